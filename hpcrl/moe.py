"""Mixture-of-experts routing in the update: the load on each expert and the auxiliary
load-balancing loss, from the router logits transformers returns with `output_router_logits`
(one [tokens, experts] tensor per MoE layer).

The loss is the Switch Transformer's, as transformers' `load_balancing_loss_func`: experts x the
sum over experts of (share of top-k assignments) x (mean router probability), over the non-padding
tokens of all MoE layers. Hugging Face experts are dropless (every token reaches its top-k
experts; there is no capacity), so no token is dropped or rerouted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def top_k(config) -> int | None:
    """Experts per token of an MoE model's config; None for a dense model."""
    k = getattr(config, "num_experts_per_tok", None)
    return k if isinstance(k, int) and k > 0 else None


def is_moe_config(cfg: dict) -> bool:
    """Whether a config.json (as a dict) describes a mixture-of-experts model."""
    text = cfg.get("text_config") or {}
    return bool(cfg.get("num_experts_per_tok") or text.get("num_experts_per_tok"))


@dataclass
class RouterLoad:
    """Routing of some tokens, per MoE layer: top-k assignments and router probability summed over
    the (weighted) tokens, and the tokens' total weight."""

    assigned: torch.Tensor  # [layers, experts]
    probs: torch.Tensor  # [layers, experts], differentiable
    tokens: torch.Tensor  # [] the summed token weights (the same in every layer)

    def __add__(self, other: RouterLoad) -> RouterLoad:
        return RouterLoad(self.assigned + other.assigned, self.probs + other.probs,
                          self.tokens + other.tokens)

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss: top-k when routing is even, up to experts x top-k when one expert
        gets every token."""
        experts = self.assigned.shape[-1]
        rows = self.tokens * self.assigned.shape[0]
        return experts * (self.assigned.sum(0) / rows * (self.probs.sum(0) / rows)).sum()


def router_load(layers: tuple[torch.Tensor, ...], weights: torch.Tensor, k: int) -> RouterLoad:
    """The routing of one forward pass: `layers` its router logits ([tokens, experts] per MoE
    layer), `weights` one weight per token ([tokens]; 0 for padding, n for a prompt that stands for
    n sequences)."""
    w = weights.reshape(-1).float()
    assigned, probs = [], []
    for logits in layers:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, k, dim=-1).indices
        hits = torch.zeros_like(p).scatter_(1, chosen, 1.0)
        assigned.append((hits * w[:, None]).sum(0).detach())
        probs.append((p * w[:, None]).sum(0))
    return RouterLoad(torch.stack(assigned), torch.stack(probs), w.sum().detach())


class RouterTally:
    """The routing of an MoE model's forward passes, from forward hooks on the modules that
    transformers itself records router logits from (the model's `_can_record_outputs`). The hooks
    record only inside `routed`, and `output_router_logits` is never passed: transformers would
    compute its own loss over the attention mask, which does not fit a pass on a KV cache."""

    def __init__(self, model, k: int):
        self.k, self.load, self._seen, self._on = k, None, [], False
        recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is None:
            raise ValueError(f"{type(model).__name__}: transformers records no router logits for this model")
        cls, self._index = getattr(recorder, "target_class", recorder), getattr(recorder, "index", 0)
        routers = [m for m in model.modules() if isinstance(m, cls)]
        if not routers:
            raise ValueError(f"{type(model).__name__}: no {cls.__name__} module to read router logits from")
        for m in routers:
            m.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        if self._on:
            self._seen.append(output[self._index] if isinstance(output, tuple | list) else output)

    def routed(self, weights: torch.Tensor, forward):
        """`forward()`, its router logits added to the tally with one weight per token."""
        self._on, self._seen = True, []
        try:
            out = forward()
        finally:
            self._on = False
        load = router_load(tuple(self._seen), weights, self.k)
        self.load = load if self.load is None else self.load + load
        return out

    def take(self) -> RouterLoad:
        load, self.load = self.load, None
        return load


def load_stats(assigned: torch.Tensor) -> dict:
    """Each expert's load relative to an even share (1.0), per layer, from [layers, experts]
    assignment totals; its maximum and minimum over layers and experts."""
    even = assigned.sum(-1, keepdim=True) / assigned.shape[-1]
    load = assigned / even.clamp(min=1e-12)
    return {"expert_load": load.tolist(), "moe_load_max": float(load.max()),
            "moe_load_min": float(load.min())}
