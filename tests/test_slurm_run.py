"""Runs on a real Slurm (the local cluster of tools/slurm_up.sh --nodes 2 --gpus 2): stage jobs
through submitit, per-stage resources, the controller job, requeue, scancel, 2-node updates,
and sbatch scripts submitted by hand."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import commit, config, executors, plan, runs
from hpcrl.rundir import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500)]

SLURM = {"kind": "slurm", "lookahead": 2, "max_retries": 0,
         "generate": {"partition": "gpu", "cpus_per_task": 2, "time_min": 20},
         "score": {"partition": "cpu", "cpus_per_task": 1, "time_min": 10},
         "update": {"partition": "debug", "cpus_per_task": 2, "time_min": 20}}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if os.environ.get("HPCRL_NO_SLURM") == "1":
        pytest.skip("HPCRL_NO_SLURM=1")
    if shutil.which("sinfo") is None:
        pytest.fail("no Slurm here: start the local cluster with `bash tools/slurm_up.sh --nodes 2 --gpus 2`")


def _write(root: Path, tiny_task: Path, name: str, **sections) -> Path:
    import tests.conftest as c

    path = root / f"{name}.toml"
    path.write_text(c.experiment_toml(tiny_task, root / "runs", name, **sections))
    return path


def _sacct(job_ids, fields="JobID,JobName,Partition,AllocCPUS,State,NodeList") -> list[dict]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", fields],
                         capture_output=True, text=True, check=True).stdout
    return [dict(zip(fields.split(","), line.split("|"), strict=True)) for line in out.splitlines()]


def _sacct_ended(job_ids, timeout: float = 120,
                 fields: str = "JobID,JobName,Partition,AllocCPUS,State,NodeList") -> list[dict]:
    """sacct's rows once no job is pending or running: a stage commits its output before its job
    process has exited, so a complete run can still show its last stage's job RUNNING."""
    deadline = time.time() + timeout
    while True:
        rows = _sacct(job_ids, fields)
        if time.time() > deadline or not any(r["State"] in ("PENDING", "RUNNING", "COMPLETING")
                                             for r in rows):
            return rows
        time.sleep(1)


def _wait_complete(run: RunDir, timeout: float = 900) -> None:
    exp = config.load(run.config_path)
    deadline = time.time() + timeout
    while plan.next_stage(run, exp) is not None:
        assert time.time() < deadline, f"run not complete; log dir {run.logs}"
        time.sleep(2)


def _same_outputs(a: RunDir, b: RunDir) -> None:
    exp = config.load(a.config_path)
    for k, s in plan.all_stages(exp):
        assert (commit.read_manifest(a.stage_dir(k, s))["files"]
                == commit.read_manifest(b.stage_dir(k, s))["files"]), (k, s)


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm")


@pytest.fixture(scope="module")
def local_ref(staged_ref):
    return staged_ref


def _wait_for_running(run: RunDir, iteration: int, stage: str, proc=None, timeout: float = 600) -> str:
    """The job id of `stage` once it is at work (its temporary output exists)."""
    deadline = time.time() + timeout
    tmp = commit.temp_dir(run.stage_dir(iteration, stage))
    while True:
        assert proc is None or proc.poll() is None, proc.communicate()[0]
        assert time.time() < deadline, f"{stage} never ran"
        jobs = [j for j in run.jobs() if j["role"] == stage and j["iteration"] == iteration]
        if jobs and tmp.exists():
            return jobs[-1]["job_id"]
        time.sleep(0.2)


