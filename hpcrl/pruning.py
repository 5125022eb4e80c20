"""Removing the policy versions and trainer states that a run's retention rules let go
(hpcrl.retention decides), recorded, never silently:

- in the update output that held them, `_PRUNED.json` names each removed folder with its rule and
  time (written before the files go, so an interrupted prune is finished by the next one, and
  `hpcrl status --verify` reports pruned folders as pruned, not as missing); the manifest
  `_COMMIT.json` is left as it was committed, so the output's identity, which the later stages
  recorded as their input, does not change;
- in the run's ledger `retention.jsonl`, one line per removed part: when, which version, which
  rule, how many files and bytes.

Pins (`hpcrl pin`) live in `pins.json`. Pinning and pruning hold `.retention.lock`, so a version
pinned while the controller prunes is either pinned before it looks, or refused as pruned.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcrl import commit, plan, retention
from hpcrl.config import Experiment
from hpcrl.retention import POLICY, TRAINER
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import GENERATE, UPDATE

LEDGER = "retention.jsonl"
PINS = "pins.json"
FOLDERS = {POLICY: ("policy", "critic"), TRAINER: ("trainer",)}  # a part's folders in the update output
NAMES = {POLICY: "policy version", TRAINER: "trainer state of version"}
KEPT = {POLICY: "policy versions", TRAINER: "trainer states of versions"}


@contextmanager
def _locked(run: RunDir) -> Iterator[None]:
    fd = os.open(run.root / ".retention.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def pins(run: RunDir) -> set[int]:
    path = run.root / PINS
    return set(json.loads(path.read_text())) if path.is_file() else set()


def present(run: RunDir) -> dict[str, set[int]]:
    """{part: the saved versions whose part is still in the run directory}."""
    out: dict[str, set[int]] = {POLICY: set(), TRAINER: set()}
    for k in run.iterations_present():
        stage = run.stage_dir(k, UPDATE)
        manifest = commit.read_manifest(stage)
        if manifest is None:
            continue
        pruned = commit.pruned_parts(stage)
        for part, folders in FOLDERS.items():
            listed = any(rel.startswith(f"{folders[0]}/") for rel in manifest["files"])
            if listed and folders[0] not in pruned:
                out[part].add(k + 1)
    return out


def needed(run: RunDir, exp: Experiment) -> set[int]:
    """The versions the run still reads: the latest saved one (the run continues from it) and
    those the pending generate and update stages load."""
    pending = plan.pending_stages(run, exp)
    return ({run.latest_saved_version()} | {k for k, s in pending if s == UPDATE}
            | {plan.policy_version(exp, k) for k, s in pending if s == GENERATE})


def _part_bytes(manifest: dict, folders: tuple[str, ...]) -> tuple[int, int]:
    files = [m for rel, m in manifest["files"].items() if rel.split("/", 1)[0] in folders]
    return len(files), sum(m["bytes"] for m in files)


def _append(path: Path, entry: dict) -> None:
    """One JSON line, appended and synced; a torn last line (a crash mid-write) is ended first."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        line = json.dumps(entry, sort_keys=True) + "\n"
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = "\n" + line
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _mark(stage: Path, folders: tuple[str, ...], record: dict) -> None:
    marks = commit.pruned_parts(stage)
    marks.update({f: record for f in folders if (stage / f).exists() or f == folders[0]})
    tmp = stage / f".{commit.PRUNED}.tmp"
    tmp.write_text(json.dumps(marks, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, stage / commit.PRUNED)


def prune(run: RunDir, exp: Experiment) -> list[dict]:
    """Remove what [run.retention] lets go now; returns the ledger entries written."""
    r = exp.run.retention
    if not (r.keep_last or r.keep_trainer_states):
        return []
    entries = []
    with _locked(run):
        _finish_interrupted(run)
        have = present(run)
        for p in retention.select(have[POLICY], have[TRAINER], r, pins(run), needed(run, exp)):
            stage = run.stage_dir(p.version - 1, UPDATE)
            folders = FOLDERS[p.part]
            files, nbytes = _part_bytes(commit.read_manifest(stage), folders)
            entry = {"at": _now(), "version": p.version, "iteration": p.version - 1, "part": p.part,
                     "rule": p.rule, "files": files, "bytes": nbytes,
                     "paths": [str((stage / f).relative_to(run.root)) for f in folders
                               if (stage / f).exists()]}
            _append(run.root / LEDGER, entry)  # a crash after this: the prune is redone, the ledger
            _mark(stage, folders, {"at": entry["at"], "rule": p.rule, "bytes": nbytes})  # reads it once
            for f in folders:
                shutil.rmtree(stage / f, ignore_errors=True)
            if p.part == POLICY:
                (run.root / "policy" / f"v{p.version:06d}").unlink(missing_ok=True)
            entries.append(entry)
    return entries


def _finish_interrupted(run: RunDir) -> None:
    """Remove what a prune marked as removed but did not get to delete (it was interrupted)."""
    for k in run.iterations_present():
        stage = run.stage_dir(k, UPDATE)
        for folder in commit.pruned_parts(stage):
            if (stage / folder).exists():
                shutil.rmtree(stage / folder, ignore_errors=True)


def ledger(run: RunDir) -> list[dict]:
    """The ledger's entries, one per pruned part (a prune redone after a crash is read once)."""
    path = run.root / LEDGER
    out, seen = [], set()
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a crash; its prune is redone
            continue
        if (entry.get("version"), entry.get("part")) not in seen:
            seen.add((entry.get("version"), entry.get("part")))
            out.append(entry)
    return out


def remaining(run: RunDir, part: str) -> list[int]:
    """The versions whose `part` the run directory holds (0, the model, for the policy)."""
    return sorted(present(run)[part] | ({0} if part == POLICY else set()))


def require(run: RunDir, version: int, part: str, purpose: str) -> None:
    """Refuse, in one line, a version whose `part` retention pruned."""
    if version <= 0:
        return
    stage = run.stage_dir(version - 1, UPDATE)
    record = commit.pruned_parts(stage).get(FOLDERS[part][0])
    if record is None:
        return
    left = ", ".join(str(v) for v in remaining(run, part)) or "none"
    raise commit.PrunedError(
        f"{purpose}: the {NAMES[part]} {version} was pruned by retention ({record['rule']}, at "
        f"{record['at']}); the run keeps {KEPT[part]} {left} "
        "(`hpcrl pin` keeps a version from now on)")


def pin(run: RunDir, version: int, unpin: bool = False) -> str:
    """Pin (or unpin) the weights of a policy version against retention; returns what was done."""
    with _locked(run):
        require(run, version, POLICY, f"hpcrl pin {version}")
        now = pins(run)
        now = now - {version} if unpin else now | {version}
        tmp = run.root / f".{PINS}.tmp"
        tmp.write_text(json.dumps(sorted(now)) + "\n")
        os.replace(tmp, run.root / PINS)
    return (f"{'unpinned' if unpin else 'pinned'} policy version {version} of {run.root}; pinned now: "
            + (", ".join(map(str, sorted(now))) or "none"))


def disk_use(path: Path) -> int:
    """Bytes of the files under `path` (symbolic links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total


def status_line(run: RunDir) -> str:
    """The run's disk use, and what retention freed."""
    entries = ledger(run)
    freed = sum(e["bytes"] for e in entries)
    parts = {part: sorted({e["version"] for e in entries if e["part"] == part}) for part in (POLICY, TRAINER)}
    labels = {POLICY: "policy versions", TRAINER: "trainer states"}
    what = "; ".join(f"{labels[p]} {_span(v)}" for p, v in parts.items() if v)
    pinned = pins(run)
    return (f"disk: {size(disk_use(run.root))} kept in the run directory; retention freed {size(freed)}"
            + (f" (pruned {what})" if what else "")
            + (f"; pinned versions: {', '.join(map(str, sorted(pinned)))}" if pinned else ""))


def _span(versions: list[int]) -> str:
    return ", ".join(f"v{v}" for v in versions)


def size(n: float) -> str:
    """Bytes for people: 1.5 MiB, 84.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):  # the unit it stops at is the one shown
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
