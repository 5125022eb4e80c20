"""The disk a run needs, estimated at submit from the model's size and the config, against the free
space of run.runs_root.

Each saved version holds the policy's weights in model.dtype (`policy/`) and its DeepSpeed state
(`trainer/`): the module's weights in model.dtype and AdamW's two fp32 moments, and, when the
weights are not fp32, fp32 master weights as well; ppo adds a critic of the same kind. Every
iteration adds its rollouts, scores and update statistics (small). [run.retention] decides how many
versions and states stay (hpcrl.retention), and while an update commits, one version more is on
disk than the rules keep: that peak is what must fit.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from hpcrl import model_check, retention
from hpcrl.config import Experiment

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_BYTES = 8  # exp_avg and exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weights beside 16-bit ones
SAMPLE_BYTES = 24  # committed bytes per token of a sample (ids, logprobs, advantages, ... compressed)
TIGHT = 0.8  # a run needing more than this share of the free space is warned about


def params_of(model_dir: str | Path) -> int | None:
    """The parameter count of an HF model folder, from its safetensors headers (no tensor read);
    None without safetensors weights (or with damaged ones: preflight names those)."""
    problems, shapes = model_check.weight_shapes(str(model_dir), "model.path")
    if problems or not shapes:
        return None
    return sum(math.prod(shape) for shape in shapes.values())


@dataclass
class Estimate:
    policy: int  # bytes of one saved version's weights (policy and critic)
    state: int  # bytes of one trainer state
    data: int  # bytes of one iteration's rollouts, scores and statistics
    policies: int  # versions kept at the end
    states: int  # trainer states kept at the end
    iterations: int
    saved: int  # versions the run saves

    @property
    def final(self) -> int:
        return self.policy * self.policies + self.state * self.states + self.data * self.iterations

    @property
    def peak(self) -> int:
        """At the commit of an update, before retention lets a version go."""
        policies, states = min(self.saved, self.policies + 1), min(self.saved, self.states + 1)
        return self.policy * policies + self.state * states + self.data * self.iterations


def estimate(exp: Experiment) -> Estimate | None:
    """The run's disk use by the end, None when the model's size is unknown (no safetensors)."""
    params = params_of(exp.model.path)
    if params is None:
        return None
    width = DTYPE_BYTES[exp.model.dtype]
    per_param = width + ADAM_BYTES + (MASTER_BYTES if width < 4 else 0)
    policy, state = params * width, params * per_param
    if exp.algorithm.critic is not None:
        critic = params_of(exp.algorithm.critic.path or exp.model.path) or params
        policy, state = policy + critic * width, state + critic * per_param
    a = exp.algorithm
    samples = a.prompts_per_iteration * a.group_size * (a.max_sampling_rounds if a.dynamic_sampling else 1)
    data = samples * exp.model.max_model_len * SAMPLE_BYTES
    every = exp.executor.resident.checkpoint_every if exp.executor.mode == "resident" else 1
    n = exp.run.iterations
    policies, states = retention.final_counts(n, exp.run.retention, every)
    return Estimate(policy, state, data, policies, states, n, len(retention.saved_versions(n, every)))


def describe(est: Estimate | None, free: int | None = None) -> str:
    from hpcrl.pruning import size

    if est is None:
        return "disk: no estimate (model.path has no safetensors files)"
    line = (f"disk: about {size(est.final)} by the end, {size(est.peak)} at the peak ({est.policies} of "
            f"{est.saved} policy versions x {size(est.policy)}, {est.states} trainer states x "
            f"{size(est.state)}, {est.iterations} iterations of rollouts x {size(est.data)}; run.retention)")
    return line + (f"; {size(free)} free in run.runs_root" if free is not None else "")


def check(exp: Experiment) -> tuple[list[str], list[str]]:
    """(problems, notes): a run that cannot fit in the free space of run.runs_root is refused; one
    that would fill most of it is warned about. A resumed run counts what it holds already."""
    from hpcrl.pruning import disk_use, size

    est = estimate(exp)
    root = Path(exp.run.runs_root)
    existing = next((p for p in (root, *root.parents) if p.is_dir()), None)
    if est is None or existing is None:
        return [], []
    free = shutil.disk_usage(existing).free
    held = disk_use(exp.run_dir) if exp.run_dir.is_dir() else 0
    need = max(0, est.peak - held)
    if need > free:
        return [f"run.runs_root: {root}: the run needs about {size(need)} more on disk and {size(free)} "
                f"are free ({describe(est)}); keep fewer versions ([run.retention] keep_last, "
                "keep_trainer_states) or free space"], []
    if need > TIGHT * free:
        return [], [f"run.runs_root: the run will fill most of the free space: it needs about {size(need)} "
                    f"of {size(free)} free ({describe(est)})"]
    return [], []
