"""A long update interrupted by the pre-timeout signal saves its DeepSpeed state and progress,
is requeued, and resumes at the next step with the result of an uninterrupted update."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pyarrow.parquet as pq
import submitit

from hpcrl import commit, config, executors, runs
from hpcrl.rundir import RunDir
from tests.conftest import task_pid


class SlowUpdate(executors.StageCall):
    """The update stage job with each optimizer step slowed down, so a signal lands mid-update."""

    def __call__(self) -> None:
        from hpcrl.actor import Actor

        step = Actor.train_step

        def slow(self, *args, **kwargs):
            time.sleep(1.0)
            return step(self, *args, **kwargs)

        Actor.train_step = slow
        super().__call__()


def _wait(job) -> None:
    while not job.done():
        time.sleep(0.2)
    assert job.exception() is None, job.stderr()


def test_signalled_update_saves_progress_and_resumes_to_the_same_result(write_experiment, tmp_path):
    path = write_experiment("pre", run={"iterations": 1, "eval_every": 0},
                            update={"mini_batches": 4, "micro_batch_size": 8, "ppo_epochs": 2})
    exp = config.load(path)
    run, _ = runs.prepare(exp, str(path))
    ex = executors.make(run, exp)
    for stage in ("generate", "score"):
        _wait(ex.submit(stage, 0).job)
    reference = RunDir.at(tmp_path / "reference")
    shutil.copytree(run.root, reference.root)

    local = submitit.LocalExecutor(folder=run.logs / "%j")
    local.update_parameters(timeout_min=20)
    job = local.submit(SlowUpdate("stages.update", str(run.root), 0))
    out = job.paths.stdout
    deadline = time.time() + 300
    while "step 2/8" not in (out.read_text() if out.exists() else ""):
        assert time.time() < deadline and not job.done(), job.stderr()
        time.sleep(0.2)
    os.kill(task_pid(run.logs, 0), signal.SIGUSR2)  # what Slurm sends before the time limit
    _wait(job)
    log = out.read_text()
    assert "saved progress" in log and "resuming at step" in log, log[-2000:]
    assert commit.is_committed(run.stage_dir(0, "update"))
    assert not commit.partial_dir(run.stage_dir(0, "update")).exists()

    _wait(executors.make(reference, exp).submit("update", 0).job)
    for name in ("stats.parquet", "advantages.parquet", "policy/model.safetensors"):
        a, b = run.stage_dir(0, "update") / name, reference.stage_dir(0, "update") / name
        if name.endswith(".parquet"):
            assert pq.read_table(a).equals(pq.read_table(b)), name
        else:
            assert a.read_bytes() == b.read_bytes(), name
