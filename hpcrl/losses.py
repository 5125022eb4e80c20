"""Policy losses: log-probabilities, the PPO clipped surrogate, KL estimators, aggregation.

Pure functions over tensors; the trainer calls them, tests check them against hand-computed
numbers. Shapes: [batch, tokens] with a 0/1 `mask` over response tokens.

Loss aggregation (`algorithm.loss_agg`), each normalised by mini-batch totals across all ranks
and micro-batches, so the loss does not depend on how the batch is split:
  token-mean           sum of token losses / tokens in the mini-batch            (DAPO)
  seq-mean-token-mean  mean over sequences of each sequence's token mean         (GRPO paper)
  seq-mean-token-sum   mean over sequences of each sequence's token sum
  seq-mean-token-sum-norm  the same divided by a constant length, generate.max_tokens (Dr.GRPO)
Clipping: `clip_ratio`/`clip_high` (clip-higher, DAPO) and dual-clip (`dual_clip_c`, Ye et al. 2020).

Policy losses are registered surrogates (`POLICY_LOSSES`: ppo_clip, gspo, cispo, gpg): each maps
(logp, old_logp, advantages, mask, LossParams) to its per-token loss and what it clipped, at the
level it clips (tokens, or sequences for gspo). `policy_loss_of` adds what every loss shares
(aggregation, the KL penalty, the entropy bonus, the statistics), and `policy_loss` builds the
configured one once per update, so a new policy loss is one decorated function here plus its
test.
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


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              n_tokens: float | None = None, n_seqs: float | None = None,
              norm_len: float | None = None) -> torch.Tensor:
    """Aggregate per-token values; `n_tokens`/`n_seqs` are the mini-batch totals (default: this
    batch's); `norm_len` is seq-mean-token-sum-norm's constant length (default: the padded width)."""
    if mode == "token-mean":
        return token_mean(values, mask, n_tokens)
    per_seq = (values * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / float(norm_len or values.shape[-1])
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")
    denom = values.shape[0] if n_seqs is None else n_seqs
    return per_seq.sum() / max(float(denom), 1.0)


@dataclass(frozen=True)
class LossParams:
    """The algorithm config's settings of a policy loss (`from_config`)."""

    clip_ratio: float = 0.2  # the lower clip range (and the upper one without clip_high)
    clip_high: float | None = None  # clip-higher (DAPO)
    dual_clip_c: float | None = None  # ppo_clip: cap of a negative-advantage token's loss at c * |A|
    kl_estimator: str = "k3"
    agg: str = "token-mean"
    entropy_coef: float = 0.0
    max_log_ratio: float = 20.0  # |log(pi / pi_old)| bound before exp (ppo_clip, cispo)
    norm_len: float | None = None  # seq-mean-token-sum-norm's constant (generate.max_tokens)

    @classmethod
    def from_config(cls, a, max_tokens: int | None = None) -> LossParams:
        """`a` is hpcrl.config's AlgorithmConfig; `max_tokens` the generate config's."""
        return cls(a.clip_ratio, a.clip_ratio_high or None, a.dual_clip_c or None, a.kl.estimator, a.loss_agg,
                   a.entropy_coef, a.max_log_ratio, max_tokens)

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_high is None else self.clip_high


@dataclass
class Surrogate:
    """A policy loss's per-token loss, and what it clipped, at the level it clips."""

    tokens: torch.Tensor  # [batch, tokens]
    clipped: torch.Tensor  # 0/1: per token ([batch, tokens]) or per sequence ([batch])
    weight: torch.Tensor  # the importance weight pi / pi_old, at the same level (detached)
    agg: str | None = None  # an aggregation the loss requires (gspo)


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # to backpropagate
    pg_loss: torch.Tensor
    clipfrac: torch.Tensor  # share of the tokens (or sequences, `level`) that were clipped
    ppo_kl: torch.Tensor  # mean of old - new logprob (approx KL(old || new))
    kl_ref: torch.Tensor  # mean KL penalty to the reference (0 without one)
    weight_mean: torch.Tensor  # mean importance weight pi / pi_old (tokens or sequences, `level`)
    weight_max: torch.Tensor
    level: str = "token"  # "token" or "sequence"


Surrogates = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossParams], Surrogate]
POLICY_LOSSES: dict[str, Surrogates] = {}


