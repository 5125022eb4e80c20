"""Device utilisation: how busy the devices each role of a run holds are, and for how long it holds
them.

Roles: the update runs on the "trainer" ranks; generate on the "generator"; score on the "scorer" in
the staged mode, and on the generator task in the resident mode (its role is then "generator").

Every committed stage records, in its manifest (`OpenStage.commit`), under "utilisation":

    {"role": "trainer", "devices": 8, "device_type": "gpu", "busy_s": 612.0, "allocated_s": 905.3,
     "queue_s": null}

- `devices`: the devices the stage's task(s) held: on GPUs the distinct GPUs its ranks see (a
  multi-rank stage gathers every rank's CUDA_VISIBLE_DEVICES per host, so ranks that each see their
  node's GPUs count them once), else the CPU cores its ranks may run on (sched_getaffinity, per host).
  A process counts as on GPUs when it imported torch and torch sees a CUDA device.
- `busy_s`: wall seconds of device work: the phases "compute" (sampling, reward functions, the
  optimizer steps), "filter" (dynamic sampling scoring its rounds to choose the batch: the role's
  own work, though with rule rewards its GPUs wait meanwhile) and "prepare" (a resident update's
  forward passes, run ahead: hpcrl.update_ahead). Not busy: "startup" (imports), "load" (model,
  engine, reward pool), "io" (tables, checkpoints) and "wait" (for a commit).
- `allocated_s`: wall seconds the role held its devices for this stage: from the end of its previous
  stage in the same process (`RoleClock`), or from the process start for its first. A stage job's
  whole life up to its commit (start-up and model load allocated but not busy); a resident task's
  time since its previous stage, waiting included (allocated, idle). Only the attempt that commits
  counts: a failed or preempted attempt's time is in no manifest.
- `beside` (only when true): the stage ran on a thread beside the role's other stages, on no
  devices of its own (a resident score beside the next generation, hpcrl.resident_scores): busy and
  allocated are 0, the time being the generation's, and the role clock is left where it was.
- `queue_s`: a stage job's Slurm queue wait (start minus the later of submit and eligible, so a
  dependency's run time is not counted); null in the manifest on Slurm, where it is read from sacct at
  report time (`queue_waits`), 0 with the local executor. Counted once per job (a resident job's for
  the whole run). Wall seconds, not device-seconds: the devices are not held while queued.

Device-seconds (seconds x devices) are derived at report time. Utilisation = busy / allocated
device-seconds, idle = allocated - busy. Roles that share GPUs (`executor.resident.colocate`) each
count them, so the run's total counts those GPUs twice. Stages committed before this record existed
have none: reports show "-" for them.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from hpcrl.stage_kinds import GENERATE, KINDS, SCORE

ROLES = ("generator", "scorer", "trainer")  # display order
SHORT = {"generator": "gen", "scorer": KINDS[SCORE].short, "trainer": "train"}  # status and inspect
BUSY_PHASES = ("compute", "filter", "prepare")
UNITS = {"gpu": "GPU", "cpu": "core"}


def role(stage: str, mode: str = "staged") -> str:
    """The role whose devices run `stage` in executor mode `mode` ("staged" or "resident")."""
    kind = KINDS.get(stage)
    if kind is not None and kind.on_trainers:
        return "trainer"
    if stage == GENERATE or mode == "resident":
        return "generator"
    return "scorer" if stage == SCORE else stage


# ---- what this process holds ---------------------------------------------------------------------

def gpu_count(torch) -> int:
    """The CUDA devices `torch` (this process's module, or None when it imported none) sees: an
    NVML-based count, which does not initialise CUDA; 0 with a broken CUDA setup."""
    if torch is None:
        return 0
    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA setup: count cores instead
        return 0


def held() -> tuple[str, str, tuple[str, ...]]:
    """(host, device type, device ids) of this process: its visible GPUs when it uses torch with
    CUDA, else the CPU cores it may run on."""
    gpus = gpu_count(sys.modules.get("torch"))
    if gpus > 0:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        ids = tuple(visible[:gpus]) if len(visible) >= gpus else tuple(str(i) for i in range(gpus))
        return socket.gethostname(), "gpu", ids
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    return socket.gethostname(), "cpu", tuple(str(c) for c in cores)


def count_devices(ranks: Iterable[tuple[str, str, Iterable[str]]]) -> tuple[int, str]:
    """(devices, type) of a stage's ranks, each (host, type, ids): the distinct ids per host, of
    the first rank's type (ranks that see the same GPUs hold them once)."""
    ranks = list(ranks)
    kind = ranks[0][1]
    per_host: dict[str, set[str]] = {}
    for host, t, ids in ranks:
        if t == kind:
            per_host.setdefault(host, set()).update(ids)
    return sum(len(ids) for ids in per_host.values()), kind


def stage_ranks(world_size: int) -> list[tuple[str, str, tuple[str, ...]]]:
    """`held()` of every rank of a stage; a collective of its process group when world_size > 1
    (every rank calls it, in `OpenStage.commit`)."""
    mine = held()
    if world_size <= 1:
        return [mine]
    import torch.distributed as dist

    out: list = [None] * world_size
    dist.all_gather_object(out, mine)
    return out


def devices() -> int:
    """The devices this process holds: visible GPUs, or CPU cores."""
    return count_devices([held()])[0]


def process_start() -> float:
    """When this process was created (epoch seconds; imports included), once per process."""
    pid = os.getpid()  # a forked child reads its own
    return _STARTS[pid] if pid in _STARTS else _STARTS.setdefault(pid, _started())


def _started() -> float:
    """On Linux the kernel's start time (clock ticks since boot) against the clock since boot; not
    psutil's create_time, whose boot time in whole seconds dates a process up to 1 s too early."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc or no boot clock: not Linux
        pass
    try:
        import psutil

        return psutil.Process().create_time()
    except ImportError:
        return _IMPORTED


_STARTS: dict[int, float] = {}
_IMPORTED = time.time()


# ---- the clock of a role in this process -----------------------------------------------------------

class RoleClock:
    """The end of this process's previous stage: a stage's allocated time runs from it to the
    stage's commit (`take`). Starts at the process start; `now` is injectable for tests."""

    def __init__(self, start: float | None = None, now: Callable[[], float] = time.time):
        self._now = now
        self._mark = process_start() if start is None else start
        self._lock = threading.Lock()  # the resident trainer commits from a background thread

    def since(self) -> float:
        """Seconds since the mark: allocated to the role, not yet to any stage."""
        with self._lock:
            return max(0.0, self._now() - self._mark)

    def mark(self) -> None:
        """Move the mark to now: time before it is attributed to no stage (a task handed back)."""
        with self._lock:
            self._mark = self._now()

    def take(self) -> float:
        """The allocated seconds of a stage that ends now; the mark moves to now."""
        with self._lock:
            now = self._now()
            out, self._mark = max(0.0, now - self._mark), now
            return out


_CLOCK: RoleClock | None = None


def clock() -> RoleClock:
    """This process's RoleClock (created at first use, marked at the process start)."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = RoleClock()
    return _CLOCK


def reset_clock(start: float | None = None, now: Callable[[], float] = time.time) -> RoleClock:
    """A new RoleClock for this process (tests; a task that starts a new life)."""
    global _CLOCK
    _CLOCK = RoleClock(start, now)
    return _CLOCK


def record(stage: str, mode: str, timings: Mapping[str, float], allocated_s: float,
           ranks: Iterable[tuple[str, str, Iterable[str]]], queue_s: float | None,
           beside: bool = False) -> dict:
    """The manifest's "utilisation" entry of a stage (see the module's docstring); `beside`: the
    stage ran beside the role's others and counts no device time (busy 0, allocated 0)."""
    count, kind = count_devices(ranks)
    busy = 0.0 if beside else sum(float(timings.get(p, 0.0)) for p in BUSY_PHASES)
    out = {"role": role(stage, mode), "devices": count, "device_type": kind, "busy_s": busy,
           "allocated_s": float(allocated_s), "queue_s": queue_s}
    return {**out, "beside": True} if beside else out


