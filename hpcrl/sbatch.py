"""Rendering the sbatch scripts of a run (sbatch/*.sbatch.j2) from its frozen config.

Resources come from executors.slurm_parameters, the same source the Slurm executor submits
with. Config values never reach a shell unquoted: #SBATCH values are checked against a safe
character set (a newline could otherwise start a command line), and paths on command lines are
shell-quoted.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import jinja2

from hpcrl import config, executors, job_env, plan, stage_kinds
from hpcrl.config import SBATCH_OPTION, SBATCH_VALUE, ConfigError, Experiment
from hpcrl.rundir import RunDir

TEMPLATES = Path(__file__).resolve().parents[1] / "sbatch"
FLAG_NAMES = {"time": "time", "mem": "mem"}


def directives(params: dict, log_dir: Path | None) -> list[str]:
    """#SBATCH lines (without the prefix) for submitit-style parameters."""
    flat = {k: v for k, v in params.items() if k != "additional_parameters"}
    flat.update(params.get("additional_parameters", {}))
    lines = []
    for key, value in flat.items():
        flag = "--" + FLAG_NAMES.get(key, key.replace("_", "-"))
        if not SBATCH_OPTION.fullmatch(flag[2:]):
            raise ConfigError(f"executor: {flag!r} is not an sbatch option name")
        if value is True:
            lines.append(flag)
            continue
        text = str(value)
        if not SBATCH_VALUE.fullmatch(text):
            raise ConfigError(f"executor: sbatch option {flag} has the value {text!r}; expected only "
                              "letters, digits and _.,:=@%/+-[] (no spaces, quotes or shell characters)")
        lines.append(f"{flag}={text}")
    if log_dir is not None and SBATCH_VALUE.fullmatch(str(log_dir)):  # else slurm-<id>.out where sbatch ran
        lines.append(f"--output={log_dir}/%x-%j.out")
    return lines


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def render(run: RunDir, exp: Experiment, role: str, iteration: int | None = None) -> str:
    """The script of the controller, of the resident job (role "resident") or of one stage of one
    iteration."""
    params = executors.slurm_parameters(exp, role, run.root.name, iteration)
    # what submitit adds to every job it submits: the pre-timeout signal and appending logs
    params["additional_parameters"].update(signal=f"USR2@{exp.executor.signal_delay_s}", open_mode="append")
    shards = stage_kinds.kind(role).shards(exp) if role in stage_kinds.KINDS else 1
    if shards > 1:  # a task per shard, each committing its own (hpcrl.shards)
        params["additional_parameters"]["array"] = f"0-{shards - 1}"
    env = job_env.job_environment(exp, role, executors.tasks_for(exp, role) if role != "controller" else 1)
    lines = directives(params, run.logs)
    if executors.generator_node(exp.executor, role) is not None:  # a heterogeneous job: the generator's node
        lines += ["hetjob", *directives(executors.generator_component(exp.executor), None)]
    ctx = {"directives": lines, "python": env.python, "setup": env.setup,
           "srun_args": "".join(shlex.quote(a) + " " for a in env.srun_args),
           "run_dir": repr(str(run.root)), "run_dir_q": shlex.quote(str(run.root))}
    if role in ("controller", "resident"):
        return _env().get_template(f"{role}.sbatch.j2").render(**ctx)
    template = _env().get_template("stage.sbatch.j2")
    return template.render(stage=role, iteration=iteration, shards=shards, **ctx)


def write_all(run: RunDir, exp: Experiment, out: Path) -> list[Path]:
    """The resolved config and every script of the run (controller and each stage) under `out`
    (replaced), for reading: a dry run writes nothing in the run directory itself."""
    scripts = {"controller.sbatch": render(run, exp, "controller")}
    if exp.executor.mode == "resident":
        scripts["resident.sbatch"] = render(run, exp, "resident")
    else:
        scripts.update({f"iter_{k:06d}-{stage}.sbatch": render(run, exp, stage, k)
                        for k, stage in plan.all_stages(exp)})
    shutil.rmtree(out, ignore_errors=True)
    (out / "sbatch").mkdir(parents=True)
    paths = [out / "experiment.toml"]
    paths[0].write_text("# Resolved config of a dry run (written by hpcrl submit --dry-run).\n"
                        + config.dumps(exp))
    for name, text in scripts.items():
        paths.append(out / "sbatch" / name)
        paths[-1].write_text(text)
    return paths


def test_only(paths: list[Path]) -> list[tuple[Path, bool, str]]:
    """`sbatch --test-only` on one script per kind of job (the first of each role): (script,
    accepted, Slurm's answer)."""
    seen, out = set(), []
    for path in paths:
        role = path.stem.split("-")[-1]  # controller, resident, iter_000000-<stage>
        if role in seen:
            continue
        seen.add(role)
        answer = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True,
                                timeout=60)
        text = (answer.stderr or answer.stdout).strip().splitlines()
        out.append((path, answer.returncode == 0, text[-1] if text else f"exit {answer.returncode}"))
    return out


def submit(run: RunDir, exp: Experiment, role: str) -> executors.StageJob:
    """A job as `render` writes it, submitted with sbatch: for what submitit cannot submit (a
    heterogeneous resident job). Its output: logs/<job name>-<job id>.out."""
    run.logs.mkdir(parents=True, exist_ok=True)
    path = run.logs / f"{role}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(render(run, exp, role))
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60,
                         cwd=run.logs)
    if out.returncode:
        raise RuntimeError(f"sbatch {path} failed: {out.stderr.strip()}")
    return follow(run, exp, role, out.stdout.strip().split(";")[0])


def follow(run: RunDir, exp: Experiment, role: str, job_id: str) -> executors.StageJob:
    """A job `submit` submitted (now or by an earlier controller), as the controller follows jobs."""
    name = executors.slurm_parameters(exp, role, run.root.name)["job_name"]
    return executors.StageJob(ScriptJob(job_id, run.logs / f"{name}-{job_id}.out"), role, None)


class ScriptJob:
    """A job submitted as a script with sbatch (a heterogeneous resident job), followed through
    sacct (asked at most every `poll_s`): what StageJob needs of a submitit job."""

    num_tasks = 1  # one log file holds every task's output

    def __init__(self, job_id: str, log: Path, poll_s: float = 10):
        self.job_id, self.paths = job_id, SimpleNamespace(stdout=log, stderr=log)
        self.poll_s, self._asked, self._info = poll_s, -float("inf"), {}

    def get_info(self, mode: str = "") -> dict:
        """sacct's line of the job (asked again when `mode` is "force" or the last answer is old)."""
        from hpcrl import slurm

        if mode == "force" or time.monotonic() - self._asked > self.poll_s:
            self._info = slurm.accounting([self.job_id]).get(self.job_id, {})
            self._asked = time.monotonic()
        return self._info

    def _state(self) -> str:
        return (self.get_info().get("State") or "PENDING").split(" ")[0]

    def done(self) -> bool:
        from hpcrl.adoption import LIVE

        return self._state() not in LIVE

    def exception(self) -> BaseException | None:
        state = self._state()
        return None if state == "COMPLETED" else RuntimeError(f"job {self.job_id} ended {state}")

    def cancel(self, check: bool = False) -> None:
        subprocess.run(["scancel", self.job_id], check=check, timeout=60)
