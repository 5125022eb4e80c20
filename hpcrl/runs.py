"""Creating a run directory from an experiment, and reopening one to resume it.

The config is frozen into the run directory on creation; a resubmission with a changed config is
refused unless every change is one a resumed run may take (config.RESUMABLE_CHANGES), and
accepted changes are recorded in run.json.
"""

from __future__ import annotations

import datetime
import getpass
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from hpcrl import config
from hpcrl.config import ConfigError, Experiment
from hpcrl.rundir import RunDir


def code_version() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def check(exp: Experiment, source: str) -> tuple[RunDir, Experiment | None]:
    """Whether `exp` may create or continue its run, reading only: returns (run, its frozen config
    when the run exists). Raises ConfigError for a change a resumed run may not take."""
    run = RunDir.at(exp.run_dir)
    if not run.config_path.is_file():
        if run.root.is_dir() and any(run.root.iterdir()):
            raise ConfigError(f"{source}: run.name: {run.root} exists and is not an hpcrl run (no "
                              f"{run.config_path.name}); expected a new name, or the directory of a run")
        return run, None
    frozen = config.load(run.config_path)
    conflicts = config.resume_conflicts(frozen, exp)
    if conflicts:
        raise ConfigError(f"{source}: run {run.root} exists with a different config; these keys may "
                          "not change on resume (use another run.name for a new run):\n  "
                          + "\n  ".join(conflicts))
    if exp.run.iterations < frozen.run.iterations:
        raise ConfigError(f"{source}: run.iterations: the run has {frozen.run.iterations}; it may grow on "
                          f"resume, not shrink (got {exp.run.iterations})")
    return run, frozen


def prepare(exp: Experiment, source: str) -> tuple[RunDir, bool]:
    """The run directory of `exp`, created and frozen if new. Returns (run, resumed)."""
    run, frozen = check(exp, source)
    if frozen is not None:
        old, new = config.flat(frozen), config.flat(exp)
        # a section may come or go ([executor.resident] when the mode changes)
        changes = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        if changes:
            if exp.run.iterations > frozen.run.iterations:
                _archive_final_validation(run, frozen.run.iterations)
            info = run.read_run_info()
            info.setdefault("config_changes", []).append(
                {"at": _now(), "keys": {k: new.get(k) for k in changes}})
            _freeze(run, exp)
            run.write_run_info(info)
        return run, True
    run.root.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(run.root, int(exp.run.dir_mode, 8))
        _freeze(run, exp)
        run.write_run_info({"run_id": uuid.uuid4().hex, "name": exp.run.name, "created": _now(),
                            "code_version": code_version(), "user": getpass.getuser(),
                            "source": str(Path(source).resolve())})
    except BaseException:  # a full disk, an interrupt: no half-made run is left to be adopted later
        discard_new(run)
        raise
    return run, False


def discard_new(run: RunDir) -> None:
    """Undo `prepare` of a new run whose first submission failed: remove the files it wrote, and the
    directory when nothing else is in it (nothing of the user's is removed)."""
    for path in (run.config_path, run.run_file, run.jobs_file):
        path.unlink(missing_ok=True)
    if run.logs.is_dir():
        shutil.rmtree(run.logs)
    if not any(run.root.iterdir()):
        run.root.rmdir()


def _archive_final_validation(run: RunDir, old_iterations: int) -> None:
    """A longer run trains at the old last iteration, whose directory held only the final
    validation: keep that validation under another name instead of mixing it in."""
    d = run.iteration_dir(old_iterations)
    if d.exists():
        d.rename(d.with_name(f"{d.name}.final-validation"))


def _freeze(run: RunDir, exp: Experiment) -> None:
    tmp = run.config_path.with_suffix(".toml.tmp")
    tmp.write_text("# Frozen, fully resolved config of this run (written by hpcrl).\n" + config.dumps(exp))
    tmp.replace(run.config_path)


def open_run(path: str | Path) -> tuple[RunDir, Experiment]:
    run = RunDir.at(path)
    if not run.config_path.is_file():
        raise ConfigError(f"{run.root}: not an hpcrl run directory (no {run.config_path.name})")
    return run, config.load(run.config_path)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
