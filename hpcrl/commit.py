"""Atomic stage outputs: write into a temporary directory, commit by rename with a manifest.

A stage directory exists, for every reader, exactly when its `_COMMIT.json` does. The writer
stages everything in `.<stage>.tmp` beside the final place and renames it into place as its last
act; a committed directory is never written again. Readers verify checksums and schemas.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hpcrl import schemas

MANIFEST = "_COMMIT.json"
IO_THREADS = 16  # the most files hashed or synced at once
PRUNED = "_PRUNED.json"  # the parts of a committed output that retention removed (hpcrl.pruning)


class AlreadyCommittedError(RuntimeError):
    """Refusal to write over a committed stage output."""


class CorruptOutputError(RuntimeError):
    """A committed output does not match its manifest."""


class PrunedError(CorruptOutputError):
    """A part of a committed output that retention removed (run.retention) was asked for."""


def is_committed(stage_dir: Path) -> bool:
    return (stage_dir / MANIFEST).is_file()


def read_json_object(path: Path, hint: str = "restore it from a backup, or move the stage directory "
                     "aside to run the stage again") -> dict:
    """A JSON object file of the run directory (a manifest, run.json); CorruptOutputError naming the
    file and what to do (`hint`) when it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptOutputError(f"{path}: damaged, not valid JSON ({err}); {hint}") from None
    if not isinstance(value, dict):
        raise CorruptOutputError(f"{path}: damaged, expected a JSON object, found a {type(value).__name__}; "
                                 f"{hint}")
    return value


def read_manifest(stage_dir: Path) -> dict | None:
    path = stage_dir / MANIFEST
    return read_json_object(path) if path.is_file() else None


def pruned_parts(stage_dir: Path) -> dict[str, dict]:
    """{top-level folder of the output: what removed it} for the folders retention pruned; the
    manifest still lists their files, so the output's identity (its manifest digest) stays."""
    path = stage_dir / PRUNED
    return json.loads(path.read_text()) if path.is_file() else {}


def pruned_message(stage_dir: Path, part: str, record: dict) -> str:
    return f"{stage_dir / part}: pruned by retention ({record.get('rule', '?')}, at {record.get('at', '?')})"


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def manifest_digest(stage_dir: Path) -> str:
    """Identity of a committed output, recorded by the stages that consume it."""
    return file_digest(stage_dir / MANIFEST)


class StageWriter:
    """Collects a stage's files and metrics in the temporary directory until commit."""

    def __init__(self, tmp: Path):
        self.dir = tmp
        self.tables: dict[str, dict] = {}
        self.written: dict[str, pa.Table] = {}  # each table as written: who goes on with it reads none back
        self.metrics: dict[str, float] = {}

    def write_table(self, name: str, table: pa.Table, schema_name: str | None = None) -> Path:
        """Write `table` as `<name>.parquet`, conformed to its stage-contract schema."""
        table = schemas.conform(schema_name or name, table)
        path = self.dir / f"{name}.parquet"
        write_parquet(table, path)
        self.tables[name] = {"file": path.name, "rows": table.num_rows, "schema": schema_name or name}
        self.written[name] = table
        return path


def write_parquet(table: pa.Table, path: Path, codecs: str | dict[str, str] | None = None) -> None:
    """`table` as a Parquet file with the fixed writer settings, so the same table gives the same
    bytes: each column's codec by its size (`compression`; `codecs` overrides it, for a benchmark's
    reference), statistics, the Arrow schema stored, dictionaries for the text columns only
    (numbers and token lists rarely repeat: trying costs more than it saves)."""
    text = [f.name for f in table.schema if pa.types.is_string(f.type)]
    pq.write_table(table, path, compression=compression(table) if codecs is None else codecs,
                   write_statistics=True, store_schema=True, use_dictionary=text)


COMPRESS_BYTES = 16 << 10  # a column smaller in memory is stored uncompressed


def compression(table: pa.Table) -> dict[str, str]:
    """The codec of each column: zstd for a column of at least COMPRESS_BYTES, none below. A small
    column saves at most a few KB compressed, and each column chunk costs the codec a context of
    its own: a table of a few hundred rows (a small batch's scores or rollouts) writes 1.3-1.4x
    faster, and an update's stats (a row a step) are smaller uncompressed (tools/bench_commit.py)."""
    return {leaf: "zstd" if column.nbytes >= COMPRESS_BYTES else "none"
            for field, column in zip(table.schema, table.columns, strict=True)
            for leaf in _leaf_paths(field.name, field.type)}


