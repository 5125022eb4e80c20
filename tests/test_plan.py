"""The order of a run's stages (hpcrl.plan): which iterations train, which validate, and which stage
comes next, from the config and the committed stage directories alone."""

from __future__ import annotations

from hpcrl import commit, plan
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir

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
