"""An update replayed on other hardware (another device, core or thread count, torch version):
`replay.compare` sees the environments differ in the manifests and judges the losses and the
weight update as a whole instead of every weight within 1e-6, which only a replay on the same
environment can meet. Each test commits a synthetic original and replay (through hpcrl.commit)
with the policy they started from."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from hpcrl import commit, replay

CPU2 = {"utilisation": {"device_type": "cpu", "devices": 2}, "device": {"name": "Xeon", "threads": 2},
        "world_size": 1, "packages": {"torch": "2.13.0"}}
CPU1 = {**CPU2, "utilisation": {"device_type": "cpu", "devices": 1}, "device": {"name": "Xeon", "threads": 1}}


def _commit_update(root, policy: dict, losses: list[float], env: dict):
    writer = commit.StageWriter(commit.fresh_temp_dir(root / "update"))
    writer.tables["stats"] = {"file": "stats.parquet", "rows": len(losses), "schema": "stats"}
    pq.write_table(pa.table({"step": pa.array(range(len(losses)), pa.int32()), "loss": losses}),
                   writer.dir / "stats.parquet")
    (writer.dir / "policy").mkdir()
    save_file(policy, str(writer.dir / "policy" / "model.safetensors"))
    commit.commit(root / "update", writer, {"stage": "update", **env})
    return root / "update"


@pytest.fixture
def start(tmp_path):
    """The policy both updates started from, in a folder of its own (as `run.policy_dir` gives)."""
    g = torch.Generator().manual_seed(0)
    weights = {"embed.weight": torch.randn(16, 8, generator=g), "mlp.weight": torch.randn(8, 8, generator=g)}
    (tmp_path / "start").mkdir()
    save_file(weights, str(tmp_path / "start" / "model.safetensors"))
    return tmp_path / "start", weights


def _step(weights: dict, scale: float, seed: int = 1) -> dict:
    """An update of the weights: each moved by `scale` x a fixed random direction."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def _verdict(tmp_path, start_dir, a_policy, b_policy, a_losses, b_losses, env_b=CPU1, bits=None,
             with_start=True):
    """compare's report and text; `bits` None: compare's default precision class (32)."""
    a = _commit_update(tmp_path / "a", a_policy, a_losses, CPU2)
    b = _commit_update(tmp_path / "b", b_policy, b_losses, env_b)
    start = start_dir if with_start else None
    args = (a, b, "update", start) if bits is None else (a, b, "update", start, bits)
    report = replay.compare(*args)
    return report, replay.format_report(report, a, b, {}).splitlines()


def test_environment_changes_name_what_differs_and_leave_out_what_is_not_recorded():
    """Pins `environment_changes`: each recorded difference as 'key old -> new', in a fixed order;
    a key one manifest lacks (an older run's) is not a difference."""
    other = {"utilisation": {"device_type": "gpu", "devices": 8},
             "device": {"name": "NVIDIA H200", "threads": 2}, "world_size": 8, "packages": {}}
    assert replay.environment_changes(CPU2, CPU1) == ["devices 2 -> 1", "threads 2 -> 1"]
    assert replay.environment_changes(CPU2, other) == ["device type cpu -> gpu", "devices 2 -> 8",
                                                      "device Xeon -> NVIDIA H200", "ranks 1 -> 8"]
    assert replay.environment_changes(CPU2, {**CPU2, "packages": {"torch": "2.14.0"}}) == [
        "torch 2.13.0 -> 2.14.0"]
    assert replay.environment_changes(CPU2, CPU2) == []
    assert replay.environment_changes({}, CPU1) == []


def test_float_noise_across_environments_is_a_match_and_the_same_noise_on_one_environment_is_not(
        tmp_path, start):
    """An update that another environment computed with float noise (1e-3 of the update, weights
    1e-5 apart, losses 1e-6 apart) is a match, with the environments named; the same pair on one
    environment is different: a replay there must agree within 1e-6."""
    start_dir, weights = start
    a = _step(weights, 1e-2)
    b = {k: v + 1e-5 * torch.sign(v) for k, v in a.items()}
    report, lines = _verdict(tmp_path, start_dir, a, b, [0.5, 0.25], [0.5, 0.25 + 1e-6])
    assert report.match and not report.identical and lines[-1] == "verdict: MATCH within tolerance"
    assert "environment: devices 2 -> 1, threads 2 -> 1" in lines
    rel = next(x for x in lines if x.startswith("weight update:"))
    assert 1e-4 < float(rel.split("by ")[1].split()[0]) < 2e-3
    same, same_lines = _verdict(tmp_path / "same", start_dir, a, b, [0.5, 0.25], [0.5, 0.25 + 1e-6],
                                env_b=CPU2)
    assert not same.match and "environment: the same" in same_lines
    assert not any(x.startswith("weight update:") for x in same_lines)


def test_a_doubled_update_across_environments_is_different(tmp_path, start):
    """Pins the update's judgement: a replay whose update is twice the original's (a doubled
    learning rate), with the same losses, is 1.0 of the update apart and different."""
    start_dir, weights = start
    a, b = _step(weights, 1e-2), _step(weights, 2e-2)
    report, lines = _verdict(tmp_path, start_dir, a, b, [0.5, 0.25], [0.5, 0.25])
    assert not report.match and lines[-1] == "verdict: DIFFERENT"
    assert "weight update: the replay's differs from the original's by 1.00e+00 of its size" in lines
    assert "weight update beyond the tolerance across environments (5%)" in lines


