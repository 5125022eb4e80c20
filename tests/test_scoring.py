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
