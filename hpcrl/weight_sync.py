"""Moving policy weights from the trainer to generators: the mechanisms, and the sync probe.

- process group: a dedicated torch.distributed group (gloo on CPU, NCCL for CUDA tensors) built
  from its own TCPStore, so it never touches the trainer's default group; tensors travel in
  buckets of up to `bucket_bytes` (0: one broadcast per tensor), preceded by a small header
  (names, dtypes, shapes). Every call has a timeout.
- shared memory (same node): the sender copies the tensors into one buffer (a memfd) that both
  sides map; the receiver reads them in place. One memory copy per side and no
  socket: on CPU several times faster than gloo over loopback (tools/bench_weight_sync.py).
- filesystem: the sender writes safetensors into a directory, the receiver reads them back.

The receiver yields (name, tensor) pairs in the sender's order. hpcrl.transports wraps each
mechanism in the one interface the resident mode uses; hpcrl.vllm_ext loads them into a running
vLLM engine. After every sync, `check_probe` compares the engine's logprobs on a fixed probe batch
with the trainer's. No stage logic here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.distributed import tcp_store

Named = tuple[str, torch.Tensor]


def make_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 300):
    """A gloo process group of its own (rank 0 sends and hosts the store); returns (group, store)."""
    store = tcp_store(host, port, world_size, rank == 0, timeout_s)
    return group_on(store, rank, world_size, timeout_s), store


def group_on(store, rank: int, world_size: int, timeout_s: float = 300, backend: str = "gloo"):
    """The weight-sync group over an existing store: gloo, or NCCL for CUDA tensors."""
    prefixed = dist.PrefixStore("hpcrl-weights", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def _buckets(tensors: list[Named], bucket_bytes: int) -> list[list[Named]]:
    if bucket_bytes <= 0:
        return [[t] for t in tensors]
    out: list[list[Named]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if out[-1] and (size + nbytes > bucket_bytes or t.dtype != out[-1][0][1].dtype):
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return out


def _broadcast_bytes(pg, payload: bytes | None, rank: int, device: str = "cpu") -> bytes:
    length = torch.tensor([len(payload) if rank == 0 else 0], dtype=torch.int64, device=device)
    pg.broadcast(length, 0).wait()
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if rank == 0 else torch.empty(
        int(length.item()), dtype=torch.uint8, device=device)
    pg.broadcast(buf, 0).wait()
    return bytes(buf.cpu().numpy())


class ProcessGroupSync:
    """Broadcast of named tensors from rank 0 to every other rank of `pg`."""

    def __init__(self, pg, rank: int, bucket_bytes: int = 64 << 20, device: str = "cpu"):
        self.pg, self.rank, self.bucket_bytes, self.device = pg, rank, bucket_bytes, device

    def send(self, tensors: Iterable[Named]) -> int:
        """Rank 0: send all tensors; returns the bytes sent."""
        tensors = [(n, t.detach().contiguous()) for n, t in tensors]
        buckets = _buckets(tensors, self.bucket_bytes)
        header = [[(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in b] for b in buckets]
        _broadcast_bytes(self.pg, json.dumps(header).encode(), self.rank, self.device)
        sent = 0
        for bucket in buckets:
            flat = (bucket[0][1].reshape(-1) if len(bucket) == 1
                    else torch.cat([t.reshape(-1) for _, t in bucket]))
            self.pg.broadcast(flat, 0).wait()
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self) -> Iterator[Named]:
        """Other ranks: the tensors, in the sender's order."""
        header = json.loads(_broadcast_bytes(self.pg, None, self.rank, self.device))
        for bucket in header:
            dtype = getattr(torch, bucket[0][1])
            sizes = [int(torch.Size(shape).numel()) for _, _, shape in bucket]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            self.pg.broadcast(flat, 0).wait()
            offset = 0
            for (name, _, shape), n in zip(bucket, sizes, strict=True):
                yield name, flat[offset: offset + n].view(shape)
                offset += n


