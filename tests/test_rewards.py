"""The reward functions and their plumbing (hpcrl.rewards), case by case against answers worked
out by hand: the built-in matches, the number normalisation GSM8K's match relies on, the loader's
refusals, the arguments a function receives, and `merge`'s checks of what sources return."""

from __future__ import annotations

import math
import sys

import pytest

from hpcrl import rewards


def test_exact_match_strips_space_and_records_an_empty_answer():
    assert rewards.exact_match(" 82\n", " 82 ") == {"score": 1.0, "nonempty": 1.0}
    assert rewards.exact_match("8", "82") == {"score": 0.0, "nonempty": 1.0}
    assert rewards.exact_match("   ", "82") == {"score": 0.0, "nonempty": 0.0}


@pytest.mark.parametrize("text, normal", [
    ("1,234", "1234"), ("1,234.", "1234"), ("3.0", "3"), ("12.50", "12.5"), ("-7", "-7"), (".5", "0.5"),
    ("1.2.", "1.2"), ("1.2.3", "1.2.3"), ("abc", "abc")])
def test_numbers_are_compared_as_numbers(text, normal):
    assert rewards._normalise_number(text) == normal


def test_gsm8k_matches_the_answer_line_and_records_the_last_number():
    out = rewards.gsm8k("3 + 4 = 7\n#### 7", "She has 3 + 4 = 7 apples.\n#### 7")
    assert out == {"score": 1.0, "format": 1.0, "flexible": 1.0, "message": ""}
    assert rewards.gsm8k("#### 7.0", "7")["score"] == 1.0  # a ground truth that is the bare answer
    assert rewards.gsm8k("#### 7", "a #### 6 #### 7")["score"] == 1.0  # the last "####" part
    assert rewards.gsm8k("#### 7", "####7")["score"] == 1.0
    wrong = rewards.gsm8k("#### 8 then 7", "#### 7")
    assert (wrong["score"], wrong["format"], wrong["flexible"]) == (0.0, 1.0, 1.0)
    assert rewards.gsm8k("no numbers at all", "#### 7") == {
        "score": 0.0, "format": 0.0, "flexible": 0.0, "message": "no '#### <answer>' line"}


def test_the_overlong_penalty_of_a_one_token_buffer():
    assert rewards.overlong_penalty(19, 20, 1) == 0.0
    assert rewards.overlong_penalty(20, 20, 1) == -1.0
    assert rewards.overlong_penalty(20, 20, -3) == 0.0


@pytest.mark.parametrize("name, message", [
    ("exact_match", "reward function 'exact_match': expected 'module:function'"),
    (":exact_match", "reward function ':exact_match': expected 'module:function'"),
    ("hpcrl.rewards:", "reward function 'hpcrl.rewards:': expected 'module:function'"),
    ("hpcrl.rewards:exact_match:x", "reward function 'hpcrl.rewards:exact_match:x': module 'hpcrl.rewards' "
                                    "has no function 'exact_match:x'"),
    ("hpcrl.rewards:Scored.reward", "reward function 'hpcrl.rewards:Scored.reward': module 'hpcrl.rewards' "
                                    "has no function 'Scored.reward'"),
    ("hpcrl.rewards:math", "reward function 'hpcrl.rewards:math': module 'hpcrl.rewards' has no function "
                           "'math'"),
    ("no_such_module_here:f", "reward function 'no_such_module_here:f': cannot import module "
                              "'no_such_module_here': No module named 'no_such_module_here'"),
])
def test_a_reward_that_cannot_load_is_named_with_what_is_missing(name, message):
    with pytest.raises(rewards.RewardLoadError) as err:
        rewards.load(name)
    assert str(err.value) == message


def test_a_module_that_raises_on_import_is_named_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_reward.py").write_text("raise RuntimeError('no key set')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(rewards.RewardLoadError) as err:
        rewards.load("broken_reward:score")
    assert str(err.value) == "reward function 'broken_reward:score': importing broken_reward raised " \
                             "RuntimeError: no key set"
    sys.modules.pop("broken_reward", None)
    assert rewards.load("hpcrl.rewards:gsm8k") is rewards.gsm8k


def test_a_function_gets_each_sample_with_its_data_source_and_prompt():
    seen = []

    def judge(response, ground_truth, **extra):
        seen.append((response, ground_truth, extra))
        return len(response)

    batch = [{"prompt": "p1", "response": "ab", "ground_truth": "g1", "data_source": "d1"},
             {"prompt": "p2", "response": "c", "ground_truth": "g2", "data_source": "d2"}]
    assert rewards.per_sample(judge)(batch) == [2, 1]
    assert seen == [("ab", "g1", {"data_source": "d1", "prompt": "p1"}),
                    ("c", "g2", {"data_source": "d2", "prompt": "p2"})]


@pytest.mark.parametrize("value", ["1.0", b"1", None, [1.0], math.nan, math.inf, -math.inf])
def test_a_score_that_is_not_a_finite_number_is_refused_by_name(value):
    with pytest.raises(rewards.RewardValueError) as err:
        rewards.merge({"judge": {"score": value}}, {"judge": 1.0})
    assert str(err.value) == f"reward source 'judge' gave score = {value!r}; expected a finite number"
    with pytest.raises(rewards.RewardValueError) as err:
        rewards.merge({"judge": {"score": 1.0, "style": value}}, {"judge": 1.0})
    assert str(err.value) == f"reward source 'judge' gave style = {value!r}; expected a finite number"


def test_merge_weighs_the_sources_and_keeps_every_component_and_message():
    out = rewards.merge({"exact": {"score": 1.0, "nonempty": 1.0, "message": "ok"},
                         "judge": {"score": 0.5, "message": ""}, "len": True, "style": {"score": 2,
                                                                                         "message": "long"}},
                        {"exact": 0.5, "judge": 2.0, "len": 1.0, "style": -1.0})
    assert out == rewards.Scored(0.5 + 1.0 + 1.0 - 2.0, {"exact": 1.0, "exact/nonempty": 1.0, "judge": 0.5,
                                                         "len": 1.0, "style": 2.0}, "exact: ok; style: long")
    with pytest.raises(rewards.RewardValueError) as err:
        rewards.merge({"judge": {"value": 1.0, "reason": "x"}}, {"judge": 1.0})
    assert str(err.value) == "reward source 'judge' gave a dict without 'score' (keys ['reason', 'value'])"
