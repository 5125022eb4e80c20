"""The [reward] section of the experiment config, with [reward.model] and [reward.http]: the
sources of a sample's reward (reward functions, a reward model, an HTTP service) and their weights.
Assembled into the experiment by hpcrl.config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hpcrl.config_section import HttpUrl, PathStr, Rule, Section


class RewardModelConfig(Section):
    path: PathStr = Field("", description="HF sequence-classification reward model (num_labels = 1) scoring "
                          "prompt + response as component `model`; empty: none.")
    weight: float = Field(1.0, description="Weight of the reward model's score in the reward.")
    batch_size: int = Field(16, ge=1, description="Samples per forward pass of the reward model.")
    max_length: int = Field(1024, ge=8, description="Longest prompt + response in reward-model tokens; "
                            "longer samples lose tokens from the start.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the reward model runs; auto: "
                                                   "cuda when the score job sees a GPU, else cpu.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Reward model weights dtype; auto: as saved.")


class RewardHttpConfig(Section):
    url: HttpUrl = Field("", description="Reward service that scores batches of samples as component "
                         "`http` (docs/data-and-rewards.md: the HTTP protocol); empty: none.")
    weight: float = Field(1.0, description="Weight of the service's score in the reward.")
    batch_size: int = Field(32, ge=1, description="Samples per request.")
    concurrency: int = Field(4, ge=1, description="Requests in flight at once.")
    timeout_s: float = Field(60.0, gt=0, description="Seconds a request may take, from connecting to the "
                             "last byte of the answer, however slowly the service sends it.")
    retries: int = Field(3, ge=0, description="Retries of a request that could not connect, timed out or got "
                         "HTTP 408, 429, 500, 502, 503 or 504; then the score stage fails.")
    backoff_s: float = Field(1.0, ge=0, description="Wait before the first retry in seconds; doubled for "
                             "each further retry.")
    max_body_mb: float = Field(16.0, gt=0, description="Largest answer in MB; a larger one fails the score "
                               "stage (not retried).")


class RewardConfig(Section):
    functions: list[str] = Field(["hpcrl.rewards:exact_match"], description="Reward functions as "
                                 "`module:function`; the reward is the weighted sum of these and the reward "
                                 "model and service below.")
    weights: list[float] = Field([], description="One weight per function; empty means all 1.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO overlong penalty: training responses longer than "
                                 "generate.max_tokens minus this many tokens lose reward linearly (0: off).")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="Penalty at generate.max_tokens for the "
                                           "overlong penalty.")
    workers: int = Field(0, ge=0, description="Reward worker processes (0: score in the stage's own "
                         "process).")
    model: RewardModelConfig = Field(RewardModelConfig(), description="Reward model backend "
                                     "(hpcrl/reward_backends.py).")
    http: RewardHttpConfig = Field(RewardHttpConfig(), description="HTTP reward service backend "
                                   "(hpcrl/reward_backends.py).")

    @model_validator(mode="after")
    def _sources(self) -> RewardConfig:
        if not (self.functions or self.model.path or self.http.url):
            raise Rule("", "no reward source: expected reward.functions, reward.model.path or "
                           "reward.http.url")
        if self.weights and len(self.weights) != len(self.functions):
            raise Rule("weights", f"expected {len(self.functions)} weights (one per reward.functions entry), "
                                  f"got {len(self.weights)}")
        return self
