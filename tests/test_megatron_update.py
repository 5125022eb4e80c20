"""The Megatron-Core update backend (hpcrl.megatron_actor) against the DeepSpeed one: one update
stage of the same batch through the local executor, its statistics and its saved policy."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from hpcrl import commit, config
from tests.test_update_deepspeed import _run_update, _weights

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def deepspeed_one_rank(tmp_path_factory, tiny_task):
    import tests.conftest as c

    root = tmp_path_factory.mktemp("ds")

    def write(name, **sections):
        path = root / f"{name}.toml"
        path.write_text(c.experiment_toml(tiny_task, root / "runs", name, **sections))
        return path

    return _run_update(write, "ds", share_prompts=False, world_size=1)


@pytest.mark.parametrize(("tp", "pp", "world", "distributed"), [(2, 2, 4, False), (2, 1, 4, True)],
                         ids=["tp2-pp2", "tp2-dp2-distopt"])
def test_a_megatron_update_is_the_deepspeed_update(write_experiment, deepspeed_one_rank, tp, pp, world,
                                                   distributed, tmp_path):
    """The same loss, statistics and gradient norm in each of the 2 optimizer steps, and the same
    updated weights, with tensor x pipeline parallelism (the tiny model's 275-token vocabulary
    padded to 276 over two ranks) and with data parallelism and the distributed optimizer. pins: a
    loss scaled by the micro-batches or ranks Megatron averages over, stages that exchange the
    wrong activations, logits of the padding rows in the softmax, a conversion that loads or saves a
    weight in the wrong place. The TP x PP update replays byte for byte."""
    run = _run_update(write_experiment, f"mg-{tp}-{pp}", world_size=world, backend="megatron",
                      megatron={"tensor_parallel": tp, "pipeline_parallel": pp,
                                "distributed_optimizer": distributed})
    stats = commit.read_table(run.stage_dir(0, "update"), "stats").to_pylist()
    ref = commit.read_table(deepspeed_one_rank.stage_dir(0, "update"), "stats").to_pylist()
    assert len(stats) == len(ref) == 2
    for a, b in zip(stats, ref, strict=True):
        for key in ("loss", "pg_loss", "entropy", "ppo_kl", "pg_clipfrac", "is_weight_mean", "is_weight_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]
    mine, theirs = _weights(run), _weights(deepspeed_one_rank)
    assert mine.keys() == theirs.keys()
    base = load_file(run.policy_dir(0, config.load(run.config_path).model.path) / "model.safetensors")
    assert any(not torch.equal(mine[k], base[k]) for k in mine)  # the update moved the policy
    lr = config.load(run.config_path).update.lr
    diffs = torch.cat([(mine[k] - theirs[k]).abs().flatten() for k in theirs])
    assert diffs.max() < 0.5 * lr and diffs.mean() < 1e-3 * lr
    old = commit.read_table(run.stage_dir(0, "update"), "advantages").column("old_logprobs").to_pylist()
    want = commit.read_table(deepspeed_one_rank.stage_dir(0, "update"), "advantages").column("old_logprobs")
    assert [pytest.approx(o, abs=1e-5) for o in want.to_pylist()] == old
    if pp > 1:  # a Megatron update replays to the byte (hpcrl replay: the same layout, offline)
        out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "replay", str(run.root), "--iteration", "0",
                              "--stage", "update", "--out", str(tmp_path / "replay")],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "verdict: MATCH: byte-identical" in out.stdout, out.stdout


def test_the_demo_learns_on_the_megatron_backend_in_the_resident_mode(tiny_task, tmp_path):
    """configs/demo.toml (resident) with update.backend = "megatron", tensor parallel 2: it meets the
    demo's learning acceptance, and each update's weights reach vLLM through the sync (gathered
    from both ranks, renamed to the checkpoint's names), which the probe checks after every update.
    pins: a sync that sends a rank's shard or the padded vocabulary, a probe computed on stale
    weights."""
    from hpcrl import commit
    from tests.test_demos import assert_learns, run_demo, run_of

    exp, table, out = run_demo("demo.toml", tiny_task, tmp_path, update__backend="megatron",
                               update__world_size=2, update__megatron__tensor_parallel=2)
    assert exp.update.backend == "megatron" and exp.executor.mode == "resident"
    assert_learns(exp, table)
    run = run_of(tmp_path)
    synced = commit.read_manifest(run.stage_dir(1, "generate"))["metrics"]
    assert synced["sync/logp_diff"] < 1e-4 < synced["sync/update_shift"]
