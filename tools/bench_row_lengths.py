#!/usr/bin/env python
"""What a large batch's token ids cost the generate and score stages when they are turned into
Python lists only to be counted, against counting them in Arrow (hpcrl's way), side by side.

    python tools/bench_row_lengths.py [--samples 8192] [--tokens 2048] [--repeats 3]

A synthetic rollouts table of `samples` responses of up to `tokens` tokens (lengths uniform in
[1, tokens]) goes through `generation.rollout_metrics` and `scoring.reward_rows` (the rows the
score stage's rewards and overlong penalty read), and through the same two computations with each
response's token ids as a Python list. The table gives the median seconds of each; both ways must
give the same metrics and the same rows (a length where the token ids were).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcrl import generation, scoring  # noqa: E402


def rollouts(samples: int, tokens: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, tokens + 1, samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 32000, offsets[-1]),
                                                                     pa.int32()))
    n = pa.array
    return pa.table({"iteration": n([0] * samples), "split": n(["train"] * samples),
                     "prompt_index": n(np.arange(samples) // 8), "sample_index": n(np.arange(samples) % 8),
                     "data_source": n(["synthetic"] * samples), "prompt_text": n(["1 + 1 ="] * samples),
                     "ground_truth": n(["2"] * samples), "response_text": n(["2"] * samples),
                     "response_ids": ids, "kept": n([True] * samples),
                     "finish_reason": n(["length" if x == tokens else "stop" for x in lengths])})


def metrics_via_python(table: pa.Table) -> dict[str, float]:
    lengths = [len(r) for r in table["response_ids"].to_pylist()]
    return {"perf/generated_tokens": float(sum(lengths)), "response_length/max": float(max(lengths))}


def rows_via_python(table: pa.Table) -> list[dict]:
    rows = table.select(scoring.INPUT_COLUMNS).to_pylist()
    for r in rows:
        r["response_length"] = len(r.pop("response_ids"))
    return rows


def ours_metrics(table: pa.Table) -> dict[str, float]:
    m = generation.rollout_metrics(table, 1.0)
    return {k: m[k] for k in ("perf/generated_tokens", "response_length/max")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    table = rollouts(args.samples, args.tokens)
    ways = {"rollout_metrics": (ours_metrics, metrics_via_python),
            "reward_rows": (scoring.reward_rows, rows_via_python)}
    tokens = len(table["response_ids"].combine_chunks().values)
    print(f"{args.samples} responses of up to {args.tokens} tokens ({tokens} in all); "
          f"median of {args.repeats}")
    print("| computation | token ids as Python lists, s | lengths in Arrow (hpcrl), s | speed-up |")
    print("|---|---|---|---|")
    for name, (ours, theirs) in ways.items():
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for _ in range(args.repeats):
            results = {}
            for key, fn in (("theirs", theirs), ("ours", ours)):
                t0 = time.perf_counter()
                results[key] = fn(table)
                times[key].append(time.perf_counter() - t0)
            if results["ours"] != results["theirs"]:
                raise SystemExit(f"{name}: the two ways differ")
        a, b = statistics.median(times["theirs"]), statistics.median(times["ours"])
        print(f"| {name} | {a:.3f} | {b:.3f} | {a / b:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
