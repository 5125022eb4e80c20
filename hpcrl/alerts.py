"""Alerts: rules ([alerts]) evaluated on each committed stage's metrics, which warn or stop the run.

The controller (staged or resident) evaluates them after every commit, on that stage's manifest
and the same stage's manifests of the previous iterations (the running medians). A rule fires an
`Alert`: a line in the progress, an entry in run.json (shown by `hpcrl status` and `hpcrl
inspect`), an MLflow tag and, when configured, a JSON POST to a webhook. A rule listed in
`alerts.stop` stops the run after the stage that fired it; `hpcrl resume` continues (with a
changed [alerts], which a resumed run may change). `evaluate` is pure; its callers read the
manifests.

| rule | stage | fires when |
|---|---|---|
| non_finite | any | a metric is NaN or infinite (always checked; critic/explained_variance may be NaN) |
| kl_max | update | the iteration's KL is above `kl_max` |
| kl_spike | update | the KL is above `kl_spike` x its running median (when that is above 0) |
| entropy_min | update | actor/entropy is below `entropy_min` |
| reward_drop | score | the mean training reward is `reward_drop` below its running median |
| clip_ratio_max | generate | more than `clip_ratio_max` of the training responses hit max_tokens |
| sync_logp_diff | generate | the resident weight sync's probe difference is above `sync_logp_diff` |
| stall | any | the stage took `stall` x its running median plus a minute |
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass

from hpcrl.config_training import AlertsConfig, AlgorithmConfig
from hpcrl.stage_kinds import GENERATE, SCORE, UPDATE

NAN_ALLOWED = ("critic/explained_variance",)  # NaN when the batch's returns did not vary
STALL_FLOOR_S = 60.0


@dataclass(frozen=True)
class Alert:
    rule: str
    stage: str
    iteration: int
    message: str
    stops: bool

    def line(self) -> str:
        action = "stops the run" if self.stops else "warning"
        return f"ALERT ({action}) iteration {self.iteration} {self.stage}: {self.rule}: {self.message}"

    def as_dict(self) -> dict:
        return asdict(self)


def kl_metric(a: AlgorithmConfig) -> str:
    """The KL an iteration is judged by: to the reference when there is one, else old vs new policy."""
    if a.kl.coef <= 0:
        return "actor/ppo_kl"
    return "actor/reward_kl_penalty" if a.kl.mode == "reward" else "actor/kl_loss"


def _median(history: list[dict], key: str, window: int) -> float | None:
    values = [m["metrics"][key] for m in history[-window:] if key in m.get("metrics", {})]
    return statistics.median(values) if len(values) >= window else None


def _bounds(cfg: AlertsConfig, kl_key: str, stage: str, metrics: dict, history: list[dict]):
    """(rule, fired, message) of the threshold and median rules that apply to `stage`."""
    if stage == UPDATE and kl_key in metrics:
        kl, median = metrics[kl_key], _median(history, kl_key, cfg.window)
        yield "kl_max", cfg.kl_max > 0 and kl > cfg.kl_max, f"{kl_key} = {kl:.3g} is above {cfg.kl_max:g}"
        spiked = median is not None and median > 0 and kl > cfg.kl_spike * median  # 0: no baseline yet
        yield ("kl_spike", cfg.kl_spike > 0 and spiked,
               f"{kl_key} = {kl:.3g} is above {cfg.kl_spike:g} x its median {median or 0:.3g} of the last "
               f"{cfg.window} iterations")
    if stage == UPDATE and "actor/entropy" in metrics:
        ent = metrics["actor/entropy"]
        yield ("entropy_min", cfg.entropy_min > 0 and ent < cfg.entropy_min,
               f"actor/entropy = {ent:.3g} is below {cfg.entropy_min:g} (entropy collapse)")
    if stage == SCORE and "critic/score/mean" in metrics:
        reward, median = metrics["critic/score/mean"], _median(history, "critic/score/mean", cfg.window)
        dropped = median is not None and reward < median - cfg.reward_drop
        yield ("reward_drop", cfg.reward_drop > 0 and dropped,
               f"critic/score/mean = {reward:.3g} is more than {cfg.reward_drop:g} below its median "
               f"{median or 0:.3g} of the last {cfg.window} iterations (reward collapse)")
    if stage == GENERATE and "response_length/clip_ratio" in metrics:
        clipped = metrics["response_length/clip_ratio"]
        yield ("clip_ratio_max", cfg.clip_ratio_max < 1 and clipped > cfg.clip_ratio_max,
               f"{clipped:.0%} of the training responses stopped at generate.max_tokens "
               f"(above {cfg.clip_ratio_max:.0%})")
    if stage == GENERATE and "sync/logp_diff" in metrics:
        diff = metrics["sync/logp_diff"]
        yield ("sync_logp_diff", cfg.sync_logp_diff > 0 and diff > cfg.sync_logp_diff,
               f"sync/logp_diff = {diff:.3g} is above {cfg.sync_logp_diff:g}: vLLM's weights drift from the "
               "trainer's")


def evaluate(cfg: AlertsConfig, kl_key: str, stage: str, iteration: int, manifest: dict,
             history: list[dict]) -> list[Alert]:
    """The alerts a committed stage fires; `history` holds the same stage's manifests of the
    previous iterations, oldest first."""
    metrics = manifest.get("metrics", {})
    fired = []
    bad = sorted(k for k, v in metrics.items() if not math.isfinite(v) and k not in NAN_ALLOWED)
    if bad:
        fired.append(("non_finite", f"non-finite metrics: {', '.join(f'{k} = {metrics[k]}' for k in bad)}"))
    fired += [(rule, message) for rule, hit, message in _bounds(cfg, kl_key, stage, metrics, history) if hit]
    total = manifest.get("timings", {}).get("total")
    totals = [m["timings"]["total"] for m in history[-cfg.window:] if "total" in m.get("timings", {})]
    if cfg.stall > 0 and total is not None and len(totals) >= cfg.window:
        median = statistics.median(totals)
        if total > cfg.stall * median + STALL_FLOOR_S:
            fired.append(("stall", f"took {total:.0f} s, more than {cfg.stall:g} x its median {median:.1f} s "
                                   f"of the last {cfg.window} iterations plus {STALL_FLOOR_S:.0f} s"))
    return [Alert(rule, stage, iteration, message, rule in cfg.stop) for rule, message in fired]


def post(url: str, payload: dict, timeout_s: float) -> str | None:
    """POST `payload` as JSON; None when delivered, else why not (an alert never stops on it)."""
    import urllib.error
    import urllib.request

    body, headers = json.dumps(payload).encode(), {"Content-Type": "application/json"}
    try:  # a malformed URL too (an old run's config, which no check read) is a reason, never an error
        request = urllib.request.Request(url, body, headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read(1 << 16)
    except (urllib.error.URLError, OSError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def report(info: dict, run_root, complete: bool, last: int = 5) -> list[str]:
    """What `hpcrl status` and `hpcrl inspect` say of a run's alerts and of why it stopped (run.json)."""
    raised = info.get("alerts", [])
    lines = [Alert(a["rule"], a["stage"], a["iteration"], a["message"], a["stops"]).line()
             for a in raised[-last:]]
    if len(raised) > last:
        lines.insert(0, f"{len(raised)} alerts, the last {last}:")
    stop = info.get("stopped")
    if stop and not complete:
        if stop.get("alert"):
            what = f"alert {stop['alert']} after stage {stop['stage']} of iteration {stop['iteration']}"
            lines.append(f"STOPPED at {stop['at']} by {what}: {stop['reason']}; fix the cause (or [alerts]), "
                         f"then `hpcrl resume {run_root}`")
        else:
            where = "the resident job" if stop["stage"] == "resident" else f"stage {stop['stage']}"
            lines.append(f"STOPPED at {stop['at']}: {where} of iteration {stop['iteration']} failed: "
                         f"{stop['reason']} (log: {stop['log']}); fix the cause, then "
                         f"`hpcrl resume {run_root}`")
    return lines
