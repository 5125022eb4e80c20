"""Executors: how a stage becomes a job. `local` runs it as its own process with submitit's
LocalExecutor; `slurm` makes it a Slurm job with submitit's SlurmExecutor, with the stage's
resources from the config. The stage is named by its module path (`stages.generate`); hpcrl
never imports stages/ itself. Stage jobs are requeueable: a stage is idempotent and commits
atomically, so a requeued or retried job simply runs again.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import submitit

from hpcrl import commit, job_env, stage_kinds
from hpcrl.config import Experiment
from hpcrl.config_jobs import ExecutorConfig
from hpcrl.distributed import free_port
from hpcrl.rundir import RunDir


def run_stage_module(module: str, run_dir: str, iteration: int, shard: tuple[int, int] | None = None) -> None:
    """What every stage job executes: `python -m <module> --run-dir R --iteration K [--shard I/N]`,
    in-process."""
    argv = ["--run-dir", run_dir, "--iteration", str(iteration)]
    importlib.import_module(module).main(argv + (["--shard", f"{shard[0]}/{shard[1]}"] if shard else []))


class StageCall(submitit.helpers.Checkpointable):
    """A stage as a submitit callable; on the time-limit or preemption signal submitit requeues it
    (nothing of an interrupted stage is committed, so it starts over)."""

    def __init__(self, module: str, run_dir: str, iteration: int, shard: tuple[int, int] | None = None):
        self.module, self.run_dir, self.iteration, self.shard = module, run_dir, iteration, shard

    def __call__(self) -> None:
        from hpcrl.stage import skip_final_collection

        run_stage_module(self.module, self.run_dir, self.iteration, self.shard)
        skip_final_collection()


def slurm_parameters(exp: Experiment, role: str, run_name: str, iteration: int | None = None) -> dict:
    """sbatch parameters of a role (controller, generate, score, update, resident), in submitit's
    names; the job's name leads with the role and iteration (what `squeue` shows first).

    The one source of a job's resources: the Slurm executor and `hpcrl sbatch` both use it.
    """
    r = getattr(exp.executor, role)
    name = f"{role}-{iteration}-{run_name}" if iteration is not None else f"{role}-{run_name}"
    tasks = tasks_for(exp, role) // r.nodes if role != "controller" else 1
    if generator_node(exp.executor, role) is not None:  # a heterogeneous job's first component: the trainers
        tasks = exp.update.world_size // r.nodes
    params: dict = {"job_name": name, "nodes": r.nodes, "ntasks_per_node": tasks,
                    "cpus_per_task": r.cpus_per_task, "time": r.time_min,
                    "additional_parameters": {"requeue": True, **r.extra}}
    if role == "controller" or (role == "resident" and generator_node(exp.executor, role) is None):
        # one at a time per run (the job name holds the run's); not a heterogeneous job, whose
        # second component would wait on its first for ever
        params["dependency"] = "singleton"
        if exp.executor.notify.mail:
            params["additional_parameters"].update(mail_type="END,FAIL", mail_user=exp.executor.notify.mail)
    if r.gpus_per_node:
        params["gpus_per_node"] = r.gpus_per_node
    if r.mem_gb:
        params["mem"] = f"{int(r.mem_gb * 1024)}M"
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(r, key):
            params[key] = getattr(r, key)
    return params


def generator_node(ex: ExecutorConfig, role: str):
    """The resident generator's own node ([executor.resident.generator]), if it has one."""
    if role != "resident" or ex.mode != "resident" or ex.kind != "slurm":
        return None
    return ex.resident.generator


def generator_component(ex: ExecutorConfig) -> dict:
    """sbatch parameters (submitit's names) of a heterogeneous resident job's second component."""
    g, r = ex.resident.generator, ex.resident
    params: dict = {"nodes": 1, "ntasks_per_node": 1, "cpus_per_task": g.cpus_per_task}
    if g.partition or r.partition:
        params["partition"] = g.partition or r.partition
    if g.gpus_per_node:
        params["gpus_per_node"] = g.gpus_per_node
    if g.mem_gb:
        params["mem"] = f"{int(g.mem_gb * 1024)}M"
    if g.constraint:
        params["constraint"] = g.constraint
    return params