def _leaf_paths(name: str, type_: pa.DataType) -> list[str]:
    """The Parquet paths of a column's leaves, which per-column settings name (a list's values are
    `<name>.list.element`, a map's `<name>.key_value.key` and `.value`)."""
    if pa.types.is_list(type_):
        return _leaf_paths(f"{name}.list.element", type_.value_type)
    if pa.types.is_map(type_):
        return [*_leaf_paths(f"{name}.key_value.key", type_.key_type),
                *_leaf_paths(f"{name}.key_value.value", type_.item_type)]
    return [name]  # the stage contracts' other types are flat (tests/test_commit.py checks each)


def _checksums(root: Path) -> dict[str, dict]:
    """Size and sha256 of every file under `root` but a manifest, hashed side by side (hashlib lets
    go of Python's lock while it hashes: a checkpoint's shards take every core)."""
    def entry(path: Path) -> tuple[str, dict]:
        return str(path.relative_to(root)), {"bytes": path.stat().st_size,
                                             "sha256": file_digest(path).split(":", 1)[1]}

    return dict(_each(entry, sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)))


_POOLS: dict[int, ThreadPoolExecutor] = {}  # by process: a forked child starts its own


def _each(function, items: list) -> list:
    """`function` of every item, in order: side by side on this process's threads, one alone here."""
    if len(items) < 2:
        return [function(item) for item in items]
    pool = _POOLS.get(os.getpid())
    if pool is None:
        pool = _POOLS[os.getpid()] = ThreadPoolExecutor(IO_THREADS)
    return list(pool.map(function, items))


