"""Device utilisation (hpcrl.utilisation): what a committed stage records, and what `hpcrl status`,
`hpcrl inspect` and MLflow show, checked against a case computed by hand. No wall clock is read:
the RoleClock takes an injected time source.

The hand-computed case: a staged run of 2 trained iterations, the generator on 1 GPU, the scorer on
4 CPU cores, the trainer on 2 GPUs (busy / allocated wall seconds, then device-seconds):

    iter  generate (1 GPU)        score (4 cores)          update (2 GPUs)
    0     1080 / 1800 s   60%     180 / 360 s ->  720 / 1440   50%     900 / 3600 s -> 1800 / 7200  25%
    1     1620 / 1800 s   90%      72 / 360 s ->  288 / 1440   20%    2700 / 3600 s -> 5400 / 7200  75%
    run   2700 / 3600 GPU-s 75%   1008 / 2880 core-s 35%            7200 / 14400 GPU-s 50%
          (0.75 / 1.00 GPU-h)     (0.28 / 0.80 core-h)              (2.00 / 4.00 GPU-h)
    all GPUs: 9900 / 18000 GPU-s = 2.75 / 5.00 GPU-h, 55%, idle 2.25 GPU-h
"""

from __future__ import annotations

import json

import pytest

from hpcrl import commit, runs, tracking, utilisation
from hpcrl import inspection as run_inspect
from hpcrl.stage import OpenStage, run_stage
from tests import synthetic_run

GEN, SCORER, TRAINER = (1, "gpu"), (4, "cpu"), (2, "gpu")
CASE = {  # (iteration, stage): (devices, type), busy_s, allocated_s
    (0, "generate"): (GEN, 1080.0, 1800.0), (0, "score"): (SCORER, 180.0, 360.0),
    (0, "update"): (TRAINER, 900.0, 3600.0),
    (1, "generate"): (GEN, 1620.0, 1800.0), (1, "score"): (SCORER, 72.0, 360.0),
    (1, "update"): (TRAINER, 2700.0, 3600.0),
}
ROLE = {"generate": "generator", "score": "scorer", "update": "trainer"}


def manifest(k: int, stage: str, queue_s: float | None = 0.0, job_id: str | None = None,
             mode: str = "staged") -> dict:
    (devices, kind), busy, allocated = CASE[(k, stage)]
    return {"stage": stage, "iteration": k, "job_id": job_id, "metrics": {}, "timings": {"total": allocated},
            "utilisation": {"role": utilisation.role(stage, mode), "devices": devices, "device_type": kind,
                            "busy_s": busy, "allocated_s": allocated, "queue_s": queue_s}}


MANIFESTS = [manifest(k, s) for k, s in CASE]


# ---- what a stage records ----------------------------------------------------------------------

def test_roles_of_the_stages_in_each_mode():
    stages = ("generate", "score", "update")
    assert [utilisation.role(s) for s in stages] == ["generator", "scorer", "trainer"]
    assert [utilisation.role(s, "resident") for s in stages] == ["generator", "generator", "trainer"]


def test_busy_is_compute_and_filter_and_devices_are_counted_once_per_host():
    timings = {"startup": 5.0, "load": 10.0, "compute": 30.0, "filter": 4.0, "io": 2.0, "wait": 7.0,
               "total": 58.0}
    node = ("0", "1", "2", "3")  # staged update: every rank sees its node's GPUs
    ranks = [("n1", "gpu", node), ("n1", "gpu", node), ("n2", "gpu", node), ("n2", "gpu", node)]
    assert utilisation.record("update", "staged", timings, 120.0, ranks, None) == {
        "role": "trainer", "devices": 8, "device_type": "gpu", "busy_s": 34.0, "allocated_s": 120.0,
        "queue_s": None}
    bound = [("n1", "gpu", ("0",)), ("n1", "gpu", ("1",))]  # resident: each rank narrowed to its GPU
    assert utilisation.count_devices(bound) == (2, "gpu")
    assert utilisation.count_devices([("h", "cpu", ("0", "1")), ("h", "cpu", ("0", "1"))]) == (2, "cpu")
    host, kind, ids = utilisation.held()  # this machine has no GPU torch: its cores
    assert kind == "cpu" and len(ids) == utilisation.devices() >= 1