def combine(records: list[dict]) -> dict:
    """One entry for a stage whose shards ran side by side (hpcrl.shards): their devices added, and
    busy and allocated seconds such that the device-seconds are the shards' sums; the longest queue
    wait (null when a shard's is read from sacct)."""
    devices = sum(r["devices"] for r in records)
    waits = [r["queue_s"] for r in records]

    def per_device(key: str) -> float:
        return sum(r[key] * r["devices"] for r in records) / devices if devices else 0.0

    return {"role": records[0]["role"], "devices": devices, "device_type": records[0]["device_type"],
            "busy_s": per_device("busy_s"), "allocated_s": per_device("allocated_s"),
            "queue_s": None if None in waits else max(waits)}


# ---- reports over manifests ----------------------------------------------------------------------

@dataclass
class Usage:
    """A role's device-seconds over some stages (an iteration's, the run's)."""

    device_type: str = ""
    devices: int = 0  # the most any of its stages held
    busy: float = 0.0  # device-seconds
    allocated: float = 0.0
    waits: dict = field(default_factory=dict)  # {job: its queue wait in wall seconds}, once per job

    @property
    def queue_s(self) -> float | None:
        return sum(self.waits.values()) if self.waits else None

    @property
    def utilisation(self) -> float | None:
        return self.busy / self.allocated if self.allocated > 0 else None

    @property
    def idle(self) -> float:
        return max(0.0, self.allocated - self.busy)

    def add(self, entry: dict, job_id: str | None, waits: Mapping[str, float]) -> None:
        n = int(entry.get("devices") or 0)
        self.device_type = self.device_type or entry.get("device_type", "")
        self.devices = max(self.devices, n)
        self.busy += float(entry.get("busy_s") or 0.0) * n
        self.allocated += float(entry.get("allocated_s") or 0.0) * n
        queue = entry.get("queue_s")
        if queue is None and job_id is not None:
            queue = waits.get(str(job_id))
        if queue is not None:
            self.waits.setdefault(str(job_id) if job_id is not None else object(), float(queue))


