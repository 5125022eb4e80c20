"""Loading new weights into a running vLLM engine, from inside its workers.

vLLM mixes this class into each of its workers (`worker_extension_cls`), and the generator calls
its methods with `llm.collective_rpc(name, ...)`: every worker (one per tensor-parallel rank)
opens the run's weight-sync transport once (hpcrl.transports; for a process group it joins the
group as its own receiver), then, per update, takes the whole state dict through it and feeds
it as one stream to vLLM's layer-wise in-place reload, which shards, fuses (q/k/v, gate/up) and
repacks as at load time. One reload call per update, never one per chunk: a chunk that splits a
fused parameter would corrupt it silently (the reload's last step processes a partly loaded
layer as it is, logging that at debug level only).

On CPU, for an unquantized model, each worker loads directly instead (`DirectLoad`): vLLM's CPU
linear layers pack their weight for oneDNN and drop it, which is what makes the layer-wise reload
restore every layer's tensors and process it again on each sync, in generic Python (11 ms for the
demo's 2 layers, against 5 ms; tools/bench_engine_load.py). For the load, the worker gives each
such layer a weight in vLLM's own layout again (from the metadata vLLM recorded for its reload),
runs the model's `load_weights` (vLLM's name mapping, fusing and sharding) straight into the live
tensors, packs again exactly the layers (and experts) it wrote, and drops those weights again:
during a load the engine holds its linear weights twice, packed and plain.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import replace

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights", which its reload logs on every sync for each
    layer no checkpoint holds weights of (`quiet_layers`). Every other layer's still reaches the
    log; the probe after each sync checks what the engine computes either way."""

    def __init__(self, layers: frozenset[str]):
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        layer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (record.msg == "%s: Failed to load weights" and layer in self.layers)


def quiet_layers(model) -> frozenset[str]:
    """The class names of the layers whose own tensors no checkpoint holds: buffers only (a rotary
    cache, an embedding scale) or parameters all shared with another layer (a tied head, sent once
    as the embedding and refreshed by `refresh_cpu_copies`); none that any layer of its own has."""
    owners = collections.Counter(id(p) for m in model.modules() for p in m._parameters.values()
                                 if p is not None)
    quiet, loud = set(), set()
    for module in model.modules():
        own = [p for p in module._parameters.values() if p is not None]
        (quiet if all(owners[id(p)] > 1 for p in own) else loud).add(type(module).__name__)
    return frozenset(quiet - loud)


class WeightReceiver:
    """Methods added to vLLM's worker (`self` is the worker; `self.model_runner` holds the model)."""

    def hpcrl_open_sync(self, setup: dict, engine: int = 0) -> int:
        """Open the load side of the transport `setup` names (hpcrl.transports.SyncSetup);
        returns this worker's rank in the weight-sync group."""
        from hpcrl import transports

        model = self.model_runner.get_model()
        reload_log = logging.getLogger(RELOAD_LOGGER)  # this engine's filter, in place of an earlier one's
        for old in [f for f in reload_log.filters if isinstance(f, ExpectedReloadWarnings)]:
            reload_log.removeFilter(old)
        reload_log.addFilter(ExpectedReloadWarnings(quiet_layers(model)))
        tp_rank = getattr(self, "rank", 0) or 0
        device = str(self.device) if setup.get("backend") == "nccl" else "cpu"
        self._hpcrl_transport = transports.make(setup)
        self._hpcrl_transport.open_receiver(engine, tp_rank, device)
        self._hpcrl_direct = DirectLoad.of(model, self.vllm_config.model_config.quantization)
        self._hpcrl_merger = None
        if setup.get("lora_scale"):  # the trainer sends LoRA adapters apart (hpcrl.lora)
            from hpcrl.lora import Merger

            packed = getattr(model, "packed_modules_mapping", {}) or {}
            self._hpcrl_merger = Merger(setup["lora_scale"], setup["lora_targets"], packed)
        return self._hpcrl_transport.setup.layout.rank(engine, tp_rank)

    def hpcrl_close_sync(self) -> None:
        """Close the load side of the transport (at the end of the run)."""
        self._hpcrl_transport.close()

    def hpcrl_load_weights(self, handoff: dict) -> dict:
        """Receive one full set of weights (hpcrl.transports.Handoff) and load it in place; what it
        received, how long it took, and whether it loaded directly (`DirectLoad`)."""
        from hpcrl import transports
        from hpcrl.transports import Handoff

        t0 = time.perf_counter()
        received = {"bytes": 0, "tensors": 0}

        handoff = Handoff(**handoff)
        transport = self._hpcrl_transport
        if handoff.transport != transport.name:  # another source (a saved version) of this one load
            transport = transports.make(replace(transport.setup, transport=handoff.transport))

        def stream():
            for name, tensor in transport.receive(handoff):
                received["bytes"] += tensor.numel() * tensor.element_size()
                received["tensors"] += 1
                yield name, tensor

        weights = stream()
        if self._hpcrl_merger is not None and transport is self._hpcrl_transport:  # not a saved version
            weights = self._hpcrl_merger(weights)
        model = self.model_runner.get_model()
        if self._hpcrl_direct is not None:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):
                self._hpcrl_direct(model, weights)
        else:
            self.reload_weights(weights_iterator=weights)  # the worker's: under its vLLM config context
            refresh_cpu_copies(model)
        transport.verify(handoff)  # nothing it read was rewritten before it was loaded
        return {**received, "seconds": time.perf_counter() - t0, "direct": self._hpcrl_direct is not None}


