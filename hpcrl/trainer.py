"""The policy update with DeepSpeed: batch building, old/reference logprobs, PPO steps, saving.

Every rank holds the whole (small) rollout table and takes its own slice of each mini-batch;
losses are normalised by the mini-batch's global token count, so the update does not depend on
how the batch is split over ranks and micro-batches. Saving writes the next policy version in HF
format and the DeepSpeed state. Stage bookkeeping (locks, commit) is not here.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpcrl import batches, lora, losses, policy_model
from hpcrl.batches import MicroBatch, Samples, micro_batches, response_outputs, response_values
from hpcrl.config import Experiment
from hpcrl.config_training import UpdateConfig, deepspeed_stage
from hpcrl.jit_ops import import_deepspeed

DS_TAG = "state"


def manual_seed(seed: int) -> None:
    """torch.manual_seed(seed); on a machine with no CUDA device (hpcrl runs on CUDA or CPU) only
    the CPU generator, all it seeds there: torch would also queue a seed for a CUDA that can never
    start, with a formatted trace of the caller's stack (1-2 ms per update under a resident
    trainer's deep stack)."""
    if torch.cuda.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def zero_stage(exp: Experiment, world_size: int) -> int:
    """The ZeRO stage DeepSpeed runs (hpcrl.config_training.deepspeed_stage)."""
    return deepspeed_stage(exp.update, exp.model.dtype, world_size)


def ds_config(exp: Experiment, world_size: int, grad_accum: int) -> dict:
    u = exp.update
    return {
        "train_micro_batch_size_per_gpu": u.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": u.micro_batch_size * grad_accum * world_size,
        "gradient_clipping": u.grad_clip,
        "zero_optimization": {"stage": zero_stage(exp, world_size),
                              "stage3_gather_16bit_weights_on_model_save": True, **_offload(exp.update)},
        # torch's AdamW on the offloaded state too (not DeepSpeedCPUAdam): the same update, nothing to compile
        **({"zero_force_ds_cpu_optimizer": False} if u.offload != "none" else {}),
        "bf16": {"enabled": exp.model.dtype == "bfloat16"},
        # bf16 weights, fp32 gradient accumulation (and master weights): small updates do not vanish
        **({"data_types": {"grad_accum_dtype": "fp32"}} if exp.model.dtype == "bfloat16" else {}),
        "fp16": {"enabled": exp.model.dtype == "float16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _offload(u: UpdateConfig) -> dict:
    """zero_optimization's offload entries for update.offload (pinned host memory on GPUs)."""
    where = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {"offload_optimizer": where, **({"offload_param": where} if u.offload == "all" else {})} \
        if u.offload != "none" else {}


def make_engine(model, lr: float, exp: Experiment, world_size: int, grad_accum: int, state_dir: Path | None,
                what: str = "policy"):
    """A DeepSpeed engine over `model` with AdamW at `lr`, restored from `state_dir` when given."""
    deepspeed = import_deepspeed()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=exp.update.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=ds_config(exp, world_size, grad_accum))
    if state_dir is not None and load_state(engine, state_dir) is None:
        raise RuntimeError(f"no DeepSpeed state of the {what} in {state_dir}")
    return engine


def release(engine, keep_weights: bool = False) -> None:
    """Colocated with vLLM (executor.resident.colocate, hpcrl.colocation): the engine's optimizer
    state and gradients, and its weights unless `keep_weights`, moved to CPU memory by DeepSpeed's
    offload_states (ZeRO 1-3; the config refuses stage 0, and ZeRO-3 without update.offload, whose
    torch AdamW state DeepSpeed does not move), and the GPU's cached blocks returned, so that vLLM
    wakes into the memory. Weights offloaded by update.offload = "all" are in CPU memory already;
    frozen weights (LoRA's base), which no ZeRO-1/2 optimizer holds, are moved here."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

    if engine.zero_offload_param() is None:
        states = [State.optim_states, State.hp_params, State.lp_grads, State.contiguous_grad_buffer]
        engine.offload_states(include=states + ([] if keep_weights else [State.lp_params]),
                              pin_memory=torch.cuda.is_available())
    if not keep_weights:
        _move_frozen(engine, "cpu")
    return_device_memory()


def return_device_memory() -> None:
    """On a GPU, the memory torch holds but no tensor uses back to the device: cuBLAS's workspaces
    (per handle and stream: 64 MiB on an H200 after one step, made again at the next matmul), which
    torch.cuda.empty_cache leaves, then the allocator's cached blocks."""
    if not torch.cuda.is_available():
        return
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # torch's own tests call it
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


def restore(engine) -> None:
    """What `release` moved, back on the engine's device."""
    if engine.zero_offload_param() is None:
        engine.reload_states()
    _move_frozen(engine, engine.device)


def _move_frozen(engine, device) -> None:
    """The frozen weights of a ZeRO-1/2 engine's model to `device` (ZeRO-3 partitions them itself)."""
    if engine.zero_optimization_stage() < 3:
        for p in engine.module.parameters():
            if not p.requires_grad:
                p.data = p.data.to(device)


def _frozen(engine) -> bool:
    """Whether some weights of the engine's model do not train (LoRA's base weights, hpcrl.lora)."""
    return any(not p.requires_grad for p in engine.module.parameters())


def save_state(engine, directory: Path) -> None:
    """The DeepSpeed state (weights that train, optimizer, scheduler) under `directory`; frozen
    weights are left out: the base model holds them."""
    engine.save_checkpoint(str(directory), tag=DS_TAG, exclude_frozen_parameters=_frozen(engine))


def load_state(engine, directory: Path) -> str | None:
    """Restore what `save_state` wrote; the path loaded, or None where there is no state."""
    path, _ = engine.load_checkpoint(str(directory), tag=DS_TAG, load_module_strict=not _frozen(engine))
    return path


def engine_step(engine) -> float:
    """engine.step() after a micro-batch's backward; at the accumulation boundary, the gradient
    norm before clipping (nan elsewhere). DeepSpeed records it only under ZeRO; without, it is
    computed here from the (already all-reduced) gradients."""
    boundary = engine.is_gradient_accumulation_boundary()
    norm = None
    if boundary and engine.zero_optimization_stage() == 0:
        norm = torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters()
                                              if p.grad is not None])
    engine.step()
    if norm is None and boundary:
        norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


