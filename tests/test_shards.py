"""Shards of a generate stage (hpcrl.shards): which requests each engine samples, and the merge back
into one engine's order. tests/test_async.py runs two engines end to end."""

from __future__ import annotations

import pyarrow as pa
import pytest

from hpcrl import shards, stage_kinds, utilisation


def _one_engine(train: list[int], group: int, val: list[int], baseline: bool = False) -> pa.Table:
    """Rollouts as one engine writes them: each training prompt's group, the greedy baselines, then
    the validation prompts (a sample each)."""
    rows = [("train", p, j) for p in train for j in range(group)]
    rows += [("baseline", p, 0) for p in train] if baseline else []
    rows += [("val", p, 0) for p in val]
    return pa.table({"split": [r[0] for r in rows], "prompt_index": [r[1] for r in rows],
                     "sample_index": [r[2] for r in rows]})


def _shard_tables(train: list[int], group: int, val: list[int], n: int, baseline: bool = False):
    return [_one_engine(shards.take(train, i, n), group, shards.take(val, i, n), baseline) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shards_merge_back_into_one_engines_rollouts(n):
    """pins: a merge that concatenates the shards (or sorts by prompt index) instead of restoring
    the draw order, or drops the requests of a shard that holds one fewer."""
    train, val = [7, 3, 11, 0, 5], [0, 1, 2, 3]  # drawn out of order; 5 and 4 do not divide evenly
    for baseline in (False, True):
        merged = shards.merge(_shard_tables(train, 4, val, n, baseline))
        assert merged.equals(_one_engine(train, 4, val, baseline))


def test_each_engine_takes_every_nth_request():
    """pins: shards that overlap, leave a request out, or give one engine a block of the batch."""
    requests = list("abcdefg")
    assert [shards.take(requests, i, 3) for i in range(3)] == [["a", "d", "g"], ["b", "e"], ["c", "f"]]
    assert shards.take(requests, 0, 1) == requests
    with pytest.raises(ValueError, match="shard 3 of 3"):
        shards.take(requests, 3, 3)


def test_a_merge_refuses_shards_that_do_not_fit_together():
    """pins: a merge that silently interleaves shards of different draws (a shard from another
    engine count, or one with a request missing)."""
    parts = _shard_tables([1, 2, 3, 4], 2, [], 2)
    with pytest.raises(ValueError, match="shard 0 of 2 holds 1 train requests"):
        shards.merge([parts[0].slice(0, 2), parts[1]])
    with pytest.raises(ValueError, match=r"\['val'\]"):
        shards.merge([_one_engine([1], 2, []), _one_engine([2], 2, [0])])


def test_a_merged_stage_counts_every_shards_devices():
    """pins: a merged utilisation that keeps one shard's devices, or averages seconds without
    weighting them by devices (device-seconds must add up)."""
    a = {"role": "generator", "devices": 1, "device_type": "gpu", "busy_s": 10.0, "allocated_s": 20.0,
         "queue_s": 0.0}
    b = {**a, "devices": 3, "busy_s": 2.0, "allocated_s": 4.0, "queue_s": 5.0}
    merged = utilisation.combine([a, b])
    assert merged["devices"] == 4 and merged["role"] == "generator"
    assert merged["busy_s"] * 4 == pytest.approx(10.0 + 3 * 2.0)
    assert merged["allocated_s"] * 4 == pytest.approx(20.0 + 3 * 4.0)
    assert merged["queue_s"] == 5.0
    assert utilisation.combine([a, {**b, "queue_s": None}])["queue_s"] is None


def test_a_sharded_generate_script_is_a_job_array_whose_tasks_each_commit_their_shard(write_experiment,
                                                                                     tmp_path, monkeypatch):
    """pins: a hand-submitted generate script that runs the whole stage in every array task (each
    engine sampling every prompt), or a score script made an array too."""
    from hpcrl import config, sbatch
    from tests.test_job_env import _execute, _run

    exp = config.load(write_experiment("engines", generate={"engines": 3},
                                       executor={"kind": "slurm", "generate": {"gpus_per_node": 1}}))
    script = sbatch.render(_run(exp), exp, "generate", 4)
    assert "#SBATCH --array=0-2\n" in script
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    argv = [a for a in _execute(script, tmp_path)[0] if not a.startswith("preamble=")]
    assert argv[-8:] == ["-m", "stages.generate", "--run-dir", str(_run(exp).root), "--iteration", "4",
                         "--shard", "2/3"]
    assert "--array" not in sbatch.render(_run(exp), exp, "score", 4)


def test_a_shard_without_a_request_merges_as_nothing():
    """pins: a merge that refuses (or misorders) a shard that drew no request: the final
    iteration's validation over fewer prompts than engines."""
    from hpcrl import schemas

    parts = _shard_tables([], 1, [4, 9], 3)
    assert parts[2].num_rows == 0
    parts[2] = schemas.ROLLOUTS.empty_table().select(parts[0].column_names)
    assert shards.merge(parts).equals(_one_engine([], 1, [4, 9]))


@pytest.mark.parametrize(("overrides", "why"), [
    ({"algorithm": {"prompts_per_iteration": 1}}, "each engine samples whole groups"),
    ({"executor": {"mode": "resident", "resident": {"colocate": True}}, "update": {"offload": "optimizer"}},
     "colocated vLLM runs one engine"),
    ({"executor": {"kind": "slurm", "mode": "resident", "resident": {"generator": {}}}},
     r"\[executor\.resident\.generator\] is the node of one engine"),
    ({"algorithm": {"dynamic_sampling": True}}, "dynamic sampling draws its rounds over the whole batch"),
])
def test_several_engines_are_refused_where_they_are_not_built(write_experiment, overrides, why):
    """pins: a config with several engines accepted where each engine would sample the whole batch."""
    from hpcrl import config
    from hpcrl.config import ConfigError

    with pytest.raises(ConfigError, match=rf"generate\.engines.*{why}"):
        config.load(write_experiment("engines", generate={"engines": 2}, **overrides))
    config.load(write_experiment("one", generate={"engines": 1}, **overrides))


@pytest.mark.parametrize(("shards", "mode", "why"), [
    (3, "staged", "the staged mode runs one shard per engine"),
    (1, "resident", "every engine samples a shard"),
    (9, "resident", "each shard samples whole groups"),
])
def test_shard_counts_are_refused_where_they_cannot_run(write_experiment, shards, mode, why):
    """pins (generate.shards): a staged array of more shards than engines, an engine left without a
    shard, or a shard without a prompt of its own."""
    from hpcrl import config
    from hpcrl.config import ConfigError

    with pytest.raises(ConfigError, match=rf"generate\.shards.*{why}"):
        config.load(write_experiment("shards", generate={"engines": 2, "shards": shards},
                                     executor={"mode": mode}))
    kind = stage_kinds.kind(stage_kinds.GENERATE)
    ok = config.load(write_experiment("ok", generate={"engines": 2, "shards": 8},
                                      executor={"mode": "resident"}))
    assert kind.shards(ok) == 8
    assert kind.shards(config.load(write_experiment("two", generate={"engines": 2}))) == 2


def test_score_tasks_are_refused_in_the_resident_mode(write_experiment):
    """pins: several score tasks accepted where the generator task's workers score alone."""
    from hpcrl import config
    from hpcrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"executor\.score\.tasks.*resident mode scores on its generator"):
        config.load(write_experiment("tasks", executor={"mode": "resident", "score": {"tasks": 2}}))
    assert config.load(write_experiment("staged", executor={"score": {"tasks": 2}})).executor.score.tasks == 2


