"""One optimizer step's policy loss, micro-batch by micro-batch, and the statistics it adds up:
shared by the update backends (hpcrl.actor's DeepSpeed engine, hpcrl.megatron_actor), which differ
in how they run the model and reduce over ranks, not in what they compute from its logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hpcrl import losses
from hpcrl.batches import MicroBatch, Samples, padded, response_values

STAT_NAMES = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_ref", "entropy", "is_weight_mean")
OFF_POLICY_NAMES = ("off_policy_weight_mean", "off_policy_clipfrac")  # with the off-policy correction


@dataclass
class StepInputs:
    """What one optimizer step of the policy trains on, by row of the update batch."""

    adv: torch.Tensor | dict[int, list[float]]  # one advantage per sample, or per token by row (ppo's GAE)
    old: dict[int, list[float]] | None  # None: the policy has not stepped since sampling (see StepLoss)
    ref: dict[int, list[float]] | None  # the reference policy's logprobs (a KL term in the loss)
    kl_coef: float  # the KL loss weight (0 when the KL is in the reward)


@dataclass
class StepLoss:
    """The policy loss of each micro-batch of one step on mini-batch rows `mini`, and the step's
    statistics (global token means once summed over the ranks).

    With `inputs.old` None the old logprobs are each forward pass's own (detached), kept by row in
    `fresh_old`. With `off_policy` (algorithm.off_policy_cap, algorithm.max_log_ratio) the token
    losses are weighted by the truncated importance weight of old over sampler."""

    policy_loss: Callable
    samples: Samples
    mini: list[int]
    inputs: StepInputs
    rank: int
    off_policy: tuple[float, float] | None = None
    sums: dict[str, float] = field(init=False)
    weight_max: float = 0.0
    behaviour_max: float = 0.0
    fresh_old: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        self.n_tokens = sum(len(self.samples.response_ids[i]) for i in self.mini)
        self.sums = dict.fromkeys(self.names, 0.0)

    @property
    def names(self) -> tuple[str, ...]:
        return STAT_NAMES + (OFF_POLICY_NAMES if self.off_policy else ())

    def __call__(self, mb: MicroBatch, logp: torch.Tensor, token_entropy: torch.Tensor | None,
                 entropy_stat: torch.Tensor) -> torch.Tensor:
        """Micro-batch `mb`'s loss (its share of the step's), from its token logprobs."""
        inputs = self.inputs
        if inputs.old is None:
            old = logp.detach()
            self.fresh_old.update(zip(mb.index.tolist(), response_values(old, mb), strict=True))
        else:
            old = padded(inputs.old, mb)
        adv = padded(inputs.adv, mb) if isinstance(inputs.adv, dict) else inputs.adv[mb.index].to(logp.device)
        bw = None
        if self.off_policy:
            bw = losses.behaviour_weight(old, padded(self.samples.sampler_logprobs, mb), mb.mask,
                                         *self.off_policy)
        out = self.policy_loss(logp, old, adv, mb.mask, kl_coef=inputs.kl_coef, n_tokens=self.n_tokens,
                               ref_logp=padded(inputs.ref, mb) if inputs.ref is not None else None,
                               n_seqs=len(self.mini), token_entropy=token_entropy,
                               behaviour_weight=bw.weight if bw is not None else None)
        if not torch.isfinite(out.loss):
            raise FloatingPointError(f"non-finite loss ({out.loss.item()}) on rank {self.rank}; the "
                                     "update is not committed and the run stays at the last good "
                                     "policy version")
        _accumulate(self.sums, out, entropy_stat, mb.mask, (self.n_tokens, len(self.mini)), bw)
        self.weight_max = max(self.weight_max, out.weight_max.item())
        if bw is not None:
            self.behaviour_max = max(self.behaviour_max, bw.max.item())
        return out.loss

    def stats(self, all_sum: Callable[[list[float]], list[float]], all_max: Callable[[float], float],
              copies: int = 1) -> dict[str, float]:
        """The step's statistics: the sums over the ranks (`all_sum`; `copies` ranks compute each
        micro-batch, so each counts once) and the maxima (`all_max`)."""
        names = self.names
        stats = dict(zip(names, [v / copies for v in all_sum([self.sums[k] for k in names])], strict=True))
        stats.update(tokens=self.n_tokens, is_weight_max=all_max(self.weight_max),
                     off_policy_weight_max=all_max(self.behaviour_max) if self.off_policy else None)
        return stats


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                         with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A micro-batch's token logprobs, its token entropies where the loss takes them (else None),
    and its token entropies detached (a statistic)."""
    logp = losses.token_logprobs(logits, targets, temperature)
    with torch.set_grad_enabled(with_entropy and torch.is_grad_enabled()):
        entropy = losses.entropy(logits)
    return logp, entropy if with_entropy else None, entropy.detach()


def _accumulate(sums: dict[str, float], out: losses.PolicyLoss, token_entropy: torch.Tensor,
                mask: torch.Tensor, totals: tuple[int, int], behaviour: losses.BehaviourWeight | None = None
                ) -> None:
    """Add one micro-batch's share of the step's statistics: token means over the mini-batch's
    `totals` (tokens, sequences), or sequence means for a loss that clips sequences; the
    off-policy weight's (`behaviour`) are token means."""
    n_tokens, n_seqs = totals
    tokens = float(mask.sum())
    share = tokens / n_tokens if out.level == "token" else float((mask.sum(-1) > 0).sum()) / n_seqs
    ent = losses.token_sum(token_entropy, mask).item()
    sums["loss"] += out.loss.item()
    sums["pg_loss"] += out.pg_loss.item()
    sums["pg_clipfrac"] += out.clipfrac.item() * share
    sums["is_weight_mean"] += out.weight_mean.item() * share
    sums["ppo_kl"] += out.ppo_kl.item() * tokens / n_tokens
    sums["kl_ref"] += out.kl_ref.item() * tokens / n_tokens
    sums["entropy"] += ent / n_tokens
    if behaviour is not None:
        sums["off_policy_weight_mean"] += behaviour.mean.item() * tokens / n_tokens
        sums["off_policy_clipfrac"] += behaviour.clipfrac.item() * tokens / n_tokens
