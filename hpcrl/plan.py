"""The order of a run's stages, derived from the config and the run directory alone.

Iterations 0..N-1 run generate -> score -> update; iteration N (after the last update) runs
generate -> score on the held-out set only, so the final policy is validated too.
"""

from __future__ import annotations

from hpcrl import commit
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import GENERATE, ORDER, SCORE


def validates(exp: Experiment, iteration: int) -> bool:
    """Whether the generate stage of `iteration` also samples the held-out set (greedy)."""
    if not exp.data.test:
        return False
    every = exp.run.eval_every
    return iteration == exp.run.iterations or (every > 0 and iteration % every == 0)


def trains(exp: Experiment, iteration: int) -> bool:
    return iteration < exp.run.iterations


def stages_of(exp: Experiment, iteration: int) -> tuple[str, ...]:
    if trains(exp, iteration):
        return ORDER
    return (GENERATE, SCORE) if validates(exp, iteration) else ()


def all_stages(exp: Experiment) -> list[tuple[int, str]]:
    return [(k, s) for k in range(exp.run.iterations + 1) for s in stages_of(exp, k)]


def pending_stages(run: RunDir, exp: Experiment) -> list[tuple[int, str]]:
    """The stages not committed yet, in run order."""
    return [(k, s) for k, s in all_stages(exp) if not commit.is_committed(run.stage_dir(k, s))]


def next_stage(run: RunDir, exp: Experiment) -> tuple[int, str] | None:
    """The first stage, in run order, that is not committed; None when the run is complete."""
    pending = pending_stages(run, exp)
    return pending[0] if pending else None
