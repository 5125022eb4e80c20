"""Micro-batches with shared prompts or packed rows give the plain layout's outputs and gradients;
packing fills a token budget; mini-batches keep groups together; ranks take contiguous shares.
The model is the tiny task's (real Qwen2)."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pyarrow.compute as pc
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
    """In float64, so that the layouts' comparisons hold on any CPU: in float32 the order of each sum
    (which depends on the kernels a CPU picks) moves a cancelling gradient such as an attention
    bias's by more than the layouts ever differ; in float64 only Qwen2's RMSNorm, which computes in
    float32, still rounds."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_task / "model", dtype=torch.float64)


def _logprobs_and_grads(model, mb, weights: dict[int, list[float]]):
    """Per-row response logprobs and the gradient of a weighted sum of them."""
    model.zero_grad()
    logits = response_outputs(model, mb)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, mb.targets[..., None])[..., 0]
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
    for name, grad in plain_grads.items():  # RMSNorm's float32 sums in another order: rounding relative to
        # the scale (measured: up to 8e-7 of it, an attention bias's gradient; in float32 1e-5)
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
    model = load_value_model(tiny_task / "model", torch.float64)
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
    critic = load_value_model(tiny_task / "model", torch.float64)
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
    model = load_value_model(tiny_task / "model", torch.float64)
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


# Exact layouts and bookkeeping on tiny hand-made rows (no model): what collate, pack, even_out,
# step_micro_batches, response_outputs' calls, padded, MicroBatch.to and load_samples produce.

def _rows(prompts: list[list[int]], responses: list[list[int]]) -> batches.Samples:
    n = len(prompts)
    return batches.Samples(None, prompts, responses, [[0.0] * len(r) for r in responses],
                           torch.zeros(n, dtype=torch.float64), torch.arange(n))


def _is(t: torch.Tensor, expected: list, dtype: torch.dtype) -> None:
    assert t.dtype == dtype and t.tolist() == expected


def test_the_plain_layout_is_right_padded_and_masked_to_the_responses():
    """pins (collate): the pad id, the attention mask's 1s and dtype, the mask one position before
    each response token, the rows' order."""
    mb = collate(_rows([[5, 6, 7], [8, 9]], [[10], [12, 13, 14]]), [1, 0], 99)
    _is(mb.index, [1, 0], torch.int64)
    _is(mb.input_ids, [[8, 9, 12, 13, 14], [5, 6, 7, 10, 99]], torch.long)
    _is(mb.attention_mask, [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], torch.long)
    _is(mb.targets, [[9, 12, 13, 14], [6, 7, 10, 99]], torch.long)
    _is(mb.mask, [[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]], torch.float32)
    assert mb.position_ids is None and mb.prompts is None and mb.packed is None


def test_the_shared_layout_runs_each_prompt_once_left_padded():
    """pins (_collate_shared): left-padded prompts and their positions, each row's prompt, the
    responses' positions after their prompt, a width of one for one-token (or empty) responses."""
    samples = _rows([[5, 6, 7], [5, 6, 7], [8, 9]], [[10, 11], [12], [13, 14, 15]])
    mb = collate(samples, [0, 1, 2], 99, share_prompts=True)
    p = mb.prompts
    _is(p.input_ids, [[5, 6, 7], [99, 8, 9]], torch.long)
    _is(p.attention_mask, [[1, 1, 1], [0, 1, 1]], torch.long)
    _is(p.position_ids, [[0, 1, 2], [0, 0, 1]], torch.long)
    _is(p.of_row, [0, 0, 1], torch.long)
    _is(mb.input_ids, [[10, 11, 99], [12, 99, 99], [13, 14, 15]], torch.long)
    _is(mb.attention_mask, [[1, 1, 0], [1, 0, 0], [1, 1, 1]], torch.long)
    _is(mb.targets, mb.input_ids.tolist(), torch.long)
    _is(mb.mask, [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], torch.float32)
    _is(mb.position_ids, [[3, 4, 5], [3, 4, 5], [2, 3, 4]], torch.long)
    one = collate(_rows([[5, 6], [5, 6]], [[10], [12]]), [0, 1], 99, share_prompts=True)
    _is(one.input_ids, [[10], [12]], torch.long)
    _is(one.position_ids, [[2], [2]], torch.long)
    empty = collate(_rows([[5, 6], [5, 6]], [[], []]), [0, 1], 99, share_prompts=True)
    _is(empty.input_ids, [[99], [99]], torch.long)
    _is(empty.mask, [[0.0], [0.0]], torch.float32)


