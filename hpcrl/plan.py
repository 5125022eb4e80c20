"""The order of a run's stages, derived from the config and the run directory alone.

Iterations 0..N-1 run generate -> score -> update; iteration N (after the last update) runs
generate -> score on the held-out set only, so the final policy is validated too.
"""

from __future__ import annotations

from hpcrl import commit, stage_kinds
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


def policy_version(exp: Experiment, iteration: int) -> int:
    """The policy version the generate stage of `iteration` samples with: max(0, k - s) for a
    training iteration (s = algorithm.max_staleness, 0 in lock-step), so that generation of the
    next s iterations can overlap the update; the final, validation-only iteration samples the
    final policy."""
    if not trains(exp, iteration):
        return iteration
    return max(0, iteration - exp.algorithm.max_staleness)


def inputs(exp: Experiment, iteration: int, stage: str) -> list[tuple[int, str]]:
    """The (iteration, stage) outputs the stage of `iteration` reads, committed before it runs."""
    return stage_kinds.kind(stage).inputs(iteration, policy_version(exp, iteration))


def stages_of(exp: Experiment, iteration: int) -> tuple[str, ...]:
    if trains(exp, iteration):
        return ORDER
    return (GENERATE, SCORE) if validates(exp, iteration) else ()


def all_stages(exp: Experiment) -> list[tuple[int, str]]:
    return [(k, s) for k in range(exp.run.iterations + 1) for s in stages_of(exp, k)]


class Progress:
    """Which of a run's stages are committed, as one process driving the run sees them.

    A committed stage stays committed while a run is driven (only `rollback`, before a start,
    moves stages aside: look again with a new Progress), so each look checks only the stages it
    has not seen committed, and only in the iteration directories that exist: a look costs a
    directory listing and a few stats, however long the run.
    """

    def __init__(self, run: RunDir, exp: Experiment):
        self.run, self.stages = run, all_stages(exp)
        self.committed: set[tuple[int, str]] = set()

    def pending(self) -> list[tuple[int, str]]:
        """The stages not committed yet, in run order."""
        present = set(self.run.iterations_present())
        out = []
        for k, s in self.stages:
            if (k, s) in self.committed:
                continue
            if k in present and commit.is_committed(self.run.stage_dir(k, s)):
                self.committed.add((k, s))
            else:
                out.append((k, s))
        return out


def pending_stages(run: RunDir, exp: Experiment) -> list[tuple[int, str]]:
    """The stages not committed yet, in run order."""
    return Progress(run, exp).pending()


def next_stage(run: RunDir, exp: Experiment) -> tuple[int, str] | None:
    """The first stage, in run order, that is not committed; None when the run is complete."""
    pending = pending_stages(run, exp)
    return pending[0] if pending else None


def resume_version(run: RunDir, exp: Experiment) -> int:
    """The policy version a run continues from: the latest saved one from which every stage it
    still has to run can run. With staleness s, the generate stages of iterations v..v+s-1 sample
    with versions below v: each must be committed already, or its version saved."""
    saved = sorted((k + 1 for k in run.iterations_present() if run.has_policy(k + 1)), reverse=True)
    for v in saved:
        early = range(v, min(v + exp.algorithm.max_staleness, exp.run.iterations))
        if all(commit.is_committed(run.stage_dir(k, GENERATE)) or run.has_policy(policy_version(exp, k))
               for k in early):
            return v
    return 0  # the base model: the generations before the first update sample with it


def rollback(run: RunDir, exp: Experiment) -> list:
    """Move aside what the run cannot continue from (hpcrl.rundir.RunDir.rollback): the stages
    after `resume_version`, but for the generations that sampled with a version up to it."""
    return run.rollback(resume_version(run, exp), lambda k: policy_version(exp, k))
