"""The [executor] section of the experiment config: where a run's jobs run and with what
resources. Its keys depend on `executor.mode`: the resident mode's keys are in
[executor.resident], which only a resident executor has (a union told apart by the mode).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from hpcrl.config_section import HttpUrl, Rule, Section

SBATCH_OPTION = re.compile(r"[a-z][a-z0-9-]*")
SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%/+\-\[\]]*")


class ContainerConfig(Section):
    image: str = Field("", description="The image the role's job steps run in (empty: none): for Pyxis an "
                       "enroot image (\"registry#hpcrl:0.4\", docker://..., or a .sqsh file), for Apptainer "
                       "a .sif file or URI. Any characters; scripts quote it.")
    runtime: Literal["pyxis", "apptainer"] = Field(
        "pyxis", description="`pyxis`: `srun --container-image=...` (Slurm's Pyxis plugin). `apptainer`: the "
        "step runs `apptainer exec [--nv] --bind ... IMAGE python ...` (--nv when the role has GPUs).")
    mounts: list[str] = Field([], description="Host paths visible inside, each \"src:dst\" (or \"path\"): "
                              "run.runs_root, the model and the data must be at the same paths inside.")
    workdir: str = Field("", description="Working directory inside the container (empty: the runtime's "
                         "default).")


class JobEnv(Section):
    setup: list[str] = Field([], description="Shell lines a job runs before its command, in the batch script "
                             "(module load, conda activate, export ...), run by the job's own shell.")
    python: str = Field("", description="The command that runs Python on the compute node (shell words, e.g. "
                        "\"/opt/venv/bin/python\"); empty: the interpreter that submitted, or `python` in a "
                        "container.")
    srun_args: list[str] = Field([], description="More srun options for the job's step, e.g. "
                                 "[\"--cpu-bind=cores\"].")
    container: ContainerConfig = Field(ContainerConfig(), description="A container image for the job's steps "
                                       "(image empty: none).")

    @field_validator("setup", "srun_args", "python")
    @classmethod
    def _no_nul(cls, v):
        if any("\x00" in s for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("a NUL character cannot reach a shell script")
        return v


class SlurmResources(Section):
    partition: str = Field("", description="Slurm partition (empty: the cluster's default).")
    nodes: int = Field(1, ge=1, description="Nodes of the job; the update's ranks (update.world_size) are "
                       "spread evenly over them.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (gres gpu); with the local executor, "
                               "the GPUs of this machine the job is given (0: none, CPU only).")
    cpus_per_task: int = Field(2, ge=1, description="CPUs per task.")
    mem_gb: float = Field(0, ge=0, description="Memory per node in GB (0: the partition's default).")
    time_min: int = Field(60, ge=1, description="Time limit in minutes; the job is signalled before it and "
                          "requeued.")
    account: str = Field("", description="Slurm account.")
    qos: str = Field("", description="Slurm QOS.")
    constraint: str = Field("", description="Node features (--constraint).")
    extra: dict[str, str | bool] = Field(
        {}, description="More sbatch options, e.g. {exclude = \"n3\", exclusive = true}: each key an sbatch "
        "long option name, each value plain (letters, digits, _.,:=@%/+-[]) or true for a bare flag; never "
        "run by a shell.")
    env: JobEnv | None = Field(None, description="This role's job environment, key by key over "
                               "[executor.env] (the controller takes no container from there).")

    @field_validator("extra")
    @classmethod
    def _sbatch_options(cls, v: dict[str, str | bool]) -> dict[str, str | bool]:
        for key, value in v.items():
            if not SBATCH_OPTION.fullmatch(key):
                raise ValueError(f"{key!r} is not an sbatch option name (expected a long option without its "
                                 "dashes: lowercase letters, digits and '-', e.g. exclude)")
            if value is False:
                raise ValueError(f"sbatch option --{key} = false: leave the key out instead")
            if value is not True and not SBATCH_VALUE.fullmatch(value):
                raise ValueError(f"sbatch option --{key} has the value {value!r}; expected only letters, "
                                 "digits and _.,:=@%/+-[] (no spaces, quotes or shell characters)")
        return v


class NotifyConfig(Section):
    mail: str = Field("", description="Slurm mails this address when the controller job or the resident job "
                      "ends or fails (--mail-type=END,FAIL; the cluster must have mail set up).")
    webhook: HttpUrl = Field("", description="POST {\"run\", \"status\": \"completed\" | \"stopped\", "
                         "\"reason\"} here when the run completes or stops (a failure, an alert rule, an "
                         "interruption); empty: none. Never stops the run.")

    @field_validator("mail")
    @classmethod
    def _plain(cls, v: str) -> str:
        if not SBATCH_VALUE.fullmatch(v):
            raise ValueError(f"{v!r} is not a plain mail address (letters, digits, _.,:=@%/+-)")
        return v


class GeneratorNode(Section):
    partition: str = Field("", description="The generator's partition (empty: executor.resident.partition).")
    gpus_per_node: int = Field(0, ge=0, description="GPUs of the generator's node (at least "
                               "generate.tensor_parallel_size).")
    cpus_per_task: int = Field(8, ge=1, description="CPUs of the generator task.")
    mem_gb: float = Field(0, ge=0, description="Memory of the generator's node in GB (0: the partition's "
                          "default).")
    constraint: str = Field("", description="Node features of the generator's node (--constraint).")


class ResidentConfig(SlurmResources):
    time_min: int = Field(1440, ge=1, description="Time limit in minutes; the job is signalled before it and "
                          "requeued.")
    weight_sync: Literal["auto", "process_group", "shared_memory", "filesystem"] = Field(
        "auto", description="How new weights reach vLLM (hpcrl/transports.py): broadcast over a process "
        "group (gloo on CPU, NCCL on GPUs; any nodes), copied through one shared-memory buffer (trainer 0 "
        "and the generator on one node; the fastest on CPU), or written to disk and reloaded. `auto`: shared "
        "memory on one node without GPUs, else the process group.")
    sync_bucket_mb: float = Field(64, ge=0, description="Weight-sync bucket size in MB (0: one broadcast per "
                                  "tensor).")
    sync_check_tol: float = Field(0.0, ge=0, description="Largest mean |logprob difference| between vLLM and "
                                  "the trainer on the probe batch after a sync (0: 1e-4 for float32, 1e-1 "
                                  "for 16-bit, where the two differ by up to 2.6e-2 on CPU).")
    checkpoint_every: int = Field(1, ge=1, description="Save the policy and trainer state every N updates "
                                  "(and after the last); a crash resumes from the last saved one.")
    overlap_commit: bool = Field(True, description="Commit each update (and write its checkpoint) in the "
                                 "background after its weights are sent, while the next generation runs; "
                                 "that generation commits only after it (with max_staleness > 0: where the "
                                 "weights go out as soon as the update ends, over shared memory or files). "
                                 "Off: the commit comes first.")
    overlap_score: bool = Field(True, description="With algorithm.max_staleness >= 1: score each generation "
                                "on a thread beside the next one, and command its update as soon as it is "
                                "scored, so slow rewards (a sandbox, a judge) keep no device waiting. Off: "
                                "the generator scores between two generations.")
    colocate: bool = Field(False, description="GPUs: the generator and the trainer share the GPUs; vLLM "
                           "sleeps (frees its memory) during each update, and the trainers move their state "
                           "to CPU memory while vLLM generates (docs/resident.md).")
    gpu_memory_gib: float = Field(0, ge=0, description="Memory of each GPU in GiB: with colocate, what each "
                                  "phase of an iteration holds is checked against it at submit (0: at the "
                                  "job's start, against the device's).")
    stall_s: float = Field(20, gt=0, description="A task whose heartbeat stalls this long is taken as dead "
                           "and the job stops.")
    collective_timeout_s: float = Field(1800, gt=0, description="Timeout of every wait between tasks "
                                        "(commands, weight broadcast).")
    generator: GeneratorNode | None = Field(
        None, description="Set: the generator runs on a node of its own with these resources, the trainers "
        "(update.world_size tasks) on `nodes` nodes with the keys above: one heterogeneous Slurm job "
        "(`#SBATCH hetjob`). Unset: all update.world_size + 1 tasks spread evenly over `nodes`.")

    @model_validator(mode="after")
    def _shared_memory_on_one_node(self) -> ResidentConfig:
        if self.generator is not None and self.colocate:
            raise Rule("colocate", "the generator has a node of its own ([executor.resident.generator]), so "
                                   "it cannot share the trainers' GPUs; expected colocate = false")
        if self.weight_sync == "shared_memory" and (self.nodes > 1 or self.generator is not None):
            raise Rule("weight_sync", f"\"shared_memory\" needs trainer 0 and the generator on one node, but "
                                      f"nodes = {self.nodes} puts them on different nodes; use "
                                      "\"process_group\"")
        return self


class ScoreResources(SlurmResources):
    tasks: int = Field(1, ge=1, description="Tasks sharing each score stage (staged mode): a job array of "
                       "this many, each with these resources, each scoring a contiguous part of the "
                       "rollouts (slow reward functions, sandboxes). Reward functions and services give "
                       "the same scores whatever the number; a reward model's may differ in the last bits "
                       "(its batches change).")


def _mode(value: str) -> Any:
    return Field(value, description="`staged`: each stage is its own job. `resident`: one job keeps the "
                 "trainer ranks, the vLLM generator and the reward workers up for the whole run and streams "
                 "weights from the trainer to vLLM ([executor.resident]).")


class ExecutorBase(Section):
    kind: Literal["local", "slurm"] = Field("local", description="Where stage jobs run: `local` (submitit "
                                            "LocalExecutor on this machine) or `slurm` (a Slurm job per "
                                            "stage).")
    mode: Literal["staged", "resident"] = _mode("staged")
    max_retries: int = Field(1, ge=0, description="Retries of a failed stage before the run stops.")
    timeout_min: int = Field(60, ge=1, description="Time limit of one local stage job in minutes.")
    lookahead: int = Field(2, ge=0, description="Slurm: stages submitted ahead of the running one with "
                           "afterok dependencies.")
    env: JobEnv = Field(JobEnv(), description="Slurm: how every job runs its command (a preamble, the "
                        "interpreter, srun options, a container); a role's own `env` overrides it key by "
                        "key.")
    signal_delay_s: int = Field(90, ge=10, description="Slurm: seconds before its time limit that a job is "
                                "signalled (USR2): the update saves its progress, and the job is requeued.")
    notify: NotifyConfig = Field(NotifyConfig(), description="Telling people that a run ended.")
    max_requeues: int = Field(3, ge=0, description="Slurm: time-limit requeues of one job before it is left "
                              "to end (submitit's max_num_timeout; the same budget for scripts submitted by "
                              "hand, counted by SLURM_RESTART_COUNT).")
    controller: SlurmResources = Field(SlurmResources(cpus_per_task=1, time_min=1440),
                                       description="Slurm resources of the controller job.")
    generate: SlurmResources = Field(SlurmResources(), description="Slurm resources of generate jobs.")
    score: ScoreResources = Field(ScoreResources(), description="Slurm resources of score jobs.")
    update: SlurmResources = Field(SlurmResources(), description="Slurm resources of update jobs.")


class StagedExecutor(ExecutorBase):
    mode: Literal["staged"] = _mode("staged")


class ResidentExecutor(ExecutorBase):
    mode: Literal["resident"] = _mode("resident")
    resident: ResidentConfig = Field(ResidentConfig(), description="executor.mode = \"resident\" only: the "
                                     "resident job (update.world_size trainer tasks + 1 generator task, "
                                     "spread evenly over its nodes): its Slurm resources and how it runs.")


def _executor_mode(value: Any) -> str:
    return value.get("mode", "staged") if isinstance(value, dict) else getattr(value, "mode", "staged")


ExecutorConfig = Annotated[Annotated[StagedExecutor, Tag("staged")] |
                           Annotated[ResidentExecutor, Tag("resident")],
                           Discriminator(_executor_mode)]
