"""Reading job accounting from Slurm (sacct) for `hpcrl status`."""

from __future__ import annotations

import datetime
import subprocess

FIELDS = ("JobID", "State", "Submit", "Start", "Elapsed", "NodeList")


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
    rows = {}
    for line in out.stdout.splitlines():
        values = dict(zip(FIELDS, line.split("|"), strict=False))
        rows[values["JobID"]] = values
    return rows


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
