"""Stages split over several tasks, each committing a shard under iter_K/<stage>.shards/
(hpcrl.rundir.RunDir.shard_dir); once every shard is committed, the stage commits them merged.

- generate (generate.engines = n): n vLLM engines, each sampling every n-th request of the
  iteration (`take`); the stage's rollouts are theirs merged back into the order one engine writes
  (`merge`). Every request carries its own seed (hpcrl.generation.sample) and a request's samples
  do not depend on which others share its batch, so the rollouts are those of one engine whatever
  n: a run does not change with the number of engines it is given.
- score (executor.score.tasks = n): n tasks, each scoring a contiguous part of the rollouts
  (`part`); the scores are theirs concatenated.

No stage logic: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import pyarrow as pa

T = TypeVar("T")


def take(requests: Sequence[T], shard: int, shards: int) -> list[T]:
    """The requests shard `shard` of `shards` samples: positions shard, shard + n, ... (every
    engine gets a spread of the batch, not one end of it)."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}: expected 0 <= shard < {shards}")
    return list(requests[shard::shards])


def blocks(table: pa.Table) -> list[tuple[str, pa.Table]]:
    """(split, rows) of each request in `table`, in order: a request's rows are consecutive rows
    of one split and prompt index (an iteration never draws a prompt twice for one split)."""
    if table.num_rows == 0:
        return []
    splits, prompts = table["split"].to_pylist(), table["prompt_index"].to_pylist()
    starts = [i for i in range(table.num_rows)
              if i == 0 or (splits[i], prompts[i]) != (splits[i - 1], prompts[i - 1])]
    ends = starts[1:] + [table.num_rows]
    return [(splits[a], table.slice(a, b - a)) for a, b in zip(starts, ends, strict=True)]


def merge(tables: Sequence[pa.Table]) -> pa.Table:
    """The rollouts of one engine from its shards' (`tables[i]` from shard i): split by split, in
    the order shard 0 holds them (it holds a request of every split any shard holds), request p
    of the split from shard p % n."""
    n = len(tables)
    per_shard = [blocks(t) for t in tables]
    order = list(dict.fromkeys(split for split, _ in per_shard[0]))
    out = []
    for split in order:
        mine = [[rows for s, rows in shard if s == split] for shard in per_shard]
        total = sum(len(m) for m in mine)
        for i, m in enumerate(mine):
            if len(m) != len(range(i, total, n)):
                raise ValueError(f"shard {i} of {n} holds {len(m)} {split} requests; taking every "
                                 f"{n}-th of {total} gives it {len(range(i, total, n))}")
        out += [mine[p % n][p // n] for p in range(total)]
    extra = {s for shard in per_shard[1:] for s, _ in shard} - set(order)
    if extra:
        raise ValueError(f"shards 1.. hold {sorted(extra)} requests that shard 0 has none of")
    return pa.concat_tables(out) if out else tables[0]


def part(rows: int, shard: int, shards: int) -> tuple[int, int]:
    """[start, stop) of the rows shard `shard` of `shards` takes: contiguous, sizes differing by at
    most one, in shard order."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}: expected 0 <= shard < {shards}")
    return rows * shard // shards, rows * (shard + 1) // shards
