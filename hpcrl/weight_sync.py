"""Moving policy weights from the trainer to generators: the mechanisms, and the sync probe.

- process group: a dedicated torch.distributed group (gloo on CPU, NCCL for CUDA tensors) built
  from its own TCPStore, so it never touches the trainer's default group; tensors travel in
  buckets of up to `bucket_bytes` (0: one broadcast per tensor), preceded by a small header
  (names, dtypes, shapes). Every call has a timeout.
- shared memory (same node): the sender copies the tensors into one buffer (a memfd) that both
  sides map; the receiver reads them in place. One memory copy per side and no
  socket: on CPU several times faster than gloo over loopback (tools/bench_weight_sync.py).
- filesystem: the sender writes safetensors shards into a directory, the receiver reads them back.

Every mechanism reads the tensors it sends as a stream (hpcrl.checkpoint_view yields a model
layer by layer), so the sender never holds a second copy of the whole model.

The buffer and the directory are rewritten in place by the next send: each send carries a stamp
(`Stamp`), odd while it is written and even once whole, and a receiver checks it before it reads
and after its engine has loaded (`check`), so a load that a later send overtakes fails loudly
instead of mixing two versions' weights.

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


def buckets(tensors: Iterable[Named], bucket_bytes: int, same_dtype: bool = True) -> Iterator[list[Named]]:
    """The tensors in consecutive groups of up to `bucket_bytes` (0: one tensor each; a tensor
    larger than a bucket goes alone), of one dtype each when `same_dtype`; read lazily, so a
    stream of tensors is never held whole."""
    bucket: list[Named] = []
    size = 0
    for name, t in tensors:
        t = t.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        if bucket and (bucket_bytes <= 0 or size + nbytes > bucket_bytes
                       or (same_dtype and t.dtype != bucket[0][1].dtype)):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def _broadcast_bytes(pg, payload: bytes | None, rank: int, device: str = "cpu") -> bytes:
    length = torch.tensor([len(payload) if rank == 0 else 0], dtype=torch.int64, device=device)
    pg.broadcast(length, 0).wait()
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if rank == 0 else torch.empty(
        int(length.item()), dtype=torch.uint8, device=device)
    pg.broadcast(buf, 0).wait()
    return bytes(buf.cpu().numpy())


class ProcessGroupSync:
    """Broadcast of named tensors from rank 0 to every other rank of `pg`, bucket by bucket: each
    bucket's header (names, dtypes, shapes), then its tensors as one flat buffer; an empty header
    ends the stream. The sender never holds more than one bucket."""

    def __init__(self, pg, rank: int, bucket_bytes: int = 64 << 20, device: str = "cpu"):
        self.pg, self.rank, self.bucket_bytes, self.device = pg, rank, bucket_bytes, device

    def send(self, tensors: Iterable[Named]) -> int:
        """Rank 0: send all tensors; returns the bytes sent."""
        sent = 0
        for bucket in buckets(tensors, self.bucket_bytes):
            header = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in bucket]
            _broadcast_bytes(self.pg, json.dumps(header).encode(), self.rank, self.device)
            flat = (bucket[0][1].reshape(-1) if len(bucket) == 1
                    else torch.cat([t.reshape(-1) for _, t in bucket]))
            self.pg.broadcast(flat.to(self.device), 0).wait()
            sent += flat.numel() * flat.element_size()
        _broadcast_bytes(self.pg, b"[]", self.rank, self.device)
        return sent

    def receive(self) -> Iterator[Named]:
        """Other ranks: the tensors, in the sender's order (read it to the end: the sender waits)."""
        while bucket := json.loads(_broadcast_bytes(self.pg, None, self.rank, self.device)):
            dtype = getattr(torch, bucket[0][1])
            sizes = [int(torch.Size(shape).numel()) for _, _, shape in bucket]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            self.pg.broadcast(flat, 0).wait()
            offset = 0
            for (name, _, shape), n in zip(bucket, sizes, strict=True):
                yield name, flat[offset: offset + n].view(shape)
                offset += n


