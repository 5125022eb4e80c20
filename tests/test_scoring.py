"""Reward functions and scoring of a rollouts table, against values worked out by hand."""

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from hpcrl import rewards, scoring


def test_builtin_rewards():
    assert rewards.exact_match(" 82 ", "82")["score"] == 1.0
    assert rewards.exact_match("0082", "82")["score"] == 0.0
    out = rewards.gsm8k("so the answer is\n#### 1,234", "... #### 1234")
    assert out["score"] == 1.0 and out["format"] == 1.0
    flexible = rewards.gsm8k("the answer is 1234.", "#### 1234")
    assert (flexible["score"] == 0.0 and flexible["flexible"] == 1.0
            and "no '#### <answer>'" in flexible["message"])


def test_overlong_penalty_by_hand():
    # max 20 tokens, buffer 8: no penalty up to 12 tokens, then -1/8 per token, -1 at 20
    assert rewards.overlong_penalty(12, 20, 8) == 0.0
    assert rewards.overlong_penalty(16, 20, 8) == pytest.approx(-0.5)
    assert rewards.overlong_penalty(20, 20, 8, factor=0.5) == pytest.approx(-0.5)
    assert rewards.overlong_penalty(20, 20, 0) == 0.0


def _rollouts():
    rows = [("train", "82", [1, 2, 3], "stop"), ("train", "82", [1] * 8, "length"),
            ("val", "81", [1] * 8, "length")]
    return pa.table({
        "split": [r[0] for r in rows], "prompt_index": [0, 0, 1], "sample_index": [0, 1, 0],
        "data_source": ["t"] * 3, "prompt_text": ["p"] * 3, "ground_truth": ["82", "82", "82"],
        "response_text": [r[1] for r in rows], "response_ids": [r[2] for r in rows],
        "finish_reason": [r[3] for r in rows]})


def test_score_records_truncation_and_applies_the_overlong_penalty_to_training_samples_only():
    fns, weights = {"exact": rewards.per_sample(rewards.exact_match)}, {"exact": 1.0}
    table = scoring.score(_rollouts(), fns, weights, overlong_buffer=4, overlong_factor=1.0, max_tokens=8)
    got = table.to_pylist()
    comps = [dict(r["reward_components"]) for r in got]
    assert [c["truncated"] for c in comps] == [0.0, 1.0, 1.0]
    assert comps[0]["overlong"] == 0.0 and comps[1]["overlong"] == pytest.approx(-1.0)
    assert "overlong" not in comps[2]  # validation scores the task alone
    assert [r["reward"] for r in got] == pytest.approx([1.0, 0.0, 0.0])
    plain = scoring.score(_rollouts(), fns, weights)
    assert [r["reward"] for r in plain.to_pylist()] == [1.0, 1.0, 0.0]


def test_the_rows_rewards_read_carry_each_responses_length_not_its_token_ids():
    """pins scoring.reward_rows: what the rewards and the overlong penalty read, without a Python
    list of every response's token ids (tools/bench_row_lengths.py: 0.4 s per 8M-token batch)."""
    rows = scoring.reward_rows(_rollouts())
    assert [r["response_length"] for r in rows] == [3, 8, 8]
    assert sorted(rows[0]) == sorted([*(c for c in scoring.INPUT_COLUMNS if c != "response_ids"),
                                      "response_length"])


def test_a_small_batch_is_shared_by_every_reward_worker_and_no_chunk_exceeds_the_cap():
    """pins (scoring.chunk_size): a batch of 256 sent to one of 4 workers whole, or chunks beyond
    POOL_CHUNK."""
    assert [scoring.chunk_size(n, w) for n, w in ((256, 4), (257, 4), (3, 8), (5000, 4), (0, 4), (10, 0))] \
        == [64, 65, 1, 256, 1, 10]


