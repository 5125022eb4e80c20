"""Policy losses: log-probabilities, the PPO clipped surrogate, KL estimators, aggregation.

Pure functions over tensors; the trainer calls them, tests check them against hand-computed
numbers. Shapes: [batch, tokens] with a 0/1 `mask` over response tokens.
"""

from __future__ import annotations

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


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # to backpropagate
    pg_loss: torch.Tensor
    clipfrac: torch.Tensor  # share of tokens whose ratio was clipped
    ppo_kl: torch.Tensor  # mean of old - new logprob (approx KL(old || new))
    kl_ref: torch.Tensor  # mean KL penalty to the reference (0 without one)


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             clip_ratio: float = 0.2, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
             kl_estimator: str = "k3", n_tokens: float | None = None) -> PolicyLoss:
    """PPO clipped surrogate with token-mean aggregation and an optional KL penalty term.

    `advantages` is per sequence ([batch]) or per token ([batch, tokens]). Reported statistics are
    means over this call's masked tokens; `loss` is normalised by `n_tokens` (see token_mean).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    pg_tokens = torch.maximum(unclipped, clipped)
    pg_loss = token_mean(pg_tokens, mask, n_tokens)
    loss = pg_loss
    kl_ref = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        kl_tokens = kl_penalty(logp, ref_logp, kl_estimator)
        loss = loss + kl_coef * token_mean(kl_tokens, mask, n_tokens)
        kl_ref = token_mean(kl_tokens.detach(), mask)
    with torch.no_grad():
        clipfrac = token_mean((clipped > unclipped).float(), mask)
        ppo_kl = token_mean(-log_ratio, mask)
    return PolicyLoss(loss, pg_loss.detach(), clipfrac, ppo_kl, kl_ref)
