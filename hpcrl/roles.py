"""The control plane of a resident job: who is who, commands, heartbeats, and stopping together.

A resident job has `update.world_size` trainer tasks and `generate.engines` generator tasks, each
holding a vLLM engine (`Layout`); generator 0 drives the loop, the others serve its commands. They
share one TCPStore, hosted by task 0 (trainer 0), for everything small: commands on named channels
("trainers", "engine<e>"), replies, heartbeats and the failure flag. (The trainers' own process
group and the weight-sync group are built over the same store.)

Every task runs a monitor thread: it beats every second, and ends the process when another task
reported a failure, when a task's heartbeat has stalled (killed, hung node), or when the store
is gone (task 0 died); so no task ever waits forever for a dead peer and the allocation is
released within seconds, with the role, the rank and the error in the log.

The store accepts any client that reaches its port. So every value the plane writes is signed
(HMAC-SHA256 over its key and body) with a per-job secret that only the job's tasks read (a 0600
file in the run directory, `job_secret`), and a value without a valid signature is ignored: a
client without the secret can neither raise the failure flag nor send a command, a reply or a
signal. (It can still delay the job by overwriting keys, and the trainers' and the weight-sync
process groups are torch.distributed's own; the probe check catches weights that are not the
trainer's.)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

HEARTBEAT_S = 1.0
STORE_CALL_S = 30  # the longest the monitor's store calls wait


class RoleFailedError(RuntimeError):
    """Another task of the resident job failed; the message names it."""


@dataclass(frozen=True)
class Layout:
    """The resident job's tasks: `trainers` trainer ranks and `engines` generator tasks (one vLLM
    engine each) on `nodes` nodes, Slurm's block order (node n holds the tasks n*t .. n*t+t-1).
    When both counts divide by the nodes, each node holds its share of trainers, then its share
    of engines (a node's trainers and engines use its GPUs side by side); else the trainers come
    first, then the engines. Task 0 is trainer 0 (it hosts the job's store) either way."""

    trainers: int
    engines: int = 1
    nodes: int = 1

    def __post_init__(self):
        if self.trainers < 1 or self.engines < 1 or self.nodes < 1 or self.world_size % self.nodes:
            raise ValueError(f"{self.trainers} trainer(s) and {self.engines} engine(s) do not spread "
                             f"evenly over {self.nodes} node(s)")

    @property
    def world_size(self) -> int:
        return self.trainers + self.engines

    @property
    def per_node(self) -> int:
        return self.world_size // self.nodes

    def interleaved(self) -> bool:
        return self.nodes > 1 and not self.trainers % self.nodes and not self.engines % self.nodes

    def role(self, task: int) -> tuple[str, int]:
        """("trainer", trainer rank) or ("generator", engine index) of a task (its global rank)."""
        if not 0 <= task < self.world_size:
            raise ValueError(f"task {task} outside a resident job of {self.world_size} tasks")
        if not self.interleaved():
            return ("trainer", task) if task < self.trainers else ("generator", task - self.trainers)
        node, local = divmod(task, self.per_node)
        here = self.trainers // self.nodes
        if local < here:
            return "trainer", node * here + local
        return "generator", node * (self.engines // self.nodes) + local - here

    def task(self, role: str, index: int) -> int:
        """The task (global rank) of trainer or generator `index`."""
        return next(t for t in range(self.world_size) if self.role(t) == (role, index))

    def node(self, task: int) -> int:
        return task // self.per_node

    def name(self, task: int) -> str:
        role, r = self.role(task)
        return f"{role} {r} (task {task})"


def job_secret(path: Path) -> bytes:
    """The job's secret in `path` (0600), created by whichever task comes first (atomically)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # publishes a complete file, or another task's was first
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return path.read_bytes()


class ControlPlane:
    def __init__(self, host: str, port: int, rank: int, layout: Layout, stall_s: float = 30.0,
                 timeout_s: float = 1800.0, secret: bytes = b""):
        from hpcrl.distributed import tcp_store

        self.rank, self.layout, self.stall_s, self.timeout_s = rank, layout, stall_s, timeout_s
        self._secret = secret
        self.store = tcp_store(host, port, layout.world_size, rank == 0, timeout_s, wait_for_workers=False)
        self.host, self.port = host, port
        self._seqs: dict[str, int] = {}  # the last command's number on each channel
        self._stopping = threading.Event()
        self._beats = 0
        self._side, self._side_lock = None, threading.Lock()
        self._owner, self._send_lock = threading.get_ident(), threading.Lock()
        self._local = threading.local()  # each other thread's connection for its waits (`_here`)
        self._monitor_thread: threading.Thread | None = None

    # -- signed values ------------------------------------------------------------------------
    def _mac(self, key: str, body: str) -> str:
        return hmac.new(self._secret, f"{key}\0{body}".encode(), hashlib.sha256).hexdigest()

    def put(self, store, key: str, value) -> None:
        body = json.dumps(value)
        store.set(key, json.dumps({"body": body, "mac": self._mac(key, body)}))

    def get(self, store, key: str):
        """The value a task of this job wrote under `key`; None when there is none, or it does not
        carry this job's signature (another client wrote it)."""
        if not store.check([key]):
            return None
        try:
            sealed = json.loads(store.get(key))
            body, mac = sealed["body"], sealed["mac"]
        except (ValueError, TypeError, KeyError):
            return None
        return json.loads(body) if hmac.compare_digest(str(mac), self._mac(key, body)) else None

    # -- failure and liveness -------------------------------------------------------------
    def fail(self, error: str, store=None) -> None:
        """Tell every task that this one failed (the earliest failure is the one reported), from
        any thread: not over the main connection, which a blocking wait may hold (the monitor
        passes its own)."""
        info = {"rank": self.rank, "who": self.layout.name(self.rank), "error": error, "at": time.time()}
        try:
            self.put(store or self._side_store(), f"failed/{self.rank}", info)
        except Exception:  # noqa: BLE001  (the store may be gone already: nothing more to tell)
            pass

    def failure(self) -> str | None:
        return self._failure(self.store)

    def _failure(self, store) -> str | None:
        found = [info for r in range(self.layout.world_size) if (info := self.get(store, f"failed/{r}"))]
        if not found:
            return None
        info = min(found, key=lambda i: i["at"])
        return f"{info['who']} failed: {info['error']}"

    def start_monitor(self) -> None:
        self._monitor_thread = threading.Thread(target=self._monitor, name="hpcrl-monitor", daemon=True)
        self._monitor_thread.start()

    def stop_monitor(self) -> None:
        """Stop the heartbeat, wait for the monitor's last store call (a daemon thread still in one
        when the interpreter exits aborts the process), and say so in the store."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._monitor_thread is not None:
            self._monitor_thread.join(timeout=STORE_CALL_S)
        try:
            self.put(self.store, f"stopped/{self.rank}", True)
        except Exception:  # noqa: BLE001  (the store may be gone already)
            pass

    def close(self) -> None:
        """A task's end, once its role's work is done: its monitor stopped; task 0, which hosts
        the store, waits for every other task's monitor to stop first (a monitor that lost the
        store would end its task as failed)."""
        self.stop_monitor()
        if self.rank == 0:
            try:
                self.store.wait([f"stopped/{r}" for r in range(1, self.layout.world_size)],
                                timedelta(seconds=self.stall_s + STORE_CALL_S))
            except Exception:  # noqa: BLE001  (a task that died never says it stopped: end anyway)
                pass

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

    def _here(self):
        """The connection the calling thread waits on: the main one in the thread that made this
        plane, a connection of its own in any other (a blocking wait holds its connection)."""
        if threading.get_ident() == self._owner:
            return self.store
        if getattr(self._local, "store", None) is None:
            self._local.store = self._connect(timedelta(seconds=self.timeout_s))
        return self._local.store

    def _monitor(self) -> None:
        store = self._connect(timedelta(seconds=STORE_CALL_S))  # the main thread may wait on self.store
        seen: dict[int, tuple[int, float]] = {}
        while not self._stopping.wait(HEARTBEAT_S):
            try:
                self._beats += 1
                self.put(store, f"hb/{self.rank}", self._beats)
                failure = self._failure(store)
                stalled = None
                now = time.monotonic()
                for r in range(self.layout.world_size):
                    beat = self.get(store, f"hb/{r}") if r != self.rank else None
                    if beat is None:
                        continue
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

    # -- commands on a channel (generator 0 -> the trainers, or -> engine e) and their replies --
    def wait_for(self, key: str):
        """The key's signed value once set (an unsigned one is reported and waited past). A failed
        or dead peer ends this process through the monitor; the timeout bounds a wait on a peer
        that is alive but stuck. Safe from any thread (`_here`)."""
        deadline, warned, store = time.monotonic() + self.timeout_s, False, self._here()
        while True:
            try:
                store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError as err:
                timed_out = self._timed_out(f"nothing came on {key}")
                raise RoleFailedError(self._failure(store) or timed_out) from err
            if (value := self.get(store, key)) is not None:
                return value
            if not warned:
                print(f"[resident] {self.layout.name(self.rank)}: ignored a value of {key} without this "
                      "job's signature (another client wrote to the job's store)", file=sys.stderr,
                      flush=True)
                warned = True
            if time.monotonic() > deadline:
                raise RoleFailedError(self._timed_out(f"no signed value came on {key}"))
            time.sleep(0.05)

    def _timed_out(self, what: str) -> str:
        return (f"{self.layout.name(self.rank)}: {what} within executor.resident.collective_timeout_s = "
                f"{self.timeout_s:.0f} s")

    def send(self, command: dict, channel: str = "trainers") -> int:
        """Command `channel`'s tasks; its number (for `wait_reply`). Safe from a thread other than
        the one that made this plane (the generator's scoring thread commands updates): that one
        sends on its own connection, numbers and all under one lock, so commands keep their order."""
        with self._send_lock:
            self._seqs[channel] = seq = self._seqs.get(channel, 0) + 1
            own = threading.get_ident() == self._owner
            self.put(self.store if own else self._side_store(), f"cmd/{channel}/{seq}", command)
        return seq

    def receive(self, channel: str = "trainers") -> dict:
        self._seqs[channel] = seq = self._seqs.get(channel, 0) + 1
        return self.wait_for(f"cmd/{channel}/{seq}")

    def reply(self, payload: dict, channel: str = "trainers", part: str = "") -> None:
        """The reply to the last command `receive` returned on `channel`; a command may have
        several, each a named `part` of it."""
        self.put(self.store, f"reply/{channel}/{self._seqs[channel]}{'/' + part if part else ''}", payload)

    def wait_reply(self, seq: int, channel: str = "trainers", part: str = "") -> dict:
        return self.wait_for(f"reply/{channel}/{seq}{'/' + part if part else ''}")

    # -- signals (any thread of any task -> whoever waits) -----------------------------------
    def signal(self, name: str) -> None:
        """Set `name` for `wait_signal`; safe from a thread other than the main one (its own
        connection: the main one may be held by a blocking wait)."""
        self.put(self._side_store(), f"signal/{name}", 1)

    def wait_signal(self, name: str) -> None:
        self.wait_for(f"signal/{name}")
