"""hpcrl.versions: which policy version a generation samples with, and the checks that the engine
holds it (staged generate, merged shards, the resident generator and its other engines). Fast: no
vLLM, stand-ins for the stage context and the engine."""

from __future__ import annotations

import collections
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcrl import versions
from hpcrl.commit import CorruptOutputError


class Ctx:
    """A generate stage's context as hpcrl.versions uses it: what it reads, and a log of its calls."""

    def __init__(self, iteration: int, iterations: int = 4, staleness: int = 0, parts=()):
        self.iteration = iteration
        self.exp = SimpleNamespace(run=SimpleNamespace(iterations=iterations),
                                   algorithm=SimpleNamespace(max_staleness=staleness))
        self.parts = list(parts)
        self.run = SimpleNamespace(stage_dir=lambda k, stage: Path("/runs/r") / f"iter_{k:06d}" / stage)
        self.log: list = []

    def input_dir(self, stage: str, iteration: int) -> None:
        self.log.append(("input", stage, iteration))

    @contextmanager
    def timed(self, phase: str):
        self.log.append(("enter", phase))
        yield
        self.log.append(("exit", phase))


# the version each iteration's generation samples with, worked out by hand: max(0, k - s) while
# training (4 iterations), the final policy (version 4) for the validation-only iteration 4
NEEDED = {0: [0, 1, 2, 3, 4], 1: [0, 0, 1, 2, 4], 2: [0, 0, 0, 1, 4], 5: [0, 0, 0, 0, 4]}


@pytest.mark.parametrize("staleness", sorted(NEEDED))
def test_a_generation_takes_only_the_version_its_iteration_samples_with(staleness):
    for k, needed in enumerate(NEEDED[staleness]):
        ctx = Ctx(k, staleness=staleness)
        versions.check_generate(ctx, needed, committed=False)
        assert ctx.log == []
        for wrong in (needed - 1, needed + 1):
            with pytest.raises(RuntimeError) as err:
                versions.check_generate(ctx, wrong, committed=True)
            assert str(err.value) == (f"generate of iteration {k} needs policy version {needed} "
                                      f"(algorithm.max_staleness = {staleness}), the engine holds {wrong}")
        assert ctx.log == []  # a refused version reads nothing


def test_a_committed_policy_names_the_update_that_made_it_at_once():
    ctx = Ctx(3, staleness=1)
    versions.check_generate(ctx, 2, committed=True)
    assert ctx.log == [("input", "update", 1)]
    base = Ctx(1, staleness=1)  # version 0, the base model: no update made it
    versions.check_generate(base, 0, committed=True)
    one = Ctx(1)  # version 1: made by the update of iteration 0
    versions.check_generate(one, 1, committed=True)
    assert (base.log, one.log) == ([], [("input", "update", 0)])


def test_an_uncommitted_policy_is_awaited_after_sampling_then_named():
    calls = []
    ctx = Ctx(3)

    def await_policy():
        calls.append("await")
        ctx.log.append("awaited")

    versions.await_update(ctx, 3, await_policy)
    assert ctx.log == [("enter", "wait"), "awaited", ("exit", "wait"), ("input", "update", 2)]
    assert calls == ["await"]
    for version, wait in ((3, None), (0, await_policy), (0, None)):  # committed already, or the base model
        quiet = Ctx(3)
        versions.await_update(quiet, version, wait)
        assert quiet.log == [], (version, wait)
    one = Ctx(1)
    versions.await_update(one, 1, lambda: None)
    assert one.log == [("enter", "wait"), ("exit", "wait"), ("input", "update", 0)]
    assert calls == ["await"]


def test_merged_shards_must_agree_on_their_version():
    assert versions.shards_version(Ctx(2, parts=[{"policy_version": 1}] * 3)) == 1
    assert versions.shards_version(Ctx(2, parts=[{"policy_version": 0}])) == 0
    for parts, found in (([4, 3, 4], "[3, 4]"), ([], "[]")):
        ctx = Ctx(2, parts=[{"policy_version": v} for v in parts])
        with pytest.raises(CorruptOutputError) as err:
            versions.shards_version(ctx)
        assert str(err.value) == (f"the shards of /runs/r/iter_000002/generate sampled with different "
                                  f"policy versions {found}")


