"""Alerts ([alerts], hpcrl.alerts): each rule fires on its injected fault and not on healthy
metrics; the controller reports them, stops the run on a rule in alerts.stop, and `status` and
`inspect` say so; the webhook receives each alert."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from hpcrl import alerts
from hpcrl.config_training import AlertsConfig
from hpcrl.controller import AlertStopError, Controller
from hpcrl.stage_kinds import GENERATE, SCORE, UPDATE

KL = "actor/kl_loss"


def _manifest(total: float = 10.0, **metrics) -> dict:
    return {"metrics": metrics, "timings": {"total": total}}


def _history(n: int = 5, total: float = 10.0, **metrics) -> list[dict]:
    return [_manifest(total, **metrics) for _ in range(n)]


HEALTHY = {  # stage: (metrics of a healthy iteration, its history's)
    UPDATE: ({KL: 0.02, "actor/entropy": 0.5, "critic/explained_variance": float("nan")}, {KL: 0.01}),
    SCORE: ({"critic/score/mean": 0.6}, {"critic/score/mean": 0.7}),
    GENERATE: ({"response_length/clip_ratio": 0.2, "sync/logp_diff": 1e-6}, {}),
}

# rule: (config, stage, the faulty iteration's metrics, its history's metrics, its seconds)
FAULTS = {
    "non_finite": ({}, UPDATE, {KL: float("nan"), "actor/grad_norm": float("inf")}, {KL: 0.01}, 10.0),
    "kl_max": ({"kl_max": 0.5}, UPDATE, {KL: 0.8}, {KL: 0.7}, 10.0),
    "kl_spike": ({}, UPDATE, {KL: 0.2}, {KL: 0.01}, 10.0),
    "entropy_min": ({"entropy_min": 0.05}, UPDATE, {"actor/entropy": 0.01}, {}, 10.0),
    "reward_drop": ({}, SCORE, {"critic/score/mean": 0.1}, {"critic/score/mean": 0.7}, 10.0),
    "clip_ratio_max": ({}, GENERATE, {"response_length/clip_ratio": 0.99}, {}, 10.0),
    "sync_logp_diff": ({"sync_logp_diff": 1e-5}, GENERATE, {"sync/logp_diff": 5e-5}, {}, 10.0),
    "stall": ({}, GENERATE, {}, {}, 200.0),
}


@pytest.mark.parametrize("rule", list(FAULTS))
def test_each_rule_fires_on_its_fault_and_only_then(rule):
    overrides, stage, bad, past, seconds = FAULTS[rule]
    cfg = AlertsConfig(**overrides, stop=[rule])
    [alert] = alerts.evaluate(cfg, KL, stage, 7, _manifest(seconds, **bad), _history(**past))
    assert (alert.rule, alert.stage, alert.iteration, alert.stops) == (rule, stage, 7, True)
    good, good_past = HEALTHY[stage]
    assert alerts.evaluate(cfg, KL, stage, 7, _manifest(**good), _history(**good_past)) == []
    warned = alerts.evaluate(AlertsConfig(**overrides, stop=[]), KL, stage, 7, _manifest(seconds, **bad),
                             _history(**past))
    assert [(a.rule, a.stops) for a in warned] == [(rule, False)]


def test_rules_off_and_medians_that_wait_for_their_window():
    off = AlertsConfig(kl_spike=0, reward_drop=0, clip_ratio_max=1, stall=0)
    for rule in ("kl_spike", "reward_drop", "clip_ratio_max", "stall"):
        _, stage, bad, past, seconds = FAULTS[rule]
        assert alerts.evaluate(off, KL, stage, 7, _manifest(seconds, **bad), _history(**past)) == [], rule
        short = alerts.evaluate(AlertsConfig(), KL, stage, 2, _manifest(seconds, **bad), _history(2, **past))
        assert rule == "clip_ratio_max" or short == [], rule  # 2 of 5 iterations: no median yet
    # a KL median of 0 (the policy did not move yet, e.g. critic warmup) is no baseline
    assert alerts.evaluate(AlertsConfig(), KL, UPDATE, 7, _manifest(**{KL: 0.5}), _history(**{KL: 0.0})) == []
    # a stall needs a minute beyond the factor: short stages vary a lot
    assert alerts.evaluate(AlertsConfig(), KL, GENERATE, 7, _manifest(59.0), _history(total=1.0)) == []
    assert alerts.kl_metric(_algorithm(0.0, "loss")) == "actor/ppo_kl"
    assert alerts.kl_metric(_algorithm(0.1, "loss")) == "actor/kl_loss"


def _algorithm(coef: float, mode: str):
    from hpcrl.config_training import AlgorithmConfig

    return AlgorithmConfig(name="ppo", kl={"coef": coef, "mode": mode})


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802  (http.server's name)
        self.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hook.received = []
    yield f"http://127.0.0.1:{server.server_port}/hook", _Hook.received
    server.shutdown()


def _inject(run, k: int, stage: str, **metrics) -> dict:
    """Rewrite a committed manifest's metrics (a fault injected into a finished synthetic stage)."""
    path = run.stage_dir(k, stage) / "_COMMIT.json"
    manifest = json.loads(path.read_text())
    manifest["metrics"].update(metrics)
    path.write_text(json.dumps(manifest))
    return manifest


