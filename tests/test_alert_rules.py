"""The alert rules at their boundaries (hpcrl.alerts), each message in full, the report `status`
shows, and the webhook's request as a server receives it. tests/test_alerts.py runs the rules in a
controller."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from hpcrl import alerts
from hpcrl.config_training import AlertsConfig, AlgorithmConfig
from hpcrl.stage_kinds import GENERATE, SCORE, UPDATE

KL = "actor/kl_loss"


def fired(cfg: AlertsConfig, stage: str, metrics: dict, history: list[dict] = (), total: float | None = None):
    manifest = {"metrics": metrics, **({"timings": {"total": total}} if total is not None else {})}
    return [(a.rule, a.message) for a in alerts.evaluate(cfg, KL, stage, 3, manifest, list(history))]


def past(n: int = 5, total: float | None = None, **metrics) -> list[dict]:
    return [{"metrics": metrics, **({"timings": {"total": total}} if total is not None else {})}] * n


def test_a_threshold_fires_above_it_not_at_it():
    at = {"kl_max": 0.5, "entropy_min": 0.1, "clip_ratio_max": 0.5, "sync_logp_diff": 1e-3}
    cfg = AlertsConfig(**at, kl_spike=0)
    assert fired(cfg, UPDATE, {KL: 0.5, "actor/entropy": 0.1}) == []
    assert fired(cfg, GENERATE, {"response_length/clip_ratio": 0.5, "sync/logp_diff": 1e-3}) == []
    assert fired(cfg, UPDATE, {KL: 0.51, "actor/entropy": 0.09}) == [
        ("kl_max", "actor/kl_loss = 0.51 is above 0.5"),
        ("entropy_min", "actor/entropy = 0.09 is below 0.1 (entropy collapse)")]
    assert fired(cfg, GENERATE, {"response_length/clip_ratio": 0.51, "sync/logp_diff": 2e-3}) == [
        ("clip_ratio_max", "51% of the training responses stopped at generate.max_tokens (above 50%)"),
        ("sync_logp_diff", "sync/logp_diff = 0.002 is above 0.001: vLLM's weights drift from the trainer's")]


def test_the_median_rules_at_their_boundaries_and_below_one():
    history = past(**{KL: 0.125})
    assert fired(AlertsConfig(kl_spike=4), UPDATE, {KL: 0.5}, history) == []  # 4 x the median: not above
    assert fired(AlertsConfig(kl_spike=4), UPDATE, {KL: 0.51}, history) == [
        ("kl_spike", "actor/kl_loss = 0.51 is above 4 x its median 0.125 of the last 5 iterations")]
    assert [r for r, _ in fired(AlertsConfig(kl_spike=0.5), UPDATE, {KL: 0.07}, history)] == ["kl_spike"]
    rewards = past(3, **{"critic/score/mean": 0.0})
    cfg = AlertsConfig(reward_drop=0.25, window=3)
    assert fired(cfg, SCORE, {"critic/score/mean": -0.25}, rewards) == []
    assert fired(cfg, SCORE, {"critic/score/mean": -0.3}, rewards) == [
        ("reward_drop", "critic/score/mean = -0.3 is more than 0.25 below its median 0 of the last 3 "
                        "iterations (reward collapse)")]


def test_a_stall_is_the_factor_times_the_median_and_a_minute():
    history = past(total=20.0)
    cfg = AlertsConfig(stall=2, kl_spike=0)
    assert fired(cfg, GENERATE, {}, history, total=100.0) == []  # 2 x 20 + 60: not above
    assert fired(cfg, GENERATE, {}, history, total=101.0) == [
        ("stall", "took 101 s, more than 2 x its median 20.0 s of the last 5 iterations plus 60 s")]
    assert [r for r, _ in fired(AlertsConfig(stall=0.5), GENERATE, {}, history, total=71.0)] == ["stall"]
    assert fired(cfg, GENERATE, {}, past(4, total=20.0), total=500.0) == []  # 4 of 5: no median yet
    assert fired(cfg, GENERATE, {}, history) == []  # a manifest without timings


def test_history_without_metrics_or_timings_is_no_baseline():
    old = [{}] * 5  # manifests of an hpcrl that recorded neither
    assert fired(AlertsConfig(), UPDATE, {KL: 9.0}, old, total=900.0) == []
    assert fired(AlertsConfig(), SCORE, {"critic/score/mean": -9.0}, old) == []
    assert alerts.evaluate(AlertsConfig(), KL, UPDATE, 3, {}, old) == []  # nor the stage's own


def test_non_finite_metrics_are_named_each_and_the_critics_nan_is_allowed():
    metrics = {"b": float("inf"), "a": float("nan"), "critic/explained_variance": float("nan"), "c": 1.0}
    assert fired(AlertsConfig(kl_spike=0), GENERATE, metrics) == [
        ("non_finite", "non-finite metrics: a = nan, b = inf")]
    assert fired(AlertsConfig(), GENERATE, {}) == fired(AlertsConfig(), GENERATE, {"c": 2.0}) == []


def test_the_kl_judged_follows_where_the_penalty_goes():
    algorithm = lambda coef, mode: AlgorithmConfig(name="ppo", kl={"coef": coef, "mode": mode})  # noqa: E731
    assert alerts.kl_metric(algorithm(0.0, "reward")) == "actor/ppo_kl"
    assert alerts.kl_metric(algorithm(0.1, "reward")) == "actor/reward_kl_penalty"
    assert alerts.kl_metric(algorithm(0.1, "loss")) == "actor/kl_loss"


def test_an_alert_line_says_whether_it_stops_the_run():
    alert = alerts.Alert("kl_max", UPDATE, 4, "actor/kl_loss = 0.9 is above 0.5", False)
    assert alert.line() == "ALERT (warning) iteration 4 update: kl_max: actor/kl_loss = 0.9 is above 0.5"
    stops = alerts.Alert("kl_max", UPDATE, 4, "m", True)
    assert stops.line() == "ALERT (stops the run) iteration 4 update: kl_max: m"


def _raised(n: int) -> list[dict]:
    return [alerts.Alert("stall", GENERATE, k, f"took {k} s", False).as_dict() for k in range(n)]


def test_the_report_shows_the_last_alerts_and_why_the_run_stopped():
    assert alerts.report({}, "/runs/r", complete=False) == []
    assert alerts.report({"alerts": _raised(5)}, "/runs/r", False)[0] == \
        "ALERT (warning) iteration 0 generate: stall: took 0 s"  # five: all of them, no header
    lines = alerts.report({"alerts": _raised(7)}, "/runs/r", False)
    assert lines[0] == "7 alerts, the last 5:" and lines[1].endswith("took 2 s") and len(lines) == 6
    failed = {"at": "2026-12-05T10:00:00", "stage": "update", "iteration": 4, "reason": "CUDA error",
              "log": "/runs/r/logs/9.err"}
    assert alerts.report({"stopped": failed}, "/runs/r", False) == [
        "STOPPED at 2026-12-05T10:00:00: stage update of iteration 4 failed: CUDA error (log: "
        "/runs/r/logs/9.err); fix the cause, then `hpcrl resume /runs/r`"]
    resident = {**failed, "stage": "resident"}
    assert alerts.report({"stopped": resident}, "/runs/r", False)[0].startswith(
        "STOPPED at 2026-12-05T10:00:00: the resident job of iteration 4 failed: CUDA error")
    assert alerts.report({"stopped": failed}, "/runs/r", complete=True) == []  # resumed and finished since


class _Receiver(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802  (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.requests.append((self.path, self.headers["Content-Type"], json.loads(body)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"x" * (1 << 16) + b"y" * 100)  # a chatty server: the answer is read in part

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Receiver.requests = []
    yield f"http://127.0.0.1:{server.server_port}", _Receiver.requests
    server.shutdown()


def test_the_webhook_gets_the_alert_as_json_and_a_failure_is_named(receiver):
    url, requests = receiver
    assert alerts.post(f"{url}/hook", {"rule": "stall", "iteration": 3}, 5.0) is None
    assert requests == [("/hook", "application/json", {"rule": "stall", "iteration": 3})]
    assert alerts.post("not a url", {}, 5.0) == "ValueError: unknown url type: 'not a url'"
    assert alerts.post("http://127.0.0.1:9/", {}, 5.0).startswith("URLError: ")


def test_a_webhook_that_never_answers_is_given_up_after_its_timeout():
    import socket
    import time

    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        t0 = time.monotonic()
        error = alerts.post(f"http://127.0.0.1:{silent.getsockname()[1]}/", {}, 0.3)
        assert error is not None and "timed out" in error and time.monotonic() - t0 < 5