def test_the_packed_layout_runs_the_rows_end_to_end():
    """pins (_collate_packed): the sequence, its restarting positions, an all-ones attention mask,
    the targets and mask per row, the kept output positions, a width of one for short responses."""
    samples = _rows([[5, 6, 7], [1, 2], [8, 9]], [[10, 11], [3], [13]])
    mb = collate(samples, [2, 0], 99, packed=True)
    _is(mb.index, [2, 0], torch.int64)
    _is(mb.input_ids, [[8, 9, 13, 5, 6, 7, 10, 11]], torch.long)
    _is(mb.position_ids, [[0, 1, 2, 0, 1, 2, 3, 4]], torch.long)
    _is(mb.attention_mask, [[1] * 8], torch.long)
    _is(mb.targets, [[13, 99], [10, 11]], torch.long)
    _is(mb.mask, [[1.0, 0.0], [1.0, 1.0]], torch.float32)
    _is(mb.packed, [1, 5, 6], torch.long)  # the outputs at 9 (-> 13), 7 (-> 10) and 10 (-> 11)
    assert mb.prompts is None
    one = collate(samples, [1, 2], 99, packed=True)
    _is(one.targets, [[3], [13]], torch.long)
    _is(one.packed, [1, 4], torch.long)
    empty = collate(_rows([[5, 6], [7]], [[], []]), [0, 1], 99, packed=True)
    _is(empty.targets, [[99], [99]], torch.long)
    _is(empty.mask, [[0.0], [0.0]], torch.float32)
    _is(empty.packed, [], torch.long)


def test_the_masks_are_float32_whatever_torch_s_default_dtype():
    """pins (collate, _collate_packed): a mask (and so `padded`'s values) in torch's default dtype,
    float64 in one layout and float32 in another."""
    samples = _rows([[5, 6], [5, 6]], [[7], [8, 9]])
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layouts = [collate(samples, [0, 1], 0), collate(samples, [0, 1], 0, packed=True),
                   collate(samples, [0, 1], 0, share_prompts=True)]
    finally:
        torch.set_default_dtype(before)
    assert [mb.mask.dtype for mb in layouts] == [torch.float32] * 3


def test_even_out_and_halves_at_their_edges():
    """pins (even_out, _halves): the bounds on `count` and the message, no split or join once there
    are `count` groups, a one-row group never split, the pair of fewest tokens joined where it is,
    and the cut where the first part reaches half the group's tokens."""
    assert batches.even_out([[0], [1], [2]], 1, [1, 2, 3]) == [[0, 1, 2]]
    assert batches.even_out([[0, 1], [2]], 3, [1, 1, 1]) == [[0], [1], [2]]
    for count, total in ((0, 2), (3, 2)):
        with pytest.raises(ValueError, match=rf"^{count} micro-batches of {total} sequences$"):
            batches.even_out([[0, 1]], count, [1, 1])
    assert batches.even_out([[0, 1], [2]], 2, [3, 3, 1]) == [[0, 1], [2]]
    assert batches.even_out([[0], [1]], 2, [1, 1]) == [[0], [1]]
    assert batches.even_out([[0], [1, 2]], 3, [10, 1, 1]) == [[0], [1], [2]]
    assert batches.even_out([[0], [1], [2]], 2, [5, 1, 1]) == [[0], [1, 2]]
    lengths = [1, 5, 2, 1, 1, 2, 2, 2]
    assert batches._halves([1, 3, 4], lengths) == [[1], [3, 4]]  # 5 tokens reach 3.5 of 7
    assert batches._halves([5, 6, 7], lengths) == [[5, 6], [7]]  # 2 tokens do not reach 3, 4 do
    assert batches._halves([3, 4, 1], lengths) == [[3, 4], [1]]  # 2 of 7 before the last row
    assert batches._halves([0, 3, 4, 0], lengths) == [[0, 3], [4, 0]]  # exactly half (2 of 4)


def _six() -> batches.Samples:
    """Rows 0-5 of 3, 2, 3, 4, 4, 2 tokens; rows 0 and 1 share a prompt, and rows 3 and 4."""
    return _rows([[5, 6], [5, 6], [7, 8], [1, 2, 3], [1, 2, 3], [4]], [[9], [], [10], [11], [12], [13]])