@pytest.mark.parametrize("losses, match", [([0.5, 0.25 + 2e-4], False), ([0.5, 0.25 + 5e-5], True),
                                           ([10.0, 0.25], True), ([10.002, 0.25], False),
                                           ([0.5, 0.25, 0.125], False)])
def test_losses_across_environments_are_judged_relative_to_their_size(tmp_path, start, losses, match):
    """Pins the loss tolerance across environments: 1e-4 x max(1, |loss|) per step (a loss of 10
    may move by 1e-3, one of 0.25 by 1e-4), and the same number of steps."""
    start_dir, weights = start
    a = _step(weights, 1e-2)
    original = [10.0005 if losses[0] >= 10 else 0.5, 0.25]
    report, lines = _verdict(tmp_path, start_dir, a, a, original, losses)
    assert report.match is match
    assert ("per-step loss beyond the tolerance across environments "
            f"(2 and {len(losses)} steps)" in lines) is not match


def test_exactly_at_the_tolerances_across_environments_is_within_them(tmp_path):
    """Pins both bounds as 'at most': a step's loss 1e-4 from 0 (exact in float64), and an update
    of 20 that the replay makes 21 (sqrt(1 / 400): exactly 0.05 in float64)."""
    (tmp_path / "s").mkdir()
    save_file({"w": torch.zeros(1, dtype=torch.float64)}, str(tmp_path / "s" / "model.safetensors"))
    a, b = {"w": torch.tensor([20.0], dtype=torch.float64)}, {"w": torch.tensor([21.0], dtype=torch.float64)}
    report, lines = _verdict(tmp_path, tmp_path / "s", a, b, [0.0, 0.5], [1e-4, 0.5])
    assert report.match, lines
    assert "weight update: the replay's differs from the original's by 5.00e-02 of its size" in lines
    assert not any("beyond the tolerance" in line for line in lines)


def test_across_environments_an_update_without_its_starting_policy_is_not_judged_a_match(tmp_path, start):
    """Fails closed: without the policy the update started from, the weights cannot be judged
    across environments, so equal losses alone are not a match."""
    start_dir, weights = start
    a = _step(weights, 1e-2)
    b = {k: v + 1e-7 for k, v in a.items()}
    report, lines = _verdict(tmp_path, start_dir, a, b, [0.5], [0.5], with_start=False)
    assert not report.identical
    assert not report.match
    assert "weight update: not judged without the policy the update started from" in lines


def test_a_tensor_of_another_shape_across_environments_differs_and_is_named(tmp_path, start):
    """A shape mismatch is an infinite difference on any environment: named, and no update
    agreement computed (b - a of two shapes would broadcast or raise)."""
    start_dir, weights = start
    a = _step(weights, 1e-2)
    b = {**a, "mlp.weight": a["mlp.weight"][:, :4].clone()}
    report, lines = _verdict(tmp_path, start_dir, a, b, [0.5], [0.5])
    assert not report.match and "policy weights: max difference inf (in mlp.weight)" in lines
    assert "weight update: not judged between tensors of other shapes" in lines


def test_16_bit_models_allow_a_wider_update_gap(tmp_path, start):
    """Pins the precision classes: an update 0.3 of its size apart is different in float32 and a
    match in 16 bits (whose saved weights round updates of this size)."""
    start_dir, weights = start
    a = _step(weights, 1e-2)
    b = {k: weights[k] + 1.3 * (v - weights[k]) for k, v in a.items()}
    assert not _verdict(tmp_path / "32", start_dir, a, b, [0.5], [0.5])[0].match  # float32 by default
    assert _verdict(tmp_path / "16", start_dir, a, b, [0.5], [0.5], bits=16)[0].match
    assert (replay.bits("float32"), replay.bits("bfloat16"), replay.bits("float16")) == (32, 16, 16)


def test_update_disagreement_reads_every_shard_and_sizes_the_update_by_the_shared_names(tmp_path):
    """Pins `update_disagreement` by hand: |b - a| over every tensor, |a - start| over the tensors
    the start's shards hold under the same name and shape: sqrt(1 / (1 + 1))."""
    a = {"x": torch.tensor([1.0, 1.0]), "y": torch.tensor([2.0]), "new": torch.tensor([5.0])}
    b = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([2.0]), "new": torch.tensor([5.0])}
    (tmp_path / "s").mkdir()
    save_file({"x": torch.tensor([0.0, 1.0])}, str(tmp_path / "s" / "model-00001-of-00002.safetensors"))
    save_file({"y": torch.tensor([1.0]), "new": torch.zeros(3)},
              str(tmp_path / "s" / "model-00002-of-00002.safetensors"))
    assert replay.update_disagreement(a, b, tmp_path / "s") == pytest.approx(0.5 ** 0.5)
    assert replay.update_disagreement(a, a, tmp_path / "s") == 0.0
    (tmp_path / "empty").mkdir()
    assert replay.update_disagreement(a, b, tmp_path / "empty") == float("inf")
    assert replay.update_disagreement(a, a, tmp_path / "empty") == 0.0