def entry(manifest: dict | None) -> dict | None:
    """A manifest's utilisation record, None for a stage that recorded none."""
    value = (manifest or {}).get("utilisation")
    return value if isinstance(value, dict) and value.get("role") else None


def by_role(manifests: Iterable[dict | None], waits: Mapping[str, float] | None = None) -> dict[str, Usage]:
    """Each role's usage over these stages' manifests (those without a record skipped)."""
    out: dict[str, Usage] = {}
    for m in manifests:
        if (e := entry(m)) is not None:
            out.setdefault(e["role"], Usage()).add(e, m.get("job_id"), waits or {})
    return dict(sorted(out.items(), key=lambda kv: role_order(kv[0])))


def by_iteration(manifests: Iterable[dict], waits: Mapping[str, float] | None = None
                 ) -> dict[int, dict[str, Usage]]:
    """{iteration: {role: usage}} over committed manifests (each with its "iteration")."""
    groups: dict[int, list[dict]] = {}
    for m in manifests:
        groups.setdefault(int(m["iteration"]), []).append(m)
    return {k: by_role(groups[k], waits) for k in sorted(groups)}


def total(roles: Mapping[str, Usage]) -> Usage | None:
    """The roles on accelerators together (all roles when none is on GPUs); None without any."""
    kind = "gpu" if any(u.device_type == "gpu" for u in roles.values()) else "cpu"
    out = Usage(device_type=kind)
    for u in roles.values():
        if u.device_type == kind:
            out.devices += u.devices
            out.busy += u.busy
            out.allocated += u.allocated
            out.waits.update(u.waits)
    return out if roles else None


def run_manifests(run) -> list[dict]:
    """Every committed stage manifest of a run directory (hpcrl.rundir.RunDir), in run order."""
    from hpcrl import commit
    from hpcrl.stage_kinds import ORDER

    return [m for k in run.iterations_present() for s in ORDER
            if (m := commit.read_manifest(run.stage_dir(k, s))) is not None]


def run_usage(manifests: list[dict]) -> dict[str, Usage]:
    """Each role's usage over the whole run, with the Slurm queue waits of the jobs whose records
    leave them to sacct (one sacct call; none without such a job)."""
    ask = {m["job_id"] for m in manifests if (e := entry(m)) and e.get("queue_s") is None and m.get("job_id")}
    return by_role(manifests, queue_waits(ask) if ask else {})


