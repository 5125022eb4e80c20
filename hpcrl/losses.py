"""Policy losses: log-probabilities, the PPO clipped surrogate, KL estimators, aggregation.

Pure functions over tensors; the trainer calls them, tests check them against hand-computed
numbers. Shapes: [batch, tokens] with a 0/1 `mask` over response tokens.

Loss aggregation (`algorithm.loss_agg`), each normalised by mini-batch totals across all ranks
and micro-batches, so the loss does not depend on how the batch is split:
  token-mean           sum of token losses / tokens in the mini-batch            (DAPO)
  seq-mean-token-mean  mean over sequences of each sequence's token mean         (GRPO paper)
  seq-mean-token-sum   mean over sequences of each sequence's token sum          (Dr.GRPO)
Clipping: `clip_low`/`clip_high` (clip-higher, DAPO) and dual-clip (`dual_clip_c`, Ye et al. 2020).

The trainer takes its policy loss from a registry (`POLICY_LOSSES`), built once per update from
the algorithm config; every entry returns a function with the one signature the trainer calls,
`(logp, old_logp, advantages, mask, *, ref_logp, kl_coef, n_tokens, n_seqs, token_entropy)`, so
a new policy loss is one decorated builder here plus its test.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), computed in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")


def token_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def token_mean(values: torch.Tensor, mask: torch.Tensor, n_tokens: float | None = None) -> torch.Tensor:
    """Sum over masked tokens divided by `n_tokens` (default: the mask's count).

    Pass the token count of the whole mini-batch across all ranks and micro-batches to get the
    same loss however the batch is split.
    """
    denom = mask.sum() if n_tokens is None else n_tokens
    return token_sum(values, mask) / max(float(denom), 1.0)


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              n_tokens: float | None = None, n_seqs: float | None = None) -> torch.Tensor:
    """Aggregate per-token values; `n_tokens`/`n_seqs` are the mini-batch totals (default: this batch's)."""
    if mode == "token-mean":
        return token_mean(values, mask, n_tokens)
    per_seq = (values * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")
    denom = values.shape[0] if n_seqs is None else n_seqs
    return per_seq.sum() / max(float(denom), 1.0)


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # to backpropagate
    pg_loss: torch.Tensor
    clipfrac: torch.Tensor  # share of tokens whose ratio was clipped
    ppo_kl: torch.Tensor  # mean of old - new logprob (approx KL(old || new))
    kl_ref: torch.Tensor  # mean KL penalty to the reference (0 without one)


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             clip_ratio: float = 0.2, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
             kl_estimator: str = "k3", n_tokens: float | None = None, *, clip_high: float | None = None,
             dual_clip_c: float | None = None, agg: str = "token-mean", n_seqs: float | None = None,
             token_entropy: torch.Tensor | None = None, entropy_coef: float = 0.0) -> PolicyLoss:
    """PPO clipped surrogate with an optional KL penalty term.

    The ratio is clipped to [1 - clip_ratio, 1 + clip_high] (clip_high defaults to clip_ratio);
    with `dual_clip_c` (> 1) the loss of a negative-advantage token is also capped at c * |A|.
    `advantages` is per sequence ([batch]) or per token ([batch, tokens]). `loss` is aggregated
    with `agg` over the mini-batch totals `n_tokens`/`n_seqs`; an entropy bonus subtracts
    `entropy_coef` times the aggregated `token_entropy`. Reported statistics are token means over
    this call's masked tokens.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    high = clip_ratio if clip_high is None else clip_high
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + high)
    pg_tokens = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        pg_tokens = torch.where(advantages < 0, torch.minimum(pg_tokens, -advantages * dual_clip_c),
                                pg_tokens)
    pg_loss = aggregate(pg_tokens, mask, agg, n_tokens, n_seqs)
    loss = pg_loss
    kl_ref = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        kl_tokens = kl_penalty(logp, ref_logp, kl_estimator)
        loss = loss + kl_coef * aggregate(kl_tokens, mask, agg, n_tokens, n_seqs)
        kl_ref = token_mean(kl_tokens.detach(), mask)
    if token_entropy is not None and entropy_coef > 0:
        loss = loss - entropy_coef * aggregate(token_entropy, mask, agg, n_tokens, n_seqs)
    with torch.no_grad():
        clipfrac = token_mean((clipped > unclipped).float(), mask)
        ppo_kl = token_mean(-log_ratio, mask)
    return PolicyLoss(loss, pg_loss.detach(), clipfrac, ppo_kl, kl_ref)


@dataclass
class ValueLoss:
    loss: torch.Tensor  # to backpropagate
    clipfrac: torch.Tensor  # share of tokens where the clipped error was the larger one


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.0, n_tokens: float | None = None, agg: str = "token-mean",
               n_seqs: float | None = None) -> ValueLoss:
    """The critic's loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, ±clip).

    PPO's value clipping (as in OpenAI baselines' ppo2 and verl): a value may move at most `clip`
    from the value the rollout was scored with before its error stops counting; `clip` 0 is the
    plain squared error. Aggregated like the policy loss (`agg` over the mini-batch totals
    `n_tokens`/`n_seqs`); `clipfrac` is a token mean over this call's masked tokens.
    """
    err = (values.float() - returns) ** 2
    if clip > 0:
        clipped = old_values + torch.clamp(values.float() - old_values, -clip, clip)
        err_clipped = (clipped - returns) ** 2
        tokens = torch.maximum(err, err_clipped)
        with torch.no_grad():
            clipfrac = token_mean((err_clipped > err).float(), mask)
    else:
        tokens = err
        clipfrac = torch.zeros((), dtype=err.dtype)
    return ValueLoss(0.5 * aggregate(tokens, mask, agg, n_tokens, n_seqs), clipfrac)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 for a perfect critic, 0 for one that
    predicts the mean, below 0 for worse; NaN when the returns do not vary."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    if r.numel() == 0:
        return float("nan")
    var_r = r.var(unbiased=False)
    if var_r == 0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


PolicyLossFn = Callable[..., PolicyLoss]
POLICY_LOSSES: dict[str, Callable[..., PolicyLossFn]] = {}


def register_policy_loss(name: str) -> Callable[[Callable[..., PolicyLossFn]], Callable[..., PolicyLossFn]]:
    def wrap(builder: Callable[..., PolicyLossFn]) -> Callable[..., PolicyLossFn]:
        POLICY_LOSSES[name] = builder
        return builder

    return wrap


@register_policy_loss("ppo_clip")
def ppo_clip_loss(a) -> PolicyLossFn:
    """`ppo_clip` with the algorithm config's clip range, dual clip, KL estimator, aggregation and
    entropy weight (`a` is hpcrl.config's AlgorithmConfig)."""
    return functools.partial(ppo_clip, clip_ratio=a.clip_ratio, kl_estimator=a.kl.estimator,
                             clip_high=a.clip_ratio_high or None, dual_clip_c=a.dual_clip_c or None,
                             agg=a.loss_agg, entropy_coef=a.entropy_coef)


def policy_loss(a) -> PolicyLossFn:
    """The registered policy loss `a.policy_loss`, built for algorithm config `a`."""
    if a.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {a.policy_loss!r}; registered: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[a.policy_loss](a)
