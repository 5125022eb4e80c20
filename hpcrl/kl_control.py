"""The coefficient of the KL penalty to the reference policy: fixed, or adapted to a target KL.

The adaptive controller is Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
Preferences", lm-human-preferences' AdaptiveKLController): after each batch,

    error = clip(KL / target - 1, -0.2, 0.2);   coef <- coef * (1 + error * n / horizon)

with KL the batch mean of each sample's KL to the reference (summed over its response tokens) and
n the number of samples in the batch. The controller's state is its coefficient. Each update
records, in its committed output (`kl_control.json`), the coefficient it used, the KL it measured
and the coefficient for the next update; the next update reads it from there (its input), so a
resumed run, staged or resident, uses exactly the coefficient the uninterrupted run would have.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hpcrl.config_training import KLConfig

FILE = "kl_control.json"
MAX_ERROR = 0.2


def adaptive_kl_coef(coef: float, current_kl: float, target: float, horizon: float, n_steps: int) -> float:
    """The adaptive controller's next coefficient (Ziegler et al. 2019)."""
    error = min(max(current_kl / target - 1.0, -MAX_ERROR), MAX_ERROR)
    return coef * (1.0 + error * n_steps / horizon)


def sequence_kl(kl_tokens: torch.Tensor, mask: torch.Tensor) -> float:
    """Batch mean of each sample's KL estimate summed over its response tokens."""
    return float((kl_tokens.double() * mask).sum(-1).mean()) if mask.shape[0] else 0.0


@dataclass
class KLControl:
    kl_coef: float  # used by this update
    kl: float  # measured by this update, before its steps (old policy vs reference)
    next_kl_coef: float  # for the next update

    def save(self, stage_dir: Path) -> None:
        (stage_dir / FILE).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")


def current_coef(kl: KLConfig, previous_update: Path | None) -> float:
    """The coefficient for this update: kl.coef when fixed, else what the previous update set."""
    if kl.target <= 0 or previous_update is None:
        return kl.coef
    path = previous_update / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the adaptive KL controller (algorithm.kl.target > 0) "
                                "needs the coefficient the previous update recorded")
    return float(json.loads(path.read_text())["next_kl_coef"])


def step(cfg: KLConfig, coef: float, kl: float, n_samples: int) -> KLControl:
    """This update's record: the next coefficient is `coef` again unless the controller is adaptive."""
    nxt = adaptive_kl_coef(coef, kl, cfg.target, cfg.horizon, n_samples) if cfg.target > 0 else coef
    return KLControl(coef, kl, nxt)
