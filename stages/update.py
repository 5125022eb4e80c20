"""Update stage: one policy update with DeepSpeed on the iteration's scored rollouts.

    python -m stages.update --run-dir R --iteration K          (one rank)
    torchrun --nproc-per-node 2 -m stages.update --run-dir R --iteration K

Writes the next policy version (HF format), the DeepSpeed state, per-step statistics and the
per-sample advantages and logprobs it used.
"""

from __future__ import annotations

from hpcrl import distributed, preemption
from hpcrl.stage import StageContext, run_stage
from stages import cli_args


def body(ctx: StageContext) -> None:
    with ctx.timed("startup"):
        import deepspeed  # noqa: F401  (import cost is process start-up, not model loading)

        from hpcrl.actor import Actor
    with ctx.timed("load"):
        actor = Actor.for_version(ctx.exp, ctx.run, ctx.iteration, ctx.rank, ctx.world_size)
    with preemption.Guard() as guard:  # Slurm's pre-timeout signal: save progress, requeue, resume
        actor.update(ctx, guard)
    actor.save(ctx)


def main(argv: list[str] | None = None) -> None:
    args = cli_args("update", argv)
    rank, world = distributed.init()
    try:
        run_stage("update", args.run_dir, args.iteration, body, rank, world)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
