"""`hpcrl pin`: keep a policy version of a run whatever its retention rules (hpcrl.pruning)."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("version", type=click.IntRange(0))
@click.option("--unpin", is_flag=True, help="Let retention prune the version again.")
def pin(run_dir: Path, version: int, unpin: bool) -> None:
    """Keep policy VERSION of RUN_DIR from retention ([run.retention]); --unpin lets it go again.

    A pinned version keeps its weights (policy/, and critic/ for ppo); its trainer state follows
    run.retention.keep_trainer_states. A version already pruned cannot be pinned."""
    from hpcrl import commit, pruning, runs
    from hpcrl.config import ConfigError

    try:
        run, exp = runs.open_run(run_dir)
        if version == 0:
            click.echo("policy version 0 is the run's model.path: it is never pruned")
            return
        if version > exp.run.iterations:
            raise ConfigError(f"policy version {version} is out of range: this run has versions "
                              f"0..{exp.run.iterations}")
        click.echo(pruning.pin(run, version, unpin))
    except (ConfigError, commit.PrunedError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
