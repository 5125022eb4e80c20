"""The local Slurm cluster that CI starts with `bash tools/slurm_up.sh --nodes 2 --gpus 2`.

These tests assume the cluster is up and FAIL when it is not (a missing cluster must not pass as
skipped); set HPCRL_NO_SLURM=1 to skip them on a machine without Slurm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import submitit  # a dependency of hpcrl (setup.cfg): missing means a broken install

pytestmark = pytest.mark.slurm

NODES = 2
START_HINT = "start it with: bash tools/slurm_up.sh --nodes 2 --gpus 2 (or set HPCRL_NO_SLURM=1 to skip)"


def sh(*args: str, timeout: float = 30) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=timeout).stdout


def node_states() -> dict[str, str]:
    out = sh("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t")
    return dict(line.split() for line in out.splitlines() if line.strip())


def idle_states(timeout: float = 15) -> dict[str, str]:
    """The nodes' states once all are idle, or the last seen after `timeout` s (a previous test's
    job may still be completing: tests run in random order)."""
    deadline, states = time.time() + timeout, {}
    while time.time() < deadline:
        try:
            states = node_states()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            pytest.fail(f"sinfo failed ({getattr(e, 'stderr', '') or e}); {START_HINT}", pytrace=False)
        if len(states) == NODES and set(states.values()) == {"idle"}:
            break
        time.sleep(0.5)
    return states


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    """Fail (not skip) unless sinfo exists and all NODES nodes are idle (within a few seconds)."""
    if os.environ.get("HPCRL_NO_SLURM") == "1":
        pytest.skip("HPCRL_NO_SLURM=1: no local Slurm cluster on this machine")
    if shutil.which("sinfo") is None:
        pytest.fail(f"sinfo not found: Slurm is not installed; {START_HINT}", pytrace=False)
    states = idle_states()
    if len(states) != NODES or set(states.values()) != {"idle"}:
        pytest.fail(f"expected {NODES} idle nodes, sinfo shows {states or 'none'}; {START_HINT}",
                    pytrace=False)


def submit(tmp_path: Path, *args: str, wrap: str) -> tuple[str, Path]:
    out = tmp_path / "job-%j.out"
    job_id = sh("sbatch", "--parsable", f"--output={out}", f"--chdir={tmp_path}",
                *args, "--wrap", wrap).strip()
    return job_id, tmp_path / f"job-{job_id}.out"


def wait_state(job_id: str, timeout: float = 30) -> str:
    """The job's final state from accounting (sacct), waiting until it has one."""
    deadline, state = time.time() + timeout, ""
    while time.time() < deadline:
        state = sh("sacct", "-j", job_id, "-n", "-X", "-o", "State%30").strip()
        if state and state.split()[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING"):
            return state
        time.sleep(0.3)
    pytest.fail(f"job {job_id} not finished after {timeout}s (sacct state {state!r})")


def test_sinfo_shows_two_idle_nodes():
    states = idle_states()
    assert states == {f"n{k}": "idle" for k in range(1, NODES + 1)}
    parts = sh("sinfo", "-h", "-o", "%P").split()
    assert {"debug*", "cpu", "gpu"} <= set(parts), parts


def test_sbatch_on_cpu_partition_completes(tmp_path):
    job_id, out = submit(tmp_path, "--partition=cpu", "--account=hpcrl", wrap="echo hello from $SLURM_JOB_ID")
    assert wait_state(job_id) == "COMPLETED"
    assert out.read_text().strip() == f"hello from {job_id}"


def test_srun_spans_both_nodes(tmp_path):
    job_id, out = submit(tmp_path, "-N2", "--ntasks-per-node=1", wrap="srun bash -c 'echo $SLURMD_NODENAME'")
    assert wait_state(job_id) == "COMPLETED", out.read_text() if out.exists() else "no output"
    lines = out.read_text().split()
    assert sorted(lines) == ["n1", "n2"], lines


def test_gres_gpu_sets_cuda_visible_devices(tmp_path):
    job_id, out = submit(tmp_path, "--partition=gpu", "--gres=gpu:1",
                         wrap="echo CVD=${CUDA_VISIBLE_DEVICES-unset}")
    assert wait_state(job_id) == "COMPLETED"
    assert out.read_text().strip() == "CVD=0"


def _slurm_executor(folder: Path):
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(slurm_partition="cpu", timeout_min=5, cpus_per_task=1, mem_gb=1)
    return ex


def _wait_done(job, timeout: float) -> None:
    deadline = time.time() + timeout
    while not job.done(force_check=True):  # force: submitit otherwise polls sacct every 2..600 s
        assert time.time() < deadline, f"submitit job {job.job_id} not done after {timeout}s ({job.state})"
        time.sleep(0.3)


def test_submitit_returns_result(tmp_path):
    job = _slurm_executor(tmp_path).submit(os.getenv, "SLURM_JOB_ID")  # stdlib: unpickles anywhere
    _wait_done(job, 60)
    assert job.result() == job.job_id
    assert wait_state(job.job_id) == "COMPLETED"  # the result file can precede the accounting record


def test_submitit_sees_external_scancel(tmp_path):
    job = _slurm_executor(tmp_path).submit(time.sleep, 300)
    deadline = time.time() + 30
    while job.watcher.get_state(job.job_id, mode="force") != "RUNNING":
        assert time.time() < deadline, f"job {job.job_id} not running after 30s ({job.state})"
        time.sleep(0.3)
    sh("scancel", job.job_id)
    _wait_done(job, 30)  # without accounting (sacct) this never returns: state stays UNKNOWN
    assert job.state.startswith("CANCELLED"), job.state
    # result() raises instead of hanging; submitit first waits _results_timeout_s (15 s) for a
    # result file that a slow shared filesystem might still deliver: none will come here.
    job._results_timeout_s = 1
    assert isinstance(job.exception(), submitit.core.utils.UncompletedJobError)


def test_a_dry_run_asks_slurm_whether_it_would_take_each_kind_of_job(write_experiment):
    """`hpcrl submit --dry-run --check-cluster`: `sbatch --test-only` on one script per role."""
    import sys

    slurm = {"kind": "slurm", "generate": {"partition": "gpu"}, "score": {"partition": "cpu"},
             "update": {"partition": "debug"}}
    good = write_experiment("fits", executor=slurm)
    def dry_run(path):
        return subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", "--dry-run", "--check-cluster",
                               str(path)], capture_output=True, text=True, timeout=300)

    out = dry_run(good)
    assert out.returncode == 0, out.stdout + out.stderr
    verdicts = [line for line in out.stdout.splitlines() if line.startswith("sbatch --test-only")]
    assert [v.split(":")[0].split()[-1] for v in verdicts] == [
        "controller.sbatch", "iter_000000-generate.sbatch", "iter_000000-score.sbatch",
        "iter_000000-update.sbatch"]
    assert all(": accepted: " in v for v in verdicts)
    bad = write_experiment("toomany", executor={**slurm, "update": {"partition": "debug", "nodes": 4}},
                           update={"world_size": 4})  # 4 nodes of a 2-node cluster
    out = dry_run(bad)
    assert out.returncode == 2 and "iter_000000-update.sbatch: REFUSED" in out.stdout, out.stdout + out.stderr
    assert "Slurm would refuse 1 of the run's kinds of job" in out.stderr


def test_doctor_lists_the_partitions_accounts_and_qos_it_can_see():
    from hpcrl import doctor

    lines = "\n".join(doctor.cluster_lines())
    assert "debug* up 2 gpu:2" in lines and "cpu up 2" in lines and "(normal)" in lines