def register_policy_loss(name: str) -> Callable[[Surrogates], Surrogates]:
    def wrap(fn: Surrogates) -> Surrogates:
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def _ratio(logp: torch.Tensor, old_logp: torch.Tensor, p: LossParams) -> torch.Tensor:
    return torch.exp(torch.clamp(logp - old_logp, -p.max_log_ratio, p.max_log_ratio))


@register_policy_loss("ppo_clip")
def ppo_surrogate(logp, old_logp, adv, mask, p: LossParams) -> Surrogate:
    """PPO's clipped surrogate: max(-A r, -A clip(r, 1 - low, 1 + high)) per token, r = pi / pi_old;
    with `dual_clip_c` the loss of a negative-advantage token is also capped at c * |A|."""
    ratio = _ratio(logp, old_logp, p)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - p.clip_ratio, 1.0 + p.high)
    tokens = torch.maximum(unclipped, clipped)
    if p.dual_clip_c is not None:
        tokens = torch.where(adv < 0, torch.minimum(tokens, -adv * p.dual_clip_c), tokens)
    return Surrogate(tokens, (clipped > unclipped).float(), ratio.detach())


@register_policy_loss("gspo")
def gspo_surrogate(logp, old_logp, adv, mask, p: LossParams) -> Surrogate:
    """GSPO (Zheng et al. 2025): the sequence's importance ratio s = exp(mean over its tokens of
    log(pi / pi_old)), clipped to [1 - low, 1 + high] per sequence; each token carries
    s * pi / sg(pi) so that its gradient is the sequence's (verl's loss_mode "gspo"; the log of s
    is capped at 10 as there). Aggregated seq-mean-token-mean."""
    lengths = mask.sum(-1).clamp(min=1)
    seq_log = ((logp - old_logp) * mask).sum(-1) / lengths
    log_s = torch.clamp(logp - logp.detach() + seq_log.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    unclipped = -adv * s
    clipped = -adv * torch.clamp(s, 1.0 - p.clip_ratio, 1.0 + p.high)
    seq_clipped = ((clipped > unclipped).float() * mask).amax(-1)  # the clip bit the sequence
    seq_s = torch.exp(torch.clamp(seq_log.detach(), max=10.0))
    return Surrogate(torch.maximum(unclipped, clipped), seq_clipped, seq_s, agg="seq-mean-token-mean")


@register_policy_loss("cispo")
def cispo_surrogate(logp, old_logp, adv, mask, p: LossParams) -> Surrogate:
    """CISPO (MiniMax 2025): -sg(clip(r, 1 - low, 1 + high)) A log pi per token: the importance
    weight is clipped and carries no gradient, so no token loses its gradient to the clip (verl's
    loss_mode "cispo")."""
    ratio = _ratio(logp, old_logp, p).detach()
    weight = torch.clamp(ratio, 1.0 - p.clip_ratio, 1.0 + p.high)
    return Surrogate(-weight * adv * logp, (weight != ratio).float(), ratio)


@register_policy_loss("gpg")
def gpg_surrogate(logp, old_logp, adv, mask, p: LossParams) -> Surrogate:
    """GPG (Chu et al. 2025): the plain policy gradient -A log pi, no ratio and no clip (verl's
    loss_mode "gpg"; pair it with algorithm.name = "gpg")."""
    ratio = torch.exp(logp - old_logp).detach()
    return Surrogate(-adv * logp, torch.zeros_like(logp), ratio)


def policy_loss_of(surrogate: Surrogates, logp: torch.Tensor, old_logp: torch.Tensor,
                   advantages: torch.Tensor, mask: torch.Tensor, params: LossParams, *,
                   ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, n_tokens: float | None = None,
                   n_seqs: float | None = None, token_entropy: torch.Tensor | None = None) -> PolicyLoss:
    """A registered surrogate's loss, aggregated over the mini-batch totals `n_tokens`/`n_seqs`
    (default: this batch's), with the KL penalty to the reference (`kl_coef` times the aggregated
    per-token estimate) and the entropy bonus (`params.entropy_coef`). `advantages` is per
    sequence ([batch]) or per token ([batch, tokens]). Statistics are means over this call's
    masked tokens (or sequences, for a loss that clips sequences)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    sur = surrogate(logp, old_logp, advantages, mask, params)
    agg = functools.partial(aggregate, mask=mask, mode=sur.agg or params.agg, n_tokens=n_tokens,
                            n_seqs=n_seqs, norm_len=params.norm_len)
    pg_loss = agg(sur.tokens)
    loss = pg_loss
    kl_ref = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        kl_tokens = kl_penalty(logp, ref_logp, params.kl_estimator)
        loss = loss + kl_coef * agg(kl_tokens)
        kl_ref = token_mean(kl_tokens.detach(), mask)
    if token_entropy is not None and params.entropy_coef > 0:
        loss = loss - params.entropy_coef * agg(token_entropy)
    with torch.no_grad():
        ppo_kl = token_mean(old_logp - logp, mask)
        if sur.clipped.dim() == 1:  # per sequence
            rows = (mask.sum(-1) > 0).float()
            n = rows.sum().clamp(min=1)
            clipfrac, w_mean = (sur.clipped * rows).sum() / n, (sur.weight * rows).sum() / n
            w_max = sur.weight.masked_fill(rows == 0, 0.0).max() if rows.any() else torch.zeros(())
        else:
            clipfrac, w_mean = token_mean(sur.clipped, mask), token_mean(sur.weight, mask)
            w_max = sur.weight.masked_fill(mask == 0, 0.0).max() if mask.any() else torch.zeros(())
    return PolicyLoss(loss, pg_loss.detach(), clipfrac, ppo_kl, kl_ref, w_mean, w_max,
                      "sequence" if sur.clipped.dim() == 1 else "token")


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             clip_ratio: float = 0.2, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
             kl_estimator: str = "k3", n_tokens: float | None = None, *, clip_high: float | None = None,
             dual_clip_c: float | None = None, agg: str = "token-mean", n_seqs: float | None = None,
             token_entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
             max_log_ratio: float = 20.0) -> PolicyLoss:
    """PPO clipped surrogate with an optional KL penalty term (`ppo_surrogate` through
    `policy_loss_of`, its settings as keywords)."""
    params = LossParams(clip_ratio, clip_high, dual_clip_c, kl_estimator, agg, entropy_coef, max_log_ratio)
    return policy_loss_of(ppo_surrogate, logp, old_logp, advantages, mask, params, ref_logp=ref_logp,
                          kl_coef=kl_coef, n_tokens=n_tokens, n_seqs=n_seqs, token_entropy=token_entropy)


@dataclass
class ValueLoss:
    loss: torch.Tensor  # to backpropagate
    clipfrac: torch.Tensor  # share of tokens whose V left the clip range and whose clipped error counted


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.0, n_tokens: float | None = None, agg: str = "token-mean",
               n_seqs: float | None = None) -> ValueLoss:
    """The critic's loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, ±clip).

    PPO's value clipping (as in OpenAI baselines' ppo2 and verl): a value may move at most `clip`
    from the value the rollout was scored with before its error stops counting; `clip` 0 is the
    plain squared error. Aggregated like the policy loss (`agg` over the mini-batch totals
    `n_tokens`/`n_seqs`); `clipfrac`, the share of tokens whose V left the range and whose clipped
    error was the larger (verl's vf_clipfrac, without counting a clamp that rounds V inside the
    range), is a token mean over this call's masked tokens.
    """
    err = (values.float() - returns) ** 2
    if clip > 0:
        clipped = old_values + torch.clamp(values.float() - old_values, -clip, clip)
        err_clipped = (clipped - returns) ** 2
        tokens = torch.maximum(err, err_clipped)
        with torch.no_grad():  # V left the range (a clamp that only rounds V is no clip) and it counted
            left = (values.float() - old_values).abs() > clip
            clipfrac = token_mean((left & (err_clipped > err)).float(), mask)
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


def policy_loss(a, max_tokens: int | None = None) -> PolicyLossFn:
    """The registered policy loss `a.policy_loss` with the settings of algorithm config `a`: a
    function of (logp, old_logp, advantages, mask, *, ref_logp, kl_coef, n_tokens, n_seqs,
    token_entropy), the one signature the trainer calls."""
    if a.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {a.policy_loss!r}; registered: {', '.join(POLICY_LOSSES)}")
    return functools.partial(policy_loss_of, POLICY_LOSSES[a.policy_loss],
                             params=LossParams.from_config(a, max_tokens))
