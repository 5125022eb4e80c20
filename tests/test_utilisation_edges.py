"""The utilisation accounting's edges (hpcrl.utilisation), each pinned by a case small enough to
compute by hand: what a process on GPUs holds (a stand-in torch module, as no GPU is here), Slurm
queue waits that sacct cannot give, records with fields missing, waits without a job, role order,
and the report's units at a cluster's scale. tests/test_utilisation.py holds the end-to-end case.
"""

from __future__ import annotations

import os
import socket
import sys
import types

import pytest

from hpcrl import slurm, utilisation
from hpcrl.utilisation import Usage


def gpu_torch(count):
    """A stand-in torch module whose CUDA sees `count` devices (or raises, when `count` is an
    exception); it never enters sys.modules, where the real torch stays."""
    def device_count():
        if isinstance(count, Exception):
            raise count
        return count

    return types.SimpleNamespace(cuda=types.SimpleNamespace(device_count=device_count))


def gpus_seen(monkeypatch, count: int) -> None:
    """This process's torch seeing `count` GPUs (held() asks gpu_count about sys.modules' torch)."""
    mine = sys.modules.get("torch")
    monkeypatch.setattr(utilisation, "gpu_count", lambda torch: count if torch is mine else -1)


# ---- what this process holds -----------------------------------------------------------------

def test_the_gpus_torch_sees_and_none_without_torch_or_with_a_broken_cuda():
    assert utilisation.gpu_count(gpu_torch(3)) == 3
    assert utilisation.gpu_count(gpu_torch(RuntimeError("no driver"))) == 0
    assert utilisation.gpu_count(None) == 0


