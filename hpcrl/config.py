"""The experiment config (`experiment.toml`): the whole schema, loading, freezing, overrides.

Every key is declared with its default and meaning in the section modules (hpcrl.config_training,
hpcrl.config_jobs); `hpcrl config` prints them. Loading refuses unknown keys, wrong types and
broken rules between keys with the file, the key path and what was expected; a key that moved
into a section names its new place. Paths are resolved against the directory of the file that
names them, and the frozen copy in the run directory holds the fully resolved config, so stages
need nothing else.
"""

from __future__ import annotations

import functools
import tomllib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import tomli_w
from pydantic import BaseModel, ValidationError, model_validator

from hpcrl import config_megatron
from hpcrl.config_jobs import SBATCH_OPTION, SBATCH_VALUE, ExecutorConfig, ResidentExecutor, StagedExecutor
from hpcrl.config_reward import RewardConfig, RewardHttpConfig, RewardModelConfig
from hpcrl.config_section import ConfigError, PathStr, Rule, Section
from hpcrl.config_training import (
    AlertsConfig,
    AlgorithmConfig,
    DataConfig,
    GenerateConfig,
    ModelConfig,
    RunConfig,
    TrackingConfig,
    UpdateConfig,
    deepspeed_stage,
)

__all__ = ["SBATCH_OPTION", "SBATCH_VALUE", "AlgorithmConfig", "ConfigError", "Experiment", "PathStr",
           "ResidentExecutor", "RewardConfig", "RewardHttpConfig", "RewardModelConfig", "StagedExecutor"]


