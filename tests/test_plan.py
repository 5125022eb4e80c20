"""The order of a run's stages (hpcrl.plan): which iterations train, which validate, and which stage
comes next, from the config and the committed stage directories alone; with staleness, which
policy version each generation samples with and which version a run resumes from."""

from __future__ import annotations

import shutil

import pytest

from hpcrl import commit, config, plan
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import GENERATE, SCORE, UPDATE

TRAIN = ("generate", "score", "update")
VALIDATE = ("generate", "score")


def _exp(iterations: int, eval_every: int, test: str = "test.parquet") -> Experiment:
    return Experiment(run={"iterations": iterations, "eval_every": eval_every}, model={"path": "m"},
                      data={"train": "train.parquet", "test": test})


def test_training_iterations_run_every_stage_and_the_last_iteration_only_validates():
    """pins: iteration N (after the last update) is validation only; iterations 0..N-1 train."""
    exp = _exp(iterations=3, eval_every=0)
    assert [plan.trains(exp, k) for k in range(5)] == [True, True, True, False, False]
    assert [plan.stages_of(exp, k) for k in range(5)] == [TRAIN, TRAIN, TRAIN, VALIDATE, ()]
    assert plan.all_stages(exp) == [(k, s) for k in range(3) for s in TRAIN] + [(3, "generate"), (3, "score")]


def test_validation_every_n_iterations_and_at_the_end():
    """pins: validation at multiples of eval_every (0 included) and always at iteration N; eval_every 0
    validates only at the end; no test set means no validation at all."""
    exp = _exp(iterations=5, eval_every=2)
    assert [plan.validates(exp, k) for k in range(6)] == [True, False, True, False, True, True]
    assert [plan.validates(_exp(5, 0), k) for k in range(7)] == [False] * 5 + [True, False]
    assert [plan.validates(_exp(5, 1), k) for k in range(6)] == [True] * 6
    assert not any(plan.validates(_exp(5, 2, test=""), k) for k in range(7))
    assert plan.all_stages(_exp(5, 2, test="")) == [(k, s) for k in range(5) for s in TRAIN]
    assert plan.stages_of(_exp(5, 2, test=""), 5) == ()
    # iteration 6 would validate by eval_every but lies beyond the run: all_stages stops at N
    assert plan.all_stages(_exp(5, 2))[-3:] == [(4, "update"), (5, "generate"), (5, "score")]


def test_pending_and_next_stage_follow_the_commits(tmp_path):
    """pins: a stage is pending until its directory holds a commit manifest; next_stage is the first
    pending one in run order, None once all are committed."""
    exp = _exp(iterations=1, eval_every=0)
    run = RunDir.at(tmp_path)
    assert plan.pending_stages(run, exp) == [(0, "generate"), (0, "score"), (0, "update"), (1, "generate"),
                                             (1, "score")]
    assert plan.next_stage(run, exp) == (0, "generate")

    def mark(k: int, stage: str) -> None:
        d = run.stage_dir(k, stage)
        d.mkdir(parents=True)
        (d / commit.MANIFEST).write_text("{}")

    mark(0, "generate")
    mark(0, "update")  # committed out of order: score is still the first pending stage
    assert plan.pending_stages(run, exp) == [(0, "score"), (1, "generate"), (1, "score")]
    assert plan.next_stage(run, exp) == (0, "score")
    for k, s in [(0, "score"), (1, "generate"), (1, "score")]:
        mark(k, s)
    assert plan.pending_stages(run, exp) == []
    assert plan.next_stage(run, exp) is None


def test_a_progress_checks_again_only_what_it_has_not_seen_committed(tmp_path, monkeypatch):
    """pins: Progress.pending equals a fresh look after every commit, and stats only the stages of
    existing iteration directories that it has not seen committed (a long run stays cheap)."""
    exp = _exp(iterations=3, eval_every=0)
    run = RunDir.at(tmp_path)
    progress = plan.Progress(run, exp)
    looked: list[tuple[int, str]] = []
    real = commit.is_committed
    monkeypatch.setattr(commit, "is_committed", lambda d: looked.append((int(d.parent.name[5:]), d.name))
                        or real(d))
    stages = plan.all_stages(exp)
    for i, (k, s) in enumerate(stages):
        assert progress.pending() == stages[i:]
        looked.clear()
        d = run.stage_dir(k, s)
        d.mkdir(parents=True)
        (d / commit.MANIFEST).write_text("{}")
        assert progress.pending() == stages[i + 1:]
        assert looked == [ks for ks in stages[i:] if ks[0] == k]  # not the committed, not absent iterations
    assert progress.pending() == [] and plan.pending_stages(run, exp) == []


# -- asynchronous generation (algorithm.max_staleness; tests/test_async.py runs it end to end) ------

