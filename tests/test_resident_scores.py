"""The score stages the resident generator runs on a thread beside its generations
(hpcrl.resident_scores), with fakes for the stage and the command (the real ones run in
tests/test_demos.py's asynchronous demo and tests/test_async.py's killed and resumed run), and the
control plane's commands sent from two threads at once over a real TCPStore."""

from __future__ import annotations

import threading
import time

import pytest

from hpcrl.resident_scores import BesideScores


class Recorder:
    """The stage and command functions: what ran, in order, on which thread; a score can be held
    until released, or made to fail."""

    def __init__(self, last: int = 99, fails: int | None = None):
        self.events: list[tuple] = []
        self.gates: dict[int, threading.Event] = {}
        self.last, self.fails = last, fails
        self.seq = 0

    def score(self, k: int) -> None:
        if k in self.gates:
            self.gates[k].wait(10)
        self.events.append(("score", k, threading.current_thread().name))
        if k == self.fails:
            raise OSError(f"disk full scoring {k}")

    def command(self, k: int) -> int:
        self.seq += 1
        self.events.append(("update", k))
        return self.seq

    def scores(self) -> BesideScores:
        return BesideScores(self.score, self.command, lambda k: k < self.last)


def test_each_update_is_commanded_once_its_score_commits_in_order_on_one_thread():
    """pins: an update commanded before its score committed, scores out of iteration order, or an
    update commanded for the final, validation-only iteration."""
    rec = Recorder(last=2)
    beside = rec.scores()
    for k in range(3):
        beside.submit(k)
    assert beside.collect(until=2) == [(0, 1), (1, 2)]
    beside.close()
    assert [e[:2] for e in rec.events] == [("score", 0), ("update", 0), ("score", 1), ("update", 1),
                                           ("score", 2)]
    assert {e[2] for e in rec.events if e[0] == "score"} == {"hpcrl-score_0"}  # one thread, not the caller's


def test_a_score_waits_for_the_one_before_and_closing_waits_for_the_running_one_only():
    """pins: scores on more than one thread (score 1 would run, and command its update, while score
    0 is still running), or a close that returns before the running score ends or runs those queued
    behind it (the job would end with a score thread still writing)."""
    rec = Recorder()
    rec.gates[0] = threading.Event()
    beside = rec.scores()
    beside.submit(0)
    beside.submit(1)
    time.sleep(0.3)
    assert rec.events == []  # score 1 waits behind the held score 0
    threading.Timer(0.3, rec.gates[0].set).start()
    beside.close()
    assert [e[:2] for e in rec.events] == [("score", 0), ("update", 0)]


def test_the_generator_owns_no_update_whose_score_it_handed_over_until_it_collects_it():
    """pins: the generator's thread commanding an update the scoring thread commands too (twice
    over), or waiting on scores it does not need (collect without `until` never blocks)."""
    rec = Recorder()
    rec.gates[1] = threading.Event()
    beside = rec.scores()
    beside.submit(0)
    beside.submit(1)
    assert beside.owns(0) and beside.owns(1) and not beside.owns(2)
    t0 = time.monotonic()
    got = beside.collect(until=0)  # score 1 is still held
    assert got == [(0, 1)] and time.monotonic() - t0 < 5
    assert not beside.owns(0) and beside.owns(1)
    assert beside.collect() == []  # score 1 still held: nothing blocks
    rec.gates[1].set()
    assert beside.collect(until=1) == [(1, 2)] and not beside.owns(1)
    beside.close()


def test_a_failed_score_raises_in_the_generator_and_no_later_update_is_commanded():
    """pins: a score error lost on the thread (the job would wait for an update never commanded),
    or a later score that commands its update although the failed one's never was (the trainers
    would update from the wrong policy)."""
    rec = Recorder(fails=1)
    beside = rec.scores()
    for k in range(3):
        beside.submit(k)
    with pytest.raises(OSError, match="disk full scoring 1"):
        beside.collect(until=1)
    with pytest.raises(RuntimeError, match="iteration 2 did not run: that of iteration 1 failed"):
        beside.collect(until=2)
    beside.close()
    assert [e[:2] for e in rec.events] == [("score", 0), ("update", 0), ("score", 1)]


def test_commands_sent_from_two_threads_keep_distinct_numbers_in_order():
    """pins (ControlPlane.send): two threads numbering commands without a lock (one number twice, a
    command lost), or the scoring thread sending on the main connection while it waits."""
    from hpcrl.distributed import free_port
    from hpcrl.roles import ControlPlane, Layout

    port = free_port()
    trainer = ControlPlane("127.0.0.1", port, 0, Layout(1), timeout_s=30, secret=b"k")
    generator = ControlPlane("127.0.0.1", port, 1, Layout(1), timeout_s=30, secret=b"k")
    seqs: dict[str, list[int]] = {"main": [], "thread": []}

    def send(who: str) -> None:
        for i in range(40):
            seqs[who].append(generator.send({"who": who, "i": i}))

    thread = threading.Thread(target=send, args=("thread",))
    thread.start()
    send("main")
    thread.join(timeout=30)
    assert sorted(seqs["main"] + seqs["thread"]) == list(range(1, 81))
    got = [trainer.receive() for _ in range(80)]
    for who in ("main", "thread"):  # each thread's commands arrive in the order it sent them
        assert [c["i"] for c in got if c["who"] == who] == list(range(40))


def test_after_an_error_closing_does_not_wait_for_the_running_score():
    """pins: the generator's error path blocked on a score that waits for its generation's commit,
    which waits on the trainers (hpcrl.resident_commits): the job would hang instead of raising its
    failure flag."""
    rec = Recorder()
    rec.gates[0] = threading.Event()
    beside = rec.scores()
    beside.submit(0)
    beside.submit(1)
    beside.close(wait=False)  # score 0 still held at its gate
    assert rec.events == []
    rec.gates[0].set()
    beside.close()
    assert [e[:2] for e in rec.events] == [("score", 0), ("update", 0)]  # score 1 dropped, not started
