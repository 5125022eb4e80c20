"""A long update interrupted by the pre-timeout signal saves its trainer's state and progress, is
requeued, and resumes at the next step with the result of an uninterrupted update."""

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
        from hpcrl.megatron_actor import MegatronActor

        for cls in (Actor, MegatronActor):
            step = cls.train_step

            def slow(self, *args, step=step, **kwargs):
                time.sleep(1.0)
                return step(self, *args, **kwargs)

            cls.train_step = slow
        super().__call__()


def _wait(job) -> None:
    while not job.done():
        time.sleep(0.2)
    assert job.exception() is None, job.stderr()


def test_signalled_update_saves_progress_and_resumes_to_the_same_result(write_experiment, tmp_path):
    """The resumed update commits the bytes of an uninterrupted one (the Megatron backend's:
    tests/test_megatron_update.py)."""
    path = write_experiment("pre", run={"iterations": 1, "eval_every": 0},
                            update={"mini_batches": 4, "micro_batch_size": 8, "ppo_epochs": 2})
    exp = config.load(path)
    run, _ = runs.prepare(exp, str(path))
    ex = executors.make(run, exp)
    for stage in ("generate", "score"):
        _wait(ex.submit(stage, 0).job)
    reference = RunDir.at(tmp_path / "reference")
    shutil.copytree(run.root, reference.root)
    run_signalled(run, "step 2/8")

    _wait(executors.make(reference, exp).submit("update", 0).job)
    for name in ("stats.parquet", "advantages.parquet", "policy/model.safetensors"):
        a, b = run.stage_dir(0, "update") / name, reference.stage_dir(0, "update") / name
        if name.endswith(".parquet"):
            assert pq.read_table(a).equals(pq.read_table(b)), name
        else:
            assert a.read_bytes() == b.read_bytes(), name


def run_signalled(run: RunDir, after: str) -> str:
    """The update of iteration 0 of `run` (its inputs committed), each step slowed down, signalled
    as Slurm signals before a time limit once its log shows `after`: it must save its progress, be
    requeued, resume and commit. Its log."""
    from hpcrl.distributed import free_port

    local = submitit.LocalExecutor(folder=run.logs / "%j")
    local.update_parameters(timeout_min=20,
                            tasks_per_node=executors.tasks_for(config.load(run.config_path), "update"))
    saved = os.environ.get("MASTER_PORT")
    os.environ["MASTER_PORT"] = str(free_port())  # where the ranks meet, as executors.LocalExecutor
    try:
        job = local.submit(SlowUpdate("stages.update", str(run.root), 0))
    finally:
        os.environ.pop("MASTER_PORT") if saved is None else os.environ.update(MASTER_PORT=saved)
    out = job.paths.stdout
    deadline = time.time() + 300
    while after not in (out.read_text() if out.exists() else ""):
        assert time.time() < deadline and not job.done(), job.stderr()
        time.sleep(0.2)
    os.kill(task_pid(run.logs, 0), signal.SIGUSR2)  # what Slurm sends before the time limit
    _wait(job)
    log = out.read_text()
    assert "saved progress" in log and "resuming at step" in log, log[-2000:]
    assert commit.is_committed(run.stage_dir(0, "update"))
    assert not commit.partial_dir(run.stage_dir(0, "update")).exists()
    return log

