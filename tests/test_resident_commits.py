"""The generations the resident generator commits behind it on a background thread
(hpcrl.resident_commits), with real stage attempts in a synthetic run directory (the whole
generator runs them in tests/test_async.py and tests/test_resident.py)."""

from __future__ import annotations

import threading

import pytest

from hpcrl import commit
from hpcrl.resident_commits import CommitsBehind
from hpcrl.rundir import RunDir
from hpcrl.stage import OpenStage
from tests.synthetic_run import write_config


def _writes(k: int, events: list, gate: threading.Event | None = None, fails: bool = False):
    """The rest of generation k's body: waits for `gate`, records where it ran, writes a metric."""
    def rest(ctx) -> None:
        if gate is not None:
            assert gate.wait(10)
        events.append((k, threading.current_thread().name))
        if fails:
            raise OSError(28, f"No space left on device writing generation {k}")
        ctx.writer.metrics["k"] = float(k)

    return rest


@pytest.fixture
def run(tmp_path) -> RunDir:
    root = tmp_path / "r"
    write_config(root, 4)
    return RunDir.at(root)


def test_a_generation_commits_behind_the_caller_in_order_and_a_wait_returns_once_it_has(run):
    """pins: a commit on the caller's thread (the engine would wait for the writes), commits out of
    the order handed over, or a wait that returns before the generation is committed (its score
    would read an uncommitted input)."""
    commits, events, gates = CommitsBehind(), [], {0: threading.Event(), 2: threading.Event()}
    for k in range(3):
        commits.submit(k, OpenStage("generate", run.root, k, startup=0.0), _writes(k, events, gates.get(k)))
    assert all(commits.handed(k) for k in range(3)) and not commits.handed(3)
    assert not any(commit.is_committed(run.stage_dir(k, "generate")) for k in range(3))  # held at the gate
    gates[0].set()
    commits.wait(1)
    assert commit.is_committed(run.stage_dir(1, "generate"))
    threading.Timer(0.3, gates[2].set).start()
    commits.wait()  # every one: generation 2 too, once released
    assert commit.is_committed(run.stage_dir(2, "generate"))
    commits.close()
    assert events == [(0, "hpcrl-commit_0"), (1, "hpcrl-commit_0"), (2, "hpcrl-commit_0")]
    assert commit.read_manifest(run.stage_dir(2, "generate"))["metrics"]["k"] == 2.0
    commits.check()  # nothing failed


def test_a_committed_generation_hands_its_tables_over_once_and_a_failed_one_none(run):
    """The score stage takes the rollouts as its generation committed them, not read back.
    pins: tables handed over before their commit, or of a commit that failed (a score of an
    uncommitted input), or kept after they were taken (a run's every generation in memory)."""
    from tests.synthetic_run import rollouts_table

    def rest(k: int):
        def write(ctx) -> None:
            ctx.writer.write_table("rollouts", rollouts_table(k, 4, 2, group_size=2, max_tokens=4))
            if k == 1:
                raise OSError(28, "No space left on device")
        return write

    commits, gate = CommitsBehind(), threading.Event()
    commits.submit(0, OpenStage("generate", run.root, 0, startup=0.0),
                   lambda ctx: (gate.wait(10), rest(0)(ctx)))
    assert commits.written(0) == {}  # not committed yet
    gate.set()
    commits.wait(0)
    written = commits.written(0)
    assert set(written) == {"rollouts"}
    assert written["rollouts"].equals(commit.read_table(run.stage_dir(0, "generate"), "rollouts"))
    assert commits.written(0) == {}  # taken once
    commits.submit(1, OpenStage("generate", run.root, 1, startup=0.0), rest(1))
    with pytest.raises(OSError):
        commits.wait(1)
    assert commits.written(1) == {}
    commits.close()


def test_after_a_failed_commit_none_commits_and_the_failure_reaches_the_caller(run):
    """pins: a failure lost on the thread, or a later generation committed after an earlier one
    failed; the failed attempt releases its stage lock, so a resumed run can redo it."""
    commits, events = CommitsBehind(), []
    for k in range(3):
        commits.submit(k, OpenStage("generate", run.root, k, startup=0.0), _writes(k, events, fails=k == 1))
    with pytest.raises(OSError, match="writing generation 1"):
        commits.wait(1)
    with pytest.raises(RuntimeError, match="the generation of iteration 2 was not committed: that of "
                                           "iteration 1 failed"):
        commits.wait(2)
    with pytest.raises(OSError, match="writing generation 1"):
        commits.check()
    commits.close()
    assert [k for k in range(3) if commit.is_committed(run.stage_dir(k, "generate"))] == [0]
    assert [k for k, _ in events] == [0, 1]  # generation 2's writes never ran
    for k in (1, 2):
        OpenStage("generate", run.root, k, startup=0.0).close()  # their locks were released


def test_after_an_error_closing_does_not_wait_for_a_commit_that_waits_on_the_trainers(run):
    """pins: the generator's error path blocked on a commit thread that waits for the trainers'
    commit signal, which may never come (the trainer waits for the generator): the job would hang
    instead of raising its failure flag. Closed normally, it waits."""
    commits, events, gate = CommitsBehind(), [], threading.Event()
    commits.submit(0, OpenStage("generate", run.root, 0, startup=0.0), _writes(0, events, gate))
    commits.submit(1, OpenStage("generate", run.root, 1, startup=0.0), _writes(1, events))
    commits.close(wait=False)  # returns with generation 0 held at its gate
    assert events == []
    gate.set()
    commits.close()
    assert events == [(0, "hpcrl-commit_0")]  # generation 1 was dropped, not started
