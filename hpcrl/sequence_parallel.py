"""Ulysses sequence parallelism in the update (`update.sequence_parallel = n`), through DeepSpeed's
`UlyssesSPAttentionHF`.

The update's ranks form groups of n consecutive ranks; the ranks of a group take the same
micro-batches (the rows are split over the groups, hpcrl.trainer.step_micro_batches), and each
runs the policy's training forward pass on its n-th of every sequence: 1/n of the activations
and of the logits. Inside each attention layer DeepSpeed's all-to-all trades the sequence split
for a split over the attention heads, so each rank attends over the whole sequence for 1/n of
the heads, and back (`register`, which replaces the model's attention function in this process;
a module in eval mode bypasses it, so the no-grad passes, the reference model and the probe run
whole sequences as without it).

Each rank turns its slice of the logits into token logprobs and entropies at once, and the group
gathers those ([rows, tokens], small) with a differentiable all-gather (`token_outputs`): every
rank of the group then holds the micro-batch's logprobs and computes the same loss. The gather's
backward sums the group's gradients of that loss into each rank's slice, so each rank scales its
loss by 1/n (hpcrl.trainer.gradient_scale): the group's gradient is the loss's, and DeepSpeed's
mean over all ranks is undone as without sequence parallelism.

Plain rows are right-padded and run without an attention mask (DeepSpeed's wrapper drops masks,
which would not span the gathered sequence): causal attention never lets a real token see the
padding after it, and the padding's own outputs are masked out of the loss. Packed rows
(`update.max_tokens_per_micro_batch`) run end to end as one sequence, each from position 0: the
wrapper gathers the positions with the heads, and `segmented` runs attention on each row of the
pack apart (with flash attention, which finds the rows from the positions itself, it is not
needed). Shared prompts are refused with it: a prompt's KV cache would not be split.
"""

from __future__ import annotations

import torch

from hpcrl import batches, losses
from hpcrl.batches import MicroBatch
from hpcrl.jit_ops import import_deepspeed


def register(model: torch.nn.Module, n: int, micro_batch_size: int):
    """Make `model`'s attention sequence-parallel over groups of `n` consecutive ranks, for
    micro-batches of `micro_batch_size` rows (1 packed); the group of this rank (None for n = 1).
    Registering again (a resident trainer's next actor) wraps the original attention again."""
    if n == 1:
        return None
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # DeepSpeed's groups are made through its own comm layer, which wraps the process group the
    # resident trainers made themselves (a stage job's is made by DeepSpeed already)
    import_deepspeed().init_distributed(dist_backend=dist.get_backend(), verbose=False)
    impl = model.config._attn_implementation
    original = _ORIGINAL.setdefault(impl, ALL_ATTENTION_FUNCTIONS[impl])
    # DeepSpeed wraps what the key holds now and puts its wrapper there
    ALL_ATTENTION_FUNCTIONS[impl] = segmented(original) if impl == "sdpa" else original
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, impl, n, micro_batch_size, seq_length_is_variable=True, disable_in_eval=True)
    return mpu.get_sequence_parallel_group()


_ORIGINAL: dict[str, object] = {}  # transformers' attention functions before `register` wrapped them