class DirectLoad:
    """A CPU worker's load straight into its model's live tensors (module docstring); `of` gives
    it for a model where it applies, None elsewhere (GPUs; quantized models; a layer whose weight
    processing is not vLLM's unquantized one), where the layer-wise reload runs."""

    PLAIN = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"})

    def __init__(self, gemms: list, dropped: dict):
        self.gemms = gemms  # the layers vLLM prepared a CPU GEMM for
        self.dropped = dropped  # of those, each that dropped its weight: the weight, as vLLM recorded it

    @classmethod
    def of(cls, model, quantization) -> DirectLoad | None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        if quantization is not None or next(model.parameters()).device.type != "cpu":
            return None
        methods = [getattr(m, "quant_method", None) for m in model.modules()]
        if any(q is not None and type(q).__name__ not in cls.PLAIN for q in methods):
            return None
        gemms = [m for m in model.modules()
                 if hasattr(m, "cpu_linear") and not getattr(m, "_cpu_skip_gemm_dispatch", False)]
        dropped = {m: LAYERWISE_INFO[m].restore_metadata[0].get("weight") if m in LAYERWISE_INFO else None
                   for m in gemms if m.weight.numel() == 0}
        if any(meta is None for meta in dropped.values()):
            return None
        return cls(gemms, {m: restore_layer_refs(meta, m) for m, meta in dropped.items()})

    def __call__(self, model, weights) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

        kept = {layer: layer.weight for layer in self.dropped}  # the empty weights their GEMMs replaced
        for layer, meta in self.dropped.items():  # each a weight to load into, for this load only
            weight = materialize_meta_tensor(meta)
            weight.weight_loader = _get_original_loader(weight)
            layer.weight = weight
        try:
            names = model.load_weights(weights)
            written = {id(p) for n, p in model.named_parameters() if names is None or n in names}
            for layer in self.gemms:  # packed (and dropped again) as at load time
                if id(layer.weight) in written:
                    dispatch_cpu_unquantized_gemm(layer, remove_weight=layer in self.dropped)
            for layer in model.modules():
                if id(getattr(layer, "w13_weight", None)) in written:
                    _repack_experts(layer)
        finally:  # a layer the load did not write keeps its packed weight
            for layer, empty in kept.items():
                if layer.weight.numel():
                    layer.weight = empty


def refresh_cpu_copies(model) -> int:
    """On CPU, prepare again what vLLM derived from reloaded weights (module docstring): the GEMM
    of every layer that shares its weight with another (a tied lm_head), and the packed weights of
    every MoE layer. Returns the layers refreshed."""
    import torch

    if next(model.parameters()).device.type != "cpu":
        return 0
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    refreshed = 0
    for modules in owners.values():
        for module in modules if len(modules) > 1 else ():
            module.quant_method.process_weights_after_loading(module)
            refreshed += 1
    for module in model.modules():
        refreshed += _repack_experts(module)
    return refreshed


def _repack_experts(layer) -> int:
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
        return 0
    size = experts.moe_config.intermediate_size_per_partition
    if experts._padded_intermediate_size(experts.moe_config) != size:
        raise NotImplementedError(f"reloading MoE weights whose intermediate size vLLM's CPU kernel pads "
                                  f"({size}) is not supported; use a multiple of 32")
    for name in ("w13_weight", "w2_weight"):
        weight = getattr(layer, name)
        weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
    return 1
