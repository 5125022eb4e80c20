"""The pipeline controller: runs the first uncommitted stage until the run is complete.

It decides from the run directory alone (hpcrl.plan), so it can be killed at any point and a new
controller continues; it holds the run lock, submits each stage through the executor, shows
progress, retries failed stages, and feeds MLflow from the committed manifests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from hpcrl import commit, executors, plan
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir, RunLock
from hpcrl.tracking import Tracker, stage_metrics

SHORT = {"generate": "gen", "score": "score", "update": "update"}


class StageFailedError(RuntimeError):
    pass


def iteration_line(exp: Experiment, run: RunDir, k: int) -> str:
    """One line per iteration: reward, validation score, KL, stage times."""
    manifests = {s: commit.read_manifest(run.stage_dir(k, s)) for s in plan.stages_of(exp, k)}
    metrics = {key: v for m in manifests.values() if m for key, v in m["metrics"].items()}
    kl_key = "actor/kl_loss" if exp.algorithm.kl_coef > 0 else "actor/ppo_kl"
    parts = [f"iter {k:>4}/{exp.run.iterations}"]
    for label, key, fmt in (("reward", "critic/score/mean", ".3f"), ("val", "val/score", ".3f"),
                            ("kl", kl_key, ".2e"), ("len", "response_length/mean", ".1f")):
        parts.append(f"{label} {format(metrics[key], fmt)}" if key in metrics else f"{label} -")
    times = "  ".join(f"{SHORT[s]} {m['timings']['total']:.1f}s" for s, m in manifests.items() if m)
    return "  ".join(parts) + "  | " + times


def summary(exp: Experiment, run: RunDir) -> str:
    """How the reward and the validation score moved over the run."""
    def series(key: str) -> list[float]:
        values = []
        for k, s in plan.all_stages(exp):
            m = commit.read_manifest(run.stage_dir(k, s)) if s == "score" else None
            if m and key in m["metrics"]:
                values.append(m["metrics"][key])
        return values

    reward, val = series("critic/score/mean"), series("val/score")
    parts = []
    if reward:
        last = reward[-3:]
        parts.append(f"reward {reward[0]:.3f} (first iteration) -> {sum(last) / len(last):.3f} (mean of last {len(last)})")
    if val:
        parts.append(f"val/score {val[0]:.3f} -> {val[-1]:.3f}")
    return "; ".join(parts)


def _wait(job: executors.StageJob, show_progress: bool) -> None:
    """Block until the job ends, with a progress indicator when a person is watching."""
    from tqdm import tqdm

    desc = f"iter {job.iteration} {job.stage} (job {job.job_id})"
    with tqdm(desc=desc, bar_format="{desc}: {elapsed}", disable=not show_progress, leave=False,
              file=sys.stderr) as bar:
        while not job.done():
            time.sleep(0.2)
            bar.refresh()


class Controller:
    def __init__(self, run: RunDir, exp: Experiment, echo: Callable[[str], None] = print,
                 show_progress: bool | None = None):
        self.run, self.exp, self.echo = run, exp, echo
        self.show_progress = sys.stderr.isatty() if show_progress is None else show_progress

    def run_all(self) -> None:
        with RunLock(self.run):
            tracker = Tracker(self.run, self.exp)
            executor = executors.make(self.run, self.exp)
            status = "FAILED"
            try:
                while (nxt := plan.next_stage(self.run, self.exp)) is not None:
                    self._run_stage(executor, *nxt)
                    self._after_commit(tracker, *nxt)
                status = "FINISHED"
            except KeyboardInterrupt:
                status = "KILLED"
                raise
            finally:
                tracker.finish(status)

    def _run_stage(self, executor, k: int, stage: str) -> None:
        attempts = self.exp.executor.max_retries + 1
        for attempt in range(1, attempts + 1):
            job = executor.submit(stage, k)
            try:
                _wait(job, self.show_progress)
            except KeyboardInterrupt:
                job.cancel()
                raise
            error = job.error()
            if error is None and commit.is_committed(self.run.stage_dir(k, stage)):
                return
            out, err = job.log_paths()
            msg = (f"stage {stage} of iteration {k} failed (job {job.job_id}, attempt {attempt}/{attempts}); "
                   f"log: {err}\n--- last lines of stderr ---\n{job.stderr_tail()}")
            if attempt == attempts:
                raise StageFailedError(msg)
            self.echo(msg + "\nretrying")

    def _after_commit(self, tracker: Tracker, k: int, stage: str) -> None:
        manifest = commit.read_manifest(self.run.stage_dir(k, stage))
        tracker.log_metrics(stage_metrics(stage, manifest), step=k)
        if stage == "update":
            self.run.publish_policy(k + 1)
        if stage == "score":
            tracker.log_table(sample_rows(self.run, k), f"samples/iter_{k:06d}.json")
        if stage == plan.stages_of(self.exp, k)[-1]:
            self.echo(iteration_line(self.exp, self.run, k))


def sample_rows(run: RunDir, k: int, limit: int = 16) -> list[dict]:
    """A few scored generations of an iteration, for a look in the MLflow UI."""
    rollouts = commit.read_table(run.stage_dir(k, "generate"), "rollouts",
                                 columns=["split", "prompt_index", "sample_index", "prompt_text", "response_text"])
    scores = commit.read_table(run.stage_dir(k, "score"), "scores", columns=["reward"])
    rows = rollouts.append_column("reward", scores["reward"]).slice(0, limit).to_pylist()
    return rows
