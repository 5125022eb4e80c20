"""Update stage: one GRPO update with DeepSpeed on the iteration's scored rollouts.

    python -m stages.update --run-dir R --iteration K          (one rank)
    torchrun --nproc-per-node 2 -m stages.update --run-dir R --iteration K

Writes the next policy version (HF format), the DeepSpeed state, per-step statistics and the
per-sample advantages and logprobs it used.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from hpcrl import advantages, commit, distributed, trainer
from hpcrl.stage import StageContext, run_stage
from stages import cli_args


def body(ctx: StageContext) -> None:
    with ctx.timed("startup"):
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

    exp, k, rank, world = ctx.exp, ctx.iteration, ctx.rank, ctx.world_size
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
    per_rank_mini = n // exp.update.mini_batches // world
    grad_accum = -(-per_rank_mini // exp.update.micro_batch_size)
    dtype = getattr(torch, exp.model.dtype)
    with ctx.timed("load"):
        tokenizer = AutoTokenizer.from_pretrained(exp.tokenizer_path)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        model = AutoModelForCausalLM.from_pretrained(ctx.run.policy_dir(k, exp.model.path), dtype=dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=exp.update.lr, weight_decay=exp.update.weight_decay)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=trainer.ds_config(exp, world, grad_accum))
        if k > 0:
            path, _ = engine.load_checkpoint(str(ctx.run.trainer_state_dir(k)), tag=trainer.DS_TAG)
            if path is None:
                raise RuntimeError(f"no DeepSpeed state in {ctx.run.trainer_state_dir(k)}")
        ref_model = None
        if exp.algorithm.kl_coef > 0:
            ref_model = AutoModelForCausalLM.from_pretrained(exp.model.path, dtype=dtype).to(engine.device).eval()
    rows = trainer.rank_rows(list(range(n)), rank, world)
    with ctx.timed("compute"):
        engine.eval()
        old = trainer.logprobs_of(engine, samples, rows, exp, pad_id, engine.device)
        ref = trainer.logprobs_of(ref_model, samples, rows, exp, pad_id, engine.device) if ref_model else None
        engine.train()
        stats = []
        for epoch in range(exp.update.ppo_epochs):
            for mini in trainer.split_mini_batches(n, exp.update.mini_batches, ctx.seed, epoch):
                s = trainer.train_step(engine, samples, mini, adv, old, ref, exp, pad_id, rank, world)
                stats.append({"step": len(stats), "epoch": epoch, **s})
    with ctx.timed("io"):
        trainer.save_policy(engine, exp, ctx.writer.dir / "policy", rank)
        engine.save_checkpoint(str(ctx.writer.dir / "trainer"), tag=trainer.DS_TAG)
        if rank == 0:
            ctx.writer.write_table("stats", pa.Table.from_pylist(stats), "stats")
            ctx.writer.write_table("advantages", pa.table({
                **{c: samples.keys[c] for c in samples.keys.column_names},
                "advantage": pa.array(adv.numpy(), pa.float32()),
                "old_logprobs": [old[i] for i in range(n)],
                "ref_logprobs": [ref[i] for i in range(n)] if ref else pa.nulls(n, pa.list_(pa.float32())),
            }))
    if rank == 0:
        ctx.writer.metrics.update(_metrics(stats, samples, old, ctx.timings["compute"]))


def _metrics(stats: list[dict], samples: trainer.Samples, old: dict, compute_s: float) -> dict[str, float]:
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


def main(argv: list[str] | None = None) -> None:
    args = cli_args("update", argv)
    rank, world = distributed.init()
    try:
        run_stage("update", args.run_dir, args.iteration, body, rank, world)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
