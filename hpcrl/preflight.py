"""Checks before any job starts: the model, the tokenizer, the data, the reward sources, the
batch shape and the runs root (writable, with working file locks) of an experiment. Every problem
is reported at once with the config file, the key and what was expected, so no compute is spent on
a run that cannot work.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpcrl import colocation, data, disk_budget, model_check, placement, rewards
from hpcrl.config import ConfigError, Experiment
from hpcrl.config_training import AlgorithmConfig, CriticConfig, LoraConfig, ModelConfig, RunConfig
from hpcrl.stage_kinds import ORDER, SCORE

# Files that hold a tokenizer's vocabulary (without one, transformers builds an empty tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt",
                   "tekken.json")


def _check_model(model: ModelConfig, lora: LoraConfig) -> tuple[list[str], dict | None]:
    """config.json, the weights (present, complete, matching their index) and the limits on them;
    the LoRA adapters' target modules among its linear layers."""
    problems, cfg = model_check.read_config(model.path, "model.path")
    if cfg is None:
        return problems, None
    problems, shapes = model_check.weight_shapes(model.path, "model.path")
    targets = lora.target_modules if lora.rank and shapes else []
    return problems + model_check.limit_problems(cfg, shapes, model.max_model_len, model.path) + \
        model_check.linear_problems(targets, shapes, cfg, model.path, "update.lora.target_modules"), cfg


def _check_moe(exp: Experiment, model_cfg: dict | None) -> list[str]:
    from hpcrl import moe  # imports torch: only where a check needs it

    if exp.update.moe_aux_loss_coef > 0 and model_cfg is not None and not moe.is_moe_config(model_cfg):
        return [f"update.moe_aux_loss_coef: {exp.update.moe_aux_loss_coef} asks for a load-balancing loss, "
                f"but {exp.model.path} is not a mixture-of-experts model (its config.json has no "
                "num_experts_per_tok); expected 0"]
    return []


def _check_sequence_parallel(exp: Experiment, model_cfg: dict | None) -> list[str]:
    """A model whose attention heads the sequence-parallel ranks divide, on an attention path
    DeepSpeed's Ulysses wraps (not eager), and dense (the router's tally counts whole rows); a
    critic of the policy's attention heads."""
    n = exp.update.sequence_parallel
    if n == 1 or model_cfg is None:
        return []
    from hpcrl import moe
    key, path = "update.sequence_parallel", exp.model.path
    text = model_cfg.get("text_config") or model_cfg
    heads, kv, _ = _attention_shape(model_cfg)
    problems = []
    if not heads or heads % n or (kv % n and n % kv):  # kv heads are repeated when fewer than n
        problems.append(f"{key}: {n} ranks must divide the attention heads of {path} ({heads} query, {kv} "
                        f"key/value heads; or the key/value heads divide {n})")
    if moe.is_moe_config(model_cfg):
        problems.append(f"{key}: {path} is a mixture-of-experts model; sequence parallelism is built for "
                        "dense models (expected 1)")
    critic = exp.algorithm.critic
    if critic is not None and critic.path:
        _, critic_cfg = model_check.read_config(critic.path, "algorithm.critic.path")
        if critic_cfg is not None and _attention_shape(critic_cfg) != _attention_shape(model_cfg):
            problems.append(f"{key}: the critic {critic.path} and the policy {path} must have the same "
                            f"attention heads, which the ranks exchange with one registration (critic: "
                            f"{_attention_shape(critic_cfg)}, policy: {_attention_shape(model_cfg)} as "
                            "(query heads, key/value heads, head size))")
    attention = exp.model.attn_implementation
    if attention == "eager" or (attention == "auto" and text.get("attn_logit_softcapping")):
        problems.append(f"{key}: the eager attention (model.attn_implementation, or a model that soft-caps "
                        "its attention logits) builds a full attention mask, which DeepSpeed's Ulysses "
                        "cannot split; expected sdpa")
    return problems


