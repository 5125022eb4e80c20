"""Which policy versions and trainer states a run keeps: the rules of [run.retention], as pure
functions of what is saved, what is pinned and what the run still needs (no file is touched here;
hpcrl.pruning removes what these functions select and records it).

A saved version v > 0 is the `policy/` (and, for ppo, `critic/`) and the `trainer/` folder that the
update of iteration v - 1 committed. Version 0 is the configured model and is never in the run
directory, so never pruned. Always kept: pinned versions (their weights), and every part of the
versions the run still needs (the latest saved version, which the next stage reads and from which
a resumed run continues).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hpcrl.config_training import RetentionConfig

POLICY, TRAINER = "policy", "trainer"  # the prunable parts of a version (critic/ goes with policy/)


@dataclass(frozen=True)
class Prune:
    """One part of one version to remove, and the rule that lets it go."""

    version: int
    part: str  # POLICY or TRAINER
    rule: str  # e.g. "run.retention.keep_last = 2"


def kept_policies(saved: Iterable[int], rules: RetentionConfig, pins: Iterable[int] = (),
                  needed: Iterable[int] = ()) -> set[int]:
    """The saved versions whose weights stay: all without keep_last; else the last keep_last
    saved, every keep_every-th, the pinned and the needed ones."""
    saved = sorted(set(saved))
    if not rules.keep_last:
        return set(saved)
    keep = set(saved[-rules.keep_last:]) | (set(pins) | set(needed)) & set(saved)
    if rules.keep_every:
        keep |= {v for v in saved if v % rules.keep_every == 0}
    return keep


def kept_states(saved: Iterable[int], rules: RetentionConfig, needed: Iterable[int] = ()) -> set[int]:
    """The saved versions whose trainer state stays: all, or the last keep_trainer_states and the needed."""
    saved = sorted(set(saved))
    if not rules.keep_trainer_states:
        return set(saved)
    return set(saved[-rules.keep_trainer_states:]) | set(needed) & set(saved)


def select(policies: Iterable[int], states: Iterable[int], rules: RetentionConfig,
           pins: Iterable[int] = (), needed: Iterable[int] = ()) -> list[Prune]:
    """What to prune now. `policies` and `states` are the saved versions (v > 0) with weights or a
    trainer state still present; `needed` the versions the run still reads (never pruned)."""
    policies, states = set(policies), set(states)
    needed = set(needed) | {max(policies | states, default=0)}
    rule = f"run.retention.keep_last = {rules.keep_last}" + (
        f", keep_every = {rules.keep_every}" if rules.keep_every else "")
    out = [Prune(v, POLICY, rule)
           for v in sorted(policies - kept_policies(policies, rules, pins, needed)) if v > 0]
    out += [Prune(v, TRAINER, f"run.retention.keep_trainer_states = {rules.keep_trainer_states}")
            for v in sorted(states - kept_states(states, rules, needed)) if v > 0]
    return out


def saved_versions(iterations: int, every: int = 1) -> list[int]:
    """The versions a run of `iterations` updates saves, one every `every` (and the last)."""
    return [v for v in range(1, iterations + 1) if v % every == 0 or v == iterations]


def final_counts(iterations: int, rules: RetentionConfig, every: int = 1) -> tuple[int, int]:
    """(policy versions, trainer states) a finished run keeps on disk under `rules`."""
    saved = saved_versions(iterations, every)
    parts = [p.part for p in select(saved, saved, rules)]
    return len(saved) - parts.count(POLICY), len(saved) - parts.count(TRAINER)
