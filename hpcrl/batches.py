"""The update batch (`Samples`, the kept training rows with their rewards) and its micro-batches:
how rows become tensors, and how a model's per-token outputs
(logits, values) for their response tokens are computed.

A micro-batch comes in one of three layouts, and the code that uses it does not need to know which:
`targets` and `mask` are aligned with what `response_outputs` returns, and `padded` /
`response_values` move per-row values in and out of that alignment.

- plain: each row is its prompt and response, right-padded; outputs are the model's at every
  position but the last (the output at t is about token t + 1), masked to the response tokens.
- shared prompts (`update.share_prompts`, when rows repeat a prompt, as a GRPO group does): each
  distinct prompt is run once (left-padded, use_cache) and every row's response is run on a copy
  of its prompt's KV cache. The output for the first response token is the prompt's last; the
  rest come from the response pass. Autograd carries every row's gradient back through the cache
  into the one prompt pass, so the loss and its gradient are the plain layout's (to float
  rounding), for (prompt + n x response) instead of n x (prompt + response) tokens of compute.
- packed (`update.max_tokens_per_micro_batch`): micro-batches are built by a token budget (`pack`)
  and their rows run end to end as one sequence, each row's positions from 0, so the model keeps
  attention within each row (transformers' packed-sequence mask) and no padding is computed; the
  outputs at the response tokens come back as [rows, longest response], as in the shared layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import torch

from hpcrl.moe import RouterTally
from hpcrl.schemas import SAMPLE_KEYS


@dataclass
class Samples:
    """The training samples of one iteration, in a fixed order."""

    keys: pa.Table  # SAMPLE_KEYS columns
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    rewards: torch.Tensor | None  # None: loaded without scores (hpcrl.update_ahead)
    group_ids: torch.Tensor
    baselines: torch.Tensor | None = None  # remax: the reward of each sample's prompt's greedy sample
    policy_versions: torch.Tensor | None = None  # int64: the policy version that generated each sample

    def __len__(self) -> int:
        return len(self.response_ids)

    def lengths(self, rows: list[int]) -> list[int]:
        """Tokens (prompt + response) of each of `rows`."""
        return [len(self.prompt_ids[i]) + len(self.response_ids[i]) for i in rows]


def load_samples(rollouts: pa.Table, scores: pa.Table | None = None) -> Samples:
    """The update batch: the `kept` training rows of the rollouts with their rewards (rows must
    line up key by key); without `scores` the same rows, with no rewards. Rollouts of schema v1
    have no `kept`: every training row is kept."""
    if scores is not None and rollouts.select(list(SAMPLE_KEYS)) != scores.select(list(SAMPLE_KEYS)):
        raise ValueError("score rows do not line up with the rollouts (keys differ)")
    batch = pc.equal(rollouts["split"], "train")
    if "kept" in rollouts.column_names:
        batch = pc.and_(batch, rollouts["kept"])
    train = rollouts.filter(batch)
    scored = scores.filter(batch) if scores is not None else None
    return Samples(
        keys=train.select(list(SAMPLE_KEYS)),
        prompt_ids=train["prompt_ids"].to_pylist(),
        response_ids=train["response_ids"].to_pylist(),
        sampler_logprobs=train["logprobs"].to_pylist(),
        rewards=None if scored is None else torch.tensor(scored["reward"].to_numpy(), dtype=torch.float64),
        group_ids=torch.tensor(train["prompt_index"].to_numpy()),
        baselines=None if scores is None else _baselines(scores, train["prompt_index"].to_pylist()),
        policy_versions=torch.tensor(train["policy_version"].to_numpy(), dtype=torch.int64),
    )


def _baselines(scores: pa.Table, prompts: list[int]) -> torch.Tensor | None:
    """The reward of the greedy baseline sample of each row's prompt (remax); None without any."""
    rows = scores.filter(pc.equal(scores["split"], "baseline"))
    if not rows.num_rows:
        return None
    by_prompt = dict(zip(rows["prompt_index"].to_pylist(), rows["reward"].to_pylist(), strict=True))
    missing = sorted(set(prompts) - set(by_prompt))
    if missing:
        raise ValueError(f"no greedy baseline sample for the training prompts {missing[:5]}")
    return torch.tensor([by_prompt[p] for p in prompts], dtype=torch.float64)


@dataclass
class SharedPrompts:
    input_ids: torch.Tensor  # [prompts, longest prompt], left-padded
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    of_row: torch.Tensor  # [rows]: each row's prompt

    def to(self, device) -> SharedPrompts:
        return SharedPrompts(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                                     self.of_row)))


