"""Scoring rollouts: apply reward functions to a rollouts table and summarise the rewards.

Pure table-in, table-out; the score stage commits the result.
"""

from __future__ import annotations

import pyarrow as pa

from hpcrl import rewards
from hpcrl.config import RewardConfig
from hpcrl.schemas import SAMPLE_KEYS

INPUT_COLUMNS = [*SAMPLE_KEYS, "data_source", "prompt_text", "ground_truth", "response_text"]


def load_functions(cfg: RewardConfig) -> tuple[dict[str, rewards.RewardFn], dict[str, float]]:
    fns = {name: rewards.load(name) for name in cfg.functions}
    weights = dict(zip(cfg.functions, cfg.weights or [1.0] * len(cfg.functions), strict=True))
    return fns, weights


def score(rollouts: pa.Table, fns: dict[str, rewards.RewardFn], weights: dict[str, float]) -> pa.Table:
    rows = rollouts.select(INPUT_COLUMNS).to_pylist()
    scored = [rewards.combine(fns, weights, r["response_text"], r["ground_truth"],
                              data_source=r["data_source"], prompt=r["prompt_text"]) for r in rows]
    return pa.table({
        **{k: rollouts[k] for k in SAMPLE_KEYS},
        "reward": pa.array([s.reward for s in scored], pa.float64()),
        "reward_components": pa.array([list(s.components.items()) for s in scored],
                                      pa.map_(pa.string(), pa.float64())),
        "reward_message": pa.array([s.message for s in scored], pa.string()),
    })


def metrics(rollouts: pa.Table, scores: pa.Table) -> dict[str, float]:
    """verl-style reward metrics: critic/score/* for training samples, val/score for validation."""
    import polars as pl

    df = pl.from_arrow(scores.select(["split", "reward"])).with_columns(
        pl.Series("data_source", rollouts["data_source"].to_pylist()))
    out: dict[str, float] = {}
    train = df.filter(pl.col("split") == "train")["reward"]
    if len(train):
        out.update({"critic/score/mean": train.mean(), "critic/score/max": train.max(),
                    "critic/score/min": train.min()})
    val = df.filter(pl.col("split") == "val")
    if len(val):
        out["val/score"] = val["reward"].mean()
        for source, group in val.group_by("data_source"):
            out[f"val/score/{source[0]}"] = group["reward"].mean()
    return {k: float(v) for k, v in out.items()}