def submitit_executor(run: RunDir, exp: Experiment, role: str, iteration: int | None = None,
                      after: Sequence[str] = ()) -> submitit.SlurmExecutor:
    """submitit's executor for one job of `role`: the resources, the job environment
    (hpcrl.job_env), the signal and the requeue budget; after every job in `after` succeeds."""
    params = slurm_parameters(exp, role, run.root.name, iteration)
    if after:  # and if one of them fails, this one leaves the queue at once
        params["dependency"] = "afterok:" + ":".join(after)
        params["additional_parameters"]["kill_on_invalid_dep"] = "yes"
    env = job_env.job_environment(exp, role, tasks_for(exp, role) if role != "controller" else 1)
    ex = submitit.SlurmExecutor(folder=run.logs / "%j", python=env.python,
                                max_num_timeout=exp.executor.max_requeues)
    ex.update_parameters(**params, setup=list(env.setup), srun_args=list(env.srun_args),
                         signal_delay_s=exp.executor.signal_delay_s, wckey=None)
    return ex


def tasks_for(exp: Experiment, stage: str) -> int:
    """Tasks of a stage's job: one per trainer rank for a kind that runs on them, one otherwise;
    the resident job: the trainers and the engines."""
    if stage == "resident":
        return exp.update.world_size + exp.generate.engines
    return exp.update.world_size if stage_kinds.kind(stage).on_trainers else 1


def _calls(run: RunDir, exp: Experiment, stage: str, iteration: int | None) -> list:
    """The callables of a stage's job (an array of one per shard still to commit, for a stage that
    runs in shards), or (stage "resident") the whole resident loop."""
    if stage == "resident":
        from hpcrl.resident import ResidentCall

        return [ResidentCall(str(run.root))]
    module = stage_kinds.kind(stage).module
    return [StageCall(module, str(run.root), iteration, shard)
            for shard in shards_to_run(run, exp, stage, iteration)]


def shards_to_run(run: RunDir, exp: Experiment, stage: str, iteration: int) -> list[tuple[int, int] | None]:
    """The shards (i, n) of a stage still to commit (hpcrl.shards), or
    [None] for a stage that runs whole. When every shard is committed but the stage is not (its
    merge was interrupted), shard 0 again: it finds its shard committed and merges."""
    n = stage_kinds.kind(stage).shards(exp)
    if n == 1:
        return [None]
    todo = [(i, n) for i in range(n) if not commit.is_committed(run.shard_dir(iteration, stage, i, n))]
    return todo or [(0, n)]


def submit_all(ex, calls: list):
    """One job, or one job array (a task per call; each is its own Slurm job, which `afterok`
    on the array's id waits for as a whole)."""
    if len(calls) == 1:
        return ex.submit(calls[0])
    with ex.batch():
        jobs = [ex.submit(call) for call in calls]
    return ArrayJob(jobs)


class ArrayJob:
    """The jobs of one stage's shards, followed as one submitit job: done when every one is, its
    error the first one's, its id the array's."""

    def __init__(self, jobs: list):
        self.jobs = jobs
        self.job_id = str(jobs[0].job_id).split("_")[0]
        self.paths = jobs[0].paths
        self.num_tasks = len(jobs)

    def done(self) -> bool:
        return all(j.done() for j in self.jobs)

    def exception(self) -> BaseException | None:
        return next((e for j in self.jobs if (e := j.exception()) is not None), None)

    def cancel(self, check: bool = False) -> None:
        for j in self.jobs:
            j.cancel(check=check)

    def task(self, i: int):
        return self.jobs[i]

    def get_info(self, mode: str = "force") -> dict:
        nodes = {getattr(j, "get_info", lambda mode: {})(mode).get("NodeList") for j in self.jobs}
        return {"NodeList": ",".join(sorted(n for n in nodes if n))}


