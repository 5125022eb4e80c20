"""Advantage estimators: pure functions from rewards (and values) to advantages.

A registry maps the config's `algorithm.name` to an outcome-reward estimator, so adding one is one
decorated function here plus its test. Every estimator is called with the samples' rewards, their
group ids and response lengths (tokens) and the keywords `norm_by_std`, `eps` and `gamma`, and
returns one advantage per sample ([n]) or, when the advantage varies along a response, one per
token (a list of per-token lists); remax also gets `baselines`. No I/O here.

| name (verl's `adv_estimator` too) | advantage of sample i in group g |
|---|---|
| grpo | (r_i - mean_g) / (std_g + eps) |
| rloo | r_i - mean of the other samples of g |
| reinforce_plus_plus_baseline | r_i - mean_g, whitened over the batch's tokens |
| reinforce_plus_plus | per-token discounted returns gamma^(T-1-t) r_i, whitened over tokens |
| gpg | (n / #nonzero rewards) (r_i - mean_g) |
| remax | r_i - reward of the prompt's greedy response |

grpo without the division (norm_by_std false) is Dr.GRPO (Liu et al. 2025); `reinforce_pp` is
the older name of reinforce_plus_plus_baseline (Hu 2025). Whitening over tokens weighs each sample
by its response length, as verl does.

PPO with a critic (`algorithm.name = "ppo"`, not in the registry: it needs values) uses the
token-level functions at the end: `token_rewards` (outcome on the last token, KL penalty on every
token), `gae` (Schulman et al. 2016) and `masked_whiten`; hpcrl.critic.gae_targets chains them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Estimator = Callable[..., torch.Tensor]
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    def wrap(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = fn
        return fn

    return wrap


def _groups(rewards: torch.Tensor, group_ids: torch.Tensor):
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inverse, rewards)
    return inverse, counts, sums


@register("grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
         eps: float = 1e-6, **_) -> torch.Tensor:
    """(r - mean_group(r)) / (std_group(r) + eps); without the division when `norm_by_std` is False.

    The std is the unbiased sample std, as in verl and the GRPO paper's reference code. A group
    whose rewards are all equal gets advantage 0.
    """
    rewards = rewards.to(torch.float64)
    inverse, counts, sums = _groups(rewards, group_ids)
    centred = rewards - (sums / counts)[inverse]
    if not norm_by_std:
        return centred.to(torch.float32)
    sq = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inverse, centred**2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    denom = std[inverse] + eps
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where(denom > 0, centred / safe, torch.zeros_like(centred)).to(torch.float32)


@register("rloo")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor, **_) -> torch.Tensor:
    """Leave-one-out baseline: r_i minus the mean reward of the group's other samples."""
    rewards = rewards.to(torch.float64)
    inverse, counts, sums = _groups(rewards, group_ids)
    n = counts[inverse].to(torch.float64)
    others = (sums[inverse] - rewards) / (n - 1).clamp(min=1)
    return torch.where(n > 1, rewards - others, torch.zeros_like(rewards)).to(torch.float32)


