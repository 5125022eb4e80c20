"""PPO with a critic end to end in the resident mode: a 2-iteration run of the tiny task, then the
same run continued for a third iteration by a fresh job that loads the saved critic, its DeepSpeed
state and the KL controller's coefficient from the run directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from hpcrl import batches, commit, config
from hpcrl.batches import micro_batches, response_values
from hpcrl.rundir import RunDir

pytestmark = pytest.mark.timeout(900)  # about 90 s on 2 CPU cores

PPO = {"name": "ppo", "critic": {"gamma": 0.9, "lam": 0.8, "lr": 1e-3},
       "kl": {"mode": "reward", "estimator": "k1", "coef": 0.05, "target": 0.5, "horizon": 100.0}}
CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean",
                  "critic/kl_coef", "critic/grad_norm", "actor/reward_kl_penalty")


def _submit(path) -> str:
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(path)], capture_output=True,
                         text=True, timeout=800)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, tiny_task):
    import tests.conftest as c

    root = tmp_path_factory.mktemp("ppo")
    path = root / "ppo.toml"
    path.write_text(c.experiment_toml(tiny_task, root / "runs", "ppo", algorithm=PPO,
                                      executor={"mode": "resident"}))
    out = _submit(path)
    return RunDir.at(root / "runs" / "ppo"), path, out


def test_critic_metrics_are_logged_finite_each_iteration(ppo_run):
    run, _, out = ppo_run
    for k in (0, 1):
        metrics = commit.read_manifest(run.stage_dir(k, "update"))["metrics"]
        for key in CRITIC_METRICS:
            assert math.isfinite(metrics[key]), (k, key, metrics.get(key))
        stats = commit.read_table(run.stage_dir(k, "update"), "stats").to_pylist()
        assert all(s["vf_loss"] > 0 and s["pg_loss"] is not None for s in stats)
    assert "run complete" in out


def _numpy_gae(outcome: float, old, ref, values, coef: float, gamma: float, lam: float):
    """The PPO targets of one response, written out independently of hpcrl: k1 KL penalty on each
    token, the outcome on the last, GAE backwards from a value of 0 after the last token."""
    rewards = -coef * (np.asarray(old, np.float64) - np.asarray(ref, np.float64))
    rewards[-1] += outcome
    v = np.append(np.asarray(values, np.float64), 0.0)
    adv, last = np.zeros(len(rewards)), 0.0
    for t in reversed(range(len(rewards))):
        last = rewards[t] + gamma * v[t + 1] - v[t] + gamma * lam * last
        adv[t] = last
    return adv, adv + v[:-1]


def test_committed_advantages_and_returns_equal_an_independent_gae(ppo_run):
    """The update's committed token advantages and returns, recomputed in numpy from its own
    committed inputs (rewards, old and reference logprobs, the critic's values, the KL
    coefficient it used), with gamma 0.9 and lambda 0.8 and the batch whitening of the advantages."""
    run, _, _ = ppo_run
    for k in (0, 1):
        d = run.stage_dir(k, "update")
        table = commit.read_table(d, "advantages").to_pylist()
        scores = commit.read_table(run.stage_dir(k, "score"), "scores").to_pylist()
        reward = {(r["split"], r["prompt_index"], r["sample_index"]): r["reward"] for r in scores}
        coef = json.loads((d / "kl_control.json").read_text())["kl_coef"]
        assert coef > 0
        advs, rets = [], []
        for row in table:
            if not row["old_logprobs"]:
                continue
            adv, ret = _numpy_gae(reward[row["split"], row["prompt_index"], row["sample_index"]],
                                  row["old_logprobs"], row["ref_logprobs"], row["values"], coef,
                                  PPO["critic"]["gamma"], PPO["critic"]["lam"])
            np.testing.assert_allclose(row["returns"], ret, atol=1e-5)
            advs.append(adv)
            rets.append(row)
        flat = np.concatenate(advs)
        whitened = (flat - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8)
        committed = np.concatenate([r["token_advantages"] for r in rets])
        np.testing.assert_allclose(committed, whitened, atol=1e-4)
        assert abs(committed.mean()) < 1e-5 and committed.std(ddof=1) == pytest.approx(1.0, abs=1e-4)


def test_the_saved_critic_is_the_live_one(ppo_run):
    """Iteration 1's values were computed by the resident trainer's critic in memory; the critic
    saved by iteration 0's update, loaded from disk, gives the same values."""
    from transformers import AutoTokenizer

    from hpcrl.critic import load_value_model

    run, path, _ = ppo_run
    exp = config.load(path)
    assert (run.critic_dir(2, "") / "value_head.safetensors").is_file()
    assert (run.critic_state_dir(2) / "latest").is_file()
    samples = batches.load_samples(commit.read_table(run.stage_dir(1, "generate"), "rollouts"),
                                   commit.read_table(run.stage_dir(1, "score"), "scores"))
    model = load_value_model(run.critic_dir(1, exp.model.path), torch.float32).eval()
    pad = AutoTokenizer.from_pretrained(exp.model.path).pad_token_id
    recorded = commit.read_table(run.stage_dir(1, "update"), "advantages")["values"].to_pylist()
    assert any(any(v) for v in recorded)  # the critic trained in iteration 0 predicts something
    with torch.no_grad():
        for mb in micro_batches(samples, list(range(len(samples))), 16, pad):  # plain rows: no shared prompts
            values = model(mb.input_ids, mb.attention_mask).values[:, :-1]
            for i, v in zip(mb.index.tolist(), response_values(values, mb), strict=True):
                np.testing.assert_allclose(v, recorded[i], atol=1e-5)


def test_a_continued_run_loads_the_critic_and_the_kl_coefficient(ppo_run, tmp_path):
    """Continued on a copy of the run (the module's run stays as the other tests read it)."""
    import shutil

    original, path, _ = ppo_run
    old_root, new_root = str(original.root.parent), str(tmp_path / "runs")
    shutil.copytree(original.root, tmp_path / "runs" / "ppo", symlinks=True)
    run = RunDir.at(tmp_path / "runs" / "ppo")
    run.config_path.write_text(run.config_path.read_text().replace(old_root, new_root))
    text = path.read_text().replace(old_root, new_root).replace("iterations = 2", "iterations = 3")
    assert "iterations = 3" in text and new_root in text
    continued = tmp_path / "ppo.toml"
    continued.write_text(text)
    # a new resident job: a fresh Actor loads policy, critic and their DeepSpeed state (v2)
    _submit(continued)
    assert not original.stage_dir(2, "update").exists()
    before = json.loads((run.stage_dir(1, "update") / "kl_control.json").read_text())
    after = json.loads((run.stage_dir(2, "update") / "kl_control.json").read_text())
    # the controller moved, and resumed
    assert after["kl_coef"] == before["next_kl_coef"] != PPO["kl"]["coef"]
    metrics = commit.read_manifest(run.stage_dir(2, "update"))["metrics"]
    assert all(math.isfinite(metrics[key]) for key in CRITIC_METRICS)
    assert (run.critic_dir(3, "") / "model.safetensors").is_file()
