"""Stage outputs are committed atomically, never overwritten, and checked on read."""

import fcntl
import os
import signal
import subprocess
import sys
import threading
import types

import pyarrow as pa
import pytest

from hpcrl import commit, schemas
from hpcrl.rundir import RunDir, RunLock, RunLockedError


def _scores(n=3):
    return pa.table({"split": ["train"] * n, "prompt_index": list(range(n)), "sample_index": [0] * n,
                     "reward": [1.0] * n,
                     "reward_components": pa.array([[("a", 1.0)]] * n, pa.map_(pa.string(), pa.float64())),
                      "reward_message": [""] * n})


def _commit(stage_dir, table):
    w = commit.StageWriter(commit.fresh_temp_dir(stage_dir))
    w.write_table("scores", table)
    w.metrics["m"] = 1.0
    return commit.commit(stage_dir, w, {"stage": "score"})


def test_commit_renames_into_place_with_manifest(tmp_path):
    d = tmp_path / "iter_000000" / "score"
    manifest = _commit(d, _scores())
    assert commit.is_committed(d) and not commit.temp_dir(d).exists()
    assert manifest["schema_version"] == schemas.SCHEMA_VERSION
    assert manifest["tables"]["scores"]["rows"] == 3
    assert set(manifest["files"]) == {"scores.parquet"}
    assert commit.read_table(d, "scores")["reward"].to_pylist() == [1.0] * 3
    assert commit.verify(d) == []


def test_committed_output_is_never_overwritten(tmp_path):
    d = tmp_path / "score"
    _commit(d, _scores())
    before = (d / "scores.parquet").read_bytes()
    with pytest.raises(commit.AlreadyCommittedError):
        _commit(d, _scores(5))
    assert (d / "scores.parquet").read_bytes() == before


def test_uncommitted_directory_does_not_exist_for_readers(tmp_path):
    d = tmp_path / "score"
    d.mkdir()
    (d / "scores.parquet").write_bytes(b"partial")
    with pytest.raises(commit.CorruptOutputError, match="not committed"):
        commit.read_table(d, "scores")
    _commit(d, _scores())  # a leftover without manifest is replaced
    assert commit.read_table(d, "scores").num_rows == 3


def test_corruption_is_reported_with_the_file_name(tmp_path):
    d = tmp_path / "score"
    _commit(d, _scores())
    data = bytearray((d / "scores.parquet").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "scores.parquet").write_bytes(bytes(data))
    assert commit.verify(d) == [f"{d / 'scores.parquet'}: checksum mismatch with _COMMIT.json"]
    with pytest.raises(commit.CorruptOutputError, match="scores.parquet: checksum mismatch"):
        commit.read_table(d, "scores")


def test_schema_is_enforced(tmp_path):
    w = commit.StageWriter(commit.fresh_temp_dir(tmp_path / "score"))
    with pytest.raises(schemas.SchemaError, match="missing columns \\['reward_message'\\]"):
        w.write_table("scores", _scores().drop_columns(["reward_message"]))


def test_a_table_is_written_in_its_schema_whether_it_came_in_it_or_not(tmp_path):
    """A table that already has its schema is written as it is (no cast); any other is cast to it,
    extra columns and reordered ones included; the file is the same either way. pins: a table
    with other types, other metadata or a column too many written as it came."""
    from tests.synthetic_run import rollouts_table

    conformed = schemas.conform("rollouts", rollouts_table(0, 4, 2, group_size=2, max_tokens=4))
    loose = pa.table({c: conformed[c].to_pylist() for c in reversed(conformed.column_names)})
    assert not loose.schema.equals(schemas.ROLLOUTS)  # inferred: int64 for int32, double for float
    tagged = conformed.replace_schema_metadata({"pandas": "{}"})
    paths = []
    for i, table in enumerate((conformed, loose, tagged)):
        out = schemas.conform("rollouts", table)
        assert out.schema.equals(schemas.ROLLOUTS, check_metadata=True) and out.equals(conformed)
        writer = commit.StageWriter(commit.fresh_temp_dir(tmp_path / str(i)))
        paths.append(writer.write_table("rollouts", table))
    assert paths[0].read_bytes() == paths[1].read_bytes() == paths[2].read_bytes()
    with pytest.raises(schemas.SchemaError, match="unexpected columns \\['extra'\\]"):
        schemas.conform("rollouts", conformed.append_column("extra", pa.array([0] * conformed.num_rows)))


