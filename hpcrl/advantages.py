"""Advantage estimators: pure functions from rewards to per-sample advantages.

GRPO normalises each reward within its group (the samples of one prompt). No I/O here.
"""

from __future__ import annotations

import torch


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
         eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group(r)) / (std_group(r) + eps); without the division when `norm_by_std` is False.

    The std is the unbiased sample std, as in verl and the GRPO paper's reference code. A group
    whose rewards are all equal gets advantage 0.
    """
    rewards = rewards.to(torch.float64)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, rewards)
    means = sums / counts
    centred = rewards - means[inverse]
    if not norm_by_std:
        return centred.to(torch.float32)
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, centred**2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    denom = std[inverse] + eps
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where(denom > 0, centred / safe, torch.zeros_like(centred)).to(torch.float32)
