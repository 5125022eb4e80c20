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

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hpcrl import checkpoint_view, commit, lora, losses, moe, policy_model, sequence_parallel, trainer
from hpcrl.batches import MicroBatch, Samples, padded, response_outputs, response_values
from hpcrl.config import Experiment
from hpcrl.stage import StageContext
from hpcrl.weight_sync import Named

STAT_NAMES = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_ref", "entropy", "is_weight_mean")
OFF_POLICY_NAMES = ("off_policy_weight_mean", "off_policy_clipfrac")  # with the off-policy correction


@dataclass
class StepInputs:
    """What one optimizer step of the policy trains on, by row of the update batch."""

    adv: torch.Tensor | dict[int, list[float]]  # one advantage per sample, or per token by row (ppo's GAE)
    old: dict[int, list[float]] | None  # None: the policy has not stepped since sampling (see train_step)
    ref: dict[int, list[float]] | None  # the reference policy's logprobs (a KL term in the loss)
    kl_coef: float  # the KL loss weight (0 when the KL is in the reward)


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
        self.off_policy = a.max_staleness > 0 and a.off_policy_cap > 0 and a.old_logprobs == "recompute"
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
    def gradient_checkpointing(self) -> bool:
        """Whether the policy recomputes its layers in the backward pass (update.gradient_checkpointing)."""
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

    def train_step(self, samples: Samples, mini: list[int], inputs: StepInputs) -> dict[str, float]:
        """One optimizer step of the policy on mini-batch `mini`; its statistics (global token means).

        With `inputs.old` None the old logprobs are this forward pass's own (detached), and come
        back, gathered by row, as stats["old"]. With the off-policy correction (`self.off_policy`)
        the token losses are weighted by the truncated importance weight of old over sampler."""
        exp, engine = self.exp, self.engine
        n_tokens = sum(len(samples.response_ids[i]) for i in mini)
        mbs = trainer.step_micro_batches(samples, mini, self.rank, self.world_size, exp.update, self.pad_id)
        scale = trainer.gradient_scale(engine, exp.update, len(mbs), self.world_size)
        names = STAT_NAMES + (OFF_POLICY_NAMES if self.off_policy else ())
        sums = dict.fromkeys(names, 0.0)
        weight_max, behaviour_max = 0.0, 0.0
        fresh_old, routed = {}, []
        tally = self.router
        for j, mb in enumerate(mbs):
            trainer.mark_boundary(engine, exp.update, j == len(mbs) - 1)
            mb = mb.to(engine.device)
            logp, token_entropy, entropy_stat = self._forward(mb, tally)
            if inputs.old is None:
                mb_old = logp.detach()
                fresh_old.update(zip(mb.index.tolist(), response_values(mb_old, mb), strict=True))
            else:
                mb_old = padded(inputs.old, mb)
            mb_adv = (padded(inputs.adv, mb) if isinstance(inputs.adv, dict)
                      else inputs.adv[mb.index].to(logp.device))
            bw = self._behaviour_weight(samples, mb, mb_old)
            out = self.policy_loss(logp, mb_old, mb_adv, mb.mask, kl_coef=inputs.kl_coef, n_tokens=n_tokens,
                                   ref_logp=padded(inputs.ref, mb) if inputs.ref is not None else None,
                                   n_seqs=len(mini), token_entropy=token_entropy,
                                   behaviour_weight=bw.weight if bw is not None else None)
            if not torch.isfinite(out.loss):
                raise FloatingPointError(f"non-finite loss ({out.loss.item()}) on rank {self.rank}; the "
                                         "update is not committed and the run stays at the last good "
                                         "policy version")
            engine.backward(out.loss * scale + self._router_term(tally, routed))
            _accumulate(sums, out, entropy_stat, mb.mask, (n_tokens, len(mini)), bw)
            weight_max = max(weight_max, out.weight_max.item())
            if bw is not None:
                behaviour_max = max(behaviour_max, bw.max.item())
            grad_norm = trainer.engine_step(engine)
        n = exp.update.sequence_parallel  # a group's ranks each count its micro-batches
        stats = dict(zip(names, [v / n for v in trainer.all_sum([sums[k] for k in names])], strict=True))
        stats.update(grad_norm=grad_norm, lr=engine.get_lr()[0], tokens=n_tokens,
                     is_weight_max=trainer.all_max(weight_max),
                     off_policy_weight_max=trainer.all_max(behaviour_max) if self.off_policy else None)
        if tally is not None:
            stats.update(_router_stats(routed))
        if inputs.old is None:
            stats["old"] = trainer.all_gather_rows(fresh_old)
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
        else:
            logits = response_outputs(self.engine, mb, tally=tally)
            logp = losses.token_logprobs(logits, mb.targets, temperature)
            with torch.set_grad_enabled(with_entropy):
                entropy = losses.entropy(logits)
        return logp, entropy if with_entropy else None, entropy.detach()

    def _behaviour_weight(self, samples: Samples, mb: MicroBatch,
                          old: torch.Tensor) -> losses.BehaviourWeight | None:
        """With the off-policy correction, a micro-batch's truncated weight pi_old / pi_sampler."""
        if not self.off_policy:
            return None
        a = self.exp.algorithm
        return losses.behaviour_weight(old, padded(samples.sampler_logprobs, mb), mb.mask, a.off_policy_cap,
                                       a.max_log_ratio)

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


def _accumulate(sums: dict[str, float], out: losses.PolicyLoss, token_entropy: torch.Tensor,
                mask: torch.Tensor, totals: tuple[int, int], behaviour: losses.BehaviourWeight | None = None
                ) -> None:
    """Add one micro-batch's share of the step's statistics: token means over the mini-batch's
    `totals` (tokens, sequences), or sequence means for a loss that clips sequences; the
    off-policy weight's (`behaviour`) are token means."""
    n_tokens, n_seqs = totals
    tokens = float(mask.sum())
    share = tokens / n_tokens if out.level == "token" else float((mask.sum(-1) > 0).sum()) / n_seqs
    ent = losses.token_sum(token_entropy, mask).item()
    sums["loss"] += out.loss.item()
    sums["pg_loss"] += out.pg_loss.item()
    sums["pg_clipfrac"] += out.clipfrac.item() * share
    sums["is_weight_mean"] += out.weight_mean.item() * share
    sums["ppo_kl"] += out.ppo_kl.item() * tokens / n_tokens
    sums["kl_ref"] += out.kl_ref.item() * tokens / n_tokens
    sums["entropy"] += ent / n_tokens
    if behaviour is not None:
        sums["off_policy_weight_mean"] += behaviour.mean.item() * tokens / n_tokens
        sums["off_policy_clipfrac"] += behaviour.clipfrac.item() * tokens / n_tokens
