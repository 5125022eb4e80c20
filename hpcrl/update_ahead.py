"""What an update computes before its first optimizer step from its rollouts alone, and its
computation ahead of the update.

An update's steps are its mini-batches, in a seeded order (`steps`). Before the first step it needs
the old policy's logprobs of the batch (unless it takes the sampler's: algorithm.old_logprobs) and
the reference policy's (with a KL to a reference), both forward passes over the rollouts under the
weights the update starts from. None of it needs the scores. So the resident trainers compute it
(`prepare`) once the generation is committed, while the generator scores it
(hpcrl.resident_generator): the update then starts with its steps as soon as the scores are
committed. Its results are those the update would compute itself, bit for bit: the same forward
passes over the same rows under the same weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from hpcrl import batches, commit, trainer
from hpcrl.config import Experiment
from hpcrl.stage import derive_seed
from hpcrl.stage_kinds import GENERATE, UPDATE

if TYPE_CHECKING:
    from hpcrl.actor import Actor
    from hpcrl.rundir import RunDir

Rows = dict[int, list[float]]  # per-token values by row of the update batch


def steps(exp: Experiment, group_ids: list[int], seed: int) -> list[tuple[int, list[int]]]:
    """(epoch, mini-batch rows) of each optimizer step, in order: the groups of each epoch split
    into update.mini_batches in an order seeded by the update's seed and the epoch."""
    u = exp.update
    return [(epoch, mini) for epoch in range(u.ppo_epochs)
            for mini in trainer.split_mini_batches(group_ids, u.mini_batches, seed, epoch)]


def trains_policy(actor: Actor, k: int) -> bool:
    """Whether update k steps the policy (ppo's critic may train alone first: critic.warmup)."""
    return actor.critic is None or k >= actor.exp.algorithm.critic.warmup


def owns_old(actor: Actor, k: int) -> bool:
    """Whether update k's first mini-batch takes its old logprobs from its own training forward pass:
    until the first optimizer step the policy is the old one; unless GAE must price the reference
    KL into the rewards before any step (kl.mode "reward"). A KL in the loss is priced (for the
    controller and the metrics) after that step, once the old logprobs cover the batch."""
    a = actor.exp.algorithm
    return (a.old_logprobs == "recompute" and trains_policy(actor, k)
            and not (actor.ref_model is not None and a.kl.mode == "reward"))


def logprobs_before_steps(actor: Actor, samples: batches.Samples,
                          first: set[int]) -> tuple[Rows | None, Rows | None]:
    """The old policy's logprobs of every row but `first` (the rows whose own forward pass gives
    them), None when the update takes the sampler's; the reference policy's of every row, None
    without a reference."""
    n = len(samples)
    old = None
    if actor.exp.algorithm.old_logprobs != "sampler":
        old = actor.logprobs(samples, actor.data_rows([i for i in range(n) if i not in first]))
    ref = None
    if actor.ref_model is not None:
        ref = actor.ref_logprobs(samples, actor.data_rows(list(range(n))))
    return old, ref


@dataclass
class Prepared:
    """Update `iteration`'s logprobs before its first step, computed ahead (`prepare`)."""

    iteration: int
    generation: str  # the manifest digest of the committed generation it read
    rollouts: pa.Table  # that generation's, as read (verified)
    keys: pa.Table  # the batch's sample keys, in order (the update checks its own against them)
    old: Rows | None
    ref: Rows | None
    seconds: float  # the forward passes' wall time: device work of the update ("prepare" phase)


def prepare(actor: Actor, rundir: RunDir, k: int) -> Prepared:
    """Update k's logprobs before its first step, from its committed generation (its scores need not
    exist yet), under the actor's weights: call it only when they are those update k starts from."""
    generation = rundir.stage_dir(k, GENERATE)
    digest, rollouts = commit.manifest_digest(generation), commit.read_table(generation, "rollouts")
    samples = batches.load_samples(rollouts)
    t0 = time.perf_counter()
    first = set()
    if owns_old(actor, k):
        seed = derive_seed(actor.exp.run.seed, k, UPDATE)
        first = set(steps(actor.exp, samples.group_ids.tolist(), seed)[0][1])
    old, ref = logprobs_before_steps(actor, samples, first)
    return Prepared(k, digest, rollouts, samples.keys, old, ref, time.perf_counter() - t0)


def of_update(prepared: Prepared | None, k: int, generation: str) -> Prepared | None:
    """`prepared` if it is update k's, computed from the committed generation whose manifest digest
    is `generation` (the one update k reads); else None."""
    ok = prepared is not None and prepared.iteration == k and prepared.generation == generation
    return prepared if ok else None
