#!/usr/bin/env python
"""Kill a run at random moments, resume it each time, and check that it ends where an uninterrupted
run of the same config ends: the same update statistics every iteration and the same final policy,
bit for bit. Retention is on (keep_last = 2, keep_trainer_states = 1), so a resume often starts
from the one trainer state retention left.

    python tools/chaos_resume.py [--kills 4] [--seed 0] [--iterations 3] [--mode staged|resident]
                                 [--staleness 0] [--checkpoint-every 1]

The kills are SIGKILLs of the whole process group of `hpcrl submit` / `hpcrl resume` (controller
and stage jobs), each after a delay drawn uniformly from [--min-delay, --max-delay] seconds of the
current attempt. The table names what was in flight at each kill (the stages whose output was
being written).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import experiment_toml  # noqa: E402 - the tests' small experiment

TINY = REPO / ".cache" / "tiny-addition"


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpcrl.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _in_flight(run: Path) -> str:
    open_ = sorted(f"{p.parent.name.removeprefix('iter_').lstrip('0') or '0'}:{p.name[1:-4]}"
                   for p in run.glob("iter_*/.*.tmp"))
    return ", ".join(open_) or "between stages"


def _config(root: Path, name: str, args: argparse.Namespace) -> Path:
    sections = {"run": {"iterations": args.iterations, "eval_every": 0,
                        "retention": {"keep_last": 2, "keep_trainer_states": 1}},
                "algorithm": {"group_size": 4, "prompts_per_iteration": 8, "max_staleness": args.staleness},
                "data": {"test": ""}, "tracking": {"enabled": False}}
    if args.mode == "resident":
        sections["executor"] = {"mode": "resident", "resident": {"checkpoint_every": args.checkpoint_every}}
    path = root / f"{name}.toml"
    path.write_text(experiment_toml(TINY, root / "runs", name, **sections))
    return path


def chaos(path: Path, run: Path, kills: int, rng: random.Random, delays: tuple[float, float]) -> list[str]:
    """Submit, then kill and resume `kills` times; returns what was in flight at each kill."""
    proc, moments = _start("submit", str(path)), []
    for _ in range(kills):
        deadline = time.monotonic() + rng.uniform(*delays)
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        if proc.poll() is not None:
            break  # the run finished before this kill
        moments.append(_in_flight(run))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc = _start("resume", str(run))
    if proc.wait() != 0:
        raise SystemExit(f"the last resume of {run} failed (exit {proc.returncode})")
    return moments


def same_ending(a: Path, b: Path, iterations: int) -> list[str]:
    differences = [f"update statistics of iteration {k}" for k in range(iterations)
                   if not pq.read_table(a / f"iter_{k:06d}/update/stats.parquet").equals(
                       pq.read_table(b / f"iter_{k:06d}/update/stats.parquet"))]
    wa = load_file(a / f"policy/v{iterations:06d}/model.safetensors")
    wb = load_file(b / f"policy/v{iterations:06d}/model.safetensors")
    if wa.keys() != wb.keys() or not all(torch.equal(wa[n], wb[n]) for n in wa):
        differences.append("final policy")
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--mode", choices=["staged", "resident"], default="staged")
    parser.add_argument("--min-delay", type=float, default=5.0)
    parser.add_argument("--max-delay", type=float, default=60.0)
    parser.add_argument("--staleness", type=int, default=0, help="algorithm.max_staleness")
    parser.add_argument("--checkpoint-every", type=int, default=1,
                        help="executor.resident.checkpoint_every (resident mode)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="hpcrl-chaos-") as tmp:
        root = Path(tmp)
        reference = _config(root, "reference", args)
        if _start("submit", str(reference)).wait() != 0:
            raise SystemExit("the uninterrupted run failed")
        killed = _config(root, "killed", args)
        moments = chaos(killed, root / "runs" / "killed", args.kills, rng, (args.min_delay, args.max_delay))
        differences = same_ending(root / "runs" / "reference", root / "runs" / "killed", args.iterations)
    print(f"| kill | in flight |  ({args.mode}, {args.iterations} iterations, max_staleness "
          f"{args.staleness}, seed {args.seed})")
    print("|---|---|")
    for i, moment in enumerate(moments, 1):
        print(f"| {i} | {moment} |")
    print("same update statistics and final policy as the uninterrupted run" if not differences
          else f"DIFFERENT: {', '.join(differences)}")
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()
