"""Score stage: apply the configured reward sources (functions, reward model, HTTP service) to the
iteration's rollouts. A source that fails raises, and nothing is committed.

    python -m stages.score --run-dir R --iteration K
"""

from __future__ import annotations

from hpcrl import scoring
from hpcrl.stage import run_stage
from stages import cli_args


def main(argv: list[str] | None = None) -> None:
    args = cli_args("score", argv)
    run_stage("score", args.run_dir, args.iteration, scoring.score_stage)


if __name__ == "__main__":
    main()
