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