def test_the_controller_reports_warns_and_stops_and_status_says_why(tmp_path, webhook):
    from tests.synthetic_run import make_run

    url, received = webhook
    from hpcrl import config

    run = make_run(tmp_path / "alerted", iterations=3, rows=32)
    alerting = {"alerts.kl_max": 0.5, "alerts.stop": ["non_finite", "kl_max"], "alerts.webhook": url,
                "tracking.enabled": False}
    exp = config.with_overrides(config.load(run.config_path), alerting, "test")
    lines: list[str] = []
    controller = Controller(run, exp, echo=lines.append, show_progress=False)
    from hpcrl.tracking import Tracker

    tracker = Tracker(run, exp)
    controller._after_commit(tracker, 1, GENERATE)  # healthy: nothing
    assert not any("ALERT" in line for line in lines)
    manifest = _inject(run, 1, SCORE, **{"critic/score/mean": float("inf")})
    with pytest.raises(AlertStopError, match="non_finite"):  # always checked, stops by default
        controller._check_alerts(tracker, 1, SCORE, manifest)
    _inject(run, 1, SCORE, **{"critic/score/mean": 0.5})
    manifest = _inject(run, 2, UPDATE, **{"actor/ppo_kl": 0.9})
    with pytest.raises(AlertStopError, match=r"kl_max: actor/ppo_kl = 0.9 is above 0.5"):
        controller._check_alerts(tracker, 2, UPDATE, manifest)
    assert [line.split(":")[0] for line in lines if line.startswith("ALERT")] == [
        "ALERT (stops the run) iteration 1 score", "ALERT (stops the run) iteration 2 update"]
    assert [(a["rule"], a["iteration"]) for a in received] == [("non_finite", 1), ("kl_max", 2)]
    assert received[1]["run"] == "alerted" and received[1]["stops"] is True
    recorded = run.read_run_info()
    assert [a["rule"] for a in recorded["alerts"]] == ["non_finite", "kl_max"]
    assert recorded["stopped"]["alert"] == "kl_max"

    for command in ("status", "inspect"):
        out = subprocess.run([sys.executable, "-m", "hpcrl.cli", command, str(run.root)], capture_output=True,
                             text=True)
        said = "ALERT (stops the run) iteration 2 update: kl_max: actor/ppo_kl = 0.9"
        assert said in out.stdout, out.stderr
    # the synthetic run is complete; had it more to run, status would say where and why it stopped
    [stopped] = alerts.report(recorded, run.root, complete=False)[-1:]
    assert stopped.startswith(f"STOPPED at {recorded['stopped']['at']} by alert kl_max after stage update "
                              "of iteration 2: kl_max: actor/ppo_kl = 0.9 is above 0.5; fix the cause (or "
                              "[alerts])")
    assert all(not line.startswith("STOPPED") for line in alerts.report(recorded, run.root, complete=True))


