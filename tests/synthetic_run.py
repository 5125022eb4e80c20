"""Synthetic run directories for tests and benchmarks: valid committed stage outputs, made fast.

`make_run` writes a frozen experiment.toml and run.json, then commits every stage of every
iteration through hpcrl.commit (fresh_temp_dir, StageWriter, commit) with the real Arrow schemas,
and manifests that carry the metric names and timings the real stages record. The data is
random but seeded; columns are built with numpy and Arrow offsets (no Python loop per row), so an
iteration of 100k rollouts takes about 0.4 s on 2 cores, most of it parquet encoding and hashing.

Lower-level pieces (`write_config`, `rollouts_table`, `commit_generate`, ...) let a test commit
tables it wrote by hand. Used by tests/ and by tools/bench_inspect.py (one implementation).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hpcrl import commit, config, plan, schemas, scoring
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir

DATA_SOURCES = ("gsm8k", "math", "tiny_addition")
REWARD_FN = "hpcrl.rewards:exact_match"


def write_config(root: Path, iterations: int, *, eval_every: int = 5, kl_coef: float = 0.0,
                 group_size: int = 8, prompts_per_iteration: int = 32, max_tokens: int = 64,
                 model_path: str | Path = "/synthetic/model", mini_batches: int = 2) -> Experiment:
    """Freeze an experiment for a run directory at `root` (its name is the run name)."""
    root = Path(root).resolve()
    data = {
        "run": {"name": root.name, "runs_root": str(root.parent), "seed": 0, "iterations": iterations,
                "eval_every": eval_every},
        "model": {"path": str(model_path)},
        "data": {"train": "/synthetic/train.parquet", "test": "/synthetic/test.parquet"},
        "algorithm": {"group_size": group_size, "prompts_per_iteration": prompts_per_iteration,
                      "kl": {"coef": kl_coef}},
        "generate": {"max_tokens": max_tokens},
        "update": {"mini_batches": mini_batches},
        "tracking": {"enabled": False},
    }
    exp = config.parse(data, "synthetic", root)
    root.mkdir(parents=True, exist_ok=True)
    run = RunDir.at(root)
    run.config_path.write_text("# Frozen, fully resolved config of this run (written by hpcrl).\n"
                               + config.dumps(exp))
    run.write_run_info({"run_id": "synthetic", "name": root.name, "code_version": "synthetic"})
    return exp


def _lists(lengths: np.ndarray, values: pa.Array, list_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values.slice(0, int(offsets[-1])), type=list_type)


def rollouts_table(k: int, n_train: int, n_val: int, *, group_size: int = 8, max_tokens: int = 64,
                   p_correct: float = 0.5, seed: int = 0) -> pa.Table:
    """Random rollouts of iteration k: n_train training samples (groups of group_size), n_val greedy.

    Prompts are 2-number additions; a response is the right sum with probability p_correct, less
    0.05 per data source index, so rewards differ by source.
    """
    rng = np.random.default_rng([seed, k, 1])
    n_prompts = -(-n_train // group_size)
    train_prompts = np.repeat(rng.integers(0, 1_000_000, n_prompts), group_size)[:n_train]
    prompt_index = np.concatenate([train_prompts, np.arange(n_val)]).astype(np.int64)
    sample_index = np.concatenate([np.tile(np.arange(group_size), n_prompts)[:n_train], np.zeros(n_val)])
    n = n_train + n_val
    split = pa.DictionaryArray.from_arrays(pa.array(np.r_[np.zeros(n_train), np.ones(n_val)].astype(np.int8)),
                                           ["train", "val"])
    source = pa.DictionaryArray.from_arrays(pa.array((prompt_index % len(DATA_SOURCES)).astype(np.int8)),
                                            list(DATA_SOURCES))
    a, b = prompt_index % 100, (prompt_index // 100) % 100
    prompt_pool = pa.array([f"Compute {i % 100} + {i // 100}. Answer:" for i in range(10_000)])
    answer_pool = pa.array([str(i) for i in range(200)])
    prompt_len = rng.integers(8, 25, n)
    response_len = np.minimum(rng.geometric(1.0 / 24, n), max_tokens)
    response_len[n_train:] = np.minimum(response_len[n_train:], 8)
    tokens = pa.array(rng.integers(0, 32_000, int(prompt_len.sum() + response_len.sum())).astype(np.int32))
    logprobs = pa.array(-rng.exponential(0.3, int(response_len.sum())).astype(np.float32))
    correct = rng.random(n) < p_correct - 0.05 * (prompt_index % len(DATA_SOURCES))
    answer = np.where(correct, a + b, (a + b + 1 + rng.integers(0, 9, n)) % 200)
    response_text = answer_pool.take(pa.array(answer))
    return schemas.conform("rollouts", pa.table({
        "iteration": pa.array(np.full(n, k, np.int32)),
        "split": split,
        "prompt_index": prompt_index,
        "sample_index": sample_index.astype(np.int32),
        "data_source": source,
        "prompt_text": prompt_pool.take(pa.array(a + 100 * b)),
        "ground_truth": answer_pool.take(pa.array(a + b)),
        "prompt_ids": _lists(prompt_len, tokens, pa.list_(pa.int32())),
        "response_ids": _lists(response_len, tokens.slice(int(prompt_len.sum())), pa.list_(pa.int32())),
        "logprobs": _lists(response_len, logprobs, pa.list_(pa.float32())),
        "response_text": response_text,
        "finish_reason": pa.DictionaryArray.from_arrays(
            pa.array((response_len >= max_tokens).astype(np.int8)), ["stop", "length"]),
        "policy_version": pa.array(np.full(n, k, np.int32)),
        "round": pa.array(np.zeros(n, np.int32)),
        "kept": pa.array(np.arange(n) < n_train),
    }))


def scores_table(rollouts: pa.Table, rewards: np.ndarray) -> pa.Table:
    """Scores of `rollouts` (same rows, same order) with the given rewards."""
    n = rollouts.num_rows
    rewards = np.asarray(rewards, np.float64)
    comps = pa.MapArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), pa.repeat(REWARD_FN, n),
                                    pa.array(rewards))
    return schemas.conform("scores", pa.table({
        **{c: rollouts[c] for c in schemas.SAMPLE_KEYS}, "reward": rewards,
        "reward_components": comps, "reward_message": pa.repeat("", n)}))


def learning_curve(k: int, iterations: int) -> float:
    """Success rate of iteration k: rises from 0.25 towards 0.85 over the run."""
    return 0.25 + 0.6 * (1 - np.exp(-4 * k / max(iterations, 1)))


def exact_match_rewards(rollouts: pa.Table) -> np.ndarray:
    """1.0 where the response text equals the ground truth (hpcrl.rewards.exact_match, vectorised)."""
    same = pc.equal(rollouts["response_text"], rollouts["ground_truth"])
    return same.to_numpy(zero_copy_only=False).astype(np.float64)


def _timings(rng: np.random.Generator, scale: float) -> dict[str, float]:
    t = {"startup": 0.5 + rng.random(), "load": scale * 0.4 * (1 + 0.2 * rng.random()),
         "compute": scale * 0.5 * (1 + 0.3 * rng.random()), "io": 0.05 + 0.05 * rng.random()}
    t["total"] = sum(t.values()) + 0.1
    return t


def _commit(run: RunDir, k: int, stage: str, tables: dict[str, pa.Table], metrics: dict[str, float],
            extra: dict, policy_from: Path | None = None) -> dict:
    out = run.stage_dir(k, stage)
    writer = commit.StageWriter(commit.fresh_temp_dir(out))
    for name, table in tables.items():
        writer.write_table(name, table)
    if policy_from is not None:
        shutil.copytree(policy_from, writer.dir / "policy")
    writer.metrics.update(metrics)
    opened = time.time() - extra.get("timings", {}).get("total", 0.0)  # as if it had run that long
    return commit.commit(out, writer, {"stage": stage, "iteration": k, "seed": k, "packages": {},
                                       "host": "synthetic", "world_size": 1, "job_id": None,
                                       "opened_at": opened, **extra})


def _inputs(run: RunDir, *deps: tuple[int, str]) -> dict[str, str]:
    return {f"{s}@iter_{i:06d}": commit.manifest_digest(run.stage_dir(i, s)) for i, s in deps if i >= 0}


def commit_generate(run: RunDir, exp: Experiment, k: int, rollouts: pa.Table,
                    rng: np.random.Generator) -> dict:
    """Commit a rollouts table with the metrics stages/generate records."""
    lengths = rollouts["response_ids"].combine_chunks().value_lengths().to_numpy()
    train = (rollouts["split"].to_numpy(zero_copy_only=False) == "train")
    t = _timings(rng, 20.0)
    m = {"perf/generated_tokens": float(lengths.sum()),
         "perf/throughput": float(lengths.sum() / t["compute"])}
    if train.any():
        finish = rollouts["finish_reason"].to_numpy(zero_copy_only=False)[train]
        m.update({"response_length/mean": float(lengths[train].mean()),
                  "response_length/max": float(lengths[train].max()),
                  "response_length/clip_ratio": float((finish == "length").mean())})
    deps = [(k - 1, "update")] if k > 0 else []
    return _commit(run, k, "generate", {"rollouts": rollouts}, m,
                   {"policy_version": k, "timings": t, "inputs": _inputs(run, *deps)})


def commit_score(run: RunDir, k: int, rollouts: pa.Table, scores: pa.Table, rng: np.random.Generator) -> dict:
    """Commit a scores table with the metrics the score stage records (hpcrl.scoring.metrics)."""
    return _commit(run, k, "score", {"scores": scores}, scoring.metrics(rollouts, scores),
                   {"policy_version": k, "timings": _timings(rng, 1.0),
                    "inputs": _inputs(run, (k, "generate"))})


def commit_update(run: RunDir, exp: Experiment, k: int, rollouts: pa.Table, scores: pa.Table,
                  rng: np.random.Generator, policy_from: Path | None = None) -> dict:
    """Commit stats and advantages (and a policy/ copy of `policy_from`) like stages/update."""
    is_train = pc.equal(rollouts["split"], "train")
    train, s = rollouts.filter(is_train), scores.filter(is_train)
    g = exp.algorithm.group_size
    r = s["reward"].to_numpy()
    groups = r[: len(r) // g * g].reshape(-1, g)
    adv = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    adv = np.concatenate([adv, np.zeros(len(r) - adv.size)]).astype(np.float32)
    steps = exp.update.mini_batches
    decay = np.exp(-3 * k / max(exp.run.iterations, 1))
    stats = pa.table({
        "step": np.arange(steps, dtype=np.int32), "epoch": np.zeros(steps, np.int32),
        "loss": rng.normal(0, 0.05, steps), "pg_loss": rng.normal(0, 0.05, steps),
        "pg_clipfrac": 0.02 * decay + 0.005 * rng.random(steps),
        "ppo_kl": 2e-3 * decay + 5e-4 * rng.random(steps),
        "kl_ref": (1e-2 * (1 - decay) + 1e-3 * rng.random(steps)) if exp.algorithm.kl.coef > 0
        else np.zeros(steps),
        "entropy": 0.3 * decay + 0.05 * rng.random(steps),
        "is_weight_mean": 1 + 0.01 * rng.normal(0, 1, steps), "is_weight_max": 1.2 + 0.1 * rng.random(steps),
        "grad_norm": 1 + 2 * rng.random(steps),
        "lr": np.full(steps, exp.update.lr), "tokens": np.full(steps, 1000, np.int64),
        **{c: pa.nulls(steps, pa.float64()) for c in ("vf_loss", "vf_clipfrac", "vf_grad_norm",
                                                      "moe_load_max", "moe_load_min", "moe_aux_loss",
                                                      "off_policy_weight_mean", "off_policy_weight_max",
                                                      "off_policy_clipfrac")},
        "expert_load": pa.nulls(steps, pa.list_(pa.list_(pa.float64())))})
    n = train.num_rows
    advantages = pa.table({**{c: train[c] for c in schemas.SAMPLE_KEYS}, "advantage": adv,
                           "old_logprobs": train["logprobs"],
                           "ref_logprobs": train["logprobs"] if exp.algorithm.kl.coef > 0
                           else pa.nulls(n, pa.list_(pa.float32())),
                           **{c: pa.nulls(n, pa.list_(pa.float32()))
                              for c in ("token_advantages", "values", "returns")}})
    mean = {c: float(np.mean(stats[c].to_numpy())) for c in stats.column_names if c != "expert_load"}
    t = _timings(rng, 15.0)
    m = {"actor/loss": mean["loss"], "actor/pg_loss": mean["pg_loss"],
         "actor/pg_clipfrac": mean["pg_clipfrac"],
         "actor/ppo_kl": mean["ppo_kl"], "actor/kl_loss": mean["kl_ref"], "actor/entropy": mean["entropy"],
         "actor/grad_norm": mean["grad_norm"], "actor/lr": mean["lr"], "rollout/logprob_diff_mean": 1e-7,
         "rollout/logprob_diff_max": 1e-6, "perf/update_tokens_per_s": mean["tokens"] * steps / t["compute"]}
    deps = [(k, "generate"), (k, "score")] + ([(k - 1, "update")] if k > 0 else [])
    return _commit(run, k, "update", {"stats": stats, "advantages": advantages}, m,
                   {"policy_version": k + 1, "timings": t, "inputs": _inputs(run, *deps)}, policy_from)


def make_run(root: Path, iterations: int = 3, rows: int = 256, *, val_rows: int = 32, eval_every: int = 5,
             kl_coef: float = 0.0, group_size: int = 8, seed: int = 0, policy_from: Path | None = None,
             model_path: str | Path = "/synthetic/model", progress: bool = False) -> RunDir:
    """A complete synthetic run: `iterations` x (generate, score, update) + final validation.

    Each update commits a `policy/` copy of `policy_from` when given (an HF model folder);
    `model_path` is the config's model.path (policy version 0). Resumable: stages already
    committed (an interrupted build) are kept.
    """
    root = Path(root)
    if (root / "experiment.toml").is_file():
        exp = config.load(root / "experiment.toml")
    else:
        exp = write_config(root, iterations, eval_every=eval_every, kl_coef=kl_coef, group_size=group_size,
                           prompts_per_iteration=max(rows // group_size, 1), model_path=model_path)
    run = RunDir.at(root)
    for k in range(iterations + 1):
        kinds = plan.stages_of(exp, k)
        if not kinds or commit.is_committed(run.stage_dir(k, kinds[-1])):
            continue
        n_train = rows if plan.trains(exp, k) else 0
        n_val = val_rows if plan.validates(exp, k) else 0
        rollouts = rollouts_table(k, n_train, n_val, group_size=group_size, seed=seed,
                                  p_correct=learning_curve(k, iterations))
        scores = scores_table(rollouts, exact_match_rewards(rollouts))
        rng = np.random.default_rng([seed, k, 3])
        if not commit.is_committed(run.stage_dir(k, "generate")):
            commit_generate(run, exp, k, rollouts, rng)
        if not commit.is_committed(run.stage_dir(k, "score")):
            commit_score(run, k, rollouts, scores, rng)
        if "update" in kinds:
            commit_update(run, exp, k, rollouts, scores, rng, policy_from)
            run.publish_policy(k + 1)
        if progress:
            print(f"\rsynthetic run {root.name}: iteration {k + 1}/{iterations + 1}", end="", flush=True)
    if progress:
        print()
    return run


def describe(run: RunDir) -> str:
    """A one-line summary of a run directory's size (for benchmark output)."""
    total = sum(p.stat().st_size for p in run.root.rglob("*.parquet"))
    rows = sum(json.loads((d / commit.MANIFEST).read_text())["tables"]["rollouts"]["rows"]
               for d in run.root.glob("iter_*/generate") if (d / commit.MANIFEST).is_file())
    return f"{run.root}: {rows:,} rollout rows, {total / 2**30:.2f} GiB of parquet"