def test_step_micro_batches_in_rows():
    """pins (micro_batches, step_micro_batches without a token budget): the rank's share in
    micro-batches of `size`, the pad id, prompts shared only when asked."""
    samples = _six()
    shares = [[0, 1, 2], [3, 4, 5]]
    for mbs in (batches.step_micro_batches(samples, shares, 1, 2, 7),
                micro_batches(samples, shares[1], 2, 7)):
        assert [mb.index.tolist() for mb in mbs] == [[3, 4], [5]]
        assert [mb.prompts for mb in mbs] == [None, None] and mbs[0].packed is None
        _is(mbs[1].input_ids, [[4, 13]], torch.long)
    mbs = batches.step_micro_batches(samples, shares, 0, 2, 7)
    assert [mb.index.tolist() for mb in mbs] == [[0, 1], [2]]
    _is(mbs[0].input_ids, [[5, 6, 9], [5, 6, 7]], torch.long)
    mbs = batches.step_micro_batches(samples, shares, 1, 2, 7, share_prompts=True)
    assert mbs[0].prompts is not None and mbs[1].prompts is None
    _is(mbs[0].input_ids, [[11], [12]], torch.long)


def test_step_micro_batches_packed_as_many_on_every_rank():
    """pins (micro_batches, step_micro_batches with a token budget): packed micro-batches, a rank
    with too many packs joining its lightest adjacent pair, one with too few splitting its pack."""
    samples = _six()
    mbs = micro_batches(samples, [0, 1, 2], 2, 7, max_tokens=5)
    assert [mb.index.tolist() for mb in mbs] == [[0, 1], [2]]
    assert all(mb.packed is not None and mb.input_ids.shape[0] == 1 for mb in mbs)
    _is(mbs[0].position_ids, [[0, 1, 2, 0, 1]], torch.long)
    shares = [[3, 4, 5], [0, 2]]  # 4, 4, 2 tokens: 3 packs within 5; 3, 3: 2 packs; so 2 on each
    for rank, expected in ((0, [[3], [4, 5]]), (1, [[0], [2]])):
        mbs = batches.step_micro_batches(samples, shares, rank, 64, 7, max_tokens=5)
        assert [mb.index.tolist() for mb in mbs] == expected
        assert all(mb.packed is not None for mb in mbs)
    one = batches.step_micro_batches(samples, [[0, 2], [3, 4]], 0, 64, 7, max_tokens=6)
    assert [mb.index.tolist() for mb in one] == [[0], [2]]  # 3 + 3 fit 6 tokens, the other rank needs 2


class _Cache:
    def __init__(self):
        self.rows = None

    def batch_select_indices(self, rows):
        self.rows = rows.tolist()


class _Model:
    """Stands in for an HF model: records each call's keyword arguments; its output at each position
    is (the input token, its position), only at `logits_to_keep` positions when asked, as HF does."""

    def __init__(self, cache=None):
        self.calls, self.cache = [], _Cache() if cache is None else cache

    def __call__(self, **kw):
        self.calls.append(kw)
        ids, pos = kw["input_ids"], kw.get("position_ids")
        pos = torch.arange(ids.shape[1]).expand_as(ids) if pos is None else pos
        out = torch.stack([ids, pos], -1).float()
        keep = kw.get("logits_to_keep", 0)
        out = out[:, keep] if torch.is_tensor(keep) else out[:, -keep:]
        return SimpleNamespace(logits=out, values=out, past_key_values=self.cache)


class _Tally:
    def __init__(self):
        self.weights = []

    def routed(self, weights, forward):
        self.weights.append(weights.tolist())
        return forward()


def test_the_update_seed_draws_as_torch_manual_seed_does():
    trainer.manual_seed(7)
    ours = (torch.rand(4), torch.randn(2, 3))
    torch.manual_seed(7)
    assert all(torch.equal(a, b) for a, b in zip(ours, (torch.rand(4), torch.randn(2, 3)), strict=True))
    trainer.manual_seed(8)
    assert not torch.equal(torch.rand(4), ours[0])


