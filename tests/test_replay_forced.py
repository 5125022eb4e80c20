"""A generate stage replayed on another environment: `replay.compare` does not ask for the same
tokens (a near tie flips a token on other hardware) but teacher-forces the original samples
through the policy there (hpcrl.replay_forced) and judges those logprobs against the sampler's.
The verdicts use synthetic committed rollouts and a stand-in for the forward pass; the forward
pass itself runs on a tiny real model (the real stage is in tests/test_replay.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from hpcrl import commit, policy_model, replay, replay_forced
from hpcrl.replay_forced import Forced
from tests import synthetic_run

CPU2 = {"utilisation": {"device_type": "cpu", "devices": 2}, "device": {"name": "Xeon", "threads": 2}}
CPU1 = {"utilisation": {"device_type": "cpu", "devices": 1}, "device": {"name": "Xeon", "threads": 1}}
TOL = 2.0 ** -10  # a tolerance the shifted logprobs meet exactly (no rounding in p + TOL - p)


@pytest.fixture
def rollouts() -> pa.Table:
    return synthetic_run.rollouts_table(0, n_train=16, n_val=4, group_size=4, max_tokens=8)


def _commit(stage_dir, rollouts: pa.Table, env: dict):
    writer = commit.StageWriter(commit.fresh_temp_dir(stage_dir))
    writer.write_table("rollouts", rollouts)
    commit.commit(stage_dir, writer, {"stage": "generate", **env})
    return stage_dir


def _first_nonempty(table: pa.Table) -> int:
    return next(i for i, ids in enumerate(table["response_ids"].to_pylist()) if ids)


def _one_token_changed(table: pa.Table) -> pa.Table:
    ids = table["response_ids"].to_pylist()
    row = _first_nonempty(table)
    ids[row] = [ids[row][0] + 1, *ids[row][1:]]
    return table.set_column(table.schema.get_field_index("response_ids"), "response_ids",
                            pa.array(ids, table.schema.field("response_ids").type))


def _shifted(shift: float, row: int | None = None):
    """A stand-in forward pass: the recorded logprobs moved by `shift` (every row, or only `row`)."""
    def score(rows: list[dict]) -> list[list[float]]:
        assert all(isinstance(r["prompt_ids"], list) for r in rows)  # what a forward pass is given
        return [[p + (shift if row in (None, i) else 0.0) for p in r["logprobs"]] for i, r in enumerate(rows)]
    return score


def _verdict(tmp_path, original: pa.Table, replayed: pa.Table, forced: Forced | None, env_b=CPU1):
    a = _commit(tmp_path / "a" / "generate", original, CPU2)
    b = _commit(tmp_path / "b" / "generate", replayed, env_b)
    report = replay.compare(a, b, "generate", forced=forced)
    return report, replay.format_report(report, a, b, {})


def test_other_tokens_on_another_environment_match_when_the_policy_there_gives_the_sampled_logprobs(
        tmp_path, rollouts):
    """Pins: across environments, token identity demanded (the same-environment verdict)."""
    report, text = _verdict(tmp_path, rollouts, _one_token_changed(rollouts), Forced(_shifted(TOL / 2), TOL))
    n = rollouts.num_rows
    assert f"token agreement: {n - 1}/{n} samples identical" in text and "environment: devices 2 -> 1" in text
    assert ("judged across environments: the original samples teacher-forced through the policy here "
            f"against the sampler's logprobs: mean difference {TOL / 2:.2e} (tolerance {TOL:.0e})") in text
    assert report.match and text.endswith("verdict: MATCH within tolerance")


@pytest.mark.parametrize("shift, match", [(TOL, True), (TOL * (1 + 1e-6), False)])
def test_the_teacher_forced_mean_difference_is_allowed_up_to_exactly_the_tolerance(tmp_path, rollouts,
                                                                                    shift, match):
    report, text = _verdict(tmp_path, rollouts, _one_token_changed(rollouts), Forced(_shifted(shift), TOL))
    assert report.match is match
    assert ("beyond the tolerance across environments" in text) is not match


def test_one_sample_the_policy_there_would_not_draw_makes_the_replay_differ_and_is_named(tmp_path, rollouts):
    """Pins: a verdict on the largest difference's sample, or one that averages a single bad
    sample away: moved by 10 nats, it alone puts the mean beyond the tolerance, and it is named."""
    row = _first_nonempty(rollouts) + 1
    forced = Forced(_shifted(10.0, row), 1e-3)
    report, text = _verdict(tmp_path, rollouts, _one_token_changed(rollouts), forced)
    r = rollouts.slice(row, 1).to_pylist()[0]
    assert not report.match and text.endswith("verdict: DIFFERENT")
    assert ("teacher-forced logprobs beyond the tolerance across environments: worst at "
            f"{r['split']} prompt {r['prompt_index']} sample {r['sample_index']}") in text
    assert "max 1.00e+01" in text


def test_a_forward_pass_that_gives_nan_is_not_a_match(tmp_path, rollouts):
    report, text = _verdict(tmp_path, rollouts, _one_token_changed(rollouts), Forced(_shifted(math.nan), TOL))
    assert not report.match and "mean difference nan" in text


def test_without_the_policy_a_generation_across_environments_fails_closed(tmp_path, rollouts):
    report, text = _verdict(tmp_path, rollouts, _one_token_changed(rollouts), None)
    assert not report.match
    line = "judged across environments: not judged without the policy the stage sampled from"
    assert line in text.splitlines()


def _emptied(table: pa.Table, rows) -> pa.Table:
    """`table` with the responses (tokens and logprobs) of `rows` empty."""
    for column in ("response_ids", "logprobs"):
        values = [[] if i in rows else v for i, v in enumerate(table[column].to_pylist())]
        table = table.set_column(table.schema.get_field_index(column), column,
                                 pa.array(values, table.schema.field(column).type))
    return table


def test_samples_without_tokens_or_no_samples_at_all_have_nothing_to_differ(tmp_path, rollouts):
    """Pins the empty cases: no response token (or no sample) is a mean and largest difference of 0,
    not a failure or NaN."""
    empty = _emptied(rollouts, range(rollouts.num_rows))
    report, text = _verdict(tmp_path, empty, empty, Forced(_shifted(1.0), TOL))
    assert "mean difference 0.00e+00 (tolerance 1e-03), max 0.00e+00" in text and report.match
    none = rollouts.slice(0, 0)
    report, text = _verdict(tmp_path / "none", none, none, Forced(_shifted(1.0), TOL))
    assert "mean difference 0.00e+00" in text and report.match


def test_the_sample_named_is_the_one_that_differs_not_one_without_tokens(tmp_path, rollouts):
    row = _first_nonempty(rollouts) + 2
    table = _emptied(rollouts, {0, 1})
    report, text = _verdict(tmp_path, table, _one_token_changed(table), Forced(_shifted(0.5, row), 1e-3))
    r = table.slice(row, 1).to_pylist()[0]
    assert not report.match
    name = f"{r['split']} prompt {r['prompt_index']} sample {r['sample_index']}"
    line = f"teacher-forced logprobs beyond the tolerance across environments: worst at {name}"
    assert line in text.splitlines()


def test_on_the_same_environment_tokens_must_agree_and_nothing_is_teacher_forced(tmp_path, rollouts):
    """Pins: teacher forcing on the same environment too, where a changed token is a real change."""
    def refuse(rows):
        raise AssertionError("teacher-forced on the same environment")

    report, text = _verdict(tmp_path, rollouts, _one_token_changed(rollouts), Forced(refuse, TOL), env_b=CPU2)
    assert "environment: the same" in text and not report.match and "judged across" not in text


def test_another_sample_count_differs_on_any_environment(tmp_path, rollouts):
    report, text = _verdict(tmp_path, rollouts, rollouts.slice(1), Forced(_shifted(0.0), TOL))
    n = rollouts.num_rows
    assert not report.match and f"samples: {n} in the original, {n - 1} in the replay" in text


def test_the_tolerance_is_the_runs_sampler_tolerance():
    def exp(dtype, setting):
        return SimpleNamespace(model=SimpleNamespace(dtype=dtype),
                               update=SimpleNamespace(sampler_mismatch_tol=setting))

    assert replay_forced.for_replay(None, exp("float32", 0.0)).tol == 1e-3
    assert replay_forced.for_replay(None, exp("bfloat16", 0.0)).tol == 5e-2
    assert replay_forced.for_replay(None, exp("bfloat16", 3e-3)).tol == 3e-3


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():  # far from uniform logits, so a temperature shows
        torch.nn.init.normal_(p, std=0.5)
    path = tmp_path_factory.mktemp("policy")
    model.save_pretrained(path)
    return path


def test_teacher_forcing_scores_each_response_token_at_the_temperature_it_was_drawn_at(tiny_policy):
    """Pins `replay_forced.logprobs`: the response's tokens only (not the prompt's), under
    softmax(logits / temperature) for training samples and unscaled for the greedy ones
    (validation, ReMax's baseline: vLLM's greedy logprobs), independent of the batch size; an
    empty response has none."""
    exp = SimpleNamespace(model=SimpleNamespace(dtype="float32", attn_implementation="auto"),
                          generate=SimpleNamespace(temperature=0.7),
                          update=SimpleNamespace(sampler_mismatch_tol=0))
    g = torch.Generator().manual_seed(1)
    shapes = [("train", 5, 3), ("val", 3, 4), ("train", 2, 7), ("baseline", 4, 2), ("train", 4, 0)]
    rows = [{"split": split, "prompt_ids": torch.randint(64, (p,), generator=g).tolist(),
             "response_ids": torch.randint(64, (r,), generator=g).tolist()} for split, p, r in shapes]
    model = policy_model.load_causal_lm(tiny_policy, torch.float32).eval()

    def expected(row, temperature):
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / temperature, dim=-1)
        whole = logp.gather(1, ids[0, 1:, None])[:, 0].tolist()
        return whole[len(whole) - len(row["response_ids"]):]

    want = [expected(r, 0.7 if r["split"] == "train" else 1.0) for r in rows]
    for batch in (1, 8):
        got = replay_forced.logprobs(tiny_policy, exp, rows, batch=batch)
        assert [len(x) for x in got] == [3, 4, 7, 2, 0]
        assert all(a == pytest.approx(b, abs=1e-5) for x, y in zip(got, want, strict=True)
                   for a, b in zip(x, y, strict=True))
    assert want[0] != pytest.approx(expected(rows[0], 1.0), abs=1e-3)  # the temperature shows
    exp.generate.temperature = 0.0  # greedy training samples: unscaled too
    greedy = replay_forced.logprobs(tiny_policy, exp, rows[:2])
    assert greedy[0] == pytest.approx(expected(rows[0], 1.0), abs=1e-5)
    assert replay_forced.for_replay(tiny_policy, exp).score(rows[:2]) == greedy


def test_the_policy_is_loaded_as_the_run_loads_it(tiny_policy, monkeypatch):
    """The run's model.dtype and model.attn_implementation reach the loader."""
    seen = []
    load = policy_model.load_causal_lm

    def spy(path, dtype, attn, **kwargs):
        seen.append((path, dtype, attn))
        return load(path, dtype, attn, **kwargs)

    monkeypatch.setattr(policy_model, "load_causal_lm", spy)
    exp = SimpleNamespace(model=SimpleNamespace(dtype="bfloat16", attn_implementation="eager"),
                          generate=SimpleNamespace(temperature=1.0))
    row = {"split": "train", "prompt_ids": [1, 2], "response_ids": [3]}
    assert replay_forced.logprobs(tiny_policy, exp, [row])
    assert seen == [(tiny_policy, torch.bfloat16, "eager")]
