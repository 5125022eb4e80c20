"""A restarted controller adopts the live jobs of its run (hpcrl.adoption): what Slurm still runs
for the first pending stages is waited for, never submitted again."""

from __future__ import annotations

import shutil

from hpcrl import adoption, config, executors, plan
from hpcrl.controller import Controller

PENDING = [(1, "generate"), (1, "score"), (1, "update"), (2, "generate")]


def _record(job_id: str, role: str, iteration: int | None) -> dict:
    return {"job_id": job_id, "role": role, "iteration": iteration, "submitted": 0.0}


def test_the_live_jobs_of_the_first_pending_stages_are_adopted_in_order():
    records = [_record("10", "generate", 1), _record("11", "score", 1), _record("12", "update", 1)]
    adopt, cancel = adoption.plan(PENDING, records, {"10": "RUNNING", "11": "PENDING", "12": "PENDING"})
    assert [r["job_id"] for r in adopt] == ["10", "11", "12"] and cancel == []


def test_a_live_job_behind_a_stage_without_one_is_cancelled():
    # generate 1 failed; score and update 1 wait on it (afterok) for ever
    records = [_record("10", "generate", 1), _record("11", "score", 1), _record("12", "update", 1)]
    adopt, cancel = adoption.plan(PENDING, records, {"10": "FAILED", "11": "PENDING", "12": "PENDING"})
    assert adopt == [] and cancel == ["11", "12"]


def test_the_latest_job_of_a_stage_counts_and_sacct_suffixes_are_read():
    records = [_record("9", "generate", 1), _record("10", "generate", 1), _record("11", "score", 1)]
    adopt, cancel = adoption.plan(PENDING, records, {"9": "RUNNING", "10": "CANCELLED by 0", "11": "PENDING"})
    assert adopt == [] and cancel == ["11"]  # job 9 was replaced by 10, which is gone
    adopt, _ = adoption.plan(PENDING, records, {"10": "REQUEUED", "11": "PENDING"})
    assert [r["job_id"] for r in adopt] == ["10", "11"]
    assert adoption.plan(PENDING, records, {})[0] == []  # jobs sacct no longer knows are not alive


def test_a_live_resident_job_is_followed():
    records = [_record("5", "controller", None), _record("6", "resident", None)]
    assert adoption.live_resident(records, {"6": "RUNNING"})["job_id"] == "6"
    assert adoption.live_resident(records, {"6": "TIMEOUT"}) is None


class FakeJob:
    """A stage job whose stage commits when it is first polled (its output is put back in place)."""

    array = 0  # a plain job, not a job array

    def __init__(self, stage: str, iteration: int, saved, run):
        self.stage, self.iteration, self.job_id = stage, iteration, f"{stage}-{iteration}"
        self._saved, self._run = saved, run

    def done(self) -> bool:
        target = self._run.stage_dir(self.iteration, self.stage)
        if not target.exists():
            shutil.move(self._saved / f"{self.iteration}-{self.stage}", target)
        return True

    def error(self):
        return None

    def cancel(self) -> None:
        raise AssertionError(f"job {self.job_id} was cancelled")


class FakeSlurm:
    """The Slurm executor's interface, recording what the controller asks of it."""

    lookahead = 2

    def __init__(self, saved, run):
        self.saved, self.run = saved, run
        self.submitted, self.adopted, self.cancelled = [], [], []
        self.arrays = {}  # (iteration, stage): the tasks of an adopted job array

    def submit(self, stage, iteration, after=None):
        self.submitted.append((iteration, stage))
        return FakeJob(stage, iteration, self.saved, self.run)

    def adopt(self, job_id, stage, iteration, array=0):
        self.adopted.append((iteration, stage))
        self.arrays[(iteration, stage)] = array
        return FakeJob(stage, iteration, self.saved, self.run)

    def cancel(self, job_id):
        self.cancelled.append(job_id)


