"""LoRA adapters on the policy (`[update.lora]`), through peft.

With `update.lora.rank > 0` the update trains low-rank adapters beside the frozen weights of the
modules `target_modules` names (peft's LoRA layers, injected into the transformers model in place:
the model keeps its class and its checkpoint names, each adapted module's own weight becoming
`<module>.base_layer.weight` beside `<module>.lora_A.default.weight` and `lora_B`). The reference
policy is the base model: the policy with its adapters switched off (`WithoutAdapters`).

Each policy version is saved merged, W + (alpha / rank) B A for each adapted module, under the
checkpoint's names (`merged`): its `policy/` folder is what vLLM, replay and `hpcrl export` load.
The adapters themselves are kept in the version's `policy/adapter/` (peft's format, which `hpcrl
export --adapters` copies) and, with their optimizer state, in its DeepSpeed state; the next update
loads the base model and those adapters. The resident mode's weight sync sends the base weights
and the adapters apart (`wire`) when the engines start and the adapters alone after each update;
each vLLM worker merges them (`Merger`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from hpcrl.config_training import LoraConfig

ADAPTER = "default"  # peft's name of the one adapter
_PEFT_PREFIX = "base_model.model."  # where peft's PeftModel holds the model: its saved adapters' names
_BASE, _A, _B = ".base_layer.", f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."


def wrap(model: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """`model` with fresh adapters on `cfg.target_modules` (B = 0, so the policy is unchanged; A
    drawn from `seed`); only the adapters train."""
    import peft

    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules),
                             lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return peft.inject_adapter_in_model(config, model)
        except ValueError as err:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(f"update.lora.target_modules {list(cfg.target_modules)} matches no linear "
                             f"module of {type(model).__name__} ({err})") from None


def config_scale(cfg: LoraConfig) -> float:
    """alpha / rank of `[update.lora]`; 0 without adapters."""
    return cfg.alpha / cfg.rank if cfg.rank else 0.0


def scaling(model: torch.nn.Module) -> float | None:
    """alpha / rank of the model's adapter; None for a model without one."""
    config = (getattr(model, "peft_config", None) or {}).get(ADAPTER)
    return None if config is None else config.lora_alpha / config.r


def merged(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state of an adapted model (some of it, e.g. one layer's) as the checkpoint names it:
    each adapted weight W (`<m>.base_layer.weight`) becomes `<m>.weight` = W + scale * B A, computed
    in float32 and rounded once to W's dtype; the adapters are dropped."""
    out = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if _BASE not in name:
            out[name] = tensor
            continue
        module, _, leaf = name.rpartition(_BASE)
        key = f"{module}.{leaf}"
        a, b = state.get(f"{module}{_A}weight"), state.get(f"{module}{_B}weight")
        if leaf == "weight" and a is not None and b is not None:
            tensor = _merge(tensor, a, b, scale)
        out[key] = tensor
    return out


def _merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A, computed in float32 and rounded once to W's dtype."""
    return (w.float() + scale * (b.float() @ a.float())).to(w.dtype)


def is_adapter(name: str) -> bool:
    """Whether a parameter of an adapted model is one of its adapters."""
    return _A in name or _B in name


def wire(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A state of an adapted model as the weight sync sends it (`Merger` reads it): the base
    weights under the checkpoint's names (`<m>.weight` unmerged) and the adapters as
    `<m>.lora_A` and `<m>.lora_B`."""
    base, adapters = {}, {}
    for name, tensor in state.items():
        for infix, wire_name in ((_A, ".lora_A"), (_B, ".lora_B")):
            if infix in name:
                adapters[name.split(infix)[0] + wire_name] = tensor
                break
        else:
            base[name.replace(_BASE, ".")] = tensor
    return base, adapters


class Merger:
    """The load side of a LoRA weight sync, in each vLLM worker: what `wire` sent, turned into the
    merged weights vLLM loads. The first sync sends every base weight and the adapters, later ones
    the adapters only; the merger keeps a copy of the base weights it will need again: those of
    each adapted module and of the modules vLLM loads into the same layer (`packed`, the model's
    `packed_modules_mapping`: q/k/v into qkv_proj), since a layer reloaded in part would be
    reloaded wrong. Each sync then loads every such layer whole: W + scale * B A for an adapted
    weight, the kept base for the others."""

    def __init__(self, scale: float, targets: list[str], packed: dict[str, list[str]]):
        self.scale = scale
        self.together = {}  # a module's last name -> the names vLLM loads with it
        for target in targets:
            group = next((tuple(m) for m in packed.values() if target in m), (target,))
            self.together.update(dict.fromkeys(group, group))
        self.bases: dict[str, dict[str, torch.Tensor]] = {}  # module -> parameter -> kept base

    def __call__(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        adapters = {}
        for name, tensor in stream:
            module, _, param = name.rpartition(".")
            if param in ("lora_A", "lora_B"):
                adapters[name] = tensor.clone()  # a received tensor may share a reused buffer
            elif module.rpartition(".")[2] in self.together:
                self.bases.setdefault(module, {})[param] = tensor.clone()
            else:
                yield name, tensor
        for module in sorted({n.rpartition(".")[0] for n in adapters}):
            if "weight" not in self.bases.get(module, {}):
                raise RuntimeError(f"LoRA sync: adapters of {module} but no base weight: the engine "
                                   "took no full sync from the trainer first")
        loaded = {(m.rpartition(".")[0], self.together[m.rpartition(".")[2]])
                  for m in {n.rpartition(".")[0] for n in adapters}}
        for parent, group in sorted(loaded):
            for leaf in group:
                module = f"{parent}.{leaf}"
                for param, base in self.bases.get(module, {}).items():
                    a, b = adapters.get(f"{module}.lora_A"), adapters.get(f"{module}.lora_B")
                    if param == "weight" and a is not None and b is not None:
                        base = _merge(base, a, b, self.scale)
                    yield f"{module}.{param}", base


class WithoutAdapters:
    """The base model of an adapted model, as a callable: `model`'s forward (a DeepSpeed engine's,
    say, whose `.module` holds the adapters) with every adapter switched off for the call. The
    reference policy of a LoRA run, without a second copy of the weights. It sets peft's switch
    itself rather than through `enable_adapters`, which would also stop the adapters training."""

    def __init__(self, model):
        from peft.tuners.lora import LoraLayer

        self.model = model
        self.layers = [m for m in getattr(model, "module", model).modules() if isinstance(m, LoraLayer)]

    def __call__(self, *args, **kwargs):
        for layer in self.layers:
            layer._disable_adapters = True
        try:
            return self.model(*args, **kwargs)
        finally:
            for layer in self.layers:
                layer._disable_adapters = False


def save_adapters(model: torch.nn.Module, state: dict[str, torch.Tensor], out: Path) -> None:
    """The adapters of `state` (the model's whole state, gathered under ZeRO-3) in peft's format
    (`adapter_model.safetensors`, `adapter_config.json`), which
    `peft.PeftModel.from_pretrained(base_model, out)` loads."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    adapters = {_PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."): t.detach().cpu().contiguous()
                for name, t in state.items() if is_adapter(name)}
    save_file(adapters, out / "adapter_model.safetensors")
    model.peft_config[ADAPTER].save_pretrained(str(out))


def load_adapters(model: torch.nn.Module, directory: Path) -> None:
    """Set the adapters of `model` (wrapped by `wrap`) to those `save_adapters` wrote in `directory`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(directory / "adapter_model.safetensors")
    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in saved.items()}
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if _A in k or _B in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{directory}: adapters that do not fit update.lora (missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]})")