def test_a_process_on_gpus_holds_the_first_visible_ids_torch_counts(monkeypatch):
    gpus_seen(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 3, 5,7")
    assert utilisation.held() == (socket.gethostname(), "gpu", ("3", "5"))
    assert utilisation.devices() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")  # fewer ids than devices: torch's own numbering
    assert utilisation.held()[1:] == ("gpu", ("0", "1"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert utilisation.held()[1:] == ("gpu", ("0", "1"))
    gpus_seen(monkeypatch, 1)
    assert utilisation.held()[1:] == ("gpu", ("0",))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    assert utilisation.held()[1:] == ("gpu", ("4",))


def test_a_process_without_gpus_holds_the_cores_it_may_run_on(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 2} if pid == 0 else {0})
    gpus_seen(monkeypatch, 0)
    assert utilisation.held() == (socket.gethostname(), "cpu", ("2", "5"))
    monkeypatch.delattr(os, "sched_getaffinity")  # not Linux: every core
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert utilisation.held()[1:] == ("cpu", ("0", "1", "2"))
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert utilisation.held()[1:] == ("cpu", ("0",))


def test_every_rank_of_a_stage_reports_what_it_holds(monkeypatch):
    import torch.distributed as dist

    calls = []

    def gather(out, mine):
        calls.append(len(out))
        out[:] = [mine, ("other", "cpu", ("9",))]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    mine = utilisation.held()
    assert utilisation.stage_ranks(1) == [mine] and calls == []  # one rank: no collective
    assert utilisation.stage_ranks(2) == [mine, ("other", "cpu", ("9",))] and calls == [2]


def test_a_process_starts_when_it_was_spawned_to_the_clock_tick(monkeypatch):
    """Pins: psutil's create_time first, which dates a process up to 1 s early (the boot time it
    adds to is whole seconds: 0.78 s early on the machine this was written on), or a start read
    from the wrong field of /proc/self/stat; one start per process, read again in a forked child;
    and the fallbacks off Linux."""
    import subprocess
    import time

    code = "import time; from hpcrl import utilisation; print(utilisation.process_start(), time.time())"
    before = time.time()
    start, ran = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout.split())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - tick - 0.005 <= start <= ran
    mine = utilisation.process_start()
    assert utilisation.process_start() == mine < before
    read, write = os.pipe()
    if (child := os.fork()) == 0:  # the child's own start, not the one its parent read
        try:
            os.write(write, repr(utilisation.process_start()).encode())
        finally:
            os._exit(0)  # never on into the parent's tests
    os.waitpid(child, 0)
    os.close(write)
    with os.fdopen(read) as pipe:
        assert float(pipe.read()) > before
    import psutil

    monkeypatch.delattr(time, "CLOCK_BOOTTIME")  # as off Linux
    assert utilisation._started() == psutil.Process().create_time()
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    assert utilisation._started() == utilisation._IMPORTED


def test_a_process_start_is_read_past_a_command_name_with_brackets(monkeypatch):
    """Pins: /proc/self/stat cut at the first ")" (a command may have one in its name)."""
    import io
    import time

    stat = "4242 (evil) (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 123456 99 98\n"
    monkeypatch.setattr(utilisation, "open", lambda path: io.StringIO(stat), raising=False)
    monkeypatch.setattr(time, "clock_gettime", lambda clock: 2000.0)
    monkeypatch.setattr(time, "time", lambda: 9000.0)
    assert utilisation._started() == 9000.0 - (2000.0 - 123456 / os.sysconf("SC_CLK_TCK"))


def test_the_process_clock_is_one_and_starts_at_the_process_start(monkeypatch):
    monkeypatch.setattr(utilisation, "_CLOCK", None)  # as in a process whose stages have not begun
    assert utilisation.clock() is utilisation.clock()
    assert isinstance(utilisation.clock(), utilisation.RoleClock)
    start = utilisation.process_start()
    clock = utilisation.RoleClock(now=lambda: start + 5.0)
    assert clock.since() == 5.0
    assert clock.take() == 5.0 and clock.take() == 0.0  # a stage that ends at once holds nothing


# ---- records and usage -------------------------------------------------------------------------

def test_stages_outside_the_pipeline_keep_their_own_role_and_the_resident_scorer_is_the_generator():
    assert utilisation.role("evaluate") == "evaluate"
    record = utilisation.record("score", "resident", {"compute": 2.0}, 3.0, [("h", "cpu", ("0",))], 0.0)
    assert record["role"] == "generator"
    assert utilisation.record("score", "staged", {}, 3.0, [("h", "cpu", ("0",))], 0.0)["role"] == "scorer"


def test_a_record_with_fields_missing_adds_nothing_it_lacks():
    u = Usage()
    u.add({"role": "trainer", "busy_s": None, "allocated_s": None}, None, {})
    assert (u.device_type, u.devices, u.busy, u.allocated, u.queue_s) == ("", 0, 0.0, 0.0, None)
    u.add({"role": "trainer", "devices": 2, "busy_s": 3.0}, None, {})  # no allocated_s, no device_type
    assert (u.device_type, u.devices, u.busy, u.allocated) == ("", 2, 6.0, 0.0)
    u.add({"role": "trainer", "devices": 1, "busy_s": None, "allocated_s": 4.0}, None, {})
    assert (u.busy, u.allocated) == (6.0, 4.0)


def test_queue_waits_count_once_per_job_and_each_record_without_a_job_counts_its_own():
    u = Usage()
    for queue in (5.0, 7.0):  # two jobs whose ids are not recorded
        u.add({"role": "scorer", "devices": 1, "queue_s": queue}, None, {})
    assert u.queue_s == 12.0
    u = Usage()
    for job, queue in (("1", 5.0), ("2", 7.0)):
        u.add({"role": "scorer", "devices": 1, "queue_s": queue}, job, {})
    assert u.queue_s == 12.0
    u = Usage()
    u.add({"role": "trainer", "devices": 1, "queue_s": 5.0}, "9", {"9": 100.0})  # its own record wins
    u.add({"role": "trainer", "devices": 1, "queue_s": None}, "9", {"9": 100.0})  # the same job: once
    assert u.queue_s == 5.0
    u = Usage()
    u.add({"role": "trainer", "devices": 1, "queue_s": None}, None, {"None": 100.0})  # no job to look up
    assert u.queue_s is None


def test_the_shards_of_a_stage_add_their_devices_and_device_seconds():
    shards = [{"role": "generator", "devices": 1, "device_type": "gpu", "busy_s": 10.0, "allocated_s": 20.0,
               "queue_s": 5.0},
              {"role": "generator", "devices": 3, "device_type": "gpu", "busy_s": 30.0, "allocated_s": 40.0,
               "queue_s": 7.0}]
    combined = utilisation.combine(shards)
    assert combined == {"role": "generator", "devices": 4, "device_type": "gpu", "busy_s": 25.0,
                        "allocated_s": 35.0, "queue_s": 7.0}
    u = Usage()
    u.add(combined, None, {})
    assert (u.busy, u.allocated) == (10.0 + 90.0, 20.0 + 120.0)  # the shards' device-seconds
    shards[0]["queue_s"] = None  # one shard's wait is left to sacct
    assert utilisation.combine(shards)["queue_s"] is None
    none = [{**shards[1], "devices": 0}]
    assert (utilisation.combine(none)["busy_s"], utilisation.combine(none)["allocated_s"]) == (0.0, 0.0)


def test_a_manifest_without_a_usable_record_has_none():
    assert utilisation.entry(None) is None
    assert utilisation.entry({"utilisation": "busy"}) is None
    assert utilisation.entry({"utilisation": {"busy_s": 1.0}}) is None
    assert utilisation.entry({"utilisation": {"role": "trainer"}}) == {"role": "trainer"}


def manifest(k: int, role: str, job: str | None = None, queue: float | None = 0.0) -> dict:
    record = {"role": role, "devices": 1, "device_type": "gpu", "busy_s": 1.0, "allocated_s": 2.0,
              "queue_s": queue}
    return {"iteration": k, "job_id": job, "utilisation": record}


def test_roles_come_in_pipeline_order_then_by_name():
    ms = [manifest(0, r) for r in ("zeta", "trainer", "critic", "scorer", "generator")]
    assert list(utilisation.by_role(ms)) == ["generator", "scorer", "trainer", "critic", "zeta"]
    order = utilisation.role_order
    assert order("trainer") < order("critic") < order("zeta")
    assert utilisation.cell(utilisation.by_role([manifest(0, "critic")])) == "critic 50%"


def test_each_iterations_usage_takes_the_queue_waits_given():
    per = utilisation.by_iteration([manifest(1, "trainer", "11", None), manifest(0, "trainer", "10", 4.0)])
    assert list(per) == [0, 1] and per[1]["trainer"].queue_s is None
    per = utilisation.by_iteration([manifest(1, "trainer", "11", None)], {"11": 60.0})
    assert per[1]["trainer"].queue_s == 60.0


def test_sacct_is_asked_only_for_the_jobs_whose_records_leave_their_wait_to_it(monkeypatch):
    asked = []
    monkeypatch.setattr(slurm, "accounting", lambda ids: asked.append(ids) or {})
    utilisation.run_usage([manifest(0, "trainer", "5", 0.0), manifest(0, "generator", None, None)])
    assert asked == []
    utilisation.run_usage([manifest(0, "trainer", "5", 0.0), manifest(1, "trainer", "6", None)])
    assert asked == [["6"]]


def test_a_queue_wait_is_from_the_later_of_submit_and_eligible_to_the_start(monkeypatch):
    rows = {"1": {"Submit": "2026-01-01T10:05:00", "Eligible": "2026-01-01T10:00:00",
                  "Start": "2026-01-01T10:06:00"},  # requeued: submitted again after it was eligible
            "2": {"Submit": "2026-01-01T10:00:00", "Start": "2026-01-01T10:00:00"},  # no Eligible; no wait
            "3": {"Submit": "2026-01-01T10:00:00", "Start": "Unknown"},  # not started
            "4": {"Submit": "2026-01-01T10:00:00", "Eligible": "2026-01-01T10:00:10",
                  "Start": "2026-01-01T10:00:00"}}  # started before eligible (clock skew): no wait
    monkeypatch.setattr(slurm, "accounting", lambda ids: rows)
    assert utilisation.queue_waits(["4", "3", "2", "1", "7"]) == {"1": 60.0, "2": 0.0, "4": 0.0}

    def down(ids):
        raise FileNotFoundError("sacct")

    monkeypatch.setattr(slurm, "accounting", down)
    assert utilisation.queue_waits(["1"]) == {}


# ---- the report's units -----------------------------------------------------------------------

def test_the_summary_at_a_clusters_scale_and_of_devices_it_does_not_know():
    week = 7 * 24 * 3600.0
    gpus = Usage("gpu", 64, busy=0.5 * 64 * week, allocated=64 * week, waits={"3": 72000.0})
    other = Usage("", 1, busy=1800.0, allocated=3600.0)
    assert utilisation.summary_lines({"trainer": gpus, "probe": other}) == [
        "utilisation (device-hours busy / allocated; idle = allocated - busy):",
        "  trainer    64 GPUs   busy 5376.00 / 10752.00 GPU-h (50%), idle 5376.00; queue wait 20.00 h",
        "  probe      1 device  busy 0.50 / 1.00 device-h (50%), idle 0.50",
        "  all GPUs   64 GPUs   busy 5376.00 / 10752.00 GPU-h (50%), idle 5376.00; queue wait 20.00 h"]
    cores = {"generator": Usage("cpu", 1, busy=0.0, allocated=3600.0)}
    assert utilisation.summary_lines(cores)[-1] == \
        "  all cores  1 core    busy 0.00 / 1.00 core-h (0%), idle 1.00"
    assert utilisation.percent(None) == "-" and utilisation.percent(0.125) == "12%"


def test_the_total_is_over_the_accelerators_or_every_core_of_a_cpu_run():
    cpu = {"generator": Usage("cpu", 1, 1.0, 2.0), "trainer": Usage("cpu", 2, 3.0, 4.0)}
    everything = utilisation.total(cpu)
    assert (everything.device_type, everything.devices, everything.busy, everything.allocated) == \
        ("cpu", 3, 4.0, 6.0)
    mixed = {**cpu, "trainer": Usage("gpu", 2, 3.0, 4.0)}
    assert (utilisation.total(mixed).devices, utilisation.total(mixed).busy) == (2, 3.0)
    assert utilisation.total({}) is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
