"""DAPO dynamic sampling (Yu et al. 2025): sample in rounds until the update batch holds
`algorithm.prompts_per_iteration` groups whose rewards are not all equal.

A group whose rewards are all equal (every sample right, or every sample wrong) has zero
advantage under every group-centred estimator of hpcrl/advantages.py, so it gives no policy
gradient and only dilutes the batch. With `algorithm.dynamic_sampling = true` the generate stage
of a training iteration runs

    for round r = 0, 1, ... < algorithm.max_sampling_rounds:
        draw prompts_per_iteration prompts that no earlier round of this iteration drew
            (hpcrl.data.draw_prompts(..., sampling_round=r); round 0 is the plain draw),
        sample a group of algorithm.group_size responses for each (hpcrl.generation.sample),
        score them with the configured reward sources (hpcrl.scoring.score: the reward the
            score stage will record, overlong penalty included),
        stop once prompts_per_iteration informative groups are in hand, or when a round finds
            no unused prompt.

The batch (`select`) is the first prompts_per_iteration informative groups in draw order (round
by round, in draw order within a round); informative groups beyond it are trimmed. Short of that
after the last round, the earliest all-equal groups fill the batch: the update keeps its fixed
size (the batch shape, update.mini_batches x update.world_size, is checked before the run starts)
and the iteration trains on what plain GRPO would have trained on, no worse; `dapo/padded_groups`
says how often that happens. (verl stops the run with an error after max_num_gen_batches; DAPO's
paper samples until the batch is full. Raise max_sampling_rounds to come closer to the latter.)

Stage contracts: the generate stage commits every group it sampled, each row with `round` (the
round that drew it) and `kept` (the update trains on it); the score stage scores every row as
without dynamic sampling, so nothing is hidden; the update (hpcrl.batches.load_samples) takes the
kept rows only. Metrics of the generate manifest: dapo/rounds, dapo/generated_groups, and a
partition of the generated groups into dapo/kept_groups (informative, in the batch),
dapo/padded_groups (all-equal, filling the batch), dapo/dropped_all_equal (all-equal, left out)
and dapo/trimmed_groups (informative, beyond the batch).

Scoring twice: the generate stage scores each training sample to decide, the score stage scores
it again for the committed record. Rule functions cost little; a reward model is loaded in the
generate job as well (beside vLLM), and an HTTP service receives every sample twice. A continuous
reward model almost never gives a group equal rewards: dynamic sampling is meant for verifiable
(right/wrong) rewards. Equal means exactly equal (max == min). The generate manifest's timings
hold this scoring as `filter`, apart from `compute` (sampling), so perf/throughput stays vLLM's.

This module holds the round loop over injected draw / sample / score functions and the pure
selection; it never touches vLLM or reward sources (hpcrl.generation wires those in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa


def all_equal_groups(prompt_index: Sequence[int], rewards: Sequence[float]) -> dict[int, bool]:
    """Whether the rewards of each group are all equal, by prompt index, in order of first row."""
    if len(prompt_index) != len(rewards):
        raise ValueError(f"{len(prompt_index)} samples but {len(rewards)} rewards")
    lo: dict[int, float] = {}
    hi: dict[int, float] = {}
    for p, r in zip(prompt_index, rewards, strict=True):
        lo[p] = min(lo.get(p, r), r)
        hi[p] = max(hi.get(p, r), r)
    return {p: lo[p] == hi[p] for p in lo}


def select(all_equal: Sequence[bool], target: int) -> list[bool]:
    """The groups of the update batch, in draw order: the first `target` informative groups, and
    when there are fewer, the earliest all-equal groups to fill the batch."""
    informative = [i for i, e in enumerate(all_equal) if not e][:target]
    fill = [i for i, e in enumerate(all_equal) if e][: target - len(informative)]
    if len(informative) + len(fill) < target:
        raise ValueError(f"{len(all_equal)} groups sampled, fewer than the {target} of the update batch")
    kept = [False] * len(all_equal)
    for i in informative + fill:
        kept[i] = True
    return kept


def metrics(all_equal: Sequence[bool], kept: Sequence[bool], rounds: int) -> dict[str, float]:
    """The dapo/* metrics; kept + padded + dropped_all_equal + trimmed = generated groups."""
    pairs = list(zip(all_equal, kept, strict=True))
    return {
        "dapo/rounds": float(rounds),
        "dapo/generated_groups": float(len(pairs)),
        "dapo/kept_groups": float(sum(k and not e for e, k in pairs)),
        "dapo/padded_groups": float(sum(k and e for e, k in pairs)),
        "dapo/dropped_all_equal": float(sum(e and not k for e, k in pairs)),
        "dapo/trimmed_groups": float(sum(not e and not k for e, k in pairs)),
    }


@dataclass(frozen=True)
class Rounds:
    table: pa.Table  # every sampled training row, round by round, `kept` set
    metrics: dict[str, float]


def sample_in_rounds(target: int, max_rounds: int, draw: Callable[[int], Sequence],
                     sample: Callable[[Sequence, int], pa.Table],
                     rewards: Callable[[pa.Table], Sequence[float]]) -> Rounds:
    """Rounds of draw(r) -> sample(requests, r) -> rewards(table) until `target` informative groups
    or `max_rounds` rounds; the sampled tables (with `prompt_index` and `kept` columns) are
    concatenated and `kept` marks the batch chosen by `select`."""
    tables: list[pa.Table] = []
    flags: dict[int, bool] = {}  # prompt index -> all rewards equal, in draw order
    for r in range(max_rounds):
        requests = draw(r)
        if not len(requests):
            break
        table = sample(requests, r)
        groups = all_equal_groups(table["prompt_index"].to_pylist(), list(rewards(table)))
        again = sorted(flags.keys() & groups.keys())
        if again:
            raise ValueError(f"sampling round {r} drew prompts {again[:5]} of an earlier round again")
        flags.update(groups)
        tables.append(table)
        if sum(not e for e in flags.values()) >= target:
            break
    kept = select(list(flags.values()), target)
    table = pa.concat_tables(tables)
    by_prompt = dict(zip(flags, kept, strict=True))
    rows = pa.array([by_prompt[p] for p in table["prompt_index"].to_pylist()], pa.bool_())
    table = table.set_column(table.schema.get_field_index("kept"), "kept", rows)
    return Rounds(table, metrics(list(flags.values()), kept, len(tables)))