def test_the_role_clock_allocates_the_time_since_the_previous_stage():
    now = [100.0]
    clock = utilisation.RoleClock(start=40.0, now=lambda: now[0])
    assert clock.since() == 60.0 and clock.take() == 60.0  # the first stage: since the process start
    now[0] = 130.0
    assert clock.since() == 30.0
    now[0] = 175.0
    assert clock.take() == 75.0  # waiting for its input is allocated to the next stage
    now[0] = 180.0
    clock.mark()  # time before a mark belongs to no stage
    now[0] = 200.0
    assert clock.take() == 20.0


@pytest.fixture
def fake_clock():
    yield utilisation.reset_clock(start=1000.0, now=lambda: 1600.0)
    utilisation.reset_clock()


def test_a_committed_stage_records_its_utilisation(tmp_path, fake_clock):
    synthetic_run.write_config(tmp_path / "r", iterations=1)
    attempt = OpenStage("score", tmp_path / "r", 0, startup=3.0)
    attempt.run(lambda ctx: ctx.timings.update(load=2.0, compute=12.0, io=1.0))
    m = attempt.commit()
    assert m["utilisation"] == {"role": "scorer", "devices": utilisation.devices(), "device_type": "cpu",
                                "busy_s": 12.0, "allocated_s": 600.0, "queue_s": 0.0}  # local executor
    path = tmp_path / "r" / "iter_000000" / "score" / commit.MANIFEST
    assert json.loads(path.read_text())["utilisation"] == m["utilisation"]
    assert fake_clock.since() == 0.0  # the next stage of this process starts from this commit
    assert m["opened_at"] <= m["committed_at"]
    m = run_stage("generate", tmp_path / "r", 0, lambda ctx: ctx.timings.update(compute=5.0), startup=0.0)
    assert (m["utilisation"]["busy_s"], "beside" in m["utilisation"]) == (5.0, False)


def test_a_stage_run_beside_another_counts_no_device_time_and_leaves_the_clock(tmp_path):
    """pins (`beside`, hpcrl.resident_scores): a score run on a thread beside the generation counting
    its rewards as busy (the devices would be busy twice over) or taking the allocated time the
    generation beside it is to have."""
    now = [1600.0]
    clock = utilisation.reset_clock(start=1000.0, now=lambda: now[0])
    try:
        synthetic_run.write_config(tmp_path / "r", iterations=1)
        body = lambda ctx: ctx.timings.update(load=2.0, compute=12.0, io=1.0)  # noqa: E731
        m = run_stage("score", tmp_path / "r", 0, body, startup=0.0, beside=True)
        assert m["utilisation"] == {"role": "scorer", "devices": utilisation.devices(),
                                    "device_type": "cpu", "busy_s": 0.0, "allocated_s": 0.0, "queue_s": 0.0,
                                    "beside": True}
        assert m["timings"]["compute"] == 12.0  # still shown as the stage's own time
        now[0] = 1700.0
        assert clock.take() == 700.0  # the generation's since its previous stage, this one's included
    finally:
        utilisation.reset_clock()


# ---- reports -------------------------------------------------------------------------------------

def test_per_iteration_and_run_usage_by_hand():
    per = utilisation.by_iteration(MANIFESTS)
    assert {k: {r: u.utilisation for r, u in roles.items()} for k, roles in per.items()} == {
        0: {"generator": 0.6, "scorer": 0.5, "trainer": 0.25},
        1: {"generator": 0.9, "scorer": 0.2, "trainer": 0.75}}
    assert (per[0]["trainer"].busy, per[0]["trainer"].allocated, per[0]["trainer"].idle) == (1800, 7200, 5400)
    run = utilisation.by_role(MANIFESTS)
    assert list(run) == ["generator", "scorer", "trainer"]
    assert [(u.busy, u.allocated, u.utilisation) for u in run.values()] == [
        (2700, 3600, 0.75), (1008, 2880, 0.35), (7200, 14400, 0.5)]
    gpus = utilisation.total(run)
    assert (gpus.device_type, gpus.devices, gpus.busy, gpus.allocated, gpus.utilisation, gpus.idle) == \
        ("gpu", 3, 9900, 18000, 0.55, 8100)
    assert utilisation.cell(per[0]) == "gen 60% score 50% train 25%"
    assert utilisation.summary_lines(run) == [
        "utilisation (device-hours busy / allocated; idle = allocated - busy):",
        "  generator  1 GPU     busy 0.75 / 1.00 GPU-h (75%), idle 0.25; queue wait 0.00 h",
        "  scorer     4 cores   busy 0.28 / 0.80 core-h (35%), idle 0.52; queue wait 0.00 h",
        "  trainer    2 GPUs    busy 2.00 / 4.00 GPU-h (50%), idle 2.00; queue wait 0.00 h",
        "  all GPUs   3 GPUs    busy 2.75 / 5.00 GPU-h (55%), idle 2.25; queue wait 0.00 h"]


