"""Micro-batches with shared prompts or packed rows give the plain layout's outputs and gradients;
packing fills a token budget; mini-batches keep groups together; ranks take contiguous shares.
The model is the tiny task's (real Qwen2)."""

from __future__ import annotations

import pytest
import torch

from hpcrl import batches, trainer
from hpcrl.batches import collate, micro_batches, padded, response_outputs, response_values
from hpcrl.critic import load_value_model


def _samples(vocab: int) -> batches.Samples:
    """Groups of 4 with prompts of 9-13 tokens and responses of 1-6 tokens; one prompt appears once."""
    g = torch.Generator().manual_seed(0)
    prompts, responses, groups = [], [], []
    for group, (length, n) in enumerate([(13, 4), (9, 4), (11, 1), (12, 4)]):
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        for s in range(n):
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (1 + (group + s) % 6,), generator=g).tolist())
            groups.append(group)
    n = len(prompts)
    return batches.Samples(None, prompts, responses, [[0.0] * len(r) for r in responses],
                           torch.zeros(n, dtype=torch.float64), torch.tensor(groups))


@pytest.fixture(scope="module")
def policy(tiny_task):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_task / "model", dtype=torch.float32)


def _logprobs_and_grads(model, mb, weights: dict[int, list[float]]):
    """Per-row response logprobs and the gradient of a weighted sum of them."""
    model.zero_grad()
    logits = response_outputs(model, mb)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.targets[..., None])[..., 0]
    (logp * padded(weights, mb) * mb.mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return dict(zip(mb.index.tolist(), response_values(logp.detach(), mb), strict=True)), grads


def test_shared_prompts_give_the_plain_logprobs_and_gradients(policy):
    samples = _samples(policy.config.vocab_size)
    rows = list(range(len(samples)))
    weights = {i: [(-1.0) ** (i + t) * (1 + t) for t in range(len(r))]
               for i, r in enumerate(samples.response_ids)}
    shared = collate(samples, rows, 0, share_prompts=True)
    # 13 rows, 4 distinct prompts
    assert shared.prompts is not None and shared.prompts.input_ids.shape[0] == 4
    _same_as_plain(policy, samples, rows, shared, weights)


def _same_as_plain(model, samples, rows, mb, weights) -> None:
    """Micro-batch `mb` of `rows` gives their plain layout's logprobs and gradients."""
    plain_lp, plain_grads = _logprobs_and_grads(model, collate(samples, rows, 0), weights)
    lp, grads = _logprobs_and_grads(model, mb, weights)
    for i in rows:
        assert len(lp[i]) == len(samples.response_ids[i])
        torch.testing.assert_close(torch.tensor(lp[i]), torch.tensor(plain_lp[i]), atol=2e-5, rtol=0)
    assert grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():  # float32 sums in another order: rounding relative to the scale
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads[name], grad, atol=5e-6 * max(scale, 1.0), rtol=1e-4, msg=name)
    assert any(g.abs().max() > 1e-3 for g in plain_grads.values())  # the comparison is not of zeros


def test_without_a_repeated_prompt_or_with_sharing_off_the_rows_run_whole(policy):
    samples = _samples(policy.config.vocab_size)
    assert collate(samples, [0, 4, 8, 9], 0, share_prompts=True).prompts is None  # four distinct prompts
    assert collate(samples, [0, 1, 2], 0, share_prompts=False).prompts is None
    # micro-batches that split a group still share within each part
    parts = micro_batches(samples, list(range(8)), 3, 0, share_prompts=True)
    assert [mb.index.tolist() for mb in parts] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert all(mb.prompts is not None for mb in parts)


def test_the_value_model_shares_prompts_too(tiny_task):
    model = load_value_model(tiny_task / "model", torch.float32)
    torch.nn.init.normal_(model.value_head.weight, std=0.1)  # a zero head would compare zeros
    samples = _samples(model.backbone.config.vocab_size)
    rows = list(range(len(samples)))
    with torch.no_grad():
        plain = response_values(response_outputs(model, collate(samples, rows, 0), "values"),
                                collate(samples, rows, 0))
        mb = collate(samples, rows, 0, share_prompts=True)
        shared = response_values(response_outputs(model, mb, "values"), mb)
    for p, s in zip(plain, shared, strict=True):
        assert len(p) == len(s) and max(abs(x) for x in p) > 1e-3
        torch.testing.assert_close(torch.tensor(s), torch.tensor(p), atol=2e-5, rtol=0)


