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
    for broken, key, message in refused:
        if broken:
            raise Rule(key, f"update.backend = \"megatron\": {message}")
