#!/usr/bin/env python
"""Several vLLM engines against one, side by side in one run (generate.engines):

- generation throughput: one engine sampling an iteration's whole batch on one core, against two
  engines, each pinned to a core of its own, each sampling its shard (every 2nd request,
  hpcrl.shards.take) at the same time; tokens per second over the slower engine's wall time;
- weight fan-out: one sender's weights reaching every engine's receiver (each copying the tensors
  into its own, as vLLM's load does), to 1 and to 2 receivers: shared memory (one buffer that
  every engine on the node maps) and the process group (one gloo broadcast to all).

    python tools/bench_engines.py [--model demo|100m] [--prompts 32] [--repeats 3] [--size 100M]

The engines start once (the start-up is not timed) and sample the same requests in every repeat
(prefix cache reset); the table shows the medians and their ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def experiment(model: str, prompts: int):
    from hpcrl import config

    exp = config.load(REPO / "configs" / "demo.toml")
    overrides = {**_tool("bench_resident").model_overrides(model), "algorithm.prompts_per_iteration": prompts}
    return config.with_overrides(exp, overrides, "bench")


def _engine(core: int, model: str, prompts: int, shard: tuple[int, int], conn) -> None:
    """One engine on `core`: samples its shard of iteration 0's requests each time it is told to."""
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    from hpcrl import commit, generation, shards

    exp = experiment(model, prompts)
    llm = generation.make_engine(exp, commit.verified(Path(exp.model.path)), exp.run.seed)
    requests = shards.take(generation.train_requests(exp, 0, llm.get_tokenizer()), *shard)
    a, g = exp.algorithm, exp.generate
    conn.send("ready")
    while conn.recv() == "go":
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        table = generation.sample(llm, list(requests), a.group_size, g.temperature, g.top_p, g.max_tokens,
                                  exp.run.seed, 0, 0)
        conn.send((sum(len(r) for r in table["response_ids"].to_pylist()), t0, time.perf_counter()))


def throughput(model: str, prompts: int, repeats: int) -> dict[int, list[float]]:
    """Tokens per second of 1 and of 2 engines, per repeat (alternating)."""
    ctx = mp.get_context("spawn")
    setups = {1: [(0, (0, 1))], 2: [(0, (0, 2)), (1, (1, 2))]}
    conns: dict[int, list] = {}
    procs = []
    for n, engines in setups.items():
        for core, shard in engines:
            mine, theirs = ctx.Pipe()
            procs.append(ctx.Process(target=_engine, args=(core, model, prompts, shard, theirs)))
            procs[-1].start()
            conns.setdefault(n, []).append(mine)
    for c in (c for cs in conns.values() for c in cs):
        assert c.recv() == "ready"
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats):
        for n, cs in conns.items():
            for c in cs:
                c.send("go")
            results = [c.recv() for c in cs]
            tokens = sum(r[0] for r in results)
            rates[n].append(tokens / (max(r[2] for r in results) - min(r[1] for r in results)))
    for c in (c for cs in conns.values() for c in cs):
        c.send("stop")
    for p in procs:
        p.join(timeout=60)
    return rates


def _receiver(rank: int, world: int, port: int, size: str, transport: str, inbox, done) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    from hpcrl.weight_sync import ProcessGroupSync, SharedMemorySync, make_group

    tensors = dict(_tool("bench_weight_sync").model_tensors(*_tool("bench_weight_sync").SHAPES[size]))
    dest = {n: t.clone() for n, t in tensors.items()}
    pg = make_group("127.0.0.1", port, rank, world)[0] if transport == "process group" else None
    buffer = None
    while (msg := inbox.get()) != "stop":
        if pg is not None:
            received = ProcessGroupSync(pg, rank, 64 << 20).receive()
        else:
            buffer = buffer if buffer is not None else SharedMemorySync.map(*msg)
            received = SharedMemorySync.receive(buffer, msg[1])
        for name, t in received:
            dest[name].copy_(t)
        done.put(time.perf_counter())


def fanout(size: str, transport: str, receivers: int, repeats: int) -> list[float]:
    """Seconds from the send's start to the last receiver holding every tensor, per repeat."""
    from hpcrl.distributed import free_port
    from hpcrl.weight_sync import ProcessGroupSync, SharedMemorySync, make_group

    ctx = mp.get_context("spawn")
    port, done = free_port(), ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(receivers)]
    procs = [ctx.Process(target=_receiver,
                         args=(r + 1, receivers + 1, port, size, transport, inboxes[r], done))
             for r in range(receivers)]
    for p in procs:
        p.start()
    tensors = _tool("bench_weight_sync").model_tensors(*_tool("bench_weight_sync").SHAPES[size])
    pg = make_group("127.0.0.1", port, 0, receivers + 1)[0] if transport == "process group" else None
    shm = SharedMemorySync() if pg is None else None
    times = []
    for _ in range(repeats + 1):  # the first maps the buffer or warms the group up: not counted
        t0 = time.perf_counter()
        if pg is not None:
            for box in inboxes:
                box.put("receive")
            ProcessGroupSync(pg, 0, 64 << 20).send(tensors)
        else:
            _, header, _ = shm.send(tensors)
            for box in inboxes:
                box.put((shm.path, header))
        times.append(max(done.get(timeout=600) for _ in range(receivers)) - t0)
    for box in inboxes:
        box.put("stop")
    for p in procs:
        p.join(timeout=60)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo or 100m (tools/bench_resident.py)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts in the batch (x group_size samples)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", default="100M", help="weights to fan out: 10M, 100M or 500M")
    args = parser.parse_args()
    rates = throughput(args.model, args.prompts, args.repeats)
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"generation, {args.model} model, {args.prompts} prompts, each engine on a core of its own "
          f"(median of {args.repeats})")
    print(f"{'engines':>8} {'tokens/s':>10} {'vs 1':>6}")
    print(f"{1:>8} {one:>10.0f} {1.0:>5.2f}x\n{2:>8} {two:>10.0f} {two / one:>5.2f}x")
    print(f"\nweight fan-out, {args.size} fp32 parameters, send start to the last engine loaded "
          f"(median of {args.repeats})")
    print(f"{'transport':>14} {'1 engine':>10} {'2 engines':>10} {'2 vs 1':>7}")
    for transport in ("shared memory", "process group"):
        t1, t2 = (statistics.median(fanout(args.size, transport, n, args.repeats)) for n in (1, 2))
        print(f"{transport:>14} {t1:>9.3f}s {t2:>9.3f}s {t2 / t1:>6.2f}x")


if __name__ == "__main__":
    main()