def role_order(name: str) -> tuple[int, str]:
    """Sort key of role names: ROLES' order, then any other by name."""
    return (ROLES.index(name) if name in ROLES else len(ROLES), name)


def queue_waits(job_ids: Iterable[str]) -> dict[str, float]:
    """Slurm queue wait of each job (sacct: start minus the later of submit and eligible); {} when
    sacct cannot answer."""
    import datetime

    from hpcrl import slurm

    ids = sorted({str(j) for j in job_ids if j})
    try:
        rows = slurm.accounting(ids)
    except Exception:  # noqa: BLE001 - no sacct, no answer in time: a view, never fatal
        return {}
    out = {}
    for job_id in ids:
        a = rows.get(job_id, {})
        try:
            start = datetime.datetime.fromisoformat(a.get("Start", ""))
            ready = max(datetime.datetime.fromisoformat(a[k]) for k in ("Submit", "Eligible") if k in a)
        except (ValueError, TypeError):  # "Unknown", "None": not started
            continue
        out[job_id] = max(0.0, (start - ready).total_seconds())
    return out


# ---- display -----------------------------------------------------------------------------------

def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def cell(roles: Mapping[str, Usage]) -> str:
    """An iteration's utilisation per role, compact: "gen 72% train 55%"; "-" without records."""
    return " ".join(f"{SHORT.get(r, r)} {percent(u.utilisation)}" for r, u in roles.items()) or "-"


def _hours(device_s: float) -> str:
    return f"{device_s / 3600:.2f}"


def summary_lines(roles: Mapping[str, Usage]) -> list[str]:
    """The run's utilisation per role and in total, for `hpcrl status` and `hpcrl inspect`."""
    if not roles:
        return ["utilisation: - (not recorded by this run's stages)"]
    lines = ["utilisation (device-hours busy / allocated; idle = allocated - busy):"]
    everything = total(roles)
    for name, u in [*roles.items(), (f"all {UNITS[everything.device_type]}s", everything)]:
        unit = f"{UNITS.get(u.device_type, 'device')}-h"
        size = f"{u.devices} {UNITS.get(u.device_type, 'device')}{'s' if u.devices != 1 else ''}"
        queue = "" if u.queue_s is None else f"; queue wait {u.queue_s / 3600:.2f} h"
        lines.append(f"  {name:<10} {size:<9} busy {_hours(u.busy)} / {_hours(u.allocated)} {unit} "
                     f"({percent(u.utilisation)}), idle {_hours(u.idle)}{queue}")
    return lines


def metrics(roles: Mapping[str, Usage], prefix: str = "util") -> dict[str, float]:
    """MLflow metrics of each role's (or stage's) usage: `<prefix>/<name>/busy_s`, `allocated_s`,
    `idle_s` (device-seconds), `devices`, `utilisation`, and `queue_s` (wall seconds) where known."""
    out = {}
    for name, u in roles.items():
        out.update({f"{prefix}/{name}/busy_s": u.busy, f"{prefix}/{name}/allocated_s": u.allocated,
                    f"{prefix}/{name}/idle_s": u.idle, f"{prefix}/{name}/devices": float(u.devices)})
        if u.utilisation is not None:
            out[f"{prefix}/{name}/utilisation"] = u.utilisation
        if u.queue_s is not None:
            out[f"{prefix}/{name}/queue_s"] = u.queue_s
    return out


def run_metrics(manifests: list[dict]) -> dict[str, float]:
    """MLflow metrics of the whole run so far: `util/run/<role>/...` and `util/run/all/...` (the
    roles on GPUs; every role on a CPU-only run), with its `busy_h` and `allocated_h` in device-hours."""
    roles = run_usage(manifests)
    if not roles:
        return {}
    everything = total(roles)
    out = metrics({**roles, "all": everything}, "util/run")
    out.update({"util/run/all/busy_h": everything.busy / 3600,
                "util/run/all/allocated_h": everything.allocated / 3600})
    return out