def _attention_shape(model_cfg: dict) -> tuple:
    """(query heads, key/value heads, head size) of a model's config.json."""
    text = model_cfg.get("text_config") or model_cfg
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // heads if heads else None)
    return heads, text.get("num_key_value_heads") or heads, head_dim


def _check_megatron(exp: Experiment, model_cfg: dict | None) -> list[str]:
    """A model the Megatron backend converts, in the layout asked (hpcrl.megatron_convert)."""
    if exp.update.backend != "megatron" or model_cfg is None:
        return []
    from transformers import AutoConfig

    from hpcrl import megatron_convert

    m = exp.update.megatron
    try:
        hf_config = AutoConfig.from_pretrained(exp.model.path)
    except Exception as err:  # noqa: BLE001  (transformers' own validation errors vary by version)
        return [f"model.path: {exp.model.path}/config.json: transformers cannot read it: "
                f"{str(err).splitlines()[0]}"]
    try:
        megatron_convert.check(hf_config, m.tensor_parallel, m.pipeline_parallel)
    except ValueError as err:
        return [f"update.megatron: {exp.model.path}: {err}"]
    return []


def _check_critic(critic: CriticConfig | None) -> list[str]:
    path = critic.path if critic is not None else ""
    if not path:
        return []
    problems, cfg = model_check.read_config(path, "algorithm.critic.path")
    return problems if cfg is None else model_check.weight_shapes(path, "algorithm.critic.path")[0]


def _check_memory(exp: Experiment) -> list[str]:
    """The CPU KV cache (generate.kv_cache_gib) within the memory of the node that will hold it."""
    if exp.executor.kind == "slurm":
        res = exp.executor.resident if exp.executor.mode == "resident" else exp.executor.generate
        if res.gpus_per_node or not res.mem_gb:
            return []
        limit, where = res.mem_gb * 1e9 / (1 << 30), f"the job's memory ({res.mem_gb} GB per node)"
    else:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
        where = f"this machine's memory ({limit:.1f} GiB)"
    if exp.generate.kv_cache_gib >= limit:
        return [f"generate.kv_cache_gib: {exp.generate.kv_cache_gib} GiB of KV cache does not fit in "
                f"{where}; expected a smaller cache, leaving room for the model and the process"]
    return []


def _check_colocation(exp: Experiment) -> list[str]:
    """A colocated resident job's phases within executor.resident.gpu_memory_gib (hpcrl.colocation);
    without it, the job checks against the device at its start."""
    r = exp.executor.resident if exp.executor.mode == "resident" else None
    if r is None or not r.colocate or not r.gpu_memory_gib:
        return []
    params = disk_budget.params_of(exp.model.path)
    if params is None:
        return []
    where = f"a GPU of executor.resident.gpu_memory_gib = {r.gpu_memory_gib:g}"
    return colocation.check(exp, params, r.gpu_memory_gib * colocation.GIB, where)


def _check_algorithm(a: AlgorithmConfig) -> list[str]:
    """algorithm.name and algorithm.policy_loss against the registries (hpcrl.advantages, hpcrl.losses)."""
    from hpcrl import advantages, losses

    problems = []
    names = [*advantages.ESTIMATORS, "ppo"]
    if a.name not in names:
        problems.append(f"algorithm.name: {a.name!r} is not a registered advantage estimator; expected one "
                        f"of {', '.join(names)}")
    if a.policy_loss not in losses.POLICY_LOSSES:
        problems.append(f"algorithm.policy_loss: {a.policy_loss!r} is not a registered policy loss; expected "
                        f"one of {', '.join(losses.POLICY_LOSSES)}")
    return problems