def test_reward_workers_score_what_the_stage_process_does():
    """The resident mode's reward workers (reward.workers, real spawned processes) give the same
    rewards, components and messages, in the same order, as scoring in the stage's own process;
    each gets its share of the batch (pins chunks that lose, repeat or reorder samples)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from hpcrl.config_reward import RewardConfig

    rows, name = 40, "hpcrl.rewards:exact_match"
    base = _rollouts()
    table = pa.table({c: [base[c][i % 3].as_py() for i in range(rows)] for c in base.column_names})
    table = table.set_column(2, "sample_index", pa.array(range(rows)))
    plain = scoring.score(table, {name: rewards.per_sample(rewards.exact_match)}, {name: 1.0})

    class Recording(ProcessPoolExecutor):
        def map(self, fn, *iterables):
            names, chunks = (list(it) for it in iterables)
            sizes.append([len(c) for c in chunks])
            return super().map(fn, names, chunks)

    sizes: list[list[int]] = []
    with Recording(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        sources, weights = scoring.stage_sources(RewardConfig(functions=[name], workers=2), pool)
        pooled = scoring.score(table, sources, weights)
    assert pooled.equals(plain) and sizes == [[20, 20]]


# ---- the score stage on a run directory --------------------------------------------------------

def _generated(root, **overrides):
    """A run directory with iteration 0's rollouts committed (synthetic: some answers right); the
    experiment with `overrides`."""
    import numpy as np

    from hpcrl import config
    from hpcrl.rundir import RunDir
    from tests import synthetic_run

    exp = synthetic_run.write_config(root, iterations=2, max_tokens=8)
    if overrides:
        exp = config.with_overrides(exp, overrides, "test")
        RunDir.at(root).config_path.write_text(config.dumps(exp))
    rollouts = synthetic_run.rollouts_table(0, 16, 4, group_size=4, max_tokens=8)
    synthetic_run.commit_generate(RunDir.at(root), exp, 0, rollouts, np.random.default_rng(0))
    return exp, rollouts


def test_the_score_stage_scores_the_generation_with_the_experiments_settings(tmp_path):
    from hpcrl import commit
    from hpcrl.stage import run_stage

    penalty = {"reward.overlong_buffer": 4, "reward.overlong_penalty_factor": 0.5}
    exp, rollouts = _generated(tmp_path / "r", **penalty)
    m = run_stage("score", tmp_path / "r", 0, scoring.score_stage, startup=0.0)
    scores = commit.read_table(tmp_path / "r" / "iter_000000" / "score", "scores")
    sources, weights = scoring.load_sources(exp.reward)
    by_hand = scoring.score(rollouts, sources, weights, 4, 0.5, 8).to_pylist()
    assert scores.to_pylist() == by_hand  # the settings reach score
    assert scoring.score_for(exp, rollouts, sources, weights).to_pylist() == by_hand
    assert min(r["reward"] for r in by_hand) == -0.5  # a wrong answer at max_tokens: -1 x 0.5
    assert m["metrics"] == scoring.metrics(rollouts, scores) and m["policy_version"] == 0
    assert set(m["timings"]) == {"startup", "io", "load", "compute", "total"}
    assert m["utilisation"]["busy_s"] == m["timings"]["compute"]


def test_a_score_stage_given_the_committed_rollouts_commits_what_it_commits_reading_them(tmp_path,
                                                                                        monkeypatch):
    """The resident generator hands each score stage the rollouts its generation committed
    (hpcrl.resident_commits): it reads none back, and the scores file is the same, byte for byte,
    as one that read them. pins: a handed table ignored, or scored in another order or with other
    columns than the read one."""
    from hpcrl import commit
    from hpcrl.stage import run_stage

    _generated(tmp_path / "read")
    run_stage("score", tmp_path / "read", 0, scoring.score_stage, startup=0.0)
    _generated(tmp_path / "handed")
    rollouts = commit.read_table(tmp_path / "handed" / "iter_000000" / "generate", "rollouts")
    handed = pa.concat_tables([rollouts.slice(0, 5), rollouts.slice(5)])  # as sampled: in parts
    read = commit.read_table
    monkeypatch.setattr(commit, "read_table", lambda d, name, **kw: (
        pytest.fail("read the rollouts back") if name == "rollouts" else read(d, name, **kw)))
    run_stage("score", tmp_path / "handed", 0, lambda ctx: scoring.score_stage(ctx, None, handed),
              startup=0.0)
    files = [tmp_path / r / "iter_000000" / "score" / "scores.parquet" for r in ("read", "handed")]
    assert files[0].read_bytes() == files[1].read_bytes()


def test_score_shards_merge_into_what_one_stage_scores(tmp_path):
    from hpcrl import commit
    from hpcrl.stage import run_stage

    _generated(tmp_path / "whole")
    run_stage("score", tmp_path / "whole", 0, scoring.score_stage, startup=0.0)
    _generated(tmp_path / "sharded")
    parts = [run_stage("score", tmp_path / "sharded", 0, scoring.score_stage, startup=0.0, shard=(i, 3))
             for i in range(3)]
    assert [p["metrics"]["critic/score/mean"] is not None for p in parts] == [True] * 3
    m = run_stage("score", tmp_path / "sharded", 0, lambda ctx: scoring.merge_shards(ctx, 3), startup=0.0)
    stage = lambda root: root / "iter_000000" / "score"  # noqa: E731
    whole = commit.read_table(stage(tmp_path / "whole"), "scores")
    merged = commit.read_table(stage(tmp_path / "sharded"), "scores")
    assert merged.equals(whole) and merged.num_rows == 20
    assert m["metrics"] == commit.read_manifest(stage(tmp_path / "whole"))["metrics"]
    assert m["policy_version"] == 0 and set(m["timings"]) == {"startup", "io", "load", "compute", "total"}
    _generated(tmp_path / "short")
    for i in range(2):
        run_stage("score", tmp_path / "short", 0, scoring.score_stage, startup=0.0, shard=(i, 2))

    def losing(ctx):  # shards that lost a sample each (a stand-in for a faulty shard job)
        tables = ctx.shard_tables
        ctx.shard_tables = lambda name, n: [t.slice(1) for t in tables(name, n)]
        scoring.merge_shards(ctx, 2)

    with pytest.raises(commit.CorruptOutputError) as err:
        run_stage("score", tmp_path / "short", 0, losing, startup=0.0)
    assert str(err.value) == f"the shards of {stage(tmp_path / 'short')} scored 18 samples of 20"
    assert not commit.is_committed(stage(tmp_path / "short"))


def test_rewards_metrics_by_split_and_data_source_by_hand():
    rollouts = pa.table({"data_source": ["a", "a", "b", "a", "b", "a"]})
    scores = pa.table({"split": ["train", "train", "val", "val", "val", "baseline"],
                       "reward": [1.0, 0.0, 0.5, 1.0, 0.25, 0.75],
                       "reward_components": pa.array(
                           [[("exact", 1.0)], [("exact", 0.0), ("x/y", 3.0)], [("exact", 0.5)],
                            [("exact", 1.0)], [("exact", 0.25)], [("exact", 0.75)]],
                           pa.map_(pa.string(), pa.float64()))})
    assert scoring.metrics(rollouts, scores) == {
        "critic/score/mean": 0.5, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "remax/baseline_score": 0.75, "val/score": 1.75 / 3, "val/score/a": 1.0, "val/score/b": 0.375,
        "reward/exact/mean": 0.5, "reward/x/y/mean": 3.0}
    # the training rows of a table slice: each component's mean over those rows only
    assert scoring.component_means(scores.slice(1, 4)) == {"reward/exact/mean": 0.0, "reward/x/y/mean": 3.0}
    val_only = scores.filter(pc.equal(scores["split"], "val"))
    assert scoring.metrics(rollouts.slice(2, 3), val_only) == {"val/score": 1.75 / 3, "val/score/b": 0.375,
                                                             "val/score/a": 1.0}


def test_component_names_become_metric_names_mlflow_accepts():
    assert [scoring.metric_name(c) for c in ("a/X/b", "a/../b", "a//b", "judge score", "x:y-z.w")] == \
        ["a/X/b", "a/_/b", "a/_/b", "judge_score", "x:y-z.w"]


def test_a_source_that_miscounts_or_gives_nan_stops_the_stage_naming_the_sample():
    rollouts = _rollouts()
    with pytest.raises(ValueError) as err:
        scoring.score(rollouts, {"judge": lambda batch: [1.0]}, {"judge": 1.0})
    assert str(err.value) == "reward source 'judge' returned 1 outputs for 3 samples"
    with pytest.raises(rewards.RewardValueError) as err:
        scoring.score(rollouts, {"judge": lambda batch: [1.0, 1.0, float("nan")]}, {"judge": 1.0})
    assert str(err.value) == ("reward source 'judge' gave score = nan; expected a finite number, for val "
                              "prompt 1 sample 0; nothing is committed")
    table = scoring.score(rollouts, {"judge": lambda batch: [1, 0, 1]}, {"judge": 1.0}, overlong_buffer=4,
                          max_tokens=8)  # the penalty's factor defaults to 1
    assert table["reward"].to_pylist() == [1.0, -1.0, 1.0] and table["reward"].type == pa.float64()


def test_the_resident_score_stage_keeps_a_pool_of_spawned_workers_until_closed(tmp_path):
    from hpcrl import config
    from hpcrl.rundir import RunDir
    from tests import synthetic_run

    exp = synthetic_run.write_config(tmp_path / "r", iterations=1)
    workers = config.with_overrides(exp, {"reward.workers": 3}, "test")
    staged = scoring.ScoreStage(workers, RunDir.at(tmp_path / "r"))
    staged.setup(0, 0)
    assert staged.pool is None  # a stage job scores in its own process
    resident = scoring.ScoreStage(workers, RunDir.at(tmp_path / "r"), resident=True)
    resident.setup(0, 0)
    pool = resident.pool
    assert (pool._max_workers, pool._mp_context.get_start_method()) == (3, "spawn")
    resident.setup(1, 0)
    assert resident.pool is pool  # one pool for the run
    resident.close()
    assert resident.pool is None and pool._shutdown_thread
    alone = scoring.ScoreStage(exp, RunDir.at(tmp_path / "r"), resident=True)
    alone.setup(0, 0)
    assert alone.pool is None  # reward.workers = 0: in the generator's process


def test_the_score_stage_runs_its_reward_functions_on_the_stages_pool(tmp_path):
    """The resident mode's reward workers: the stage hands its pool to the reward functions (here
    a thread pool that counts its calls; tests above run real spawned workers)."""
    from concurrent.futures import ThreadPoolExecutor

    from hpcrl import commit
    from hpcrl.rundir import RunDir
    from hpcrl.stage import run_stage

    class Counting(ThreadPoolExecutor):
        calls = 0

        def map(self, *args, **kwargs):
            Counting.calls += 1
            return super().map(*args, **kwargs)

    exp, _ = _generated(tmp_path / "r")
    stage = scoring.ScoreStage(exp, RunDir.at(tmp_path / "r"), resident=True)
    stage.pool = Counting(2)
    run_stage("score", tmp_path / "r", 0, stage.run, startup=0.0)
    stage.close()
    assert Counting.calls == 1 and stage.pool is None
    assert commit.read_table(tmp_path / "r" / "iter_000000" / "score", "scores").num_rows == 20
