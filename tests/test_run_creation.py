"""Creating a run directory and resuming it (hpcrl.runs): what run.json and the frozen config hold,
which resubmissions are accepted, and the code version recorded."""

from __future__ import annotations

import getpass
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from hpcrl import config, runs
from hpcrl.config import ConfigError, Experiment


def _exp(tmp_path: Path, **run) -> Experiment:
    return Experiment(run={"name": "r", "runs_root": str(tmp_path), "iterations": 2, **run},
                      model={"path": str(tmp_path / "m")}, data={"train": str(tmp_path / "train.parquet")})


def test_a_new_run_records_who_what_and_when(tmp_path):
    """pins: the keys and values of run.json, the header of the frozen config, a UTC timestamp."""
    exp = _exp(tmp_path)
    (tmp_path / "r").mkdir()  # an existing empty directory is fine
    run, resumed = runs.prepare(exp, "sub/e.toml")
    assert not resumed
    info = json.loads(run.run_file.read_text())
    assert set(info) == {"run_id", "name", "created", "code_version", "user", "source"}
    assert re.fullmatch(r"[0-9a-f]{32}", info["run_id"]) and info["name"] == "r"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", info["created"])
    assert info["user"] == getpass.getuser() and info["source"] == str(Path("sub/e.toml").resolve())
    assert info["code_version"]
    text = run.config_path.read_text()
    assert text.startswith("# Frozen, fully resolved config of this run (written by hpcrl).\n")
    assert config.load(run.config_path) == exp
    assert sorted(p.name for p in run.root.iterdir()) == ["experiment.toml", "run.json"]


def test_resubmissions_same_or_equal_length_or_refused(tmp_path):
    """pins: the same iterations may resume (`<`, not `<=`); a resumable change at the same length does
    not move the last iteration aside (`>`, not `>=`); refused keys are listed one per line."""
    exp = _exp(tmp_path)
    run, _ = runs.prepare(exp, "e.toml")
    last = run.iteration_dir(2) / "generate"
    last.mkdir(parents=True)
    run2, resumed = runs.prepare(config.with_overrides(exp, {"executor.max_retries": 3}, "e.toml"), "e.toml")
    assert resumed and last.is_dir()
    assert run2.read_run_info()["config_changes"][0]["keys"] == {"executor.max_retries": 3}
    assert set(run2.read_run_info()["config_changes"][0]) == {"at", "keys"}
    changed = config.with_overrides(exp, {"update.lr": 0.5, "update.weight_decay": 0.25}, "e.toml")
    with pytest.raises(ConfigError) as err:
        runs.prepare(changed, "e.toml")
    assert ("these keys may not change on resume (use another run.name for a new run):\n"
            "  update.lr: run has 1e-05, config has 0.5\n"
            "  update.weight_decay: run has 0.0, config has 0.25") in str(err.value)


