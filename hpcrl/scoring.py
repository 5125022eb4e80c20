"""Scoring rollouts: apply the reward sources to a rollouts table and summarise the rewards.

Pure table-in, table-out; the score stage commits the result (and the generate stage scores its
rounds with the same functions under dynamic sampling). The sources of a config are its
reward functions (named `module:function`), the reward model (`model`) and the HTTP service
(`http`); each scores every sample and rewards.merge weighs their outputs into the reward.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.compute as pc

from hpcrl import rewards, shards
from hpcrl.config import Experiment, RewardConfig
from hpcrl.schemas import SAMPLE_KEYS
from hpcrl.stage import Stage, StageContext
from hpcrl.stage_kinds import GENERATE, SCORE

INPUT_COLUMNS = [*SAMPLE_KEYS, "data_source", "prompt_text", "ground_truth", "response_text", "response_ids",
                 "finish_reason"]


def load_sources(cfg: RewardConfig) -> tuple[dict[str, rewards.Source], dict[str, float]]:
    """The reward sources of a config by component name, and their weights; loads the reward model."""
    from hpcrl import reward_backends

    sources = {name: rewards.per_sample(rewards.load(name)) for name in cfg.functions}
    weights = dict(zip(cfg.functions, cfg.weights or [1.0] * len(cfg.functions), strict=True))
    if cfg.model.path:
        sources["model"], weights["model"] = reward_backends.RewardModel(cfg.model), cfg.model.weight
    if cfg.http.url:
        sources["http"], weights["http"] = reward_backends.HttpReward.from_config(cfg.http), cfg.http.weight
    return sources, weights


def stage_sources(cfg: RewardConfig, pool=None) -> tuple[dict[str, rewards.Source], dict[str, float]]:
    """load_sources, with the reward functions run on `pool` (an Executor of reward worker
    processes, kept by the resident mode) when given."""
    sources, weights = load_sources(cfg)
    if pool is not None:
        sources.update({name: PooledFunction(name, pool, cfg.workers) for name in cfg.functions})
    return sources, weights


def samples(rows: list[dict]) -> list[dict]:
    """Rollout rows as the samples reward sources score (the HTTP protocol's sample objects)."""
    return [{"prompt": r["prompt_text"], "response": r["response_text"], "ground_truth": r["ground_truth"],
             "data_source": r["data_source"]} for r in rows]


def reward_rows(rollouts: pa.Table) -> list[dict]:
    """The rollout rows scoring reads (INPUT_COLUMNS), as dicts, with each response's length
    (`response_length`) in place of its token ids: those as Python ints would cost more than many a
    reward (tools/bench_row_lengths.py)."""
    lengths = pc.list_value_length(rollouts["response_ids"])
    return rollouts.select([c for c in INPUT_COLUMNS if c != "response_ids"]).append_column(
        "response_length", lengths).to_pylist()


def score(rollouts: pa.Table, sources: dict[str, rewards.Source], weights: dict[str, float],
          overlong_buffer: int = 0, overlong_factor: float = 1.0, max_tokens: int = 0) -> pa.Table:
    """Rewards per sample. Every sample records `truncated` (it hit the length limit); with an
    overlong buffer, training samples also get the `overlong` penalty added to their reward."""
    rows = reward_rows(rollouts)
    batch = samples(rows)
    outputs = {}
    for name, source in sources.items():
        outputs[name] = source(batch)
        if len(outputs[name]) != len(batch):
            raise ValueError(f"reward source {name!r} returned {len(outputs[name])} outputs for "
                             f"{len(batch)} samples")
    out_reward, out_components, out_message = [], [], []
    for i, r in enumerate(rows):
        try:
            s = rewards.merge({name: out[i] for name, out in outputs.items()}, weights)
        except rewards.RewardValueError as err:
            raise rewards.RewardValueError(f"{err}, for {r['split']} prompt {r['prompt_index']} sample "
                                           f"{r['sample_index']}; nothing is committed") from None
        components = {**s.components, "truncated": float(r["finish_reason"] == "length")}
        reward = s.reward
        if overlong_buffer and r["split"] != "val":  # training samples and remax's baselines
            components["overlong"] = rewards.overlong_penalty(r["response_length"], max_tokens,
                                                              overlong_buffer, overlong_factor)
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


def score_for(exp: Experiment, rollouts: pa.Table, sources: dict[str, rewards.Source],
              weights: dict[str, float]) -> pa.Table:
    """`score` with the overlong penalty settings of an experiment: what the score stage records."""
    r = exp.reward
    return score(rollouts, sources, weights, r.overlong_buffer, r.overlong_penalty_factor,
                 exp.generate.max_tokens)


def metric_name(component: str) -> str:
    """A component name as a metric name MLflow accepts: each '/'-part non-empty, other characters '_'."""
    parts = [re.sub(r"[^\w.\-:]", "_", p) for p in component.split("/")]
    return "/".join(p if p.strip(".") else "_" for p in parts)


def component_means(scores: pa.Table) -> dict[str, float]:
    """`reward/<component>/mean` over the training samples that carry the component."""
    train = scores.filter(pc.equal(scores["split"], "train"))
    if not train.num_rows:
        return {}
    maps = train["reward_components"].combine_chunks()
    start, end = maps.offsets[0].as_py(), maps.offsets[-1].as_py()  # the entries of these rows
    means = (pa.table({"key": maps.keys.slice(start, end - start),
                       "value": maps.items.slice(start, end - start)})
             .group_by("key", use_threads=False).aggregate([("value", "mean")]).sort_by("key"))
    return {f"reward/{metric_name(k)}/mean": float(v)
            for k, v in zip(means["key"].to_pylist(), means["value_mean"].to_pylist(), strict=True)}


def metrics(rollouts: pa.Table, scores: pa.Table) -> dict[str, float]:
    """verl-style reward metrics: critic/score/* for training samples, val/score for validation, and the
    mean of each reward component over the training samples."""
    reward, split = scores["reward"], scores["split"]
    out: dict[str, float] = {}
    train = reward.filter(pc.equal(split, "train"))
    if len(train):
        out.update({"critic/score/mean": pc.mean(train).as_py(), "critic/score/max": pc.max(train).as_py(),
                    "critic/score/min": pc.min(train).as_py()})
    baseline = reward.filter(pc.equal(split, "baseline"))
    if len(baseline):
        out["remax/baseline_score"] = pc.mean(baseline).as_py()
    val = pa.table({"source": rollouts["data_source"], "reward": reward}).filter(pc.equal(split, "val"))
    if val.num_rows:
        out["val/score"] = pc.mean(val["reward"]).as_py()
        means = val.group_by("source", use_threads=False).aggregate([("reward", "mean")])
        out.update({f"val/score/{source}": mean for source, mean in
                    zip(means["source"].to_pylist(), means["reward_mean"].to_pylist(), strict=True)})
    out.update(component_means(scores))
    return {k: float(v) for k, v in out.items()}


class ScoreStage(Stage):
    """The score stage: the configured reward sources over the iteration's rollouts. A source
    that fails raises, and nothing is committed. In the resident mode `setup` starts the pool
    of reward workers (`reward.workers`) that the reward functions then run on for the run."""

    name = SCORE
    pool = None

    def setup(self, version: int, seed: int) -> None:
        if self.resident and self.exp.reward.workers and self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(self.exp.reward.workers,
                                            mp_context=multiprocessing.get_context("spawn"))

    def run(self, ctx: StageContext, rollouts: pa.Table | None = None) -> None:
        score_stage(ctx, self.pool, rollouts)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


def score_stage(ctx: StageContext, pool=None, rollouts: pa.Table | None = None) -> None:
    """The score stage of ctx.iteration; the reward functions run on `pool` (an Executor of
    reward worker processes, kept by the resident mode) when given. `rollouts`: the generation's
    table as committed, from the caller that committed it (the resident generator); else read."""
    from hpcrl import commit

    gen = ctx.input_dir(GENERATE)
    ctx.policy_version = commit.read_manifest(gen)["policy_version"]
    with ctx.timed("io"):
        rollouts = (commit.read_table(gen, "rollouts", columns=INPUT_COLUMNS) if rollouts is None
                    else rollouts.select(INPUT_COLUMNS))
    if ctx.shard:  # one of executor.score.tasks tasks: a contiguous part (hpcrl.shards)
        start, stop = shards.part(rollouts.num_rows, *ctx.shard)
        rollouts = rollouts.slice(start, stop - start)
    with ctx.timed("load"):
        sources, weights = stage_sources(ctx.exp.reward, pool)
    with ctx.timed("compute"):
        scores = score_for(ctx.exp, rollouts, sources, weights)
    with ctx.timed("io"):
        ctx.writer.write_table("scores", scores)
    ctx.writer.metrics.update(metrics(rollouts, scores))


def merge_shards(ctx: StageContext, shards_n: int) -> None:
    """The score stage of ctx.iteration from its `shards_n` committed shards (hpcrl.shards): their
    scores in order; the manifest lists them as its inputs."""
    from hpcrl import commit

    gen = ctx.input_dir(GENERATE)
    ctx.policy_version = commit.read_manifest(gen)["policy_version"]
    with ctx.timed("io"):
        rollouts = commit.read_table(gen, "rollouts", columns=INPUT_COLUMNS)
        scores = pa.concat_tables(ctx.shard_tables("scores", shards_n))
    if scores.num_rows != rollouts.num_rows:
        raise commit.CorruptOutputError(f"the shards of {ctx.run.stage_dir(ctx.iteration, SCORE)} scored "
                                        f"{scores.num_rows} samples of {rollouts.num_rows}")
    with ctx.timed("io"):
        ctx.writer.write_table("scores", scores)
    ctx.writer.metrics.update(metrics(rollouts, scores))


POOL_CHUNK = 256  # the most samples per task sent to a reward worker


def chunk_size(samples: int, workers: int) -> int:
    """Samples per task: every worker gets a share of even a small batch, none more than POOL_CHUNK."""
    return max(1, min(POOL_CHUNK, -(-samples // max(1, workers))))


class PooledFunction:
    """A reward function applied by a pool of `workers` worker processes, in chunks (chunk_size)."""

    def __init__(self, name: str, pool, workers: int):
        self.name, self.pool, self.workers = name, pool, workers

    def __call__(self, batch: list[dict]) -> list:
        size = chunk_size(len(batch), self.workers)
        chunks = [batch[i: i + size] for i in range(0, len(batch), size)]
        return [out for part in self.pool.map(_apply_function, [self.name] * len(chunks), chunks)
                for out in part]


def _apply_function(name: str, batch: list[dict]) -> list:
    return rewards.per_sample(rewards.load(name))(batch)
