"""The worker extension's own logic (hpcrl.vllm_ext) without an engine; the loads themselves are
tested against real vLLM in tests/test_families.py."""

from __future__ import annotations

import logging

import torch

from hpcrl import vllm_ext


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.zeros(4))


class Head(torch.nn.Linear):
    pass


def _model(tied: bool) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(8, 4)
    model.rotary = Rotary()
    model.proj = torch.nn.Linear(4, 4)
    model.head = Head(4, 8, bias=False)
    if tied:
        model.head.weight = model.embed.weight
    return model


def test_only_layers_without_tensors_of_their_own_are_quiet():
    """A buffer-only layer and a head tied to the embedding hold nothing a checkpoint sends; a head
    with its own weight, and any class some layer of which owns a weight, does."""
    assert {"Rotary", "Head"} <= vllm_ext.quiet_layers(_model(tied=True))
    untied = vllm_ext.quiet_layers(_model(tied=False))
    assert "Rotary" in untied and not {"Head", "Linear", "Embedding"} & untied


def _record(layer: str, msg: str = "%s: Failed to load weights") -> logging.LogRecord:
    return logging.LogRecord(vllm_ext.RELOAD_LOGGER, logging.WARNING, __file__, 1, msg, (layer,), None)


def test_the_filter_drops_the_reload_warning_of_quiet_layers_only():
    keep = vllm_ext.ExpectedReloadWarnings(frozenset({"Rotary", "Head"}))
    assert not keep.filter(_record("Rotary")) and not keep.filter(_record("Head"))
    assert keep.filter(_record("Linear"))  # a layer that should have loaded: still logged
    assert keep.filter(_record("Rotary", "%s: Delayed processing"))  # another message of a quiet layer


class Method:  # a layer's quant_method: vLLM matches them by class name
    pass


def _gemm(n: int, k: int, method: str = "UnquantizedLinearMethod") -> torch.nn.Linear:
    layer = torch.nn.Linear(k, n, bias=False)
    layer.quant_method = type(method, (Method,), {})()
    layer.cpu_linear = torch.nn.functional.linear  # as vLLM's CPU GEMM dispatch leaves it
    return layer


def test_a_direct_load_applies_only_to_unquantized_layers_whose_weight_vllm_kept_or_recorded():
    model = torch.nn.Sequential(_gemm(4, 4), _gemm(4, 4, "UnquantizedEmbeddingMethod"))
    assert vllm_ext.DirectLoad.of(model, None).gemms == list(model)
    assert vllm_ext.DirectLoad.of(model, "fp8") is None  # a quantized model: the layer-wise reload
    assert vllm_ext.DirectLoad.of(torch.nn.Sequential(_gemm(4, 4, "Fp8LinearMethod")), None) is None
    dropped = _gemm(4, 4)
    dropped.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # packed, with nothing recorded
    assert vllm_ext.DirectLoad.of(torch.nn.Sequential(dropped), None) is None


class Loaded(torch.nn.Module):
    """A model whose `load_weights` writes the named weights only, as vLLM's does; `a` and `b` dropped
    their weights as vLLM's CPU linear layers do once packed (recorded first, as vLLM records them)."""

    def __init__(self):
        from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

        super().__init__()
        self.a, self.b = _gemm(4, 4), _gemm(4, 4)
        self.embed = _gemm(4, 4, "UnquantizedEmbeddingMethod")
        self.head = _gemm(4, 4, "UnquantizedEmbeddingMethod")
        self.head.weight = self.embed.weight  # tied
        record_metadata_for_reloading(self)
        for layer in (self.a, self.b):
            layer.weight = _empty()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        return {name for name, _ in weights}


def _empty() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(0), requires_grad=False)


def test_a_direct_load_packs_again_exactly_the_layers_it_wrote(monkeypatch):
    """A sync may carry part of the weights (LoRA adapters' layers); a layer it did not write keeps
    its packed weight: packing it again would pack garbage (experts: pack them twice). A layer
    that dropped its weight drops it again once packed."""
    from vllm.model_executor.layers import utils

    packed = []

    def dispatch(layer, remove_weight):
        packed.append((layer, remove_weight, layer.weight.detach().clone()))
        if remove_weight:
            layer.weight = _empty()

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", dispatch)
    model = Loaded()
    b = model.b.weight
    load = vllm_ext.DirectLoad.of(model, None)
    assert set(load.dropped) == {model.a, model.b}
    load(model, [("a.weight", torch.ones(4, 4)), ("embed.weight", torch.full((4, 4), 2.0))])
    assert [(layer, drop) for layer, drop, _ in packed] == [(model.a, True), (model.embed, False),
                                                            (model.head, False)]
    assert torch.equal(packed[0][2], torch.ones(4, 4)) and torch.equal(packed[2][2], torch.full((4, 4), 2.0))
    assert model.a.weight.numel() == 0 and model.b.weight is b  # dropped again; untouched
    packed.clear()
    load(model, [("b.weight", torch.ones(4, 4))])
    assert [layer for layer, _, _ in packed] == [model.b] and model.a.weight.numel() == 0
