"""The actor: a live DeepSpeed engine over the policy that runs an iteration's update.

The staged mode builds one per update job; the resident mode keeps one for the whole run and
streams its weights to the generator after each update. Either way the update of an iteration
is `Actor.update(ctx)`: read the committed rollouts and scores, compute old and reference
logprobs and advantages, take the PPO steps, write the per-step statistics and per-sample tables.
With `algorithm.name = "ppo"` the actor also owns the critic (hpcrl.critic): it scores the batch
with values, turns token-level rewards into GAE advantages and returns, and takes its own steps
beside the policy's on the same mini-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from hpcrl import advantages, commit, kl_control, losses, trainer
from hpcrl.config import Experiment
from hpcrl.schemas import UPDATE_STATS
from hpcrl.stage import StageContext

# What an interrupted update saves besides the engines' state (hpcrl.preemption), in this order.
PROGRESS = ("old", "ref", "adv", "old_values", "returns", "control", "metrics", "stats")


class Actor:
    def __init__(self, exp: Experiment, rank: int, world_size: int, policy_path: Path, state_dir: Path | None,
                 critic_path: Path | None = None, critic_state: Path | None = None):
        """Load the policy (and, when given, the DeepSpeed state that produced it); for ppo, the critic."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.exp, self.rank, self.world_size = exp, rank, world_size
        u = exp.update
        n = exp.algorithm.prompts_per_iteration * exp.algorithm.group_size
        trainer.check_batch_shape(exp, n, world_size)
        grad_accum = -(-(n // u.mini_batches // world_size) // u.micro_batch_size)
        dtype = getattr(torch, exp.model.dtype)
        tokenizer = AutoTokenizer.from_pretrained(exp.tokenizer_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype)
        self.engine = trainer.make_engine(model, u.lr, exp, world_size, grad_accum, state_dir)
        self.ref_model = None
        if exp.algorithm.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(exp.model.path, dtype=dtype).to(
                self.engine.device).eval()
        self.critic = None
        if exp.algorithm.name == "ppo":
            from hpcrl.critic import Critic

            self.critic = Critic(exp, rank, world_size, critic_path or exp.algorithm.critic_path or exp.model.path,
                                 critic_state, grad_accum, self.pad_id)

    @classmethod
    def for_version(cls, exp: Experiment, run, version: int, rank: int, world_size: int) -> Actor:
        critic_path = run.critic_dir(version, exp.algorithm.critic_path or exp.model.path)
        return cls(exp, rank, world_size, run.policy_dir(version, exp.model.path), run.trainer_state_dir(version),
                   critic_path, run.critic_state_dir(version))

    def update(self, ctx: StageContext, guard=None) -> None:
        """The update of iteration ctx.iteration; writes `stats` and `advantages` (rank 0).

        With a preemption `guard` (hpcrl.preemption), a signal makes it save its progress after
        the current optimizer step and hand over for a requeue; a requeued update resumes there."""
        from hpcrl import preemption

        exp, a, k, rank, world = self.exp, self.exp.algorithm, ctx.iteration, self.rank, self.world_size
        gen, scored = ctx.input_dir("generate"), ctx.input_dir("score")
        previous = ctx.input_dir("update", k - 1) if k > 0 else None
        ctx.policy_version = k + 1
        torch.manual_seed(ctx.seed)
        with ctx.timed("io"):
            samples = trainer.load_samples(commit.read_table(gen, "rollouts"), commit.read_table(scored, "scores"))
        n = len(samples)
        trainer.check_batch_shape(exp, n, world)
        rows = trainer.rank_rows(list(range(n)), rank, world)
        engine, out_dir = self.engine, ctx.run.stage_dir(k, "update")
        engines = {"trainer": engine, **({"critic": self.critic.engine} if self.critic is not None else {})}
        steps = [(epoch, mini) for epoch in range(exp.update.ppo_epochs)
                 for mini in trainer.split_mini_batches(samples.group_ids.tolist(), exp.update.mini_batches,
                                                          ctx.seed, epoch)]
        trains_policy = self.critic is None or k >= a.critic_warmup
        # Until the first optimizer step the policy is the old one, so the first mini-batch's old
        # logprobs come from its own training forward pass; unless GAE must price the reference KL
        # into the rewards before any step (kl_mode "reward"). A KL in the loss is priced (for
        # the controller and the metrics) after that step, once the old logprobs cover the batch.
        own_old = (a.old_logprobs == "recompute" and trains_policy
                   and not (self.ref_model is not None and a.kl_mode == "reward"))
        coef = kl_control.current_coef(a, previous) if self.ref_model is not None else 0.0
        with ctx.timed("compute"):
            resumed = preemption.load_progress(engines, out_dir) if guard is not None else None
            if resumed is not None:
                old, ref, adv, old_values, returns, control, metrics, stats = (resumed[key] for key in PROGRESS)
                _say(rank, f"[update] iteration {k}: resuming at step {len(stats) + 1}/{len(steps)} "
                           f"from {preemption.partial_dir(out_dir)}")
            else:
                metrics: dict[str, float] = {}
                engine.eval()
                if a.old_logprobs == "sampler":
                    old = dict(enumerate(samples.sampler_logprobs))
                else:
                    first = set(steps[0][1]) if own_old else set()
                    later = trainer.rank_rows([i for i in range(n) if i not in first], rank, world)
                    old = trainer.logprobs_of(engine, samples, later, exp, self.pad_id, engine.device)
                ref = (trainer.logprobs_of(self.ref_model, samples, rows, exp, self.pad_id, engine.device)
                       if self.ref_model is not None else None)
                mask = trainer.response_mask([len(r) for r in samples.response_ids])
                kl_tokens, control = None, None
                if ref is not None and not own_old:
                    kl_tokens, control = self._price_kl(samples, old, ref, coef, metrics)
                old_values = returns = None
                if self.critic is None:
                    adv = advantages.compute(a.name, samples.rewards, samples.group_ids, a.norm_adv_by_std)
                else:
                    reward_coef = control.kl_coef if control is not None and a.kl_mode == "reward" else 0.0
                    adv, old_values, returns = self._gae(samples, rows, mask, kl_tokens, reward_coef, metrics)
                stats = []
            loss_coef = coef if a.kl_mode == "loss" else 0.0
            engine.train()
            for epoch, mini in steps[len(stats):]:
                s = {"step": len(stats), "epoch": epoch}
                if trains_policy:
                    fresh = own_old and not stats
                    s.update(trainer.train_step(engine, samples, mini, adv, None if fresh else old, ref, exp,
                                                self.pad_id, rank, world, kl_coef=loss_coef))
                    old.update(s.pop("old", {}))
                if ref is not None and control is None:  # own_old: the batch's old logprobs are all in now
                    _, control = self._price_kl(samples, old, ref, coef, metrics)
                if self.critic is not None:
                    s.update(self.critic.train_step(samples, mini, old_values, returns))
                stats.append(s)
                if len(steps) > 1:
                    _say(rank, f"[update] iteration {k}: step {len(stats)}/{len(steps)}"
                               + (f" loss {s['loss']:.4g}" if "loss" in s else ""))
                if guard is not None and len(stats) < len(steps) and guard.should_stop():
                    values = (old, ref, adv, old_values, returns, control, metrics, stats)
                    where = preemption.save_progress(engines, out_dir, rank, dict(zip(PROGRESS, values, strict=True)))
                    _say(rank, f"[update] iteration {k}: saved progress ({len(stats)}/{len(steps)} steps) in {where}")
                    guard.hand_over()
        trainer.refuse_non_finite(k, stats, {name: e.module for name, e in engines.items()})
        if rank == 0:
            with ctx.timed("io"):
                ctx.writer.write_table("stats", pa.Table.from_pylist(stats, schema=UPDATE_STATS), "stats")
                ctx.writer.write_table("advantages", advantages_table(samples, adv, old, ref, old_values, returns))
                if control is not None:
                    control.save(ctx.writer.dir)
            ctx.writer.metrics.update(update_metrics(stats, samples, old, ctx.timings["compute"]))
            ctx.writer.metrics.update(metrics)

    def _price_kl(self, samples: trainer.Samples, old: dict, ref: dict, coef: float,
                  metrics: dict) -> tuple[torch.Tensor, kl_control.KLControl]:
        """The batch's per-token KL to the reference (old vs ref logprobs) at this update's coefficient,
        and its KL control record."""
        a = self.exp.algorithm
        mask = trainer.response_mask([len(r) for r in samples.response_ids])
        kl_tokens = losses.kl_penalty(trainer.pad_rows(old, mask), trainer.pad_rows(ref, mask), a.kl_estimator) * mask
        control = kl_control.step(a, coef, kl_control.sequence_kl(kl_tokens, mask), len(samples))
        metrics.update({"critic/kl_coef": coef, "actor/reward_kl_penalty": control.kl})
        return kl_tokens, control

    def _gae(self, samples: trainer.Samples, rows: list[int], mask: torch.Tensor, kl_tokens: torch.Tensor | None,
             kl_coef: float, metrics: dict) -> tuple[dict, dict, dict]:
        """PPO: the critic's values of the batch, and GAE's token advantages and returns, by row."""
        from hpcrl.critic import gae_targets

        values = trainer.pad_rows(self.critic.values_of(samples, rows), mask)
        targets = gae_targets(samples.rewards, mask, values, kl_tokens, kl_coef, self.exp.algorithm)
        metrics.update(critic_metrics(values, targets, mask))
        return (trainer.unpad_rows(targets.advantages, mask), trainer.unpad_rows(values, mask),
                trainer.unpad_rows(targets.returns, mask))

    def save(self, ctx: StageContext) -> None:
        """The new policy version (HF format) and the DeepSpeed state (and the critic's), into the stage output."""
        with ctx.timed("io"):
            trainer.save_policy(self.engine, self.exp, ctx.writer.dir / "policy", self.rank)
            self.engine.save_checkpoint(str(ctx.writer.dir / "trainer"), tag=trainer.DS_TAG)
            if self.critic is not None:
                self.critic.save(ctx.writer.dir / "critic", ctx.writer.dir / "trainer" / "critic")

    @contextmanager
    def full_parameters(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every parameter, whole, in HF names (collective under ZeRO-3: every rank enters).

        Tied parameters come under each of their names (lm_head.weight and embed_tokens.weight):
        vLLM's in-place reload unties them when only one name arrives."""
        module = self.engine.module
        params = list(module.named_parameters(remove_duplicate=False))
        if self.exp.update.zero_stage == 3:
            import deepspeed

            unique = list({id(p): p for _, p in params}.values())
            with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
                yield [(n, p.data) for n, p in params]
        else:
            yield [(n, p.data) for n, p in params]

    @torch.no_grad()
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprobs (temperature 1) of tokens 1.. of each sequence: the probe the generator repeats."""
        from hpcrl import losses

        self.engine.eval()
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, s in enumerate(sequences):
            ids[b, : len(s)] = torch.tensor(s)
            attn[b, : len(s)] = 1
        ids, attn = ids.to(self.engine.device), attn.to(self.engine.device)
        logits = self.engine(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        lp = losses.token_logprobs(logits, ids[:, 1:], 1.0)
        return [lp[b, : len(s) - 1].tolist() for b, s in enumerate(sequences)]


def _say(rank: int, line: str) -> None:
    if rank == 0:
        print(line, flush=True)


def advantages_table(samples: trainer.Samples, adv, old: dict, ref: dict | None, values: dict | None,
                     returns: dict | None) -> pa.Table:
    """The per-sample record of the update; for ppo (`adv` by row) also per-token advantages, values, returns."""
    n = len(samples)
    floats = pa.list_(pa.float32())

    def rows(d: dict | None):
        return pa.array([d[i] for i in range(n)], floats) if d is not None else pa.nulls(n, floats)

    token_adv = adv if isinstance(adv, dict) else None
    per_sample = adv.numpy() if token_adv is None else [float(np.mean(v)) if v else 0.0 for v in token_adv.values()]
    return pa.table({
        **{c: samples.keys[c] for c in samples.keys.column_names},
        "advantage": pa.array(per_sample, pa.float32()),
        "old_logprobs": [old[i] for i in range(n)],
        "ref_logprobs": rows(ref),
        "token_advantages": rows(token_adv),
        "values": rows(values),
        "returns": rows(returns),
    })


def critic_metrics(values: torch.Tensor, targets, mask: torch.Tensor) -> dict[str, float]:
    """The critic's view of the batch, before its steps: how well its values explain the returns."""
    m = mask.bool()
    mean = (lambda t: float(t[m].mean())) if m.any() else (lambda t: 0.0)
    return {
        "critic/explained_variance": losses.explained_variance(values, targets.returns, mask),
        "critic/values_mean": mean(values),
        "critic/returns_mean": mean(targets.returns),
        "critic/advantages_mean": mean(targets.advantages),
        "critic/token_reward_mean": mean(targets.rewards),
    }


def update_metrics(stats: list[dict], samples: trainer.Samples, old: dict, compute_s: float) -> dict[str, float]:
    """Means over the steps; a statistic no step has (the policy's during critic warmup) is left out."""
    diffs = np.abs(np.concatenate([np.asarray(old[i]) - np.asarray(samples.sampler_logprobs[i])
                                   for i in range(len(samples))] or [np.zeros(0)]))
    names = {"loss": "actor/loss", "pg_loss": "actor/pg_loss", "pg_clipfrac": "actor/pg_clipfrac",
             "ppo_kl": "actor/ppo_kl", "kl_ref": "actor/kl_loss", "entropy": "actor/entropy",
             "grad_norm": "actor/grad_norm", "lr": "actor/lr", "vf_loss": "critic/vf_loss",
             "vf_clipfrac": "critic/vf_clipfrac", "vf_grad_norm": "critic/grad_norm"}
    out = {}
    for key, name in names.items():
        values = [s[key] for s in stats if s.get(key) is not None]
        if values:
            out[name] = float(np.mean(values))
    tokens = sum(s.get("tokens") or 0 for s in stats)
    return {
        **out,
        "rollout/logprob_diff_mean": float(diffs.mean()) if diffs.size else 0.0,
        "rollout/logprob_diff_max": float(diffs.max()) if diffs.size else 0.0,
        "perf/update_tokens_per_s": tokens / max(compute_s, 1e-9),
    }
