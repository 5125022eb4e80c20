#!/usr/bin/env python
"""Memory and time of one update micro-batch at long sequence lengths, with and without the memory
features (update.gradient_checkpointing, update.max_tokens_per_micro_batch, update.sequence_parallel),
side by side in one run.

    python tools/bench_memory.py [--lengths 1024,4096,16384] [--features plain,checkpointing] [--rows 1]
    python tools/bench_memory.py --features plain,checkpointing,sp2,checkpointing+sp2
    python tools/bench_memory.py --rows 4 --lengths 1024,4096 \
        --features plain,packed,checkpointing,packed+checkpointing

A ~10M-parameter Qwen2 (built here from a config, random weights; the tiny task's tokenizer size)
runs the update's forward and backward (hpcrl.batches.collate and response_outputs, the policy
loss's shape: a weighted sum of the response tokens' logprobs) on one micro-batch of --rows
sequences of the given length, halved from one row to the next (4 rows of 4096: 4096, 2048, 1024
and 512 tokens), each a 16-token prompt and the rest response: right-padded to the longest
("plain"), or end to end ("packed"); "sp2" splits each sequence over 2 ranks (gloo on CPU, each
rank one core of the machine's two; NCCL on GPUs), as `update.sequence_parallel = 2` does; "lora"
trains rank-8 adapters on the attention projections only (`[update.lora]`). Each
case runs in its own process (an sp case in one per rank, reporting the rank that held most); peak
memory is that process's peak RSS (getrusage; glibc told to return every block of 64 KiB or more to
the system when freed, CASE_ENV) on CPU, or torch's peak allocated on a GPU, and "over the model"
subtracts what the process held once the model was built. Time per token is the forward and
backward's wall time over the micro-batch's tokens, padding not counted (the median of --repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=12, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)
PROMPT = 16
# glibc serves allocations of 64 KiB and more with mmap and unmaps them when they are freed, so a
# process's peak RSS is the peak of the memory it held, not the high-water mark of a heap that keeps
# freed blocks (which made activations freed by checkpointing look held)
CASE_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _setup(length: int, parts: list[str], rows: int):
    """The model (checkpointing its layers if asked) and the micro-batch; the tokens in it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hpcrl import batches
    from hpcrl.policy_model import checkpoint_layers

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPE, max_position_embeddings=max(length, 2048), attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).to("cuda" if torch.cuda.is_available() else "cpu").train()
    if "checkpointing" in parts:
        checkpoint_layers(model)
    if "lora" in parts:  # rank-8 adapters on the attention projections; the rest frozen
        from hpcrl import lora
        from hpcrl.config_training import LoraConfig

        model = lora.wrap(model, LoraConfig(rank=8), seed=0)
    vocab = SHAPE["vocab_size"]
    seqs = [torch.randint(3, vocab, (max(length >> r, PROMPT + 1),)).tolist() for r in range(rows)]
    samples = batches.Samples(None, [s[:PROMPT] for s in seqs], [s[PROMPT:] for s in seqs],
                              [[0.0] * (len(s) - PROMPT) for s in seqs],
                              torch.zeros(rows, dtype=torch.float64), torch.arange(rows))
    mb = batches.collate(samples, list(range(rows)), 0, packed="packed" in parts).to(model.device)
    return model, mb, sum(len(s) for s in seqs)


def _measure(model, mb, tokens: int, repeats: int, group=None) -> dict:
    """Forward and backward of the micro-batch `repeats` times (each rank of a sequence-parallel
    `group` its slice): peak memory and seconds per token."""
    import time

    import torch

    from hpcrl import batches, sequence_parallel

    gpu = torch.cuda.is_available()
    base = torch.cuda.memory_allocated() / 2**20 if gpu else _rss_mb()
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if group is None:
            logits = batches.response_outputs(model, mb)
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.targets[..., None])[..., 0]
            del logits
        else:
            logp, _ = sequence_parallel.token_outputs(model, mb, group, 1.0, with_entropy=False)
        (logp * mb.mask).sum().backward()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del logp
    peak = torch.cuda.max_memory_allocated() / 2**20 if gpu else _rss_mb()
    params = sum(p.numel() for p in model.parameters())
    return {"peak_mb": peak, "over_model_mb": peak - base, "s_per_token": statistics.median(times) / tokens,
            "params": params, "device": "gpu" if gpu else "cpu"}


