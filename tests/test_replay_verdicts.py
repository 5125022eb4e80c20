"""Replay verdicts on outputs that really differ: one token, one logprob, one reward, one weight.

Each test commits an original stage output and a replayed one that differs from it in exactly
one place (through hpcrl.commit, like the stages), and checks that `replay.compare` says
"DIFFERENT" and names what differs, and that a difference within tolerance is still a match.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from hpcrl import commit, replay
from tests import synthetic_run


def _commit(stage_dir, tables: dict[str, pa.Table], policy: dict[str, torch.Tensor] | None = None):
    writer = commit.StageWriter(commit.fresh_temp_dir(stage_dir))
    for name, table in tables.items():
        writer.write_table(name, table)
    if policy is not None:
        (writer.dir / "policy").mkdir()
        save_file(policy, str(writer.dir / "policy" / "model.safetensors"))
    commit.commit(stage_dir, writer, {"stage": stage_dir.name})
    return stage_dir


def _verdict(original, replayed, stage) -> tuple[replay.Report, str]:
    report = replay.compare(original, replayed, stage)
    return report, replay.format_report(report, original, replayed, {})


@pytest.fixture
def rollouts() -> pa.Table:
    return synthetic_run.rollouts_table(0, n_train=16, n_val=4, group_size=4, max_tokens=8)


def _with_row(table: pa.Table, column: str, row: int, change) -> pa.Table:
    values = table[column].to_pylist()
    values[row] = change(values[row])
    return table.set_column(table.schema.get_field_index(column), column,
                            pa.array(values, table.schema.field(column).type))


def _first_nonempty(table: pa.Table) -> int:
    return next(i for i, ids in enumerate(table["response_ids"].to_pylist()) if ids)


def _name(table: pa.Table, row: int) -> str:
    r = table.slice(row, 1).to_pylist()[0]
    return f"{r['split']} prompt {r['prompt_index']} sample {r['sample_index']}"


def test_generate_replay_of_identical_rollouts_is_byte_identical(tmp_path, rollouts):
    a = _commit(tmp_path / "a" / "generate", {"rollouts": rollouts})
    b = _commit(tmp_path / "b" / "generate", {"rollouts": rollouts})
    report, text = _verdict(a, b, "generate")
    assert report.identical and report.match and text.endswith("verdict: MATCH: byte-identical")
    assert f"token agreement: {rollouts.num_rows}/{rollouts.num_rows} samples identical" in text


def test_one_other_token_makes_a_generate_replay_differ_and_names_the_sample(tmp_path, rollouts):
    """Pins: a generate verdict that ignores token agreement (it compared logprobs only on the
    samples whose tokens agree, so one changed token left nothing to compare)."""
    row = _first_nonempty(rollouts)
    changed = _with_row(rollouts, "response_ids", row, lambda ids: [ids[0] + 1, *ids[1:]])
    a = _commit(tmp_path / "a" / "generate", {"rollouts": rollouts})
    b = _commit(tmp_path / "b" / "generate", {"rollouts": changed})
    report, text = _verdict(a, b, "generate")
    assert not report.match and text.endswith("verdict: DIFFERENT")
    n = rollouts.num_rows
    assert f"token agreement: {n - 1}/{n} samples identical" in text
    assert f"first sample with other tokens: {_name(rollouts, row)}" in text


@pytest.mark.parametrize("shift, match", [(5e-3, False), (1e-5, True)])
def test_generate_logprobs_are_judged_against_the_tolerance(tmp_path, rollouts, shift, match):
    """Pins: the logprob tolerance (1e-3) dropped or inverted. Same tokens, one logprob moved by
    more than the tolerance: different, naming the sample; moved by less: a match."""
    row = _first_nonempty(rollouts)
    changed = _with_row(rollouts, "logprobs", row, lambda lp: [lp[0] + shift, *lp[1:]])
    a = _commit(tmp_path / "a" / "generate", {"rollouts": rollouts})
    b = _commit(tmp_path / "b" / "generate", {"rollouts": changed})
    report, text = _verdict(a, b, "generate")
    assert not report.identical and report.match is match
    assert text.endswith("verdict: MATCH within tolerance" if match else "verdict: DIFFERENT")
    assert ("logprobs beyond the tolerance 1e-03: worst at " + _name(rollouts, row) in text) is not match


def test_one_other_reward_makes_a_score_replay_differ_and_names_the_sample(tmp_path, rollouts):
    rewards = synthetic_run.exact_match_rewards(rollouts)
    original = synthetic_run.scores_table(rollouts, rewards.copy())  # the table shares a numpy array's memory
    rewards[3] = 1.0 - rewards[3]
    a = _commit(tmp_path / "a" / "score", {"scores": original})
    b = _commit(tmp_path / "b" / "score", {"scores": synthetic_run.scores_table(rollouts, rewards)})
    report, text = _verdict(a, b, "score")
    assert not report.match and text.endswith("verdict: DIFFERENT")
    n = rollouts.num_rows
    assert "differing files: scores.parquet" in text and f"scores: {n - 1}/{n} samples identical" in text
    assert (f"first sample scored differently: {_name(rollouts, 3)}: "
            f"reward {1.0 - rewards[3]} -> {rewards[3]}") in text


def _stats(losses: list[float]) -> pa.Table:
    return pa.table({"step": pa.array(range(len(losses)), pa.int32()), "loss": losses})


@pytest.fixture
def policy() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(16, 8, generator=g),
            "layers.0.mlp.weight": torch.randn(8, 8, generator=g)}


def _commit_update(root, policy, losses):
    writer = commit.StageWriter(commit.fresh_temp_dir(root / "update"))
    writer.tables["stats"] = {"file": "stats.parquet", "rows": len(losses), "schema": "stats"}
    import pyarrow.parquet as pq

    pq.write_table(_stats(losses), writer.dir / "stats.parquet")
    (writer.dir / "policy").mkdir()
    save_file(policy, str(writer.dir / "policy" / "model.safetensors"))
    commit.commit(root / "update", writer, {"stage": "update"})
    return root / "update"


@pytest.mark.parametrize("shift, match", [(1e-3, False), (5e-7, True)])
def test_one_weight_beyond_the_tolerance_makes_an_update_replay_differ_and_names_the_tensor(
        tmp_path, policy, shift, match):
    """Pins: an update verdict that ignores the weight tolerance (always a match), or one that
    demands bit-identity. One weight moved by 1e-3 is different and the tensor is named; by
    5e-7 (float32 noise at this scale) it is a match within tolerance."""
    a = _commit_update(tmp_path / "a", policy, [0.5, 0.25])
    moved = {k: v.clone() for k, v in policy.items()}
    moved["layers.0.mlp.weight"][2, 3] += shift
    b = _commit_update(tmp_path / "b", moved, [0.5, 0.25])
    assert load_file(b / "policy" / "model.safetensors")["layers.0.mlp.weight"][2, 3] != policy[
        "layers.0.mlp.weight"][2, 3]
    report, text = _verdict(a, b, "update")
    assert not report.identical and report.match is match
    assert text.endswith("verdict: MATCH within tolerance" if match else "verdict: DIFFERENT")
    assert "(in layers.0.mlp.weight)" in text
    assert ("beyond the weight tolerance 1e-06: 1 of 2 tensors" in text) is not match


@pytest.mark.parametrize("loss, match", [(0.125, False), (0.25 + 1e-9, True)])
def test_an_update_replay_with_other_losses_differs_and_says_so(tmp_path, policy, loss, match):
    """Same weights, one step's loss different beyond the tolerance: different (the update did
    not compute what it committed); within float noise: a match."""
    a = _commit_update(tmp_path / "a", policy, [0.5, 0.25])
    b = _commit_update(tmp_path / "b", policy, [0.5, loss])
    report, text = _verdict(a, b, "update")
    assert report.match is match
    assert f"per-step loss: max difference {abs(loss - 0.25):.2e}" in text
    assert ("per-step loss beyond the tolerance 1e-06" in text) is not match