class Experiment(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig
    data: DataConfig
    algorithm: AlgorithmConfig = AlgorithmConfig()
    generate: GenerateConfig = GenerateConfig()
    reward: RewardConfig = RewardConfig()
    update: UpdateConfig = UpdateConfig()
    executor: ExecutorConfig = StagedExecutor()
    tracking: TrackingConfig = TrackingConfig()
    alerts: AlertsConfig = AlertsConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.runs_root) / self.run.name

    @property
    def tokenizer_path(self) -> str:
        return self.model.tokenizer or self.model.path

    @model_validator(mode="after")
    def _consistent(self) -> Experiment:
        if self.reward.overlong_buffer > self.generate.max_tokens:
            raise Rule("reward.overlong_buffer",
                       f"expected at most generate.max_tokens = {self.generate.max_tokens}, "
                       f"got {self.reward.overlong_buffer}")
        ex, w = self.executor, self.update.world_size
        if ex.mode == "resident" and ex.resident.colocate and self.algorithm.max_staleness:
            raise Rule("executor.resident.colocate", "asynchronous generation (algorithm.max_staleness = "
                       f"{self.algorithm.max_staleness}) samples while the trainers update, so vLLM cannot "
                       "give its GPUs to them; expected colocate = false, or max_staleness = 0")
        if ex.score.tasks > 1 and ex.mode == "resident":
            raise Rule("executor.score.tasks", "the resident mode scores on its generator task's reward "
                       "workers; expected tasks = 1, or executor.mode = \"staged\"")
        n = self.generate.engines
        if n > 1 and ex.mode == "resident" and ex.resident.colocate:
            raise Rule("generate.engines", "colocated vLLM runs one engine, on the trainers' GPUs; expected "
                       "engines = 1, or executor.resident.colocate = false")
        if n > 1 and ex.mode == "resident" and ex.kind == "slurm" and ex.resident.generator is not None:
            raise Rule("generate.engines", "[executor.resident.generator] is the node of one engine; "
                       "expected engines = 1, or no [executor.resident.generator] (engines beside the "
                       "trainers, executor.resident.nodes)")
        if self.generate.engines > self.algorithm.prompts_per_iteration:
            raise Rule("generate.engines", f"each engine samples whole groups (every engines-th prompt); "
                       f"expected at most algorithm.prompts_per_iteration = "
                       f"{self.algorithm.prompts_per_iteration} engines, got {self.generate.engines}")
        if self.generate.engines > 1 and self.algorithm.dynamic_sampling:
            raise Rule("generate.engines", "dynamic sampling draws its rounds over the whole batch in one "
                       "engine; expected engines = 1, or algorithm.dynamic_sampling = false")
        if self.update.backend == "megatron":
            config_megatron.check(self)
        if ex.mode == "resident" and ex.resident.colocate:
            self._colocation_rules()
        self._shards_rules()
        if ex.mode != "resident" or ex.kind != "slurm":
            return self
        if ex.resident.generator is not None and w % ex.resident.nodes:
            raise Rule("executor.resident.nodes", f"update.world_size = {w} trainer tasks must spread evenly "
                       f"over {ex.resident.nodes} nodes (the generator has a node of its own)")
        if ex.resident.generator is None and (w + n) % ex.resident.nodes:
            raise Rule("executor.resident.nodes", f"the resident job's {w + n} tasks (update.world_size = "
                       f"{w} trainers + generate.engines = {n}) must spread evenly over {ex.resident.nodes} "
                       "nodes; or give the generator a node of its own ([executor.resident.generator])")
        return self

    def _colocation_rules(self) -> None:
        """The trainers' state must leave the GPU while vLLM generates (hpcrl.trainer.release):
        DeepSpeed moves the state of its ZeRO-1/2 optimizer, of ZeRO-3's only for its own FusedAdam,
        and not of its plain or bf16 (ZeRO-1 in bf16) optimizers."""
        u, dtype = self.update, self.model.dtype
        stage = deepspeed_stage(u, dtype, u.world_size)
        if stage == 0 or (stage == 1 and dtype == "bfloat16" and u.offload == "none"):
            runs_as = "a plain" if stage == 0 else "its bf16 (ZeRO-1)"
            raise Rule("executor.resident.colocate", f"the update (zero_stage = {u.zero_stage} on "
                       f"{u.world_size} rank(s) in {dtype}) runs {runs_as} optimizer, whose state DeepSpeed "
                       "cannot move off the GPU; expected update.offload = \"optimizer\", or zero_stage = 2 "
                       "on 2 ranks or more")
        if stage == 3 and u.offload == "none":
            raise Rule("executor.resident.colocate", "under ZeRO-3 DeepSpeed moves only its FusedAdam's "
                       "state off the GPU, and the update steps torch's AdamW; expected update.offload = "
                       "\"optimizer\" or \"all\", or zero_stage = 2")

    def _shards_rules(self) -> None:
        g, a = self.generate, self.algorithm
        if not g.shards:
            return
        if self.executor.mode != "resident" and g.shards != g.engines:
            raise Rule("generate.shards", "the staged mode runs one shard per engine (a job array task "
                       f"each); expected shards = 0 or {g.engines}, or executor.mode = \"resident\"")
        if g.shards < g.engines:
            raise Rule("generate.shards", f"every engine samples a shard; expected 0 or at least "
                       f"generate.engines = {g.engines}, got {g.shards}")
        if g.shards > a.prompts_per_iteration:
            raise Rule("generate.shards", "each shard samples whole groups (every shards-th prompt); "
                       f"expected at most algorithm.prompts_per_iteration = {a.prompts_per_iteration}, got "
                       f"{g.shards}")
        if g.shards > 1 and a.dynamic_sampling:
            raise Rule("generate.shards", "dynamic sampling draws its rounds over the whole batch in one "
                       "shard; expected shards = 0, or algorithm.dynamic_sampling = false")


# Keys a resumed run may change; anything else must match the frozen config.
RESUMABLE_CHANGES = ("run.iterations", "run.eval_every", "run.retention.", "executor.", "tracking.enabled",
                     "tracking.plot_every", "alerts.")