def case(length: int, feature: str, repeats: int, rows: int = 1) -> dict:
    """One (length, feature) in this process (a feature with "sp<n>": in n processes, the most any
    one of them held): peak memory and seconds per token."""
    parts = feature.split("+")
    sp = next((int(p[2:]) for p in parts if p.startswith("sp")), 1)
    if sp == 1:
        return _measure(*_setup(length, parts, rows), repeats)
    import tempfile

    import torch.multiprocessing as mp

    from hpcrl.distributed import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_sp_rank, args=(sp, free_port(), length, parts, repeats, rows, out), nprocs=sp)
        ranks = [json.loads((Path(out) / f"{r}.json").read_text()) for r in range(sp)]
    return max(ranks, key=lambda r: r["peak_mb"]) | {"s_per_token": max(r["s_per_token"] for r in ranks)}


def _sp_rank(rank: int, n: int, port: int, length: int, parts: list[str], repeats: int, rows: int,
             out: str) -> None:
    """One rank of a sequence-parallel case (gloo on CPU, NCCL on GPUs): its measure into out/<rank>.json."""
    import torch

    from hpcrl import distributed, jit_ops, sequence_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, distributed.usable_cores() // n))
    jit_ops.import_deepspeed().init_distributed(
        dist_backend=distributed.default_backend(torch.cuda.is_available()), verbose=False)
    model, mb, tokens = _setup(length, parts, rows)
    group = sequence_parallel.register(model, n, 1 if "packed" in parts else rows)
    (Path(out) / f"{rank}.json").write_text(json.dumps(_measure(model, mb, tokens, repeats, group)))


def _run_case(length: int, feature: str, repeats: int, rows: int) -> dict:
    """One case in a fresh process (CASE_ENV)."""
    print(f"length {length} {feature}", file=sys.stderr, flush=True)
    out = subprocess.run([sys.executable, __file__, "--case", f"{length},{feature}",
                          "--repeats", str(repeats), "--rows", str(rows)],
                         capture_output=True, text=True, cwd=REPO, env=CASE_ENV)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def longest_within(budget_mb: float, features: list[str], start: int, limit: int, rows: int) -> None:
    """For each feature, the longest sequence (doubling from `start`, up to `limit`) whose memory over
    the model stays within `budget_mb`: a table."""
    print(f"longest sequence whose memory over the model stays within {budget_mb:.0f} MB "
          f"(lengths doubling from {start})")
    print("| feature | longest that fits | over the model MB | the next length's MB |")
    print("|---|---|---|---|")
    for feature in features:
        length, fits, over = start, None, None
        while length <= limit:
            r = _run_case(length, feature, 1, rows)
            if r["over_model_mb"] > budget_mb:
                over = r
                break
            fits = (length, r)
            length *= 2
        longest = f"{fits[0]} | {fits[1]['over_model_mb']:.0f}" if fits else "- | -"
        beyond = f"{over['over_model_mb']:.0f}" if over else f"(not tried beyond {limit})"
        print(f"| {feature} | {longest} | {beyond} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--features", default="plain,checkpointing")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1, help="sequences in the micro-batch, halving in length")
    parser.add_argument("--budget-mb", type=float, help="instead of the table: the longest sequence each "
                        "feature fits within this many MB over the model (lengths doubling from 1024)")
    parser.add_argument("--limit", type=int, default=131072, help="with --budget-mb: the longest tried")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # "length,feature": run one case, print JSON
    args = parser.parse_args()
    if args.case:
        length, feature = args.case.split(",")
        print(json.dumps(case(int(length), feature, args.repeats, args.rows)))
        return
    if args.budget_mb:
        longest_within(args.budget_mb, args.features.split(","), 1024, args.limit, args.rows)
        return
    rows = [(length, feature, _run_case(length, feature, args.repeats, args.rows))
            for length in (int(x) for x in args.lengths.split(",")) for feature in args.features.split(",")]
    params = rows[0][2]["params"] / 1e6
    what = "one sequence" if args.rows == 1 else f"{args.rows} sequences, halving from the longest"
    print(f"one micro-batch of {what}, forward + backward; {params:.1f}M parameters; "
          f"{rows[0][2]['device']}; peak memory of the process")
    print("| longest | feature | peak MB | over the model MB | ms per 1k tokens | memory vs plain "
          "| time vs plain |")
    print("|---|---|---|---|---|---|---|")
    plain = {length: r for length, feature, r in rows if feature == "plain"}
    for length, feature, r in rows:
        p = plain.get(length)
        mem = f"{r['over_model_mb'] / p['over_model_mb']:.2f}x" if p else "-"
        tim = f"{r['s_per_token'] / p['s_per_token']:.2f}x" if p else "-"
        print(f"| {length} | {feature} | {r['peak_mb']:.0f} | {r['over_model_mb']:.0f} | "
              f"{r['s_per_token'] * 1e6:.1f} | {mem} | {tim} |")


if __name__ == "__main__":
    main()
