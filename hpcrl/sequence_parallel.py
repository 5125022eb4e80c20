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

Rows are right-padded and run without an attention mask (DeepSpeed's wrapper drops masks, which
would not span the gathered sequence): causal attention never lets a real token see the padding
after it, and the padding's own outputs are masked out of the loss. Packed rows would see each
other, so packing (`update.max_tokens_per_micro_batch`) and shared prompts are refused with it.
"""

from __future__ import annotations

import torch

from hpcrl import losses
from hpcrl.batches import MicroBatch


def register(model: torch.nn.Module, n: int, micro_batch_size: int):
    """Make `model`'s attention sequence-parallel over groups of `n` consecutive ranks; the group
    of this rank (None for n = 1)."""
    if n == 1:
        return None
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    # DeepSpeed's groups are made through its own comm layer, which wraps the process group the
    # resident trainers made themselves (a stage job's is made by DeepSpeed already)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, model.config._attn_implementation, n, micro_batch_size, seq_length_is_variable=True,
        disable_in_eval=True)
    return mpu.get_sequence_parallel_group()


def slice_bounds(length: int, n: int, index: int) -> tuple[int, int, int]:
    """(padded length, start, end) of slice `index` when a sequence of `length` tokens is padded
    to a multiple of `n` and cut into n equal slices."""
    padded = -(-length // n) * n
    size = padded // n
    return padded, index * size, (index + 1) * size


def token_outputs(model, mb: MicroBatch, group, temperature: float,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's token logprobs of `mb.targets` and token entropies ([rows, tokens - 1],
    aligned with the targets as hpcrl.batches.response_outputs' logits are), each rank of `group`
    computing its slice of the sequence; differentiable, the entropies only `with_entropy`."""
    import torch.distributed as dist

    if mb.prompts is not None or mb.packed is not None:
        raise ValueError("sequence parallelism runs rows whole and padded: expected update.share_prompts = "
                         "false and update.max_tokens_per_micro_batch = 0")
    rows, length = mb.input_ids.shape
    padded, start, end = slice_bounds(length, dist.get_world_size(group), dist.get_rank(group))
    ids = torch.nn.functional.pad(mb.input_ids, (0, padded - length))
    targets = torch.nn.functional.pad(mb.targets, (0, padded - mb.targets.shape[1]))
    positions = torch.arange(padded, device=ids.device).expand(rows, -1)
    logits = model(input_ids=ids[:, start:end], position_ids=positions[:, start:end].contiguous(),
                   attention_mask=None, use_cache=False).logits
    logp = losses.token_logprobs(logits, targets[:, start:end], temperature)
    with torch.set_grad_enabled(with_entropy and torch.is_grad_enabled()):
        entropy = losses.entropy(logits)
    cut = mb.targets.shape[1]
    return _gather(logp, group)[:, :cut], _gather(entropy, group)[:, :cut]


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