@dataclass
class StageJob:
    """A submitted stage job (or the resident job: stage "resident"), whatever the executor."""

    job: object  # submitit.Job
    stage: str
    iteration: int | None

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def array(self) -> int:
        """The tasks of a job array (a stage's shards); 0 for a plain job."""
        return len(self.job.jobs) if isinstance(self.job, ArrayJob) else 0

    def done(self) -> bool:
        return self.job.done()

    def error(self) -> BaseException | None:
        return self.job.exception()

    def cancel(self) -> None:
        self.job.cancel(check=False)

    def where(self) -> str:
        """", node X" for a Slurm job whose node is known, else ""."""
        info = getattr(self.job, "get_info", None)
        node = info(mode="force").get("NodeList") if info else None
        return f", node {node}" if node and node not in ("None", "None assigned") else ""

    def log_paths(self) -> tuple[Path, Path]:
        return Path(self.job.paths.stdout), Path(self.job.paths.stderr)

    def stderr_tail(self, lines: int = 20) -> str:
        """The last lines of the job's stderr (of each task, when it has several)."""
        tasks = getattr(self.job, "num_tasks", 1)
        if tasks <= 1:
            return _tail(self.log_paths()[1], lines)
        return "\n".join(f"[task {i}: {self.job.task(i).paths.stderr}]\n"
                         f"{_tail(self.job.task(i).paths.stderr, lines)}" for i in range(tasks))


def _tail(path, lines: int) -> str:
    path = Path(path)
    if not path.is_file():
        return "(no stderr file)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class LocalExecutor:
    """Each stage is its own process on this machine (submitit.LocalExecutor); one at a time."""

    lookahead = 0

    def __init__(self, run: RunDir, exp: Experiment):
        self.exp = exp
        self.run = run
        self._ex = submitit.LocalExecutor(folder=run.logs / "%j")

    def submit(self, stage: str, iteration: int | None, after: Sequence[StageJob] = ()) -> StageJob:
        timeout = (self.exp.executor.resident.time_min if stage == "resident"
                   else self.exp.executor.timeout_min)
        self._ex.update_parameters(timeout_min=timeout, tasks_per_node=tasks_for(self.exp, stage),
                                   **local_gpus(self.exp, stage))
        # The ranks of a local job meet on a port free now (submitit would derive one from the pid).
        saved = os.environ.get("MASTER_PORT")
        os.environ["MASTER_PORT"] = str(free_port())
        try:
            job = submit_all(self._ex, _calls(self.run, self.exp, stage, iteration))
        finally:
            if saved is None:
                del os.environ["MASTER_PORT"]
            else:
                os.environ["MASTER_PORT"] = saved
        return StageJob(job, stage, iteration)


def local_gpus(exp: Experiment, stage: str, visible: str | None = None) -> dict:
    """submitit's GPU parameters of a local stage job: executor.<stage>.gpus_per_node of the GPUs
    this process sees (CUDA_VISIBLE_DEVICES, by index; all of the machine's when unset). submitit
    sets the job's CUDA_VISIBLE_DEVICES to them: none for a role with no GPUs, as on Slurm.
    hpcrl.preflight checks that the machine has them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    params: dict = {"gpus_per_node": getattr(exp.executor, stage).gpus_per_node}
    if visible is not None and params["gpus_per_node"]:
        params["visible_gpus"] = [int(v) for v in visible.split(",") if v.strip()]
    return params


class SlurmExecutor:
    """Each stage is a Slurm job with its own resources; later stages can wait in the queue
    behind earlier ones with afterok dependencies."""

    def __init__(self, run: RunDir, exp: Experiment):
        self.exp = exp
        self.run = run
        self.lookahead = exp.executor.lookahead

    def submit(self, stage: str, iteration: int | None, after: Sequence[StageJob] = ()) -> StageJob:
        ex = submitit_executor(self.run, self.exp, stage, iteration, [job.job_id for job in after])
        return StageJob(submit_all(ex, _calls(self.run, self.exp, stage, iteration)), stage, iteration)

    def adopt(self, job_id: str, stage: str, iteration: int | None, array: int = 0) -> StageJob:
        """A job submitted earlier (by a controller before this one), followed as if submitted now;
        `array`: its tasks, for a job array (a stage's shards)."""
        def job(jid: str):
            return submitit.SlurmJob(folder=self.run.logs / "%j", job_id=jid,
                                     tasks=range(tasks_for(self.exp, stage)))

        return StageJob(ArrayJob([job(f"{job_id}_{i}") for i in range(array)]) if array else job(job_id),
                        stage, iteration)

    def cancel(self, job_id: str) -> None:
        submitit.SlurmJob(folder=self.run.logs / "%j", job_id=job_id).cancel(check=False)


def make(run: RunDir, exp: Experiment) -> LocalExecutor | SlurmExecutor:
    return {"local": LocalExecutor, "slurm": SlurmExecutor}[exp.executor.kind](run, exp)