def test_code_version_is_git_describe_or_unknown(monkeypatch):
    """pins: `git -C <package dir> describe --always --dirty` with a 5 s timeout; "unknown" when git
    prints nothing or cannot run."""
    here = str(Path(runs.__file__).resolve().parent)
    expected = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True,
                              text=True).stdout.strip() or "unknown"
    assert runs.code_version() == expected
    calls = []

    def fake(args, **kwargs):
        calls.append((args, kwargs))
        return subprocess.CompletedProcess(args, 0, stdout="  \n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake)
    assert runs.code_version() == "unknown"
    assert calls == [(["git", "-C", here, "describe", "--always", "--dirty"],
                      {"capture_output": True, "text": True, "timeout": 5})]

    def broken(args, **kwargs):
        raise OSError("no git")

    monkeypatch.setattr(subprocess, "run", broken)
    assert runs.code_version() == "unknown"


def test_a_run_continues_in_the_other_mode_and_records_the_keys_that_came_and_went(tmp_path):
    """pins: a staged run resubmitted resident (its [executor.resident] is new) and back."""
    staged = _exp(tmp_path)
    runs.prepare(staged, "e.toml")
    switch = {"executor.mode": "resident", "executor.resident.stall_s": 9.0}
    resident = config.with_overrides(staged, switch, "e")
    run, resumed = runs.prepare(resident, "e.toml")
    assert resumed and config.load(run.config_path).executor.resident.stall_s == 9.0
    runs.prepare(staged, "e.toml")
    first, second = (c["keys"] for c in run.read_run_info()["config_changes"])
    assert first["executor.mode"] == "resident" and first["executor.resident.stall_s"] == 9.0
    assert second["executor.mode"] == "staged" and second["executor.resident.stall_s"] is None
    assert config.load(run.config_path).executor.mode == "staged"


@pytest.mark.parametrize("mode", ["0750", "0700"])
def test_a_new_run_directory_is_not_world_readable(tmp_path, mode):
    old = os.umask(0o022)  # the usual default lets everyone read what is created
    try:
        run, _ = runs.prepare(_exp(tmp_path, dir_mode=mode), "e.toml")
    finally:
        os.umask(old)
    assert stat.S_IMODE(run.root.stat().st_mode) == int(mode, 8)
    with pytest.raises(ConfigError, match=r"run\.dir_mode: String should match pattern"):
        config.parse({"run": {"dir_mode": "777x"}, "model": {"path": "m"}, "data": {"train": "t"}}, "e",
                     tmp_path)


def test_the_scratch_directory_is_private_and_never_another_users(tmp_path):
    from hpcrl.generation import private_dir

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    assert stat.S_IMODE(private_dir(loose).stat().st_mode) == 0o700
    assert stat.S_IMODE(private_dir(tmp_path / "new").stat().st_mode) == 0o700
    (tmp_path / "link").symlink_to(loose)
    with pytest.raises(RuntimeError, match="is a link or belongs to another user"):
        private_dir(tmp_path / "link")
    if os.getuid() == 0:  # as root, hand a directory to someone else (another user came first)
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 12345, 12345)
        with pytest.raises(RuntimeError, match=r"belongs to another user \(uid 12345\)"):
            private_dir(theirs)


def test_a_directory_that_is_not_a_run_is_refused_naming_the_source(tmp_path):
    """pins: run.name naming a non-empty directory without experiment.toml is refused, with the
    submitted file, the key and the directory; nothing is written into it."""
    exp = _exp(tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as err:
        runs.prepare(exp, "sub/e.toml")
    assert str(err.value) == (f"sub/e.toml: run.name: {tmp_path / 'r'} exists and is not an hpcrl run (no "
                              "experiment.toml); expected a new name, or the directory of a run")
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["notes.txt"]


def test_a_failed_creation_leaves_no_run_behind(tmp_path, monkeypatch):
    """pins: when writing a new run fails (a full disk, an interrupt), prepare removes what it wrote,
    the directory too when it made it, and re-raises the failure."""
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(getpass, "getuser", full)
    with pytest.raises(OSError, match="No space left"):
        runs.prepare(_exp(tmp_path), "e.toml")
    assert not (tmp_path / "r").exists()


def test_discard_new_removes_only_what_prepare_and_the_first_submission_wrote(tmp_path):
    """pins: discard_new removes experiment.toml, run.json, the jobs file and logs/ (those that exist),
    then the directory if nothing else is in it; a file of the user's keeps it."""
    for keep in (False, True):
        run, _ = runs.prepare(_exp(tmp_path), "e.toml")
        if keep:  # a first submission that got as far as a job, and a file of the user's
            run.record_job("1", "controller", None)
            (run.logs / "j1").mkdir(parents=True)
            (run.root / "notes.txt").write_text("mine")
        runs.discard_new(run)
        assert sorted(p.name for p in run.root.iterdir()) == ["notes.txt"] if keep else not run.root.exists()


def test_open_run_reads_the_frozen_config_or_refuses_a_non_run(tmp_path):
    """pins: open_run gives the run directory and its frozen config; a directory without
    experiment.toml is refused naming it."""
    exp = _exp(tmp_path)
    runs.prepare(exp, "e.toml")
    run, frozen = runs.open_run(tmp_path / "r")
    assert run.root == tmp_path / "r" and frozen == exp
    with pytest.raises(ConfigError) as err:
        runs.open_run(tmp_path)
    assert str(err.value) == f"{tmp_path}: not an hpcrl run directory (no experiment.toml)"