def test_a_restarted_controller_submits_nothing_its_predecessor_left_queued(tmp_path, monkeypatch, tiny_task):
    from tests.synthetic_run import make_run

    # each update saves its policy (else the run rolls back to the last saved one on start)
    run = make_run(tmp_path / "adopt", iterations=2, rows=32, eval_every=1, policy_from=tiny_task / "model")
    exp = config.with_overrides(config.load(run.config_path), {"tracking.enabled": False}, "test")
    saved = tmp_path / "saved"
    saved.mkdir()
    for k, stage in reversed(plan.all_stages(exp)[3:]):  # iteration 1 onwards: pending again
        shutil.move(run.stage_dir(k, stage), saved / f"{k}-{stage}")
    pending = plan.pending_stages(run, exp)
    assert pending[:2] == [(1, "generate"), (1, "score")]
    # the earlier controller's jobs: generate 1 running (a job array of its two shards), score 1
    # queued behind it
    run.record_job("101", "generate", 1, array=2)
    run.record_job("102", "score", 1)
    states = {"101": "RUNNING", "102": "PENDING"}
    monkeypatch.setattr(adoption, "states_of", lambda records: {r["job_id"]: states[r["job_id"]]
                                                                 for r in records if r["job_id"] in states})
    fake = FakeSlurm(saved, run)
    monkeypatch.setattr(executors, "make", lambda run, exp: fake)
    lines: list[str] = []
    Controller(run, exp, echo=lines.append, show_progress=False).run_all()
    assert fake.adopted == [(1, "generate"), (1, "score")]
    assert fake.arrays == {(1, "generate"): 2, (1, "score"): 0}  # the array followed task by task
    assert fake.submitted == pending[2:] and fake.cancelled == []
    assert not plan.pending_stages(run, exp)
    assert any("job 101 of an earlier controller is still queued or running" in line for line in lines)
    recorded = [(r["iteration"], r["role"]) for r in run.jobs()]
    assert recorded.count((1, "generate")) == 1 and recorded.count((1, "score")) == 1


def test_the_local_executor_adopts_nothing(tmp_path, monkeypatch):
    from tests.synthetic_run import make_run

    run = make_run(tmp_path / "local", iterations=1, rows=32)
    exp = config.load(run.config_path)
    run.record_job("7", "generate", 1)

    def no_sacct(records):
        raise AssertionError("a local run has no Slurm to ask")

    monkeypatch.setattr(adoption, "states_of", no_sacct)
    assert Controller(run, exp, show_progress=False)._adopted(
        executors.LocalExecutor(run, exp)) == []


def test_controller_and_resident_jobs_run_one_at_a_time(write_experiment):
    exp = config.load(write_experiment("single", executor={"kind": "slurm", "mode": "resident"}))
    for role in ("controller", "resident"):
        assert executors.slurm_parameters(exp, role, "single")["dependency"] == "singleton"
    assert "dependency" not in executors.slurm_parameters(exp, "generate", "single")


def test_sacct_gives_a_job_array_the_state_of_a_task_still_alive(monkeypatch):
    """pins: an array (a sharded stage) that sacct lists only task by task ("7_0", "7_1", or
    "7_[2-3]" while pending) read as unknown, so a restarted controller submits it again."""
    import subprocess

    from hpcrl import slurm

    lines = {"done": ["7_0|COMPLETED", "7_1|COMPLETED"], "one left": ["7_0|COMPLETED", "7_1|RUNNING"],
             "pending": ["7_[0-1]|PENDING"], "plain": ["8|RUNNING"]}
    for case, rows in lines.items():
        out = "\n".join(r + "|" * (len(slurm.FIELDS) - 2) for r in rows)
        monkeypatch.setattr(subprocess, "run",
                            lambda *a, out=out, **k: subprocess.CompletedProcess(a, 0, out, ""))
        states = {k: v["State"] for k, v in slurm.accounting(["7", "8"]).items()}
        expected = {"done": "COMPLETED", "one left": "RUNNING", "pending": "PENDING"}.get(case)
        assert states.get("7") == expected, case
    assert states == {"8": "RUNNING"}