def test_a_controller_job_survives_a_requeued_stage_and_commits_what_a_local_run_does(runs_root, tiny_task,
                                                                                      local_ref):
    """The controller runs as a Slurm job; the update of iteration 0 is requeued while it works
    (`scontrol requeue`), runs again, and the run commits what the local run does. Issue #19: the
    run has generate.engines = 2, so each generate stage is a job array whose two tasks (a node's
    two GPUs each, so never on one node) run side by side on both nodes (sacct), and the stages
    commit the bytes of the one-engine local run. pins: shards run one after the other in one job,
    or merged out of one engine's order."""
    from hpcrl import slurm

    spec = {**SLURM, "generate": {**SLURM["generate"], "cpus_per_task": 1, "gpus_per_node": 2}}
    path = _write(runs_root, tiny_task, "slurm", executor=spec, generate={"engines": 2},
                  tracking={"enabled": True})
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "submitted the controller as Slurm job" in out.stdout
    run = RunDir.at(runs_root / "runs" / "slurm")
    requeued = _wait_for_running(run, 0, "update")
    time.sleep(1.0)
    assert not commit.is_committed(run.stage_dir(0, "update"))
    subprocess.run(["scontrol", "requeue", requeued], check=True)
    _wait_complete(run)
    _same_outputs(run, local_ref)
    restarts = subprocess.run(["sacct", "-n", "-P", "-D", "-X", "-j", requeued, "-o", "State"],
                              capture_output=True, text=True).stdout.split()
    assert "REQUEUED" in restarts, restarts
    jobs = run.jobs()
    stage_jobs = [j for j in jobs if j["role"] != "controller"]
    assert (sorted((j["iteration"], j["role"]) for j in stage_jobs)
            == sorted(plan.all_stages(config.load(path))))
    arrays = [j for j in stage_jobs if j["role"] == "generate"]
    assert [j.get("array") for j in arrays] == [2, 2, 2]  # what a restarted controller adopts
    rows = {r["JobID"]: r for r in _sacct_ended([j["job_id"] for j in jobs])}  # the controller's too
    for j in stage_jobs:
        tasks = [f"{j['job_id']}_{i}" for i in range(2)] if j["role"] == "generate" else [j["job_id"]]
        for task in tasks:
            row = rows[task]
            assert row["State"] == "COMPLETED"
            assert row["Partition"] == spec[j["role"]]["partition"]
            assert int(row["AllocCPUS"]) == spec[j["role"]]["cpus_per_task"]
            assert row["JobName"] == f"{j['role']}-{j['iteration']}-slurm"
    for j in arrays:  # iterations 0, 1 and the final validation, one array each
        array = j["job_id"]
        assert slurm.accounting([array])[array]["State"] == "COMPLETED"
        merged_by = commit.read_manifest(run.stage_dir(j["iteration"], "generate"))["job_id"]
        assert merged_by in (f"{array}_0", f"{array}_1"), merged_by  # the task that merged
        tasks = [r for job_id, r in rows.items() if job_id.startswith(f"{array}_")]
        assert sorted(r["JobID"] for r in tasks) == [f"{array}_0", f"{array}_1"], tasks
        assert all(r["State"] == "COMPLETED" for r in tasks), tasks
        assert sorted(r["NodeList"] for r in tasks) == ["n1", "n2"], tasks
    _reported_in_status_and_mlflow(run)


def _reported_in_status_and_mlflow(run: RunDir) -> None:
    status = subprocess.run([sys.executable, "-m", "hpcrl.cli", "status", str(run.root)], capture_output=True,
                            text=True)
    assert "Slurm jobs:" in status.stdout and "COMPLETED" in status.stdout
    import sqlite3  # lineage in MLflow: per-stage queue wait, elapsed time and GPU-hours, job ids and nodes

    info = run.read_run_info()
    con = sqlite3.connect(info["mlflow_tracking_uri"].removeprefix("sqlite:///"))
    keys = {k for (k,) in con.execute("select key from metrics where run_uuid=?", (info["mlflow_run_id"],))}
    for stage in ("generate", "score", "update"):
        assert {f"slurm/{stage}/elapsed_s", f"slurm/{stage}/queue_wait_s", f"slurm/{stage}/gpu_hours"} <= keys
    tags = dict(con.execute("select key, value from tags where run_uuid=?", (info["mlflow_run_id"],)))
    assert tags["slurm.update.last_nodes"] in ("n1", "n2")


def test_cancelled_stage_is_reported_with_job_id_and_log(runs_root, tiny_task):
    path = _write(runs_root, tiny_task, "cancelled", executor=SLURM)
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "submit", "--foreground", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = RunDir.at(runs_root / "runs" / "cancelled")
    job_id = _wait_for_running(run, 0, "generate", proc)
    subprocess.run(["scancel", job_id], check=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert f"stage generate of iteration 0 failed (job {job_id}" in out and f"logs/{job_id}/" in out
    assert not commit.is_committed(run.stage_dir(0, "generate"))
    queued = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True).stdout
    assert "-cancelled" not in queued  # nothing left holding or waiting for an allocation


def test_update_spans_two_nodes_with_two_ranks(runs_root, tiny_task):
    from transformers import AutoTokenizer

    from tests.test_update_deepspeed import _commit_inputs

    spec = {**SLURM, "update": {"partition": "debug", "nodes": 2, "cpus_per_task": 1, "time_min": 20}}
    exp = config.load(_write(runs_root, tiny_task, "twonode", executor=spec, update={"world_size": 2},
                             run={"iterations": 1}))
    run, _ = runs.prepare(exp, "twonode")
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
    job = executors.SlurmExecutor(run, exp).submit("update", 0)
    job.job.results()
    manifest = commit.read_manifest(run.stage_dir(0, "update"))
    assert manifest["world_size"] == 2
    nodes = _sacct([job.job_id])[0]["NodeList"]
    assert nodes in ("n[1-2]", "n1,n2"), nodes