def step_micro_batches(samples: Samples, mini: list[int], rank: int, world_size: int, u,
                       pad_id: int) -> list[MicroBatch]:
    """This rank's micro-batches of mini-batch `mini` for one optimizer step (hpcrl.batches:
    `u.micro_batch_size` rows each, or packed, as many on every rank). With sequence parallelism
    the rows are split over the groups of `u.sequence_parallel` ranks, each group's ranks taking
    the same micro-batches (hpcrl.sequence_parallel)."""
    n = u.sequence_parallel
    shares = [rank_rows(mini, r, world_size // n) for r in range(world_size // n)]
    return batches.step_micro_batches(samples, shares, rank // n, u.micro_batch_size, pad_id, u.share_prompts,
                                      u.max_tokens_per_micro_batch)


def gradient_scale(engine, u, micro_batches: int, world_size: int) -> int:
    """The factor that undoes DeepSpeed's mean over the ranks and the micro-batches of a step (it
    divides each loss by gradient_accumulation_steps, which packed micro-batches need not number).
    A sequence-parallel group's n ranks compute one loss, whose gradient their gather sums n times
    (hpcrl.sequence_parallel): the group counts as one rank."""
    steps = engine.gradient_accumulation_steps() if u.max_tokens_per_micro_batch else micro_batches
    return world_size // u.sequence_parallel * steps


def mark_boundary(engine, u, last: bool) -> None:
    """Packed micro-batches vary in number: DeepSpeed is told which one ends the accumulation (it
    counts `gradient_accumulation_steps` micro-batches otherwise)."""
    if u.max_tokens_per_micro_batch:
        engine.set_gradient_accumulation_boundary(last)


def rank_rows(rows: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of `rows` (so a group's rows stay together on one rank)."""
    bounds = np.linspace(0, len(rows), world_size + 1).round().astype(int)
    return rows[bounds[rank]: bounds[rank + 1]]


def split_mini_batches(group_ids: list[int], mini_batches: int, seed: int, epoch: int) -> list[list[int]]:
    """The rows in equal mini-batches, groups in a random order (per seed and epoch), each group's
    rows together (a group may straddle two mini-batches when the sizes do not divide)."""
    groups = list(dict.fromkeys(group_ids))
    position = np.argsort(np.random.default_rng([seed, epoch]).permutation(len(groups)))  # of each group
    rank_of = dict(zip(groups, position.tolist(), strict=True))
    rows = sorted(range(len(group_ids)), key=lambda i: (rank_of[group_ids[i]], i))
    size = len(rows) // mini_batches
    return [rows[i * size: (i + 1) * size] for i in range(mini_batches)]


def check_batch_shape(u: UpdateConfig, n_samples: int, world_size: int) -> None:
    groups = world_size // u.sequence_parallel  # the ranks that take rows of their own
    if n_samples % (u.mini_batches * groups):
        over = f"update.world_size={world_size} ranks" if groups == world_size else \
            f"{groups} groups of update.sequence_parallel={u.sequence_parallel} ranks"
        raise ValueError(f"update: {n_samples} samples cannot be split into "
                         f"update.mini_batches={u.mini_batches} mini-batches over {over} evenly")


def refuse_non_finite(iteration: int, stats: list[dict], modules: dict[str, torch.nn.Module]) -> None:
    """Raise before anything is written when an update's gradient norm or any updated parameter
    (of every rank's share, under ZeRO-3) is not finite: a non-finite policy is never committed."""
    norms = [s["step"] for s in stats if not math.isfinite(s.get("grad_norm", 0.0))]
    counts = all_sum([float(sum(not bool(torch.isfinite(getattr(p, "ds_tensor", p.data)).all())
                                 for p in m.parameters())) for m in modules.values()])
    bad = {name: int(c) for name, c in zip(modules, counts, strict=True) if c}
    if norms or bad:
        what = ([f"a non-finite gradient norm at step(s) {norms}"] if norms else []) + \
               [f"{n} non-finite parameter tensor(s) in the {name}" for name, n in bad.items()]
        raise FloatingPointError(f"the update of iteration {iteration} produced {' and '.join(what)}; "
                                 f"nothing is committed and the run stays at policy version {iteration} "
                                 "(check update.lr, update.grad_clip and the rewards)")


def all_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_gather_rows(local: dict[int, list[float]]) -> dict[int, list[float]]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


@torch.no_grad()
def logprobs_of(model, samples: Samples, rows: list[int], exp: Experiment, pad_id: int,
                device) -> dict[int, list[float]]:
    """Response-token logprobs of `rows` under `model` (all ranks together, gathered)."""
    out = {}
    temperature = exp.generate.temperature or 1.0
    u = exp.update
    for mb in micro_batches(samples, rows, u.micro_batch_size, pad_id, u.share_prompts,
                            u.max_tokens_per_micro_batch):
        mb = mb.to(device)
        logits = response_outputs(model, mb)
        lp = losses.token_logprobs(logits, mb.targets, temperature)
        for i, values in zip(mb.index.tolist(), response_values(lp, mb), strict=True):
            out[i] = values
    return all_gather_rows(out)


def response_mask(lengths: list[int]) -> torch.Tensor:
    """[samples, longest response] 0/1 mask of the response tokens."""
    mask = torch.zeros((len(lengths), max(lengths, default=0)), dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    return mask


def pad_rows(rows_values: dict[int, list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Per-row response values as a [samples, longest response] tensor (float64, 0 past each)."""
    t = torch.zeros_like(mask, dtype=torch.float64)
    for i, values in rows_values.items():
        t[i, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return t


def unpad_rows(values: torch.Tensor, mask: torch.Tensor) -> dict[int, list[float]]:
    return {i: values[i][mask[i].bool()].tolist() for i in range(values.shape[0])}


def save_policy(engine, exp: Experiment, out: Path, rank: int) -> None:
    """HF-format weights (and tokenizer) of the engine's model, loadable by from_pretrained and vLLM."""

    if exp.update.zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank calls it
    else:
        state = engine.module.state_dict() if rank == 0 else None
    if rank == 0:
        model = engine.module
        state = to_cpu(state)
        if (scale := lora.scaling(model)) is not None:
            lora.save_adapters(model, state, out / "adapter")
            state = lora.merged(state, scale)
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        policy_model.save_tokenizer(exp.tokenizer_path, out)
    if dist.is_initialized():
        dist.barrier()


def to_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict in CPU memory, with tensors that share memory (tied weights: the embedding and
    lm_head.weight) still sharing it: save_pretrained keeps one of a tied pair only when they do.
    A plain `.cpu()` per entry copies each GPU tensor apart, and the checkpoint of a GPU update
    would hold an lm_head.weight that the same update on a CPU does not."""
    moved: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if key not in moved:
            moved[key] = t.detach().cpu()
        out[name] = moved[key]
    return out