def _commit_shard(run, k: int, i: int, n: int, table: pa.Table, total_s: float) -> dict:
    from hpcrl import commit

    out = run.shard_dir(k, "generate", i, n)
    writer = commit.StageWriter(commit.fresh_temp_dir(out))
    writer.write_table("rollouts", table)
    use = {"role": "generator", "devices": 1, "device_type": "cpu", "busy_s": total_s / 2,
           "allocated_s": total_s, "queue_s": 0.0}
    return commit.commit(out, writer, {"stage": "generate", "iteration": k, "policy_version": 0, "inputs": {},
                                       "timings": {"compute": total_s / 2, "total": total_s},
                                       "utilisation": use, "shard": [i, n]})


def test_a_retry_runs_only_the_missing_shards_and_merges_when_none_is(tmp_path):
    """pins: a retry that samples committed shards again, or that finds every shard committed and
    submits nothing, so a merge interrupted before its commit never happens."""
    import shutil

    from hpcrl import commit, config, executors, stage, stage_kinds
    from tests.synthetic_run import make_run

    run = make_run(tmp_path / "run", iterations=1, rows=32, val_rows=8, eval_every=1)
    exp = config.with_overrides(config.load(run.config_path), {"generate.engines": 2}, "test")
    whole = commit.read_table(run.stage_dir(0, "generate"), "rollouts")
    shutil.move(run.stage_dir(0, "generate"), tmp_path / "aside")
    per_split = {}
    for split, rows in shards.blocks(whole):
        per_split.setdefault(split, []).append(rows)
    parts = [pa.concat_tables([b for blocks in per_split.values() for b in shards.take(blocks, i, 2)])
             for i in range(2)]
    assert executors.shards_to_run(run, exp, "generate", 0) == [(0, 2), (1, 2)]
    _commit_shard(run, 0, 1, 2, parts[1], total_s=3.0)
    assert executors.shards_to_run(run, exp, "generate", 0) == [(0, 2)]
    _commit_shard(run, 0, 0, 2, parts[0], total_s=5.0)
    assert executors.shards_to_run(run, exp, "generate", 0) == [(0, 2)]  # to merge
    assert executors.shards_to_run(run, exp, "score", 0) == [None]
    stage._shard_job(stage_kinds.kind("generate"), str(run.root), 0, (0, 2))  # its shard is committed
    assert commit.read_table(run.stage_dir(0, "generate"), "rollouts").equals(whole)
    manifest = commit.read_manifest(run.stage_dir(0, "generate"))
    assert {f"generate.shards/{i}-of-2@iter_000000" for i in range(2)} <= set(manifest["inputs"])
    assert manifest["policy_version"] == 0 and manifest["utilisation"]["devices"] == 2
    assert manifest["timings"]["compute"] == 2.5  # the slowest shard's
    assert manifest["timings"]["total"] >= 5.0


def test_score_tasks_take_contiguous_parts_that_cover_the_rollouts_once():
    """pins: parts that overlap or leave rows out when the rows do not divide evenly."""
    for rows in (0, 1, 7, 64):
        for n in (1, 2, 3, 5):
            spans = [shards.part(rows, i, n) for i in range(n)]
            assert spans[0][0] == 0 and spans[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1
    with pytest.raises(ValueError):
        shards.part(10, 2, 2)