def test_sbatch_script_submitted_by_hand_runs_the_stage_and_injects_nothing(tmp_path, tiny_task):
    import tests.conftest as c

    root = tmp_path / "it's $(touch hpcrl-pwned)"
    root.mkdir()
    canaries = [d / "hpcrl-pwned" for d in (tmp_path, root, Path.cwd(), Path.home())]
    path = root / "e.toml"
    path.write_text(c.experiment_toml(tiny_task, root / "runs", "byhand", executor=SLURM))
    script = subprocess.run([sys.executable, "-m", "hpcrl.cli", "sbatch", str(path), "--stage", "generate",
                             "--iteration", "0"], capture_output=True, text=True)
    assert script.returncode == 0, script.stderr
    assert "#SBATCH --partition=gpu" in script.stdout and "#SBATCH --cpus-per-task=2" in script.stdout
    (tmp_path / "gen.sbatch").write_text(script.stdout)
    job_id = subprocess.run(["sbatch", "--parsable", str(tmp_path / "gen.sbatch")], capture_output=True,
                            text=True, check=True, cwd=tmp_path).stdout.strip().split(";")[0]
    run = RunDir.at(root / "runs" / "byhand")
    deadline = time.time() + 300
    while not commit.is_committed(run.stage_dir(0, "generate")):
        state = _sacct([job_id], "JobID,State")
        assert not state or state[0]["State"] not in ("FAILED", "CANCELLED", "TIMEOUT"), state
        assert time.time() < deadline
        time.sleep(1)
    assert not any(c.exists() for c in canaries)
    bad = root / "bad.toml"
    bad.write_text(c.experiment_toml(tiny_task, root / "runs", "bad", executor={
        **SLURM, "score": {"partition": "cpu$(touch hpcrl-pwned)"}}))
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", "--dry-run", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "executor.score: sbatch option --partition" in out.stderr
    assert not any(c.exists() for c in canaries)


def test_resident_heterogeneous_job_puts_the_generator_on_a_node_of_its_own(runs_root, tiny_task, local_ref):
    """[executor.resident.generator]: one Slurm job of two components (hetjob), the trainers on
    one node, the generator on another, submitted as the rendered script and followed by sacct."""
    spec = {"kind": "slurm", "mode": "resident", "max_retries": 0,
            "resident": {"partition": "debug", "nodes": 1, "cpus_per_task": 1, "time_min": 20,
                         "generator": {"partition": "debug", "cpus_per_task": 1}}}
    path = _write(runs_root, tiny_task, "resident", executor=spec)
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", "--foreground", str(path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    run = RunDir.at(runs_root / "runs" / "resident")
    _same_outputs_but_policies(run, local_ref)
    [job] = [j for j in run.jobs() if j["role"] == "resident"]
    rows = _sacct([job["job_id"]])
    assert [r["JobID"] for r in rows] == [f"{job['job_id']}+0", f"{job['job_id']}+1"], rows
    assert {r["State"] for r in rows} == {"COMPLETED"} and {r["NodeList"] for r in rows} == {"n1", "n2"}
    exp = config.load(path)
    nodes = {s: {commit.read_manifest(run.stage_dir(k, s))["node"] for k, st in plan.all_stages(exp)
                 if st == s}
             for s in ("generate", "update")}
    assert nodes == {"update": {"n1"}, "generate": {"n2"}}, nodes
    # weight_sync = "auto" across two (Slurm) nodes: the process group, not shared memory
    logs = "".join(p.read_text(errors="replace") for p in (run.root / "logs").rglob("*") if p.is_file())
    assert "weights reach vLLM through process group" in logs


def _same_outputs_but_policies(a: RunDir, b: RunDir) -> None:
    """Equal rollouts, scores and update tables (a resident run saves fewer policy versions)."""
    exp = config.load(a.config_path)
    for k, s in plan.all_stages(exp):
        fa, fb = (commit.read_manifest(d.stage_dir(k, s))["files"] for d in (a, b))
        assert {f: v for f, v in fa.items() if f.endswith(".parquet")} == \
            {f: v for f, v in fb.items() if f.endswith(".parquet")}, (k, s)


