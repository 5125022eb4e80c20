"""What a restarted controller does with the jobs its predecessor left in Slurm's queue.

A controller job is requeued at its time limit, preempted, or started again by `hpcrl resume`
while the stage jobs it submitted are still queued or running. Submitting those stages again
would put a duplicate behind the stage lock, holding its allocation until it finds the stage
committed. So a new controller reads jobs.jsonl and asks Slurm which of its jobs are alive: the
live jobs of the first pending stages, in order, are adopted (waited for, never resubmitted); a
live job of a later pending stage, behind a stage that has no live job, waits on a dependency
that will never be met and is cancelled.
"""

from __future__ import annotations

from hpcrl import slurm

LIVE = slurm.LIVE


def latest_jobs(records: list[dict]) -> dict[tuple[int | None, str], dict]:
    """The last job recorded for each (iteration, role) in jobs.jsonl."""
    return {(r["iteration"], r["role"]): r for r in records}


def plan(pending: list[tuple[int, str]], records: list[dict], states: dict[str, str]) -> tuple[list[dict],
                                                                                             list[str]]:
    """(records of the jobs to adopt, in the order of `pending`; ids of the jobs to cancel).

    `pending` are the uncommitted (iteration, stage) pairs in run order; `states` maps a job id to
    its Slurm state. Adopted: the live jobs of the longest run of pending stages from the first,
    each with its own live job. Cancelled: the live jobs of the pending stages after that run."""
    latest = latest_jobs(records)
    adopt: list[dict] = []
    for key in pending:
        record = latest.get(key)
        if record is None or _state(states, record) not in LIVE:
            break
        adopt.append(record)
    stranded = [latest[key]["job_id"] for key in pending[len(adopt):]
                if key in latest and _state(states, latest[key]) in LIVE]
    return adopt, stranded


def live_resident(records: list[dict], states: dict[str, str]) -> dict | None:
    """The resident job of the run, if the last one submitted is still alive."""
    record = latest_jobs(records).get((None, "resident"))
    return record if record is not None and _state(states, record) in LIVE else None


def states_of(records: list[dict]) -> dict[str, str]:
    """Slurm's state of every recorded job (sacct; a job it no longer knows is absent)."""
    accounting = slurm.accounting([r["job_id"] for r in records])
    return {job_id: a.get("State", "") for job_id, a in accounting.items()}


def _state(states: dict[str, str], record: dict) -> str:
    """The bare state word: sacct writes "CANCELLED by 0"."""
    return (states.get(record["job_id"]) or "").split(" ")[0]
