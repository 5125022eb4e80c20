"""The control plane of a resident job: who is who, commands, heartbeats, and stopping together.

A resident job has `update.world_size` trainer tasks (global ranks 0..W-1) and one generator task
(rank W) that drives the loop. They share one TCPStore, hosted by rank 0, for everything small:
commands from the generator to the trainers, replies, heartbeats and the failure flag. (The
trainers' own process group and the weight-sync group are built over the same store.)

Every task runs a monitor thread: it beats every second, and ends the process when another task
reported a failure, when a task's heartbeat has stalled (killed, hung node), or when the store
is gone (rank 0 died); so no task ever waits forever for a dead peer and the allocation is
released within seconds, with the role, the rank and the error in the log.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

HEARTBEAT_S = 1.0


class RoleFailedError(RuntimeError):
    """Another task of the resident job failed; the message names it."""


@dataclass(frozen=True)
class Layout:
    trainers: int

    @property
    def world_size(self) -> int:
        return self.trainers + 1

    @property
    def generator_rank(self) -> int:
        return self.trainers

    def role(self, rank: int) -> tuple[str, int]:
        """("trainer", trainer rank) or ("generator", 0) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a resident job of {self.world_size} tasks")
        return ("trainer", rank) if rank < self.trainers else ("generator", 0)

    def name(self, rank: int) -> str:
        role, r = self.role(rank)
        return f"{role} {r} (task {rank})" if role == "trainer" else f"generator (task {rank})"


class ControlPlane:
    def __init__(self, host: str, port: int, rank: int, layout: Layout, stall_s: float = 30.0,
                 timeout_s: float = 1800.0):
        import torch.distributed as dist

        self.rank, self.layout, self.stall_s, self.timeout_s = rank, layout, stall_s, timeout_s
        self.store = dist.TCPStore(host, port, layout.world_size, is_master=rank == 0,
                                   timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.host, self.port = host, port
        self._seq = 0
        self._stopping = threading.Event()
        self._beats = 0
        self._side, self._side_lock = None, threading.Lock()

    # -- failure and liveness -------------------------------------------------------------
    def fail(self, error: str, store=None) -> None:
        """Tell every task that this one failed (first failure wins), from any thread: not over
        the main connection, which a blocking wait may hold (the monitor passes its own)."""
        info = json.dumps({"rank": self.rank, "who": self.layout.name(self.rank), "error": error})
        try:
            (store or self._side_store()).compare_set("failed", "", info)
        except Exception:  # noqa: BLE001  (the store may be gone already: nothing more to tell)
            pass

    def failure(self) -> str | None:
        return self._failure(self.store)

    @staticmethod
    def _failure(store) -> str | None:
        if not store.check(["failed"]):
            return None
        info = json.loads(store.get("failed"))
        return f"{info['who']} failed: {info['error']}"

    def start_monitor(self) -> None:
        threading.Thread(target=self._monitor, name="hpcrl-monitor", daemon=True).start()

    def stop_monitor(self) -> None:
        self._stopping.set()

    def _connect(self, timeout: timedelta):
        """Another client connection to the job's store."""
        import torch.distributed as dist

        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout, wait_for_workers=False)

    def _side_store(self):
        """A second connection for what any thread may send (signals, the failure flag)."""
        with self._side_lock:
            if self._side is None:
                self._side = self._connect(timedelta(seconds=30))
            return self._side

    def _monitor(self) -> None:
        store = self._connect(timedelta(seconds=30))  # the main thread may sit in a wait on self.store
        seen: dict[int, tuple[int, float]] = {}
        while not self._stopping.wait(HEARTBEAT_S):
            try:
                self._beats += 1
                store.set(f"hb/{self.rank}", str(self._beats))
                failure = self._failure(store)
                stalled = None
                now = time.monotonic()
                for r in range(self.layout.world_size):
                    if r == self.rank or not store.check([f"hb/{r}"]):
                        continue
                    beat = int(store.get(f"hb/{r}"))
                    if seen.get(r, (None,))[0] != beat:
                        seen[r] = (beat, now)
                    elif now - seen[r][1] > self.stall_s:
                        stalled = r
            except Exception as err:  # noqa: BLE001
                if self._stopping.is_set():
                    return
                failure = f"lost the job's store on task 0 ({self.layout.name(0)} died?): {err}"
            if self._stopping.is_set():
                return
            if failure is None and stalled is not None:
                failure = (f"{self.layout.name(stalled)} stopped responding (no heartbeat for "
                           f"{self.stall_s:.0f} s: killed, or its node is gone)")
                self.fail(failure.split(" failed: ")[-1], store)
            if failure is not None:
                print(f"[resident] {self.layout.name(self.rank)} stops: {failure}", file=sys.stderr,
                      flush=True)
                os._exit(1)

    # -- commands (generator -> trainers) and replies (trainer 0 -> generator) --------------
    def _wait_key(self, key: str) -> str:
        """The key's value once set. A failed or dead peer ends this process through the monitor;
        the timeout bounds a wait on a peer that is alive but stuck."""
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise RoleFailedError(self.failure() or
                                  f"{self.layout.name(self.rank)}: nothing came on {key} within "
                                  f"executor.resident.collective_timeout_s = {self.timeout_s:.0f} s") from err
        return self.store.get(key).decode()

    def send(self, command: dict) -> int:
        self._seq += 1
        self.store.set(f"cmd/{self._seq}", json.dumps(command))
        return self._seq

    def receive(self) -> dict:
        self._seq += 1
        return json.loads(self._wait_key(f"cmd/{self._seq}"))

    def reply(self, payload: dict) -> None:
        self.store.set(f"reply/{self._seq}", json.dumps(payload))

    def wait_reply(self, seq: int) -> dict:
        return json.loads(self._wait_key(f"reply/{seq}"))

    # -- signals (any thread of any task -> whoever waits) -----------------------------------
    def signal(self, name: str) -> None:
        """Set `name` for `wait_signal`; safe from a thread other than the main one (its own
        connection: the main one may be held by a blocking wait)."""
        self._side_store().set(f"signal/{name}", "1")

    def wait_signal(self, name: str) -> None:
        self._wait_key(f"signal/{name}")
