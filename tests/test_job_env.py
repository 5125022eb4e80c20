"""Job environments (hpcrl.job_env): a preamble, the interpreter and a container per role, in the
scripts `hpcrl sbatch` renders and in what the Slurm executor hands submitit, the same in both."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import config, executors, job_env, sbatch
from hpcrl.rundir import RunDir

ROLES = ("controller", "generate", "score", "update")
SETUP = ["export HPCRL_PREAMBLE=ran", "module() { echo \"module $*\" >> \"$HPCRL_TRACE\"; }",
         "module load cuda/12"]
PYXIS = {"image": "registry.example#team/hpcrl:0.4", "mounts": ["/scratch:/scratch", "/models"],
         "workdir": "/scratch/work"}
APPTAINER = {"image": "/images/hpcrl 0.4.sif", "runtime": "apptainer", "mounts": ["/scratch"]}


def _exp(write_experiment, mode: str = "staged", **env):
    executor = {"kind": "slurm", "mode": mode, "env": {"setup": SETUP, **env},
                "update": {"gpus_per_node": 2}, "generate": {"gpus_per_node": 1}}
    if mode == "resident":
        executor["resident"] = {"gpus_per_node": 2, "nodes": 1}
    return config.load(write_experiment("env", executor=executor, update={"world_size": 2}))


def _run(exp) -> RunDir:
    return RunDir.at(Path(exp.run.runs_root) / exp.run.name)


def _fake(bin_dir: Path, name: str) -> None:
    """A stand-in for srun or apptainer: records its argv and whether the preamble ran first."""
    path = bin_dir / name
    path.write_text("#!/bin/bash\n"
                    f"printf '%s\\n' \"{name}\" \"$@\" > \"$HPCRL_TRACE.{name}\"\n"
                    f"echo \"preamble=$HPCRL_PREAMBLE\" >> \"$HPCRL_TRACE.{name}\"\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _execute(script: str, tmp_path: Path) -> tuple[list[str], str]:
    """Run a rendered script under the fake srun; (srun's argv, the trace of the preamble)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _fake(bin_dir, "srun")
    trace = tmp_path / "trace"
    trace.write_text("")
    (tmp_path / "job.sh").write_text(script)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HPCRL_TRACE": str(trace)}
    subprocess.run(["bash", str(tmp_path / "job.sh")], env=env, check=True, timeout=30)
    argv = Path(f"{trace}.srun").read_text().splitlines()
    return argv, trace.read_text()


@pytest.mark.parametrize("role", [*ROLES, "resident"])
def test_a_pyxis_job_runs_its_preamble_then_srun_with_the_container(write_experiment, tmp_path, role):
    exp = _exp(write_experiment, "resident" if role == "resident" else "staged", container=PYXIS)
    argv, trace = _execute(sbatch.render(_run(exp), exp, role, None if role in ("controller", "resident")
                                         else 0), tmp_path)
    assert trace == "module load cuda/12\n" and argv[-1] == "preamble=ran"  # the preamble ran, before srun
    if role == "controller":  # outside the container: it calls sbatch
        assert not any(a.startswith("--container") for a in argv)
        return
    assert "--container-image=registry.example#team/hpcrl:0.4" in argv  # "#" reaches srun as it is
    assert "--container-mounts=/scratch:/scratch,/models" in argv
    assert "--container-workdir=/scratch/work" in argv
    assert ("--kill-on-bad-exit=1" in argv) == (role in ("update", "resident"))  # several tasks
    module = "hpcrl.resident" if role == "resident" else f"stages.{role}"
    assert argv[argv.index("python") + 1: argv.index("python") + 3] == ["-m", module]


@pytest.mark.parametrize("role", ["generate", "score", "update", "resident"])
def test_an_apptainer_job_runs_python_through_apptainer_exec(write_experiment, tmp_path, role):
    exp = _exp(write_experiment, "resident" if role == "resident" else "staged", container=APPTAINER)
    argv, _ = _execute(sbatch.render(_run(exp), exp, role, None if role == "resident" else 0), tmp_path)
    at = argv.index("apptainer")
    gpus = ["--nv"] if role != "score" else []  # the score role has no GPUs
    assert argv[at: at + 6 + len(gpus)] == ["apptainer", "exec", *gpus, "--bind", "/scratch",
                                            "/images/hpcrl 0.4.sif", "python"]


def test_a_role_env_overrides_the_default_key_by_key(write_experiment):
    exp = config.load(write_experiment("env", executor={
        "kind": "slurm", "env": {"setup": ["module load a"], "container": PYXIS},
        "update": {"env": {"python": "/opt/venv/bin/python"}},
        "score": {"env": {"setup": ["module load b"], "container": {"image": ""}}}}))
    update, score = job_env.role_env(exp.executor, "update"), job_env.role_env(exp.executor, "score")
    assert (update.setup, update.python) == (["module load a"], "/opt/venv/bin/python")
    assert update.container.image == PYXIS["image"]
    assert (score.setup, score.container.image) == (["module load b"], "")
    assert job_env.job_environment(exp, "score", 1).python == shlex.quote(sys.executable)


def _directives(script: str) -> dict[str, str]:
    found = {}
    for line in script.splitlines():
        if m := re.fullmatch(r"#SBATCH --([a-z-]+)(?:=(.*))?", line):
            found[m.group(1)] = shlex.split(m.group(2))[0] if m.group(2) else True
    return {k: v for k, v in found.items() if k not in ("output", "error")}  # two log layouts


@pytest.mark.parametrize("role", [*ROLES, "resident"])
def test_hand_rendered_and_submitted_scripts_agree(write_experiment, role):
    """Same resources, signal, open mode, requeue, preamble, srun options and interpreter."""
    exp = _exp(write_experiment, "resident" if role == "resident" else "staged", container=PYXIS)
    k = None if role in ("controller", "resident") else 0
    run = _run(exp)
    ex = executors.submitit_executor(run, exp, role, k)
    submitted = ex._make_submission_file_text(ex._submitit_command_str, "uid")  # what submit() writes
    by_hand = sbatch.render(run, exp, role, k)
    assert _directives(submitted) == _directives(by_hand)
    assert {"signal", "open-mode", "requeue"} <= _directives(by_hand).keys()
    setup = submitted.split("# setup\n")[1].split("\n\n")[0].splitlines()
    assert setup == SETUP and "\n".join(SETUP) in by_hand
    env = job_env.job_environment(exp, role, executors.tasks_for(exp, role) if role != "controller" else 1)
    srun_submitted = next(line for line in submitted.splitlines() if line.startswith("srun "))
    srun_by_hand = next(line for line in by_hand.splitlines() if line.startswith("srun "))
    for arg in env.srun_args:
        assert shlex.quote(arg) in srun_submitted.split() and shlex.quote(arg) in srun_by_hand.split()
    assert f" {env.python} -u -m submitit" in srun_submitted and f" {env.python} -m " in srun_by_hand


def test_notify_mail_reaches_the_controller_and_resident_jobs(write_experiment):
    exp = config.load(write_experiment("mail", executor={"kind": "slurm", "mode": "resident",
                                                         "notify": {"mail": "me@example.org"}}))
    for role in ("controller", "resident"):
        extra = executors.slurm_parameters(exp, role, "mail")["additional_parameters"]
        assert (extra["mail_type"], extra["mail_user"]) == ("END,FAIL", "me@example.org")
    assert "mail_type" not in executors.slurm_parameters(exp, "generate", "mail")["additional_parameters"]
    assert executors.slurm_parameters(exp, "update", "mail", 3)["job_name"] == "update-3-mail"
