"""The experiment config (`experiment.toml`): schema, defaults, loading, freezing.

Every key is declared here with its default and meaning; `hpcrl config` prints them. Loading
refuses unknown keys and wrong types with the file, the key path and what was expected.
Paths are resolved against the directory of the file that names them, and the frozen copy in
the run directory holds the fully resolved config, so stages need nothing else.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

PathStr = Annotated[str, "path"]  # resolved against the config file's directory


class ConfigError(ValueError):
    """A config that cannot run; the message names the file, the key and what was expected."""


SBATCH_OPTION = re.compile(r"[a-z][a-z0-9-]*")
SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%/+\-\[\]]*")


class Section(BaseModel):
    # allow_inf_nan: no key takes inf or nan (update.lr = inf once trained a non-finite policy)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(Section):
    name: str = Field("run", description="Run name: the run directory is <runs_root>/<name>.")
    runs_root: PathStr = Field("runs", description="Directory holding the run directories and the MLflow store.")
    seed: int = Field(0, description="Run seed; each stage's seed derives from (seed, iteration, stage).")
    iterations: int = Field(10, ge=1, description="Number of generate -> score -> update iterations.")
    eval_every: int = Field(5, ge=0, description="Validate on the test set every N iterations (0: only at the end).")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not v or "/" in v or v.startswith("."):
            raise ValueError("a run name is a plain directory name (no '/', not starting with '.')")
        return v


class ModelConfig(Section):
    path: PathStr = Field(..., description="HF-format model directory (policy version 0 and the reference).")
    tokenizer: PathStr = Field("", description="Tokenizer directory; empty means the model directory.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype for generation and training.")
    max_model_len: int = Field(256, ge=8, description="Longest prompt + response in tokens.")


class DataConfig(Section):
    train: PathStr = Field(..., description="Training prompts: verl-layout parquet, plain parquet, JSONL, or a directory written by datasets' save_to_disk.")
    test: PathStr = Field("", description="Held-out prompts for validation (same formats); empty: no validation.")
    train_split: str = Field("train", description="Split of data.train when it is a DatasetDict save_to_disk directory.")
    test_split: str = Field("test", description="Split of data.test when it is a DatasetDict save_to_disk directory.")
    prompt_key: str = Field("prompt", description="Column with the prompt: a chat message list or a string.")
    answer_key: str = Field("reward_model.ground_truth", description="Column (dotted for a struct field) with the reference answer; falls back to `answer`.")
    max_val_prompts: int = Field(0, ge=0, description="Use at most this many test prompts (0: all).")
    filter_overlong: bool = Field(True, description="Drop prompts longer than model.max_model_len - generate.max_tokens tokens (the count is reported at submit); false: refuse the run instead.")


class AlgorithmConfig(Section):
    name: Literal["grpo", "rloo", "reinforce_pp", "ppo"] = Field("grpo", description="Advantage estimator (hpcrl/advantages.py): grpo, rloo or reinforce_pp from outcome rewards and groups; ppo: GAE with a learned critic (hpcrl/critic.py).")
    group_size: int = Field(8, ge=1, description="Samples per prompt (the GRPO group; 1 only with ppo).")
    prompts_per_iteration: int = Field(32, ge=1, description="Prompts drawn per iteration.")
    norm_adv_by_std: bool = Field(True, description="Divide group-centred rewards by the group's std (False: Dr.GRPO); ppo: whiten the token advantages over the batch.")
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip range epsilon (the lower side when clip_ratio_high is set).")
    clip_ratio_high: float = Field(0.0, ge=0, description="Upper clip range (clip-higher, e.g. 0.28); 0: same as clip_ratio.")
    dual_clip_c: float = Field(0.0, ge=0, description="Dual-clip constant c > 1 capping the loss of negative advantages; 0: off.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference policy (0: no reference); the adaptive controller's initial value.")
    old_logprobs: Literal["recompute", "sampler"] = Field("recompute", description="The old policy's logprobs in the PPO ratio: `recompute` them with the trainer (a forward pass before the first step over every mini-batch but the first, whose own training forward pass gives them while the policy is still the old one, unless kl_mode = \"reward\" needs them before any step), or take the `sampler`'s (vLLM's, verl's bypass mode): one forward pass fewer, and the ratio then corrects for any sampler/trainer mismatch.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator for the penalty (k1, the log ratio, is the classic per-token reward penalty).")
    kl_mode: Literal["loss", "reward"] = Field("loss", description="Where the KL penalty goes: a loss term, or (ppo) a per-token reward -kl_coef * KL before GAE.")
    kl_target: float = Field(0.0, ge=0, description="Target KL per sample (summed over its tokens) of the adaptive KL controller (Ziegler et al. 2019); 0: fixed kl_coef.")
    kl_horizon: float = Field(10000.0, gt=0, description="Horizon (in samples) of the adaptive KL controller.")
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: discount factor of GAE.")
    lam: float = Field(0.95, ge=0, le=1, description="ppo: GAE lambda.")
    critic_path: PathStr = Field("", description="ppo: initial critic: a critic saved by hpcrl (update/critic) or any HF model directory (its backbone, a new value head); empty: the policy's model.path.")
    critic_lr: float = Field(1e-5, gt=0, description="ppo: AdamW learning rate of the critic (weight decay, grad clip, ZeRO stage as in [update]).")
    value_clip: float = Field(0.2, ge=0, description="ppo: a value may move at most this far from the rollout's value before its error stops counting (0: no clipping).")
    critic_warmup: int = Field(0, ge=0, description="ppo: train only the critic during the first N iterations (the policy does not change).")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus in the loss (0: none).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field("token-mean", description="Loss aggregation (hpcrl/losses.py).")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling (hpcrl/dynamic_sampling.py): sample prompts in rounds and train on groups whose rewards are not all equal, prompts_per_iteration of them.")
    max_sampling_rounds: int = Field(4, ge=1, description="Dynamic sampling: most sampling rounds per iteration, each drawing prompts_per_iteration new prompts; short of informative groups after the last, groups with equal rewards fill the batch.")


class GenerateConfig(Section):
    max_tokens: int = Field(64, ge=1, description="Longest response in tokens.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    kv_cache_gib: float = Field(1.0, gt=0, description="vLLM KV cache size on CPU in GiB (fractions allowed).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM memory share on a GPU.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel size.")


class RewardModelConfig(Section):
    path: PathStr = Field("", description="HF sequence-classification reward model (num_labels = 1) scoring prompt + response as component `model`; empty: none.")
    weight: float = Field(1.0, description="Weight of the reward model's score in the reward.")
    batch_size: int = Field(16, ge=1, description="Samples per forward pass of the reward model.")
    max_length: int = Field(1024, ge=8, description="Longest prompt + response in reward-model tokens; longer samples lose tokens from the start.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the reward model runs; auto: cuda when the score job sees a GPU, else cpu.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Reward model weights dtype; auto: as saved.")


class RewardHttpConfig(Section):
    url: str = Field("", description="Reward service that scores batches of samples as component `http` (docs/data-and-rewards.md: the HTTP protocol); empty: none.")
    weight: float = Field(1.0, description="Weight of the service's score in the reward.")
    batch_size: int = Field(32, ge=1, description="Samples per request.")
    concurrency: int = Field(4, ge=1, description="Requests in flight at once.")
    timeout_s: float = Field(60.0, gt=0, description="Seconds to connect, and to wait for a response, per request.")
    retries: int = Field(3, ge=0, description="Retries of a request that could not connect, timed out or got HTTP 408, 429, 500, 502, 503 or 504; then the score stage fails.")
    backoff_s: float = Field(1.0, ge=0, description="Wait before the first retry in seconds; doubled for each further retry.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v:
            return v
        parts = urlsplit(v)
        try:
            parts.port  # noqa: B018 -- raises ValueError on a port that is not a number in range
        except ValueError:
            raise ValueError("expected an http:// or https:// URL with a valid port") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL with a host, e.g. http://rm-node:8000/score")
        return v


class RewardConfig(Section):
    functions: list[str] = Field(["hpcrl.rewards:exact_match"], description="Reward functions as `module:function`; the reward is the weighted sum of these and the reward model and service below.")
    weights: list[float] = Field([], description="One weight per function; empty means all 1.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO overlong penalty: training responses longer than generate.max_tokens minus this many tokens lose reward linearly (0: off).")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="Penalty at generate.max_tokens for the overlong penalty.")
    workers: int = Field(0, ge=0, description="Reward worker processes (0: score in the stage's own process).")
    model: RewardModelConfig = Field(RewardModelConfig(), description="Reward model backend (hpcrl/reward_backends.py).")
    http: RewardHttpConfig = Field(RewardHttpConfig(), description="HTTP reward service backend (hpcrl/reward_backends.py).")


class UpdateConfig(Section):
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each iteration's batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass (the batch is split into this many).")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per forward/backward per rank.")
    share_prompts: bool = Field(True, description="Run each distinct prompt of a micro-batch once and its responses on its KV cache (a GRPO group's samples share one prompt): the same loss and gradient (to float rounding) for fewer tokens of compute. `false` runs every row whole (for a model whose cache cannot be batch-indexed).")
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clipping (0: none).")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage. Stages 1 and 2 run as 0 when update.world_size is 1: they partition over data-parallel ranks, and one rank has nothing to partition.")
    world_size: int = Field(1, ge=1, description="DeepSpeed ranks for the update (processes on this node).")


class SlurmResources(Section):
    partition: str = Field("", description="Slurm partition (empty: the cluster's default).")
    nodes: int = Field(1, ge=1, description="Nodes of the job; the update's ranks (update.world_size) are spread evenly over them.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (gres gpu).")
    cpus_per_task: int = Field(2, ge=1, description="CPUs per task.")
    mem_gb: float = Field(0, ge=0, description="Memory per node in GB (0: the partition's default).")
    time_min: int = Field(60, ge=1, description="Time limit in minutes; the job is signalled before it and requeued.")
    account: str = Field("", description="Slurm account.")
    qos: str = Field("", description="Slurm QOS.")
    constraint: str = Field("", description="Node features (--constraint).")
    extra: dict[str, str] = Field({}, description="More sbatch options, e.g. {exclude = \"n3\"}: each key an sbatch long option name, each value plain (letters, digits, _.,:=@%/+-[]); never run by a shell.")

    @field_validator("extra")
    @classmethod
    def _sbatch_options(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not SBATCH_OPTION.fullmatch(key):
                raise ValueError(f"{key!r} is not an sbatch option name (expected a long option without its dashes: "
                                 "lowercase letters, digits and '-', e.g. exclude)")
            if not SBATCH_VALUE.fullmatch(value):
                raise ValueError(f"sbatch option --{key} has the value {value!r}; expected only letters, digits and "
                                 "_.,:=@%/+-[] (no spaces, quotes or shell characters)")
        return v


class ExecutorConfig(Section):
    kind: Literal["local", "slurm"] = Field("local", description="Where stage jobs run: `local` (submitit LocalExecutor on this machine) or `slurm` (a Slurm job per stage).")
    mode: Literal["staged", "resident"] = Field("staged", description="`staged`: each stage is its own job. `resident`: one job keeps the trainer ranks, the vLLM generator and the reward workers up for the whole run and streams weights from the trainer to vLLM.")
    weight_sync: Literal["auto", "process_group", "shared_memory", "filesystem"] = Field("auto", description="Resident: how new weights reach vLLM: broadcast over a process group (gloo on CPU, NCCL on GPUs; any nodes), copied through one shared-memory buffer (trainer 0 and the generator on one node; the fastest on CPU), or written to disk and reloaded. `auto`: shared memory on one node without GPUs, else the process group.")
    sync_bucket_mb: float = Field(64, ge=0, description="Resident: weight-sync bucket size in MB (0: one broadcast per tensor).")
    sync_check_tol: float = Field(0.0, ge=0, description="Resident: largest mean |logprob difference| between vLLM and the trainer on the probe batch after a sync (0: 1e-4 for float32, 2e-2 for 16-bit).")
    checkpoint_every: int = Field(1, ge=1, description="Resident: save the policy and trainer state every N updates (and after the last); a crash resumes from the last saved one.")
    overlap_commit: bool = Field(True, description="Resident: commit each update (and write its checkpoint) in the background while the next generation runs; that generation commits only after it. Off: the generator waits for the commit.")
    colocate: bool = Field(False, description="Resident, GPUs: the generator and the trainer share the GPUs; vLLM sleeps (frees its memory) during each update.")
    stall_s: float = Field(20, gt=0, description="Resident: a task whose heartbeat stalls this long is taken as dead and the job stops.")
    collective_timeout_s: float = Field(1800, gt=0, description="Resident: timeout of every wait between tasks (commands, weight broadcast).")
    max_retries: int = Field(1, ge=0, description="Retries of a failed stage before the run stops.")
    timeout_min: int = Field(60, ge=1, description="Time limit of one local stage job in minutes.")
    lookahead: int = Field(2, ge=0, description="Slurm: stages submitted ahead of the running one with afterok dependencies.")
    controller: SlurmResources = Field(SlurmResources(cpus_per_task=1, time_min=1440), description="Slurm resources of the controller job.")
    resident: SlurmResources = Field(SlurmResources(time_min=1440), description="Slurm resources of the resident job (update.world_size trainer tasks + 1 generator task, spread evenly over its nodes).")
    generate: SlurmResources = Field(SlurmResources(), description="Slurm resources of generate jobs.")
    score: SlurmResources = Field(SlurmResources(), description="Slurm resources of score jobs.")
    update: SlurmResources = Field(SlurmResources(), description="Slurm resources of update jobs.")


class TrackingConfig(Section):
    enabled: bool = Field(True, description="Log to MLflow.")
    tracking_uri: str = Field("", description="MLflow tracking URI; empty: sqlite:///<runs_root>/mlflow.db.")
    experiment: str = Field("hpcrl", description="MLflow experiment name.")
    plot_every: int = Field(10, ge=0, description="Log the run's plots to MLflow every N iterations and at the end (0: only at the end).")


class Experiment(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig
    data: DataConfig
    algorithm: AlgorithmConfig = AlgorithmConfig()
    generate: GenerateConfig = GenerateConfig()
    reward: RewardConfig = RewardConfig()
    update: UpdateConfig = UpdateConfig()
    executor: ExecutorConfig = ExecutorConfig()
    tracking: TrackingConfig = TrackingConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.runs_root) / self.run.name

    @property
    def tokenizer_path(self) -> str:
        return self.model.tokenizer or self.model.path


# Keys a resumed run may change; anything else must match the frozen config.
RESUMABLE_CHANGES = ("run.iterations", "run.eval_every", "executor.", "tracking.enabled", "tracking.plot_every")


def _path_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _path_fields(ann, f"{prefix}{name}.")
        elif "path" in field.metadata:
            out.append(prefix + name)
    return out


PATH_KEYS = _path_fields(Experiment)


def _describe(err: dict) -> str:
    key = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        section = ".".join(str(p) for p in err["loc"][:-1])
        where = f"[{section}]" if section else "the top level"
        return f"{key}: unknown key in {where}"
    if kind == "missing":
        return f"{key}: required key is missing"
    got = err.get("input")
    return f"{key}: {err['msg']} (got {got!r})"


def parse(data: dict[str, Any], source: str, base_dir: Path) -> Experiment:
    """Validate a config mapping; resolve relative paths against `base_dir`."""
    try:
        exp = Experiment.model_validate(data)
    except ValidationError as err:
        lines = "\n  ".join(_describe(e) for e in err.errors())
        raise ConfigError(f"{source}: invalid config:\n  {lines}") from None
    if 0 < exp.algorithm.dual_clip_c <= 1:
        raise ConfigError(f"{source}: algorithm.dual_clip_c: expected 0 (off) or a value above 1, got {exp.algorithm.dual_clip_c}")
    a = exp.algorithm
    if a.group_size < 2 and a.name != "ppo":
        raise ConfigError(f"{source}: algorithm.group_size: {a.name} compares samples of one prompt: expected at least 2, "
                          f"got {a.group_size}")
    if a.name != "ppo":
        used = [k for k in ("critic_path", "critic_warmup") if getattr(a, k)] + (["kl_mode"] if a.kl_mode == "reward" else [])
        if used:
            raise ConfigError(f"{source}: algorithm.{used[0]}: only algorithm.name = \"ppo\" has a critic and "
                              f"token-level rewards (name is {a.name!r})")
    if a.kl_target > 0 and a.kl_coef <= 0:
        raise ConfigError(f"{source}: algorithm.kl_target: the adaptive KL controller starts from algorithm.kl_coef, "
                          "which is 0 (no KL penalty); set kl_coef > 0")
    if exp.reward.overlong_buffer > exp.generate.max_tokens:
        raise ConfigError(f"{source}: reward.overlong_buffer: expected at most generate.max_tokens = "
                          f"{exp.generate.max_tokens}, got {exp.reward.overlong_buffer}")
    if exp.executor.mode == "resident" and exp.executor.kind == "slurm":
        n = exp.update.world_size + 1
        if n % exp.executor.resident.nodes:
            raise ConfigError(f"{source}: executor.resident.nodes: the resident job's {n} tasks (update.world_size "
                              f"= {exp.update.world_size} trainers + 1 generator) must spread evenly over "
                              f"{exp.executor.resident.nodes} nodes")
        if exp.executor.weight_sync == "shared_memory" and exp.executor.resident.nodes > 1:
            raise ConfigError(f"{source}: executor.weight_sync: \"shared_memory\" needs trainer 0 and the generator "
                              f"on one node, but executor.resident.nodes = {exp.executor.resident.nodes} puts them on "
                              "different nodes; use \"process_group\"")
    if not (exp.reward.functions or exp.reward.model.path or exp.reward.http.url):
        raise ConfigError(f"{source}: reward: no reward source: expected reward.functions, reward.model.path "
                          "or reward.http.url")
    if exp.reward.weights and len(exp.reward.weights) != len(exp.reward.functions):
        raise ConfigError(f"{source}: reward.weights: expected {len(exp.reward.functions)} weights "
                          f"(one per reward.functions entry), got {len(exp.reward.weights)}")
    for key in PATH_KEYS:
        *sections, name = key.split(".")
        owner = exp
        for section in sections:
            owner = getattr(owner, section)
        value = getattr(owner, name)
        if value and not Path(value).is_absolute():
            setattr(owner, name, str((base_dir / value).resolve()))
    return exp


def load(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return parse(data, str(path), path.resolve().parent)


def parse_assignments(items: Iterable[str], source: str = "--set") -> dict[str, Any]:
    """`KEY=VALUE` strings (dotted keys; VALUE a TOML value, else taken as a bare string) as overrides."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source} {item!r}: expected KEY=VALUE, e.g. update.lr=1e-5 or run.name=\"try-2\"")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw
    return out


def with_overrides(exp: Experiment, overrides: dict[str, Any], source: str) -> Experiment:
    """A copy of `exp` with dotted-key overrides applied, validated like a file."""
    data = exp.model_dump()
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            if not isinstance(node.get(p), dict):
                raise ConfigError(f"{source}: {key}: unknown key")
            node = node[p]
        node[leaf] = value
    return parse(data, source, Path.cwd())


def dumps(exp: Experiment) -> str:
    return tomli_w.dumps(exp.model_dump())


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        if isinstance(v, dict) and k != "extra":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def flat(exp: Experiment) -> dict[str, Any]:
    """The config as dotted keys (for MLflow params and diffs)."""
    return _flatten(exp.model_dump())


def resume_conflicts(frozen: Experiment, new: Experiment) -> list[str]:
    """Keys that differ between a run's frozen config and a resubmitted one and may not change."""
    a, b = flat(frozen), flat(new)
    return [f"{k}: run has {a[k]!r}, config has {b[k]!r}" for k in a
            if a[k] != b[k] and not any(k == c or (c.endswith(".") and k.startswith(c))
                                         for c in RESUMABLE_CHANGES)]