@dataclass
class MicroBatch:
    index: torch.Tensor  # rows of Samples
    input_ids: torch.Tensor  # plain: prompt + response; shared prompts: the response only
    attention_mask: torch.Tensor
    targets: torch.Tensor  # the token each output position is about
    mask: torch.Tensor  # 1 where that token is a response token
    position_ids: torch.Tensor | None = None  # shared prompts: the responses' positions; packed: each row's
    prompts: SharedPrompts | None = None
    packed: torch.Tensor | None = None  # packed: the positions whose outputs are about response tokens

    def to(self, device) -> MicroBatch:
        moved = (t.to(device) for t in (self.input_ids, self.attention_mask, self.targets, self.mask))
        return MicroBatch(self.index, *moved,
                          position_ids=None if self.position_ids is None else self.position_ids.to(device),
                          prompts=None if self.prompts is None else self.prompts.to(device),
                          packed=None if self.packed is None else self.packed.to(device))


def collate(samples: Samples, rows: list[int], pad_id: int, share_prompts: bool = False,
            packed: bool = False) -> MicroBatch:
    """The rows as one micro-batch; with `share_prompts`, in the shared layout when a prompt repeats;
    `packed`: end to end."""
    if packed:
        return _collate_packed(samples, rows, pad_id)
    distinct = {tuple(samples.prompt_ids[i]): None for i in rows}
    if share_prompts and len(distinct) < len(rows):
        return _collate_shared(samples, rows, pad_id, [list(p) for p in distinct])
    seqs = [samples.prompt_ids[i] + samples.response_ids[i] for i in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for b, (i, seq) in enumerate(zip(rows, seqs, strict=True)):
        ids[b, : len(seq)] = torch.tensor(seq)
        attn[b, : len(seq)] = 1
        p, r = len(samples.prompt_ids[i]), len(samples.response_ids[i])
        mask[b, p - 1: p - 1 + r] = 1.0  # logits at position t predict token t + 1
    return MicroBatch(torch.tensor(rows), ids, attn, ids[:, 1:], mask)


def _collate_shared(samples: Samples, rows: list[int], pad_id: int, prompts: list[list[int]]) -> MicroBatch:
    longest = max(len(p) for p in prompts)
    p_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    p_attn = torch.zeros_like(p_ids)
    for j, p in enumerate(prompts):
        p_ids[j, longest - len(p):] = torch.tensor(p)
        p_attn[j, longest - len(p):] = 1
    slot = {tuple(p): j for j, p in enumerate(prompts)}
    of_row = torch.tensor([slot[tuple(samples.prompt_ids[i])] for i in rows])
    width = max(1, max(len(samples.response_ids[i]) for i in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, i in enumerate(rows):
        r = samples.response_ids[i]
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, : len(r)] = 1
    lengths = torch.tensor([len(samples.prompt_ids[i]) for i in rows])
    shared = SharedPrompts(p_ids, p_attn, (p_attn.cumsum(-1) - 1).clamp(min=0), of_row)
    return MicroBatch(torch.tensor(rows), ids, attn, ids, attn.float(),
                      position_ids=lengths[:, None] + torch.arange(width)[None], prompts=shared)


def _collate_packed(samples: Samples, rows: list[int], pad_id: int) -> MicroBatch:
    seqs = [samples.prompt_ids[i] + samples.response_ids[i] for i in rows]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None]
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    width = max(1, max(len(samples.response_ids[i]) for i in rows))
    targets = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    keep, start = [], 0
    for b, (i, seq) in enumerate(zip(rows, seqs, strict=True)):
        p, r = len(samples.prompt_ids[i]), len(samples.response_ids[i])
        targets[b, :r] = torch.tensor(samples.response_ids[i], dtype=torch.long)
        mask[b, :r] = 1.0
        keep += range(start + p - 1, start + p - 1 + r)  # the output at t is about token t + 1
        start += len(seq)
    return MicroBatch(torch.tensor(rows), ids, torch.ones_like(ids), targets, mask, position_ids=position_ids,
                      packed=torch.tensor(keep, dtype=torch.long))


def pack(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Positions 0..n-1 of sequences of `lengths` tokens, in order, grouped into consecutive
    micro-batches of at most `max_tokens` tokens (a longer sequence goes alone)."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if groups and used + n <= max_tokens:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups


def even_out(groups: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """`groups` (consecutive positions) made exactly `count` consecutive groups: the group of most
    tokens split at its token midpoint while there are too few, the adjacent pair of fewest tokens
    joined while there are too many. So every rank of a multi-rank update runs as many
    micro-batches (DeepSpeed reduces gradients collectively at the last)."""
    groups = [list(g) for g in groups]
    if not 0 < count <= sum(len(g) for g in groups):
        raise ValueError(f"{count} micro-batches of {sum(len(g) for g in groups)} sequences")

    def size(g: list[int]) -> int:
        return sum(lengths[i] for i in g)

    while len(groups) < count:
        j = max((j for j, g in enumerate(groups) if len(g) > 1), key=lambda j: size(groups[j]))
        groups[j: j + 1] = _halves(groups[j], lengths)
    while len(groups) > count:
        j = min(range(len(groups) - 1), key=lambda j: size(groups[j]) + size(groups[j + 1]))
        groups[j: j + 2] = [groups[j] + groups[j + 1]]
    return groups


def _halves(group: list[int], lengths: list[int]) -> list[list[int]]:
    """`group` cut in two where its first part reaches half its tokens (each part one row at least)."""
    half, run = sum(lengths[i] for i in group) / 2, 0
    for cut in range(1, len(group)):
        run += lengths[group[cut - 1]]
        if run >= half:
            break
    return [group[:cut], group[cut:]]


def micro_batches(samples: Samples, rows: list[int], size: int, pad_id: int, share_prompts: bool = False,
                  max_tokens: int = 0) -> list[MicroBatch]:
    """`rows` in micro-batches of `size` rows, or packed to at most `max_tokens` tokens each."""
    if max_tokens:
        return [collate(samples, [rows[j] for j in g], pad_id, packed=True)
                for g in pack(samples.lengths(rows), max_tokens)]
    return [collate(samples, rows[i: i + size], pad_id, share_prompts) for i in range(0, len(rows), size)]


def step_micro_batches(samples: Samples, shares: list[list[int]], rank: int, size: int, pad_id: int,
                       share_prompts: bool = False, max_tokens: int = 0) -> list[MicroBatch]:
    """Rank `rank`'s micro-batches of one optimizer step over every rank's rows `shares`: as
    `micro_batches` its share, and packed, as many on every rank (`even_out`; a micro-batch may then
    exceed the budget)."""
    mine = shares[rank]
    if not max_tokens:
        return micro_batches(samples, mine, size, pad_id, share_prompts)
    count = min(max(len(pack(samples.lengths(s), max_tokens)) for s in shares), min(len(s) for s in shares))
    lengths = samples.lengths(mine)
    return [collate(samples, [mine[j] for j in g], pad_id, packed=True)
            for g in even_out(pack(lengths, max_tokens), count, lengths)]


def unpack(flat: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """A packed micro-batch's outputs at its response tokens ([tokens, ...], in order) as
    [rows, longest response, ...], aligned with mb.targets (zeros past each response)."""
    rows = flat.new_zeros((*mb.mask.shape, *flat.shape[1:]))
    rows[mb.mask.bool()] = flat
    return rows


def response_outputs(model, mb: MicroBatch, field: str = "logits",
                     tally: RouterTally | None = None) -> torch.Tensor:
    """The model's `field` output (logits; a value model's values) aligned with mb.targets.

    `model` is called with HF keyword arguments (input_ids, attention_mask, position_ids,
    past_key_values, use_cache) and returns an object with `field` and `past_key_values`. With a
    `tally` (an MoE model), the routing of every token is added to it, a shared prompt's tokens
    weighted by the rows it stands for, so the tally is the same with and without sharing."""
    def run(weights, forward):
        return tally.routed(weights, forward) if tally is not None else forward()

    if mb.packed is not None:  # no attention mask: the positions tell the model where each row starts
        keep = {"logits_to_keep": mb.packed} if field == "logits" else {}
        out = run(mb.attention_mask, lambda: model(input_ids=mb.input_ids, position_ids=mb.position_ids,
                                                   attention_mask=None, use_cache=False, **keep))
        flat = getattr(out, field)[0]
        return unpack(flat if keep else flat[mb.packed], mb)
    if mb.prompts is None:
        out = run(mb.attention_mask, lambda: model(input_ids=mb.input_ids, attention_mask=mb.attention_mask))
        return getattr(out, field)[:, :-1]
    p = mb.prompts
    last_only = {"logits_to_keep": 1} if field == "logits" else {}
    rows_per_prompt = torch.bincount(p.of_row, minlength=p.input_ids.shape[0])
    first = run(p.attention_mask * rows_per_prompt[:, None],
                lambda: model(input_ids=p.input_ids, attention_mask=p.attention_mask,
                              position_ids=p.position_ids, use_cache=True, **last_only))
    cache = first.past_key_values
    if not hasattr(cache, "batch_select_indices"):
        raise TypeError(f"update.share_prompts: this model's cache ({type(cache).__name__}) cannot be "
                        "indexed by batch row; set update.share_prompts = false")
    cache.batch_select_indices(p.of_row)  # each row its prompt's keys and values (a differentiable gather)
    rest = run(mb.attention_mask,
               lambda: model(input_ids=mb.input_ids,
                             attention_mask=torch.cat([p.attention_mask[p.of_row], mb.attention_mask], 1),
                             position_ids=mb.position_ids, past_key_values=cache, use_cache=True))
    return torch.cat([getattr(first, field)[p.of_row, -1:], getattr(rest, field)[:, :-1]], 1)


def response_values(values: torch.Tensor, batch: MicroBatch) -> list[list[float]]:
    """Per-row lists of a [batch, tokens] tensor at the response positions."""
    return [values[b][batch.mask[b].bool()].tolist() for b in range(values.shape[0])]


def padded(rows_values: dict[int, list[float]] | list[list[float]], mb: MicroBatch) -> torch.Tensor:
    """Per-row response values (by row of Samples) placed at the mask positions of a micro-batch."""
    t = torch.zeros_like(mb.mask)
    for b, i in enumerate(mb.index.tolist()):
        t[b][mb.mask[b].bool()] = torch.tensor(rows_values[i], dtype=t.dtype, device=t.device)
    return t

