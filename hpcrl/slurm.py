"""Reading job accounting from Slurm (sacct) for `hpcrl status`."""

from __future__ import annotations

import datetime
import subprocess

FIELDS = ("JobID", "State", "Submit", "Start", "Elapsed", "NodeList", "NNodes", "AllocTRES", "Eligible")
# Job states (sacct) in which a job will still run or is running.
LIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
                  "COMPLETING", "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT"})


def _seconds(a: str, b: str) -> str:
    try:
        d = datetime.datetime.fromisoformat(b) - datetime.datetime.fromisoformat(a)
    except ValueError:
        return "-"
    return f"{d.total_seconds():.0f}s"


def accounting(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """sacct's view of the jobs: state, submit/start times, elapsed, nodes (latest attempt)."""
    if not job_ids:
        return {}
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", ",".join(FIELDS)],
                         capture_output=True, text=True, timeout=30)
    rows: dict[str, dict[str, str]] = {}
    arrays: dict[str, list[dict[str, str]]] = {}
    for line in out.stdout.splitlines():
        values = dict(zip(FIELDS, line.split("|"), strict=False))
        rows[values["JobID"]] = values
        leader, plus, _ = values["JobID"].partition("+")  # a heterogeneous job's component: "<id>+<n>"
        if plus and leader not in rows:
            rows[leader] = values  # the job itself: its first component
        leader, underscore, _ = values["JobID"].partition("_")  # an array's task "<id>_<n>", or "<id>_[a-b]"
        if underscore:
            arrays.setdefault(leader, []).append(values)
    for leader, tasks in arrays.items():  # the array itself: a task still alive if there is one
        rows.setdefault(leader, next((t for t in tasks if t["State"].split(" ")[0] in LIVE), tasks[-1]))
    return rows


def _elapsed_s(text: str) -> float:
    """sacct's [D-]HH:MM:SS in seconds."""
    days, _, clock = text.rpartition("-")
    parts = [float(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0.0)
    return (float(days) if days else 0.0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def lineage(job_id: str, stage: str) -> tuple[dict[str, float], dict[str, str]]:
    """MLflow metrics and tags for one stage job: queue wait, elapsed, GPU-hours, nodes."""
    a = accounting([job_id]).get(job_id)
    if not a:
        return {}, {}
    gpus = 0
    for item in a.get("AllocTRES", "").split(","):
        if item.startswith("gres/gpu="):
            gpus = int(item.split("=")[1])
    elapsed = _elapsed_s(a["Elapsed"]) if a.get("Elapsed") else 0.0
    wait = _seconds(a.get("Submit", ""), a.get("Start", ""))
    metrics = {f"slurm/{stage}/elapsed_s": elapsed, f"slurm/{stage}/gpu_hours": elapsed * gpus / 3600}
    if wait != "-":
        metrics[f"slurm/{stage}/queue_wait_s"] = float(wait[:-1])
    tags = {f"slurm.{stage}.last_job_id": job_id, f"slurm.{stage}.last_nodes": a.get("NodeList", "")}
    return metrics, tags


def job_table(jobs: list[dict]) -> str:
    info = accounting([j["job_id"] for j in jobs])
    lines = [f"{'job':>8}  {'role':<10} {'iter':>5}  {'state':<12} {'queue wait':>10} {'run time':>9}  node"]
    for j in jobs:
        a = info.get(j["job_id"], {})
        it = "-" if j["iteration"] is None else str(j["iteration"])
        lines.append(f"{j['job_id']:>8}  {j['role']:<10} {it:>5}  {a.get('State', '?'):<12} "
                     f"{_seconds(a.get('Submit', ''), a.get('Start', '')):>10} {a.get('Elapsed', '-'):>9}  "
                     f"{a.get('NodeList', '-')}")
    return "\n".join(lines)