def _check_tokenizer(exp: Experiment, model_cfg: dict | None) -> tuple[list[str], bool, object | None]:
    """(problems, whether prompts can be measured, the tokenizer if it was loaded)."""
    key = "model.tokenizer" if exp.model.tokenizer else "model.path"
    if not any((Path(exp.tokenizer_path) / name).is_file() for name in TOKENIZER_FILES):
        return [f"{key}: {exp.tokenizer_path}: no tokenizer files (expected one of "
                f"{', '.join(TOKENIZER_FILES)}); set model.tokenizer to a tokenizer's directory"], False, None
    try:
        facts, tok = data.tokenizer_facts(exp)
    except (OSError, ValueError) as err:
        reason = str(err).splitlines()[0]
        return [f"{key}: {exp.tokenizer_path}: cannot load a tokenizer: {reason}"], False, None
    problems = []
    if model_cfg is not None:
        vocab = model_cfg.get("vocab_size") or model_cfg.get("text_config", {}).get("vocab_size")
        if vocab is not None and facts.tokens > vocab:
            problems.append(f"{key}: the tokenizer at {exp.tokenizer_path} has {facts.tokens} tokens but the "
                            f"model at {exp.model.path} has vocab_size {vocab}: they do not belong together")
    if facts.eos_token_id is None:
        problems.append(f"{key}: the tokenizer at {exp.tokenizer_path} has no eos token")
    return problems, True, tok


def _check_split(exp: Experiment, split: str, measurable: bool, tok) -> tuple[list[str], list[str]]:
    """(problems, notes) of data.train or data.test: readable, long enough, prompts that fit (their
    lengths measured with `tok`, or the tokenizer loaded when they are not cached)."""
    key, path = f"data.{split}", getattr(exp.data, split)
    problems, notes = [], []
    try:
        if not measurable:  # the tokenizer's problem is reported already
            table = data.load_prompts(path, exp.data.prompt_key, exp.data.answer_key,
                                      getattr(exp.data, f"{split}_split"))
            prompts = data.PromptSet(table, table.num_rows, 0, 0)
        else:
            prompts = data.prompt_set(exp, split, tok)
    except data.DatasetError as err:
        return [f"{key}: {err}"], []
    if prompts.too_long:
        what = (f"{prompts.too_long} of {prompts.total} prompts longer than model.max_model_len - "
                f"generate.max_tokens = {prompts.limit} tokens")
        if exp.data.filter_overlong:
            notes.append(f"{key}: {path}: dropped {what} (data.filter_overlong)")
        else:
            problems.append(f"{key}: {path}: {what}; drop them with data.filter_overlong = true, or raise "
                            "model.max_model_len")
    usable = prompts.table.num_rows
    dropped = prompts.total - usable
    after = f" (after dropping {dropped} too long)" if dropped else ""
    if usable == 0:
        problems.append(f"{key}: {path}: no prompt left{after}")
    elif split == "train" and usable < exp.algorithm.prompts_per_iteration:
        problems.append(f"{key}: {path}: {usable} prompts{after}, fewer than "
                        f"algorithm.prompts_per_iteration = {exp.algorithm.prompts_per_iteration}")
    return problems, notes


def _check_data(exp: Experiment, measurable: bool, tok) -> tuple[list[str], list[str]]:
    problems, notes = [], []
    for split in ("train", "test"):
        if getattr(exp.data, split):
            p, n = _check_split(exp, split, measurable, tok)
            problems += p
            notes += n
    return problems, notes


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
        role = "resident" if exp.executor.mode == "resident" else SCORE  # the job that scores
        if model.device == "cuda" and not getattr(exp.executor, role).gpus_per_node:
            problems.append(f"reward.model.device: 'cuda' but executor.{role}.gpus_per_node = 0 gives the "
                            f"{role} job no GPU")
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
        problems.append(f"executor.update.nodes: update.world_size={exp.update.world_size} ranks do not "
                        f"spread evenly over {exp.executor.update.nodes} nodes")
    for role in ("controller", *ORDER):
        try:
            sbatch.directives(executors.slurm_parameters(exp, role, exp.run.name), Path("logs"))
        except ConfigError as err:
            problems.append(str(err).replace("executor:", f"executor.{role}:", 1))
    return problems


