"""The update stage: one policy update (and the critic's, for ppo) on the iteration's scored rollouts.

`UpdateStage` is the stage object (hpcrl.stage.Stage): its setup builds the Actor (hpcrl.actor),
which a stage job builds once per update and the resident trainer keeps for the run. `Update` is
the update of one iteration: read the committed rollouts and scores; compute the old and
reference logprobs and the advantages (GAE from the critic's values, for ppo); take an optimizer
step per mini-batch of each epoch; write the per-step statistics and the per-sample table. Its
progress is one `UpdateState`: on Slurm's preemption signal it is saved between two steps with
the engines' state (hpcrl.preemption), and the requeued job loads it whole and goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from hpcrl import advantages, agreement, batches, commit, hf_imports, kl_control, losses, preemption, trainer
from hpcrl import update_ahead as ahead
from hpcrl.actor import Actor, StepInputs
from hpcrl.jit_ops import import_deepspeed
from hpcrl.kl_control import KLControl
from hpcrl.schemas import UPDATE_STATS
from hpcrl.stage import Stage, StageContext
from hpcrl.stage_kinds import GENERATE, SCORE, UPDATE

Rows = ahead.Rows


@dataclass
class UpdateState:
    """An update's progress: what a requeued update needs besides the engines' state."""

    old: Rows  # the old policy's logprobs (the first step adds its own when it computes them)
    ref: Rows | None  # the reference policy's logprobs
    adv: torch.Tensor | Rows  # one advantage per sample, or per token by row (ppo, discounted returns)
    old_values: Rows | None = None  # ppo: the critic's values before its steps
    returns: Rows | None = None  # ppo: GAE's returns
    control: KLControl | None = None  # the KL controller's record, once the batch's KL is priced
    metrics: dict[str, float] = field(default_factory=dict)
    stats: list[dict] = field(default_factory=list)  # one per optimizer step taken
    rng: torch.Tensor | None = None  # torch's RNG state when the progress was saved

    @property
    def step(self) -> int:
        """Optimizer steps taken (epochs and mini-batches follow from the update's step list)."""
        return len(self.stats)


class UpdateStage(Stage):
    """The update stage: the actor of update.backend (the DeepSpeed engine and critic, or
    Megatron-Core's model), one update per run."""

    name = UPDATE
    actor: Actor | None = None
    # called on every rank once an update's compute has ended and its weights are known finite,
    # before its outputs are written (the resident trainers send the weights then)
    after_compute: Callable[[], None] | None = None
    prepared: ahead.Prepared | None = None  # the next update's, computed ahead (`prepare`)

    def startup(self) -> None:
        import_deepspeed()  # its import cost is process start-up, not model loading

    def setup(self, version: int, seed: int = 0) -> None:
        hf_imports.skip_scikit_learn()
        if self.exp.update.backend == "megatron":
            from hpcrl.megatron_actor import MegatronActor

            self.actor = MegatronActor.for_version(self.exp, self.rundir, version, self.rank, self.world_size)
        else:
            self.actor = Actor.for_version(self.exp, self.rundir, version, self.rank, self.world_size)

    def prepare(self, k: int) -> None:
        """Compute update k's logprobs before its first step now (hpcrl.update_ahead), for its
        run: call it only when the actor holds the weights update k starts from."""
        self.prepared = ahead.prepare(self.actor, self.rundir, k)

    def run(self, ctx: StageContext, guard: preemption.Guard | None = None) -> None:
        prepared, self.prepared = self.prepared, None
        Update(self.actor, ctx, guard, self.after_compute, prepared).run()

    def job(self, ctx: StageContext) -> None:
        """Set up, update under Slurm's pre-timeout signal (save progress, requeue, resume), save."""
        with ctx.timed("startup"):
            self.startup()
        with ctx.timed("load"):
            self.setup(ctx.iteration)
        with preemption.Guard() as guard:
            self.run(ctx, guard)
        self.actor.save(ctx)


class Update:
    """The update of ctx.iteration by `actor`; writes `stats` and `advantages` (rank 0).

    With a preemption `guard`, a signal makes it save its progress after the current optimizer
    step and hand over for a requeue; a requeued update resumes there. `after_compute` runs once
    the steps have ended and the weights are known finite, before the writes."""

    def __init__(self, actor: Actor, ctx: StageContext, guard: preemption.Guard | None = None,
                 after_compute: Callable[[], None] | None = None, prepared: ahead.Prepared | None = None):
        exp, k = actor.exp, ctx.iteration
        a = exp.algorithm
        self.actor, self.ctx, self.guard, self.exp = actor, ctx, guard, exp
        self.after_compute = after_compute
        gen, scored = ctx.input_dir(GENERATE), ctx.input_dir(SCORE)
        previous = ctx.input_dir(UPDATE, k - 1) if k > 0 else None
        ctx.policy_version = k + 1
        trainer.manual_seed(ctx.seed)
        prepared = ahead.of_update(prepared, k, ctx.inputs[f"{GENERATE}@{gen.parent.name}"])
        with ctx.timed("io"):
            rollouts = prepared.rollouts if prepared is not None else commit.read_table(gen, "rollouts")
            self.samples = batches.load_samples(rollouts, commit.read_table(scored, "scores"))
        n = len(self.samples)
        trainer.check_batch_shape(exp.update, n, actor.world_size)
        self.rows = actor.data_rows(list(range(n)))
        self.engines = {"trainer": actor.engine, **({"critic": actor.critic.engine} if actor.critic else {})}
        self.steps = ahead.steps(exp, self.samples.group_ids.tolist(), ctx.seed)
        self.trains_policy = ahead.trains_policy(actor, k)
        self.own_old = ahead.owns_old(actor, k)
        # computed ahead (hpcrl.update_ahead) for this batch: what the update would compute itself
        self.prepared = prepared if prepared is not None and prepared.keys.equals(self.samples.keys) else None
        self.coef = kl_control.current_coef(a.kl, previous) if actor.ref_model is not None else 0.0
        self.loss_coef = self.coef if a.kl.mode == "loss" else 0.0

    def run(self) -> None:
        ctx, k = self.ctx, self.ctx.iteration
        with ctx.timed("compute"):
            state = self._resumed() or self._start()
            if not self.own_old:
                self._check_sampler(state)  # the old logprobs are all known before any step
            self.actor.engine.train()
            for epoch, mini in self.steps[state.step:]:
                self._step(state, epoch, mini)
                if self.guard is not None and state.step < len(self.steps) and self.guard.should_stop():
                    self._hand_over(state)
        trainer.refuse_non_finite(k, state.stats, {name: e.module for name, e in self.engines.items()})
        if self.after_compute is not None:
            self.after_compute()
        if self.actor.rank == 0:
            self._write(state)

    def _start(self) -> UpdateState:
        """The batch's old and reference logprobs and its advantages, before any step."""
        actor, samples, a = self.actor, self.samples, self.exp.algorithm
        metrics = {}
        if self.prepared is not None:
            old, ref = self.prepared.old, self.prepared.ref
            self.ctx.timings["prepare"] = self.prepared.seconds
        else:
            first = set(self.steps[0][1]) if self.own_old else set()
            old, ref = ahead.logprobs_before_steps(actor, samples, first)
        if old is None:  # algorithm.old_logprobs = "sampler"
            old = dict(enumerate(samples.sampler_logprobs))
        mask = trainer.response_mask([len(r) for r in samples.response_ids])
        kl_tokens, control = None, None
        if ref is not None and not self.own_old:
            kl_tokens, control = self._price_kl(old, ref, metrics)
        if actor.critic is None:
            lengths = torch.tensor([len(r) for r in samples.response_ids])
            adv = advantages.compute(a.name, samples.rewards, samples.group_ids, lengths,
                                     norm_by_std=a.norm_adv_by_std, eps=a.std_eps, gamma=a.reinforce_gamma,
                                     baselines=samples.baselines)
            if isinstance(adv, list):  # per token (reinforce_plus_plus with gamma < 1)
                adv = dict(enumerate(adv))
            return UpdateState(old, ref, adv, control=control, metrics=metrics)
        reward_coef = control.kl_coef if control is not None and a.kl.mode == "reward" else 0.0
        adv, old_values, returns = self._gae(mask, kl_tokens, reward_coef, metrics)
        return UpdateState(old, ref, adv, old_values, returns, control, metrics)

    def _step(self, state: UpdateState, epoch: int, mini: list[int]) -> None:
        """One optimizer step on mini-batch `mini` (the policy's, the critic's, or both)."""
        actor, s = self.actor, {"step": state.step, "epoch": epoch}
        if self.trains_policy:
            fresh = self.own_old and not state.stats
            s.update(actor.train_step(self.samples, mini, StepInputs(state.adv, None if fresh else state.old,
                                                                     state.ref, self.loss_coef)))
            state.old.update(s.pop("old", {}))
            if fresh:  # the first step's forward pass completed the old logprobs
                self._check_sampler(state)
        # own_old: the batch's old logprobs are all in now
        if state.ref is not None and state.control is None:
            _, state.control = self._price_kl(state.old, state.ref, state.metrics)
        if actor.critic is not None:
            s.update(actor.critic.train_step(self.samples, mini, state.old_values, state.returns))
        state.stats.append(s)
        if len(self.steps) > 1:
            self._say(f"step {state.step}/{len(self.steps)}"
                      + (f" loss {s['loss']:.4g}" if "loss" in s else ""))

    def _check_sampler(self, state: UpdateState) -> None:
        """Record how far the trainer's old logprobs are from the sampler's (every rank holds them
        all) and how stale the samples are, and stop when beyond update.sampler_mismatch_tol
        (hpcrl.agreement): at the first step, before the update spends its compute on a model other
        than the one generating. The tolerance holds only when every sample was generated by the
        version the update starts from: a stale sample's sampler (an older policy, with
        algorithm.max_staleness) legitimately differs, so a batch with one is not checked."""
        exp, k = self.exp, self.ctx.iteration
        mismatch = agreement.sampler_mismatch(state.old, self.samples.sampler_logprobs)
        state.metrics.update(mismatch)
        staleness = staleness_metrics(k, self.samples.policy_versions)
        state.metrics.update(staleness)
        fresh = staleness["rollout/staleness_max"] == 0
        if exp.algorithm.old_logprobs == "recompute" and exp.generate.top_p == 1.0 and fresh:
            tol = agreement.sampler_tolerance(exp.update.sampler_mismatch_tol, exp.model.dtype)
            agreement.check_sampler(mismatch, tol, k)

    def _hand_over(self, state: UpdateState) -> None:
        """Save the progress (every rank: its engines' state) and let Slurm requeue the job."""
        state.rng = torch.get_rng_state()
        out_dir = self.ctx.run.stage_dir(self.ctx.iteration, UPDATE)
        where = preemption.save_progress(self.actor, out_dir, self.actor.rank, state)
        self._say(f"saved progress ({state.step}/{len(self.steps)} steps) in {where}")
        self.guard.hand_over()

    def _resumed(self) -> UpdateState | None:
        """The progress an interrupted attempt saved (the engines' state restored), if any."""
        if self.guard is None:
            return None
        out_dir = self.ctx.run.stage_dir(self.ctx.iteration, UPDATE)
        state = preemption.load_progress(self.actor, out_dir, (UpdateState, KLControl))
        if state is None:
            return None
        if state.rng is not None:
            torch.set_rng_state(state.rng)
        self._say(f"resuming at step {state.step + 1}/{len(self.steps)} from "
                  f"{preemption.partial_dir(out_dir)}")
        return state

    def _write(self, state: UpdateState) -> None:
        ctx, samples = self.ctx, self.samples
        with ctx.timed("io"):
            ctx.writer.write_table("stats", pa.Table.from_pylist(state.stats, schema=UPDATE_STATS), "stats")
            ctx.writer.write_table("advantages", advantages_table(samples, state.adv, state.old, state.ref,
                                                                  state.old_values, state.returns))
            if state.control is not None:
                state.control.save(ctx.writer.dir)
        busy = ctx.timings["compute"] + ctx.timings.get("prepare", 0.0)
        ctx.writer.metrics.update(update_metrics(state.stats, busy))
        ctx.notes["attn_implementation"] = self.actor.attn_implementation
        ctx.notes["gradient_checkpointing"] = str(self.actor.gradient_checkpointing).lower()
        ctx.notes["offload"] = self.actor.offload
        ctx.writer.metrics.update(state.metrics)

    def _price_kl(self, old: Rows, ref: Rows, metrics: dict) -> tuple[torch.Tensor, KLControl]:
        """The batch's per-token KL to the reference (old vs ref logprobs) at this update's
        coefficient, and its KL control record."""
        a, samples = self.exp.algorithm, self.samples
        mask = trainer.response_mask([len(r) for r in samples.response_ids])
        kl_tokens = losses.kl_penalty(trainer.pad_rows(old, mask), trainer.pad_rows(ref, mask),
                                      a.kl.estimator)
        kl_tokens = kl_tokens * mask
        control = kl_control.step(a.kl, self.coef, kl_control.sequence_kl(kl_tokens, mask), len(samples))
        metrics.update({"critic/kl_coef": self.coef, "actor/reward_kl_penalty": control.kl})
        return kl_tokens, control

    def _gae(self, mask: torch.Tensor, kl_tokens: torch.Tensor | None, kl_coef: float,
             metrics: dict) -> tuple[Rows, Rows, Rows]:
        """PPO: the critic's values of the batch, and GAE's token advantages and returns, by row."""
        from hpcrl.critic import gae_targets

        values = trainer.pad_rows(self.actor.critic.values_of(self.samples, self.rows), mask)
        targets = gae_targets(self.samples.rewards, mask, values, kl_tokens, kl_coef, self.exp.algorithm)
        metrics.update(critic_metrics(values, targets, mask))
        return (trainer.unpad_rows(targets.advantages, mask), trainer.unpad_rows(values, mask),
                trainer.unpad_rows(targets.returns, mask))

    def _say(self, line: str) -> None:
        if self.actor.rank == 0:
            print(f"[update] iteration {self.ctx.iteration}: {line}", flush=True)


def advantages_table(samples: batches.Samples, adv, old: dict, ref: dict | None, values: dict | None,
                     returns: dict | None) -> pa.Table:
    """The per-sample record of the update; for ppo (`adv` by row) also per-token advantages, values,
    returns."""
    n = len(samples)
    floats = pa.list_(pa.float32())

    def rows(d: dict | None):
        return pa.array([d[i] for i in range(n)], floats) if d is not None else pa.nulls(n, floats)

    token_adv = adv if isinstance(adv, dict) else None
    per_sample = (adv.numpy() if token_adv is None
                  else [float(np.mean(v)) if v else 0.0 for v in token_adv.values()])
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


def staleness_metrics(iteration: int, policy_versions: torch.Tensor) -> dict[str, float]:
    """How many iterations old the policies that generated the batch are: the update of
    `iteration` starts from policy version `iteration` (0 in lock-step)."""
    stale = (iteration - policy_versions).double()
    if not stale.numel():
        return {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    return {"rollout/staleness_mean": float(stale.mean()), "rollout/staleness_max": float(stale.max())}


def update_metrics(stats: list[dict], compute_s: float) -> dict[str, float]:
    """Means over the steps, largest values for the maxima; a statistic no step has (the policy's
    during critic warmup, the off-policy correction's without it) is left out."""
    names = {"loss": "actor/loss", "pg_loss": "actor/pg_loss", "pg_clipfrac": "actor/pg_clipfrac",
             "ppo_kl": "actor/ppo_kl", "kl_ref": "actor/kl_loss", "entropy": "actor/entropy",
             "is_weight_mean": "actor/is_weight_mean",
             "grad_norm": "actor/grad_norm", "lr": "actor/lr", "vf_loss": "critic/vf_loss",
             "vf_clipfrac": "critic/vf_clipfrac", "vf_grad_norm": "critic/grad_norm",
             "moe_load_max": "moe/load_max", "moe_load_min": "moe/load_min", "moe_aux_loss": "moe/aux_loss",
             "off_policy_weight_mean": "actor/off_policy_weight_mean",
             "off_policy_clipfrac": "actor/off_policy_clipfrac"}
    maxima = {"is_weight_max": "actor/is_weight_max", "off_policy_weight_max": "actor/off_policy_weight_max"}
    out = {}
    for key, name in [*names.items(), *maxima.items()]:
        values = [s[key] for s in stats if s.get(key) is not None]
        if values:
            out[name] = float(max(values) if key in maxima else np.mean(values))
    tokens = sum(s.get("tokens") or 0 for s in stats)
    return {
        **out,
        "perf/update_tokens_per_s": tokens / max(compute_s, 1e-9),
    }
