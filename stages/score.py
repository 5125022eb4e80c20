"""Score stage: apply the configured reward sources (functions, reward model, HTTP service) to the
iteration's rollouts. A source that fails raises, and nothing is committed.

    python -m stages.score --run-dir R --iteration K
"""

from __future__ import annotations

from hpcrl import commit, scoring
from hpcrl.stage import StageContext, run_stage
from stages import cli_args


def body(ctx: StageContext) -> None:
    gen = ctx.input_dir("generate")
    ctx.policy_version = commit.read_manifest(gen)["policy_version"]
    with ctx.timed("io"):
        rollouts = commit.read_table(gen, "rollouts", columns=scoring.INPUT_COLUMNS)
    with ctx.timed("load"):
        sources, weights = scoring.load_sources(ctx.exp.reward)
    with ctx.timed("compute"):
        r = ctx.exp.reward
        scores = scoring.score(rollouts, sources, weights, r.overlong_buffer, r.overlong_penalty_factor,
                               ctx.exp.generate.max_tokens)
    with ctx.timed("io"):
        ctx.writer.write_table("scores", scores)
    ctx.writer.metrics.update(scoring.metrics(rollouts, scores))


def main(argv: list[str] | None = None) -> None:
    args = cli_args("score", argv)
    run_stage("score", args.run_dir, args.iteration, body)


if __name__ == "__main__":
    main()
