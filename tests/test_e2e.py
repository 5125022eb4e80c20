"""End to end through `hpcrl submit` and submitit's LocalExecutor: a 2-iteration run (conftest's
`staged_ref`, shared with the other files that compare against it), a run killed with SIGKILL in the
middle of each stage kind and resumed, MLflow, status and the run lock."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import commit, config, plan
from hpcrl.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SLOW = ["slow_reward:slow_exact_match"]
SLOW_REWARD = '''
import time
from hpcrl.rewards import exact_match

def slow_exact_match(response, ground_truth, **info):
    time.sleep(0.03)  # a reward that takes a while, like a verifier
    return exact_match(response, ground_truth, **info)
'''


def hpcrl(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpcrl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True, **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_task):
    import tests.conftest as c

    root = tmp_path_factory.mktemp("e2e")
    (root / "slow_reward.py").write_text(SLOW_REWARD)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    path = root / "killed.toml"  # staged_ref's experiment but for the reward function
    path.write_text(c.experiment_toml(tiny_task, root / "runs", "killed", reward={"functions": SLOW},
                                      tracking={"enabled": True}))
    return root, env, path


def test_run_completes_with_iteration_lines(staged_ref_submitted):
    run, out = staged_ref_submitted
    exp = config.load(run.config_path)
    assert plan.next_stage(run, exp) is None
    lines = [line for line in out.splitlines() if line.startswith("iter ")]
    assert len(lines) == 3  # iterations 0, 1 and the final validation
    assert "reward" in lines[0] and "val" in lines[0] and "gen " in lines[0] and "update " in lines[0]
    assert (run.root / "policy" / "v000002").resolve() == (run.stage_dir(1, "update") / "policy").resolve()


def test_mlflow_has_the_metrics_and_artifacts(staged_ref):
    run = staged_ref
    info = run.read_run_info()
    db = Path(info["mlflow_tracking_uri"].removeprefix("sqlite:///"))
    assert stat.S_IMODE(db.stat().st_mode) & 0o007 == 0  # like the run directory: not for others
    assert stat.S_IMODE(run.root.stat().st_mode) == 0o750
    con = sqlite3.connect(db)
    keys = {k for (k,) in con.execute("select key from metrics where run_uuid=?", (info["mlflow_run_id"],))}
    for key in ("critic/score/mean", "val/score", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                "actor/entropy", "actor/grad_norm", "response_length/mean", "timing_s/generate",
                "timing_s/score", "timing_s/update", "perf/throughput"):
        assert key in keys, key
    steps = {s for (s,) in con.execute("select step from metrics where run_uuid=? and key='val/score'",
                                       (info["mlflow_run_id"],))}
    assert steps == {0, 1, 2}
    status = con.execute("select status from runs where run_uuid=?", (info["mlflow_run_id"],)).fetchone()[0]
    assert status == "FINISHED"
    params = dict(con.execute("select key, value from params where run_uuid=?", (info["mlflow_run_id"],)))
    assert params["algorithm.group_size"] == "4"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(info["mlflow_tracking_uri"])
    artifacts = {a.path for a in client.list_artifacts(info["mlflow_run_id"])}
    assert {"experiment.toml", "samples", "plots"} <= artifacts
    plots = {a.path for a in client.list_artifacts(info["mlflow_run_id"], "plots")}
    assert "plots/reward.png" in plots and "plots/stage_timings.png" in plots
    samples = {a.path for a in client.list_artifacts(info["mlflow_run_id"], "samples")}
    assert "samples/iter_000000.json" in samples


def _committed(run: RunDir) -> dict[tuple[int, str], bytes]:
    exp = config.load(run.config_path)
    return {(k, s): (run.stage_dir(k, s) / commit.MANIFEST).read_bytes()
            for k, s in plan.all_stages(exp) if commit.is_committed(run.stage_dir(k, s))}


def _kill_during(run: RunDir, iteration: int, stage: str, proc: subprocess.Popen, delay: float) -> None:
    """SIGKILL the controller and its stage jobs while `stage` of `iteration` is at work."""
    tmp = commit.temp_dir(run.stage_dir(iteration, stage))
    deadline = time.time() + 600
    while not tmp.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.time() < deadline, f"{stage} never started"
        time.sleep(0.05)
    time.sleep(delay)
    assert not commit.is_committed(run.stage_dir(iteration, stage)), f"{stage} finished before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _scored_again(ref: RunDir, iteration: int, out: Path, functions: list[str]) -> Path:
    """The score stage of `ref`'s iteration run again (hpcrl replay) with these reward functions:
    what a run of `ref`'s experiment with them commits, its generation being `ref`'s."""
    from hpcrl import replay

    again, again_exp = replay.prepare(ref, config.load(ref.config_path), iteration, "score",
                                      {"reward.functions": functions}, out)
    replay.run_stage(again, again_exp, iteration, "score")
    return again.stage_dir(iteration, "score")


def test_killed_in_each_stage_and_resumed_gives_identical_outputs(setup, staged_ref, tmp_path, monkeypatch):
    root, env, path = setup
    run = RunDir.at(root / "runs" / "killed")
    proc = hpcrl("submit", str(path), env=env)
    _kill_during(run, 0, "generate", proc, delay=1.0)
    for iteration, stage, delay in ((0, "score", 0.3), (0, "update", 0.5), (1, "generate", 1.0)):
        before = _committed(run)
        proc = hpcrl("resume", str(run.root), env=env)
        _kill_during(run, iteration, stage, proc, delay)
        after = _committed(run)
        assert {k: after[k] for k in before} == before  # nothing committed was recomputed
    proc = hpcrl("resume", str(run.root), env=env)
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])  # the score jobs below import slow_reward
    exp = config.load(run.config_path)
    for k, s in plan.all_stages(exp):
        got = commit.read_manifest(run.stage_dir(k, s))
        # staged_ref, its scores made with the slow reward function (the name is in them) like this run's
        ref = _scored_again(staged_ref, k, tmp_path / f"score-{k}", SLOW) if s == "score" else \
            staged_ref.stage_dir(k, s)
        want = commit.read_manifest(ref)
        assert got["files"] == want["files"], (k, s)  # byte-identical data and policy files
    assert len(RunDir.at(run.root).read_run_info()["mlflow_run_id"]) > 0


def test_status_shows_committed_stages_and_second_controller_is_refused(staged_ref, setup):
    run = staged_ref
    _, env, _ = setup
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "status", str(run.root), "--verify"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "complete" in out.stdout and out.stdout.count("done") == 8
    from hpcrl.rundir import RunLock

    with RunLock(run):
        res = subprocess.run([sys.executable, "-m", "hpcrl.cli", "resume", str(run.root)],
                             capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "already driven by another controller" in res.stderr


def test_failed_stage_is_retried_then_stops_the_run_with_job_log_and_stderr(setup, tiny_task):
    import tests.conftest as c

    root, env, _ = setup
    (root / "bad_reward.py").write_text(
        "def boom(response, ground_truth, **_):\n    raise ValueError('verifier crashed on purpose')\n")
    path = root / "failing.toml"
    path.write_text(c.experiment_toml(tiny_task, root / "runs", "failing",
                                      reward={"functions": ["bad_reward:boom"]}, executor={"max_retries": 1}))
    proc = hpcrl("submit", str(path), env=env)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out
    assert "stage score of iteration 0 failed (job" in out and "attempt 1/2" in out and "retrying" in out
    assert "attempt 2/2" in out and "verifier crashed on purpose" in out and "log: " in out
    run = RunDir.at(root / "runs" / "failing")
    assert commit.is_committed(run.stage_dir(0, "generate"))
    assert not commit.is_committed(run.stage_dir(0, "score"))