def test_a_table_is_written_with_the_fixed_settings_and_kept_as_written(tmp_path):
    """The writer's settings are fixed (the same table, the same bytes): zstd for the columns of at
    least COMPRESS_BYTES (a list's values too), none for smaller ones, statistics, the Arrow schema
    stored, dictionaries for the text columns alone; the table it wrote stays at hand (the resident
    score takes its generation's rollouts from there). pins: a setting dropped or changed, a list
    column's values left uncompressed, or the written table not kept."""
    import pyarrow.parquet as pq

    from tests.synthetic_run import rollouts_table

    writer = commit.StageWriter(commit.fresh_temp_dir(tmp_path / "generate"))
    table = rollouts_table(0, 512, 2, group_size=8, max_tokens=64)
    path = writer.write_table("rollouts", table)
    assert writer.written["rollouts"].equals(schemas.conform("rollouts", table))
    meta = pq.ParquetFile(path).metadata.row_group(0)
    columns = {meta.column(i).path_in_schema.split(".")[0]: meta.column(i) for i in range(meta.num_columns)}
    written = writer.written["rollouts"]
    big = {name for name in columns if written[name].nbytes >= commit.COMPRESS_BYTES}
    assert {"response_ids", "logprobs"} <= big and "iteration" not in big
    assert {name for name, c in columns.items() if c.compression == "ZSTD"} == big
    assert all(c.statistics is not None for c in columns.values())
    dictionary = {name for name, c in columns.items() if "RLE_DICTIONARY" in c.encodings}
    assert dictionary == {f.name for f in schemas.ROLLOUTS if f.type == pa.string()}
    assert b"ARROW:schema" in pq.ParquetFile(path).metadata.metadata


def test_commit_moves_the_staged_directory_into_place_and_does_not_copy_it(tmp_path):
    """Pins: the rename replaced by a copy of the temporary directory followed by its deletion.
    A copy is not atomic (a reader can see the manifest before the data); a rename keeps the
    directory and its files (the same inodes), and a failed rename commits nothing."""
    d = tmp_path / "iter_000000" / "score"
    w = commit.StageWriter(commit.fresh_temp_dir(d))
    table_path = w.write_table("scores", _scores())
    inodes = (w.dir.stat().st_ino, table_path.stat().st_ino)
    commit.commit(d, w, {"stage": "score"})
    assert (d.stat().st_ino, (d / "scores.parquet").stat().st_ino) == inodes