class Engine:
    """The resident generator's engine and its updates in flight, as `versions.hold` drives them."""

    def __init__(self, holds: int, inflight: list[int]):
        self.version, self.inflight, self.log = holds, collections.deque(inflight), []

    def load_saved(self, version: int) -> None:
        self.log.append(("load", version))
        self.version = version

    def finish_update(self) -> None:
        k = self.inflight.popleft()
        self.log.append(("finish", k))
        self.version = k + 1  # the update of iteration k makes version k + 1

    def hold(self, version: int, base: int) -> None:
        versions.hold(version, base, lambda: self.version, self.inflight, self.load_saved, self.finish_update)


def test_the_engine_finishes_the_updates_in_flight_up_to_the_version_and_no_further():
    e = Engine(holds=0, inflight=[0, 1, 2])
    e.hold(2, base=0)
    assert (e.version, e.log, list(e.inflight)) == (2, [("finish", 0), ("finish", 1)], [2])
    e.hold(2, base=0)  # held already: nothing more
    assert (e.version, len(e.log), list(e.inflight)) == (2, 2, [2])
    e.hold(3, base=0)
    assert (e.version, e.log[2:], list(e.inflight)) == (3, [("finish", 2)], [])


def test_a_resumed_run_loads_saved_versions_up_to_the_trainers_start():
    e = Engine(holds=3, inflight=[])
    e.hold(1, base=3)  # older than the trainers' start: read from the run directory
    assert (e.version, e.log) == (1, [("load", 1)])
    e.hold(3, base=3)  # the start itself (equal to base) too
    assert (e.version, e.log[1:]) == (3, [("load", 3)])
    e = Engine(holds=3, inflight=[3])
    e.hold(4, base=3)  # past it: from the update in flight, nothing read from disk
    assert (e.version, e.log, list(e.inflight)) == (4, [("finish", 3)], [])


def test_a_version_no_update_in_flight_makes_is_refused():
    e = Engine(holds=1, inflight=[1])
    with pytest.raises(RuntimeError) as err:
        e.hold(3, base=0)
    assert str(err.value) == ("the generation needs policy version 3; the engine holds 2 and no update in "
                              "flight makes it")
    assert e.log == [("finish", 1)]
    older = Engine(holds=2, inflight=[2])  # a version it has left behind, after the trainers' start
    with pytest.raises(RuntimeError, match="needs policy version 1; the engine holds 2 and"):
        older.hold(1, base=0)
    assert (older.log, list(older.inflight)) == ([], [2])


def test_a_generation_waits_only_for_the_uncommitted_update_that_made_its_version():
    assert versions.made_by(3, {2}) == 2
    assert versions.made_by(3, {0, 1, 3, 4}) is None  # committed: no wait
    assert versions.made_by(1, {0}) == 0
    assert versions.made_by(0, set()) is None  # the base model
    waited = []
    for update in (0, 5):
        wait = versions.awaiting(update, waited.append)
        assert callable(wait) and waited == ([] if update == 0 else [0])  # waits only when called
        wait()
    assert waited == [0, 5]
    assert versions.awaiting(None, waited.append) is None


def test_another_engine_refuses_a_generation_of_another_version():
    versions.check_engine(2, 3, 3, 7)
    for held in (2, 4, None):
        with pytest.raises(RuntimeError) as err:
            versions.check_engine(2, held, 3, 7)
        assert str(err.value) == (f"engine 2 holds policy version {held}; the generation of iteration 7 "
                                  "needs 3")


def test_the_resident_generator_holds_the_version_and_awaits_its_update():
    """hpcrl.resident_generator.Generator._hold wired to hpcrl.versions: a stand-in generator
    (no engine, no control plane) whose update 0 is in flight and not committed."""
    from hpcrl.resident_generator import Generator

    signals = []
    g = Generator.__new__(Generator)
    g.base, g.inflight, g.uncommitted, g.beside = 0, collections.deque([(0, 17)]), {0}, None
    g.gen = SimpleNamespace(version=0, await_policy=None)
    g.plane = SimpleNamespace(wait_signal=signals.append)
    g._finish_update = lambda: (g.inflight.popleft(), setattr(g.gen, "version", 1))
    g._hold(1)
    assert (g.gen.version, g.made_by, list(g.inflight)) == (1, 0, [])
    assert signals == []
    g.gen.await_policy()
    assert (signals, g.uncommitted) == (["committed/0"], set())
    g._hold(1)  # committed now: no wait
    assert (g.made_by, g.gen.await_policy) == (None, None)


