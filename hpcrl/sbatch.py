"""Rendering the sbatch scripts of a run (sbatch/*.sbatch.j2) from its frozen config.

Resources come from executors.slurm_parameters, the same source the Slurm executor submits
with. Config values never reach a shell unquoted: #SBATCH values are checked against a safe
character set (a newline could otherwise start a command line), and paths on command lines are
shell-quoted.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import jinja2

from hpcrl import config, executors, job_env, plan
from hpcrl.config import SBATCH_OPTION, SBATCH_VALUE, ConfigError, Experiment
from hpcrl.rundir import RunDir

TEMPLATES = Path(__file__).resolve().parents[1] / "sbatch"
FLAG_NAMES = {"time": "time", "mem": "mem"}


def directives(params: dict, log_dir: Path) -> list[str]:
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
    if SBATCH_VALUE.fullmatch(str(log_dir)):  # else Slurm's default, slurm-<id>.out where sbatch was run
        lines.append(f"--output={log_dir}/%x-%j.out")
    return lines


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def render(run: RunDir, exp: Experiment, role: str, iteration: int | None = None) -> str:
    """The script of the controller, of the resident job (role "resident") or of one stage of one
    iteration."""
    params = executors.slurm_parameters(exp, role, run.root.name)
    if iteration is not None:
        params["job_name"] += f"-{iteration}"
    # what submitit adds to every job it submits: the pre-timeout signal and appending logs
    params["additional_parameters"].update(signal=f"USR2@{exp.executor.signal_delay_s}", open_mode="append")
    env = job_env.job_environment(exp, role, executors.tasks_for(exp, role) if role != "controller" else 1)
    ctx = {"directives": directives(params, run.logs), "python": env.python, "setup": env.setup,
           "srun_args": "".join(shlex.quote(a) + " " for a in env.srun_args),
           "run_dir": repr(str(run.root)), "run_dir_q": shlex.quote(str(run.root))}
    if role in ("controller", "resident"):
        return _env().get_template(f"{role}.sbatch.j2").render(**ctx)
    return _env().get_template("stage.sbatch.j2").render(stage=role, iteration=iteration, **ctx)


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
