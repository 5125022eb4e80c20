#!/usr/bin/env python
"""Iteration time of the resident mode against the staged mode, side by side in one run, on the
demo experiment and on a ~100M-parameter CPU configuration (random init: only timing matters).

    python tools/bench_resident.py [--models demo,100m] [--iterations 4] [--repeats 1]

Each (model, mode) runs a fresh run through the real controller and executor (as `hpcrl submit`),
alternating the order of the modes per repeat. The resident mode runs once per same-node weight
transport (shared memory, the default here, and the gloo process group). The iteration time is \
the wall time between the commits of two
consecutive updates (iterations 1..N-2: iteration 0 includes the start of the job(s), the last
one saves the final checkpoint), so it includes everything a user waits for: job launches,
loading, generation, scoring, the update, parquet I/O and, resident, the weight sync. The
resident mode's non-compute overhead is that wall time minus the compute phases of the three
stages (vLLM generation, reward functions, the update's forward/backward/step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from hpcrl import commit, config, runs
from hpcrl.controller import Controller

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / ".cache" / "tiny-addition"


def build_100m(out: Path) -> Path:
    """A randomly initialised Qwen2 of ~100M parameters with the tiny task's tokenizer (cached)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(TINY / "model")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=768, num_hidden_layers=14, num_attention_heads=12,
                      num_key_value_heads=4, intermediate_size=2560, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


# The modes compared: the staged mode, and the resident mode with each same-node weight transport.
MODES = {
    "staged": {"executor.mode": "staged"},
    "resident, shared memory": {"executor.mode": "resident",
                                "executor.resident.weight_sync": "shared_memory"},
    "resident, process group": {"executor.mode": "resident",
                                "executor.resident.weight_sync": "process_group"},
}


def experiment(name: str, model: str, mode: str, root: Path, iterations: int) -> config.Experiment:
    exp = config.load(REPO / "configs" / "demo.toml")
    overrides = {"run.name": f"{name}-{mode.replace(', ', '-').replace(' ', '_')}",
                 "run.runs_root": str(root), "run.iterations": iterations, "run.eval_every": 0,
                 "data.test": "", "tracking.enabled": False, **MODES[mode]}
    if mode != "staged":
        overrides["executor.resident.checkpoint_every"] = iterations
    return config.with_overrides(exp, {**overrides, **model_overrides(model)}, "bench")


def model_overrides(model: str) -> dict[str, object]:
    """The demo's keys to change for `model`: none for "demo"; for "100m" the ~100M model (built
    once, cached) with a batch and lengths that fit this machine."""
    if model != "100m":
        return {}
    return {"model.path": str(build_100m(REPO / ".cache" / "bench-100m")),
            "algorithm.prompts_per_iteration": 8, "algorithm.group_size": 4, "generate.max_tokens": 16,
            "generate.kv_cache_gib": 0.5,
            "update.mini_batches": 1, "update.micro_batch_size": 32}


def measure(exp: config.Experiment) -> dict[str, float]:
    run, _ = runs.prepare(exp, "bench")
    Controller(run, exp, echo=lambda line: print("   ", line, file=sys.stderr), show_progress=False).run_all()
    m = {s: [commit.read_manifest(run.stage_dir(k, s)) for k in range(exp.run.iterations)]
         for s in ("generate", "score", "update")}
    ks = range(1, exp.run.iterations - 1)
    wall = [m["update"][k]["committed_at"] - m["update"][k - 1]["committed_at"] for k in ks]
    row = {"iteration": statistics.median(wall)}
    for s in ("generate", "score", "update"):
        row[s] = statistics.median(m[s][k]["timings"]["compute"] for k in ks)
    row["sync"] = statistics.median(m["generate"][k]["metrics"].get("sync/seconds", 0.0) for k in ks)
    row["overhead"] = row["iteration"] - row["generate"] - row["score"] - row["update"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,100m", help="comma-separated: demo, 100m")
    parser.add_argument("--iterations", type=int, default=4, help="iterations per run (>= 3)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-") as tmp:
        for model in args.models.split(","):
            for r in range(args.repeats):
                modes = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
                for mode in modes:
                    print(f"{model} {mode} repeat {r + 1}/{args.repeats}", file=sys.stderr)
                    exp = experiment(f"{model}{r}", model, mode, Path(tmp), args.iterations)
                    results.setdefault((model, mode), []).append(measure(exp))
    cols = ("iteration", "generate", "score", "update", "sync", "overhead")
    print(f"seconds per iteration (median over iterations 1..{args.iterations - 2} and {args.repeats} "
          "repeat(s)); generate/score/update = compute phases; overhead = the rest (share of the iteration)")
    print(f"| model | mode | {' | '.join(cols)} | staged / this |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for model in args.models.split(","):
        med = {mode: {c: statistics.median(r[c] for r in results[(model, mode)]) for c in cols}
               for mode in MODES}
        for mode in MODES:
            row = med[mode]
            cells = [f"{row[c]:.2f}" for c in cols[:-1]] + [
                f"{row['overhead']:.2f} ({row['overhead'] / row['iteration']:.0%})"]
            ratio = med["staged"]["iteration"] / med[mode]["iteration"]
            print(f"| {model} | {mode} | {' | '.join(cells)} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