def test_the_resident_generator_leaves_a_handed_over_score_and_its_update_to_the_scoring_thread():
    """hpcrl.resident_generator.Generator with scores beside its generations (hpcrl.resident_scores):
    its next stage skips the score it handed over and that score's update (pins commanding it
    twice) and a generation whose commit it handed to its commit thread (pins sampling it twice;
    hpcrl.resident_commits), and holding the version that update makes waits for the thread to
    command it (pins a hold that finds no update in flight and fails)."""
    import threading

    from hpcrl.resident_generator import Generator
    from hpcrl.resident_scores import BesideScores

    release = threading.Event()
    g = Generator.__new__(Generator)
    g.base, g.inflight, g.uncommitted, g.started = 0, collections.deque(), set(), set()
    g.gen = SimpleNamespace(version=0, await_policy=None)
    g.beside = BesideScores(lambda k: release.wait(10), lambda k: 40 + k, lambda k: True)
    g.progress = SimpleNamespace(pending=lambda: [(0, "score"), (0, "update"), (1, "generate"), (1, "score")])
    g._finish_update = lambda: (g.inflight.popleft(), setattr(g.gen, "version", 1))
    g.commits = SimpleNamespace(handed=lambda k: False)
    g.beside.submit(0)
    assert g._next_stage() == (1, "generate")
    g.commits = SimpleNamespace(handed=lambda k: k == 1)  # sampled; its writes and commit on the thread
    assert g._next_stage() == (1, "score")
    threading.Timer(0.2, release.set).start()
    g._hold(1)  # version 1: update 0's, commanded by the thread once score 0 is done
    assert (g.gen.version, g.started, g.uncommitted, g.made_by) == (1, {0}, {0}, 0)
    g.beside.close()


def test_another_engine_checks_its_version_and_awaits_the_update(monkeypatch):
    from hpcrl import resident_engines

    signals, claimed = [], []
    e = resident_engines.Engine.__new__(resident_engines.Engine)
    e.index, e.run = 1, None
    e.gen = SimpleNamespace(version=2, await_policy=None)
    e.plane = SimpleNamespace(wait_signal=signals.append)
    monkeypatch.setattr(resident_engines, "claim_shards", lambda *args: claimed.append(args) or [1, 3])
    reply = e._generate({"iteration": 4, "version": 2, "await": 1, "claim": "claim/generate/4"})
    assert reply == {"shards": [1, 3]} and claimed == [(e.plane, e.gen, None, 4, 1, "claim/generate/4")]
    e.gen.await_policy()
    assert signals == ["committed/1"]
    with pytest.raises(RuntimeError, match="engine 1 holds policy version 2; the generation of iteration 5"):
        e._generate({"iteration": 5, "version": 3, "await": None, "claim": "c"})
    assert len(claimed) == 1


@pytest.mark.parametrize(("staleness", "presend", "colocate", "overlap", "behind"), [
    (0, False, False, True, True),  # lock-step: the commit runs while the next generation samples
    (0, False, False, False, False),  # executor.resident.overlap_commit off
    (0, False, True, True, False),  # colocated: before the trainers' state leaves the GPU
    (1, False, False, True, False),  # a send the generator asks for: the commit fills the wait for it
    (1, True, False, True, True),  # sent as soon as the update ends: the commit does not hold it back
    (2, True, False, False, False),
    (1, True, True, True, False),
])
def test_the_trainers_commit_after_the_send_where_nothing_waits_for_the_commit(staleness, presend, colocate,
                                                                              overlap, behind):
    """hpcrl.resident_sync.commits_behind, which the trainers and the generator both follow (the
    generator then awaits the commit only when a generation of that version commits)."""
    from hpcrl import resident_sync

    exp = SimpleNamespace(algorithm=SimpleNamespace(max_staleness=staleness),
                          executor=SimpleNamespace(resident=SimpleNamespace(overlap_commit=overlap,
                                                                            colocate=colocate)))
    assert resident_sync.commits_behind(exp, presend) is behind
