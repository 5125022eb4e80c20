"""Loading new weights into a running vLLM engine, from inside its workers.

vLLM mixes this class into each of its workers (`worker_extension_cls`), and the generator calls
its methods with `llm.collective_rpc(name, ...)`: every worker (one per tensor-parallel rank)
opens the run's weight-sync transport once (hpcrl.transports; for a process group it joins the
group as its own receiver), then, per update, takes the whole state dict through it and feeds
it as one stream to vLLM's layer-wise in-place reload, which shards, fuses (q/k/v, gate/up) and
repacks as at load time. One reload call per update, never one per chunk: a chunk that splits a
fused parameter would corrupt it silently (the reload's last step processes a partly loaded
layer as it is, logging that at debug level only).
"""

from __future__ import annotations

import time


class WeightReceiver:
    """Methods added to vLLM's worker (`self` is the worker; `self.model_runner` holds the model)."""

    def hpcrl_open_sync(self, setup: dict, engine: int = 0) -> int:
        """Open the load side of the transport `setup` names (hpcrl.transports.SyncSetup);
        returns this worker's rank in the weight-sync group."""
        from hpcrl import transports

        tp_rank = getattr(self, "rank", 0) or 0
        device = str(self.device) if setup.get("backend") == "nccl" else "cpu"
        self._hpcrl_transport = transports.make(setup)
        self._hpcrl_transport.open_receiver(engine, tp_rank, device)
        return self._hpcrl_transport.setup.layout.rank(engine, tp_rank)

    def hpcrl_load_weights(self, handoff: dict) -> dict:
        """Receive one full set of weights (hpcrl.transports.Handoff) and load it in place."""
        from hpcrl.transports import Handoff

        t0 = time.perf_counter()
        received = {"bytes": 0, "tensors": 0}

        def stream():
            for name, tensor in self._hpcrl_transport.receive(Handoff(**handoff)):
                received["bytes"] += tensor.numel() * tensor.element_size()
                received["tensors"] += 1
                yield name, tensor

        self.model_runner.reload_weights(weights_iterator=stream())
        return {**received, "seconds": time.perf_counter() - t0}