def test_the_plots_are_written_every_plot_every_iterations_and_once_at_the_end(tmp_path, monkeypatch):
    """A resident run may be complete while the controller still logs its earlier iterations: the
    plots come at every tracking.plot_every-th iteration and once for the end. pins: a plot written
    for every iteration logged after the end (1.7 s each on 2 cores)."""
    from hpcrl import config, plan
    from hpcrl.tracking import Tracker
    from tests.synthetic_run import make_run

    run = make_run(tmp_path / "plotted", iterations=5, rows=16)  # complete: nothing left to run
    exp = config.with_overrides(config.load(run.config_path), {"tracking.plot_every": 2,
                                                               "tracking.enabled": False}, "test")
    tracker, plotted = Tracker(run, exp), []
    monkeypatch.setattr(tracker, "log_plots", lambda r, e: plotted.append(k))
    controller = Controller(run, exp, echo=lambda line: None, show_progress=False)
    for k in range(exp.run.iterations + 1):
        if stages := plan.stages_of(exp, k):
            controller._after_commit(tracker, k, stages[-1])
    assert plotted == [0, 1, 3, 5]  # the end (seen at 0), then every 2nd; 5: the final validation


def test_the_controller_looks_for_the_end_through_its_drive_loops_view(tmp_path, monkeypatch):
    """Each iteration the controller logs asks whether the run is complete: it asks the drive loop's
    view of the commits, which looks again only at the stages it has not seen committed, and it
    reads no sample tables when tracking is off. pins: a fresh look at every stage of the run
    per iteration (a run of N iterations then costs N^2 stats), and the samples read for nothing."""
    from hpcrl import commit, config, plan
    from hpcrl.tracking import Tracker
    from tests.synthetic_run import make_run

    run = make_run(tmp_path / "seen", iterations=5, rows=16)  # complete
    exp = config.with_overrides(config.load(run.config_path), {"tracking.enabled": False}, "test")
    tracker = Tracker(run, exp)
    plotted = []
    monkeypatch.setattr(tracker, "log_plots", lambda r, e: plotted.append(k))
    controller = Controller(run, exp, echo=lambda line: None, show_progress=False)
    controller.progress = plan.Progress(run, exp)
    assert controller.progress.pending() == []  # the drive loop has seen every commit
    looked, read = [], []
    monkeypatch.setattr(commit, "is_committed", lambda d: looked.append(d) or True)
    monkeypatch.setattr(commit, "read_table", lambda *a, **kw: read.append(a))
    for k in range(exp.run.iterations):
        for stage in plan.stages_of(exp, k):
            controller._after_commit(tracker, k, stage)
    assert plotted == [0] and looked == [] and read == []


def test_an_unreachable_webhook_is_reported_and_does_not_stop_the_run():
    error = alerts.post("http://127.0.0.1:9/nowhere", {"rule": "kl_max"}, timeout_s=2)
    assert error is not None and ("Connection refused" in error or "URLError" in error)


def test_the_run_s_end_is_posted_to_the_notify_webhook(tmp_path, webhook, monkeypatch, tiny_task):
    """[executor.notify] webhook: once when a run completes, once with the reason when it stops."""
    from hpcrl import config, executors
    from tests.synthetic_run import make_run

    url, received = webhook
    run = make_run(tmp_path / "notified", iterations=1, rows=16, policy_from=tiny_task / "model")
    exp = config.with_overrides(config.load(run.config_path), {"executor.notify.webhook": url,
                                                               "tracking.enabled": False}, "test")
    Controller(run, exp, echo=lambda line: None, show_progress=False).run_all()  # nothing left to run
    assert received == [{"run": "notified", "status": "completed", "reason": ""}]

    def refuse(run, exp):
        raise FloatingPointError("the update of iteration 0 produced a non-finite gradient norm")

    monkeypatch.setattr(executors, "make", refuse)
    with pytest.raises(FloatingPointError):
        Controller(run, exp, echo=lambda line: None, show_progress=False).run_all()
    assert received[1] == {"run": "notified", "status": "stopped",
                           "reason": "FloatingPointError: the update of iteration 0 produced a non-finite "
                                     "gradient norm"}
