"""Which policy version a generation samples with, and the checks that the engine holds it.

The update of iteration v - 1 makes policy version v (version 0 is the base model); the generate
stage of iteration k samples with hpcrl.plan.policy_version's (k - algorithm.max_staleness, at
least 0). A generation with version v > 0 names that update as its input, which must be committed
before the generation commits: at once in the staged mode, and in the resident mode, where the
trainers may still be committing it while the generation samples, by the time it has sampled
(`await_policy`). The resident generator loads versions in order, only between two generations,
so no generation mixes versions (`hold`); a merged generation's shards must agree on theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sized

from hpcrl import commit, plan
from hpcrl.stage_kinds import GENERATE, UPDATE


def check_generate(ctx, version: int, committed: bool) -> None:
    """The engine must hold the version iteration k samples with (hpcrl.plan.policy_version);
    `committed`: the update that made it must be committed already."""
    needed = plan.policy_version(ctx.exp, ctx.iteration)
    if version != needed:
        raise RuntimeError(f"generate of iteration {ctx.iteration} needs policy version {needed} "
                           f"(algorithm.max_staleness = {ctx.exp.algorithm.max_staleness}), the engine "
                           f"holds {version}")
    if version > 0 and committed:
        ctx.input_dir(UPDATE, version - 1)


def await_update(ctx, version: int, await_policy: Callable[[], None] | None) -> None:
    """After sampling with `version`: the update that made it, when it was not committed at the
    start (`await_policy` given), awaited (timed as "wait") and named as the stage's input."""
    if version > 0 and await_policy is not None:
        with ctx.timed("wait"):
            await_policy()
        ctx.input_dir(UPDATE, version - 1)


def shards_version(ctx) -> int:
    """The one policy version the shards of a merged generation (their manifests, ctx.parts)
    sampled with."""
    found = {m["policy_version"] for m in ctx.parts}
    if len(found) != 1:
        raise commit.CorruptOutputError(f"the shards of {ctx.run.stage_dir(ctx.iteration, GENERATE)} sampled "
                                        f"with different policy versions {sorted(found)}")
    return found.pop()


def hold(version: int, base: int, held: Callable[[], int | None], inflight: Sized,
         load_saved: Callable[[int], None], finish_update: Callable[[], None]) -> None:
    """The resident engine made to hold `version` (`held()` says which it holds): a saved version
    up to `base` (what the trainers started from) is loaded from the run directory, a later one
    by finishing the updates in flight, oldest first, until it is loaded; raises when none makes it."""
    if version <= base:  # a resumed run's first generations: saved versions, from disk
        load_saved(version)
    while held() < version and inflight:
        finish_update()
    if held() != version:
        raise RuntimeError(f"the generation needs policy version {version}; the engine holds "
                           f"{held()} and no update in flight makes it")


def made_by(version: int, uncommitted: Collection[int]) -> int | None:
    """The update that made `version` when it is not committed yet (the generation waits for it)."""
    return version - 1 if version - 1 in uncommitted else None


def awaiting(update: int | None, wait: Callable[[int], None]) -> Callable[[], None] | None:
    """A generation's `await_policy`: waits for `update` to be committed; None when there is none."""
    return (lambda: wait(update)) if update is not None else None


def check_engine(index: int, held: int | None, version: int, iteration: int) -> None:
    """Engine `index` must hold the version the leader sampled the generation of `iteration` with."""
    if held != version:
        raise RuntimeError(f"engine {index} holds policy version {held}; the generation "
                           f"of iteration {iteration} needs {version}")
