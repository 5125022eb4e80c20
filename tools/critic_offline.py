"""Could a critic with more data explain a run's returns? Train one offline and score it out of sample.

    python tools/critic_offline.py RUN_DIR --policy-version 10 --test-iterations 12-19 \
        [--samples-per-prompt 8] [--steps 100,300,600,1000,1500] [--lr 3e-4]

Samples `--samples-per-prompt` responses (HF generate, temperature 1, generate.max_tokens) from a
policy version of the run for every training prompt that none of the test iterations drew, scores
them with exact match, and trains a fresh critic (the run's model.path backbone and a zero value
head, hpcrl.critic.load_value_model) on them: plain squared error against the outcome at every
response token, AdamW, random batches of 256. At each step count in `--steps` it prints the
explained variance of its values against the outcome on the run's own batches of the test
iterations (prompts it never saw): the same quantity as critic/explained_variance with lam = 1,
without the KL term. For exact-match tasks (hpcrl.rewards:exact_match) only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from hpcrl import batches, commit
from hpcrl.batches import collate, micro_batches, padded, response_values
from hpcrl.config import load
from hpcrl.critic import load_value_model
from hpcrl.rundir import RunDir


def run_batch(run: RunDir, k: int) -> tuple[batches.Samples, dict[int, list[float]]]:
    """Iteration k's update batch and its outcome returns (the sample's reward at each token)."""
    s = batches.load_samples(commit.read_table(run.stage_dir(k, "generate"), "rollouts"),
                             commit.read_table(run.stage_dir(k, "score"), "scores"))
    return s, {i: [float(s.rewards[i])] * len(s.response_ids[i]) for i in range(len(s))}


def sample_rollouts(policy, tokenizer, prompts: list[list[int]], answers: list[str], n: int, max_tokens: int,
                    pad: int) -> batches.Samples:
    """n responses per prompt (temperature 1), each ending at EOS or max_tokens, scored by exact match."""
    eos = tokenizer.eos_token_id
    p_ids, r_ids, rewards = [], [], []
    with torch.no_grad():
        for start in range(0, len(prompts), 256):
            chunk = prompts[start: start + 256]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # left-padded
            attn = (ids != pad).long()
            for _ in range(n):
                out = policy.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, max_new_tokens=max_tokens, eos_token_id=eos,
                                      pad_token_id=pad)
                for b, p in enumerate(chunk):
                    response = out[b, width:].tolist()
                    response = response[: response.index(eos) + 1] if eos in response else response
                    text = tokenizer.decode([t for t in response if t != eos])
                    p_ids.append(p)
                    r_ids.append(response)
                    rewards.append(float(text.strip() == answers[start + b].strip()))
    return batches.Samples(None, p_ids, r_ids, [], torch.tensor(rewards, dtype=torch.float64), torch.zeros(0))


def explained_variances(model, batches, pad: int) -> list[float]:
    model.eval()
    out = []
    for samples, returns in batches:
        values, targets = [], []
        with torch.no_grad():
            for mb in micro_batches(samples, list(range(len(samples))), 256, pad):
                v = model(mb.input_ids, mb.attention_mask).values[:, :-1]
                for i, row in zip(mb.index.tolist(), response_values(v, mb), strict=True):
                    values += row
                    targets += returns[i]
        values, targets = np.asarray(values), np.asarray(targets)
        out.append(float(1 - (targets - values).var() / targets.var()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--policy-version", type=int, required=True)
    parser.add_argument("--test-iterations", required=True, help="first-last")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--steps", default="100,300,600,1000,1500")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    run = RunDir.at(args.run_dir)
    exp = load(run.config_path)
    tokenizer = AutoTokenizer.from_pretrained(exp.tokenizer_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    first, _, last = args.test_iterations.partition("-")
    test_iterations = range(int(first), int(last or first) + 1)
    test = [run_batch(run, k) for k in test_iterations]
    seen = set()
    for k in test_iterations:
        seen |= set(commit.read_table(run.stage_dir(k, "generate"), "rollouts")["prompt_text"].to_pylist())
    prompts, answers = [], []
    for row in pq.read_table(exp.data.train).to_pylist():
        text = tokenizer.apply_chat_template(row[exp.data.prompt_key], tokenize=False,
                                             add_generation_prompt=True)
        if text not in seen:
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            answers.append(str(row["reward_model"]["ground_truth"]))
    policy = AutoModelForCausalLM.from_pretrained(run.policy_dir(args.policy_version, exp.model.path)).eval()
    data = sample_rollouts(policy, tokenizer, prompts, answers, args.samples_per_prompt,
                           exp.generate.max_tokens, pad)
    returns = {i: [float(data.rewards[i])] * len(data.response_ids[i]) for i in range(len(data))}
    print(f"{len(data)} rollouts of policy v{args.policy_version} on {len(prompts)} prompts (reward "
          f"{float(data.rewards.mean()):.3f}); explained variance on iterations {list(test_iterations)}:",
          flush=True)
    model = load_value_model(exp.model.path, getattr(torch, exp.model.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    done = 0
    for target in [0] + [int(s) for s in args.steps.split(",")]:
        model.train()
        for _ in range(done, target):
            mb = collate(data, torch.randint(len(data), (256,)).tolist(), pad)
            v = model(mb.input_ids, mb.attention_mask).values[:, :-1].float()
            loss = ((v - padded(returns, mb)) ** 2 * mb.mask).sum() / mb.mask.sum()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), exp.update.grad_clip)
            optimizer.step()
        done = target
        evs = explained_variances(model, test, pad)
        print(f"step {target:5d}: mean {np.mean(evs):.3f}  (" + " ".join(f"{x:.3f}" for x in evs) + ")",
              flush=True)


if __name__ == "__main__":
    main()
