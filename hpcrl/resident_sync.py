"""What the resident job's roles agree on: the weight sync from trainer 0 to the engines,
the probe both score after each sync, when an update saves a checkpoint and when it commits."""

from __future__ import annotations

import os

from hpcrl import lora, transports
from hpcrl.config import Experiment
from hpcrl.roles import ControlPlane
from hpcrl.rundir import RunDir

PROBE_PROMPTS = 4


def checkpoint_due(exp: Experiment, iteration: int) -> bool:
    """Whether the update of `iteration` saves the policy and trainer state."""
    every = exp.executor.resident.checkpoint_every
    return (iteration + 1) % every == 0 or iteration + 1 == exp.run.iterations


def commits_behind(exp: Experiment, presend: bool = False) -> bool:
    """Whether the trainers commit an update (and its checkpoint) after sending its weights, in the
    background while the generator samples (`executor.resident.overlap_commit`): in lock-step, and
    with max_staleness > 0 where trainer 0 sends as soon as the update ends (`presend`), so that the
    commit's writes do not delay the weights. With max_staleness > 0 and a send the generator asks
    for, they commit before, while they wait for it; colocated, before their state leaves the GPU
    for vLLM."""
    r = exp.executor.resident
    return r.overlap_commit and not r.colocate and (exp.algorithm.max_staleness == 0 or presend)


def scores_beside(exp: Experiment) -> bool:
    """Whether the generator scores each generation on a thread beside the next one and commands
    its update from there (hpcrl.resident_scores): with max_staleness > 0, where the next
    generation needs no update of this one, and not colocated, where vLLM sleeps during updates."""
    r = exp.executor.resident
    return r.overlap_score and exp.algorithm.max_staleness > 0 and not r.colocate


def probe_sequences(exp: Experiment, tokenizer) -> list[list[int]]:
    """Fixed token sequences (the first training prompts and their answers) both sides score."""
    from hpcrl import data

    prompts = data.prompt_set(exp, "train", tokenizer).table
    out = []
    for i in range(min(PROBE_PROMPTS, prompts.num_rows)):
        text = data.render(tokenizer, prompts["prompt"][i].as_py()) + str(prompts["ground_truth"][i].as_py())
        out.append(tokenizer(text)["input_ids"][: exp.model.max_model_len])
    return out


def engine_logprobs(llm, sequences: list[list[int]]) -> list[list[float]]:
    """vLLM's logprobs (temperature 1) of tokens 1.. of each sequence: the engine's side of the probe."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hpcrl.generation import token_logprobs

    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                        SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                                       flat_logprobs=True, skip_clone=True),
                        use_tqdm=False)
    return [token_logprobs(o.prompt_logprobs, list(s[1:])) for o, s in zip(outs, sequences, strict=True)]


def sync_setup(exp: Experiment, run: RunDir, plane: ControlPlane, me: str) -> transports.SyncSetup:
    """The weight sync every end agrees on (hpcrl.transports), from where trainer 0 and each engine
    run; `me` is "trainer0" or "engine<e>"."""
    here = os.environ.get("SLURMD_NODENAME") or os.uname().nodename  # Slurm's node name, else the host's
    plane.put(plane.store, f"host/{me}", here)
    engines = exp.generate.engines
    ends = ("trainer0", *(f"engine{e}" for e in range(engines)))
    hosts = {who: plane.wait_for(f"host/{who}") for who in ends}
    r = exp.executor.resident
    name = transports.choose(r.weight_sync, hosts.pop("trainer0"), list(hosts.values()), backend() == "nccl")
    return transports.SyncSetup(name, plane.host, plane.port, engines=engines,
                                tp=exp.generate.tensor_parallel_size, timeout_s=r.collective_timeout_s,
                                bucket_bytes=int(r.sync_bucket_mb * (1 << 20)), backend=backend(),
                                directory=str(run.root / "resident" / "weights"),
                                lora_scale=lora.config_scale(exp.update.lora),
                                lora_targets=list(exp.update.lora.target_modules))


def vllm_sleeps(exp: Experiment) -> bool:
    """Whether vLLM gives its GPU memory to the trainers while they update (colocated on GPUs;
    vLLM's sleep mode is CUDA's)."""
    return exp.executor.resident.colocate and backend() == "nccl"


def backend() -> str:
    """The weight sync's backend (it moves the trainer's device tensors)."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"