def segmented(attention):
    """`attention` (a transformers attention function) run on each row of a packed sequence apart
    when it gets no mask and `position_ids` that start again inside the sequence (the gathered
    positions of a packed micro-batch): causal within each row, as transformers' packed mask is,
    without an O(length^2) mask. Anything else goes to `attention` as is."""
    def run(module, query, key, value, attention_mask, *args, **kwargs):
        positions = kwargs.get("position_ids")
        if attention_mask is not None or positions is None or positions.shape[-1] != query.shape[2]:
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        bounds = [segment_bounds(row) for row in positions.tolist()]
        if all(len(b) == 2 for b in bounds):
            return attention(module, query, key, value, None, *args, **kwargs)
        rows = []
        for r, cuts in enumerate(bounds):
            parts = [attention(module, query[r:r + 1, :, a:b], key[r:r + 1, :, a:b], value[r:r + 1, :, a:b],
                               None, *args, **kwargs)[0] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
            rows.append(torch.cat(parts, 1))
        return torch.cat(rows, 0), None
    return run


def segment_bounds(positions: list[int]) -> list[int]:
    """Where each run of consecutive positions starts, and the end: [0, ..., len(positions)]."""
    starts = [t for t in range(1, len(positions)) if positions[t] != positions[t - 1] + 1]
    return [0, *starts, len(positions)]


def slice_bounds(length: int, n: int, index: int) -> tuple[int, int, int]:
    """(padded length, start, end) of slice `index` when a sequence of `length` tokens is padded
    to a multiple of `n` and cut into n equal slices."""
    padded = -(-length // n) * n
    size = padded // n
    return padded, index * size, (index + 1) * size


def token_outputs(model, mb: MicroBatch, group, temperature: float,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's token logprobs of `mb.targets` and token entropies (aligned with the
    targets as hpcrl.batches.response_outputs' logits are), each rank of `group` computing its
    slice of the sequence; differentiable, the entropies only `with_entropy`."""
    inputs, targets = _slice(mb, group)
    logits = model(**inputs).logits
    logp = losses.token_logprobs(logits, targets, temperature)
    with torch.set_grad_enabled(with_entropy and torch.is_grad_enabled()):
        entropy = losses.entropy(logits)
    return _aligned(_gather(logp, group), mb), _aligned(_gather(entropy, group), mb)


def values(model, mb: MicroBatch, group) -> torch.Tensor:
    """A value model's values (hpcrl.critic.ValueModel) aligned with mb.targets, each rank of
    `group` computing its slice of the sequence; differentiable."""
    inputs, _ = _slice(mb, group)
    return _aligned(_gather(model(**inputs).values, group), mb)


def _slice(mb: MicroBatch, group) -> tuple[dict, torch.Tensor]:
    """This rank's slice of the micro-batch (padded to a multiple of the group's size): the
    model's keyword arguments and the token each output position is about."""
    import torch.distributed as dist

    if mb.prompts is not None:
        raise ValueError("sequence parallelism runs rows whole: expected update.share_prompts = false")
    rows, length = mb.input_ids.shape
    padded, start, end = slice_bounds(length, dist.get_world_size(group), dist.get_rank(group))
    ids = torch.nn.functional.pad(mb.input_ids, (0, padded - length))
    if mb.packed is None:
        targets = torch.nn.functional.pad(mb.targets, (0, padded - mb.targets.shape[1]))
        positions = torch.arange(padded, device=ids.device).expand(rows, -1)
    else:  # the output at t is about token t + 1; the padding goes on from the last row's positions
        targets = torch.nn.functional.pad(mb.input_ids[:, 1:], (0, padded - length + 1))
        more = torch.arange(1, padded - length + 1, device=ids.device)
        positions = torch.cat([mb.position_ids, mb.position_ids[:, -1:] + more], 1)
    inputs = dict(input_ids=ids[:, start:end], position_ids=positions[:, start:end].contiguous(),
                  attention_mask=None, use_cache=False)
    return inputs, targets[:, start:end]


def _aligned(gathered: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Per-position outputs of the whole padded sequence ([rows, padded]) aligned with mb.targets."""
    if mb.packed is None:
        return gathered[:, :mb.targets.shape[1]]
    return batches.unpack(gathered[0, mb.packed], mb)


def _gather(local: torch.Tensor, group) -> torch.Tensor:
    """The group's slices side by side along the sequence (dim 1); the backward sums the group's
    gradients into each rank's slice."""
    return _GatherSlices.apply(local, group)


class _GatherSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.width = group, local.shape[1]
        ctx.index = dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank's loss reaches every slice
        start = ctx.index * ctx.width
        return grad[:, start:start + ctx.width], None
