#!/usr/bin/env python
"""hpcrl's resident mode side by side with TRL's GRPOTrainer: completions per second on the same
model, prompts, group size, completion length and update schedule, measured in one run.

    python tools/bench_trl.py [--model-size tiny|100m] [--steps S] [--repeats R] [--set KEY=VALUE ...]

The hpcrl side is `hpcrl submit` on configs/demo.toml (or --config) with executor.mode =
"resident", S iterations, no validation and no MLflow, in a fresh run directory under a temporary
directory. The TRL side is tools/trl_grpo_run.py, run with the python of a virtual environment this
script builds once (default .cache/trl-venv: TRL and CPU torch at the pinned versions below; TRL is
never installed into hpcrl's environment). TRL generates with plain HF `generate` (its CPU path,
no vLLM). Its settings are derived from the same hpcrl config: prompts_per_iteration x group_size
completions generated at once (generation_batch_size), update.mini_batches optimizer steps over
them (update.micro_batch_size sequences per forward/backward), update.ppo_epochs passes, lr,
clip_ratio, grad_clip, kl.coef as beta, max_tokens, temperature, and exact-match reward.

What is timed, per system (the first iteration is a warm-up and is left out of the steady rows):
  TRL steady       wall time from the end of iteration 1 to the end of iteration S (a trainer
                   callback, time.perf_counter() after each iteration's last optimizer step)
  TRL train        wall time of trainer.train(), all S iterations (model already loaded)
  hpcrl stages     sum of the generate, score and update stage times (`timings.total` in each
                   iter_*/<stage>/_COMMIT.json) of iterations 2..S; also of all S iterations.
                   With executor.resident.overlap_commit (the default) the update's checkpoint and commit
                   run during the next generation, so this sum counts that time twice.
  hpcrl loop       wall time between the commits of iteration 1's and iteration S's update: what
                   the run takes per iteration in the steady state (weight sync and probe included)
  end to end       wall time of the whole command: interpreter start, imports, model load or
                   vLLM engine and DeepSpeed start-up, all S iterations, teardown
The two systems run alternately (ABAB...); the table shows medians over the repeats, and each
hpcrl ratio is the median over the repeats of (completions/s / TRL's completions/s in the same
repeat), against the TRL row above it: steady against steady, all iterations against
trainer.train(), end to end against end to end.

`--model-size 100m` builds (once, cached) a randomly initialised ~99M-parameter Qwen2 with the tiny
task's tokenizer and runs both systems on it with fewer iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcrl import commit, config

REPO = Path(__file__).resolve().parents[1]
# Versions that work together on CPU (on the development machine torch==2.13.0 resolves to a local CPU
# wheel; an unpinned torch would pull a CUDA build of several GB). Changing this list rebuilds the venv.
TRL_PINS = ("torch==2.13.0", "trl==1.16.0", "transformers==5.19.0", "accelerate==1.15.0", "datasets==5.2.0",
            "tokenizers==0.23.3", "safetensors==0.8.0")
STAMP = "hpcrl-bench-pins.txt"
# Qwen2 shape of the 100m model: 14 x (4 x 768^2 attention + 3 x 768 x 2048 MLP) = 99M parameters.
SHAPE_100M = {"hidden_size": 768, "num_hidden_layers": 14, "num_attention_heads": 12,
              "num_key_value_heads": 12, "intermediate_size": 2048}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# per model size: default iterations and repeats, and hpcrl settings sized for the model (vLLM's KV
# cache must hold a whole batch; smaller micro-batches bound the trainer's activation memory).
SIZES = {
    "tiny": {"steps": 10, "repeats": 3, "set": {}},
    "100m": {"steps": 3, "repeats": 1, "set": {"generate.kv_cache_gib": 2.0, "update.micro_batch_size": 32}},
}


def log(msg: str) -> None:
    print(f"[bench_trl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the TRL environment and the 100m model ------------------------------------------------------
def trl_python(venv: Path) -> Path:
    """The python of the TRL venv, built (or rebuilt, when the pins changed) first."""
    python = venv / "bin" / "python"
    stamp = venv / STAMP
    if python.exists() and stamp.is_file() and stamp.read_text().split() == list(TRL_PINS):
        return python
    log(f"building the TRL virtual environment {venv} (once; a few minutes): {' '.join(TRL_PINS)}")
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # pip's own "Collecting ... / Installing ..." lines are the progress report
    subprocess.run([str(python), "-m", "pip", "install", "--progress-bar", "off", *TRL_PINS], check=True,
                   stdout=sys.stderr)
    cuda = subprocess.run([str(python), "-c", "import torch; print(torch.version.cuda)"], check=True,
                          capture_output=True, text=True).stdout.strip()
    if cuda != "None":
        raise RuntimeError(f"{venv}: pip installed a CUDA build of torch (CUDA {cuda}); "
                           "expected the CPU build")
    stamp.write_text("\n".join(TRL_PINS) + "\n")
    log(f"TRL virtual environment ready: {venv}")
    return python


def model_100m(cache: Path, tiny_model: Path) -> Path:
    """A randomly initialised ~99M-parameter Qwen2 with the tiny task's tokenizer (cached)."""
    out = cache / "bench-qwen2-100m"
    record = {"shape": SHAPE_100M, "tokenizer_from": str(tiny_model), "seed": 0}
    build = out / "BUILD.json"
    if build.is_file() and json.loads(build.read_text())["record"] == record:
        return out
    log(f"building the 100m model in {out}")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = json.loads((tiny_model / "config.json").read_text())
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "hidden_act", "rope_parameters")
    cfg = Qwen2Config(**{k: base[k] for k in keep if k in base}, **SHAPE_100M)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    tmp = Path(tempfile.mkdtemp(prefix=".bench-qwen2-100m-", dir=cache))
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tiny_model / name).is_file():
            shutil.copy2(tiny_model / name, tmp / name)
    params = sum(p.numel() for p in model.parameters())
    (tmp / "BUILD.json").write_text(json.dumps({"record": record, "params": params}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"100m model ready: {params / 1e6:.1f}M parameters")
    return out


# ---- one run of each system ----------------------------------------------------------------------
def run_trl(python: Path, exp: config.Experiment, steps: int, work: Path) -> dict[str, float]:
    out = work / "trl.json"
    a, u = exp.algorithm, exp.update
    cmd = [str(python), str(REPO / "tools" / "trl_grpo_run.py"), "--model", exp.model.path,
           "--train", exp.data.train, "--iterations", str(steps), "--prompts", str(a.prompts_per_iteration),
           "--group-size", str(a.group_size), "--mini-batches", str(u.mini_batches),
           "--micro-batch", str(u.micro_batch_size), "--ppo-epochs", str(u.ppo_epochs),
           "--max-tokens", str(exp.generate.max_tokens), "--temperature", str(exp.generate.temperature),
           "--lr", str(u.lr), "--clip", str(a.clip_ratio), "--grad-clip", str(u.grad_clip),
           "--beta", str(a.kl.coef), "--seed", str(exp.run.seed), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(work / "hf-home"))
    t0 = time.perf_counter()
    _run(cmd, env, work / "trl.log")
    wall = time.perf_counter() - t0
    res = json.loads(out.read_text())
    ends = res["iteration_end"]
    if len(ends) != steps:
        raise RuntimeError(f"TRL ran {len(ends)} iterations, expected {steps}; log: {work / 'trl.log'}")
    return {"steady": ends[-1] - ends[0], "train": res["train_end"] - res["train_start"], "end to end": wall,
            "reward first": res["rewards"][0], "reward last": res["rewards"][-1], "params": res["params"]}


def run_hpcrl(exp: config.Experiment, steps: int, work: Path, keep: bool = False) -> dict[str, float]:
    """One hpcrl run; its run directory (GBs of checkpoints at 99M) goes once read, unless `keep`."""
    exp = config.with_overrides(exp, {"run.name": "bench", "run.runs_root": str(work / "runs"),
                                      "run.iterations": steps, "data.test": "", "tracking.enabled": False,
                                      "executor.kind": "local", "executor.mode": "resident"}, "bench_trl")
    toml = work / "hpcrl.toml"
    toml.write_text(config.dumps(exp))
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    _run([sys.executable, "-m", "hpcrl.cli", "submit", str(toml)], env, work / "hpcrl.log")
    wall = time.perf_counter() - t0
    root = work / "runs" / "bench"
    manifests = [{s: commit.read_manifest(root / f"iter_{k:06d}" / s)
                  for s in ("generate", "score", "update")}
                 for k in range(steps)]
    if any(m is None for it in manifests for m in it.values()):
        raise RuntimeError(f"{root}: not every stage committed; log: {work / 'hpcrl.log'}")
    stage_s = [sum(m["timings"]["total"] for m in it.values()) for it in manifests]
    commits = [it["update"]["committed_at"] for it in manifests]
    rewards = [it["score"]["metrics"]["critic/score/mean"] for it in manifests]
    if not keep:
        shutil.rmtree(work / "runs", ignore_errors=True)
    return {"stages": sum(stage_s[1:]), "stages all": sum(stage_s), "loop": commits[-1] - commits[0],
            "end to end": wall, "reward first": rewards[0], "reward last": rewards[-1]}


def _run(cmd: list[str], env: dict[str, str], logfile: Path) -> None:
    with open(logfile, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode:
        tail = "".join(logfile.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}; log {logfile}:\n{tail}")


# ---- the table -------------------------------------------------------------------------------------
def table(trl: list[dict], hp: list[dict], per_iter: int, steps: int) -> list[str]:
    steady, total = per_iter * (steps - 1), per_iter * steps
    rows = [  # system, what is timed, results, key, completions, the TRL key it is compared with
        ("TRL GRPOTrainer", f"iterations 2..{steps}, wall", trl, "steady", steady, "steady"),
        ("hpcrl resident", f"iterations 2..{steps}, stage times", hp, "stages", steady, "steady"),
        ("hpcrl resident", f"iterations 2..{steps}, wall between update commits", hp, "loop", steady,
         "steady"),
        ("TRL GRPOTrainer", f"iterations 1..{steps}, wall of trainer.train()", trl, "train", total, "train"),
        ("hpcrl resident", f"iterations 1..{steps}, stage times", hp, "stages all", total, "train"),
        ("TRL GRPOTrainer", "end to end (process start to exit)", trl, "end to end", total, "end to end"),
        ("hpcrl resident", "end to end (`hpcrl submit`)", hp, "end to end", total, "end to end"),
    ]
    out = ["| system | timed | completions | seconds | completions/s | ratio vs TRL | each repeat |",
           "|---|---|---|---|---|---|---|"]
    for system, what, res, key, n, ref in rows:
        seconds = statistics.median(r[key] for r in res)
        ratios = [t[ref] / r[key] for r, t in zip(res, trl, strict=True)]  # same completions
        each = ", ".join(f"{x:.2f}x" for x in ratios)
        out.append(f"| {system} | {what} | {n} | {seconds:.2f} | {n / seconds:.1f} | "
                   f"{statistics.median(ratios):.2f}x | {each} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.toml"))
    parser.add_argument("--model-size", choices=sorted(SIZES), default="tiny",
                        help="tiny: the config's model; 100m: a random ~99M-parameter Qwen2 built here")
    parser.add_argument("--steps", type=int, help="iterations per run (default: 10 tiny, 3 100m); at least 2")
    parser.add_argument("--repeats", type=int,
                        help="runs of each system, alternating (default: 3 tiny, 1 100m)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override an hpcrl config key (TRL's settings follow), "
                             "e.g. executor.resident.checkpoint_every=100")
    parser.add_argument("--cache-dir", default=str(REPO / ".cache"),
                        help="holds trl-venv/ and the 100m model")
    parser.add_argument("--keep", action="store_true",
                        help="keep the run directories and logs (path printed)")
    args = parser.parse_args()
    size = SIZES[args.model_size]
    steps, repeats = args.steps or size["steps"], args.repeats or size["repeats"]
    if steps < 2:
        parser.error("--steps: at least 2 (the first iteration is a warm-up)")
    cache = Path(args.cache_dir).resolve()
    cache.mkdir(parents=True, exist_ok=True)

    exp = config.load(args.config)
    overrides = dict(size["set"])
    if args.model_size == "100m":
        overrides["model.path"] = str(model_100m(cache, Path(exp.model.path)))
    overrides.update(config.parse_assignments(args.set))
    if overrides:
        exp = config.with_overrides(exp, overrides, "bench_trl")
    python = trl_python(cache / "trl-venv")
    per_iter = exp.algorithm.prompts_per_iteration * exp.algorithm.group_size

    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-trl-"))
    trl, hp = [], []
    try:
        for r in range(repeats):
            for name in ("TRL", "hpcrl"):
                d = work / f"{name}-{r}"
                d.mkdir()
                log(f"repeat {r + 1}/{repeats}: {name}, {steps} iterations ({d})")
                if name == "TRL":
                    trl.append(run_trl(python, exp, steps, d))
                    res = trl[-1]
                else:
                    hp.append(run_hpcrl(exp, steps, d, args.keep))
                    res = hp[-1]
                log(f"  {name}: end to end {res['end to end']:.1f}s, reward {res['reward first']:.3f} -> "
                    f"{res['reward last']:.3f}" + (f"; steady {trl[-1]['steady']:.1f}s (TRL) vs "
                                                   f"{res['loop']:.1f}s" if name == "hpcrl" else ""))
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    params = trl[0]["params"]
    print(f"{args.model_size} ({params / 1e6:.2f}M parameters), {exp.algorithm.prompts_per_iteration} "
          f"prompts x {exp.algorithm.group_size} samples x <= {exp.generate.max_tokens} tokens per "
          f"iteration, {exp.update.mini_batches} optimizer steps per iteration, {steps} iterations; "
          f"median of {repeats} alternating runs; ratio: median over repeats of completions/s / TRL's "
          "in the same repeat (each hpcrl row against the TRL row above it)")
    print("\n".join(table(trl, hp, per_iter, steps)))
    print(f"\nmean sampled reward, first -> last iteration (median): TRL "
          f"{statistics.median(r['reward first'] for r in trl):.3f} -> "
          f"{statistics.median(r['reward last'] for r in trl):.3f}"
          f", hpcrl {statistics.median(r['reward first'] for r in hp):.3f} -> "
          f"{statistics.median(r['reward last'] for r in hp):.3f}")


if __name__ == "__main__":
    main()