def test_response_outputs_calls_the_model_as_each_layout_needs():
    """pins (response_outputs): the keyword arguments of each pass (attention mask, positions, cache,
    use_cache, logits_to_keep for logits only), each pass's token weights in the MoE tally (a shared
    prompt's weighted by its rows), and the output about each response token: the one before it."""
    samples = _rows([[5, 6, 7], [5, 6, 7], [8, 9]], [[10, 11], [12], [13, 14, 15]])
    before = [[[7, 2], [10, 3]], [[7, 2]], [[9, 1], [13, 2], [14, 3]]]  # (token, position)
    for field in ("logits", "values"):
        logits = field == "logits"
        for layout in ("plain", "share_prompts", "packed"):
            mb = collate(samples, [0, 1, 2], 0, **({} if layout == "plain" else {layout: True}))
            model, tally = _Model(), _Tally()
            out = response_outputs(model, mb, field, tally)
            assert [out[b][mb.mask[b].bool()].tolist() for b in range(3)] == before
            calls = model.calls
            if layout == "plain":
                assert len(calls) == 1 and calls[0].keys() == {"input_ids", "attention_mask"}
                assert calls[0]["input_ids"] is mb.input_ids
                assert calls[0]["attention_mask"] is mb.attention_mask
                assert tally.weights == [mb.attention_mask.tolist()]
            elif layout == "packed":
                keys = {"input_ids", "position_ids", "attention_mask", "use_cache"}
                assert len(calls) == 1 and calls[0].keys() == keys | ({"logits_to_keep"} if logits else set())
                assert calls[0]["attention_mask"] is None and calls[0]["use_cache"] is False
                assert calls[0]["position_ids"] is mb.position_ids
                assert calls[0].get("logits_to_keep", mb.packed) is mb.packed
                assert tally.weights == [[[1] * 14]]  # every token once
            else:
                first, rest = calls
                keys = {"input_ids", "attention_mask", "position_ids", "use_cache"}
                assert first.keys() == keys | ({"logits_to_keep"} if logits else set())
                assert first["use_cache"] is True and first.get("logits_to_keep", 1) == 1
                assert first["input_ids"] is mb.prompts.input_ids
                assert first["position_ids"] is mb.prompts.position_ids
                assert rest.keys() == keys | {"past_key_values"}
                assert rest["use_cache"] is True and rest["past_key_values"] is model.cache
                assert rest["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0],
                                                           [0, 1, 1, 1, 1, 1]]
                assert model.cache.rows == [0, 0, 1]
                assert tally.weights == [[[2, 2, 2], [0, 1, 1]], mb.attention_mask.tolist()]


def test_shared_prompts_refuse_a_cache_that_cannot_be_indexed_by_row():
    """pins (response_outputs): the message, naming the cache's type and the setting to change."""
    mb = collate(_rows([[5, 6], [5, 6]], [[7], [8]]), [0, 1], 0, share_prompts=True)
    message = (r"^update\.share_prompts: this model's cache \(tuple\) cannot be indexed by batch row; "
               r"set update\.share_prompts = false$")
    with pytest.raises(TypeError, match=message):
        response_outputs(_Model(cache=()), mb)


def test_padded_places_each_row_s_values_in_the_mask_s_dtype():
    """pins (padded): values by row of Samples (a dict or a list), at the mask, at full float64
    precision with a float64 mask."""
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    mb = batches.MicroBatch(torch.tensor([4, 2]), None, None, None, mask)
    expected = [[0.0, 0.3, 0.7], [0.1, 0.0, 0.0]]
    _is(padded({2: [0.1], 4: [0.3, 0.7]}, mb), expected, torch.float64)
    _is(padded([[], [], [0.1], [], [0.3, 0.7]], mb), expected, torch.float64)


def test_to_moves_every_tensor_of_each_layout():
    """pins (MicroBatch.to, SharedPrompts.to): a tensor left behind or dropped; the row index stays."""
    samples = _rows([[5, 6], [5, 6], [7]], [[8], [9, 10], [11]])
    for layout, tensors in (({}, 4), ({"share_prompts": True}, 9), ({"packed": True}, 6)):
        mb = collate(samples, [0, 1, 2], 0, **layout)
        moved = mb.to("meta")
        assert moved.index is mb.index
        pairs = [(getattr(mb, f), getattr(moved, f))
                 for f in ("input_ids", "attention_mask", "targets", "mask", "position_ids", "packed")]
        assert (mb.prompts is None) == (moved.prompts is None)
        if mb.prompts is not None:
            pairs += [(getattr(mb.prompts, f), getattr(moved.prompts, f))
                      for f in ("input_ids", "attention_mask", "position_ids", "of_row")]
        for t, m in pairs:
            assert (t is None and m is None) or (m.device.type == "meta" and m.shape == t.shape
                                                 and m.dtype == t.dtype)
        assert sum(t is not None for t, _ in pairs) == tensors


