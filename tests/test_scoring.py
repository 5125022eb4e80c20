"""Reward functions and scoring of a rollouts table, against values worked out by hand."""

import pyarrow as pa
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