def test_a_failed_rename_commits_nothing(tmp_path, monkeypatch):
    """Pins: any commit that does not go through one rename (copy, or copy then rename)."""
    d = tmp_path / "score"
    w = commit.StageWriter(commit.fresh_temp_dir(d))
    w.write_table("scores", _scores())

    def refuse(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(commit.os, "rename", refuse)
    with pytest.raises(OSError, match="Input/output error"):
        commit.commit(d, w, {"stage": "score"})
    assert not commit.is_committed(d) and not d.exists()
    assert (w.dir / "scores.parquet").is_file()  # the attempt's work is still in its temporary directory


def test_commit_itself_refuses_a_committed_stage(tmp_path):
    """Pins: commit() without its own refusal to overwrite. A second attempt that staged its
    files before the first one committed (it passed fresh_temp_dir earlier) must not replace the
    committed output at its rename."""
    d = tmp_path / "score"
    _commit(d, _scores())
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    late = commit.StageWriter(tmp_path / "late-attempt")
    late.dir.mkdir()
    late.write_table("scores", _scores(5))
    with pytest.raises(commit.AlreadyCommittedError, match="is committed; it is never written again"):
        commit.commit(d, late, {"stage": "score"})
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert commit.read_table(d, "scores").num_rows == 3


def _hold_in_child(code: str) -> subprocess.Popen:
    """A child process that takes a lock, prints 'held' and waits to be killed."""
    proc = subprocess.Popen([sys.executable, "-c", code + "\nprint('held', flush=True)\nimport time\n"
                             "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_controller_is_refused_and_the_lock_survives_a_killed_holder(tmp_path):
    """A controller killed with SIGKILL (no cleanup runs) does not wedge the run: the kernel
    releases its flock, and the next controller takes the run."""
    run = RunDir.at(tmp_path)
    holder = _hold_in_child("from hpcrl.rundir import RunDir, RunLock\n"
                            f"RunLock(RunDir.at({str(tmp_path)!r})).acquire()")
    try:
        with pytest.raises(RunLockedError, match=rf"already driven by another controller \(pid {holder.pid}"):
            RunLock(run).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(run):
        with pytest.raises(RunLockedError):
            RunLock(run).acquire()


def _stage_lock_is_held(stage_dir) -> bool:
    fd = os.open(stage_dir.parent / f".{stage_dir.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_stage_attempt_killed_while_holding_its_lock_leaves_the_stage_to_the_next_attempt(tmp_path):
    """A stage job killed mid-attempt (SIGKILL, preemption) leaves its temporary directory and no
    lock: the next attempt replaces the leftovers and commits."""
    d = tmp_path / "iter_000000" / "score"
    holder = _hold_in_child(
        "from pathlib import Path\nfrom hpcrl import commit\n"
        f"d = Path({str(d)!r})\nlock = commit.stage_lock(d)\nlock.__enter__()\n"
        "(commit.fresh_temp_dir(d) / 'half-written.parquet').write_bytes(b'partial')")
    try:
        assert _stage_lock_is_held(d)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert not _stage_lock_is_held(d)
    with commit.stage_lock(d):
        _commit(d, _scores())
    assert sorted(p.name for p in d.iterdir()) == ["_COMMIT.json", "scores.parquet"]
    assert commit.verify(d) == []


class _Clock:
    """A perf_counter that moves only when the test says so."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_an_open_stage_holds_its_lock_until_a_later_commit_from_another_thread(tmp_path, monkeypatch):
    """The resident trainer's pattern: the body now, more of it and the commit later in a
    background thread. The lock is held in between (checked without blocking), the manifest's
    total counts both parts and not the wait between them, and a second attempt that waited for
    the lock finds the stage committed."""
    from hpcrl import stage
    from hpcrl.stage import OpenStage
    from tests.synthetic_run import write_config

    clock = _Clock()
    monkeypatch.setattr(stage, "time", types.SimpleNamespace(perf_counter=clock.perf_counter,
                                                             time=stage.time.time))
    root = tmp_path / "r"
    write_config(root, 1)
    first = OpenStage("score", root, 0, startup=0.0)

    def body(ctx):
        ctx.writer.write_table("scores", _scores())
        clock.now += 0.25

    first.run(body)
    clock.now += 30.0  # the wait between the parts
    assert _stage_lock_is_held(first.out) and not commit.is_committed(first.out)
    second: list[OpenStage] = []
    waiter = threading.Thread(target=lambda: second.append(OpenStage("score", root, 0, startup=0.0)))
    waiter.start()

    def later(ctx):
        ctx.writer.metrics["m"] = 2.0
        clock.now += 0.5

    committer = threading.Thread(target=lambda: (first.run(later), first.commit()))
    committer.start()
    committer.join()
    waiter.join()
    manifest = commit.read_manifest(first.out)
    assert manifest["metrics"] == {"m": 2.0} and manifest["tables"]["scores"]["rows"] == 3
    assert manifest["timings"]["total"] == 0.75
    assert second[0].ctx is None and second[0].manifest == manifest  # nothing to do, nothing overwritten
    assert not _stage_lock_is_held(first.out)


def test_a_failed_open_stage_releases_its_lock_and_commits_nothing(tmp_path):
    from hpcrl.stage import OpenStage
    from tests.synthetic_run import write_config

    root = tmp_path / "r"
    write_config(root, 1)
    attempt = OpenStage("score", root, 0, startup=0.0)
    assert _stage_lock_is_held(attempt.out)
    with pytest.raises(ZeroDivisionError):
        attempt.run(lambda ctx: 1 / 0)
    assert not commit.is_committed(attempt.out)
    assert not _stage_lock_is_held(attempt.out)
    retry = OpenStage("score", root, 0, startup=0.0)
    retry.run(lambda ctx: ctx.writer.write_table("scores", _scores()))
    assert retry.commit()["tables"]["scores"]["rows"] == 3


def test_verify_names_an_input_that_is_not_the_one_a_stage_was_computed_from(tmp_path):
    """Pins: the input digests a stage records were never checked. A generate output replaced
    after its score was committed makes the score's lineage wrong, and verify says so."""
    from hpcrl.stage import run_stage
    from tests.synthetic_run import write_config

    root = tmp_path / "r"
    write_config(root, 1)
    gen = root / "iter_000000" / "generate"
    _commit(gen, _scores())  # any committed output serves as the input here

    def body(ctx):
        ctx.input_dir("generate")
        ctx.writer.write_table("scores", _scores())

    run_stage("score", root, 0, body, startup=0.0)
    score = root / "iter_000000" / "score"
    assert commit.verify(score) == []
    (gen / commit.MANIFEST).rename(tmp_path / "moved")
    assert commit.verify(score) == [f"{score}: its input {gen} is not committed"]
    import shutil

    shutil.rmtree(gen)
    _commit(gen, _scores(4))
    assert commit.verify(score) == [f"{score}: computed from another {gen} than the one committed there now"]


def test_the_trainer_state_is_checksummed_and_checked_before_anything_loads_it(tmp_path):
    """Pins: the DeepSpeed state (which loading unpickles) outside the manifest's checksums, and a
    policy or trainer state loaded without checking them."""
    d = tmp_path / "iter_000000" / "update"
    w = commit.StageWriter(commit.fresh_temp_dir(d))
    files = {"policy/model.safetensors": b"weights", "trainer/state/mp_rank_00_model_states.pt": b"ds",
             "trainer/critic/state/optim.pt": b"adam"}
    for rel, data in files.items():
        (w.dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (w.dir / rel).write_bytes(data)
    manifest = commit.commit(d, w, {"stage": "update"})
    assert "trainer/state/mp_rank_00_model_states.pt" in manifest["files"]
    assert commit.verified(d / "trainer") == d / "trainer" and commit.verified(d / "policy") == d / "policy"
    assert commit.verified(tmp_path / "base-model") == tmp_path / "base-model"  # not a stage output: as is
    (d / "trainer" / "critic" / "state" / "optim.pt").write_bytes(b"evil")
    with pytest.raises(commit.CorruptOutputError, match=r"critic/state/optim\.pt: checksum mismatch"):
        commit.verified(d / "trainer")
    assert commit.verified(d / "policy") == d / "policy"  # only what is loaded is checked
    (d / "policy" / "model.safetensors").unlink()
    with pytest.raises(commit.CorruptOutputError, match=r"policy/model\.safetensors: missing"):
        commit.verified(d / "policy")
    with pytest.raises(commit.CorruptOutputError, match=r"critic: no files of it are listed"):
        commit.verified(d / "critic")


def test_the_manifest_records_what_was_committed_in_a_stable_form(tmp_path):
    """Pins: the manifest written unsorted or unindented (the same output giving other bytes, so
    another digest: the identity the consumers record), `committed_at` missing, a table's schema
    name lost, and the digest's "sha256:" prefix."""
    import hashlib
    import json
    import time

    d = tmp_path / "iter_000000" / "score"
    before = time.time()
    manifest = _commit(d, _scores())
    text = (d / commit.MANIFEST).read_text()
    assert text == json.dumps(manifest, indent=2, sort_keys=True)
    assert before <= manifest["committed_at"] <= time.time()
    assert manifest["tables"] == {"scores": {"file": "scores.parquet", "rows": 3, "schema": "scores"}}
    assert manifest["metrics"] == {"m": 1.0} and manifest["stage"] == "score"
    assert commit.manifest_digest(d) == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    data = (d / "scores.parquet").read_bytes()
    assert manifest["files"]["scores.parquet"] == {"bytes": len(data),
                                                   "sha256": hashlib.sha256(data).hexdigest()}
    assert commit._checksums(d) == manifest["files"]  # every file but the manifest itself, which sorts first


def test_a_table_written_under_another_schema_records_that_schema(tmp_path):
    """Pins: the manifest's "schema" of a table written under another stage-contract schema (the
    update's stats) recorded as the table's own name, or as the name when none is given."""
    w = commit.StageWriter(commit.fresh_temp_dir(tmp_path / "score"))
    w.write_table("rescored", _scores(2), "scores")
    w.write_table("scores", _scores(1))
    assert w.tables == {"rescored": {"file": "rescored.parquet", "rows": 2, "schema": "scores"},
                        "scores": {"file": "scores.parquet", "rows": 1, "schema": "scores"}}


def test_the_codecs_name_every_column_chunk_of_every_contract_and_compress_from_the_threshold(tmp_path):
    """commit.compression names each Parquet leaf of every stage-contract table (a name pyarrow
    does not know leaves its chunk uncompressed, silently), and compresses a column of exactly
    COMPRESS_BYTES; a codec given to write_parquet overrides them. pins: a list's or a map's leaf
    path misspelt, a new nested type not handled, the threshold exclusive, the override ignored."""
    import pyarrow.parquet as pq

    for name, schema in schemas.TABLES.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(schema.empty_table(), path)
        meta = pq.ParquetFile(path).metadata
        leaves = {meta.schema.column(i).path for i in range(meta.num_columns)}
        assert set(commit.compression(schema.empty_table())) == leaves, name
    n = commit.COMPRESS_BYTES // 8
    exact = pa.table({"a": pa.array(range(n), pa.int64()), "b": pa.array(range(n), pa.int32())})
    assert exact["a"].nbytes == commit.COMPRESS_BYTES
    assert commit.compression(exact) == {"a": "zstd", "b": "none"}
    assert commit.compression(exact.slice(1)) == {"a": "none", "b": "none"}
    commit.write_parquet(exact, tmp_path / "zstd.parquet", "zstd")  # a benchmark's reference codec
    every = pq.ParquetFile(tmp_path / "zstd.parquet").metadata.row_group(0)
    assert {every.column(i).compression for i in range(every.num_columns)} == {"ZSTD"}


def test_tables_are_written_with_the_fixed_parquet_settings(tmp_path):
    """Pins: the writer settings that make a table's file what readers rely on: zstd compression
    of large columns (a map's keys and values too), column statistics (row-group filtering),
    dictionary encoding, and the Arrow schema stored in the file (the contract's exact types on
    read). Any of them dropped to another value changes the bytes of every output."""
    import pyarrow.parquet as pq

    w = commit.StageWriter(commit.fresh_temp_dir(tmp_path / "score"))
    path = w.write_table("scores", _scores(2048))
    meta = pq.ParquetFile(path).metadata
    split = meta.row_group(0).column(0)
    assert split.path_in_schema == "split"
    assert split.compression == "ZSTD" and split.is_stats_set and "RLE_DICTIONARY" in split.encodings
    chunks = [meta.row_group(0).column(i) for i in range(meta.num_columns)]
    components = {c.path_in_schema.split(".", 1)[1]: c.compression for c in chunks
                  if c.path_in_schema.startswith("reward_components.")}
    assert components == {"key_value.key": "ZSTD", "key_value.value": "ZSTD"}
    small = pq.ParquetFile(w.write_table("scores", _scores())).metadata.row_group(0)
    assert {small.column(i).compression for i in range(small.num_columns)} == {"UNCOMPRESSED"}
    assert b"ARROW:schema" in meta.metadata


def test_a_committed_table_reads_back_whole_in_a_process_that_never_imports_pyarrow_dataset(tmp_path):
    """Pins: commit.read_table going through pq.read_table, whose dataset layer costs each process
    that reads a table about 0.25 s to import, or a read that loses the map column's types."""
    d = tmp_path / "score"
    _commit(d, _scores())
    code = ("import sys; from pathlib import Path; from hpcrl import commit; "
            f"t = commit.read_table(Path({str(d)!r}), 'scores'); "
            "print(t.num_rows, t.schema.field('reward_components').type.equals(commit.schemas.SCORES"
            ".field('reward_components').type), 'pyarrow.dataset' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["3", "True", "False"]


def test_read_table_reads_the_columns_asked_for_and_refuses_a_missing_or_unlisted_file(tmp_path):
    """Pins: `columns` not passed to the reader, a column the file lacks left out without an error,
    a missing table named without the ones there are,
    and a table file that is gone (or not in the manifest's files) read as if it were sound, or
    failing with another error than CorruptOutputError."""
    import json

    d = tmp_path / "score"
    _commit(d, _scores())
    assert commit.read_table(d, "scores", columns=["reward"]).column_names == ["reward"]
    with pytest.raises(pa.ArrowInvalid, match=r"scores\.parquet: has no column 'kept', 'round' \(has split,"):
        commit.read_table(d, "scores", columns=["reward", "kept", "round"])
    with pytest.raises(commit.CorruptOutputError, match=r"has no table 'rollouts' \(has \['scores'\]\)"):
        commit.read_table(d, "rollouts")
    assert commit.read_table(d, "scores", check=False).num_rows == 3
    manifest = json.loads((d / commit.MANIFEST).read_text())
    del manifest["files"]["scores.parquet"]
    (d / commit.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(commit.CorruptOutputError,
                       match=r"scores\.parquet: checksum mismatch with .*_COMMIT\.json"):
        commit.read_table(d, "scores")
    (d / "scores.parquet").unlink()
    with pytest.raises(commit.CorruptOutputError, match=r"scores\.parquet: checksum mismatch"):
        commit.read_table(d, "scores")


def test_fresh_temp_dir_refuses_a_committed_stage_and_says_why(tmp_path):
    """Pins: the refusal to start an attempt at a committed stage without naming the stage and the
    rule (it is never written again)."""
    d = tmp_path / "score"
    _commit(d, _scores())
    with pytest.raises(commit.AlreadyCommittedError, match=rf"^{d} is committed; it is never written again$"):
        commit.fresh_temp_dir(d)


@pytest.mark.parametrize(("content", "what"), [(b'{"stage": ', "not valid JSON"),
                                               (b"\xff\xfe{}", "not valid JSON"),
                                               (b"[1, 2]", "expected a JSON object, found a list")])
def test_a_damaged_manifest_is_named_with_what_to_do(tmp_path, content, what):
    """Pins: a damaged manifest (truncated, not UTF-8, not an object) reported without its path,
    what is wrong with it, or the way out (restore it, or move the stage aside and run it again)."""
    d = tmp_path / "score"
    _commit(d, _scores())
    (d / commit.MANIFEST).write_bytes(content)
    with pytest.raises(commit.CorruptOutputError) as err:
        commit.read_manifest(d)
    assert str(err.value).startswith(f"{d / commit.MANIFEST}: damaged, {what}")
    assert str(err.value).endswith("; restore it from a backup, or move the stage directory aside to run "
                                   "the stage again")
    with pytest.raises(commit.CorruptOutputError, match="see the runbook$"):
        commit.read_json_object(d / commit.MANIFEST, "see the runbook")


def _committed_input(run_root, iteration: int, stage: str, rows: int = 3):
    d = run_root / f"iter_{iteration:06d}" / stage
    _commit(d, _scores(rows))
    return d


def test_lineage_reads_the_manifest_it_is_given_and_skips_absent_inputs_only_when_told(tmp_path):
    """Pins: lineage that reads the stage's manifest from disk when given one (or never reads it),
    that skips an absent input by default, skips an input that exists (stale or not), or stops at
    the first absent input instead of checking the others."""
    gen = _committed_input(tmp_path, 0, "generate")
    score = _committed_input(tmp_path, 0, "score")
    stale = {"generate@iter_000000": "sha256:0"}
    assert commit.lineage(score) == []  # its manifest records no input
    assert commit.lineage(score, {"inputs": stale}) == [
        f"{score}: computed from another {gen} than the one committed there now"]
    absent_first = {"inputs": {"a@iter_000000": "sha256:0", **stale}}  # "a" is not in the tree
    assert commit.lineage(score, absent_first, absent_ok=True) == [
        f"{score}: computed from another {gen} than the one committed there now"]
    assert commit.lineage(score, absent_first) == [
        f"{score}: its input {tmp_path / 'iter_000000' / 'a'} is not committed",
        f"{score}: computed from another {gen} than the one committed there now"]
    uncommitted = tmp_path / "iter_000001" / "score"
    assert commit.lineage(uncommitted, {"inputs": stale}) == [
        f"{uncommitted}: computed from another {gen} than the one committed there now"]
    assert commit.lineage(uncommitted) == []  # no manifest: nothing recorded


def test_verify_under_a_folder_checks_its_files_only_and_joins_every_problem(tmp_path):
    """Pins: verify(under=...) that also reports the whole output's lineage (a policy refused
    because an input of its update moved), and `verified` reporting only one of several problems."""
    d = tmp_path / "iter_000000" / "update"
    w = commit.StageWriter(commit.fresh_temp_dir(d))
    for rel in ("policy/a.bin", "policy/b.bin"):
        (w.dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (w.dir / rel).write_bytes(b"x")
    commit.commit(d, w, {"stage": "update", "inputs": {"generate@iter_000000": "sha256:0"}})
    assert commit.verify(d) == [f"{d}: its input {tmp_path / 'iter_000000' / 'generate'} is not committed"]
    assert commit.verify(d, "policy") == []
    (d / "policy" / "a.bin").unlink()
    (d / "policy" / "b.bin").write_bytes(b"y")
    with pytest.raises(commit.CorruptOutputError) as err:
        commit.verified(d / "policy")
    assert str(err.value) == (f"{d / 'policy' / 'a.bin'}: missing (listed in _COMMIT.json); "
                              f"{d / 'policy' / 'b.bin'}: checksum mismatch with _COMMIT.json")


def test_a_pruned_folder_is_reported_as_pruned_and_its_files_are_not_checked(tmp_path):
    """Pins (hpcrl.pruning's `_PRUNED.json`): a pruned folder reported as missing files, or
    verified silently; the pruned folder's name, rule and time wrong in the message, for a path one
    or more levels inside it; the folder found by another part of the path than its first."""
    import json
    import shutil

    d = tmp_path / "iter_000000" / "update"
    w = commit.StageWriter(commit.fresh_temp_dir(d))
    for rel in ("policy/model.bin", "trainer/state/rank/optim.pt", "trainer/critic/state/optim.pt"):
        (w.dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (w.dir / rel).write_bytes(b"x")
    commit.commit(d, w, {"stage": "update"})
    assert commit.pruned_parts(d) == {}
    record = {"rule": "keep_trainer_states = 1", "at": "2026-12-02T10:00:00", "bytes": 2}
    shutil.rmtree(d / "trainer")
    (d / commit.PRUNED).write_text(json.dumps({"trainer": record}))
    assert commit.pruned_parts(d) == {"trainer": record}
    message = f"{d / 'trainer'}: pruned by retention (keep_trainer_states = 1, at 2026-12-02T10:00:00)"
    assert commit.verify(d) == []  # the rest of the output is sound
    for under in ("trainer", "trainer/state", "trainer/critic/state"):
        assert commit.verify(d, under) == [message]
        with pytest.raises(commit.PrunedError) as err:
            commit.verified(d / under)
        assert str(err.value) == message
    assert commit.verified(d / "policy") == d / "policy"
    assert commit.pruned_message(d, "policy", {}) == f"{d / 'policy'}: pruned by retention (?, at ?)"


def test_a_manifest_is_read_as_utf8_whatever_the_jobs_locale(tmp_path):
    """Pins: the run directory's JSON read in the locale's encoding: a job started under LANG=C
    (ASCII) would call a manifest or run.json with a non-ASCII name damaged."""
    import json
    import locale

    path = tmp_path / "run.json"
    path.write_bytes(json.dumps({"name": "Zürich-run"}, ensure_ascii=False).encode("utf-8"))
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        assert commit.read_json_object(path) == {"name": "Zürich-run"}
    finally:
        locale.setlocale(locale.LC_CTYPE, old)


def test_the_data_and_the_manifest_reach_stable_storage_before_the_rename(tmp_path, monkeypatch):
    """Pins: a commit that fsyncs only its manifest, or renames before its fsyncs end. After a node
    crash the renamed directory and its manifest could then survive while the tables it lists did
    not (empty or partial files): a committed output that is lost. Every file and folder of the
    temporary directory, the manifest and the folder itself included, is synced before the rename,
    and the parent's entry after it."""
    d = tmp_path / "iter_000000" / "update"
    w = commit.StageWriter(commit.fresh_temp_dir(d))
    w.write_table("scores", _scores())
    (w.dir / "policy").mkdir()
    (w.dir / "policy" / "model.safetensors").write_bytes(b"weights")
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync", os.path.relpath(path, tmp_path), "renamed" if d.exists() else "before"))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename",))
        return real_rename(src, dst)

    monkeypatch.setattr(commit.os, "fsync", fsync)
    monkeypatch.setattr(commit.os, "rename", rename)
    commit.commit(d, w, {"stage": "update"})
    tmp = "iter_000000/.update.tmp"
    synced_first = {e[1] for e in events if e[0] == "fsync" and e[2] == "before"}
    assert synced_first == {f"{tmp}/scores.parquet", f"{tmp}/policy", f"{tmp}/policy/model.safetensors",
                            f"{tmp}/{commit.MANIFEST}", tmp}
    assert events[len(synced_first):] == [("rename",), ("fsync", "iter_000000", "renamed")]
    assert len(events) == len(synced_first) + 2  # each synced once
