"""The pre-timeout signal in a script submitted by hand (hpcrl.requeue): task 0 requeues the job
within executor.max_requeues, as submitit does for the jobs it submits. Real signals, a stand-in
`scontrol` that records its arguments."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import config

PROGRAM = """
import os, signal, sys, time
from hpcrl import requeue
print("installed" if requeue.install_by_hand(sys.argv[1]) else "not installed", flush=True)
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.5)
print("still running", flush=True)
"""


@pytest.fixture
def job(tmp_path):
    from tests.synthetic_run import make_run

    run = make_run(tmp_path / "byhand", iterations=1, rows=16)
    exp = config.with_overrides(config.load(run.config_path), {"executor.max_requeues": 2}, "test")
    run.config_path.write_text(config.dumps(exp))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    base["PATH"] = f"{bin_dir}:{base['PATH']}"

    def start(**env) -> tuple[subprocess.CompletedProcess, str]:
        out = subprocess.run([sys.executable, "-c", PROGRAM, str(run.root)], env={**base, **env},
                             capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])
        log = tmp_path / "scontrol.log"
        return out, log.read_text() if log.is_file() else ""

    return start


def test_task_0_requeues_its_job_within_the_budget(job):
    out, calls = job(SLURM_JOB_ID="42", SLURM_PROCID="0", SLURM_RESTART_COUNT="1")
    assert out.stdout.splitlines() == ["installed"] and out.returncode == 255
    assert calls == "requeue 42\n"
    assert "requeued (restart 2 of executor.max_requeues = 2)" in out.stderr


def test_a_spent_budget_ends_the_job_without_a_requeue(job):
    out, calls = job(SLURM_JOB_ID="42", SLURM_PROCID="0", SLURM_RESTART_COUNT="2")
    assert out.returncode == 255 and calls == ""
    assert "not requeued, 2 restarts spent" in out.stderr and "hpcrl resume" in out.stderr


def test_other_tasks_leave_the_requeue_to_task_0(job):
    out, calls = job(SLURM_JOB_ID="42", SLURM_PROCID="1")
    assert out.stdout.splitlines() == ["installed", "still running"] and calls == ""


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": "42", "SUBMITIT_EXECUTOR": "slurm"}])
def test_outside_a_hand_submitted_job_the_signal_is_left_alone(job, env):
    out, calls = job(**env)  # no Slurm job, or submitit's own handler takes the signal
    assert out.stdout.splitlines() == ["not installed"] and out.returncode == -signal.SIGUSR2 and calls == ""
