"""Retention in real runs of the tiny task (vLLM, DeepSpeed, the local executor): a staged run with
run.retention.keep_last = 2 and keep_trainer_states = 1, killed during an update that starts from
the one trainer state left and resumed, and a resident run that keeps every policy version but
only the last trainer state. Both learn the same numbers and end at the same policy; what they
keep, what the ledger and `hpcrl status` say, the refusals of export and replay, and the disk
estimate of `hpcrl submit` against the bytes the runs hold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from hpcrl import commit, config, disk_budget, plan, pruning
from hpcrl.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ITERATIONS = 3


def hpcrl(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpcrl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_during(run: RunDir, iteration: int, stage: str, proc: subprocess.Popen) -> None:
    tmp = commit.temp_dir(run.stage_dir(iteration, stage))
    deadline = time.time() + 900
    while not tmp.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.time() < deadline, f"{stage} never started"
        time.sleep(0.05)
    time.sleep(1.0)
    assert not commit.is_committed(run.stage_dir(iteration, stage)), f"{stage} finished before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_task) -> dict[str, tuple[RunDir, str]]:
    import tests.conftest as c

    root = tmp_path_factory.mktemp("retention")
    common = {"data": {"test": ""}}
    specs = {
        "staged": {"run": {"iterations": ITERATIONS, "eval_every": 0,
                           "retention": {"keep_last": 2, "keep_trainer_states": 1}}},
        "resident": {"run": {"iterations": ITERATIONS, "eval_every": 0,
                             "retention": {"keep_trainer_states": 1}},
                     "executor": {"mode": "resident", "max_retries": 0,
                                  "resident": {"stall_s": 5, "checkpoint_every": 1}}},
    }
    out = {}
    for name, sections in specs.items():
        path = root / f"{name}.toml"
        path.write_text(c.experiment_toml(tiny_task, root / "runs", name, **common, **sections))
        run = RunDir.at(root / "runs" / name)
        proc = hpcrl("submit", str(path))
        if name == "staged":  # killed while the update of iteration 2 loads the only trainer state left
            _kill_during(run, 2, "update", proc)
            proc = hpcrl("resume", str(run.root))
        text, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0, text[-3000:]
        out[name] = (run, text)
    return out


def test_the_rules_keep_the_last_versions_and_the_last_trainer_state(runs):
    run, text = runs["staged"]
    assert plan.next_stage(run, config.load(run.config_path)) is None
    assert [v for v in range(ITERATIONS + 1) if run.has_policy(v)] == [0, 2, 3]
    assert pruning.present(run) == {"policy": {2, 3}, "trainer": {3}}
    assert sorted((e["part"], e["version"]) for e in pruning.ledger(run)) == [
        ("policy", 1), ("trainer", 1), ("trainer", 2)]
    assert "retention: pruned the policy version 1 (1.8 MiB; run.retention.keep_last = 2)" in text
    resident, _ = runs["resident"]
    assert pruning.present(resident) == {"policy": {1, 2, 3}, "trainer": {3}}
    assert sorted((e["part"], e["version"]) for e in pruning.ledger(resident)) == [("trainer", 1),
                                                                                    ("trainer", 2)]


def test_pruned_runs_learn_the_same_numbers_and_end_at_the_same_policy(runs):
    (a, _), (b, _) = runs["staged"], runs["resident"]
    for k in range(ITERATIONS):
        assert pq.read_table(a.stage_dir(k, "update") / "stats.parquet").equals(
            pq.read_table(b.stage_dir(k, "update") / "stats.parquet")), k
        assert (commit.read_manifest(a.stage_dir(k, "score"))["files"]
                == commit.read_manifest(b.stage_dir(k, "score"))["files"]), k
    wa = load_file(a.policy_dir(ITERATIONS, "") / "model.safetensors")
    wb = load_file(b.policy_dir(ITERATIONS, "") / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)


def test_status_verifies_and_reports_the_bytes_kept_and_freed(runs):
    run, _ = runs["staged"]
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "status", str(run.root), "--verify"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    freed = sum(e["bytes"] for e in pruning.ledger(run))
    assert (f"disk: {pruning.size(pruning.disk_use(run.root))} kept in the run directory; retention freed "
            f"{pruning.size(freed)} (pruned policy versions v1; trainer states v1, v2)") in out.stdout


def test_export_and_replay_refuse_a_pruned_version_and_export_a_kept_one(runs, tmp_path):
    run, _ = runs["staged"]
    cli = [sys.executable, "-m", "hpcrl.cli"]
    out = subprocess.run([*cli, "export", str(run.root), "--version", "1", str(tmp_path / "v1")],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1
    assert "policy version 1 was pruned by retention" in out.stderr
    assert "the run keeps policy versions 0, 2, 3" in out.stderr
    out = subprocess.run([*cli, "replay", str(run.root), "--iteration", "1", "--stage", "generate",
                          "--out", str(tmp_path / "replay")], capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "replay of generate of iteration 1: the policy version 1 was pruned by retention" in out.stderr
    out = subprocess.run([*cli, "export", str(run.root), "--version", "2", str(tmp_path / "v2")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "v2" / "model.safetensors").read_bytes() == (
        run.policy_dir(2, "") / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ["staged", "resident"])
def test_the_submit_estimate_is_within_a_fifth_of_what_the_run_holds(runs, name):
    run, _ = runs[name]
    estimate = disk_budget.estimate(config.load(run.config_path)).final
    measured = pruning.disk_use(run.root)
    assert abs(estimate - measured) <= 0.2 * measured, (estimate, measured)
