"""What a colocated resident job (`executor.resident.colocate`: vLLM on the trainers' GPUs) holds on
one GPU in each phase of an iteration, and the check that every phase fits.

A GPU holds one trainer rank and vLLM's share of the engine (1 / generate.tensor_parallel_size of
its weights). The phases:

- generation: vLLM awake takes generate.gpu_memory_utilization of the GPU (its weights, KV cache
  and activations); the trainer has released its weights, gradients and optimizer state to CPU
  memory (hpcrl.trainer.release) and holds its CUDA context only.
- training: vLLM asleep (level 2: weights and KV cache freed) holds its context; the trainer holds
  its weights, gradients and optimizer state (as ZeRO partitions and update.offload leave them on
  the GPU) and the update's activations, which depend on the batch and are not estimated here: they
  get what is left.
- sync: the trainer's weights (gradients and optimizer state released) and vLLM's woken weights.

The bytes per parameter follow DeepSpeed: 16-bit weights with float32 master weights, gradients
accumulated in float32 under ZeRO-1 (its bf16 optimizer) and in the weights' dtype under ZeRO-2/3,
and AdamW's two float32 moments; ZeRO-1 partitions the optimizer state over
the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too; update.offload moves the optimizer
state (and with "all" the weights) to CPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTEXT_BYTES = 1 << 30  # per process on a GPU: CUDA context, NCCL buffers, allocator slack (an estimate)
GIB = float(1 << 30)


@dataclass(frozen=True)
class Trainer:
    """One trainer rank's bytes on its GPU."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def trainer_bytes(params: int, dtype_bytes: int, stage: int, ranks: int, offload: str) -> Trainer:
    """A trainer rank's weights, gradients and optimizer state on the GPU for a model of `params`
    parameters in `dtype_bytes`-byte weights, at ZeRO `stage` (the one DeepSpeed runs,
    hpcrl.trainer.zero_stage) over `ranks` data-parallel ranks, with update.offload `offload`."""
    # DeepSpeed's bf16 (ZeRO-1) optimizer accumulates 16-bit weights' gradients in float32; ZeRO-2/3
    # in the weights' dtype
    grad_bytes = 4 if dtype_bytes < 4 and stage <= 1 else dtype_bytes
    state_bytes = 8 + (4 if dtype_bytes < 4 else 0)  # AdamW's moments, and the float32 master weights
    weights = 0.0 if offload == "all" else params * dtype_bytes / (ranks if stage == 3 else 1)
    gradients = params * grad_bytes / (ranks if stage >= 2 else 1)
    optimizer = 0.0 if offload != "none" else params * state_bytes / (ranks if stage >= 1 else 1)
    return Trainer(weights, gradients, optimizer)


def phases(trainer: Trainer, engine_weights: float, utilisation: float, gpu: float,
           extra: float = 0.0) -> dict[str, float]:
    """Bytes on the GPU in each phase (the update's before its activations); `extra`: what else
    the trainer holds in the update (the critic's engine, the reference model's weights)."""
    return {"generation": utilisation * gpu + CONTEXT_BYTES,
            "training": trainer.total + extra + 2 * CONTEXT_BYTES,
            "sync": trainer.weights + engine_weights + 2 * CONTEXT_BYTES}


def problems(trainer: Trainer, engine_weights: float, utilisation: float, gpu: float, where: str,
             extra: float = 0.0) -> list[str]:
    """What does not fit on a GPU of `gpu` bytes (`where` names it), one line per phase."""
    found = phases(trainer, engine_weights, utilisation, gpu, extra)
    out = []
    if found["generation"] > gpu:
        out.append(f"generation: vLLM takes generate.gpu_memory_utilization = {utilisation} of {where} "
                   f"({utilisation * gpu / GIB:.1f} GiB) and the released trainer keeps its context "
                   f"(~{CONTEXT_BYTES / GIB:.0f} GiB); expected at most {1 - CONTEXT_BYTES / gpu:.2f}")
    if found["training"] > gpu:
        others = f" and {extra / GIB:.1f} GiB of critic and reference" if extra else ""
        parts = " + ".join(f"{b / GIB:.1f}" for b in (trainer.weights, trainer.gradients, trainer.optimizer))
        out.append(f"training: the trainer's weights, gradients and optimizer state take "
                   f"{trainer.total / GIB:.1f} GiB ({parts}){others} of {where} ({gpu / GIB:.1f} GiB) before "
                   "any activation; expected more ranks (ZeRO partitions), zero_stage = 3, or update.offload")
    if found["sync"] > gpu:
        out.append(f"sync: the trainer's weights ({trainer.weights / GIB:.1f} GiB) and vLLM's "
                   f"({engine_weights / GIB:.1f} GiB) do not fit together in {where} ({gpu / GIB:.1f} GiB); "
                   "expected zero_stage = 3 or a larger generate.tensor_parallel_size")
    return out


def layout_bytes(exp, params: int) -> tuple[Trainer, float, float]:
    """For a policy of `params` parameters: a trainer rank's bytes, vLLM's weights on one GPU (its
    tensor-parallel share), and what else the trainer holds in the update (a critic's engine like
    the policy's; the reference model's weights when a KL term needs them, LoRA's being the policy
    itself)."""
    from hpcrl.trainer import zero_stage

    u = exp.update
    width = 4 if exp.model.dtype == "float32" else 2
    trainer = trainer_bytes(params, width, zero_stage(exp, u.world_size), u.world_size, u.offload)
    if u.lora.rank:  # only the adapters train: their gradients and state are small
        trainer = Trainer(trainer.weights, 0.0, 0.0)
    extra = (trainer.total if exp.algorithm.critic is not None else 0.0) + \
        (trainer.weights if exp.algorithm.kl.coef > 0 and not u.lora.rank else 0.0)
    return trainer, params * width / exp.generate.tensor_parallel_size, extra


def check(exp, params: int, gpu: float, where: str) -> list[str]:
    """The problems of the experiment's colocated layout on GPUs of `gpu` bytes (each line names
    executor.resident.colocate)."""
    trainer, engine, extra = layout_bytes(exp, params)
    return [f"executor.resident.colocate: {line}"
            for line in problems(trainer, engine, exp.generate.gpu_memory_utilization, gpu, where, extra)]


def check_device(exp, device: int) -> None:
    """At a colocated job's start, before anything is loaded: `check` against CUDA device `device`."""
    import torch

    from hpcrl import disk_budget

    params = disk_budget.params_of(exp.model.path)
    gpu = torch.cuda.get_device_properties(device).total_memory
    found = [] if params is None else check(exp, params, gpu, f"GPU {device} ({gpu / GIB:.1f} GiB)")
    if found:
        raise RuntimeError("the colocated job does not fit:\n  " + "\n  ".join(found))
