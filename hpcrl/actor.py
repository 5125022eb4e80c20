"""The actor: a live DeepSpeed engine over the policy that runs an iteration's update.

The staged mode builds one per update job; the resident mode keeps one for the whole run and
streams its weights to the generator after each update. Either way the update of an iteration
is `Actor.update(ctx)`: read the committed rollouts and scores, compute advantages, old and
reference logprobs, take the PPO steps, write the per-step statistics and per-sample tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from hpcrl import advantages, commit, trainer
from hpcrl.config import Experiment
from hpcrl.stage import StageContext


class Actor:
    def __init__(self, exp: Experiment, rank: int, world_size: int, policy_path: Path, state_dir: Path | None):
        """Load the policy (and, when given, the DeepSpeed state that produced it)."""
        import deepspeed
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=u.lr, weight_decay=u.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=trainer.ds_config(exp, world_size, grad_accum))
        if state_dir is not None:
            path, _ = self.engine.load_checkpoint(str(state_dir), tag=trainer.DS_TAG)
            if path is None:
                raise RuntimeError(f"no DeepSpeed state in {state_dir}")
        self.ref_model = None
        if exp.algorithm.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(exp.model.path, dtype=dtype).to(
                self.engine.device).eval()

    @classmethod
    def for_version(cls, exp: Experiment, run, version: int, rank: int, world_size: int) -> Actor:
        return cls(exp, rank, world_size, run.policy_dir(version, exp.model.path), run.trainer_state_dir(version))

    def update(self, ctx: StageContext, guard=None) -> None:
        """The update of iteration ctx.iteration; writes `stats` and `advantages` (rank 0).

        With a preemption `guard` (hpcrl.preemption), a signal makes it save its progress after
        the current optimizer step and hand over for a requeue; a requeued update resumes there."""
        from hpcrl import preemption

        exp, k, rank, world = self.exp, ctx.iteration, self.rank, self.world_size
        gen, scored = ctx.input_dir("generate"), ctx.input_dir("score")
        if k > 0:
            ctx.input_dir("update", k - 1)
        ctx.policy_version = k + 1
        torch.manual_seed(ctx.seed)
        with ctx.timed("io"):
            samples = trainer.load_samples(commit.read_table(gen, "rollouts"), commit.read_table(scored, "scores"))
        n = len(samples)
        trainer.check_batch_shape(exp, n, world)
        adv = advantages.compute(exp.algorithm.name, samples.rewards, samples.group_ids, exp.algorithm.norm_adv_by_std)
        rows = trainer.rank_rows(list(range(n)), rank, world)
        engine, out_dir = self.engine, ctx.run.stage_dir(k, "update")
        steps = [(epoch, mini) for epoch in range(exp.update.ppo_epochs)
                 for mini in trainer.split_mini_batches(n, exp.update.mini_batches, ctx.seed, epoch)]
        with ctx.timed("compute"):
            resumed = preemption.load_progress(engine, out_dir) if guard is not None else None
            if resumed is not None:
                old, ref, stats = resumed["old"], resumed["ref"], resumed["stats"]
                _say(rank, f"[update] iteration {k}: resuming at step {len(stats) + 1}/{len(steps)} "
                           f"from {preemption.partial_dir(out_dir)}")
            else:
                engine.eval()
                old = trainer.logprobs_of(engine, samples, rows, exp, self.pad_id, engine.device)
                ref = (trainer.logprobs_of(self.ref_model, samples, rows, exp, self.pad_id, engine.device)
                       if self.ref_model is not None else None)
                stats = []
            engine.train()
            for epoch, mini in steps[len(stats):]:
                s = trainer.train_step(engine, samples, mini, adv, old, ref, exp, self.pad_id, rank, world)
                stats.append({"step": len(stats), "epoch": epoch, **s})
                if len(steps) > 1:
                    _say(rank, f"[update] iteration {k}: step {len(stats)}/{len(steps)} loss {s['loss']:.4g}")
                if guard is not None and len(stats) < len(steps) and guard.should_stop():
                    where = preemption.save_progress(engine, out_dir, rank, {"old": old, "ref": ref, "stats": stats})
                    _say(rank, f"[update] iteration {k}: saved progress ({len(stats)}/{len(steps)} steps) in {where}")
                    guard.hand_over()
        if rank == 0:
            with ctx.timed("io"):
                ctx.writer.write_table("stats", pa.Table.from_pylist(stats), "stats")
                ctx.writer.write_table("advantages", pa.table({
                    **{c: samples.keys[c] for c in samples.keys.column_names},
                    "advantage": pa.array(adv.numpy(), pa.float32()),
                    "old_logprobs": [old[i] for i in range(n)],
                    "ref_logprobs": [ref[i] for i in range(n)] if ref else pa.nulls(n, pa.list_(pa.float32())),
                }))
            ctx.writer.metrics.update(update_metrics(stats, samples, old, ctx.timings["compute"]))

    def save(self, ctx: StageContext) -> None:
        """The new policy version (HF format) and the DeepSpeed state, into the stage output."""
        with ctx.timed("io"):
            trainer.save_policy(self.engine, self.exp, ctx.writer.dir / "policy", self.rank)
            self.engine.save_checkpoint(str(ctx.writer.dir / "trainer"), tag=trainer.DS_TAG)

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


def update_metrics(stats: list[dict], samples: trainer.Samples, old: dict, compute_s: float) -> dict[str, float]:
    diffs = np.abs(np.concatenate([np.asarray(old[i]) - np.asarray(samples.sampler_logprobs[i])
                                   for i in range(len(samples))] or [np.zeros(0)]))
    mean = {k: float(np.mean([s[k] for s in stats])) for k in trainer.STAT_NAMES + ("grad_norm", "lr")}
    tokens = sum(s["tokens"] for s in stats)
    return {
        "actor/loss": mean["loss"], "actor/pg_loss": mean["pg_loss"], "actor/pg_clipfrac": mean["pg_clipfrac"],
        "actor/ppo_kl": mean["ppo_kl"], "actor/kl_loss": mean["kl_ref"], "actor/entropy": mean["entropy"],
        "actor/grad_norm": mean["grad_norm"], "actor/lr": mean["lr"],
        "rollout/logprob_diff_mean": float(diffs.mean()) if diffs.size else 0.0,
        "rollout/logprob_diff_max": float(diffs.max()) if diffs.size else 0.0,
        "perf/update_tokens_per_s": tokens / max(compute_s, 1e-9),
    }
