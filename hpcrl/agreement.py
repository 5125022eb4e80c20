"""Whether the trainer computes the model vLLM samples from.

Two implementations of one architecture can disagree (an attention path that skips soft-capping,
another RoPE reading, another dtype) while both load the same weights; PPO then trains a model
other than the one generating, and nothing else notices. Two checks:

- before the first iteration (resident): the trainer's and vLLM's logprobs of the probe
  sequences, from the same weights, must agree within the probe tolerance
  (hpcrl.weight_sync.probe_tolerance); otherwise the run is refused with both numbers and what
  to look at (`check_start`);
- every update (both modes): the recomputed old logprobs against the sampler's, over the batch's
  tokens: their mean and largest difference and the KL between the two (`sampler_mismatch`),
  recorded as rollout/* metrics; above `update.sampler_mismatch_tol` the update stops uncommitted
  (`check_sampler`).
"""

from __future__ import annotations

import math

import numpy as np

from hpcrl.weight_sync import WeightSyncError

HINT = ("the trainer's attention implementation (soft-capping, sliding windows; hpcrl.policy_model), "
        "model.dtype, and the RoPE settings in the model's config.json")


class ModelMismatchError(WeightSyncError):
    """The trainer and vLLM compute different models from the same weights."""


def _diffs(a: list[list[float]], b: list[list[float]]) -> np.ndarray:
    """Token by token differences of two sides' logprobs of the same rows (a row of another
    length is refused, never broadcast)."""
    rows = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if len(x) != len(y):
            raise ModelMismatchError(f"row {i}: {len(x)} logprobs on one side, {len(y)} on the other; "
                                     "both sides must score the same tokens")
        rows.append(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64))
    return np.concatenate(rows) if rows else np.zeros(0)


def check_start(engine: list[list[float]], trainer: list[list[float]], tol: float,
                attn_implementation: str, model: str) -> dict[str, float]:
    """Refuse a run whose trainer and vLLM disagree on the probe sequences before any update."""
    d = np.abs(_diffs(engine, trainer))
    mean, worst = (float(d.mean()), float(d.max())) if d.size else (0.0, 0.0)
    if not (math.isfinite(mean) and mean <= tol):
        raise ModelMismatchError(
            f"{model}: before any update, vLLM's logprobs on the probe sequences differ from the "
            f"trainer's by {mean:.2e} on average (largest {worst:.2e}), above the tolerance {tol:.0e} "
            f"(executor.resident.sync_check_tol): the two compute different models from the same "
            f"weights, and training would optimise one while sampling from the other. The trainer "
            f"uses attention implementation {attn_implementation!r}; check {HINT}")
    return {"sync/start_logp_diff": mean, "sync/start_logp_diff_max": worst}


def sampler_mismatch(old: dict[int, list[float]], sampler: list[list[float]]) -> dict[str, float]:
    """The trainer's logprobs (`old`, by row) against the sampler's, over the batch's tokens:
    the mean and largest |difference|, and KL(sampler || trainer) (the k3 estimate on the
    sampled tokens)."""
    lr = _diffs([old[i] for i in range(len(sampler))], sampler)  # log(pi_trainer / pi_sampler)
    if not lr.size:
        return {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0, "rollout/sampler_kl": 0.0}
    return {
        "rollout/logprob_diff_mean": float(np.abs(lr).mean()),
        "rollout/logprob_diff_max": float(np.abs(lr).max()),
        "rollout/sampler_kl": float(np.mean(np.expm1(lr) - lr)),
    }


def sampler_tolerance(setting: float, dtype: str) -> float:
    """`update.sampler_mismatch_tol` when set, else by the weights' dtype."""
    if setting:
        return setting
    return 1e-3 if dtype == "float32" else 5e-2


def check_sampler(metrics: dict[str, float], tol: float, iteration: int) -> None:
    """Stop an update whose trainer and sampler disagree beyond `tol` on the batch."""
    mean = metrics["rollout/logprob_diff_mean"]
    if math.isfinite(mean) and mean <= tol:
        return
    raise ModelMismatchError(
        f"iteration {iteration}: the trainer's logprobs of the sampled tokens differ from vLLM's by "
        f"{mean:.2e} on average (largest {metrics['rollout/logprob_diff_max']:.2e}, KL "
        f"{metrics['rollout/sampler_kl']:.2e}), above update.sampler_mismatch_tol = {tol:.0e}: the "
        f"trainer does not compute the model that generated the batch; the update is not committed. "
        f"Check {HINT}")
