"""Saving a long update's progress on Slurm's pre-timeout / preemption signal, and resuming it.

Slurm signals a job (USR2, `--signal` set by submitit) some time before its time limit or when
it is preempted. submitit's own handler would requeue at once, losing the update's work so far.
During an update stage, `Guard` takes the signal instead: it only records it. Between optimizer
steps the update asks `guard.should_stop()` (all ranks agree, so they stop at the same step),
saves the trainer's state (DeepSpeed's or Megatron's) and its progress into the stage's partial
directory, and hands the signal back to submitit, which requeues the job. The requeued update
loads the partial state and goes on from the next step, with the same result as an uninterrupted
one. The partial directory is not a committed output: the stage commit removes it.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.commit import partial_dir

PROGRESS = "progress.pt"


# USR2: Slurm's warning before the time limit (--signal); TERM: preemption (or scancel), some
# seconds (the partition's GraceTime) before the job is killed.
SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class Guard:
    """Within `with Guard():`, the pre-timeout and preemption signals are recorded instead of
    acted on."""

    def __init__(self, signums: tuple[int, ...] = SIGNALS):
        self.signums, self.requested, self.caught, self._previous = signums, False, None, {}

    def __enter__(self) -> Guard:
        self._previous = {s: signal.signal(s, self._record) for s in self.signums}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _record(self, signum, frame) -> None:
        print(f"[update] caught signal {signal.Signals(signum).name}: saving progress at the next step",
              flush=True)
        self.requested, self.caught = True, self.caught or signum

    def should_stop(self) -> bool:
        flag = torch.tensor([float(self.requested)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def hand_over(self) -> None:
        """End this process after the progress is saved. Before a time limit (USR2, here or on
        another rank) the signal's own handler requeues the job on task 0: submitit's, or
        hpcrl.requeue's in a script submitted by hand; on other tasks it returns, and they exit 0 (a
        bad exit would let srun --kill-on-bad-exit kill task 0 before its requeue). On preemption
        (TERM) nothing is requeued here: Slurm requeues a preempted job itself (PreemptMode=REQUEUE),
        and a cancelled one is meant to stop; either way the saved progress is there to resume."""
        if dist.is_initialized():
            dist.barrier()
        self.__exit__()
        previous = self._previous.get(signal.SIGUSR2)
        if self.caught != signal.SIGTERM and callable(previous):
            previous(signal.SIGUSR2, None)  # task 0: checkpoint, requeue and exit
        raise SystemExit(0 if int(os.environ.get("SLURM_PROCID") or 0) else -1)


def save_progress(actor, stage_dir: Path, rank: int, progress: object) -> Path:
    """The trainer's state (every rank: `actor.save_progress`, its engines' or Megatron's) and the
    progress record (rank 0: an hpcrl.update.UpdateState) into the partial directory."""
    final = partial_dir(stage_dir)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    actor.save_progress(tmp)
    if rank == 0:
        torch.save(progress, tmp / PROGRESS)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_progress(actor, stage_dir: Path, types: tuple[type, ...]) -> object | None:
    """The saved progress of an interrupted update (the trainer's state restored:
    `actor.load_progress`), or None.

    Only tensors, containers and the record classes `types` unpickle (torch's weights_only load)."""
    d = partial_dir(stage_dir)
    if not (d / PROGRESS).is_file():
        return None
    actor.load_progress(d)
    with torch.serialization.safe_globals(list(types)):
        return torch.load(d / PROGRESS, weights_only=True)