class FilesystemSync:
    """The fallback: safetensors shards of up to `shard_bytes` written by the sender (then an index
    naming them, replaced atomically), read back shard by shard by the receiver."""

    INDEX = "weights.json"

    def __init__(self, directory: str | Path, shard_bytes: int = 1 << 30):
        self.dir, self.shard_bytes = Path(directory), shard_bytes

    def send(self, tensors: Iterable[Named]) -> tuple[int, int]:
        """Write the tensors; returns (bytes, the send's stamp)."""
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        stamp = Stamp.next(self.stamp())
        self._write_index({"stamp": stamp - 1})  # being written: no shard list to read
        shards, nbytes = [], 0
        for i, shard in enumerate(buckets(tensors, self.shard_bytes, same_dtype=False)):
            name = f"weights-{i:05d}.safetensors"
            # a copy each: safetensors refuses tensors that share memory (views of one fused weight)
            save_file({n: t.clone() for n, t in shard}, str(self.dir / f"{name}.tmp"))
            (self.dir / f"{name}.tmp").replace(self.dir / name)
            shards.append(name)
            nbytes += sum(t.numel() * t.element_size() for _, t in shard)
        self._write_index({"shards": shards, "stamp": stamp})
        for stale in set(p.name for p in self.dir.glob("weights-*.safetensors")) - set(shards):
            (self.dir / stale).unlink()
        return nbytes, stamp

    def _write_index(self, index: dict) -> None:
        (self.dir / f"{self.INDEX}.tmp").write_text(json.dumps(index))
        (self.dir / f"{self.INDEX}.tmp").replace(self.dir / self.INDEX)

    def stamp(self) -> int:
        """The stamp of what the directory holds (0: nothing sent yet)."""
        index = self.dir / self.INDEX
        return json.loads(index.read_text()).get("stamp", 0) if index.is_file() else 0

    def receive(self, stamp: int | None = None) -> Iterator[Named]:
        """The tensors of the send stamped `stamp` (when given: checked first)."""
        from safetensors.torch import load_file

        if stamp is not None:
            Stamp.check(self.stamp(), stamp, str(self.dir))
        for name in json.loads((self.dir / self.INDEX).read_text())["shards"]:
            yield from load_file(str(self.dir / name)).items()