def _tables(kept: bool = True, baselines: bool = True) -> tuple[pa.Table, pa.Table]:
    """Rollouts and scores: training rows of prompts 7 and 3 (row 6 not kept), a validation row,
    and the greedy baselines of prompts 3 and 7."""
    split = ["train", "val", "train", "baseline", "train", "baseline", "train"]
    keys = {"split": split, "prompt_index": pa.array([7, 0, 3, 3, 7, 7, 3], pa.int64()),
            "sample_index": pa.array([0, 0, 0, 0, 1, 0, 1], pa.int32())}
    rollouts = pa.table(keys | {
        "prompt_ids": [[1, 2], [3], [4], [5], [6, 7], [8], [18]],
        "response_ids": [[9], [10], [11, 12], [13], [14, 15, 16], [17], [19]],
        "logprobs": [[-0.5], [-1.0], [-0.25, -0.75], [0.0], [-1.5, -2.0, -2.5], [0.0], [-3.0]],
        "policy_version": pa.array([4, 4, 3, 4, 2, 4, 1], pa.int32()),
        "kept": [True, False, True, False, True, False, False]})
    scores = pa.table(keys | {"reward": [1.0, 0.5, 0.25, 0.75, 0.0, 0.125, 0.375]})
    if not kept:
        rollouts = rollouts.drop_columns(["kept"])
    if not baselines:
        rollouts, scores = (t.filter(pc.not_equal(t["split"], "baseline"))
                            for t in (rollouts, scores))
    return rollouts, scores


def test_load_samples_takes_the_kept_training_rows_and_their_baselines():
    """pins (load_samples, _baselines): every field of the kept training rows, in order and dtype;
    schema v1 rollouts (no `kept`); no baselines without baseline rows; the errors' messages."""
    s = batches.load_samples(*_tables())
    assert s.keys.column_names == ["split", "prompt_index", "sample_index"]
    assert s.keys.to_pydict() == {"split": ["train"] * 3, "prompt_index": [7, 3, 7],
                                  "sample_index": [0, 0, 1]}
    assert (s.prompt_ids, s.response_ids) == ([[1, 2], [4], [6, 7]], [[9], [11, 12], [14, 15, 16]])
    assert s.sampler_logprobs == [[-0.5], [-0.25, -0.75], [-1.5, -2.0, -2.5]]
    _is(s.rewards, [1.0, 0.25, 0.0], torch.float64)
    _is(s.group_ids, [7, 3, 7], torch.int64)
    _is(s.baselines, [0.125, 0.75, 0.125], torch.float64)
    _is(s.policy_versions, [4, 3, 2], torch.int64)
    v1 = batches.load_samples(*_tables(kept=False, baselines=False))
    assert v1.response_ids == [[9], [11, 12], [14, 15, 16], [19]] and v1.baselines is None
    _is(v1.rewards, [1.0, 0.25, 0.0, 0.375], torch.float64)
    assert batches.load_samples(*_tables(kept=False)).baselines.tolist() == [0.125, 0.75, 0.125, 0.75]
    rollouts, scores = _tables()
    shifted = scores.set_column(2, "sample_index", pa.array([0, 0, 0, 0, 2, 0, 1], pa.int32()))
    with pytest.raises(ValueError, match=r"^score rows do not line up with the rollouts \(keys differ\)$"):
        batches.load_samples(rollouts, shifted)
    with pytest.raises(ValueError, match=r"^no greedy baseline sample for the training prompts \[7\]$"):
        batches.load_samples(rollouts.slice(0, 5), scores.slice(0, 5))  # prompt 7's baseline is row 5
    alone = batches.load_samples(rollouts)  # no scores yet (hpcrl.update_ahead): the same rows, no rewards
    assert alone.keys.equals(s.keys) and alone.response_ids == s.response_ids
    assert alone.rewards is None and alone.baselines is None
    few = pa.table({"split": ["baseline"], "prompt_index": [9], "reward": [1.0]})
    with pytest.raises(ValueError, match=r"training prompts \[0, 1, 2, 3, 4\]$"):  # the first five
        batches._baselines(few, [6, 5, 4, 3, 2, 1, 0, 9])