def _stale_exp(tmp_path, iterations: int = 4, staleness: int = 1):
    from tests.synthetic_run import write_config

    exp = write_config(tmp_path / "cfg", iterations, eval_every=0)
    return config.with_overrides(exp, {"algorithm.max_staleness": str(staleness)}, "test")


def test_iteration_k_samples_with_version_k_minus_s_and_reads_the_update_that_made_it(tmp_path):
    """pins: a generate stage that samples with (or records as its input) the lock-step version."""
    for s, versions in ((0, [0, 1, 2, 3, 4]), (1, [0, 0, 1, 2, 4]), (2, [0, 0, 0, 1, 4])):
        exp = _stale_exp(tmp_path, staleness=s)
        # the final iteration trains nothing: it validates the final policy
        assert [plan.policy_version(exp, k) for k in range(5)] == versions, s
        assert plan.inputs(exp, 3, GENERATE) == ([(versions[3] - 1, UPDATE)] if versions[3] else [])
        assert plan.inputs(exp, 3, UPDATE) == [(3, GENERATE), (3, SCORE), (2, UPDATE)]
        assert plan.inputs(exp, 3, SCORE) == [(3, GENERATE)]
        assert plan.inputs(exp, 0, GENERATE) == []
        assert plan.inputs(exp, 0, UPDATE) == [(0, GENERATE), (0, SCORE)]
        assert plan.inputs(exp, 1, GENERATE) == ([(0, UPDATE)] if s == 0 else [])  # version 0: the base model
    with pytest.raises(ValueError, match="unknown stage 'nope'; expected one of generate, score, update"):
        plan.inputs(exp, 0, "nope")


def _run_with_policies(tmp_path, tiny_task, unsaved: set[int], absent: list[tuple[int, str]]) -> RunDir:
    """A synthetic run of 4 iterations whose updates 0..2 are committed, with versions in `unsaved`
    not saved (a resident run between checkpoints) and the stages in `absent` not committed."""
    from tests.synthetic_run import make_run

    run = make_run(tmp_path / "run", iterations=4, rows=16, eval_every=0, policy_from=tiny_task / "model")
    for d in (run.stage_dir(3, UPDATE), run.iteration_dir(4)):
        shutil.rmtree(d)
    for version in unsaved:
        shutil.rmtree(run.policy_dir(version, "") / "")
    for k, stage in absent:
        shutil.rmtree(run.stage_dir(k, stage))
        if not any(run.iteration_dir(k).iterdir()):
            run.iteration_dir(k).rmdir()
    return run


def test_a_run_resumes_from_a_version_its_pending_generations_can_sample_with(tmp_path, tiny_task):
    """pins: a resume from the latest saved version when a pending generation needs an older,
    unsaved one (it could never run), and a rollback that discards generations made with a
    version the run keeps."""
    exp = _stale_exp(tmp_path)
    run = _run_with_policies(tmp_path / "a", tiny_task, unsaved={2}, absent=[])
    assert plan.resume_version(run, exp) == 3  # generate 3 (version 2) is committed already
    assert plan.rollback(run, exp) == []
    run = _run_with_policies(tmp_path / "b", tiny_task, unsaved={2}, absent=[(3, SCORE), (3, GENERATE)])
    assert plan.resume_version(run, exp) == 1  # generate 3 needs version 2, which is gone
    moved = {str(p.relative_to(run.root)).split(".")[0] for p in plan.rollback(run, exp)}
    assert moved == {"iter_000001/update", "iter_000002/update"}
    assert commit.is_committed(run.stage_dir(2, GENERATE))  # sampled with version 1: kept
    assert run.latest_saved_version() == 1
    assert plan.pending_stages(run, exp)[:2] == [(1, UPDATE), (2, UPDATE)]
    run = _run_with_policies(tmp_path / "d", tiny_task, unsaved={1, 2}, absent=[(3, SCORE), (3, GENERATE)])
    assert plan.resume_version(run, exp) == 0  # no saved version but the base model serves
    run = _run_with_policies(tmp_path / "e", tiny_task, unsaved={1}, absent=[(2, SCORE), (2, GENERATE)])
    assert plan.resume_version(run, exp) == 3  # only the generations from version 3 on matter
    # the last version unsaved: lock-step discards the generation made with it, s = 1 keeps it
    lock_step = config.with_overrides(exp, {"algorithm.max_staleness": "0"}, "test")
    for e, kept in ((lock_step, False), (exp, True)):
        run = _run_with_policies(tmp_path / f"c{kept}", tiny_task, unsaved={3}, absent=[])
        assert plan.resume_version(run, e) == 2
        moved = {str(p.relative_to(run.root)).split(".")[0] for p in plan.rollback(run, e)}
        assert moved == {"iter_000002/update"} | (set() if kept else {"iter_000003"})
