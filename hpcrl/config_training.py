"""The sections of the experiment config that say what a run computes: [run], [model], [data],
[algorithm] (with [algorithm.kl] and, for ppo, [algorithm.critic]), [generate], [update],
[tracking] and [alerts] ([reward] is hpcrl.config_reward's). Each key has its default and
meaning; rules between keys of one section are validators on it. Assembled into the experiment
by hpcrl.config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hpcrl.config_megatron import MegatronConfig
from hpcrl.config_section import HttpUrl, PathStr, Rule, Section


class RetentionConfig(Section):
    keep_last: int = Field(0, ge=0, description="Keep the weights of the last N saved policy versions (0: "
                           "keep every version). Version 0 (model.path), pinned versions (`hpcrl pin`) and "
                           "the version the run continues from are always kept (docs/retention.md).")
    keep_every: int = Field(0, ge=0, description="Also keep every K-th policy version (versions K, 2K, ...; "
                            "0: none beyond keep_last).")
    keep_trainer_states: int = Field(0, ge=0, description="Keep the DeepSpeed trainer states (optimizer "
                                     "state and fp32 master weights) of the last M saved versions (0: all); "
                                     "a continuing run needs only the latest.")


class RunConfig(Section):
    name: str = Field("run", description="Run name: the run directory is <runs_root>/<name>.")
    runs_root: PathStr = Field("runs", description="Directory holding the run directories and the MLflow "
                               "store.")
    seed: int = Field(0, description="Run seed; each stage's seed derives from (seed, iteration, stage).")
    iterations: int = Field(10, ge=1, description="Number of generate -> score -> update iterations.")
    dir_mode: str = Field(
        "0750", pattern=r"^0?[0-7]{3}$", description="Permissions (octal) of a new run directory: 0750 lets "
        "your group read it, 0700 only you.")
    eval_every: int = Field(5, ge=0, description="Validate on the test set every N iterations (0: only at "
                            "the end).")
    retention: RetentionConfig = Field(RetentionConfig(), description="Which policy versions and trainer "
                                       "states the run keeps on disk; the rest are pruned after each update "
                                       "and recorded in retention.jsonl.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not v or "/" in v or v.startswith("."):
            raise ValueError("a run name is a plain directory name (no '/', not starting with '.')")
        if len(v.encode()) > 200:
            raise ValueError(f"a run name is at most 200 bytes (it names directories; got {len(v.encode())})")
        return v


class ModelConfig(Section):
    path: PathStr = Field(..., description="HF-format model directory (policy version 0 and the reference).")
    tokenizer: PathStr = Field("", description="Tokenizer directory; empty means the model directory.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype for generation and training.")
    max_model_len: int = Field(256, ge=8, description="Longest prompt + response in tokens.")
    attn_implementation: Literal["auto", "eager", "sdpa"] = Field(
        "auto", description="The trainer's attention implementation (transformers). auto: the one that "
        "computes what vLLM computes for this model (eager where attention logits are soft-capped, as "
        "Gemma-2's; else sdpa); the choice is in each update's manifest (notes.attn_implementation).")


class DataConfig(Section):
    train: PathStr = Field(..., description="Training prompts: verl-layout parquet, plain parquet, JSONL, or "
                           "a directory written by datasets' save_to_disk.")
    test: PathStr = Field("", description="Held-out prompts for validation (same formats); empty: no "
                          "validation.")
    train_split: str = Field("train", description="Split of data.train when it is a DatasetDict save_to_disk "
                             "directory.")
    test_split: str = Field("test", description="Split of data.test when it is a DatasetDict save_to_disk "
                            "directory.")
    prompt_key: str = Field("prompt", description="Column with the prompt: a chat message list or a string.")
    answer_key: str = Field("reward_model.ground_truth", description="Column (dotted for a struct field) "
                            "with the reference answer; falls back to `answer`.")
    max_val_prompts: int = Field(0, ge=0, description="Use at most this many test prompts (0: all).")
    filter_overlong: bool = Field(True, description="Drop prompts longer than model.max_model_len - "
                                  "generate.max_tokens tokens (the count is reported at submit); false: "
                                  "refuse the run instead.")


class KLConfig(Section):
    coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference policy (0: no "
                        "reference); the adaptive controller's initial value.")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator for the penalty (k1, the "
                                                 "log ratio, is the classic per-token reward penalty).")
    mode: Literal["loss", "reward"] = Field("loss", description="Where the KL penalty goes: a loss term, or "
                                            "(ppo) a per-token reward -coef * KL before GAE.")
    target: float = Field(0.0, ge=0, description="Target KL per sample (summed over its tokens) of the "
                          "adaptive KL controller (Ziegler et al. 2019); 0: a fixed coef.")
    horizon: float = Field(10000.0, gt=0, description="Horizon (in samples) of the adaptive KL controller.")

    @model_validator(mode="after")
    def _controller_needs_a_coef(self) -> KLConfig:
        if self.target > 0 and self.coef <= 0:
            raise Rule("target", "the adaptive KL controller starts from algorithm.kl.coef, which is 0 (no "
                                 "KL penalty); set coef > 0")
        return self


class CriticConfig(Section):
    path: PathStr = Field("", description="Initial critic: a critic saved by hpcrl (update/critic) or any HF "
                          "model directory (its backbone, a new value head); empty: the policy's model.path.")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the critic (weight decay, grad clip, "
                      "ZeRO stage as in [update]).")
    value_clip: float = Field(0.2, ge=0, description="A value may move at most this far from the rollout's "
                              "value before its error stops counting (0: no clipping).")
    warmup: int = Field(0, ge=0, description="Train only the critic during the first N iterations (the "
                        "policy does not change).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor of GAE.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")


class AlgorithmConfig(Section):
    name: str = Field("grpo", description="Advantage estimator: grpo, rloo, "
                      "reinforce_plus_plus_baseline (also reinforce_pp), reinforce_plus_plus or gpg from "
                      "outcome rewards and groups, remax against a greedy sample of each prompt (the "
                      "registry in hpcrl/advantages.py); ppo: GAE with a learned critic ([algorithm.critic], "
                      "hpcrl/critic.py).")
    group_size: int = Field(8, ge=1, description="Samples per prompt (the GRPO group; 1 only with ppo or "
                            "remax).")
    prompts_per_iteration: int = Field(32, ge=1, description="Prompts drawn per iteration.")
    norm_adv_by_std: bool = Field(True, description="Divide group-centred rewards by the group's std (False: "
                                  "Dr.GRPO); ppo: whiten the token advantages over the batch.")
    std_eps: float = Field(1e-6, gt=0, description="grpo: added to the group's reward std before dividing "
                           "(verl 1e-6, TRL 1e-4).")
    reinforce_gamma: float = Field(1.0, ge=0, le=1, description="reinforce_plus_plus: discount of the "
                                   "per-token returns (verl's algorithm.gamma; ppo's GAE takes "
                                   "algorithm.critic.gamma).")
    policy_loss: str = Field("ppo_clip", description="Policy loss (the registry in hpcrl/losses.py): "
                             "ppo_clip (PPO's clipped surrogate), gspo (sequence-level ratio and clip), "
                             "cispo (clipped importance weight, stop-gradient) or gpg (no ratio).")
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip range epsilon (the lower side when "
                              "clip_ratio_high is set).")
    clip_ratio_high: float = Field(0.0, ge=0, description="Upper clip range (clip-higher, e.g. 0.28); 0: "
                                   "same as clip_ratio.")
    dual_clip_c: float = Field(0.0, ge=0, description="Dual-clip constant c > 1 capping the loss of negative "
                               "advantages; 0: off.")
    max_log_ratio: float = Field(20.0, gt=0, description="ppo_clip and cispo clamp log(pi / pi_old) to "
                                 "[-max_log_ratio, max_log_ratio] before exp (verl's 20).")
    old_logprobs: Literal["recompute", "sampler"] = Field(
        "recompute", description="The old policy's logprobs in the PPO ratio: `recompute` them with the "
        "trainer (a forward pass before the first step over every mini-batch but the first, whose own "
        "training forward pass gives them while the policy is still the old one, unless kl.mode = \"reward\" "
        "needs them before any step), or take the `sampler`'s (vLLM's, verl's bypass mode): one forward pass "
        "fewer, and the ratio then corrects for any sampler/trainer mismatch.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus in the loss (0: none).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="Loss aggregation (hpcrl/losses.py); seq-mean-token-sum-norm divides each "
        "sequence's token sum by generate.max_tokens (Dr.GRPO). gspo always aggregates seq-mean-token-mean.")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling (hpcrl/dynamic_sampling.py): "
                                   "sample prompts in rounds and train on groups whose rewards are not all "
                                   "equal, prompts_per_iteration of them.")
    max_sampling_rounds: int = Field(4, ge=1, description="Dynamic sampling: most sampling rounds per "
                                     "iteration, each drawing prompts_per_iteration new prompts; short of "
                                     "informative groups after the last, groups with equal rewards fill the "
                                     "batch.")
    max_staleness: int = Field(0, ge=0, description="Bounded staleness s of asynchronous generation: "
                               "iteration k samples with policy version max(0, k - s), so generation of "
                               "the next s iterations overlaps the update (0: lock-step). Deterministic: "
                               "a run and its resume give the same outputs at any s.")
    off_policy_cap: float = Field(2.0, ge=0, description="With max_staleness > 0 and old_logprobs = "
                                  "\"recompute\": each token's loss is weighted by min(pi_old / "
                                  "pi_sampler, off_policy_cap), pi_old the trainer's policy before the "
                                  "update, pi_sampler the (older) policy that generated it (decoupled PPO "
                                  "with a truncated importance weight); 0: no correction.")
    kl: KLConfig = Field(KLConfig(), description="The KL penalty to the reference policy and its adaptive "
                         "controller.")
    critic: CriticConfig | None = Field(None, description="ppo only: the critic (value model) and GAE.")

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if 0 < self.dual_clip_c <= 1:
            raise Rule("dual_clip_c", f"expected 0 (off) or a value above 1, got {self.dual_clip_c}")
        if self.group_size < 2 and self.name not in ("ppo", "remax"):
            raise Rule("group_size", f"{self.name} compares samples of one prompt: expected at least 2, "
                                     f"got {self.group_size}")
        if self.name != "ppo" and self.critic is not None:
            raise Rule("critic", f"only algorithm.name = \"ppo\" has a critic (name is {self.name!r})")
        if self.name == "remax" and self.dynamic_sampling:
            raise Rule("dynamic_sampling", "remax samples greedy baselines for the round-0 prompts only, "
                                           "and dynamic sampling draws more rounds: set one of them off")
        if self.reinforce_gamma != 1.0 and self.name != "reinforce_plus_plus":
            raise Rule("reinforce_gamma", "only algorithm.name = \"reinforce_plus_plus\" discounts its "
                                          f"returns (name is {self.name!r}; ppo's GAE: critic.gamma)")
        if self.name != "ppo" and self.kl.mode == "reward":
            raise Rule("kl.mode", f"only algorithm.name = \"ppo\" has token-level rewards (name is "
                                  f"{self.name!r})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _ppo_has_a_critic(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("name") == "ppo" and data.get("critic") is None:
            data = {**data, "critic": {}}
        return data


class GenerateConfig(Section):
    max_tokens: int = Field(64, ge=1, description="Longest response in tokens.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    kv_cache_gib: float = Field(1.0, gt=0, description="vLLM KV cache size on CPU in GiB (fractions "
                                "allowed).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM memory share on a GPU.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel size (GPUs of the engine; "
                                      "on CPU, workers each bound to their share of the task's cores).")
    engines: int = Field(1, ge=1, description="vLLM engines sharing each generate stage, each committing "
                         "a shard of the prompts; the rollouts are the same whatever the number. Staged: a "
                         "job array of one task each, with executor.generate's resources per task. Resident: "
                         "this many generator tasks beside the trainers, each holding its engine for the "
                         "run, all loading every update's weights.")
    shards: int = Field(0, ge=0, description="Resident mode: the shards each generation splits into (0: one "
                        "per engine). Engine e samples shard e, then the next shard not taken, until none "
                        "is left: a slow engine (long responses) holds a generation for one shard, not for a "
                        "share of the batch; each shard costs a commit and makes vLLM's batches smaller. "
                        "The staged mode runs one shard per engine.")

    @property
    def shard_count(self) -> int:
        """The shards of a generate stage (hpcrl.shards): `shards`, or one per engine."""
        return self.shards or self.engines


class LoraConfig(Section):
    rank: int = Field(0, ge=0, description="Rank of the LoRA adapters (through peft); 0: no adapters, every "
                      "weight trains. With rank > 0 only the adapters train (on `target_modules`, the base "
                      "weights frozen); each policy version is saved merged, with its adapters in "
                      "`policy/adapter/`.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapters' product is scaled by "
                         "alpha / rank.")
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
                                      description="Names (last component) of the linear modules that get "
                                      "adapters.")


class UpdateConfig(Section):
    backend: Literal["deepspeed", "megatron"] = Field(
        "deepspeed", description="What trains the policy: DeepSpeed (ZeRO data parallelism, every feature "
        "here) or Megatron-Core (tensor and pipeline parallelism, [update.megatron], for models that outgrow "
        "ZeRO; rows run whole, so share_prompts does not apply). Both compute the same update.")
    megatron: MegatronConfig = Field(MegatronConfig(), description="The Megatron-Core backend's layout.")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each iteration's batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass (the batch is split into this "
                              "many).")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per forward/backward per rank.")
    max_tokens_per_micro_batch: int = Field(
        0, ge=0, description="0: micro-batches of micro_batch_size rows, each right-padded to its longest. "
        "Else micro-batches of consecutive rows up to this many tokens (prompt + response; a longer row goes "
        "alone), run end to end as one sequence with attention kept within each row: no compute or "
        "activation memory on padding, and memory bounded by the budget rather than by the longest row. "
        "The same loss and gradients (to float rounding). Needs share_prompts = false.")
    share_prompts: bool = Field(True, description="Run each distinct prompt of a micro-batch once and its "
                                "responses on its KV cache (a GRPO group's samples share one prompt): the "
                                "same loss and gradient (to float rounding) for fewer tokens of compute. "
                                "`false` runs every row whole (for a model whose cache cannot be "
                                "batch-indexed).")
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clipping (0: none).")
    gradient_checkpointing: bool = Field(
        False, description="Keep only each layer's input through the forward pass and recompute the layer in "
        "the backward pass (the policy's and the critic's; the reference model and the old-logprob passes "
        "keep nothing to begin with): less activation memory for about a third more compute, the same loss "
        "and gradients. A recomputed layer cannot reuse a prompt's KV cache, so it needs share_prompts = "
        "false.")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage. Stages 1 and 2 run as 0 "
                                            "when update.world_size is 1: they partition over data-parallel "
                                            "ranks, and one rank has nothing to partition.")
    offload: Literal["none", "optimizer", "all"] = Field(
        "none", description="Keep state in CPU memory instead of the GPU's (DeepSpeed's ZeRO-Offload): "
        "`optimizer`: the AdamW moments and the float32 master weights, stepped on the CPU (the update runs "
        "as ZeRO stage 2, or 3 if asked, on any number of ranks); `all`: the parameters too (zero_stage = 3 "
        "only). The optimizer stays torch's AdamW, so the update is the plain one; slower where the "
        "optimizer step or moving the parameters dominates.")
    world_size: int = Field(1, ge=1, description="DeepSpeed ranks for the update (processes on this node).")
    sequence_parallel: int = Field(
        1, ge=1, description="Ulysses sequence parallelism: each sequence of a micro-batch split over this "
        "many consecutive ranks, which exchange attention heads for sequence slices inside each attention "
        "layer (DeepSpeed's all-to-all): 1/n of the activations and logits per rank, the same loss and "
        "gradients. The rows are split over world_size / n groups. Needs world_size a multiple of it, "
        "share_prompts = false and a dense model whose attention heads it divides (a critic's too); composes "
        "with packing, gradient checkpointing and PPO's critic.")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters on the policy (rank 0: off).")
    moe_aux_loss_coef: float = Field(
        0.0, ge=0, description="Mixture-of-experts models: weight of the router's load-balancing loss "
        "(the Switch Transformer's, as transformers computes it) added to the policy loss; 0: none. The "
        "routing (each expert's load per layer, moe/load_max, moe/load_min, moe/aux_loss) is recorded "
        "either way.")
    sampler_mismatch_tol: float = Field(
        0.0, ge=0, description="Stop an update (uncommitted) whose recomputed old logprobs differ from the "
        "sampler's by more than this on average over the batch's tokens (rollout/logprob_diff_mean): the "
        "trainer would train a model other than the one generating. 0: 1e-3 for float32 weights, 5e-2 "
        "otherwise. Not checked with algorithm.old_logprobs = \"sampler\" or generate.top_p < 1 (vLLM's "
        "logprobs are then renormalised over the nucleus).")

    @model_validator(mode="after")
    def _offload_params_under_zero_3(self) -> UpdateConfig:
        if self.offload == "all" and self.zero_stage != 3:
            raise Rule("offload", f"\"all\" offloads the parameters, which only ZeRO stage 3 partitions; "
                                  f"expected zero_stage = 3 (got {self.zero_stage}), or offload = "
                                  "\"optimizer\"")
        return self

    @model_validator(mode="after")
    def _sequence_parallel_runs_rows_whole(self) -> UpdateConfig:
        n = self.sequence_parallel
        if n > 1 and self.world_size % n:
            raise Rule("sequence_parallel", f"{n} ranks per sequence must divide update.world_size = "
                                            f"{self.world_size}")
        if n > 1 and self.share_prompts:
            raise Rule("sequence_parallel", "a sequence split over ranks runs whole, its prompt with it; "
                       "expected share_prompts = false with it")
        return self

    @model_validator(mode="after")
    def _checkpointing_runs_rows_whole(self) -> UpdateConfig:
        if self.gradient_checkpointing and self.share_prompts:
            raise Rule("gradient_checkpointing", "a layer recomputed in the backward pass cannot reuse a "
                                                 "prompt's KV cache; expected share_prompts = false with it")
        if self.max_tokens_per_micro_batch and self.share_prompts:
            raise Rule("max_tokens_per_micro_batch", "packed rows run whole, end to end, and a shared prompt "
                       "runs once for its rows; expected share_prompts = false with it (docs/memory.md says "
                       "when each wins)")
        return self


class TrackingConfig(Section):
    enabled: bool = Field(True, description="Log to MLflow.")
    tracking_uri: str = Field("", description="MLflow tracking URI; empty: sqlite:///<runs_root>/mlflow.db.")
    experiment: str = Field("hpcrl", description="MLflow experiment name.")
    plot_every: int = Field(10, ge=0, description="Log the run's plots to MLflow every N iterations and at "
                            "the end (0: only at the end).")


class AlertsConfig(Section):
    kl_max: float = Field(
        0.0, ge=0, description="Alert when the iteration's KL (the one the progress line shows) is above "
        "this (0: off).")
    kl_spike: float = Field(
        10.0, ge=0, description="Alert when the KL is above this many times its median over the last "
        "`window` iterations (0: off).")
    entropy_min: float = Field(
        0.0, ge=0, description="Alert when the policy's mean token entropy (actor/entropy) falls below this "
        "(entropy collapse; 0: off).")
    reward_drop: float = Field(
        0.5, ge=0, description="Alert when the mean training reward falls this far below its median over the "
        "last `window` iterations (reward collapse; 0: off).")
    clip_ratio_max: float = Field(
        0.95, ge=0, le=1, description="Alert when more than this share of the training responses stop at "
        "generate.max_tokens (1: off).")
    sync_logp_diff: float = Field(
        0.0, ge=0, description="Resident: alert when the weight sync's probe difference (sync/logp_diff) is "
        "above this, below the tolerance that stops the run (0: off).")
    stall: float = Field(
        5.0, ge=0, description="Alert when a stage takes this many times its median over the last `window` "
        "iterations, and a minute more (0: off).")
    window: int = Field(
        5, ge=1, description="Iterations in the running medians (a rule with a median waits for this many).")
    stop: list[Literal["non_finite", "kl_max", "kl_spike", "entropy_min", "reward_drop", "clip_ratio_max",
                       "sync_logp_diff", "stall"]] = Field(
        ["non_finite"], description="Rules that stop the run after the stage that fired them (`hpcrl "
        "resume` continues); the others warn: a line in the progress, `hpcrl status` and `hpcrl inspect`, "
        "and an MLflow tag. A non-finite metric is always checked.")
    webhook: HttpUrl = Field(
        "", description="URL that receives each alert as a JSON POST ({\"run\", \"iteration\", "
        "\"stage\", \"rule\", \"message\", \"stops\"}; e.g. a chat channel's incoming webhook); empty: "
        "none.")
    webhook_timeout_s: float = Field(
        5.0, gt=0, description="Seconds before the webhook POST is given up (the run goes on).")


def deepspeed_stage(u: UpdateConfig, dtype: str, world_size: int) -> int:
    """The ZeRO stage DeepSpeed runs: update.zero_stage, except that stages 1 and 2 become 0 on one
    rank. They partition optimizer state and gradients over the data-parallel ranks; with one rank
    there is nothing to partition, and ZeRO-2's gradient buckets cost 13% of a 99M update on CPU.
    bf16 runs at least stage 1: DeepSpeed's stage 0 keeps no fp32 master weights and cannot
    accumulate gradients in fp32 (its bf16 optimizer, with both, is stage 1's). With
    update.offload, stage 2 (or 3): the stages whose optimizer steps on the CPU."""
    stage = u.zero_stage
    if u.offload != "none":  # ZeRO-Offload: the optimizer of stage 2 (or 3) on any number of ranks
        return 3 if stage == 3 else 2
    if dtype == "bfloat16":
        return 1 if stage < 2 or (world_size == 1 and stage == 2) else stage
    return 0 if world_size == 1 and stage in (1, 2) else stage
