"""The pre-timeout signal in a job submitted by hand (a script `hpcrl sbatch` rendered).

Slurm signals every job step USR2 `executor.signal_delay_s` before the time limit (`--signal`, in
every script). A job submitit submitted has submitit's handler: task 0 requeues the job, within
its budget of time-outs. A script submitted by hand runs hpcrl directly, so this module does the
same there: task 0 runs `scontrol requeue` while SLURM_RESTART_COUNT is below
`executor.max_requeues`, then exits; the other tasks wait for the requeue (an early exit of theirs
would let `srun --kill-on-bad-exit` kill task 0 first). The requeued job starts over from the run
directory: committed stages are never redone, and an update resumes from the progress it saved
(hpcrl.preemption). SLURM_RESTART_COUNT counts preemptions too, which submitit does not.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys


def install_by_hand(run_dir: str) -> bool:
    """Take USR2 as submitit would, in a Slurm job of the run at `run_dir` that submitit did not
    submit (the budget from its frozen config); whether it did."""
    if os.environ.get("SUBMITIT_EXECUTOR") or not os.environ.get("SLURM_JOB_ID"):
        return False
    from hpcrl import runs

    _, exp = runs.open_run(run_dir)
    signal.signal(signal.SIGUSR2, functools.partial(requeue, exp.executor.max_requeues))
    return True


def requeue(max_requeues: int, signum: int, frame=None) -> None:
    """Task 0: requeue this job if its budget allows, and exit. Other tasks: nothing."""
    if int(os.environ.get("SLURM_PROCID") or 0) != 0:
        return
    job = os.environ["SLURM_JOB_ID"]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    name = signal.Signals(signum).name
    if restarts < max_requeues:
        print(f"[hpcrl] job {job}: {name} before the time limit: requeued (restart {restarts + 1} of "
              f"executor.max_requeues = {max_requeues})", file=sys.stderr, flush=True)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
    else:
        print(f"[hpcrl] job {job}: {name} before the time limit: not requeued, {restarts} restarts spent "
              f"(executor.max_requeues = {max_requeues}); `hpcrl resume` continues the run",
              file=sys.stderr, flush=True)
    sys.exit(-1)
