"""Runs on a shared filesystem: a locked or slow tracking store never stops a run, and a runs root
without working file locks (Lustre `noflock`, NFS `nolock`) is refused at submit with what to do."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import config, preflight, tracking
from hpcrl.config import ConfigError
from hpcrl.rundir import LocksUnsupportedError, RunDir, RunLock, RunLockedError
from hpcrl.tracking import Tracker

pytestmark = pytest.mark.timeout(180)  # about 20 s on 2 CPU cores, most of it MLflow's start

MOUNTS = r"""/dev/sda1 / ext4 rw,relatime 0 0
10.0.0.1@o2ib:/lus /lus lustre rw,flock 0 0
server:/export/home /home nfs4 rw,vers=4.2 0 0
tmpfs /lus/scratch/tmp tmpfs rw 0 0
/dev/sdb1 /mnt/my\040disk xfs rw 0 0
/dev/sdc1 /home ext4 rw 0 0
"""


def test_the_filesystem_of_a_path_is_that_of_the_longest_mount_point_above_it():
    fs = tracking.filesystem_type
    assert fs("/lus/runs/mlflow.db", MOUNTS) == "lustre"
    assert fs("/lus", MOUNTS) == "lustre"
    assert fs("/lustre/runs", MOUNTS) == "ext4"  # /lus is not a parent of /lustre
    assert fs("/lus/scratch/tmp/a.db", MOUNTS) == "tmpfs"
    assert fs("/mnt/my disk/a.db", MOUNTS) == "xfs"  # \040 is a space
    assert fs("/home/u/runs", MOUNTS) == "ext4"  # mounted over the NFS home: the last one counts
    assert fs("/home/u/runs", MOUNTS.replace("/dev/sdc1 /home ext4 rw 0 0\n", "")) == "nfs4"
    assert fs("/anything", "") is None


def test_a_sqlite_store_on_a_network_filesystem_is_warned_about():
    said = tracking.store_warning("sqlite:////lus/runs/mlflow.db", MOUNTS)
    assert said.startswith("warning: the MLflow tracking store /lus/runs/mlflow.db is on a lustre filesystem")
    assert "tracking.tracking_uri" in said and "Shared filesystems: tracking and locks" in said
    assert tracking.store_warning("sqlite:////var/runs/mlflow.db", MOUNTS) is None
    assert tracking.store_warning("http://tracking:5000", MOUNTS) is None


def _hold_store(uri: str) -> subprocess.Popen:
    """Another process that creates the MLflow store of `uri`, then holds its SQLite file locked."""
    db = uri.removeprefix("sqlite:///")
    code = (f"import sqlite3, time\nfrom mlflow.tracking import MlflowClient\n"
            f"MlflowClient({uri!r}).search_experiments()\n"
            f"con = sqlite3.connect({db!r}, isolation_level=None)\ncon.execute('BEGIN EXCLUSIVE')\n"
            "print('held', flush=True)\ntime.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: MLflow tracking at")]


def test_a_locked_tracking_store_leaves_the_run_untracked_with_one_warning(tmp_path, capsys):
    from tests.synthetic_run import write_config

    run = RunDir.at(tmp_path / "runs" / "shared")
    exp = config.with_overrides(write_config(run.root, 2), {"tracking.enabled": True}, "test")
    uri = tracking.tracking_uri(exp)
    holder = _hold_store(uri)
    try:
        tracker = Tracker(run, exp)  # another controller holds the store: sqlite says `database is locked`
        tracker.log_metrics({"critic/score/mean": 0.5}, step=0)
        tracker.set_tags({"a": "b"})
        tracker.finish("FINISHED")
    finally:
        holder.kill()
        holder.wait()
    [warning] = _warnings(capsys.readouterr().err)
    assert warning.startswith(f"warning: MLflow tracking at {uri} failed (")
    assert "database is locked" in warning and "the run goes on without tracking" in warning
    assert "tracking.tracking_uri to an MLflow tracking server backed by a real database" in warning
    assert not tracker.enabled and "mlflow_run_id" not in run.read_run_info()

    tracker = Tracker(run, exp)  # the store is free again: the next controller tracks the run
    assert tracker.enabled and run.read_run_info()["mlflow_run_id"] == tracker.run_id
    tracker.run_id = "0" * 32  # a later call that MLflow refuses (no such run): one warning, then quiet
    tracker.log_metrics({"critic/score/mean": 0.5}, step=1)
    tracker.set_tags({"a": "b"})
    tracker.finish("FINISHED")
    [warning] = _warnings(capsys.readouterr().err)
    assert "MlflowException" in warning and not tracker.enabled


def _no_locks_under(root: Path, code: int, monkeypatch) -> None:
    """flock fails with `code` on files under `root`, as on Lustre mounted `noflock` (ENOSYS)."""
    real = fcntl.flock

    def flock(fd, operation):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(root)):
            raise OSError(code, os.strerror(code))
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)


def test_submit_refuses_a_runs_root_without_working_locks(write_experiment, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from hpcrl.cli import main

    path = write_experiment("nolocks")
    exp = config.load(path)
    _no_locks_under(tmp_path, errno.ENOSYS, monkeypatch)
    with pytest.raises(ConfigError) as refused:
        preflight.check(exp, str(path))
    said = (f"run.runs_root: {tmp_path / 'runs'}: file locks do not work on the filesystem of {tmp_path}: "
            "flock(2) fails with ENOSYS (Function not implemented)")
    assert said in str(refused.value), str(refused.value)
    assert "mount Lustre with the option `flock` (not `localflock` or `noflock`)" in str(refused.value)
    assert "NFS with a running lock manager (not `nolock`)" in str(refused.value)
    result = CliRunner().invoke(main, ["submit", "--dry-run", str(path)])
    assert result.exit_code == 2 and "file locks do not work" in result.stderr, result.output
    assert "Traceback" not in result.output and not (tmp_path / "runs" / "dry-runs").exists()
    monkeypatch.undo()  # working locks: no problem, and the probe leaves nothing behind
    assert preflight.check(exp, str(path)) == []
    assert not list(tmp_path.rglob(".hpcrl-lock-probe-*"))


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP],
                         ids=errno.errorcode.get)
def test_the_run_lock_on_a_filesystem_without_locks_says_what_to_do(tmp_path, monkeypatch, code):
    _no_locks_under(tmp_path, code, monkeypatch)
    with pytest.raises(LocksUnsupportedError) as refused:
        RunLock(RunDir.at(tmp_path)).acquire()
    assert isinstance(refused.value, RunLockedError)  # the CLI reports it in one line, as a held run
    said = str(refused.value)
    assert said.startswith(f"file locks do not work on the filesystem of {tmp_path / '.controller.lock'}: "
                           f"flock(2) fails with {errno.errorcode[code]}")
    assert "run.runs_root" in said and "`noflock`" in said and "`nolock`" in said


def test_a_run_completes_while_another_process_holds_its_tracking_store(tmp_path, capsys, tiny_task):
    from hpcrl import plan
    from hpcrl.controller import Controller
    from tests.synthetic_run import make_run

    run = make_run(tmp_path / "runs" / "locked", iterations=1, rows=16, policy_from=tiny_task / "model")
    exp = config.with_overrides(config.load(run.config_path), {"tracking.enabled": True}, "test")
    holder = _hold_store(tracking.tracking_uri(exp))
    try:
        Controller(run, exp, echo=lambda line: None, show_progress=False).run_all()
    finally:
        holder.kill()
        holder.wait()
    assert not plan.pending_stages(run, exp)
    [warning] = _warnings(capsys.readouterr().err)
    assert "database is locked" in warning and "the run goes on without tracking" in warning
