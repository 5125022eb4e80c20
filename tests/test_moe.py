"""Mixture-of-experts routing in the update (hpcrl.moe): the load-balancing loss is transformers'
own, the routing tally is the same with and without shared prompts, and the load statistics say
what they claim."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from hpcrl import moe, policy_model
from hpcrl.batches import Samples, collate, response_outputs
from tests.conftest import load_tool

tiny_models = load_tool("tiny_models")


def test_the_aux_loss_is_transformers_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    layers = tuple(torch.randn(2 * 7, 5, generator=g) * 2 for _ in range(3))
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0  # padding
    ours = moe.router_load(layers, mask, k=2).aux_loss()
    theirs = load_balancing_loss_func(layers, 5, 2, mask)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    # padding is excluded: the same loss from the unpadded tokens alone
    kept = tuple(t[mask.reshape(-1).bool()] for t in layers)
    unpadded = moe.router_load(kept, torch.ones(11), k=2).aux_loss()
    assert unpadded.item() == pytest.approx(ours.item(), rel=1e-6)


def test_load_statistics_name_the_busy_and_the_idle_expert():
    # 3 experts, top-1, 6 tokens: expert 0 takes 4, expert 1 takes 2, expert 2 none
    logits = torch.tensor([[5.0, 0, 0]] * 4 + [[0, 5.0, 0]] * 2)
    load = moe.router_load((logits,), torch.ones(6), k=1)
    stats = moe.load_stats(load.assigned)
    assert stats["expert_load"] == [pytest.approx([2.0, 1.0, 0.0])]  # relative to an even 2 tokens each
    assert (stats["moe_load_max"], stats["moe_load_min"]) == (2.0, 0.0)
    even = moe.router_load((torch.eye(3).repeat(2, 1) * 5,), torch.ones(6), k=1)
    assert moe.load_stats(even.assigned)["expert_load"] == [pytest.approx([1.0, 1.0, 1.0])]
    assert even.aux_loss().item() < load.aux_loss().item()


def _samples(prompts: list[list[int]], responses: list[list[int]]) -> Samples:
    n = len(responses)
    return Samples(pa.table({"i": list(range(n))}), prompts, responses, [[0.0] * len(r) for r in responses],
                   torch.zeros(n), torch.tensor([i // 2 for i in range(n)]))


def test_shared_prompts_tally_the_routing_of_whole_rows(tiny_task, tmp_path):
    model = policy_model.load_causal_lm(tiny_models.build("qwen3_moe", tmp_path / "m", tiny_task / "model"),
                                        torch.float32)
    tally = moe.RouterTally(model, moe.top_k(model.config))
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10]]  # two groups of two
    samples = _samples(prompts, [[11, 12, 13], [14, 15], [16], [17, 18, 19]])
    rows = list(range(4))
    tallies = {}
    for shared in (False, True):
        logits = response_outputs(model, collate(samples, rows, 0, shared), tally=tally)
        tallies[shared] = (tally.take(), logits)
    plain, shared = tallies[False][0], tallies[True][0]
    assert torch.equal(plain.assigned, shared.assigned)
    assert plain.tokens == shared.tokens == 4 + 3 + 4 + 2 + 2 + 1 + 2 + 3
    assert torch.allclose(plain.probs, shared.probs, atol=1e-5)
    assert shared.aux_loss().item() == pytest.approx(plain.aux_loss().item(), rel=1e-5)
    # the plain layout's loss is the one the model itself reports for the same tokens
    mb = collate(samples, rows, 0, False)
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, output_router_logits=True)
    assert plain.aux_loss().item() == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert tally.load is None  # the hooks record only inside `routed`
    shared.aux_loss().backward()  # differentiable into the router
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_dense_models_have_no_router(tiny_task):
    model = policy_model.load_causal_lm(tiny_task / "model", torch.float32)
    assert moe.top_k(model.config) is None
    assert moe.is_moe_config({"num_experts_per_tok": 2}) and not moe.is_moe_config({"hidden_size": 8})
