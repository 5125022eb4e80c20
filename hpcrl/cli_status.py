"""`hpcrl status`: what is committed and what is running in a run directory."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import click

from hpcrl import commit, plan, utilisation
from hpcrl.cli_errors import fail as _fail
from hpcrl.config import ConfigError
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import ORDER


def _stage_state(run: RunDir, k: int, stage: str) -> str:
    d = run.stage_dir(k, stage)
    if commit.is_committed(d):
        m = commit.read_manifest(d)
        return f"done {m['timings'].get('total', 0):.1f}s"
    lock = d.parent / f".{stage}.lock"
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "RUNNING"
        finally:
            os.close(fd)
    return "-"


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--verify", is_flag=True, help="Check every committed file against its manifest checksums.")
def status(run_dir: Path, verify: bool) -> None:
    """What is committed and what is running in RUN_DIR."""
    from hpcrl import runs

    try:
        run, exp = runs.open_run(run_dir)
    except ConfigError as err:
        _fail(str(err))
    stages = ORDER
    click.echo(f"{'iter':>6}  " + "  ".join(f"{s:<12}" for s in stages) + "  reward   val      util")
    problems, manifests = [], []
    for k in range(exp.run.iterations + 1):
        kinds = plan.stages_of(exp, k)
        if not kinds:
            continue
        cells = [(_stage_state(run, k, s) if s in kinds else "") for s in stages]
        metrics, found = {}, []
        for s in kinds:
            m = commit.read_manifest(run.stage_dir(k, s))
            if m:
                found.append(m)
                metrics.update(m["metrics"])
                if verify:
                    problems += commit.verify(run.stage_dir(k, s))
        manifests += found
        reward = f"{metrics['critic/score/mean']:.3f}" if "critic/score/mean" in metrics else "-"
        val = f"{metrics['val/score']:.3f}" if "val/score" in metrics else "-"
        util = utilisation.cell(utilisation.by_role(found))  # busy / allocated device-seconds per role
        click.echo(f"{k:>6}  " + "  ".join(f"{c:<12}" for c in cells) + f"  {reward:<7}  {val:<7}  {util}")
    nxt = plan.next_stage(run, exp)
    click.echo("complete" if nxt is None else f"next: iteration {nxt[0]} {nxt[1]}")
    for line in utilisation.summary_lines(utilisation.run_usage(manifests)):
        click.echo(line)
    from hpcrl import alerts, pruning

    click.echo(pruning.status_line(run))

    for line in alerts.report(run.read_run_info(), run.root, nxt is None):
        click.echo(line)
    if exp.executor.kind == "slurm" and run.jobs():
        from hpcrl.slurm import job_table

        click.echo("\nSlurm jobs:")
        click.echo(job_table(run.jobs()))
    for p in problems:
        click.echo(f"CORRUPT: {p}", err=True)
    if problems:
        sys.exit(1)
