"""How much of a PPO run's return variance a critic could explain: the ceiling of
`critic/explained_variance` on an exact-match task, iteration by iteration.

    python tools/critic_ceiling.py RUN_DIR [--iterations 0-19]

For exact-match rewards (hpcrl.rewards:exact_match) the true value of a response prefix under the
policy that sampled it is computable: 0 once the prefix has left the reference answer, else the
probability that the policy writes the rest of the answer and then stops (one forward pass over
prompt + answer + EOS; completions with extra whitespace, which strip() would also accept, are left
out, so this slightly underestimates the value). Against the Monte-Carlo returns of the batch (the
outcome plus the KL penalty of the tokens still to come, i.e. the returns of lam = 1) it gives:

  ev_oracle   the explained variance of that true value: what no critic can beat in expectation
  ev_prompt   the same with the value of the prompt alone at every token (a critic that knows each
              prompt's success rate exactly but cannot read the response)
  ev_critic   the run's own critic (its values before its steps) against the same returns
  ev_logged   the run's critic/explained_variance (against the run's own GAE returns)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from hpcrl import commit
from hpcrl.config import load
from hpcrl.rundir import RunDir


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float:
    var = returns.var()
    return float(1 - (returns - values).var() / var) if var > 0 else float("nan")


def oracle_values(model, prompt_ids: list[int], response_ids: list[int],
                  answer_ids: list[int]) -> list[float]:
    """True value of the state before each response token: P(rest of the answer, then EOS | prefix)."""
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].double(), -1)
    # log p of each answer token
    steps = logp[torch.arange(len(answer_ids)), torch.tensor(answer_ids)].numpy()
    tail = np.exp(np.cumsum(steps[::-1])[::-1])  # tail[t] = P(answer[t:] | answer[:t])
    return [float(tail[t]) if t < len(answer_ids) and response_ids[:t] == answer_ids[:t] else 0.0
            for t in range(len(response_ids))]


def iteration_report(run: RunDir, exp, k: int, tokenizer) -> dict:
    from transformers import AutoModelForCausalLM

    rollouts = commit.read_table(run.stage_dir(k, "generate"), "rollouts").to_pandas()
    scores = commit.read_table(run.stage_dir(k, "score"), "scores").to_pandas()
    keep = (rollouts["split"] == "train") & rollouts.get("kept", True)
    rollouts, rewards = rollouts[keep].reset_index(drop=True), scores["reward"][keep.values].to_numpy()
    adv = commit.read_table(run.stage_dir(k, "update"), "advantages").to_pandas()
    metrics = commit.read_manifest(run.stage_dir(k, "update")).get("metrics", {})
    coef = metrics.get("critic/kl_coef", 0.0) if exp.algorithm.kl.mode == "reward" else 0.0
    model = AutoModelForCausalLM.from_pretrained(run.policy_dir(k, exp.model.path),
                                                 dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    mc, oracle, prompt_only, critic = [], [], [], []
    for i, row in rollouts.iterrows():
        response = list(row["response_ids"])
        answer = tokenizer(str(row["ground_truth"]).strip(), add_special_tokens=False)["input_ids"] + [eos]
        kl = np.zeros(len(response))
        if coef and adv["ref_logprobs"][i] is not None:
            kl = np.asarray(adv["old_logprobs"][i]) - np.asarray(adv["ref_logprobs"][i])
        token_rewards = -coef * kl
        token_rewards[-1] += rewards[i]
        mc.extend(np.cumsum(token_rewards[::-1])[::-1])
        v = oracle_values(model, list(row["prompt_ids"]), response, answer)
        oracle.extend(v)
        prompt_only.extend([v[0]] * len(response))
        critic.extend(adv["values"][i] if adv["values"][i] is not None else [0.0] * len(response))
    mc, oracle, prompt_only, critic = (np.asarray(x, dtype=np.float64)
                                       for x in (mc, oracle, prompt_only, critic))
    return {"iteration": k, "reward": float(rewards.mean()), "ev_oracle": explained_variance(oracle, mc),
            "ev_prompt": explained_variance(prompt_only, mc), "ev_critic": explained_variance(critic, mc),
            "ev_logged": metrics.get("critic/explained_variance", float("nan"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--iterations", default="", help="first-last (default: every committed update)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    run = RunDir.at(args.run_dir)
    exp = load(run.config_path)
    tokenizer = AutoTokenizer.from_pretrained(exp.tokenizer_path)
    if args.iterations:
        first, _, last = args.iterations.partition("-")
        iterations = range(int(first), int(last or first) + 1)
    else:
        iterations = [k for k in range(exp.run.iterations)
                      if commit.read_manifest(run.stage_dir(k, "update"))]
    print("iteration,reward,ev_oracle,ev_prompt,ev_critic,ev_logged")
    for k in iterations:
        r = iteration_report(run, exp, k, tokenizer)
        print(",".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in r), flush=True)


if __name__ == "__main__":
    main()
