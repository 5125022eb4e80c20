"""How the resident mode's weights travel from trainer 0 to the vLLM workers: one interface, a
registry of transports by name (`executor.resident.weight_sync`), and the rank arithmetic of the
weight-sync group.

A `Transport` has a send side (trainer 0: `open_sender`, then `send` per update, which returns
a `Handoff`) and a load side (inside each vLLM worker: `open_receiver`, then `receive(handoff)`
per update, which yields the tensors for vLLM's in-place reload; hpcrl.vllm_ext). A transport
that `streams` (the process group) delivers while the sender sends, so the generator starts the
load before trainer 0 replies; the others are loaded after the reply, from what the Handoff
names. The byte-moving mechanisms themselves are hpcrl.weight_sync's.

The weight-sync group (`SyncLayout`): trainer 0 is rank 0 and sends; engine e's tensor-parallel
worker t is rank 1 + e * tp + t, each its own receiver.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from hpcrl import weight_sync
from hpcrl.weight_sync import Named


@dataclass(frozen=True)
class SyncLayout:
    """The ranks of the weight-sync group: trainer 0, then `engines` x `tp` vLLM workers."""

    engines: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return 1 + self.engines * self.tp

    def rank(self, engine: int, tp_rank: int) -> int:
        if not (0 <= engine < self.engines and 0 <= tp_rank < self.tp):
            raise ValueError(f"no worker {tp_rank} of engine {engine} in {self.engines} engine(s) x "
                             f"{self.tp} rank(s)")
        return 1 + engine * self.tp + tp_rank


@dataclass(frozen=True)
class SyncSetup:
    """What both ends agree on before the first sync; sent to vLLM's workers as a dict."""

    transport: str
    host: str = ""  # the run's store (process group)
    port: int = 0
    engines: int = 1
    tp: int = 1
    timeout_s: float = 300.0
    bucket_bytes: int = 64 << 20
    backend: str = "gloo"  # nccl between GPUs
    directory: str = ""  # where the filesystem transport writes
    lora_scale: float = 0.0  # LoRA adapters: their alpha / rank (0: none; hpcrl.lora.Merger)
    lora_targets: list[str] = field(default_factory=list)

    @property
    def layout(self) -> SyncLayout:
        return SyncLayout(self.engines, self.tp)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Handoff:
    """What one sync hands the load side: the bytes sent and where to read them."""

    transport: str
    bytes: int = 0
    path: str = ""  # shared memory: the sender's buffer; filesystem: the directory
    header: list = field(default_factory=list)  # shared memory: name, dtype, shape, offset per tensor
    stamp: int = 0  # shared memory, filesystem: the send's stamp (hpcrl.weight_sync.Stamp)

    def as_dict(self) -> dict:
        return asdict(self)


class Transport(ABC):
    name: ClassVar[str]
    streams: ClassVar[bool] = False  # the load side receives while the send side sends

    def __init__(self, setup: SyncSetup):
        self.setup = setup

    def open_sender(self, store=None, device: str = "cpu") -> None:  # noqa: B027  (an optional hook)
        """Trainer 0, once before the first send (`store`: the run's store, for a process group)."""

    def open_receiver(self, engine: int, tp_rank: int,  # noqa: B027  (an optional hook)
                      device: str = "cpu") -> None:
        """A vLLM worker, once before the first load."""

    def close(self) -> None:  # noqa: B027  (an optional hook)
        """Release what `open_sender` or `open_receiver` made (each end, once, at the end of the run)."""

    @abstractmethod
    def send(self, tensors: Iterable[Named]) -> Handoff:
        """Trainer 0: the whole set of weights out, read from `tensors` as a stream (one layer's
        tensors at a time from hpcrl.checkpoint_view), never held whole."""

    @abstractmethod
    def receive(self, handoff: Handoff) -> Iterator[Named]:
        """A vLLM worker: the tensors of one sync, in the sender's order."""

    def verify(self, handoff: Handoff) -> None:  # noqa: B027  (an optional hook)
        """A vLLM worker, once its engine has loaded `handoff`: WeightSyncError if what it read was
        rewritten meanwhile (a transport that the next send rewrites in place)."""


TRANSPORTS: dict[str, type[Transport]] = {}


def register(name: str) -> Callable[[type[Transport]], type[Transport]]:
    def wrap(cls: type[Transport]) -> type[Transport]:
        cls.name = name
        TRANSPORTS[name] = cls
        return cls

    return wrap


def make(setup: SyncSetup | dict) -> Transport:
    setup = setup if isinstance(setup, SyncSetup) else SyncSetup(**setup)
    if setup.transport not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {setup.transport!r}; registered: "
                         f"{', '.join(TRANSPORTS)}")
    return TRANSPORTS[setup.transport](setup)


