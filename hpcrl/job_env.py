"""How a Slurm job of a role runs its command: the preamble, the Python command, the srun
options and the container, from [executor.env] and the role's own `env` ([executor.<role>.env],
key by key over the default). The one source for both paths: the Slurm executor hands it to
submitit (`setup`, `python`, `srun_args`) and `hpcrl sbatch` renders it into the scripts.

The controller calls sbatch, so it takes no container from [executor.env]: only one its own
`env.container` names (an image that has Slurm's client commands).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

from hpcrl.config import Experiment
from hpcrl.config_jobs import ContainerConfig, ExecutorConfig, JobEnv

# srun options of a job step with several tasks: one task that dies ends the step (and its job)
# at once instead of leaving the others in a collective until its timeout; the others get 60 s.
MULTI_TASK_SRUN = ("--kill-on-bad-exit=1", "--wait=60")


@dataclass(frozen=True)
class JobEnvironment:
    setup: tuple[str, ...]  # shell lines before the step
    python: str  # a shell command (quoted words) that runs Python
    srun_args: tuple[str, ...]  # srun options (each one argument; scripts quote them)


def role_env(executor: ExecutorConfig, role: str) -> JobEnv:
    """The role's env: its own keys where it sets them, [executor.env]'s elsewhere."""
    default, own = executor.env, getattr(executor, role).env
    if role == "controller":
        default = default.model_copy(update={"container": ContainerConfig()})
    if own is None:
        return default
    return default.model_copy(update={key: getattr(own, key) for key in own.model_fields_set})


def job_environment(exp: Experiment, role: str, tasks: int) -> JobEnvironment:
    """The preamble, the Python command and the srun options of a job of `role` with `tasks` tasks."""
    env = role_env(exp.executor, role)
    c = env.container
    python = env.python or ("python" if c.image else shlex.quote(sys.executable))
    srun = list(MULTI_TASK_SRUN if tasks > 1 else ()) + list(env.srun_args)
    if role == "resident" and exp.executor.resident.generator is not None:
        srun.insert(0, "--het-group=0,1")  # one step over both components: trainers, then the generator
    if c.image and c.runtime == "pyxis":
        srun.append(f"--container-image={c.image}")
        if c.mounts:
            srun.append(f"--container-mounts={','.join(c.mounts)}")
        if c.workdir:
            srun.append(f"--container-workdir={c.workdir}")
    elif c.image:  # apptainer
        gpus = getattr(exp.executor, role).gpus_per_node > 0
        words = ["apptainer", "exec", *(["--nv"] if gpus else [])]
        for mount in c.mounts:
            words += ["--bind", mount]
        if c.workdir:
            words += ["--pwd", c.workdir]
        python = f"{shlex.join([*words, c.image])} {python}"
    return JobEnvironment(tuple(env.setup), python, tuple(srun))
