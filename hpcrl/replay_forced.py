"""Teacher forcing for a generate stage replayed on another environment (hpcrl.replay).

On another device, core count or kernel library, sampling flips a token wherever two candidates
nearly tie, and the rest of that sample differs: a replay elsewhere cannot be asked for the same
tokens. It can be asked whether the original samples are what this policy samples here: the
policy, computed on the replay's hardware, must give each original sample's tokens the logprobs
the sampler recorded for them (teacher forcing), within the tolerance a run itself allows
between its sampler and its trainer (`update.sampler_mismatch_tol`; by default a mean |difference|
of 1e-3 in float32 and 5e-2 in 16-bit: hpcrl.agreement). The forward pass is the trainer's
implementation (hpcrl.policy_model) at the temperature each sample was drawn at, on the GPUs this process
sees when it has any (split over them by transformers' device map), else on its CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcrl import agreement, generation, policy_model
from hpcrl.config import Experiment

BATCH = 8  # sequences per forward pass


@dataclass(frozen=True)
class Forced:
    """How a generate replay is judged across environments: `score` gives the policy's logprobs
    here of each original sample's response tokens (from its rows: prompt_ids, response_ids), and
    `tol` bounds their mean |difference| from the sampler's."""

    score: Callable[[list[dict]], list[list[float]]]
    tol: float


def for_replay(policy: Path, exp: Experiment) -> Forced:
    """Teacher forcing through the policy folder `policy` (the one the stage sampled from), with
    the replay's config `exp` (its dtype, attention, temperature and sampler tolerance)."""
    return Forced(lambda rows: logprobs(policy, exp, rows),
                  agreement.sampler_tolerance(exp.update.sampler_mismatch_tol, exp.model.dtype))


def logprobs(policy: Path, exp: Experiment, rows: list[dict], batch: int = BATCH) -> list[list[float]]:
    """The logprobs of each row's response tokens under the policy at `policy`, given its prompt
    and the response tokens before them, at the temperature its logprobs were recorded at
    (generation.logprob_temperature: its split's)."""
    import torch
    from tqdm import tqdm

    # on GPUs spread over those this process sees (a model one GPU cannot hold), as transformers places it
    placement = {"device_map": "auto"} if torch.cuda.is_available() else {}
    dtype = getattr(torch, exp.model.dtype)
    model = policy_model.load_causal_lm(policy, dtype, exp.model.attn_implementation, **placement).eval()
    device = model.device
    out: list[list[float]] = [[] for _ in rows]
    temperatures = [generation.logprob_temperature(exp, r["split"]) for r in rows]
    for temperature in sorted(set(temperatures)):
        todo = [i for i, t in enumerate(temperatures) if t == temperature]
        starts = tqdm(range(0, len(todo), batch), desc=f"teacher forcing at temperature {temperature:g}",
                      unit="batch", disable=None, leave=False)  # a bar on a terminal, none in a log
        for start in starts:
            chunk = todo[start:start + batch]
            seqs = [list(rows[i]["prompt_ids"]) + list(rows[i]["response_ids"]) for i in chunk]
            for lp, i in zip(policy_model.sequence_logprobs(model, seqs, 0, device, temperature), chunk,
                             strict=True):
                out[i] = lp[len(lp) - len(rows[i]["response_ids"]):]
    return out
