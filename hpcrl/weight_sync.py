"""Moving policy weights from the trainer to generators: one small interface, two transports.

- process group: a dedicated torch.distributed group (gloo on CPU, NCCL for CUDA tensors) built
  from its own TCPStore, so it never touches the trainer's default group; tensors travel in
  buckets of up to `bucket_bytes` (0: one broadcast per tensor), preceded by a small header
  (names, dtypes, shapes). Every call has a timeout.
- filesystem: the sender writes safetensors into a directory, the receiver reads them back.

The receiver yields (name, tensor) pairs in the sender's order; loading them into a running vLLM
engine is the generator's business (the resident mode builds on this). No stage logic here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

Named = tuple[str, torch.Tensor]


def make_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 300):
    """A gloo process group of its own (rank 0 sends), independent of any default group."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore("hpcrl-weights", store)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout_s)), store


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


def _broadcast_bytes(pg, payload: bytes | None, rank: int) -> bytes:
    length = torch.tensor([len(payload) if rank == 0 else 0], dtype=torch.int64)
    pg.broadcast(length, 0).wait()
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank == 0 else torch.empty(
        int(length.item()), dtype=torch.uint8)
    pg.broadcast(buf, 0).wait()
    return bytes(buf.numpy())


class ProcessGroupSync:
    """Broadcast of named tensors from rank 0 to every other rank of `pg`."""

    def __init__(self, pg, rank: int, bucket_bytes: int = 64 << 20):
        self.pg, self.rank, self.bucket_bytes = pg, rank, bucket_bytes

    def send(self, tensors: Iterable[Named]) -> int:
        """Rank 0: send all tensors; returns the bytes sent."""
        tensors = [(n, t.detach().contiguous()) for n, t in tensors]
        buckets = _buckets(tensors, self.bucket_bytes)
        header = [[(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in b] for b in buckets]
        _broadcast_bytes(self.pg, json.dumps(header).encode(), self.rank)
        sent = 0
        for bucket in buckets:
            flat = bucket[0][1].reshape(-1) if len(bucket) == 1 else torch.cat([t.reshape(-1) for _, t in bucket])
            self.pg.broadcast(flat, 0).wait()
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self) -> Iterator[Named]:
        """Other ranks: the tensors, in the sender's order."""
        header = json.loads(_broadcast_bytes(self.pg, None, self.rank))
        for bucket in header:
            dtype = getattr(torch, bucket[0][1])
            sizes = [int(torch.Size(shape).numel()) for _, _, shape in bucket]
            flat = torch.empty(sum(sizes), dtype=dtype)
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
        state = {n: t.detach().contiguous() for n, t in tensors}
        tmp = self.dir / "weights.safetensors.tmp"
        save_file(state, str(tmp))
        tmp.replace(self.dir / "weights.safetensors")
        return sum(t.numel() * t.element_size() for t in state.values())

    def receive(self) -> Iterator[Named]:
        from safetensors.torch import load_file

        yield from load_file(str(self.dir / "weights.safetensors")).items()