def test_old_manifests_show_a_dash():
    old = {k: v for k, v in MANIFESTS[0].items() if k != "utilisation"}
    assert utilisation.by_role([old, None]) == {} and utilisation.cell({}) == "-"
    assert utilisation.summary_lines({}) == ["utilisation: - (not recorded by this run's stages)"]
    assert tracking.stage_metrics("generate", old) == {"timing_s/generate": 1800.0}


def test_slurm_queue_waits_are_read_from_sacct_once_per_job(monkeypatch):
    from hpcrl import slurm

    staged = [manifest(0, s, None, job) for s, job in (("generate", "11"), ("score", "12"), ("update", "13"))]
    rows = {"11": {"Submit": "2026-01-01T10:00:00", "Eligible": "2026-01-01T10:00:00",
                   "Start": "2026-01-01T10:01:00"},
            "12": {"Submit": "2026-01-01T10:00:00", "Eligible": "2026-01-01T10:30:00",  # behind 11 (afterok)
                   "Start": "2026-01-01T10:30:30"},
            "13": {"Submit": "2026-01-01T10:00:00", "Eligible": "Unknown", "Start": "Unknown"}}
    asked = []
    monkeypatch.setattr(slurm, "accounting", lambda ids: asked.append(ids) or rows)
    run = utilisation.run_usage(staged)
    assert asked == [["11", "12", "13"]]
    assert [u.queue_s for u in run.values()] == [60.0, 30.0, None]
    assert utilisation.total(run).queue_s == 60.0  # the GPU roles' jobs
    # resident: one job for both roles, its wait counted once in the total; score on the generator
    resident = [manifest(0, s, None, "7", "resident") for s in ("generate", "score", "update")]
    resident[1]["utilisation"].update(devices=1, device_type="gpu")
    usage = utilisation.by_role(resident, {"7": 120.0})
    assert list(usage) == ["generator", "trainer"] and [u.queue_s for u in usage.values()] == [120.0, 120.0]
    assert utilisation.total(usage).queue_s == 120.0
    assert (usage["generator"].busy, usage["generator"].allocated) == (1080 + 180, 1800 + 360)


def test_mlflow_metrics_per_stage_per_iteration_and_for_the_run(tmp_path):
    out = tracking.stage_metrics("update", MANIFESTS[2])
    assert {k: v for k, v in out.items() if k.startswith("util/")} == {
        "util/update/busy_s": 1800.0, "util/update/allocated_s": 7200.0, "util/update/idle_s": 5400.0,
        "util/update/devices": 2.0, "util/update/utilisation": 0.25, "util/update/queue_s": 0.0}
    run = _run(tmp_path)
    it = tracking.iteration_utilisation(run, 1)
    assert (it["util/generator/utilisation"], it["util/scorer/utilisation"], it["util/trainer/utilisation"]) \
        == (0.9, 0.2, 0.75)
    total = utilisation.run_metrics(utilisation.run_manifests(run))
    assert [total[f"util/run/all/{k}"] for k in ("busy_h", "allocated_h", "utilisation")] == [2.75, 5.0, 0.55]
    assert total["util/run/trainer/allocated_s"] == 14400 and total["util/run/scorer/utilisation"] == 0.35


# ---- status and inspect on a run directory -------------------------------------------------------

def _run(root):
    """The hand-computed case committed in a run directory, and iteration 2 (the final validation)
    with a generate committed by an hpcrl that recorded no utilisation."""
    exp = synthetic_run.write_config(root / "r", iterations=2)
    run, _ = runs.open_run(root / "r")
    for m in [*MANIFESTS, {k: v for k, v in manifest(0, "generate").items() if k != "utilisation"}
              | {"iteration": 2}]:
        out = run.stage_dir(m["iteration"], m["stage"])
        if not commit.is_committed(out):
            commit.commit(out, commit.StageWriter(commit.fresh_temp_dir(out)),
                          {k: v for k, v in m.items() if k != "metrics"})
    assert exp.run.iterations == 2
    return run


