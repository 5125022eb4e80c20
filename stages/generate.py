"""Generate stage job: sample the iteration's prompts with vLLM (hpcrl.generation.GenerateStage).

    python -m stages.generate --run-dir R --iteration K
"""

from hpcrl.stage import job_main
from hpcrl.stage_kinds import GENERATE


def main(argv: list[str] | None = None) -> None:
    job_main(GENERATE, argv)


if __name__ == "__main__":
    main()