def _token_whiten(per_sample: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten a per-sample value repeated on each of its response tokens, over all the batch's
    tokens (masked_whiten of the token matrix, computed per sample): length-weighted mean and
    unbiased variance. A sample without tokens gets 0."""
    w = lengths.to(torch.float64)
    n = w.sum()
    mean = (w * per_sample).sum() / n.clamp(min=1)
    var = (w * (per_sample - mean) ** 2).sum() / (n - 1).clamp(min=1)
    return torch.where(w > 0, (per_sample - mean) * torch.rsqrt(var + eps), torch.zeros_like(per_sample))


@register("reinforce_plus_plus_baseline")
@register("reinforce_pp")
def reinforce_pp_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor,
                          **_) -> torch.Tensor:
    """REINFORCE++ with baseline: group-centred rewards, whitened over the batch's response tokens."""
    centred = grpo(rewards, group_ids, norm_by_std=False).to(torch.float64)
    return _token_whiten(centred, lengths).to(torch.float32)


@register("reinforce_plus_plus")
def reinforce_plus_plus(rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor,
                        gamma: float = 1.0, **_) -> torch.Tensor | list[list[float]]:
    """REINFORCE++ (no baseline): the discounted return of each response token, gamma^(T-1-t) r
    for an outcome reward r on the last of T tokens, whitened over the batch's tokens. Per sample
    when gamma is 1 (every token of a response has the same return), else per token."""
    rewards = rewards.to(torch.float64)
    if gamma == 1.0:
        return _token_whiten(rewards, lengths).to(torch.float32)
    width = int(lengths.max()) if lengths.numel() else 0
    t = torch.arange(width, dtype=torch.float64)
    mask = t < lengths.unsqueeze(-1)
    exponent = (lengths.unsqueeze(-1) - 1 - t).clamp(min=0)
    returns = rewards.unsqueeze(-1) * gamma ** exponent * mask
    white = masked_whiten(returns, mask)
    return [white[i, : int(lengths[i])].tolist() for i in range(len(rewards))]


@register("gpg")
def gpg(rewards: torch.Tensor, group_ids: torch.Tensor, **_) -> torch.Tensor:
    """GPG (Chu et al. 2025): group-centred rewards scaled by n / (samples with a nonzero reward),
    as verl counts them."""
    alpha = rewards.numel() / max(int(torch.count_nonzero(rewards)), 1)
    return (alpha * grpo(rewards, group_ids, norm_by_std=False).to(torch.float64)).to(torch.float32)


@register("remax")
def remax(rewards: torch.Tensor, group_ids: torch.Tensor, baselines: torch.Tensor | None = None,
          **_) -> torch.Tensor:
    """ReMax (Li et al. 2024): r minus the reward of the prompt's greedy response, which the
    generate stage samples and the score stage scores (split "baseline"); no whitening."""
    if baselines is None:
        raise ValueError("remax needs the reward of each prompt's greedy baseline sample (rollouts of split "
                         "\"baseline\", which the generate stage samples when algorithm.name = \"remax\")")
    return (rewards.to(torch.float64) - baselines.to(torch.float64)).to(torch.float32)


def compute(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, *,
            norm_by_std: bool = True, eps: float = 1e-6, gamma: float = 1.0,
            baselines: torch.Tensor | None = None) -> torch.Tensor | list[list[float]]:
    """The advantages of estimator `name`: per sample ([n]) or per token (lists by sample)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](rewards, group_ids, lengths=lengths, norm_by_std=norm_by_std, eps=eps,
                            gamma=gamma, baselines=baselines)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens ([batch, tokens] each).

    Returns (advantages, returns = advantages + values); the value after the last response token
    is 0. Positions outside `mask` get 0 and are skipped when bootstrapping.
    """
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    last = torch.zeros(rewards.shape[0], dtype=torch.float64)
    next_value = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t].to(torch.float64)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = m * (delta + gamma * lam * last) + (1 - m) * last
        next_value = m * values[:, t].to(torch.float64) + (1 - m) * next_value
        advantages[:, t] = m * last
    return advantages.to(rewards.dtype), (advantages + values * mask).to(rewards.dtype)


def token_rewards(outcome: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards for GAE ([batch, tokens]): -kl_coef * kl on every response token, plus
    the outcome reward of the sample on its last response token (Ziegler et al. 2019).

    A row without response tokens gets no reward. Positions outside `mask` are 0.
    """
    mask = mask.to(torch.float64)
    rewards = torch.zeros_like(mask)
    if kl is not None and kl_coef:
        rewards = -kl_coef * kl.to(torch.float64) * mask
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += outcome.to(torch.float64)[rows]
    return rewards


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased var, as verl and TRL);
    positions outside `mask` are 0."""
    m = mask.to(torch.float64)
    x = values.to(torch.float64)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return ((x - mean) * torch.rsqrt(var + eps) * m).to(values.dtype)