class Stamp:
    """A send's stamp: 2n - 1 while send n is written, 2n once it is whole."""

    @staticmethod
    def next(current: int) -> int:
        """The stamp of the send after the one stamped `current` (an interrupted one counts)."""
        return 2 * (current // 2 + current % 2 + 1)

    @staticmethod
    def check(found: int, expected: int, where: str) -> None:
        if found == expected:
            return
        state = "is being written" if found % 2 else "is whole"
        raise WeightSyncError(f"{where}: the weights were rewritten under their reader: it holds send "
                              f"{(found + 1) // 2}, which {state}, where send {expected // 2} was to be "
                              "read; the sender must not send again before every engine has loaded "
                              "(loaded/<n>)")


ALIGN = 64  # bytes; every tensor in the shared buffer starts on a cache line


class SharedMemorySync:
    """Same-node transport through one shared buffer: an anonymous memory file (memfd) of the
    sender, created on the first send, grown when a send needs more, and rewritten in place,
    which the receiver maps through /proc/<sender pid>/fd. The header (name, dtype, shape, byte
    offset) travels beside it. Nothing is left behind, whichever side dies: the memory goes with
    the last process that maps it. The buffer is rewritten only while the receiver does not read
    it (the resident loop alternates the two)."""

    def __init__(self):
        if not hasattr(os, "memfd_create"):
            raise RuntimeError("shared-memory weight sync needs Linux (memfd); use "
                               "weight_sync = \"process_group\"")
        self.path: str | None = None
        self.fd: int | None = None
        self.buffer: torch.Tensor | None = None

    def send(self, tensors: Iterable[Named]) -> tuple[int, list, int]:
        """Copy the tensors into the buffer, one at a time, after its stamp (the first ALIGN
        bytes); returns (bytes, header, the send's stamp)."""
        self._reserve(ALIGN)
        stamp = Stamp.next(self.stamp_of(self.buffer))
        self._stamp(stamp - 1)  # being written
        header, offset, nbytes = [], ALIGN, 0
        for name, t in tensors:
            size = t.numel() * t.element_size()
            self._reserve(offset + size)
            _slot(self.buffer, offset, t.dtype, t.shape).copy_(t.detach())
            header.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
            offset += -(-size // ALIGN) * ALIGN
            nbytes += size
        self._stamp(stamp)
        return nbytes, header, stamp

    def _stamp(self, stamp: int) -> None:
        self.buffer[:8].view(torch.int64)[0] = stamp

    @staticmethod
    def stamp_of(buffer: torch.Tensor) -> int:
        return int(buffer[:8].view(torch.int64)[0])

    def _reserve(self, end: int) -> None:
        """A buffer of at least `end` bytes (grown by doubling; the receiver maps it again)."""
        if self.buffer is not None and end <= self.buffer.numel():
            return
        if self.fd is None:
            self.fd = os.memfd_create("hpcrl-weights")  # open for the life of this process
            self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        size = max(end, 2 * (self.buffer.numel() if self.buffer is not None else 0), 1 << 16)
        os.ftruncate(self.fd, size)
        self.buffer = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)

    @staticmethod
    def end(header: list) -> int:
        """The bytes of the buffer a header reads."""
        return max((start + torch.Size(shape).numel() * getattr(torch, dtype).itemsize
                    for _, dtype, shape, start in header), default=1)

    @staticmethod
    def map(path: str, header: list) -> torch.Tensor:
        """The receiver's mapping of the sender's buffer."""
        buffer = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
        if buffer.numel() < SharedMemorySync.end(header):
            raise WeightSyncError(f"the shared weight buffer {path} holds {buffer.numel()} bytes, the header "
                                  f"needs {SharedMemorySync.end(header)}")
        return buffer

    @staticmethod
    def receive(buffer: torch.Tensor, header: list, stamp: int | None = None) -> Iterator[Named]:
        """Views into the mapped buffer, in the sender's order (valid until the next send); the
        send stamped `stamp` (when given: checked first)."""
        if stamp is not None:
            Stamp.check(SharedMemorySync.stamp_of(buffer), stamp, "the shared weight buffer")
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
    return 1e-4 if dtype == "float32" else 1e-1  # 16-bit: ~4x the largest measured (tools/calibrate_probe.py)


def _mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    flat_a = torch.tensor([x for row in a for x in row], dtype=torch.float64)
    flat_b = torch.tensor([x for row in b for x in row], dtype=torch.float64)
    if flat_a.shape != flat_b.shape:
        raise WeightSyncError(f"probe logprobs differ in shape: {tuple(flat_a.shape)} vs "
                              f"{tuple(flat_b.shape)}")
    return float((flat_a - flat_b).abs().mean()) if flat_a.numel() else 0.0


def check_probe(engine: list[list[float]], trainer_new: list[list[float]], trainer_old: list[list[float]],
                tol: float, version: int, noise: float | None = None) -> dict[str, float]:
    """Compare the generator's probe logprobs with the trainer's after the update (`new`) and
    before it (`old`). Fails when they differ by more than `tol`, or when the engine is no closer
    to the new weights than to the old ones although the update moved the probe beyond what the
    two can tell apart (a skipped or partial sync): beyond 4 x `noise`, the difference the two
    showed holding the same weights (the start probe), or beyond `tol` when not measured. So an
    update smaller than the tolerance (lr 1e-6) is still seen to arrive. Returns the sync/* metrics."""
    diff_new = _mean_abs_diff(engine, trainer_new)
    diff_old = _mean_abs_diff(engine, trainer_old)
    shift = _mean_abs_diff(trainer_new, trainer_old)
    metrics = {"sync/logp_diff": diff_new, "sync/logp_diff_prev": diff_old, "sync/update_shift": shift}
    if not math.isfinite(shift) or not math.isfinite(diff_new):
        raise WeightSyncError(f"after loading policy version {version}, the probe logprobs are not finite "
                              f"(trainer: {'finite' if math.isfinite(shift) else 'non-finite'}, difference "
                              f"{diff_new}); stopping rather than serving a non-finite policy")
    if diff_new > tol:
        why = (f"it still holds the previous weights ({diff_old:.2e} from them): the sync did not happen"
               if diff_old <= tol else
               f"it holds neither the new weights nor the previous ones ({diff_old:.2e} from those): weights "
               "were loaded but differ, as when the engine reads a name, shape or layout otherwise")
        raise WeightSyncError(f"after loading policy version {version}, vLLM's logprobs on the probe batch "
                              f"differ from the trainer's by {diff_new:.2e} on average, above the tolerance "
                              f"{tol:.0e} (executor.resident.sync_check_tol): {why}; stopping rather than "
                              "training on stale or corrupted weights")
    if shift > min(tol, 4 * noise if noise is not None else tol) and diff_old <= diff_new:
        raise WeightSyncError(f"after loading policy version {version}, vLLM matches the previous weights "
                              f"({diff_old:.2e}) at least as well as the new ones ({diff_new:.2e}): the sync "
                              "did not take effect")
    return metrics
