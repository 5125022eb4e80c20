"""The actor on Megatron-Core (update.backend = "megatron"): the policy split over
update.megatron.tensor_parallel x pipeline_parallel ranks, data parallel over the rest of
update.world_size, stepped by Megatron's optimizer (optionally its distributed optimizer).

It computes what the DeepSpeed actor (hpcrl.actor) computes: the same micro-batches per data-parallel
rank, the same per-micro-batch loss and statistics (hpcrl.step_loss), the same AdamW step with
gradient clipping. The micro-batches of a step run through Megatron's pipeline schedule (1F1B with
pipeline stages), each padded to the step's widest so the stages exchange one shape; the logits
of the last stage are gathered over the vocabulary's tensor-parallel shards before the loss.
Policy versions stay Hugging Face folders (hpcrl.megatron_convert converts both ways). Without
CUDA, hpcrl.megatron_shims lets Megatron run on the CPU over gloo.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl import batches, commit, losses, megatron_convert, megatron_shims, policy_model
from hpcrl.batches import MicroBatch, Samples, response_values
from hpcrl.config import Experiment
from hpcrl.step_loss import StepInputs, StepLoss, logprobs_and_entropy
from hpcrl.weight_sync import Named


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the Hugging Face checkpoint in folder `path` (one or several safetensors)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors file")
    return {k: v for f in files for k, v in load_file(f).items()}


def pad_width(mb: MicroBatch, width: int, pad_id: int) -> MicroBatch:
    """A plain micro-batch right-padded to `width` tokens (the padding masked out everywhere)."""
    extra = width - mb.input_ids.shape[1]
    if extra == 0:
        return mb
    pad = torch.nn.functional.pad
    return MicroBatch(mb.index, pad(mb.input_ids, (0, extra), value=pad_id),
                      pad(mb.attention_mask, (0, extra)), pad(mb.targets, (0, extra), value=pad_id),
                      pad(mb.mask, (0, extra)))


class MegatronActor:
    """The policy on Megatron-Core; the same methods the update calls on hpcrl.actor.Actor."""

    ref_model = None  # refused with the backend for now (hpcrl.config_megatron)
    critic = None
    router = None
    gradient_checkpointing = False
    offload = "none"

    def __init__(self, exp: Experiment, rank: int, world_size: int, policy_path: Path,
                 state_dir: Path | None = None):
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from transformers import AutoConfig, AutoTokenizer

        megatron_shims.install()
        m = exp.update.megatron
        self.exp, self.rank, self.world_size = exp, rank, world_size
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(m.tensor_parallel, m.pipeline_parallel)
        tensor_parallel.model_parallel_cuda_manual_seed(exp.run.seed)
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        tokenizer = AutoTokenizer.from_pretrained(exp.tokenizer_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.hf_config = AutoConfig.from_pretrained(policy_path)
        self.vocab = self.hf_config.vocab_size
        dtype = getattr(torch, exp.model.dtype)
        model = megatron_convert.build_model(self.hf_config, self.first, self.last, m.tensor_parallel,
                                             m.pipeline_parallel, params_dtype=dtype, pipeline_dtype=dtype,
                                             bf16=dtype == torch.bfloat16)
        megatron_convert.load(model, megatron_convert.to_megatron(
            hf_state(policy_path), self.hf_config, ps.get_tensor_model_parallel_rank(), m.tensor_parallel,
            ps.get_pipeline_model_parallel_rank(), m.pipeline_parallel))
        self.gpt = model  # the GPTModel itself, inside the wrappers of _wrap
        self.model, self.optimizer = self._wrap(model)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        if state_dir is not None:
            self._load_state(Path(state_dir))
        self.policy_loss = losses.policy_loss(exp.algorithm, exp.generate.max_tokens)
        a = exp.algorithm
        self.off_policy = ((a.off_policy_cap, a.max_log_ratio)
                           if a.max_staleness > 0 and a.off_policy_cap > 0 and a.old_logprobs == "recompute"
                           else None)
        self.attn_implementation = "megatron"

    def _wrap(self, model):
        """Megatron's data-parallel wrapper (fp32 gradient buffers) and its AdamW (torch's on CPU),
        as the DeepSpeed actor steps: weight decay on every parameter, the same clipping."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        u, m = self.exp.update, self.exp.update.megatron
        bf16 = model.config.bf16
        if bf16:  # bf16 weights and activations; the optimizer keeps fp32 master weights
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=m.distributed_optimizer), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=u.lr, min_lr=u.lr, weight_decay=u.weight_decay, adam_beta1=0.9,
            adam_beta2=0.999, adam_eps=1e-8, clip_grad=u.grad_clip, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=m.distributed_optimizer), [ddp], config_overrides={})
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = ddp.no_sync
        return ddp, optimizer

    @classmethod
    def for_version(cls, exp: Experiment, run, version: int, rank: int, world_size: int) -> MegatronActor:
        """The actor of policy `version` of `run` (and the optimizer state that made it), its files
        checked against their manifest first."""
        state = run.trainer_state_dir(version)
        return cls(exp, rank, world_size, commit.verified(run.policy_dir(version, exp.model.path)),
                   state and commit.verified(state))

    # the update's calls -------------------------------------------------------------------------

    @property
    def engine(self):
        return self.model

    def data_rows(self, rows: list[int]) -> list[int]:
        """This rank's share of `rows` for a forward pass: its data-parallel rank's."""
        from hpcrl import trainer

        return trainer.rank_rows(rows, self.dp_rank, self.dp)

    def train_step(self, samples: Samples, mini: list[int], inputs: StepInputs) -> dict[str, float]:
        """One optimizer step of the policy on mini-batch `mini` (as hpcrl.actor.Actor.train_step)."""
        from hpcrl import trainer

        u = self.exp.update
        shares = [trainer.rank_rows(mini, r, self.dp) for r in range(self.dp)]
        mbs = batches.step_micro_batches(samples, shares, self.dp_rank, u.micro_batch_size, self.pad_id)
        step = StepLoss(self.policy_loss, samples, mini, inputs, self.rank, self.off_policy)
        # Megatron divides each micro-batch's loss by their number and averages the gradients over
        # the data-parallel ranks; the step's loss is already a mean over all its tokens.
        scale = len(mbs) * self.dp
        with_entropy = self.exp.algorithm.entropy_coef > 0
        temperature = self.exp.generate.temperature or 1.0

        def loss(mb: MicroBatch, logits: torch.Tensor):
            out = step(mb, *logprobs_and_entropy(logits, mb.targets, temperature, with_entropy))
            return out * scale, {}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._schedule(mbs, loss, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        stats = self._from_last_stage(lambda: step.stats(self._dp_sum, self._dp_max) if self.last else None)
        stats.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                     lr=self.optimizer.param_groups[0]["lr"])
        if inputs.old is None:
            stats["old"] = self._gather_rows(step.fresh_old)
        return stats

    @torch.no_grad()
    def logprobs(self, samples: Samples, rows: list[int]) -> dict[int, list[float]]:
        """Response-token logprobs of this data-parallel rank's `rows` (data_rows), gathered from all."""
        out: dict[int, list[float]] = {}
        temperature = self.exp.generate.temperature or 1.0

        def keep(mb: MicroBatch, logits: torch.Tensor):
            lp = losses.token_logprobs(logits, mb.targets, temperature)
            out.update(zip(mb.index.tolist(), response_values(lp, mb), strict=True))
            return logits.new_zeros(()), {}

        self.model.eval()
        self._schedule(batches.micro_batches(samples, rows, self.exp.update.micro_batch_size, self.pad_id),
                       keep, forward_only=True)
        return self._gather_rows(out)

    @torch.no_grad()
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprobs (temperature 1) of tokens 1.. of each sequence, on every rank: the probe the
        generator repeats, through the pipeline as the update runs it."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros((len(sequences), width - 1))
        for b, seq in enumerate(sequences):
            ids[b, : len(seq)], attn[b, : len(seq)], mask[b, : len(seq) - 1] = torch.tensor(seq), 1, 1.0
        out: dict[int, list[float]] = {}

        def keep(mb: MicroBatch, logits: torch.Tensor):
            lp = losses.token_logprobs(logits, mb.targets)
            out.update(zip(mb.index.tolist(), response_values(lp, mb), strict=True))
            return logits.new_zeros(()), {}

        self.model.eval()
        self._schedule([MicroBatch(torch.arange(len(sequences)), ids, attn, ids[:, 1:], mask)], keep,
                       forward_only=True)
        rows = self._from_last_stage(lambda: out)
        return [rows[i] for i in range(len(sequences))]

    def checkpoint_weights(self, form: str = "merged") -> Iterator[Named]:
        """The policy's weights under the names its Hugging Face checkpoint keeps (a tied lm_head
        once, as the embedding), one decoder layer at a time (hpcrl.megatron_convert.chunks): the
        tensor-parallel ranks of the stage holding it send their shards to rank 0, which merges
        and yields them. Every rank must read the stream to its end (a gather per layer); only
        rank 0's yields anything. `form` is the LoRA choice (no adapters on this backend)."""
        m = self.exp.update.megatron
        state = megatron_convert.state(self.gpt)
        for pp, entries in megatron_convert.chunks(self.hf_config, m.pipeline_parallel):
            mine = ({mg: state[mg].detach().cpu() for mg, _, _ in entries}
                    if pp == self.pp_rank and self.dp_rank == 0 else None)
            parts = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object((self.tp_rank, mine), parts, dst=0)
            if self.rank == 0:
                shards = dict(part for part in parts if part[1] is not None)
                merged = megatron_convert.merge_chunk(entries, [shards[t] for t in range(m.tensor_parallel)],
                                                      self.hf_config)
                yield from merged.items()

    @property
    def device(self) -> torch.device:
        return next(self.gpt.parameters()).device

    def release(self, keep_weights: bool = False) -> None:
        raise NotImplementedError("colocation is refused with update.backend = \"megatron\"")

    restore = release

    # the pipeline --------------------------------------------------------------------------------

    def _schedule(self, mbs: list[MicroBatch], loss, forward_only: bool) -> None:
        """Run micro-batches `mbs` through Megatron's schedule; `loss(mb, logits)` on the last stage
        gets each one's logits over the whole vocabulary, aligned with mb.targets."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not mbs:
            return
        width = max(mb.input_ids.shape[1] for mb in mbs)
        mbs = [pad_width(mb, width, self.pad_id) for mb in mbs]
        sizes = {len(mb.index) for mb in mbs}
        if len(sizes) > 1 and self.exp.update.megatron.pipeline_parallel > 1:  # (config_megatron.check)
            raise ValueError(f"update: micro-batches of {sorted(sizes)} rows; the pipeline needs one size "
                             "(update.micro_batch_size must divide each rank's rows of a mini-batch)")

        def forward(data, model):
            mb = next(data)
            positions = torch.arange(width).expand(len(mb.index), width)
            output = model(input_ids=mb.input_ids, position_ids=positions, attention_mask=None)
            return output, partial(self._loss_of_logits, loss, mb)

        get_forward_backward_func()(forward_step_func=forward, data_iterator=iter(mbs), model=[self.model],
                                    num_microbatches=len(mbs), seq_length=width,
                                    micro_batch_size=max(sizes), forward_only=forward_only)

    def _loss_of_logits(self, loss, mb: MicroBatch, logits: torch.Tensor):
        from megatron.core import tensor_parallel

        if self.exp.update.megatron.tensor_parallel > 1:  # each rank holds a slice of the vocabulary
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return loss(mb, logits[:, :-1, : self.vocab])  # without the padding rows (megatron_convert)

    # reductions ----------------------------------------------------------------------------------

    @staticmethod
    def _dp_sum(values: list[float]) -> list[float]:
        from megatron.core import parallel_state as ps

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        return t.tolist()

    @staticmethod
    def _dp_max(value: float) -> float:
        from megatron.core import parallel_state as ps

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        return float(t.item())

    def _from_last_stage(self, make):
        """What `make()` returns on the last pipeline stage, on every stage of the pipeline."""
        from megatron.core import parallel_state as ps

        box = [make()]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    def _gather_rows(self, local: dict[int, list[float]]) -> dict[int, list[float]]:
        """Rows computed on the last stages of every data-parallel rank, on every rank."""
        from megatron.core import parallel_state as ps

        mine = self._from_last_stage(lambda: local)
        parts = [None] * self.dp
        dist.all_gather_object(parts, mine, group=ps.get_data_parallel_group())
        return {k: v for part in parts for k, v in part.items()}

    # the weights ---------------------------------------------------------------------------------

    def hf_weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's Hugging Face state dict (a tied lm_head the embedding itself, as HF's
        state_dict shows it), gathered layer by layer from every rank (a collective), on rank 0."""
        state = dict(self.checkpoint_weights())
        if self.rank != 0:
            return None
        if self.hf_config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def save(self, ctx) -> None:
        """The new policy version (HF format) and the optimizer state, into the stage output."""
        with ctx.timed("io"):
            self.save_policy(ctx.writer.dir / "policy")
            self.save_state(ctx.writer.dir / "trainer")

    def save_policy(self, out: Path) -> None:
        """HF-format weights and tokenizer, as the DeepSpeed backend saves them (a collective)."""
        from transformers import AutoModelForCausalLM

        state = self.hf_weights()
        if self.rank == 0:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.hf_config, torch_dtype=torch.float32)
            model.save_pretrained(out, state_dict=state, safe_serialization=True)
            policy_model.save_tokenizer(self.exp.tokenizer_path, out)
        dist.barrier()

    def _state_files(self, directory: Path) -> tuple[Path, Path, Path]:
        d = directory / "megatron"
        return (d / f"optimizer-rank{self.rank:05d}.pt",
                d / f"parameters-tp{self.tp_rank:03d}-pp{self.pp_rank:03d}.pt",
                d / f"weights-rank{self.rank:05d}.pt")

    def save_state(self, directory: Path, weights: bool = False) -> None:
        """Each rank's optimizer state (the distributed optimizer's parameter state too, gathered
        over the data-parallel ranks), and with `weights` its shard of the model; a policy's next
        update loads it (for_version), weights from the policy version itself."""
        optimizer, parameters, shard = self._state_files(directory)
        optimizer.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.optimizer.state_dict(), optimizer)
        if self.exp.update.megatron.distributed_optimizer:
            self.optimizer.save_parameter_state(str(parameters))
        if weights:
            torch.save(megatron_convert.state(self.gpt), shard)
        dist.barrier()

    def _load_state(self, directory: Path, weights: bool = False) -> None:
        optimizer, parameters, shard = self._state_files(directory)
        if not optimizer.is_file():
            raise RuntimeError(f"{directory}: no Megatron optimizer state of rank {self.rank} "
                               f"({optimizer.name}); was it saved by another backend or layout?")
        if weights:
            megatron_convert.load(self.gpt, torch.load(shard, weights_only=True))
        self.optimizer.load_state_dict(torch.load(optimizer, weights_only=False))
        if self.exp.update.megatron.distributed_optimizer:
            self.optimizer.load_parameter_state(str(parameters))

    def save_progress(self, directory: Path) -> None:
        """An interrupted update's state (hpcrl.preemption): the optimizer's and the weights."""
        self.save_state(directory, weights=True)

    def load_progress(self, directory: Path) -> None:
        self._load_state(directory, weights=True)
