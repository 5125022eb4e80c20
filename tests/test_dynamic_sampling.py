"""DAPO dynamic sampling: which groups are kept, the draws of the rounds, the round loop, and the
update's view of the batch, against values worked out by hand."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from hpcrl import batches
from hpcrl import dynamic_sampling as ds
from hpcrl.data import draw_prompts


def test_a_group_is_all_equal_when_its_rewards_are_exactly_equal():
    prompts = [7, 7, 7, 3, 3, 3, 5, 5, 5]
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, -0.5, -0.5, -0.5]
    assert ds.all_equal_groups(prompts, rewards) == {7: True, 3: False, 5: True}
    assert list(ds.all_equal_groups(prompts, rewards)) == [7, 3, 5]  # draw order
    assert ds.all_equal_groups([1, 1], [0.5, 0.5 + 1e-9]) == {1: False}
    with pytest.raises(ValueError, match="3 samples but 2 rewards"):
        ds.all_equal_groups([1, 1, 1], [0.0, 1.0])


def test_select_keeps_the_first_informative_groups_and_trims_the_rest():
    #          g0     g1     g2    g3     g4    g5
    equal = [True, False, False, True, False, False]
    assert ds.select(equal, 3) == [False, True, True, False, True, False]  # g5 trimmed, g0 and g3 dropped
    assert ds.metrics(equal, ds.select(equal, 3), rounds=2) == {
        "dapo/rounds": 2.0, "dapo/generated_groups": 6.0, "dapo/kept_groups": 3.0, "dapo/padded_groups": 0.0,
        "dapo/dropped_all_equal": 2.0, "dapo/trimmed_groups": 1.0}


def test_select_fills_a_short_batch_with_the_earliest_all_equal_groups():
    equal = [True, False, True, True]
    kept = ds.select(equal, 3)
    assert kept == [True, True, True, False]  # g1 informative; g0, g2 fill; g3 dropped
    assert ds.metrics(equal, kept, rounds=1) == {
        "dapo/rounds": 1.0, "dapo/generated_groups": 4.0, "dapo/kept_groups": 1.0, "dapo/padded_groups": 2.0,
        "dapo/dropped_all_equal": 1.0, "dapo/trimmed_groups": 0.0}
    with pytest.raises(ValueError, match="4 groups sampled, fewer than the 5"):
        ds.select(equal, 5)


def test_rounds_of_an_iteration_draw_distinct_prompts_deterministically():
    first = draw_prompts(10, 4, 0, seed=5)
    assert (draw_prompts(10, 4, 0, seed=5, sampling_round=0) == first).all()  # round 0: the plain draw
    rounds = [draw_prompts(10, 4, 0, seed=5, sampling_round=r) for r in range(4)]
    assert [len(r) for r in rounds] == [4, 4, 2, 0]  # 10 rows: the third extra round finds none left
    assert sorted(np.concatenate(rounds).tolist()) == list(range(10))  # never a row twice
    # Extra rounds take, in order, the rows round 0 left in a permutation seeded by (seed, iteration, 1).
    rest = [int(i) for i in np.random.default_rng([5, 0, 1]).permutation(10) if i not in first]
    assert rounds[1].tolist() == rest[:4] and rounds[2].tolist() == rest[4:]
    again = [draw_prompts(10, 4, 0, seed=5, sampling_round=r) for r in range(4)]
    assert all((a == b).all() for a, b in zip(rounds, again, strict=True))
    assert draw_prompts(10, 4, 1, seed=5, sampling_round=1).tolist() != rounds[1].tolist()  # per iteration
    assert (draw_prompts(10, 4, 1, seed=5) == np.random.default_rng([5, 0]).permutation(10)[4:8]).all()
    with pytest.raises(ValueError, match="sampling round -1"):
        draw_prompts(10, 4, 0, seed=5, sampling_round=-1)


def _fake_round(requests, r: int) -> pa.Table:
    """Two samples per requested prompt index, as generation.sample lays them out."""
    rows = [p for p in requests for _ in range(2)]
    return pa.table({"prompt_index": pa.array(rows, pa.int64()),
                     "round": pa.array([r] * len(rows), pa.int32()), "kept": pa.array([True] * len(rows))})


REWARDS = {10: (1.0, 1.0), 11: (0.0, 1.0), 20: (0.0, 0.0), 21: (1.0, 0.0), 22: (0.5, 0.0), 30: (0.0, 1.0)}


def _rewards(table: pa.Table) -> list[float]:
    seen: dict[int, int] = {}
    out = []
    for p in table["prompt_index"].to_pylist():
        out.append(REWARDS[p][seen.get(p, 0)])
        seen[p] = seen.get(p, 0) + 1
    return out


def test_rounds_stop_once_the_batch_has_enough_informative_groups():
    draws = {0: [10, 11], 1: [20, 21, 22], 2: [30]}
    drawn = []

    def draw(r):
        drawn.append(r)
        return draws[r]

    out = ds.sample_in_rounds(3, 5, draw, _fake_round, _rewards)
    # round 0: 10 all equal, 11 informative (1 of 3); round 1: 20 all equal, 21, 22 informative (3): stop
    assert drawn == [0, 1]
    assert out.table["prompt_index"].to_pylist() == [10, 10, 11, 11, 20, 20, 21, 21, 22, 22]
    assert out.table["round"].to_pylist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert out.table["kept"].to_pylist() == [False, False, True, True, False, False, True, True, True, True]
    assert out.metrics == {"dapo/rounds": 2.0, "dapo/generated_groups": 5.0, "dapo/kept_groups": 3.0,
                           "dapo/padded_groups": 0.0, "dapo/dropped_all_equal": 2.0,
                           "dapo/trimmed_groups": 0.0}


def test_at_the_round_limit_all_equal_groups_fill_the_batch():
    out = ds.sample_in_rounds(2, 1, lambda r: [10, 11], _fake_round, _rewards)
    assert out.table["kept"].to_pylist() == [True] * 4  # 11 informative, 10 fills the batch
    assert out.metrics["dapo/rounds"] == 1.0 and out.metrics["dapo/padded_groups"] == 1.0
    # A round that finds no unused prompt ends the rounds early.
    draws = {0: [10, 11], 1: [20], 2: []}
    out = ds.sample_in_rounds(2, 9, lambda r: draws[r], _fake_round, _rewards)
    assert (out.metrics["dapo/rounds"] == 2.0
            and out.table["kept"].to_pylist() == [True, True, True, True, False, False])


def test_a_prompt_drawn_twice_in_one_iteration_is_refused():
    with pytest.raises(ValueError, match=r"sampling round 1 drew prompts \[11\]"):
        ds.sample_in_rounds(5, 3, lambda r: [[10, 11], [11]][r], _fake_round, _rewards)


def _tables(kept: list[bool] | None):
    n = 6  # prompts 4 and 5 (train, 2 samples each), then 2 validation samples
    rollouts = {"split": ["train"] * 4 + ["val"] * 2,
                "prompt_index": pa.array([4, 4, 5, 5, 0, 1], pa.int64()),
                "sample_index": pa.array([0, 1, 0, 1, 0, 0], pa.int32()),
                "prompt_ids": [[1]] * n, "response_ids": [[2, 3]] * n, "logprobs": [[-0.1, -0.2]] * n,
                "policy_version": pa.array([0] * n, pa.int32())}
    if kept is not None:
        rollouts["kept"] = kept
    scores = {"split": rollouts["split"], "prompt_index": rollouts["prompt_index"],
              "sample_index": rollouts["sample_index"], "reward": [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]}
    return pa.table(rollouts), pa.table(scores)


def test_the_update_batch_is_the_kept_training_rows():
    samples = batches.load_samples(*_tables([True, True, False, False, False, False]))
    assert samples.keys["prompt_index"].to_pylist() == [4, 4]
    assert samples.rewards.tolist() == [1.0, 0.0] and samples.group_ids.tolist() == [4, 4]
    old = batches.load_samples(*_tables(None))  # schema v1 rollouts: every training row
    assert old.keys["prompt_index"].to_pylist() == [4, 4, 5, 5]
    rollouts, scores = _tables(None)
    with pytest.raises(ValueError, match="do not line up"):
        batches.load_samples(rollouts, scores.set_column(1, "prompt_index", pa.array([4, 4, 5, 6, 0, 1])))


def test_config_keys_and_the_note_on_scoring_twice(write_experiment):
    from hpcrl import config, preflight

    exp = config.load(write_experiment())
    assert (exp.algorithm.dynamic_sampling, exp.algorithm.max_sampling_rounds) == (False, 4)
    with pytest.raises(config.ConfigError, match="algorithm.max_sampling_rounds"):
        config.load(write_experiment(algorithm={"max_sampling_rounds": 0}))
    rules = config.load(write_experiment(algorithm={"dynamic_sampling": True}, data={"test": ""}))
    assert preflight.check(rules, "e.toml") == []  # rule functions: nothing to say
    http = config.load(write_experiment(algorithm={"dynamic_sampling": True}, data={"test": ""},
                                        reward={"http": {"url": "http://rm:8000/score"}}))
    assert preflight.check(http, "e.toml") == [
        "algorithm.dynamic_sampling: the generate stage scores training samples to choose the batch and the "
        "score stage scores them again: the HTTP reward service receives every training sample twice"]


def test_metrics_refuse_flags_that_do_not_line_up():
    """pins: metrics() zips the all-equal flags and the kept flags strictly (a short list is an error,
    not a silently shorter count)."""
    with pytest.raises(ValueError):
        ds.metrics([True, False, True], [True, False], rounds=1)


def test_a_repeated_draw_names_at_most_five_prompts():
    """pins: the error lists the first five prompts drawn again (`again[:5]`), sorted."""
    draws = [[9, 8, 7, 6, 5, 4, 3], [3, 4, 5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match=r"sampling round 1 drew prompts \[3, 4, 5, 6, 7\] of an earlier"):
        ds.sample_in_rounds(1, 3, lambda r: draws[r], _fake_round, lambda t: [0.0] * t.num_rows)
