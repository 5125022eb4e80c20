"""Score stage job: the reward sources over the iteration's rollouts (hpcrl.scoring.ScoreStage).

    python -m stages.score --run-dir R --iteration K
"""

from hpcrl.stage import job_main
from hpcrl.stage_kinds import SCORE


def main(argv: list[str] | None = None) -> None:
    job_main(SCORE, argv)


if __name__ == "__main__":
    main()