def sections_of(annotation: Any) -> list[type[BaseModel]]:
    """The section models a field holds: its model, or each model of a union (None left out)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        return [m for arg in typing.get_args(annotation) for m in sections_of(arg)]
    return []


def _path_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        for section in sections_of(field.annotation):
            out += [k for k in _path_fields(section, f"{prefix}{name}.") if k not in out]
        if "path" in field.metadata:
            out.append(prefix + name)
    return out


PATH_KEYS = _path_fields(Experiment)

# Keys that moved into sections: a config that still uses one is told where it went.
MOVED = {
    **{f"algorithm.kl_{k}": f"algorithm.kl.{k}" for k in ("coef", "estimator", "mode", "target", "horizon")},
    **{f"algorithm.{k}": f"algorithm.critic.{k.removeprefix('critic_')}"
       for k in ("critic_path", "critic_lr", "value_clip", "critic_warmup", "gamma", "lam")},
    **{f"executor.{k}": f"executor.resident.{k} (with executor.mode = \"resident\")"
       for k in ("weight_sync", "sync_bucket_mb", "sync_check_tol", "checkpoint_every", "overlap_commit",
                 "colocate", "stall_s", "collective_timeout_s")},
}


def _describe(err: dict) -> str:
    loc = [str(p) for p in err["loc"]]
    if loc[:1] == ["executor"] and loc[1:2] in (["staged"], ["resident"]):  # the union's tag
        del loc[1]
    key = ".".join(loc)
    kind = err["type"]
    rule = err.get("ctx", {}).get("error")
    if isinstance(rule, Rule):
        return f"{'.'.join(loc + ([rule.key] if rule.key else []))}: {rule}"
    if kind == "extra_forbidden":
        if key in MOVED:
            return f"{key}: this key is now {MOVED[key]}"
        section = ".".join(loc[:-1])
        where = f"[{section}]" if section else "the top level"
        if key == "executor.resident":
            return f"{key}: only with executor.mode = \"resident\""
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
    for key in PATH_KEYS:
        *sections, name = key.split(".")
        owner = exp
        for section in sections:
            owner = getattr(owner, section, None)
        value = getattr(owner, name, None)
        if value and not Path(value).is_absolute():
            setattr(owner, name, str((base_dir / value).resolve()))
    return exp


@functools.lru_cache(maxsize=8)
def _parse_toml(text: str) -> dict[str, Any]:
    """A config's TOML, parsed once per text: every stage of a resident job loads the run's frozen
    config (2 ms of pure-Python parsing per stage on CPU); callers get a copy (`_copied`)."""
    return tomllib.loads(text)


def _copied(value: Any) -> Any:
    """A copy of parsed TOML: new tables and arrays, the immutable leaves shared (a fifth of
    copy.deepcopy's time, which keeps a memo for the cycles TOML cannot have)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def load(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = _copied(_parse_toml(path.read_text(encoding="utf-8")))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not valid UTF-8 (byte {err.start}): a config file is UTF-8 TOML"
                          ) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return parse(data, str(path), path.resolve().parent)


def parse_assignments(items: Iterable[str], source: str = "--set") -> dict[str, Any]:
    """`KEY=VALUE` strings (dotted keys; VALUE a TOML value, else taken as a bare string) as overrides."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source} {item!r}: expected KEY=VALUE, e.g. update.lr=1e-5 or "
                              "run.name=\"try-2\"")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw
    return out


def _is_section(path: list[str]) -> bool:
    """Whether dotted `path` names a section of the schema (in any variant of a union)."""
    models: list[type[BaseModel]] = [Experiment]
    for name in path:
        models = [s for m in models if name in m.model_fields
                  for s in sections_of(m.model_fields[name].annotation)]
    return bool(models)


def with_overrides(exp: Experiment, overrides: dict[str, Any], source: str) -> Experiment:
    """A copy of `exp` with dotted-key overrides applied, validated like a file."""
    data = exp.model_dump(exclude_none=True)
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for i, p in enumerate(parents):
            if p not in node and _is_section(parents[: i + 1]):
                # an optional section the config leaves out ([algorithm.critic], [executor.resident])
                node[p] = {}
            if not isinstance(node.get(p), dict):
                raise ConfigError(f"{source}: {key}: unknown key")
            node = node[p]
        node[leaf] = value
    if (data["executor"].get("mode") == "staged"
            and not any(k.startswith("executor.resident.") for k in overrides)):
        data["executor"].pop("resident", None)  # a resident run continued staged
    return parse(data, source, Path.cwd())


def dumps(exp: Experiment) -> str:
    return tomli_w.dumps(exp.model_dump(exclude_none=True))


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
    return _flatten(exp.model_dump(exclude_none=True))


def resume_conflicts(frozen: Experiment, new: Experiment) -> list[str]:
    """Keys that differ between a run's frozen config and a resubmitted one and may not change."""
    a, b = flat(frozen), flat(new)
    return [f"{k}: run has {a.get(k)!r}, config has {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and not any(k == c or (c.endswith(".") and k.startswith(c))
                                                 for c in RESUMABLE_CHANGES)]
