"""Retention: which versions the rules keep (hpcrl.retention), and pruning a run directory by them
(hpcrl.pruning): the ledger, the marks that keep `status --verify` sound, pins, and the refusals of
export and replay. The run directories here hold committed update outputs with small policy/ and
trainer/ folders, written through hpcrl.commit; tests/test_retention_run.py prunes a real run."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hpcrl import commit, config, plan, pruning, replay, retention
from hpcrl.config_training import RetentionConfig
from hpcrl.export import export_policy
from hpcrl.rundir import RunDir
from tests.synthetic_run import write_config


def rules(**keys) -> RetentionConfig:
    return RetentionConfig(**keys)


def pruned(plan: list[retention.Prune], part: str) -> list[int]:
    return [p.version for p in plan if p.part == part]


def test_the_defaults_keep_everything():
    assert retention.select(range(1, 9), range(1, 9), rules()) == []


def test_keep_last_keeps_the_last_n_and_the_pinned_and_needed():
    plan = retention.select(range(1, 6), [], rules(keep_last=2))
    assert pruned(plan, "policy") == [1, 2, 3] and plan[0].rule == "run.retention.keep_last = 2"
    assert pruned(retention.select(range(1, 6), [], rules(keep_last=2), pins=[2]), "policy") == [1, 3]
    assert pruned(retention.select(range(1, 6), [], rules(keep_last=1), needed=[3]), "policy") == [1, 2, 4]
    # the last saved version stays whatever the rules and whatever `needed` says
    assert pruned(retention.select([1, 2, 3], [], rules(keep_last=1), needed=[1]), "policy") == [2]


def test_keep_every_adds_every_kth_version():
    plan = retention.select(range(1, 8), [], rules(keep_last=1, keep_every=3))
    assert pruned(plan, "policy") == [1, 2, 4, 5]
    assert plan[0].rule == "run.retention.keep_last = 1, keep_every = 3"


def test_trainer_states_are_kept_by_their_own_rule():
    plan = retention.select(range(1, 5), range(1, 5), rules(keep_trainer_states=1))
    assert pruned(plan, "policy") == [] and pruned(plan, "trainer") == [1, 2, 3]
    assert plan[0].rule == "run.retention.keep_trainer_states = 1"
    # pins keep weights, not trainer states
    plan = retention.select(range(1, 5), range(1, 5), rules(keep_last=2, keep_trainer_states=2), pins=[1])
    assert pruned(plan, "policy") == [2] and pruned(plan, "trainer") == [1, 2]


def test_final_counts_follow_the_saved_versions():
    assert retention.final_counts(10, rules()) == (10, 10)
    assert retention.final_counts(10, rules(keep_last=2, keep_every=5, keep_trainer_states=1)) == (3, 1)
    # the resident mode saves every checkpoint_every-th version and the last: 5, 10, 12
    assert retention.saved_versions(12, 5) == [5, 10, 12]
    assert retention.final_counts(12, rules(keep_last=2), every=5) == (2, 3)


def test_retention_is_a_config_section_a_resumed_run_may_change(tmp_path):
    exp = write_config(tmp_path / "r", 4)
    assert exp.run.retention == RetentionConfig()
    changed = config.with_overrides(exp, {"run.retention.keep_last": 2}, "--set")
    assert changed.run.retention.keep_last == 2
    assert config.resume_conflicts(exp, changed) == []
    with pytest.raises(config.ConfigError, match="run.retention.keep_last"):
        config.with_overrides(exp, {"run.retention.keep_last": -1}, "--set")


# ---- a run directory --------------------------------------------------------------------------

def _commit(run: RunDir, k: int, stage: str, folders: tuple[str, ...] = ()) -> None:
    writer = commit.StageWriter(commit.fresh_temp_dir(run.stage_dir(k, stage)))
    for folder in folders:
        (writer.dir / folder).mkdir()
        (writer.dir / folder / "config.json").write_text(json.dumps({"v": k + 1, "folder": folder}))
        (writer.dir / folder / "weights.bin").write_bytes(bytes([k]) * (1000 if folder == "policy" else 3000))
    commit.commit(run.stage_dir(k, stage), writer, {"stage": stage, "iteration": k})


def make_run(root, iterations: int = 4, updates: int = 4, **keep) -> tuple[RunDir, config.Experiment]:
    """A run whose first `updates` iterations are committed, each update with policy/ and trainer/."""
    exp = write_config(root, iterations, eval_every=0)
    if keep:
        exp = config.with_overrides(exp, {f"run.retention.{k}": v for k, v in keep.items()}, "test")
    run = RunDir.at(root)
    for k in range(updates):
        _commit(run, k, "generate")
        _commit(run, k, "score")
        _commit(run, k, "update", ("policy", "trainer"))
        run.publish_policy(k + 1)
    return run, exp


def test_pruning_removes_records_and_still_verifies(tmp_path):
    run, exp = make_run(tmp_path / "r", keep_last=2, keep_trainer_states=1)
    entries = pruning.prune(run, exp)
    assert [(e["part"], e["version"]) for e in entries] == [("policy", 1), ("policy", 2), ("trainer", 1),
                                                            ("trainer", 2), ("trainer", 3)]
    assert entries[0]["bytes"] == 1000 + len(json.dumps({"v": 1, "folder": "policy"}))
    assert entries[0]["paths"] == ["iter_000000/update/policy"] and entries[0]["iteration"] == 0
    assert pruning.ledger(run) == entries
    assert (run.root / pruning.LEDGER).stat().st_mode & 0o777 == 0o644 & ~_umask()  # read by all, run by none
    assert not (run.stage_dir(0, "update") / "policy").exists()
    assert not (run.root / "policy" / "v000001").is_symlink() and (run.root / "policy" / "v000003").is_dir()
    assert (run.stage_dir(0, "update") / "_COMMIT.json").is_file()  # the manifest, and its digest, stay
    assert [v for v in range(5) if run.has_policy(v)] == [0, 3, 4] and run.latest_saved_version() == 4
    for k in range(4):
        for stage in ("generate", "score", "update"):
            assert commit.verify(run.stage_dir(k, stage)) == []
    with pytest.raises(commit.PrunedError, match="policy: pruned by retention"):
        commit.verified(run.stage_dir(0, "update") / "policy")
    assert commit.verified(run.stage_dir(2, "update") / "policy")
    assert pruning.prune(run, exp) == []  # nothing more to let go
    line = pruning.status_line(run)
    freed = sum(e["bytes"] for e in entries)
    assert 11000 < freed < 11200
    assert (f"retention freed {freed / 1024:.1f} KiB (pruned policy versions v1, v2; trainer states v1, v2, "
            "v3)") in line


def test_a_changed_file_is_still_corrupt_next_to_a_pruned_folder(tmp_path):
    run, exp = make_run(tmp_path / "r", keep_last=1)
    pruning.prune(run, exp)
    (run.stage_dir(0, "update") / "trainer" / "weights.bin").write_bytes(b"x")
    problems = commit.verify(run.stage_dir(0, "update"))
    assert [p.endswith("checksum mismatch with _COMMIT.json") for p in problems] == [True]


def test_export_and_replay_of_a_pruned_version_refuse_naming_what_remains(tmp_path):
    run, exp = make_run(tmp_path / "r", keep_last=2, keep_trainer_states=1)
    pruning.prune(run, exp)
    with pytest.raises(commit.PrunedError) as err:
        export_policy(run, exp, 2, tmp_path / "out")
    message = str(err.value)
    assert "\n" not in message and "export of policy version 2: the policy version 2 was pruned by " \
        "retention (run.retention.keep_last = 2, at " in message
    assert message.endswith("the run keeps policy versions 0, 3, 4 (`hpcrl pin` keeps a version from now on)")
    assert not (tmp_path / "out").exists()
    with pytest.raises(commit.PrunedError, match="replay of generate of iteration 1: the policy version 1"):
        replay.prepare(run, exp, 1, "generate", {}, tmp_path / "replay")
    with pytest.raises(commit.PrunedError, match="the trainer state of version 3 was pruned .* the run keeps "
                                                 "trainer states of versions 4 "):
        replay.prepare(run, exp, 3, "update", {}, tmp_path / "replay")
    replay.prepare(run, exp, 3, "generate", {}, tmp_path / "replay")  # a kept version replays as before


def test_a_pinned_version_keeps_its_weights_and_a_pruned_one_cannot_be_pinned(tmp_path):
    run, exp = make_run(tmp_path / "r", updates=3, keep_last=1)
    assert pruning.pin(run, 1).endswith("pinned now: 1")
    assert [(e["part"], e["version"]) for e in pruning.prune(run, exp)] == [("policy", 2)]
    with pytest.raises(commit.PrunedError, match="hpcrl pin 2: the policy version 2 was pruned"):
        pruning.pin(run, 2)
    pruning.pin(run, 1, unpin=True)
    _commit(run, 3, "generate")
    _commit(run, 3, "score")
    _commit(run, 3, "update", ("policy", "trainer"))
    assert [(e["part"], e["version"]) for e in pruning.prune(run, exp)] == [("policy", 1), ("policy", 3)]


def test_the_versions_pending_stages_read_are_kept(tmp_path):
    run, exp = make_run(tmp_path / "r", updates=3, keep_last=1, keep_trainer_states=1)
    # iteration 2's update is moved aside: the next stage (update 2) reads version 2
    run.stage_dir(2, "update").rename(run.stage_dir(2, "update").with_name("update.gone"))
    assert pruning.needed(run, exp) == {2, 3, 4}  # 3 and 4 are not saved yet
    assert [(e["part"], e["version"]) for e in pruning.prune(run, exp)] == [("policy", 1), ("trainer", 1)]


def test_an_interrupted_prune_is_finished_and_read_once(tmp_path):
    run, exp = make_run(tmp_path / "r", keep_last=3)
    pruning.prune(run, exp)
    stage = run.stage_dir(0, "update")
    # as if the process died after the ledger line and the mark, before the files went
    (stage / "policy").mkdir()
    (stage / "policy" / "config.json").write_text("{}")
    with open(run.root / pruning.LEDGER, "a") as f:
        f.write(json.dumps(pruning.ledger(run)[0]) + "\n" + '{"torn')
    assert pruning.prune(run, exp) == [] and not (stage / "policy").exists()
    assert len(pruning.ledger(run)) == 1 and not run.has_policy(1)


# ---- the disk budget at submit ----------------------------------------------------------------

def test_the_estimate_counts_weights_trainer_states_and_retention(write_experiment):
    from hpcrl import disk_budget

    exp = config.load(write_experiment("b", run={"iterations": 10}))
    params = disk_budget.params_of(exp.model.path)
    assert params == 462592  # the tiny task's model
    full = disk_budget.estimate(exp)
    assert (full.policy, full.state, full.policies, full.states) == (4 * params, 12 * params, 10, 10)
    kept = disk_budget.estimate(config.with_overrides(
        exp, {"run.retention.keep_last": 2, "run.retention.keep_trainer_states": 1,
              "model.dtype": "bfloat16"}, "test"))
    assert (kept.policy, kept.state, kept.policies, kept.states) == (2 * params, 14 * params, 2, 1)
    assert kept.peak == 3 * kept.policy + 2 * kept.state + 10 * kept.data
    assert kept.final < full.final / 4
    ppo = disk_budget.estimate(config.with_overrides(exp, {"algorithm.name": "ppo"}, "test"))
    assert ppo.policy == 2 * full.policy and ppo.state == 2 * full.state


def test_a_run_that_cannot_fit_is_refused_before_anything_and_dry_run_prints_the_estimate(write_experiment,
                                                                                         tmp_path):
    import shutil

    from click.testing import CliRunner

    from hpcrl.cli import main

    # twice the free space without retention (7.2 MiB an iteration), about 1% of it with
    iterations = 2 * shutil.disk_usage(tmp_path).free // (7 << 20)
    huge = write_experiment("huge", run={"iterations": iterations})
    out = CliRunner().invoke(main, ["submit", str(huge)])
    assert out.exit_code == 2
    assert "run.runs_root: " in out.stderr and "more on disk and" in out.stderr
    assert "[run.retention]" in out.stderr
    assert not (huge.parent / "runs" / "huge").exists()
    fits = write_experiment("fits", run={"iterations": iterations,
                                         "retention": {"keep_last": 1, "keep_trainer_states": 1}})
    from hpcrl import preflight

    assert preflight.check(config.load(fits), str(fits)) == []  # about 1% of the free space
    small = write_experiment("small", run={"iterations": 3, "retention": {"keep_last": 2,
                                                                          "keep_trainer_states": 1}})
    out = CliRunner().invoke(main, ["submit", "--dry-run", str(small)])
    assert out.exit_code == 0, out.output
    assert ("disk: about 9.0 MiB by the end, 16.0 MiB at the peak (2 of 3 policy versions x 1.8 MiB, "
            "1 trainer states x 5.3 MiB, 3 iterations of rollouts x 48.0 KiB; run.retention)") in out.stdout


# ---- the edges of pruning ---------------------------------------------------------------------

def _commit_stages(run: RunDir, *stages: tuple[int, str]) -> None:
    for k, stage in stages:
        _commit(run, k, stage, ("policy", "trainer") if stage == "update" else ())


def test_generations_behind_the_policy_keep_the_versions_they_sample_from(tmp_path):
    """With max_staleness = 2 the pending generate of iteration 4 samples version 2 and that of 5
    version 3: both stay, whatever keep_last says, with their trainer states."""
    run, exp = make_run(tmp_path / "r", iterations=6, updates=4, keep_last=1, keep_trainer_states=1)
    exp = config.with_overrides(exp, {"algorithm.max_staleness": 2}, "test")
    assert pruning.needed(run, exp) == {2, 3, 4, 5, 6}  # generations 4, 5 and the final one; updates 4, 5
    assert [(e["part"], e["version"]) for e in pruning.prune(run, exp)] == [("policy", 1), ("trainer", 1)]
    _commit_stages(run, (4, "generate"), (4, "score"), (5, "generate"), (5, "score"))
    assert pruning.needed(run, exp) == {4, 5, 6}  # updates 4 and 5, then the final generation
    assert [(e["part"], e["version"]) for e in pruning.prune(run, exp)] == [("policy", 2), ("policy", 3),
                                                                            ("trainer", 2), ("trainer", 3)]


def test_a_finished_run_needs_only_its_latest_version(tmp_path):
    run, exp = make_run(tmp_path / "r", iterations=3, updates=3)
    _commit_stages(run, *[(3, s) for s in ("generate", "score")])  # the final validation
    assert plan.pending_stages(run, exp) == [] and pruning.needed(run, exp) == {3}


def test_a_ledger_line_torn_by_a_crash_is_ended_and_skipped(tmp_path):
    run, exp = make_run(tmp_path / "r", keep_last=2)
    (run.root / pruning.LEDGER).write_text('{"version": 9, "part": "policy"}\n{"torn')
    entries = pruning.prune(run, exp)
    assert len(entries) == 2  # the second appended after a whole line: no blank line between
    lines = (run.root / pruning.LEDGER).read_text().splitlines()
    assert lines[1] == '{"torn' and json.loads(lines[2]) == entries[0]
    assert pruning.ledger(run) == [{"version": 9, "part": "policy"}, *entries]  # the torn line skipped
    assert list(entries[0]) == ["at", "version", "iteration", "part", "rule", "files", "bytes", "paths"]
    assert entries[0]["at"].endswith("+00:00") and entries[0]["files"] == 2
    assert lines[2:] == [json.dumps(e, sort_keys=True) for e in entries]  # one sorted JSON object a line
    assert pruning.ledger(RunDir.at(tmp_path / "r")) == pruning.ledger(run)
    assert pruning.ledger(make_run(tmp_path / "empty", updates=0)[0]) == []


def test_the_marks_name_each_folder_of_a_pruned_part(tmp_path):
    run, exp = make_run(tmp_path / "r", iterations=5, updates=3, keep_last=1)
    _commit(run, 3, "generate")
    _commit(run, 3, "score")
    _commit(run, 3, "update", ("policy", "critic", "trainer"))  # ppo: the critic goes with the policy
    (run.root / "policy" / "v000002").unlink()  # a published link already gone
    pruning.prune(run, exp)
    marks = {k: set(commit.pruned_parts(run.stage_dir(k, "update"))) for k in range(4)}
    assert marks == {0: {"policy"}, 1: {"policy"}, 2: {"policy"}, 3: set()}
    _commit_stages(run, (4, "generate"), (4, "score"), (4, "update"))
    pruning.prune(run, exp)
    marks, entry = commit.pruned_parts(run.stage_dir(3, "update")), pruning.ledger(run)[-1]
    assert marks == dict.fromkeys(("critic", "policy"), {"at": entry["at"], "rule": entry["rule"],
                                                        "bytes": entry["bytes"]})
    assert (run.stage_dir(3, "update") / commit.PRUNED).read_text() == json.dumps(marks, indent=2,
                                                                                  sort_keys=True) + "\n"
    assert not (run.stage_dir(3, "update") / "critic").exists()
    # a part whose folder a crash already removed is still marked (its first folder)
    stage = run.stage_dir(4, "update")
    pruning._mark(stage, pruning.FOLDERS["policy"], {"at": "t", "rule": "r", "bytes": 0})
    assert commit.pruned_parts(stage) == {"policy": {"at": "t", "rule": "r", "bytes": 0}}


def test_a_part_counts_the_files_under_its_folders_at_any_depth():
    manifest = {"files": {"policy/a.bin": {"bytes": 5}, "policy/tokenizer/b.json": {"bytes": 7},
                          "trainer/c.pt": {"bytes": 100}, "critic/d.bin": {"bytes": 3}}}
    assert pruning._part_bytes(manifest, ("policy", "critic")) == (3, 15)
    assert pruning._part_bytes(manifest, ("trainer",)) == (1, 100)


def test_the_refusals_and_the_pin_messages_in_full(tmp_path):
    run, exp = make_run(tmp_path / "r", updates=2, keep_trainer_states=1)
    assert pruning.pin(run, 2) == f"pinned policy version 2 of {run.root}; pinned now: 2"
    assert pruning.pin(run, 1) == f"pinned policy version 1 of {run.root}; pinned now: 1, 2"
    assert pruning.pin(run, 2, unpin=True) == f"unpinned policy version 2 of {run.root}; pinned now: 1"
    assert pruning.pin(run, 1, unpin=True) == f"unpinned policy version 1 of {run.root}; pinned now: none"
    pruning.prune(run, exp)
    shutil.rmtree(run.stage_dir(1, "update") / "trainer")  # as if the last state were lost too
    pruning._mark(run.stage_dir(1, "update"), ("trainer",), {"at": "then", "rule": "r", "bytes": 1})
    with pytest.raises(commit.PrunedError) as err:
        pruning.require(run, 1, "trainer", "replay")
    assert str(err.value) == (
        "replay: the trainer state of version 1 was pruned by retention (run.retention.keep_trainer_states"
        f" = 1, at {pruning.ledger(run)[0]['at']}); the run keeps trainer states of versions none (`hpcrl"
        " pin` keeps a version from now on)")
    pruning.require(run, 0, "trainer", "replay")  # version 0, the model, is never pruned


def test_disk_use_adds_the_files_and_does_not_follow_links(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "x.bin").write_bytes(b"1" * 10)
    (tmp_path / "a" / "b" / "y.bin").write_bytes(b"2" * 20)
    (tmp_path / "big").write_bytes(b"3" * 1000)
    (tmp_path / "a" / "b" / "link").symlink_to(tmp_path / "big")
    link = len(str(tmp_path / "big"))  # a link counts its own size, not its target's
    assert pruning.disk_use(tmp_path / "a") == 30 + link
    assert pruning.disk_use(tmp_path / "none") == 0
    (tmp_path / "a" / "z.bin").write_bytes(b"4" * 5)
    lstat, failed = os.lstat, []

    def gone(path):  # the first file the walk reads is removed meanwhile: the others still count
        if not failed:
            failed.append(lstat(path).st_size)
            raise FileNotFoundError(path)
        return lstat(path)

    monkeypatch.setattr(os, "lstat", gone)
    assert pruning.disk_use(tmp_path / "a") == 35 + link - failed[0]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_sizes_for_people():
    cases = {0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 5 * 1024 ** 2: "5.0 MiB",
             84 * 1024 ** 3: "84.0 GiB", 2 * 1024 ** 4: "2.0 TiB", 3 * 1024 ** 5: "3072.0 TiB"}
    assert {n: pruning.size(n) for n in cases} == cases


def test_the_status_line_names_what_was_pruned_and_pinned(tmp_path):
    run, exp = make_run(tmp_path / "r", updates=3)
    used = pruning.size(pruning.disk_use(run.root))
    assert pruning.status_line(run) == f"disk: {used} kept in the run directory; retention freed 0 B"
    pruning.pin(run, 3)
    pruning.pin(run, 1)
    exp = config.with_overrides(exp, {"run.retention.keep_last": 1}, "test")
    freed = sum(e["bytes"] for e in pruning.prune(run, exp))
    assert pruning.status_line(run) == (f"disk: {pruning.size(pruning.disk_use(run.root))} kept in the run "
                                        f"directory; retention freed {pruning.size(freed)} (pruned policy "
                                        "versions v2); pinned versions: 1, 3")


def test_the_versions_a_run_saves():
    assert retention.saved_versions(3) == [1, 2, 3]
    assert retention.saved_versions(5, 2) == [2, 4, 5]
