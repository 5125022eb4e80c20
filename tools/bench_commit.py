#!/usr/bin/env python
"""What a stage commit costs: hpcrl's (`commit.commit`: every file hashed side by side, the manifest
written, then every file and folder of the temporary directory fsynced side by side, the rename, the
parent's fsync) against the same commit with one hash and one fsync after another and the manifest
written only once the data is synced, side by side in one run.

    python tools/bench_commit.py [--root DIR] [--repeats 30] [--checkpoint-files 16] [--file-mb 8]

Two outputs, each committed `repeats` times by both ways, alternately: a score stage's (one table of
the demo's 256 rows) and a checkpoint's (`checkpoint-files` files of `file-mb` MB, as a DeepSpeed
state's shards). `--root` must be on the filesystem to measure (a shared one on a cluster: Lustre
and GPFS serve fsyncs side by side from several servers). The table gives the median milliseconds
of the commit call; both ways must commit the same files with the same checksums.

A second table: what writing a table costs (`StageWriter.write_table`: zstd for the columns of at
least `commit.COMPRESS_BYTES`, none for smaller ones) against zstd for every column, for an update's
stats (2 rows), the demo's scores and rollouts (256 rows) and a large batch's rollouts (1024
samples of 512 tokens): the median thread-CPU milliseconds of the write and the file's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcrl import commit, schemas  # noqa: E402


def one_after_another(stage_dir: Path, writer: commit.StageWriter, manifest: dict) -> dict:
    """The reference: each file hashed and synced in turn, then the manifest, then the folder."""
    for path in sorted(writer.dir.rglob("*")):
        commit._fsync(path)
    files = {str(p.relative_to(writer.dir)): {"bytes": p.stat().st_size,
                                             "sha256": commit.file_digest(p).split(":", 1)[1]}
             for p in sorted(writer.dir.rglob("*")) if p.is_file()}
    full = {"schema_version": schemas.SCHEMA_VERSION, **manifest, "tables": writer.tables,
            "metrics": writer.metrics, "files": files, "committed_at": time.time()}
    with open(writer.dir / commit.MANIFEST, "w") as f:
        json.dump(full, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    commit._fsync(writer.dir)
    os.rename(writer.dir, stage_dir)
    commit._fsync(stage_dir.parent)
    return full


def scores_table(rows: int = 256) -> pa.Table:
    rng = np.random.default_rng(0)
    return pa.table({"split": ["train"] * rows,
                     "prompt_index": list(range(rows // 8)) * 8, "sample_index": [i % 8 for i in range(rows)],
                     "reward": rng.random(rows),
                     "reward_components": pa.array([[("exact", 1.0)]] * rows,
                                                   pa.map_(pa.string(), pa.float64())),
                     "reward_message": [""] * rows})


def write_output(stage_dir: Path, kind: str, files: int, file_mb: float) -> commit.StageWriter:
    writer = commit.StageWriter(commit.fresh_temp_dir(stage_dir))
    if kind == "score":
        writer.write_table("scores", scores_table())
    else:
        (writer.dir / "state").mkdir()
        payload = np.random.default_rng(0).bytes(int(file_mb * (1 << 20)))
        for i in range(files):
            (writer.dir / "state" / f"shard_{i:03d}.pt").write_bytes(payload)
    return writer


def measure(root: Path, kind: str, repeats: int, files: int, file_mb: float) -> dict[str, float]:
    ways = {"one after another": one_after_another, "hpcrl (side by side)": commit.commit}
    times: dict[str, list[float]] = {w: [] for w in ways}
    checksums: dict[str, dict] = {}
    for r in range(repeats):
        for name, way in ways.items() if r % 2 == 0 else reversed(ways.items()):
            stage_dir = root / f"iter_{r:06d}" / f"{kind}-{name.split()[0]}"
            writer = write_output(stage_dir, kind, files, file_mb)
            t0 = time.perf_counter()
            manifest = way(stage_dir, writer, {"stage": kind})
            times[name].append(time.perf_counter() - t0)
            checksums.setdefault(name, manifest["files"])
            shutil.rmtree(stage_dir)
    if len({json.dumps(c, sort_keys=True) for c in checksums.values()}) != 1:
        raise SystemExit(f"{kind}: the two ways committed different files")
    return {name: statistics.median(t) for name, t in times.items()}


def rollouts_table(samples: int, tokens: int) -> pa.Table:
    """A rollouts table of `samples` responses of `tokens` tokens (prompts of 32)."""
    rng = np.random.default_rng(0)
    ids = lambda n: pa.array(list(rng.integers(0, 32000, (samples, n))), pa.list_(pa.int64()))  # noqa: E731
    return schemas.conform("rollouts", pa.table({
        "iteration": [0] * samples, "split": ["train"] * samples,
        "prompt_index": [i // 8 for i in range(samples)], "sample_index": [i % 8 for i in range(samples)],
        "data_source": ["demo"] * samples,
        "prompt_text": [f"What is {i // 8} + 1?" for i in range(samples)], "ground_truth": ["1"] * samples,
        "prompt_ids": ids(32), "response_ids": ids(tokens),
        "logprobs": pa.array(list(-rng.random((samples, tokens))), pa.list_(pa.float64())),
        "response_text": ["x " * tokens] * samples, "finish_reason": ["length"] * samples,
        "policy_version": [0] * samples, "round": [0] * samples, "kept": [True] * samples}))


def stats_table(steps: int = 2) -> pa.Table:
    return pa.Table.from_pylist([{"step": s, "epoch": 0, "loss": 0.1 * s, "lr": 1e-5, "tokens": 100.0}
                                 for s in range(steps)], schema=schemas.UPDATE_STATS)


def measure_writes(root: Path, repeats: int) -> list[tuple[str, dict]]:
    """Thread-CPU ms and bytes of each table written both ways, alternately."""
    tables = {"stats (2 rows)": ("stats", stats_table()), "scores (256 rows)": ("scores", scores_table()),
              "rollouts (256 x 8 tokens)": ("rollouts", rollouts_table(256, 8)),
              "rollouts (1024 x 512 tokens)": ("rollouts", rollouts_table(1024, 512))}
    ways = {"zstd, every column": "zstd", "by size (hpcrl)": None}  # None: commit.compression
    rows = []
    for label, (schema, table) in tables.items():
        table = schemas.conform(schema, table)
        times: dict[str, list[float]] = {w: [] for w in ways}
        sizes = {}
        for r in range(repeats + 3):
            for name, codec in ways.items() if r % 2 == 0 else reversed(ways.items()):
                path = root / "table.parquet"
                t0 = time.thread_time()
                commit.write_parquet(table, path, codec)
                if r >= 3:  # the first writes warm up
                    times[name].append(time.thread_time() - t0)
                sizes[name] = path.stat().st_size
        rows.append((label, {name: (statistics.median(times[name]), sizes[name]) for name in ways}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="a directory on the filesystem to measure")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--checkpoint-files", type=int, default=16)
    parser.add_argument("--file-mb", type=float, default=8.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-commit-", dir=args.root) as tmp:
        rows = {kind: measure(Path(tmp), kind, args.repeats, args.checkpoint_files, args.file_mb)
                for kind in ("score", "checkpoint")}
    print(f"median ms of a commit over {args.repeats} repeats; checkpoint: {args.checkpoint_files} files "
          f"of {args.file_mb:g} MB")
    print("| output | one after another | hpcrl (side by side) | speed-up |")
    print("|---|---|---|---|")
    for kind, row in rows.items():
        old, new = row["one after another"], row["hpcrl (side by side)"]
        print(f"| {kind} | {old * 1000:.2f} | {new * 1000:.2f} | {old / new:.2f}x |")
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-write-", dir=args.root) as tmp:
        writes = measure_writes(Path(tmp), args.repeats)
    print(f"\nmedian thread-CPU ms of a table's write over {args.repeats} repeats, and its file's bytes")
    print("| table | zstd, every column | by size (hpcrl) | speed-up | bytes (every column) "
          "| bytes (by size) |")
    print("|---|---|---|---|---|---|")
    for label, row in writes:
        (old, old_b), (new, new_b) = row["zstd, every column"], row["by size (hpcrl)"]
        print(f"| {label} | {old * 1000:.2f} | {new * 1000:.2f} | {old / new:.2f}x | {old_b} | {new_b} |")


if __name__ == "__main__":
    main()
