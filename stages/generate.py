"""Generate stage: sample the iteration's prompts with vLLM from the current policy version.

    python -m stages.generate --run-dir R --iteration K
"""

from __future__ import annotations

from hpcrl import generation
from hpcrl.stage import StageContext, run_stage
from stages import cli_args


def body(ctx: StageContext) -> None:
    version = ctx.iteration  # iteration k samples from the policy after k updates
    with ctx.timed("startup"):
        generation.configure_env(ctx.exp)
        import vllm  # noqa: F401  (import cost is process start-up, not model loading)
    with ctx.timed("load"):
        llm = generation.make_engine(ctx.exp, ctx.run.policy_dir(version, ctx.exp.model.path), ctx.seed)
    generation.generate(ctx, llm, version)


def main(argv: list[str] | None = None) -> None:
    args = cli_args("generate", argv)
    run_stage("generate", args.run_dir, args.iteration, body)


if __name__ == "__main__":
    main()
