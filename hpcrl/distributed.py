"""torch.distributed set-up for multi-rank stages, whoever launched them.

torchrun or the deepspeed launcher set RANK/WORLD_SIZE; a submitit job (local or Slurm) knows its
tasks; a plain `python -m stages.update` is one rank. The backend follows the device: NCCL on
GPUs, gloo on CPU.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from hpcrl.jit_ops import import_deepspeed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_store(host: str, port: int, world_size: int | None, is_master: bool, timeout_s: float,
              wait_for_workers: bool = True):
    """A torch TCPStore whose server (is_master) listens on `host`'s address only: the address the
    job's other tasks connect to, not every interface of the node (TCPStore alone binds them all)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout,
                             wait_for_workers=wait_for_workers)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    # the store owns the descriptor from here (detach: Python's socket object will not close it)
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=wait_for_workers,
                         master_listen_fd=listener.detach())


def export_env() -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT if no launcher did."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    import submitit

    try:
        env = submitit.helpers.TorchDistributedEnvironment()  # MASTER_PORT from the environment if set
    except RuntimeError:  # not inside a submitit job
        env = None
    if env is None and "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        _export_from_srun()  # a task of `srun` in a script submitted by hand
        return
    if env is not None:
        os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port), RANK=str(env.rank),
                          WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                          LOCAL_WORLD_SIZE=str(env.local_world_size))
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def _export_from_srun() -> None:
    # submitit's parser of Slurm's host lists ("n[1-3,5]"): no `scontrol`, which a container lacks
    from submitit.slurm.slurm import _parse_node_list

    first = _parse_node_list(os.environ["SLURM_STEP_NODELIST"])[0]
    tasks, nodes = int(os.environ["SLURM_STEP_NUM_TASKS"]), int(os.environ.get("SLURM_STEP_NUM_NODES", "1"))
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=str(tasks),
                      LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"), LOCAL_WORLD_SIZE=str(tasks // nodes),
                      MASTER_ADDR=first, MASTER_PORT=str(20000 + int(os.environ["SLURM_JOB_ID"]) % 40000))


def default_backend(cuda: bool) -> str:
    """The backend of the trainers' default group: on GPUs, CUDA tensors over NCCL and CPU tensors
    over gloo (the update all-reduces statistics and the preemption flag as CPU tensors, which an
    NCCL-only group refuses: "No backend type associated with device type cpu"); gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def usable_cores() -> int:
    """The cores this process may run on: its affinity (Slurm's cgroup, taskset), not the node's
    count, which os.cpu_count() gives and which oversubscribes a job holding part of a node."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_threads(local_world: int) -> int:
    """Torch's threads for one of the `local_world` ranks on this node: a Slurm task's cpus per task
    (whether Slurm bound it to them or to the job's cores), else the cores this process may use,
    shared among the node's ranks (the local executor's ranks share its cores)."""
    cores = usable_cores()
    per_task = os.environ.get("SLURM_CPUS_PER_TASK")
    if per_task and "SUBMITIT_LOCAL_JOB_ID" not in os.environ:
        return max(1, min(int(per_task), cores))
    return max(1, cores // local_world)


def init(timeout_s: float = 1800) -> tuple[int, int]:
    """Initialise the default process group; returns (rank, world_size)."""
    import torch

    export_env()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(rank_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    import_deepspeed().init_distributed(dist_backend=default_backend(cuda), verbose=False,
                                        timeout=timedelta(seconds=timeout_s))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def shutdown(barrier: bool = True) -> None:
    """Leave the process group, after every rank has reached this point (`barrier`)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
