"""Scoring rollouts: apply reward functions to a rollouts table and summarise the rewards.

Pure table-in, table-out; `score_stage` is the body of the score stage (hpcrl.stage commits it),
optionally spread over a pool of reward worker processes that the resident mode keeps alive.
"""

from __future__ import annotations

import pyarrow as pa

from hpcrl import rewards
from hpcrl.config import RewardConfig
from hpcrl.schemas import SAMPLE_KEYS

INPUT_COLUMNS = [*SAMPLE_KEYS, "data_source", "prompt_text", "ground_truth", "response_text", "response_ids",
                 "finish_reason"]


def load_functions(cfg: RewardConfig) -> tuple[dict[str, rewards.RewardFn], dict[str, float]]:
    fns = {name: rewards.load(name) for name in cfg.functions}
    weights = dict(zip(cfg.functions, cfg.weights or [1.0] * len(cfg.functions), strict=True))
    return fns, weights


def score(rollouts: pa.Table, fns: dict[str, rewards.RewardFn], weights: dict[str, float],
          overlong_buffer: int = 0, overlong_factor: float = 1.0, max_tokens: int = 0) -> pa.Table:
    """Rewards per sample. Every sample records `truncated` (it hit the length limit); with an
    overlong buffer, training samples also get the `overlong` penalty added to their reward."""
    rows = rollouts.select(INPUT_COLUMNS).to_pylist()
    out_reward, out_components, out_message = [], [], []
    for r in rows:
        s = rewards.combine(fns, weights, r["response_text"], r["ground_truth"], data_source=r["data_source"],
                            prompt=r["prompt_text"])
        components = {**s.components, "truncated": float(r["finish_reason"] == "length")}
        reward = s.reward
        if overlong_buffer and r["split"] == "train":
            components["overlong"] = rewards.overlong_penalty(len(r["response_ids"]), max_tokens, overlong_buffer,
                                                              overlong_factor)
            reward += components["overlong"]
        out_reward.append(reward)
        out_components.append(list(components.items()))
        out_message.append(s.message)
    return pa.table({
        **{k: rollouts[k] for k in SAMPLE_KEYS},
        "reward": pa.array(out_reward, pa.float64()),
        "reward_components": pa.array(out_components, pa.map_(pa.string(), pa.float64())),
        "reward_message": pa.array(out_message, pa.string()),
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


def score_stage(ctx, pool=None) -> None:
    """The score stage of ctx.iteration: rewards of its rollouts, on `pool` (an Executor) if given."""
    from hpcrl import commit

    gen = ctx.input_dir("generate")
    ctx.policy_version = commit.read_manifest(gen)["policy_version"]
    with ctx.timed("io"):
        rollouts = commit.read_table(gen, "rollouts", columns=INPUT_COLUMNS)
    with ctx.timed("load"):
        fns, weights = load_functions(ctx.exp.reward)
    with ctx.timed("compute"):
        r = ctx.exp.reward
        args = (fns, weights, r.overlong_buffer, r.overlong_penalty_factor, ctx.exp.generate.max_tokens)
        if pool is None or rollouts.num_rows < 2 * POOL_CHUNK:
            scores = score(rollouts, *args)
        else:
            chunks = [rollouts.slice(i, POOL_CHUNK) for i in range(0, rollouts.num_rows, POOL_CHUNK)]
            scores = pa.concat_tables(pool.map(score, chunks, *([a] * len(chunks) for a in args)))
    with ctx.timed("io"):
        ctx.writer.write_table("scores", scores)
    ctx.writer.metrics.update(metrics(rollouts, scores))


POOL_CHUNK = 256  # rows per task sent to a reward worker