def _check_gpus(exp: Experiment) -> list[str]:
    """The jobs' tasks fit on their GPUs (hpcrl.placement), and the local executor's jobs ask for
    no more GPUs than this machine shows (CUDA_VISIBLE_DEVICES, by index)."""
    try:
        placement.describe(exp)
    except placement.PlacementError as err:
        return [str(err)]
    roles = ("resident",) if exp.executor.mode == "resident" else ORDER
    wanted = {role: getattr(exp.executor, role).gpus_per_node for role in roles}
    if exp.executor.kind != "local" or not any(wanted.values()):
        return []
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and not all(v.strip().isdigit() for v in visible.split(",")):
        return [f"executor.{next(r for r, n in wanted.items() if n)}.gpus_per_node: the local executor hands "
                f"its jobs GPUs by index, but CUDA_VISIBLE_DEVICES={visible} names them otherwise"]
    have = torch.cuda.device_count()  # NVML where it can: no CUDA context in this process
    return [f"executor.{role}.gpus_per_node = {n}: the local executor runs the job on this machine, which "
            f"shows {have} GPU(s)" for role, n in wanted.items() if n > have]


def _check_runs_root(run: RunConfig) -> list[str]:
    """run.runs_root: a directory this user can write in, or one that can be created."""
    root = Path(run.runs_root)
    existing = _nearest_existing(root)
    if not existing.is_dir():
        return [f"run.runs_root: {root}: {existing} is not a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"run.runs_root: {root}: {existing} is not writable by this user"]
    return []


def _nearest_existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if p.exists())


def _check_locks(run: RunConfig) -> list[str]:
    """flock(2) works where run.runs_root is (or will be created): a controller locks its run with it.
    Lustre mounted `noflock` or NFS without a lock manager fail here, not at the controller's start."""
    import fcntl
    import tempfile

    from hpcrl.rundir import locks_unsupported

    root = Path(run.runs_root)
    existing = _nearest_existing(root)
    try:
        fd, probe = tempfile.mkstemp(prefix=".hpcrl-lock-probe-", dir=existing)
    except OSError as err:
        return [f"run.runs_root: {root}: cannot create a file in {existing}: {err.strerror}"]
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: only a filesystem without locks fails
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as err:
        return [f"run.runs_root: {root}: {locks_unsupported(existing, err)}"]
    finally:
        os.close(fd)
        os.unlink(probe)
    return []


def check(exp: Experiment, source: str) -> list[str]:
    """Raise ConfigError listing every problem found in the experiment `source`; return notes
    for the user (prompts dropped by the length filter)."""
    problems, model_cfg = _check_model(exp.model, exp.update.lora)
    problems += _check_runs_root(exp.run) or _check_locks(exp.run)
    # AutoTokenizer reads the model's config.json too: its problem is reported already
    tok_problems, measurable, tok = ([], False, None) if model_cfg is None and not exp.model.tokenizer else \
        _check_tokenizer(exp, model_cfg)
    data_problems, notes = _check_data(exp, measurable, tok)
    problems += (tok_problems + data_problems + _check_algorithm(exp.algorithm)
                 + _check_critic(exp.algorithm.critic) + _check_moe(exp, model_cfg) + _check_rewards(exp)
                 + _check_sequence_parallel(exp, model_cfg) + _check_megatron(exp, model_cfg)
                 + _check_batch(exp) + _check_slurm(exp) + _check_gpus(exp) + _check_memory(exp)
                 + _check_colocation(exp))
    if not problems:  # the disk budget is only worth a look for a run that can start
        disk_problems, disk_notes = disk_budget.check(exp)
        problems, notes = disk_problems, notes + disk_notes
    if problems:
        raise ConfigError(f"{source}: the experiment cannot run:\n  " + "\n  ".join(problems))
    return notes + _dynamic_sampling_notes(exp)


def _dynamic_sampling_notes(exp: Experiment) -> list[str]:
    """Dynamic sampling scores in the generate stage too: say what that costs beyond rule functions."""
    r = exp.reward
    if not exp.algorithm.dynamic_sampling or not (r.model.path or r.http.url):
        return []
    costs = (["the reward model is loaded in the generate job as well"] if r.model.path else []) + (
        ["the HTTP reward service receives every training sample twice"] if r.http.url else [])
    return [f"algorithm.dynamic_sampling: the generate stage scores training samples to choose the batch "
            f"and the score stage scores them again: {'; '.join(costs)}"]
