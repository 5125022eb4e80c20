"""The checkpoint's view of a live model: the tensors `save_pretrained` would write, streamed.

A transformers 5 model holds some weights in memory under other names and shapes than its
checkpoint (mixture-of-experts layers fuse every expert into one `mlp.experts.gate_up_proj`;
Mixtral's `block_sparse_moe` is `mlp` in memory), and a tied `lm_head.weight` is the embedding
under a second name. vLLM loads checkpoints, so the weight sync sends what the checkpoint holds:
transformers' own reverse conversion (`revert_weight_conversion`, the step `save_pretrained`
takes), with tied parameters once under the name the checkpoint keeps. No table of names is
kept here.

The tensors come layer by layer (`chunks`): a decoder layer's parameters together, as the reverse
conversions and vLLM's layer-wise reload both need, and under ZeRO-3 only one layer gathered at
a time, so memory stays bounded by a layer, never the whole model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch

from hpcrl import lora

Named = tuple[str, torch.Tensor]
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def unique_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Every parameter once: of tied names, the one the checkpoint keeps (transformers drops the
    targets of its tied-weight map, such as lm_head.weight, and keeps the source)."""
    dropped = set(getattr(model, "all_tied_weights_keys", None) or {})
    by_id: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append((name, p))
    out = []
    for names in by_id.values():
        kept = [(n, p) for n, p in names if n not in dropped] or names[:1]
        out.append(kept[0])
    return out


def layer_of(name: str) -> str:
    """The group a parameter syncs with: its decoder layer (`model.layers.3`), else itself."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def chunks(model: torch.nn.Module,
           gather: Callable[[list[torch.nn.Parameter]], AbstractContextManager] | None = None,
           form: str = "merged") -> Iterator[list[Named]]:
    """The checkpoint's tensors, one layer (or one top-level parameter) at a time, in the model's
    order. `gather(params)` makes a chunk's parameters whole while it is used (ZeRO-3); each
    chunk's tensors are valid until the next chunk is asked for.

    A model with LoRA adapters (hpcrl.lora) comes in one of three `form`s: "merged" (each adapted
    weight with its adapters merged in, as a checkpoint of the policy holds it), "wire" (the base
    weights and the adapters apart, `lora.wire`) or "adapters" (only the adapters, the layers
    without any skipped). Without adapters every form is the checkpoint's."""
    from transformers.core_model_loading import revert_weight_conversion

    scale = lora.scaling(model)
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in unique_parameters(model):
        if scale is None or form != "adapters" or lora.is_adapter(name):
            groups.setdefault(layer_of(name), []).append((name, p))
    for group in groups.values():
        with (gather or _whole)([p for _, p in group]):
            state = {name: p.data for name, p in group}
            if scale is None:
                yield list(revert_weight_conversion(model, state).items())
                continue
            if form == "merged":
                yield list(revert_weight_conversion(model, lora.merged(state, scale)).items())
                continue
            base, adapters = lora.wire(state)
            base = revert_weight_conversion(model, base) if base else {}
            yield list(base.items()) + list(adapters.items())


def tensors(model: torch.nn.Module, gather=None, copy: bool = False, form: str = "merged") -> Iterator[Named]:
    """`chunks` as one stream of tensors. With `copy`, each tensor is a copy that outlives its
    chunk (what a sender that holds tensors across chunks needs under ZeRO-3)."""
    for chunk in chunks(model, gather, form):
        for name, t in chunk:
            yield name, (t.detach().clone() if copy else t.detach())


def _whole(params: list[torch.nn.Parameter]) -> AbstractContextManager:
    return nullcontext()
