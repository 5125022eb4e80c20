"""The [executor] section of the experiment config: where a run's jobs run and with what
resources. Its keys depend on `executor.mode`: the resident mode's keys are in
[executor.resident], which only a resident executor has (a union told apart by the mode).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from hpcrl.config_section import Rule, Section

SBATCH_OPTION = re.compile(r"[a-z][a-z0-9-]*")
SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%/+\-\[\]]*")



class SlurmResources(Section):
    partition: str = Field("", description="Slurm partition (empty: the cluster's default).")
    nodes: int = Field(1, ge=1, description="Nodes of the job; the update's ranks (update.world_size) are "
                       "spread evenly over them.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (gres gpu).")
    cpus_per_task: int = Field(2, ge=1, description="CPUs per task.")
    mem_gb: float = Field(0, ge=0, description="Memory per node in GB (0: the partition's default).")
    time_min: int = Field(60, ge=1, description="Time limit in minutes; the job is signalled before it and "
                          "requeued.")
    account: str = Field("", description="Slurm account.")
    qos: str = Field("", description="Slurm QOS.")
    constraint: str = Field("", description="Node features (--constraint).")
    extra: dict[str, str] = Field({}, description="More sbatch options, e.g. {exclude = \"n3\"}: each key an "
                                  "sbatch long option name, each value plain (letters, digits, "
                                  "_.,:=@%/+-[]); never run by a shell.")

    @field_validator("extra")
    @classmethod
    def _sbatch_options(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not SBATCH_OPTION.fullmatch(key):
                raise ValueError(f"{key!r} is not an sbatch option name (expected a long option without its "
                                 "dashes: lowercase letters, digits and '-', e.g. exclude)")
            if not SBATCH_VALUE.fullmatch(value):
                raise ValueError(f"sbatch option --{key} has the value {value!r}; expected only letters, "
                                 "digits and _.,:=@%/+-[] (no spaces, quotes or shell characters)")
        return v


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
                                  "the trainer on the probe batch after a sync (0: 1e-4 for float32, 2e-2 "
                                  "for 16-bit).")
    checkpoint_every: int = Field(1, ge=1, description="Save the policy and trainer state every N updates "
                                  "(and after the last); a crash resumes from the last saved one.")
    overlap_commit: bool = Field(True, description="Commit each update (and write its checkpoint) in the "
                                 "background while the next generation runs; that generation commits only "
                                 "after it. Off: the generator waits for the commit.")
    colocate: bool = Field(False, description="GPUs: the generator and the trainer share the GPUs; vLLM "
                           "sleeps (frees its memory) during each update.")
    stall_s: float = Field(20, gt=0, description="A task whose heartbeat stalls this long is taken as dead "
                           "and the job stops.")
    collective_timeout_s: float = Field(1800, gt=0, description="Timeout of every wait between tasks "
                                        "(commands, weight broadcast).")

    @model_validator(mode="after")
    def _shared_memory_on_one_node(self) -> ResidentConfig:
        if self.weight_sync == "shared_memory" and self.nodes > 1:
            raise Rule("weight_sync", f"\"shared_memory\" needs trainer 0 and the generator on one node, but "
                                      f"nodes = {self.nodes} puts them on different nodes; use "
                                      "\"process_group\"")
        return self


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
    controller: SlurmResources = Field(SlurmResources(cpus_per_task=1, time_min=1440),
                                       description="Slurm resources of the controller job.")
    generate: SlurmResources = Field(SlurmResources(), description="Slurm resources of generate jobs.")
    score: SlurmResources = Field(SlurmResources(), description="Slurm resources of score jobs.")
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
