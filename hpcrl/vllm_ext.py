"""Loading new weights into a running vLLM engine, from inside its workers.

vLLM mixes this class into each of its workers (`worker_extension_cls`), and the generator calls
its methods with `llm.collective_rpc(name, ...)`: every worker (one per tensor-parallel rank)
joins the weight-sync group as its own receiver, takes the whole state dict as the trainer
broadcasts it, and feeds it as one stream to vLLM's layer-wise in-place reload, which shards,
fuses (q/k/v, gate/up) and repacks as at load time. One reload call per update, never one per
chunk: a chunk that splits a fused parameter would corrupt it silently (the reload's last step
processes a partly loaded layer as it is, logging that at debug level only).
"""

from __future__ import annotations

import time
from datetime import timedelta


class WeightReceiver:
    """Methods added to vLLM's worker (`self` is the worker; `self.model_runner` holds the model)."""

    def hpcrl_join_sync(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                        bucket_bytes: int, backend: str) -> int:
        """Connect to the run's store and join the weight-sync group; returns this worker's rank."""
        import torch.distributed as dist

        from hpcrl.weight_sync import ProcessGroupSync, group_on

        tp_rank = getattr(self, "rank", 0) or 0
        rank = first_rank + tp_rank
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        device = str(self.device) if backend == "nccl" else "cpu"
        self._hpcrl_store = store
        self._hpcrl_sync = ProcessGroupSync(group_on(store, rank, world_size, timeout_s, backend), rank,
                                            bucket_bytes, device)
        return rank

    def hpcrl_receive_weights(self) -> dict:
        """Receive one full set of weights from the trainer and load it in place."""
        t0 = time.perf_counter()
        received = {"bytes": 0, "tensors": 0}

        def stream():
            for name, tensor in self._hpcrl_sync.receive():
                received["bytes"] += tensor.numel() * tensor.element_size()
                received["tensors"] += 1
                yield name, tensor

        self.model_runner.reload_weights(weights_iterator=stream())
        return {**received, "seconds": time.perf_counter() - t0}

    def hpcrl_reload_from(self, path: str) -> dict:
        """The filesystem fallback: load the weights the trainer wrote (hpcrl.weight_sync.FilesystemSync)."""
        from hpcrl.weight_sync import FilesystemSync

        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=FilesystemSync(path).receive())
        return {"seconds": time.perf_counter() - t0}

    def hpcrl_load_shared(self, path: str, header: list) -> dict:
        """The same-node transport: load the weights from the trainer's shared buffer
        (hpcrl.weight_sync.SharedMemorySync), mapped on the first call."""
        from hpcrl.weight_sync import SharedMemorySync

        t0 = time.perf_counter()
        if getattr(self, "_hpcrl_shared", None) is None:
            self._hpcrl_shared = SharedMemorySync.map(path, header)
        self.model_runner.reload_weights(weights_iterator=SharedMemorySync.receive(self._hpcrl_shared, header))
        return {"seconds": time.perf_counter() - t0}
