"""The stage kinds of an iteration, in run order, and the registry that describes them.

Each kind's work is one object (a subclass of hpcrl.stage.Stage) in the module that holds that
work: `setup` builds what a stage job, or a resident task for the whole run, keeps alive (the vLLM
engine, the reward pool, the DeepSpeed actor); `run` does one iteration's stage on a stage
context. The registry says where that object lives, which committed outputs the stage reads and
whether it runs on the trainer ranks, so the plan, the executors, sbatch rendering, the CLI, replay
and the resident loop all take their stage kinds from here. Adding a kind is its module, its
`stages/<name>.py` entry point and one `register` call below (and its place in hpcrl.plan).

This module imports nothing from hpcrl: every other module may import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

GENERATE, SCORE, UPDATE = "generate", "score", "update"


@dataclass(frozen=True)
class Kind:
    name: str
    home: str  # "module:Class" of its hpcrl.stage.Stage, imported only when the stage runs
    reads: tuple[tuple[int, str], ...] = ()  # (iteration offset, kind) of the committed outputs it reads
    on_trainers: bool = False  # runs on update.world_size ranks (one task each); else on one task
    short: str = ""  # its column title in status tables
    samples_policy: bool = False  # reads the update that made the policy it samples with (hpcrl.plan)
    merge: str | None = None  # "module:function" merging its shards (it runs in shards: hpcrl.shards)
    shards_key: str = ""  # the config key that says into how many shards it splits

    def shards(self, exp) -> int:
        """Into how many shards the stage splits in experiment `exp` (1: it runs whole)."""
        value = exp
        for name in self.shards_key.split(".") if self.shards_key else ():
            value = getattr(value, name)
        return value if self.shards_key else 1

    def inputs(self, iteration: int, version: int) -> list[tuple[int, str]]:
        """The (iteration, kind) stage outputs the stage of `iteration` reads; a stage that samples
        with policy `version` (hpcrl.plan.policy_version) also reads the update that made it."""
        out = [(iteration + offset, kind) for offset, kind in self.reads if iteration + offset >= 0]
        if self.samples_policy and version > 0:
            out.append((version - 1, UPDATE))
        return out

    def stage_class(self) -> type:
        module, name = self.home.split(":")
        return getattr(importlib.import_module(module), name)

    def merge_function(self):
        module, name = self.merge.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def module(self) -> str:
        """The entry point of its jobs: `python -m stages.<name>`."""
        return f"stages.{self.name}"


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    KINDS[kind.name] = kind
    return kind


register(Kind(GENERATE, "hpcrl.generation:GenerateStage", samples_policy=True, short="gen",
              merge="hpcrl.generation:merge_shards", shards_key="generate.shard_count"))
register(Kind(SCORE, "hpcrl.scoring:ScoreStage", reads=((0, GENERATE),), short="score",
              merge="hpcrl.scoring:merge_shards", shards_key="executor.score.tasks"))
register(Kind(UPDATE, "hpcrl.update:UpdateStage", reads=((0, GENERATE), (0, SCORE), (-1, UPDATE)),
              on_trainers=True, short="update"))

ORDER: tuple[str, ...] = tuple(KINDS)  # within an iteration


def kind(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"unknown stage {name!r}; expected one of {', '.join(KINDS)}")
    return KINDS[name]
