#!/usr/bin/env python
"""TRL's GRPOTrainer on an hpcrl task, timed per iteration: the TRL side of tools/bench_trl.py.

Runs inside the benchmark's own TRL virtual environment (tools/bench_trl.py builds it), never in
hpcrl's: it imports neither hpcrl nor vLLM. TRL generates with plain `model.generate` (its CPU
path). One "iteration" is what hpcrl calls one: `--prompts` prompts x `--group-size` completions
generated at once (TRL's generation_batch_size), then `--mini-batches` optimizer steps over them
(micro-batches accumulated as TRL's gradient_accumulation_steps), `--ppo-epochs` times (TRL's
num_iterations).

    python tools/trl_grpo_run.py --model DIR --train train.parquet --iterations 10 --out times.json

The output JSON holds `iteration_end` (time.perf_counter() when each iteration's last optimizer
step ended), `train_start` (just before trainer.train()), `process_start`, the mean reward of each
iteration, and the versions used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

PROCESS_START = time.perf_counter()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def prompts_and_answers(path: str, tokenizer) -> tuple[list[str], list[str]]:
    """verl-layout parquet -> model input texts (chat template, generation prompt) and answers,
    rendered as hpcrl.data.render does."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path, columns=["prompt", "reward_model"]).to_pylist()
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
             for r in rows]
    return texts, [str(r["reward_model"]["ground_truth"]) for r in rows]


def exact_match(completions: list[str], ground_truth: list[str], **_) -> list[float]:
    """1 when the completion, stripped of surrounding space, equals the answer (hpcrl.rewards:exact_match)."""
    return [float(c.strip() == g.strip()) for c, g in zip(completions, ground_truth, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="HF model directory (copied to a temporary directory first)")
    parser.add_argument("--train", required=True, help="verl-layout parquet of training prompts")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--mini-batches", type=int, default=2,
                        help="optimizer steps per pass over an iteration's batch")
    parser.add_argument("--micro-batch", type=int, default=128, help="sequences per forward/backward")
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference model)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, help="JSON file for the timings")
    args = parser.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    completions = args.prompts * args.group_size
    if completions % args.mini_batches:
        parser.error(f"--prompts x --group-size = {completions} must split into "
                     f"--mini-batches {args.mini_batches}")
    mini_batch = completions // args.mini_batches
    micro_batch = min(args.micro_batch, mini_batch)
    if mini_batch % micro_batch:
        parser.error(f"a mini-batch of {mini_batch} sequences must split into micro-batches of {micro_batch}")
    steps_per_iteration = args.mini_batches * args.ppo_epochs
    iteration_end: list[float] = []
    rewards: list[float] = []

    class IterationClock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step % steps_per_iteration == 0:
                iteration_end.append(time.perf_counter())

        def on_log(self, _args, state, control, logs=None, **kwargs):
            # one log per optimizer step; the reward of an iteration is logged at its first step
            if logs and "reward" in logs and (state.global_step - 1) % steps_per_iteration == 0:
                rewards.append(float(logs["reward"]))

    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as tmp:
        model_dir = shutil.copytree(args.model, os.path.join(tmp, "model"))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        texts, answers = prompts_and_answers(args.train, tokenizer)
        dataset = Dataset.from_dict({"prompt": texts, "ground_truth": answers})
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = GRPOConfig(
            output_dir=os.path.join(tmp, "out"),
            max_steps=args.iterations * steps_per_iteration,
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=mini_batch // micro_batch,  # one optimizer step per mini-batch
            generation_batch_size=completions,  # one generation of all prompts x samples per iteration
            num_generations=args.group_size,
            num_iterations=args.ppo_epochs,
            max_completion_length=args.max_tokens,
            temperature=args.temperature,
            top_p=1.0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=args.grad_clip,
            epsilon=args.clip,
            beta=args.beta,
            loss_type="dapo",  # token mean over the optimizer step's batch, as hpcrl's token-mean
            scale_rewards="group",
            gradient_checkpointing=False,
            bf16=False,
            use_cpu=not torch.cuda.is_available(),
            seed=args.seed,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[IterationClock()])
        train_start = time.perf_counter()
        trainer.train()
        train_end = time.perf_counter()
    with open(args.out, "w") as f:
        json.dump({"process_start": PROCESS_START, "train_start": train_start, "train_end": train_end,
                   "iteration_end": iteration_end, "rewards": rewards,
                   "completions_per_iteration": completions,
                   "params": sum(p.numel() for p in model.parameters()),
                   "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                "torch": torch.__version__}}, f, indent=1)


if __name__ == "__main__":
    main()
