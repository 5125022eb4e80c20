"""Stage outputs are committed atomically, never overwritten, and checked on read."""

import pyarrow as pa
import pytest

from hpcrl import commit, schemas
from hpcrl.rundir import RunDir, RunLock, RunLockedError


def _scores(n=3):
    return pa.table({"split": ["train"] * n, "prompt_index": list(range(n)), "sample_index": [0] * n,
                     "reward": [1.0] * n, "reward_components": pa.array([[("a", 1.0)]] * n, pa.map_(pa.string(), pa.float64())),
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


def test_second_controller_is_refused_and_lock_survives_a_crash(tmp_path):
    run = RunDir.at(tmp_path)
    with RunLock(run):
        with pytest.raises(RunLockedError, match=r"already driven by another controller \(pid \d+"):
            RunLock(run).acquire()
    with RunLock(run):  # released on exit; a crashed holder's flock is released by the kernel
        pass


def test_an_open_stage_holds_its_lock_until_a_later_commit_from_another_thread(tmp_path):
    """The resident trainer's pattern: the body now, more of it and the commit later in a
    background thread; a second attempt waits for the lock and then finds the stage committed."""
    import threading
    import time

    from hpcrl.stage import OpenStage
    from tests.synthetic_run import write_config

    root = tmp_path / "r"
    write_config(root, 1)
    first = OpenStage("score", root, 0, startup=0.0)
    first.run(lambda ctx: (ctx.writer.write_table("scores", _scores()), time.sleep(0.2)))
    second: list[OpenStage] = []
    waiter = threading.Thread(target=lambda: second.append(OpenStage("score", root, 0, startup=0.0)))
    waiter.start()
    time.sleep(0.3)
    assert not second and not commit.is_committed(first.out)  # the lock is still held

    def later(ctx):
        ctx.writer.metrics["m"] = 2.0
        time.sleep(0.2)

    committer = threading.Thread(target=lambda: (first.run(later), first.commit()))
    committer.start()
    committer.join()
    waiter.join(timeout=10)
    manifest = commit.read_manifest(first.out)
    assert manifest["metrics"] == {"m": 2.0} and manifest["tables"]["scores"]["rows"] == 3
    assert 0.4 <= manifest["timings"]["total"] < 1.0  # both parts, not the wait between them
    assert second[0].ctx is None and second[0].manifest == manifest  # nothing to do, nothing overwritten


def test_a_failed_open_stage_releases_its_lock_and_commits_nothing(tmp_path):
    from hpcrl.stage import OpenStage
    from tests.synthetic_run import write_config

    root = tmp_path / "r"
    write_config(root, 1)
    attempt = OpenStage("score", root, 0, startup=0.0)
    with pytest.raises(ZeroDivisionError):
        attempt.run(lambda ctx: 1 / 0)
    assert not commit.is_committed(attempt.out)
    retry = OpenStage("score", root, 0, startup=0.0)  # would block forever if the lock were held
    retry.run(lambda ctx: ctx.writer.write_table("scores", _scores()))
    assert retry.commit()["tables"]["scores"]["rows"] == 3