class FilesystemSync:
    """The fallback: safetensors written by the sender, read by the receiver."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    def send(self, tensors: Iterable[Named]) -> int:
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        state, seen = {}, set()
        for n, t in tensors:  # tied parameters go under each name; safetensors wants separate storage
            t = t.detach().contiguous()
            state[n] = t.clone() if t.data_ptr() in seen else t
            seen.add(t.data_ptr())
        tmp = self.dir / "weights.safetensors.tmp"
        save_file(state, str(tmp))
        tmp.replace(self.dir / "weights.safetensors")
        return sum(t.numel() * t.element_size() for t in state.values())

    def receive(self) -> Iterator[Named]:
        from safetensors.torch import load_file

        yield from load_file(str(self.dir / "weights.safetensors")).items()


ALIGN = 64  # bytes; every tensor in the shared buffer starts on a cache line


class SharedMemorySync:
    """Same-node transport through one shared buffer: an anonymous memory file (memfd) of the
    sender, created on the first send and rewritten in place afterwards, which the receiver maps
    through /proc/<sender pid>/fd. The header (name, dtype, shape, byte offset) travels beside
    it. Nothing is left behind, whichever side dies: the memory goes with the last process that
    maps it. The buffer is rewritten only while the receiver does not read it (the resident loop
    alternates the two)."""

    def __init__(self):
        if not hasattr(os, "memfd_create"):
            raise RuntimeError("shared-memory weight sync needs Linux (memfd); use "
                               "weight_sync = \"process_group\"")
        self.path: str | None = None
        self.buffer: torch.Tensor | None = None

    def send(self, tensors: Iterable[Named]) -> tuple[int, list]:
        """Copy the tensors into the buffer; returns (bytes, header). A tensor seen twice (tied
        parameters) is stored once, under both names."""
        header, slots, offset, seen = [], [], 0, {}
        for name, t in tensors:
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key not in seen:
                seen[key] = offset
                slots.append((t, offset))
                offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            header.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), seen[key]])
        if self.buffer is None:
            fd = os.memfd_create("hpcrl-weights")  # open for the life of this process
            os.ftruncate(fd, max(offset, 1))
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
            self.buffer = torch.from_file(self.path, shared=True, size=max(offset, 1), dtype=torch.uint8)
        elif offset > self.buffer.numel():
            raise ValueError(f"the weights grew from {self.buffer.numel()} to {offset} bytes since the "
                             "first sync")
        for t, start in slots:
            _slot(self.buffer, start, t.dtype, t.shape).copy_(t.detach())
        return sum(t.numel() * t.element_size() for t, _ in slots), header

    @staticmethod
    def map(path: str, header: list) -> torch.Tensor:
        """The receiver's mapping of the sender's buffer."""
        end = max((start + torch.Size(shape).numel() * getattr(torch, dtype).itemsize
                   for _, dtype, shape, start in header), default=1)
        buffer = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
        if buffer.numel() < end:
            raise WeightSyncError(f"the shared weight buffer {path} holds {buffer.numel()} bytes, the header "
                                  f"needs {end}")
        return buffer

    @staticmethod
    def receive(buffer: torch.Tensor, header: list) -> Iterator[Named]:
        """Views into the mapped buffer, in the sender's order (valid until the next send)."""
        for name, dtype, shape, start in header:
            yield name, _slot(buffer, start, getattr(torch, dtype), shape)


def _slot(buffer: torch.Tensor, start: int, dtype: torch.dtype, shape) -> torch.Tensor:
    n = torch.Size(shape).numel() * dtype.itemsize
    return buffer[start: start + n].view(dtype).view(shape)


class WeightSyncError(RuntimeError):
    """The generator's weights do not match the trainer's after a sync."""


def probe_tolerance(sync_check_tol: float, dtype: str) -> float:
    """Largest accepted mean |logprob difference| on the probe batch: `executor.resident.sync_check_tol`
    when set, else by the weights' dtype."""
    if sync_check_tol:
        return sync_check_tol
    return 1e-4 if dtype == "float32" else 2e-2


def _mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    flat_a = torch.tensor([x for row in a for x in row], dtype=torch.float64)
    flat_b = torch.tensor([x for row in b for x in row], dtype=torch.float64)
    if flat_a.shape != flat_b.shape:
        raise WeightSyncError(f"probe logprobs differ in shape: {tuple(flat_a.shape)} vs "
                              f"{tuple(flat_b.shape)}")
    return float((flat_a - flat_b).abs().mean()) if flat_a.numel() else 0.0


def check_probe(engine: list[list[float]], trainer_new: list[list[float]], trainer_old: list[list[float]],
                tol: float, version: int) -> dict[str, float]:
    """Compare the generator's probe logprobs with the trainer's after the update (`new`) and
    before it (`old`). Fails when they differ by more than `tol`, or when the engine is closer
    to the old weights than to the new ones although the update moved the probe by more than
    `tol` (a skipped or partial sync). Returns the sync/* metrics."""
    diff_new = _mean_abs_diff(engine, trainer_new)
    diff_old = _mean_abs_diff(engine, trainer_old)
    shift = _mean_abs_diff(trainer_new, trainer_old)
    metrics = {"sync/logp_diff": diff_new, "sync/logp_diff_prev": diff_old, "sync/update_shift": shift}
    if not math.isfinite(shift) or not math.isfinite(diff_new):
        raise WeightSyncError(f"after loading policy version {version}, the probe logprobs are not finite "
                              f"(trainer: {'finite' if math.isfinite(shift) else 'non-finite'}, difference "
                              f"{diff_new}); stopping rather than serving a non-finite policy")
    if diff_new > tol:
        stale = " (it matches the previous weights: the sync did not happen)" if diff_old < diff_new else ""
        raise WeightSyncError(f"after loading policy version {version}, vLLM's logprobs on the probe batch "
                              f"differ from the trainer's by {diff_new:.2e} on average, above the tolerance "
                              f"{tol:.0e} (executor.resident.sync_check_tol){stale}; stopping rather than "
                              "training on stale or corrupted weights")
    if shift > tol and diff_old <= diff_new:
        raise WeightSyncError(f"after loading policy version {version}, vLLM matches the previous weights "
                              f"({diff_old:.2e}) at least as well as the new ones ({diff_new:.2e}): the sync "
                              "did not take effect")
    return metrics