def test_resident_engines_on_two_nodes_from_a_script_submitted_by_hand_commit_what_one_engine_does(
        tmp_path, tiny_task, local_ref):
    """Issue #19: a resident job of one trainer and three vLLM engines over two nodes (n1: the
    trainer and engine 0; n2: engines 1 and 2), rendered by `hpcrl sbatch` and submitted with
    sbatch: its engines sample on both nodes, every engine loads the update's weights over the
    process group ("auto" across nodes), and the run commits the bytes of the one-engine run."""
    spec = {"kind": "slurm", "mode": "resident",
            "resident": {"partition": "debug", "nodes": 2, "cpus_per_task": 1, "stall_s": 20}}
    path = _write(tmp_path, tiny_task, "byhand-resident", executor=spec, generate={"engines": 3},
                  run={"iterations": 1})
    script = subprocess.run([sys.executable, "-m", "hpcrl.cli", "sbatch", str(path), "--stage", "resident"],
                            capture_output=True, text=True)
    assert script.returncode == 0, script.stderr
    assert "#SBATCH --nodes=2" in script.stdout and "#SBATCH --ntasks-per-node=2" in script.stdout
    assert "-m hpcrl.resident --run-dir" in script.stdout
    (tmp_path / "resident.sbatch").write_text(script.stdout)
    subprocess.run(["sbatch", str(tmp_path / "resident.sbatch")], check=True, cwd=tmp_path,
                   capture_output=True)
    run = RunDir.at(tmp_path / "runs" / "byhand-resident")
    _wait_complete(run, timeout=600)
    for stage in ("generate", "score", "update"):  # iteration 0 is the same in the two-iteration reference
        fa, fb = (commit.read_manifest(r.stage_dir(0, stage))["files"] for r in (run, local_ref))
        assert {f: v for f, v in fa.items() if f.endswith(".parquet")} == \
            {f: v for f, v in fb.items() if f.endswith(".parquet")}, stage
    nodes = [commit.read_manifest(run.shard_dir(k, "generate", i, 3))["node"]
             for k in (0, 1) for i in range(3)]
    assert nodes == ["n1", "n2", "n2"] * 2, nodes
    logs = "".join(p.read_text(errors="replace") for p in (run.root / "logs").rglob("*") if p.is_file())
    assert "weights reach vLLM of 3 engines through process group" in logs
    synced = commit.read_manifest(run.stage_dir(1, "generate"))["metrics"]  # all three engines' probes passed
    assert synced["sync/logp_diff"] < 1e-4 < synced["sync/update_shift"]


def test_staged_async_run_overlaps_a_generation_with_the_update_before_it(tmp_path, tiny_task, local_ref):
    """Issue #18: with algorithm.max_staleness = 1 the generate job of iteration k + 1 depends on
    update k - 1 only, so Slurm runs it beside update k (sacct's start and end times). pins: jobs
    chained behind the previous one, as lock-step needs. Its one-engine stages of iteration 0 (policy
    version 0, as in lock-step) commit the local run's bytes (the requeued run has two engines)."""
    from datetime import datetime

    one_core = {role: {**SLURM[role], "cpus_per_task": 1} for role in ("generate", "update")}
    path = _write(tmp_path, tiny_task, "async", executor={**SLURM, **one_core, "lookahead": 3},
                  algorithm={"group_size": 4, "prompts_per_iteration": 8, "max_staleness": 1},
                  run={"iterations": 3, "eval_every": 1})
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    run = RunDir.at(tmp_path / "runs" / "async")
    _wait_complete(run)
    jobs = {(j["iteration"], j["role"]): j["job_id"] for j in run.jobs() if j["role"] != "controller"}
    rows = {r["JobID"]: r for r in _sacct_ended(list(jobs.values()), fields="JobID,State,Start,End")}
    times = {key: [datetime.fromisoformat(rows[job][t]) for t in ("Start", "End")]
             for key, job in jobs.items()}
    for job in jobs.values():
        assert rows[job]["State"] == "COMPLETED", rows[job]
    overlaps = [k for k in range(2)
                if times[(k + 1, "generate")][0] < times[(k, "update")][1]
                and times[(k, "update")][0] < times[(k + 1, "generate")][1]]
    assert overlaps, times
    for k in range(2):  # each generation sampled with the update its job waited for
        inputs = commit.read_manifest(run.stage_dir(k + 2, "generate"))["inputs"]
        assert f"update@iter_{k + (k == 1):06d}" in inputs  # the final validation: the final policy
    for stage in ("generate", "score"):
        assert (commit.read_manifest(run.stage_dir(0, stage))["files"]
                == commit.read_manifest(local_ref.stage_dir(0, stage))["files"]), stage
