"""Checks before any job starts: the model, the tokenizer, the data, the reward sources and the
batch shape of an experiment. Every problem is reported at once with the config file, the key
and what was expected, so no compute is spent on a run that cannot work.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl import data, rewards
from hpcrl.config import ConfigError, Experiment

PROMPTS_CHECKED = 1000  # prompt lengths are checked on the first rows of each dataset


def _check_model(exp: Experiment) -> tuple[list[str], dict | None]:
    cfg_file = Path(exp.model.path) / "config.json"
    if not cfg_file.is_file():
        return [f"model.path: {exp.model.path}: not an HF model directory (no config.json)"], None
    return [], json.loads(cfg_file.read_text())


def _check_tokenizer(exp: Experiment, model_cfg: dict | None):
    from transformers import AutoTokenizer

    key = "model.tokenizer" if exp.model.tokenizer else "model.path"
    try:
        tok = AutoTokenizer.from_pretrained(exp.tokenizer_path)
    except (OSError, ValueError) as err:
        return [f"{key}: {exp.tokenizer_path}: cannot load a tokenizer: {str(err).splitlines()[0]}"], None
    problems = []
    if model_cfg is not None:
        vocab = model_cfg.get("vocab_size") or model_cfg.get("text_config", {}).get("vocab_size")
        if vocab is not None and len(tok) > vocab:
            problems.append(f"{key}: the tokenizer at {exp.tokenizer_path} has {len(tok)} tokens but the model at "
                            f"{exp.model.path} has vocab_size {vocab}: they do not belong together")
    if tok.eos_token_id is None:
        problems.append(f"{key}: the tokenizer at {exp.tokenizer_path} has no eos token")
    return problems, tok


def _check_data(exp: Experiment, tok) -> list[str]:
    problems = []
    longest = exp.model.max_model_len - exp.generate.max_tokens
    for key in ("train", "test"):
        path = getattr(exp.data, key)
        if not path:
            continue
        try:
            prompts = data.load_prompts(path, exp.data.prompt_key, exp.data.answer_key)
        except data.DatasetError as err:
            problems.append(f"data.{key}: {err}")
            continue
        if key == "train" and prompts.num_rows < exp.algorithm.prompts_per_iteration:
            problems.append(f"data.train: {path}: {prompts.num_rows} prompts, fewer than "
                            f"algorithm.prompts_per_iteration = {exp.algorithm.prompts_per_iteration}")
        if tok is None:
            continue
        texts = prompts["prompt"].slice(0, PROMPTS_CHECKED).to_pylist()
        if any(t.startswith("[{") for t in texts) and not tok.chat_template:
            problems.append(f"data.{key}: {path}: prompts are chat messages but the tokenizer has no chat template")
            continue
        too_long = sum(len(tok(data.render(tok, t))["input_ids"]) > longest for t in texts)
        if too_long:
            problems.append(f"data.{key}: {path}: {too_long} of the first {len(texts)} prompts are longer than "
                            f"model.max_model_len - generate.max_tokens = {longest} tokens")
    return problems


def _check_rewards(exp: Experiment) -> list[str]:
    """Reward functions import; a reward model's directory holds a one-label sequence classifier
    and a tokenizer (its weights are not loaded here). The HTTP service's URL is checked for form
    when the config loads, not for reachability: the service may answer only from compute nodes,
    or not be up yet."""
    problems = []
    for name in exp.reward.functions:
        try:
            rewards.load(name)
        except rewards.RewardLoadError as err:
            problems.append(f"reward.functions: {err}")
    model = exp.reward.model
    if model.path:
        from hpcrl import reward_backends

        try:
            reward_backends.inspect_model(model.path)
        except reward_backends.RewardBackendError as err:
            problems.append(f"reward.model.path: {err}")
        if model.device == "cuda" and exp.executor.kind == "slurm" and not exp.executor.score.gpus_per_node:
            problems.append("reward.model.device: 'cuda' but executor.score.gpus_per_node = 0 gives the score job "
                            "no GPU")
    return problems


def _check_batch(exp: Experiment) -> list[str]:
    n = exp.algorithm.prompts_per_iteration * exp.algorithm.group_size
    parts = exp.update.mini_batches * exp.update.world_size
    if n % parts:
        return [f"update.mini_batches: {n} samples per iteration (algorithm.prompts_per_iteration x "
                f"algorithm.group_size) do not split evenly into {exp.update.mini_batches} mini-batches over "
                f"update.world_size={exp.update.world_size} ranks"]
    return []


def _check_slurm(exp: Experiment) -> list[str]:
    if exp.executor.kind != "slurm":
        return []
    from hpcrl import executors, sbatch

    problems = []
    if exp.update.world_size % exp.executor.update.nodes:
        problems.append(f"executor.update.nodes: update.world_size={exp.update.world_size} ranks do not spread "
                        f"evenly over {exp.executor.update.nodes} nodes")
    for role in ("controller", "generate", "score", "update"):
        try:
            sbatch.directives(executors.slurm_parameters(exp, role, exp.run.name), Path("logs"))
        except ConfigError as err:
            problems.append(str(err).replace("executor:", f"executor.{role}:", 1))
    return problems


def check(exp: Experiment, source: str) -> None:
    """Raise ConfigError listing every problem found in the experiment `source`."""
    problems, model_cfg = _check_model(exp)
    tok_problems, tok = _check_tokenizer(exp, model_cfg)
    problems += tok_problems + _check_data(exp, tok) + _check_rewards(exp) + _check_batch(exp) + _check_slurm(exp)
    if problems:
        raise ConfigError(f"{source}: the experiment cannot run:\n  " + "\n  ".join(problems))
