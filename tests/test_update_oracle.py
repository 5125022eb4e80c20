"""One real update step (DeepSpeed, through the stage job) against an independent computation.

The test recomputes, with transformers and a few lines of its own, what the first optimizer step
of an update must do: Dr.GRPO advantages worked out by hand from the committed rewards, the
token-mean policy-gradient loss at ratio 1, its gradient and norm, and AdamW's first step with
decoupled weight decay. It shares nothing with hpcrl's update code but the committed inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hpcrl import commit, config
from tests.test_update_deepspeed import _run_update

pytestmark = pytest.mark.timeout(900)
LR, WEIGHT_DECAY, EPS = 1e-3, 0.1, 1e-8  # torch.optim.AdamW's eps


def _advantages_by_hand(rows: list[dict], rewards: dict) -> list[float]:
    """Dr.GRPO (norm_adv_by_std = false): each reward minus its group's mean."""
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(r["prompt_index"], []).append(rewards[r["prompt_index"], r["sample_index"]])
    return [rewards[r["prompt_index"], r["sample_index"]] - float(np.mean(groups[r["prompt_index"]]))
            for r in rows]


def _gradient(model_path, rows: list[dict], adv: list[float]) -> tuple[dict, dict]:
    """(gradient, weights) by name, in float64: d/dθ of -Σ_tokens A·log π(token) / #tokens, the
    PPO-clip loss at ratio 1 (the first step of an update), token mean."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    n_tokens = sum(len(r["response_ids"]) for r in rows)
    model.zero_grad()
    for r, a in zip(rows, adv, strict=True):
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        logits = model(ids).logits[0, len(r["prompt_ids"]) - 1: -1]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(r["response_ids"])[:, None])
        (-a * logp.sum() / n_tokens).backward()
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}, \
        {n: p.detach().double().clone() for n, p in model.named_parameters()}


def test_first_update_step_equals_an_independent_gradient_and_adamw_step(write_experiment):
    """Pins the update's maths end to end with non-default settings (norm_adv_by_std = false, lr,
    weight_decay, grad_clip): a wrong advantage, sign, mask, token mean, temperature or optimizer
    wiring moves the weights away from the hand-computed step."""
    run = _run_update(write_experiment, "oracle", algorithm={"norm_adv_by_std": False}, lr=LR,
                      weight_decay=WEIGHT_DECAY, grad_clip=0.5, mini_batches=1, micro_batch_size=8)
    rows = commit.read_table(run.stage_dir(0, "generate"), "rollouts").to_pylist()
    scores = commit.read_table(run.stage_dir(0, "score"), "scores").to_pylist()
    rewards = {(s["prompt_index"], s["sample_index"]): s["reward"] for s in scores}
    adv = _advantages_by_hand(rows, rewards)
    committed = commit.read_table(run.stage_dir(0, "update"), "advantages").to_pylist()
    assert ([(c["prompt_index"], c["sample_index"]) for c in committed]
            == [(r["prompt_index"], r["sample_index"]) for r in rows])
    np.testing.assert_allclose([c["advantage"] for c in committed], adv, atol=1e-6)
    assert max(abs(a) for a in adv) > 0.1  # the batch has something to learn
    exp = config.load(run.config_path)
    grads, before = _gradient(exp.model.path, rows, adv)
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads.values())))
    stats = commit.read_table(run.stage_dir(0, "update"), "stats").to_pylist()
    assert len(stats) == 1 and norm > 0.5  # clipping is active
    assert stats[0]["grad_norm"] == pytest.approx(norm, rel=1e-4)

    after = {k: v.double()
             for k, v in load_file(run.stage_dir(0, "update") / "policy" / "model.safetensors").items()}
    largest = max(float(g.abs().max()) for g in grads.values())
    for name, g in grads.items():
        key = name if name in after else name.removeprefix("model.")
        g = g * 0.5 / (norm + 1e-6)  # DeepSpeed's gradient clipping
        expected = before[name] * (1 - LR * WEIGHT_DECAY) - LR * g / (g.abs() + EPS)
        # entries whose Adam step (about lr * g / |g|) float32 rounding of the gradient cannot move
        # by lr * 1e-3
        clear = g.abs() > 1e-4 * largest
        np.testing.assert_allclose(after[key][clear].numpy(), expected[clear].numpy(), atol=LR * 1e-3,
                                   err_msg=name)
        assert float((after[key] - expected).abs().max()) <= 2 * LR + 1e-9, name  # no step is larger than lr
