"""The Megatron-Core update backend's config section ([update.megatron]) and the rules an experiment
must follow to run on it (update.backend = "megatron", hpcrl.megatron_actor)."""

from __future__ import annotations

from pydantic import Field

from hpcrl.config_section import Rule, Section


class MegatronConfig(Section):
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel ranks per model replica: each layer's "
                                 "weights split over them (attention by query group, the MLP and the "
                                 "vocabulary by rows or columns).")
    pipeline_parallel: int = Field(1, ge=1, description="Pipeline stages per model replica: consecutive "
                                   "layers on each, the micro-batches of a step run through them by 1F1B.")
    distributed_optimizer: bool = Field(False, description="Megatron's distributed optimizer: the AdamW "
                                        "state and the fp32 master weights split over the data-parallel "
                                        "ranks (as ZeRO-1); the same update.")

    @property
    def model_parallel(self) -> int:
        """Ranks per model replica."""
        return self.tensor_parallel * self.pipeline_parallel


def check(exp) -> None:
    """Refuse, naming the key, what the Megatron backend does not run (or runs differently)."""
    u, a = exp.update, exp.algorithm
    m = u.megatron
    if u.world_size % m.model_parallel:
        raise Rule("update.world_size", f"update.backend = \"megatron\": {u.world_size} ranks do not split "
                   f"into replicas of update.megatron.tensor_parallel x pipeline_parallel = "
                   f"{m.model_parallel} ranks")
    refused = [
        (exp.model.dtype == "float16", "model.dtype", "\"float16\" needs loss scaling, which the Megatron "
         "backend does not run; expected \"bfloat16\" or \"float32\""),
        (a.critic is not None, "algorithm.name", "\"ppo\" needs a critic, which the Megatron backend does "
         "not train yet; expected a critic-free algorithm (grpo, rloo, ...)"),
        (a.kl.coef > 0, "algorithm.kl.coef", "a reference model is not kept by the Megatron backend yet; "
         "expected 0"),
        (u.lora.rank > 0, "update.lora.rank", "LoRA adapters train on the DeepSpeed backend only; "
         "expected 0"),
        (u.sequence_parallel > 1, "update.sequence_parallel", "Ulysses sequence parallelism is the "
         "DeepSpeed backend's; expected 1"),
        (u.max_tokens_per_micro_batch > 0, "update.max_tokens_per_micro_batch", "packed micro-batches are "
         "the DeepSpeed backend's; expected 0"),
        (u.gradient_checkpointing, "update.gradient_checkpointing", "not on the Megatron backend yet; "
         "expected false"),
        (u.offload != "none", "update.offload", "DeepSpeed's offload; expected \"none\" (or "
         "update.megatron.distributed_optimizer for the optimizer state)"),
        (u.moe_aux_loss_coef > 0, "update.moe_aux_loss_coef", "mixture-of-experts models train on the "
         "DeepSpeed backend only; expected 0"),
        (exp.executor.mode == "resident" and exp.executor.resident.colocate, "executor.resident.colocate",
         "moving a Megatron trainer's state off the GPU for vLLM is not built yet; expected false"),
    ]
    rows = a.prompts_per_iteration * a.group_size // (u.world_size // m.model_parallel)  # per replica
    step = rows // u.mini_batches
    if m.pipeline_parallel > 1 and any(n % min(u.micro_batch_size, n) for n in (rows, step)):
        raise Rule("update.micro_batch_size", f"update.backend = \"megatron\": the pipeline's micro-batches "
                   f"must all have one size; expected a divisor of each replica's {rows} rows and of its "
                   f"{step} rows per optimizer step (got {u.micro_batch_size})")
    for broken, key, message in refused:
        if broken:
            raise Rule(key, f"update.backend = \"megatron\": {message}")


def rank_of(tp: int, dp: int, pp: int, m: MegatronConfig, replicas: int) -> int:
    """The global rank Megatron gives (tensor rank, data-parallel rank, pipeline stage): its
    default order "tp-cp-ep-dp-pp", tensor parallel fastest, pipeline stages slowest."""
    return tp + m.tensor_parallel * (dp + replicas * pp)


def describe(exp) -> list[str]:
    """The update's rank layout for a person (the dry run prints it): each pipeline stage's ranks
    and the nodes they run on, and a tensor-parallel group split over nodes, which would put
    every layer's collectives on the network."""
    u, m = exp.update, exp.update.megatron
    replicas = u.world_size // m.model_parallel
    nodes = exp.executor.update.nodes if exp.executor.mode == "staged" and exp.executor.kind == "slurm" else 1
    per_node = max(1, u.world_size // nodes)
    lines = [f"update: Megatron-Core, tensor parallel {m.tensor_parallel} x pipeline parallel "
             f"{m.pipeline_parallel} x {replicas} data-parallel replica(s) = {u.world_size} ranks on "
             f"{nodes} node(s)"]
    for pp in range(m.pipeline_parallel):
        ranks = sorted(rank_of(t, d, pp, m, replicas)
                       for t in range(m.tensor_parallel) for d in range(replicas))
        on = sorted({r // per_node for r in ranks})
        lines.append(f"  pipeline stage {pp}: ranks {_spans(ranks)} on node(s) {_spans(on)}")
    if m.tensor_parallel > per_node:
        lines.append(f"  note: a tensor-parallel group of {m.tensor_parallel} ranks spans nodes of "
                     f"{per_node} ranks: every layer's all-reduce crosses the network")
    return lines


def _spans(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v > start else f"{v}")
            start = None
    return ",".join(out)
