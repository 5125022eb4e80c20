"""Executors: how a stage becomes a job. `local` runs it as its own process with submitit's
LocalExecutor. The stage is named by its module path (`stages.generate`); hpcrl never imports
stages/ itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config import Experiment
from hpcrl.rundir import RunDir


def run_stage_module(module: str, run_dir: str, iteration: int) -> None:
    """What every stage job executes: `python -m <module> --run-dir R --iteration K`, in-process."""
    importlib.import_module(module).main(["--run-dir", run_dir, "--iteration", str(iteration)])


def stage_module(stage: str) -> str:
    return f"stages.{stage}"


def tasks_for(exp: Experiment, stage: str) -> int:
    return exp.update.world_size if stage == "update" else 1


@dataclass
class StageJob:
    """A submitted stage job, whatever the executor."""

    job: object  # submitit.Job
    stage: str
    iteration: int

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def done(self) -> bool:
        return self.job.done()

    def error(self) -> BaseException | None:
        return self.job.exception()

    def cancel(self) -> None:
        self.job.cancel(check=False)

    def log_paths(self) -> tuple[Path, Path]:
        return Path(self.job.paths.stdout), Path(self.job.paths.stderr)

    def stderr_tail(self, lines: int = 20) -> str:
        _, err = self.log_paths()
        if not err.is_file():
            return "(no stderr file)"
        return "\n".join(err.read_text(errors="replace").splitlines()[-lines:])


class LocalExecutor:
    """Each stage is its own process on this machine (submitit.LocalExecutor)."""

    def __init__(self, run: RunDir, exp: Experiment):
        import submitit

        self.exp = exp
        self.run = run
        self._ex = submitit.LocalExecutor(folder=run.logs / "%j")

    def submit(self, stage: str, iteration: int) -> StageJob:
        self._ex.update_parameters(timeout_min=self.exp.executor.timeout_min,
                                   tasks_per_node=tasks_for(self.exp, stage))
        job = self._ex.submit(run_stage_module, stage_module(stage), str(self.run.root), iteration)
        return StageJob(job, stage, iteration)


def make(run: RunDir, exp: Experiment) -> LocalExecutor:
    if exp.executor.kind == "local":
        return LocalExecutor(run, exp)
    raise ValueError(f"executor.kind {exp.executor.kind!r} is not supported")