def _invoke(*args):
    from click.testing import CliRunner

    from hpcrl.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_status_shows_each_iterations_utilisation_and_the_run_summary(tmp_path):
    run = _run(tmp_path)
    lines = _invoke("status", run.root)
    assert lines[0].split() == ["iter", "generate", "score", "update", "reward", "val", "util"]
    assert lines[1].endswith("gen 60% score 50% train 25%") and lines[1].split()[0] == "0"
    assert lines[2].endswith("gen 90% score 20% train 75%")
    assert lines[3].split()[0] == "2" and lines[3].endswith("  -")  # committed without a record
    at = lines.index(utilisation.summary_lines(utilisation.by_role(MANIFESTS))[0])
    assert lines[at + 3:at + 5] == [
        "  trainer    2 GPUs    busy 2.00 / 4.00 GPU-h (50%), idle 2.00; queue wait 0.00 h",
        "  all GPUs   3 GPUs    busy 2.75 / 5.00 GPU-h (55%), idle 2.25; queue wait 0.00 h"]


def test_inspect_shows_each_roles_utilisation_and_the_run_summary(tmp_path):
    run = _run(tmp_path)
    _, exp = runs.open_run(run.root)
    df = run_inspect.iteration_table(run, exp)
    assert df["util/generator/utilisation"].to_list() == [0.6, 0.9, None]
    assert df["util/trainer/allocated_s"].to_list() == [7200.0, 7200.0, None]
    assert df["util/scorer/gpu"].to_list() == [0.0, 0.0, None]
    lines = _invoke("inspect", run.root)
    header = lines[0].split()
    assert header[-3:] == ["gen_util", "score_util", "train_util"]
    assert lines[1].split()[-3:] == ["60%", "50%", "25%"] and lines[3].split()[-3:] == ["-", "-", "-"]
    assert "  all GPUs   3 GPUs    busy 2.75 / 5.00 GPU-h (55%), idle 2.25" in lines
    rows = json.loads("\n".join(_invoke("inspect", run.root, "--format", "json")))
    assert rows[1]["util/trainer/busy_s"] == 5400.0 and rows[1]["util/scorer/utilisation"] == 0.2


def test_inspect_of_a_run_without_records_has_no_utilisation_columns(tmp_path):
    run = synthetic_run.make_run(tmp_path / "old", iterations=1, rows=16, val_rows=4, group_size=4)
    _, exp = runs.open_run(run.root)
    assert not [c for c in run_inspect.iteration_table(run, exp).columns if c.startswith("util/")]


def test_the_tracker_logs_each_iterations_roles_and_the_run_totals(tmp_path, monkeypatch):
    from hpcrl import plots

    run = _run(tmp_path)
    _, exp = runs.open_run(run.root)
    logged = []
    tracker = tracking.Tracker(run, exp)  # tracking disabled in the synthetic config: no MLflow store
    tracker.enabled = True
    monkeypatch.setattr(tracker, "log_metrics", lambda metrics, step: logged.append((step, metrics)))
    monkeypatch.setattr(plots, "write_plots", lambda *a: [])
    tracker.log_utilisation(run, 0)
    tracker.log_plots(run, exp)
    (step0, iteration), (last, totals) = logged
    assert (step0, iteration["util/trainer/utilisation"], iteration["util/scorer/busy_s"]) == (0, 0.25, 720)
    assert (last, totals["util/run/all/utilisation"], totals["util/run/generator/busy_s"]) == (2, 0.55, 2700)


def _rank(rank: int, port: int, root: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        attempt = OpenStage("update", root, 0, rank, 2, startup=0.0)
        attempt.run(lambda ctx: ctx.timings.update(compute=5.0))
        m = attempt.commit()
        out.put((rank, None if m is None else m["utilisation"]))
    finally:
        dist.destroy_process_group()


def test_a_multi_rank_stage_counts_the_devices_its_ranks_share_once(tmp_path):
    """Both ranks run on this host's cores: the gathered record counts them once, not twice."""
    import multiprocessing as mp

    from hpcrl.distributed import free_port

    synthetic_run.write_config(tmp_path / "r", iterations=1)
    ctx = mp.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path / "r"), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got[1] is None
    assert {k: got[0][k] for k in ("role", "devices", "device_type", "busy_s", "queue_s")} == {
        "role": "trainer", "devices": utilisation.devices(), "device_type": "cpu", "busy_s": 5.0,
        "queue_s": 0.0}
