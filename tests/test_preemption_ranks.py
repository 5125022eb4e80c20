"""The ranks of an update agree to stop: the preemption signal reaches one rank (Slurm signals the
batch step, whose task may be any rank), and every rank stops at the same optimizer step."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from hpcrl.distributed import free_port

WORLD = 2


def _rank(rank: int, port: int, signalled_rank: int | None, signal_at: int, out,
          signum: int = signal.SIGUSR2) -> None:
    import torch.distributed as dist

    from hpcrl.preemption import Guard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        stopped_at = None
        with Guard() as guard:
            for step in range(6):
                if rank == signalled_rank and step == signal_at:
                    os.kill(os.getpid(), signum)  # USR2 before the time limit, TERM on preemption
                if guard.should_stop():
                    stopped_at = step
                    break
        out.put((rank, stopped_at, guard.requested))
    finally:
        dist.destroy_process_group()


def _run(signalled_rank: int | None, signal_at: int = 2,
         signum: int = signal.SIGUSR2) -> dict[int, tuple[int | None, bool]]:
    ctx = mp.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, signalled_rank, signal_at, out, signum))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return {rank: (stopped_at, requested) for rank, stopped_at, requested in results}


@pytest.mark.parametrize("signalled_rank, signum", [(0, signal.SIGUSR2), (1, signal.SIGUSR2),
                                                    (1, signal.SIGTERM)])
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(signalled_rank, signum):
    """Pins: the ranks' agreement dropped (each rank reads only its own flag, so the signalled
    rank saves while the other waits in the next collective) or reduced with MIN (nobody stops);
    preemption's TERM not taken (the update would die without saving)."""
    got = _run(signalled_rank, signal_at=2, signum=signum)
    assert {rank: stopped for rank, (stopped, _) in got.items()} == {0: 2, 1: 2}
    assert ({rank: requested for rank, (_, requested) in got.items()}
            == {r: r == signalled_rank for r in range(WORLD)})


def test_without_a_signal_no_rank_stops():
    assert _run(None) == {0: (None, False), 1: (None, False)}