@contextmanager
def stage_lock(stage_dir: Path) -> Iterator[None]:
    """Serialise attempts at one stage (an orphaned attempt finishes before a new one starts)."""
    stage_dir.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(stage_dir.parent / f".{stage_dir.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def temp_dir(stage_dir: Path) -> Path:
    return stage_dir.parent / f".{stage_dir.name}.tmp"


def partial_dir(stage_dir: Path) -> Path:
    """Where an interrupted stage keeps its progress for the next attempt (hpcrl.preemption);
    never a committed output, removed by the commit."""
    return stage_dir.parent / f".{stage_dir.name}.partial"


def fresh_temp_dir(stage_dir: Path) -> Path:
    """Empty the stage's temporary directory (leftovers of an interrupted attempt) and return it."""
    if is_committed(stage_dir):
        raise AlreadyCommittedError(f"{stage_dir} is committed; it is never written again")
    tmp = temp_dir(stage_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """Every file and directory under `root`, and `root` itself, on stable storage. Side by side:
    a parallel filesystem (Lustre, GPFS) serves concurrent fsyncs from several servers, and a local
    journal commits them together (a checkpoint's files are many)."""
    paths = [p for p in sorted(root.rglob("*")) if p.is_file() or p.is_dir()] + [root]
    _each(_fsync, paths)


def commit(stage_dir: Path, writer: StageWriter, manifest: dict) -> dict:
    """Write the manifest into the temporary directory and rename it into place: the data and the
    manifest on stable storage, with the directory's entries, before the rename, then the directory
    holding it. Nothing in the temporary directory is read before the rename makes it the stage's,
    so the manifest may reach the disk before the data it lists, not the rename before either."""
    if is_committed(stage_dir):
        raise AlreadyCommittedError(f"{stage_dir} is committed; it is never written again")
    full = {
        "schema_version": schemas.SCHEMA_VERSION,
        **manifest,
        "tables": writer.tables,
        "metrics": writer.metrics,
        "files": _checksums(writer.dir),
        "committed_at": time.time(),
    }
    with open(writer.dir / MANIFEST, "w") as f:
        json.dump(full, f, indent=2, sort_keys=True)
    _sync_tree(writer.dir)
    if stage_dir.exists():  # an uncommitted directory (no manifest) does not exist: clear it
        shutil.rmtree(stage_dir)
    os.rename(writer.dir, stage_dir)
    _fsync(stage_dir.parent)
    return full


def lineage(stage_dir: Path, manifest: dict | None = None, absent_ok: bool = False) -> list[str]:
    """Problems with the inputs a committed output records: each must be committed, and be the
    output it was computed from (the digest of its manifest). Reads manifests only: cheap. With
    `absent_ok`, an input that is not in this tree at all is no problem (a replay links only the
    stage's direct inputs, whose lineage it checked in the run they come from)."""
    manifest = read_manifest(stage_dir) if manifest is None else manifest
    problems = []
    # "generate@iter_000003": the digest of that input's manifest
    for name, digest in (manifest or {}).get("inputs", {}).items():
        stage, iteration_dir = name.split("@", 1)
        source = stage_dir.parent.parent / iteration_dir / stage
        if absent_ok and not source.exists():
            continue
        if not is_committed(source):
            problems.append(f"{stage_dir}: its input {source} is not committed")
        elif manifest_digest(source) != digest:
            problems.append(f"{stage_dir}: computed from another {source} than the one committed there now")
    return problems


def verify(stage_dir: Path, under: str | None = None) -> list[str]:
    """Problems with a committed output (missing or changed files, or inputs that are not the
    committed outputs it was computed from), empty when it is sound; with `under`, only its files
    in that subdirectory. The files of a folder retention pruned are not checked (`pruned_parts`)."""
    manifest = read_manifest(stage_dir)
    if manifest is None:
        return [f"{stage_dir}: not committed (no {MANIFEST})"]
    problems = lineage(stage_dir, manifest) if under is None else []
    pruned = pruned_parts(stage_dir)
    if under is not None and under.split("/", 1)[0] in pruned:
        return [pruned_message(stage_dir, under.split("/", 1)[0], pruned[under.split("/", 1)[0]])]
    files = {rel: meta for rel, meta in manifest["files"].items()
             if (under is None or rel.startswith(f"{under}/")) and rel.split("/", 1)[0] not in pruned}
    if under is not None and not files:
        problems.append(f"{stage_dir / under}: no files of it are listed in {MANIFEST}")
    present = [rel for rel in files if (stage_dir / rel).is_file()]
    sized = [rel for rel in present if (stage_dir / rel).stat().st_size == files[rel]["bytes"]]
    digests = dict(_each(lambda rel: (rel, file_digest(stage_dir / rel)), sized))
    for rel, meta in files.items():
        path = stage_dir / rel
        if rel not in present:
            problems.append(f"{path}: missing (listed in {MANIFEST})")
        elif digests.get(rel) != f"sha256:{meta['sha256']}":  # no digest: another size
            problems.append(f"{path}: checksum mismatch with {MANIFEST}")
    return problems


def verified(path: Path) -> Path:
    """`path` (a directory of a committed stage output, like a policy version or the trainer state),
    once its files match the manifest; a path outside any stage output (the base model) as is.
    Nothing of a run directory is loaded (and DeepSpeed's state unpickled) before this."""
    path = Path(path)
    stage_dir = next((d for d in path.parents if (d / MANIFEST).is_file()), None)
    if stage_dir is None:
        return path
    rel = str(path.relative_to(stage_dir))
    if (record := pruned_parts(stage_dir).get(rel.split("/", 1)[0])) is not None:
        raise PrunedError(pruned_message(stage_dir, rel.split("/", 1)[0], record))
    problems = verify(stage_dir, rel)
    if problems:
        raise CorruptOutputError("; ".join(problems))
    return path


def read_table(stage_dir: Path, name: str, columns: list[str] | None = None, check: bool = True) -> pa.Table:
    """Read a committed table; refuses an uncommitted or corrupted output."""
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise CorruptOutputError(f"{stage_dir}: not committed (no {MANIFEST}); run its stage first")
    if name not in manifest["tables"]:
        raise CorruptOutputError(f"{stage_dir}: has no table {name!r} (has {sorted(manifest['tables'])})")
    entry = manifest["tables"][name]
    path = stage_dir / entry["file"]
    if check:
        meta = manifest["files"].get(entry["file"])
        if not path.is_file() or meta is None or file_digest(path).split(":", 1)[1] != meta["sha256"]:
            raise CorruptOutputError(f"{path}: checksum mismatch with {stage_dir / MANIFEST}")
    return read_parquet(path, columns)


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One Parquet file's table, read without pq.read_table's dataset layer: importing
    pyarrow.dataset costs each process that reads a table about 0.25 s. A column asked for that
    the file lacks is an error, as with pq.read_table (ParquetFile.read leaves it out)."""
    with pq.ParquetFile(path) as f:
        if missing := [c for c in columns or () if c not in f.schema_arrow.names]:
            raise pa.ArrowInvalid(f"{path}: has no column {', '.join(map(repr, missing))} "
                                  f"(has {', '.join(f.schema_arrow.names)})")
        return f.read(columns=columns)
