#!/usr/bin/env python
"""Weight-sync throughput on this machine: the process-group path (per tensor and bucketed), the
shared-memory path and the filesystem path, against the bound of one flat-buffer broadcast of
the same bytes, for transformer-shaped fp32 weights of ~10M, ~100M and ~500M parameters.

    python tools/bench_weight_sync.py [--sizes 10M,100M,500M] [--repeats 3]

A receiver process is spawned per size; every transport is timed side by side in the same run
(median of the repeats), from the sender's first byte to the receiver holding every tensor (for
shared memory: copied out of the buffer into tensors of its own, as vLLM's load does).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time

import torch

from hpcrl.distributed import free_port
from hpcrl.weight_sync import FilesystemSync, ProcessGroupSync, SharedMemorySync, make_group

# (hidden, layers) giving about the named parameter count with a 32k vocabulary
SHAPES = {"10M": (256, 1), "100M": (768, 8), "500M": (1536, 12)}
TRANSPORTS = ("flat bound", "pg per-tensor", "pg 64MiB buckets", "shared memory", "filesystem")


def model_tensors(hidden: int, layers: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [("embed", torch.randn(32000, hidden, generator=g))]
    for i in range(layers):
        for name, shape in (("q", (hidden, hidden)), ("k", (hidden, hidden)), ("v", (hidden, hidden)),
                            ("o", (hidden, hidden)), ("gate", (4 * hidden, hidden)),
                            ("up", (4 * hidden, hidden)), ("down", (hidden, 4 * hidden)),
                            ("norm", (hidden,))):
            out.append((f"layers.{i}.{name}", torch.randn(*shape, generator=g)))
    return out


def _receiver(port: int, size: str, repeats: int, fs_dir: str, shared, done) -> None:
    pg, _store = make_group("127.0.0.1", port, 1, 2)
    dest = {n: torch.empty_like(t) for n, t in model_tensors(*SHAPES[size])}
    nbytes = sum(t.numel() * t.element_size() for t in dest.values())
    buffer = None
    for _ in range(repeats):
        path, header = shared.get(timeout=600)
        buffer = buffer if buffer is not None else SharedMemorySync.map(path, header)
        for name, view in SharedMemorySync.receive(buffer, header):
            dest[name].copy_(view)
        done.put(time.perf_counter())
        flat = torch.empty(nbytes // 4, dtype=torch.float32)
        pg.broadcast(flat, 0).wait()
        for bucket in (0, 64 << 20):
            list(ProcessGroupSync(pg, 1, bucket).receive())
        pg.barrier().wait()  # the sender has written the file
        list(FilesystemSync(fs_dir).receive())
        done.put(time.perf_counter())


def bench(size: str, repeats: int) -> dict[str, float]:
    tensors = model_tensors(*SHAPES[size])
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    ctx = mp.get_context("spawn")
    port, shared, done = free_port(), ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hpcrl-wsync-") as fs_dir:
        proc = ctx.Process(target=_receiver, args=(port, size, repeats, fs_dir, shared, done))
        proc.start()
        pg, _store = make_group("127.0.0.1", port, 0, 2)
        times: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
        flat = torch.randn(nbytes // 4)
        shm = SharedMemorySync()
        for _ in range(repeats):
            t0 = time.perf_counter()
            _, header, _ = shm.send(tensors)
            shared.put((shm.path, header))
            times["shared memory"].append(done.get(timeout=600) - t0)
            t0 = time.perf_counter()
            pg.broadcast(flat, 0).wait()
            times["flat bound"].append(time.perf_counter() - t0)
            for label, bucket in (("pg per-tensor", 0), ("pg 64MiB buckets", 64 << 20)):
                t0 = time.perf_counter()
                ProcessGroupSync(pg, 0, bucket).send(tensors)
                times[label].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            FilesystemSync(fs_dir).send(tensors)
            pg.barrier().wait()
            end = done.get(timeout=600)
            times["filesystem"].append(end - t0)
        proc.join(timeout=60)
    params = nbytes // 4
    return {"params": params, "bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M,500M")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"weight sync, fp32, 2 processes on this machine (median of {args.repeats}); "
          "GB/s and share of the bound")
    print(f"{'model':>6} {'params':>8} {'GB':>6}" + "".join(f"{t:>26}" for t in TRANSPORTS))
    for size in args.sizes.split(","):
        r = bench(size, args.repeats)
        gb = r["bytes"] / 1e9
        cells = "".join(f"{gb / r[t]:>12.2f} GB/s ({r['flat bound'] / r[t]:>5.0%})  " for t in TRANSPORTS)
        print(f"{size:>6} {r['params'] / 1e6:>7.0f}M {gb:>6.2f}{cells}")


if __name__ == "__main__":
    main()
