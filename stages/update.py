"""Update stage job: one policy update with DeepSpeed (hpcrl.update.UpdateStage).

    python -m stages.update --run-dir R --iteration K   (or torchrun --nproc-per-node N -m ...)
"""

from hpcrl.stage import job_main
from hpcrl.stage_kinds import UPDATE


def main(argv: list[str] | None = None) -> None:
    job_main(UPDATE, argv)


if __name__ == "__main__":
    main()
