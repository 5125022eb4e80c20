"""The stage kinds' registry (hpcrl.stage_kinds): where a kind's Stage object and job entry point are."""

from __future__ import annotations

import pytest

from hpcrl import config, stage_kinds
from hpcrl.stage_kinds import Kind


def test_a_kind_imports_its_stage_object_by_module_and_name():
    """pins: Kind.stage_class imports "module:Name" of `home` only when asked and returns that object,
    Kind.merge_function the same of `merge`; Kind.module is the `python -m` entry point
    stages.<name>."""
    kind = Kind("probe", "hpcrl.config:Experiment", merge="hpcrl.config:parse")
    assert kind.stage_class() is config.Experiment and kind.merge_function() is config.parse
    assert kind.module == "stages.probe"
    assert [k.module for k in stage_kinds.KINDS.values()] == ["stages.generate", "stages.score",
                                                              "stages.update"]


def test_register_adds_a_kind_under_its_name(monkeypatch):
    """pins: register records the kind under its name and returns it; kind() finds it there, and an
    unknown name is refused listing the known ones."""
    monkeypatch.setattr(stage_kinds, "KINDS", dict(stage_kinds.KINDS))
    probe = Kind("probe", "hpcrl.config:Experiment", reads=((0, stage_kinds.GENERATE),))
    assert stage_kinds.register(probe) is probe
    assert stage_kinds.KINDS["probe"] is probe and stage_kinds.kind("probe") is probe
    with pytest.raises(ValueError, match=r"unknown stage 'nope'; expected one of generate, score, update, "
                                         r"probe$"):
        stage_kinds.kind("nope")


def test_a_kind_splits_into_the_shards_its_config_key_says():
    """pins: Kind.shards reads the dotted config key `shards_key` of the experiment (nested sections
    included); a kind without one runs whole (1)."""
    from pathlib import Path

    exp = config.parse({"model": {"path": "/m"}, "data": {"train": "/t"}, "update": {"world_size": 3},
                        "executor": {"update": {"nodes": 5}}}, "e", Path("/"))
    assert Kind("probe", "hpcrl.config:Experiment", shards_key="update.world_size").shards(exp) == 3
    assert Kind("probe", "hpcrl.config:Experiment", shards_key="executor.update.nodes").shards(exp) == 5
    assert Kind("probe", "hpcrl.config:Experiment").shards(exp) == 1