def choose(setting: str, trainer_host: str, engine_hosts: str | list[str], cuda: bool) -> str:
    """The transport a resident job uses (`executor.resident.weight_sync`); "auto": shared memory when
    trainer 0 and every engine share a node and the weights are on CPU, else a process group
    (NCCL between GPUs, gloo across nodes: one broadcast reaches every engine). Shared memory
    with an engine on another node is refused."""
    hosts = [engine_hosts] if isinstance(engine_hosts, str) else list(engine_hosts)
    away = [h for h in hosts if h != trainer_host]
    if setting == "auto":
        same_cpu_node = not away and not cuda and hasattr(os, "memfd_create")
        return "shared_memory" if same_cpu_node else "process_group"
    if setting == "shared_memory" and away:
        raise RuntimeError(f"executor.resident.weight_sync = \"shared_memory\" needs trainer 0 and every "
                           f"engine on one node; trainer 0 is on {trainer_host}, an engine on {away[0]}: use "
                           "\"process_group\" or \"auto\"")
    return setting


@register("process_group")
class ProcessGroupTransport(Transport):
    """Broadcast in buckets over a group of its own (hpcrl.weight_sync.ProcessGroupSync)."""

    streams = True

    def open_sender(self, store=None, device: str = "cpu") -> None:
        s = self.setup
        pg = weight_sync.group_on(store, 0, s.layout.world_size, s.timeout_s, s.backend)
        self.sync = weight_sync.ProcessGroupSync(pg, 0, s.bucket_bytes, device)

    def open_receiver(self, engine: int, tp_rank: int, device: str = "cpu") -> None:
        from datetime import timedelta

        import torch.distributed as dist

        s = self.setup
        rank = s.layout.rank(engine, tp_rank)
        self.store = dist.TCPStore(s.host, s.port, is_master=False, timeout=timedelta(seconds=s.timeout_s),
                                   wait_for_workers=False)
        pg = weight_sync.group_on(self.store, rank, s.layout.world_size, s.timeout_s, s.backend)
        self.sync = weight_sync.ProcessGroupSync(pg, rank, s.bucket_bytes, device)

    def send(self, tensors: Iterable[Named]) -> Handoff:
        return Handoff(self.name, self.sync.send(tensors))

    def close(self) -> None:
        """Shut the group down: a process group left to the interpreter's exit warns, and NCCL's
        may hang in its destructor."""
        sync, self.sync = getattr(self, "sync", None), None
        if sync is not None:
            sync.pg.shutdown()

    def receive(self, handoff: Handoff) -> Iterator[Named]:
        return self.sync.receive()


@register("shared_memory")
class SharedMemoryTransport(Transport):
    """One memory file of trainer 0, mapped by the workers on its node
    (hpcrl.weight_sync.SharedMemorySync)."""

    buffer = None

    def open_sender(self, store=None, device: str = "cpu") -> None:
        self.sync = weight_sync.SharedMemorySync()

    def send(self, tensors: Iterable[Named]) -> Handoff:
        nbytes, header, stamp = self.sync.send(tensors)
        return Handoff(self.name, nbytes, self.sync.path, header, stamp)

    def receive(self, handoff: Handoff) -> Iterator[Named]:
        needed = weight_sync.SharedMemorySync.end(handoff.header)
        if self.buffer is None or self.buffer.numel() < needed:  # mapped again only when it grew
            self.buffer = weight_sync.SharedMemorySync.map(handoff.path, handoff.header)
        return weight_sync.SharedMemorySync.receive(self.buffer, handoff.header, handoff.stamp)

    def verify(self, handoff: Handoff) -> None:
        weight_sync.Stamp.check(weight_sync.SharedMemorySync.stamp_of(self.buffer), handoff.stamp,
                                "the shared weight buffer")


@register("filesystem")
class FilesystemTransport(Transport):
    """safetensors in `directory`, written by trainer 0 and read back (hpcrl.weight_sync.FilesystemSync)."""

    def send(self, tensors: Iterable[Named]) -> Handoff:
        nbytes, stamp = weight_sync.FilesystemSync(self.setup.directory).send(tensors)
        return Handoff(self.name, nbytes, self.setup.directory, stamp=stamp)

    def receive(self, handoff: Handoff) -> Iterator[Named]:
        return weight_sync.FilesystemSync(Path(handoff.path)).receive(handoff.stamp)

    def verify(self, handoff: Handoff) -> None:
        weight_sync.Stamp.check(weight_sync.FilesystemSync(Path(handoff.path)).stamp(), handoff.stamp,
                                handoff.path)


@register("saved")
class SavedPolicyTransport(Transport):
    """A saved policy version's HF folder, read by the load side (a resumed asynchronous run whose
    next generations sample with versions older than the trainers'); nothing sends through it."""

    def send(self, tensors: Iterable[Named]) -> Handoff:
        raise NotImplementedError("a saved policy is read from the run directory, never sent")

    def receive(self, handoff: Handoff) -> Iterator[Named]:
        from safetensors.torch import load_file

        files = sorted(Path(handoff.path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{handoff.path}: no safetensors weights")
        for f in files:
            yield from load_file(str(f)).items()