def test_gradient_checkpointing_gives_the_plain_logprobs_and_gradients(policy, tiny_task):
    """update.gradient_checkpointing, the policy's and the value model's: pins a recompute that
    runs another forward (dropout, a cache), or that leaves some layer's gradient out."""
    import copy

    from hpcrl.policy_model import checkpoint_layers

    samples = _samples(policy.config.vocab_size)
    rows = list(range(len(samples)))
    weights = {i: [(-1.0) ** (i + t) * (1 + t) for t in range(len(r))]
               for i, r in enumerate(samples.response_ids)}
    mb = collate(samples, rows, 0)
    recomputing = copy.deepcopy(policy)  # the module's fixture stays as it is
    checkpoint_layers(recomputing)
    recomputing.train()
    assert recomputing.is_gradient_checkpointing
    plain_lp, plain_grads = _logprobs_and_grads(copy.deepcopy(policy).train(), mb, weights)
    lp, grads = _logprobs_and_grads(recomputing, mb, weights)
    assert lp == plain_lp
    assert grads.keys() == plain_grads.keys() and len(grads) == len(list(policy.parameters()))
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    critic = load_value_model(tiny_task / "model", torch.float32)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    values = {}
    for recompute in (False, True):
        model = copy.deepcopy(critic).train()
        if recompute:
            checkpoint_layers(model.backbone)
        out = response_outputs(model, mb, "values")
        (out * mb.mask).sum().backward()
        values[recompute] = (out.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(values[True][0], values[False][0], atol=0, rtol=0)
    for a, b in zip(values[True][1], values[False][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_gradient_checkpointing_needs_rows_run_whole(write_experiment):
    """pins: checkpointing accepted with shared prompts, whose KV cache a recomputed layer loses."""
    from hpcrl import config
    from hpcrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"update\.gradient_checkpointing.*share_prompts = false"):
        config.load(write_experiment("ckpt", update={"gradient_checkpointing": True}))
    whole = {"gradient_checkpointing": True, "share_prompts": False}
    exp = config.load(write_experiment("ckpt", update=whole))
    assert exp.update.gradient_checkpointing


def test_packed_rows_give_the_plain_logprobs_values_and_gradients(policy, tiny_task):
    """update.max_tokens_per_micro_batch: rows end to end in one sequence. pins: attention that
    crosses into the previous row (positions not restarted, or a mask that lets it), an output
    taken one position off, a row's response placed under another row, or a gradient lost in
    the re-layout."""
    samples = _samples(policy.config.vocab_size)
    rows = [12, 0, 5, 3, 9]  # rows of different prompts and lengths, not in order
    weights = {i: [(-1.0) ** (i + t) * (1 + t) for t in range(len(r))]
               for i, r in enumerate(samples.response_ids)}
    packed = collate(samples, rows, 0, packed=True)
    assert packed.input_ids.shape == (1, sum(samples.lengths(rows)))
    _same_as_plain(policy, samples, rows, packed, weights)
    model = load_value_model(tiny_task / "model", torch.float32)
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    with torch.no_grad():
        plain = response_values(response_outputs(model, collate(samples, rows, 0), "values"),
                                collate(samples, rows, 0))
        values = response_values(response_outputs(model, packed, "values"), packed)
    for a, b in zip(plain, values, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=2e-5, rtol=0)


def test_packing_fills_a_token_budget_and_evens_out_the_ranks():
    """pins (batches.pack, even_out): a budget exceeded by a pack of several rows, a row left out
    or repeated, rows out of order, ranks with different numbers of micro-batches."""
    assert batches.pack([5, 4, 3, 9, 2, 2], 9) == [[0, 1], [2], [3], [4, 5]]
    assert batches.pack([12, 1], 9) == [[0], [1]]  # a row longer than the budget goes alone
    assert batches.even_out([[0, 1], [2], [3], [4, 5]], 5, [5, 4, 3, 9, 2, 2]) == [[0], [1], [2], [3], [4, 5]]
    assert batches.even_out([[0], [1], [2], [3]], 2, [5, 4, 3, 9]) == [[0, 1, 2], [3]]  # fewest tokens joined
    assert batches.even_out([[0], [1], [2]], 2, [1, 1, 9]) == [[0, 1], [2]]
    with pytest.raises(ValueError):
        batches.even_out([[0, 1]], 3, [1, 1])
    samples = _samples(1000)
    shares = [list(range(0, 7)), list(range(7, 13))]
    mbs = [batches.step_micro_batches(samples, shares, r, 64, 0, max_tokens=40) for r in range(2)]
    assert len(mbs[0]) == len(mbs[1]) > 1
    for r, share in enumerate(shares):
        assert sum((mb.index.tolist() for mb in mbs[r]), []) == share
    one = micro_batches(samples, shares[0], 64, 0, max_tokens=40)
    assert all(mb.input_ids.shape[1] <= 40 or len(mb.index) == 1 for mb in one)
    assert sum((mb.index.tolist() for mb in one), []) == shares[0]


def test_packing_needs_rows_run_whole(write_experiment):
    """pins: packing accepted with shared prompts (a shared prompt runs once for several rows)."""
    from hpcrl import config
    from hpcrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"update\.max_tokens_per_micro_batch.*share_prompts = false"):
        config.load(write_experiment("pack", update={"max_tokens_per_micro_batch": 256}))
    whole = {"max_tokens_per_micro_batch": 256, "share_prompts": False}
    exp = config.load(write_experiment("pack", update=whole))
    assert exp.update.max_tokens_per_micro_batch == 256


def test_mini_batches_keep_groups_together_in_a_seeded_random_order():
    groups = [g for g in range(8) for _ in range(4)]
    minis = trainer.split_mini_batches(groups, 2, seed=5, epoch=0)
    assert sorted(sum(minis, [])) == list(range(32)) and [len(m) for m in minis] == [16, 16]
    for mini in minis:
        assert len({groups[i] for i in mini}) == 4  # whole groups: 4 groups of 4 per mini-batch
        runs = [groups[i] for k, i in enumerate(mini) if k == 0 or groups[mini[k - 1]] != groups[i]]
        assert len(runs) == len(set(runs)) == 4  # each group's rows next to each other
    assert minis == trainer.split_mini_batches(groups, 2, seed=5, epoch=0)
    others = [trainer.split_mini_batches(groups, 2, seed=5, epoch=e) for e in range(1, 4)]
    assert any(o != minis for o in others)
    # groups of 3 in mini-batches of 4: a group may straddle two, every row still once
    uneven = trainer.split_mini_batches([g for g in range(4) for _ in range(3)], 3, seed=1, epoch=0)
    assert sorted(sum(uneven, [])) == list(range(12)) and {len(m) for m in uneven} == {4}


def test_ranks_take_contiguous_shares_of_every_row():
    rows = list(range(10, 23))
    shares = [trainer.rank_rows(rows, r, 3) for r in range(3)]
    assert sum(shares, []) == rows and max(map(len, shares)) - min(map(len, shares)) <= 1
    assert trainer.rank_rows(rows, 0, 1) == rows
