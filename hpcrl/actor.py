"""The actor: a live DeepSpeed engine over the policy, with the reference model and (for ppo)
the critic, and the policy's optimizer step.

The staged mode builds one per update job; the resident mode keeps one for the whole run and
streams its weights to the generator after each update. The update of an iteration
(hpcrl.update) drives it: `train_step` takes one optimizer step of the policy on a mini-batch,
with the policy loss built once from the config (hpcrl.losses.POLICY_LOSSES). With
`algorithm.name = "ppo"` the actor also owns the critic (hpcrl.critic), which takes its own
steps beside the policy's on the same mini-batches. With asynchronous generation
(`algorithm.max_staleness`) each token's loss is weighted by min(pi_old / pi_sampler,
`algorithm.off_policy_cap`) (hpcrl.losses.behaviour_weight), pi_sampler the policy that generated it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from hpcrl import checkpoint_view, commit, lora, losses, moe, policy_model, sequence_parallel, trainer
from hpcrl.batches import MicroBatch, Samples, response_outputs
from hpcrl.config import Experiment
from hpcrl.stage import StageContext
from hpcrl.step_loss import StepInputs, StepLoss, logprobs_and_entropy
from hpcrl.weight_sync import Named

__all__ = ["Actor", "StepInputs"]

class Actor:
    def __init__(self, exp: Experiment, rank: int, world_size: int, policy_path: Path, state_dir: Path | None,
                 critic_path: Path | None = None, critic_state: Path | None = None):
        """Load the policy (and, when given, the DeepSpeed state that produced it); for ppo, the critic."""
        from transformers import AutoTokenizer

        self.exp, self.rank, self.world_size = exp, rank, world_size
        u = exp.update
        n = exp.algorithm.prompts_per_iteration * exp.algorithm.group_size
        trainer.check_batch_shape(exp.update, n, world_size)
        grad_accum = -(-(n // u.mini_batches // (world_size // u.sequence_parallel)) // u.micro_batch_size)
        dtype = getattr(torch, exp.model.dtype)
        tokenizer = AutoTokenizer.from_pretrained(exp.tokenizer_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        model = self._policy_model(policy_path, dtype)
        self.attn_implementation = model.config._attn_implementation
        if u.gradient_checkpointing:
            policy_model.checkpoint_layers(model)
        self.sp_group = sequence_parallel.register(model, u.sequence_parallel,
                                                   1 if u.max_tokens_per_micro_batch else u.micro_batch_size)
        k = moe.top_k(model.config)  # experts per token; None for a dense model
        self.router = moe.RouterTally(model, k) if k else None
        self.engine = trainer.make_engine(model, u.lr, exp, world_size, grad_accum, state_dir)
        self.policy_loss = losses.policy_loss(exp.algorithm, exp.generate.max_tokens)
        a = exp.algorithm
        self.off_policy = ((a.off_policy_cap, a.max_log_ratio)
                           if a.max_staleness > 0 and a.off_policy_cap > 0 and a.old_logprobs == "recompute"
                           else None)
        self.ref_model = None
        if exp.algorithm.kl.coef > 0 and u.lora.rank:  # the base model: the policy without its adapters
            self.ref_model = lora.WithoutAdapters(self.engine)
        elif exp.algorithm.kl.coef > 0:
            self.ref_model = policy_model.load_causal_lm(exp.model.path, dtype, exp.model.attn_implementation)
            self.ref_model = self.ref_model.to(self.engine.device).eval()
        self.critic = None
        if exp.algorithm.critic is not None:  # ppo
            from hpcrl.critic import Critic

            initial = critic_path or exp.algorithm.critic.path or exp.model.path
            self.critic = Critic(exp, rank, world_size, initial, critic_state, grad_accum, self.pad_id,
                                 self.sp_group)

    def _policy_model(self, policy_path: Path, dtype) -> torch.nn.Module:
        """The policy at `policy_path`; with update.lora, the base model with the adapters saved
        beside that version (fresh ones at version 0, whose path is the base model)."""
        exp = self.exp
        cfg = exp.update.lora
        if not cfg.rank:
            return policy_model.load_causal_lm(policy_path, dtype, exp.model.attn_implementation)
        model = lora.wrap(policy_model.load_causal_lm(exp.model.path, dtype, exp.model.attn_implementation),
                          cfg, exp.run.seed)
        if (Path(policy_path) / "adapter").is_dir():
            lora.load_adapters(model, Path(policy_path) / "adapter")
        return model

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @functools.cached_property
    def gradient_checkpointing(self) -> bool:
        """Whether the policy recomputes its layers in the backward pass (update.gradient_checkpointing);
        fixed for the run (read once: a walk over every module)."""
        return bool(getattr(self.engine.module, "is_gradient_checkpointing", False))

    @property
    def offload(self) -> str:
        """What DeepSpeed keeps in CPU memory, as its engine was configured (update.offload)."""
        e = self.engine
        params = e.zero_offload_param() is not None and str(e.zero_offload_param().device).endswith("cpu")
        return "all" if e.zero_cpu_offload() and params else "optimizer" if e.zero_cpu_offload() else "none"

    @classmethod
    def for_version(cls, exp: Experiment, run, version: int, rank: int, world_size: int) -> Actor:
        """The actor of policy `version` of `run`, its files checked against their manifest first."""
        c = exp.algorithm.critic
        critic_path = run.critic_dir(version, c.path or exp.model.path) if c is not None else None
        state = run.trainer_state_dir(version)
        return cls(exp, rank, world_size, commit.verified(run.policy_dir(version, exp.model.path)),
                   state and commit.verified(state), critic_path and commit.verified(critic_path),
                   run.critic_state_dir(version))

    def data_rows(self, rows: list[int]) -> list[int]:
        """This rank's share of `rows` for a forward pass (logprobs, values)."""
        return trainer.rank_rows(rows, self.rank, self.world_size)

    def logprobs(self, samples: Samples, rows: list[int]) -> dict[int, list[float]]:
        """The policy's response-token logprobs of this rank's `rows`, gathered from every rank."""
        self.engine.eval()
        return trainer.logprobs_of(self.engine, samples, rows, self.exp, self.pad_id, self.engine.device)

    def ref_logprobs(self, samples: Samples, rows: list[int]) -> dict[int, list[float]]:
        """The reference policy's, likewise."""
        return trainer.logprobs_of(self.ref_model, samples, rows, self.exp, self.pad_id, self.engine.device)

    def train_step(self, samples: Samples, mini: list[int], inputs: StepInputs) -> dict[str, float]:
        """One optimizer step of the policy on mini-batch `mini`; its statistics (global token means,
        hpcrl.step_loss). With `inputs.old` None the old logprobs are this forward pass's own
        (detached), and come back, gathered by row, as stats["old"]."""
        exp, engine = self.exp, self.engine
        mbs = trainer.step_micro_batches(samples, mini, self.rank, self.world_size, exp.update, self.pad_id)
        scale = trainer.gradient_scale(engine, exp.update, len(mbs), self.world_size)
        step = StepLoss(self.policy_loss, samples, mini, inputs, self.rank, self.off_policy)
        routed, tally = [], self.router
        for j, mb in enumerate(mbs):
            trainer.mark_boundary(engine, exp.update, j == len(mbs) - 1)
            mb = mb.to(engine.device)
            loss = step(mb, *self._forward(mb, tally))
            engine.backward(loss * scale + self._router_term(tally, routed))
            grad_norm = trainer.engine_step(engine)
        # a sequence-parallel group's ranks each count its micro-batches
        stats = step.stats(trainer.all_sum, trainer.all_max, copies=exp.update.sequence_parallel)
        stats.update(grad_norm=grad_norm, lr=engine.get_lr()[0])
        if tally is not None:
            stats.update(_router_stats(routed))
        if inputs.old is None:
            stats["old"] = trainer.all_gather_rows(step.fresh_old)
        return stats

    def _forward(self, mb: MicroBatch, tally) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A micro-batch's token logprobs, its token entropies where the loss takes them (else
        None), and its token entropies detached (a statistic); under sequence parallelism each
        rank of the group computes its slice of the sequence."""
        temperature = self.exp.generate.temperature or 1.0
        with_entropy = self.exp.algorithm.entropy_coef > 0
        if self.sp_group is not None:
            logp, entropy = sequence_parallel.token_outputs(self.engine, mb, self.sp_group, temperature,
                                                            with_entropy)
            return logp, entropy if with_entropy else None, entropy.detach()
        logits = response_outputs(self.engine, mb, tally=tally)
        return logprobs_and_entropy(logits, mb.targets, temperature, with_entropy)

    def _router_term(self, tally: moe.RouterTally | None, routed: list) -> torch.Tensor | float:
        """An MoE micro-batch's load-balancing term of the loss (update.moe_aux_loss_coef x the
        auxiliary loss; DeepSpeed's mean over micro-batches and ranks makes it their mean); its
        routing is appended to `routed`."""
        if tally is None:
            return 0.0
        load = tally.take()
        aux = load.aux_loss()
        routed.append((load.assigned, aux.item()))
        return self.exp.update.moe_aux_loss_coef * aux

    def save(self, ctx: StageContext) -> None:
        """The new policy version (HF format) and the DeepSpeed state (and the critic's), into the stage
        output."""
        with ctx.timed("io"):
            trainer.save_policy(self.engine, self.exp, ctx.writer.dir / "policy", self.rank)
            trainer.save_state(self.engine, ctx.writer.dir / "trainer")
            if self.critic is not None:
                self.critic.save(ctx.writer.dir / "critic", ctx.writer.dir / "trainer" / "critic")

    def save_progress(self, directory: Path) -> None:
        """An interrupted update's state (hpcrl.preemption): each engine's DeepSpeed state."""
        for name, engine in self._engines().items():
            trainer.save_state(engine, directory / name)

    def load_progress(self, directory: Path) -> None:
        """Restore what `save_progress` wrote."""
        for name, engine in self._engines().items():
            if trainer.load_state(engine, directory / name) is None:
                raise RuntimeError(f"{directory}: progress without the DeepSpeed state of the {name}")

    def _engines(self) -> dict:
        return {"trainer": self.engine, **({"critic": self.critic.engine} if self.critic else {})}

    def checkpoint_weights(self, form: str = "merged") -> Iterator[Named]:
        """The policy's weights as its checkpoint holds them (hpcrl.checkpoint_view), layer by layer,
        with LoRA adapters in `form`. Under ZeRO-3 each layer is gathered in turn (every rank reads
        the stream to its end) and each tensor is a copy that outlives its layer's gather."""
        if self.exp.update.zero_stage != 3:
            return checkpoint_view.tensors(self.engine.module, form=form)
        import deepspeed

        def gather(params):
            return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

        return checkpoint_view.tensors(self.engine.module, gather, copy=True, form=form)

    def release(self, keep_weights: bool = False) -> None:
        """Colocated with vLLM: the policy's and the critic's state (hpcrl.trainer.release) and the
        reference model in CPU memory; the policy's weights stay with `keep_weights` (for a sync)."""
        trainer.release(self.engine, keep_weights)
        if self.critic is not None:
            trainer.release(self.critic.engine)
        if isinstance(self.ref_model, torch.nn.Module):
            self.ref_model.to("cpu")

    def restore(self) -> None:
        """Everything `release` moved back on the trainer's device."""
        trainer.restore(self.engine)
        if self.critic is not None:
            trainer.restore(self.critic.engine)
        if isinstance(self.ref_model, torch.nn.Module):
            self.ref_model.to(self.engine.device)

    @torch.no_grad()
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprobs (temperature 1) of tokens 1.. of each sequence: the probe the generator repeats."""
        self.engine.eval()
        return policy_model.sequence_logprobs(self.engine, sequences, self.pad_id, self.engine.device)


def _router_stats(routed: list[tuple[torch.Tensor, float]]) -> dict:
    """A step's routing over its micro-batches and ranks: each expert's load per layer, its extremes,
    and the mean auxiliary loss."""
    assigned = sum(a for a, _ in routed)
    shape = assigned.shape
    totals = trainer.all_sum([*assigned.flatten().tolist(), sum(aux for _, aux in routed), len(routed)])
    stats = moe.load_stats(torch.tensor(totals[:-2]).reshape(shape))
    return {**stats, "moe_aux_loss": totals[-2] / totals[-1]}
