"""The `hpcrl` command line: submit, resume, status, doctor, ui, config."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import click

from hpcrl import cli_retention, cli_status, commit, config, plan, requeue
from hpcrl.cli_errors import Main
from hpcrl.cli_errors import fail as _fail
from hpcrl.config import ConfigError
from hpcrl.rundir import RunDir, RunLockedError
from hpcrl.stage_kinds import ORDER


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """hpcrl: RL post-training of language models as a Slurm batch workflow."""


def _drive(run: RunDir, exp: config.Experiment) -> None:
    from hpcrl.controller import Controller, StageFailedError

    click.echo(f"run directory: {run.root}")
    try:
        Controller(run, exp, echo=click.echo).run_all()
    except RunLockedError as err:
        _fail(str(err))
    except StageFailedError as err:
        _fail(str(err), 1)
    except KeyboardInterrupt:
        _fail(f"interrupted; continue with: hpcrl resume {run.root}", 130)
    from hpcrl.controller import summary

    click.echo(f"run complete: {run.root}")
    if line := summary(exp, run):
        click.echo(line)


def _validated(experiment: Path, sets: tuple[str, ...]) -> config.Experiment:
    """The experiment with its overrides, checked (config, data, model, rewards) before any run exists."""
    from hpcrl import preflight

    try:
        exp = config.load(experiment)
        if sets:
            exp = config.with_overrides(exp, config.parse_assignments(sets), f"{experiment} with --set")
        notes = preflight.check(exp, str(experiment))
    except ConfigError as err:
        _fail(str(err))
    for note in notes:
        click.echo(f"note: {note}", err=True)
    return exp


def _prepare(experiment: Path, sets: tuple[str, ...] = ()):
    from hpcrl import runs

    exp = _validated(experiment, sets)
    try:
        run, resumed = runs.prepare(exp, str(experiment))
    except ConfigError as err:
        _fail(str(err))
    return exp, run, resumed


@main.command()
@click.argument("experiment", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--foreground", is_flag=True,
              help="Slurm: drive the run from this terminal instead of a controller job.")
@click.option("--dry-run", is_flag=True,
              help="Check everything and write the resolved config and every sbatch script under "
                   "<runs_root>/dry-runs/<name>/; nothing is created or changed in the run.")
@click.option("--check-cluster", is_flag=True,
              help="With --dry-run: ask Slurm whether it would accept each kind of job "
                   "(`sbatch --test-only` on one script per role).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. update.lr=1e-5 or run.name=lr-sweep-2 (a TOML value; "
                   "one that is not TOML is taken as a string); repeatable. The run's frozen config "
                   "records the result.")
def submit(experiment: Path, foreground: bool, dry_run: bool, check_cluster: bool,
           sets: tuple[str, ...]) -> None:
    """Validate EXPERIMENT (a TOML file) and run it; resubmitting continues the same run.

    With the local executor the run is driven in this terminal. With the Slurm executor the
    controller is submitted as a small Slurm job and this command returns (--foreground keeps it here).
    """
    if check_cluster and not dry_run:
        _fail("--check-cluster goes with --dry-run")
    if dry_run:
        _dry_run(experiment, sets, check_cluster)
        return
    exp, run, resumed = _prepare(experiment, sets)
    if resumed:
        click.echo(f"resuming the existing run {exp.run.name}")
    if exp.executor.kind == "slurm" and not foreground:
        from hpcrl.controller import submit_controller

        try:
            job_id = submit_controller(run, exp)
        except Exception as err:  # noqa: BLE001 - sbatch's refusal, in whatever form submitit raises it
            from hpcrl import runs

            left = "the existing run is left as it was" if resumed else "no run was created"
            if not resumed:
                runs.discard_new(run)
            _fail(f"could not submit the controller job ({type(err).__name__}: "
                  f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); {left}", 1)
        click.echo(f"submitted the controller as Slurm job {job_id}\nrun directory: {run.root}\n"
                   f"follow it:  hpcrl status {run.root}    (logs: {run.logs}/{job_id}/)\n"
                   f"cancel it:  hpcrl cancel {run.root}")
        return
    _drive(run, exp)


def _dry_run(experiment: Path, sets: tuple[str, ...], check_cluster: bool = False) -> None:
    from hpcrl import runs, sbatch

    exp = _validated(experiment, sets)
    try:
        run, frozen = runs.check(exp, str(experiment))  # read-only: the run is left as it is
    except ConfigError as err:
        _fail(str(err))
    out = Path(exp.run.runs_root).resolve() / "dry-runs" / exp.run.name
    try:
        paths = sbatch.write_all(run, exp, out)
    except ConfigError as err:
        _fail(str(err))
    from hpcrl import disk_budget, placement

    click.echo(disk_budget.describe(disk_budget.estimate(exp)))
    gpus = placement.describe(exp)
    if gpus is not None:
        click.echo("GPU placement (each task on its own GPUs):\n" + gpus)
    if exp.update.backend == "megatron":
        from hpcrl import config_megatron

        click.echo("\n".join(config_megatron.describe(exp)))
    state = (f"the existing run {run.root} is left as it is" if frozen is not None
             else f"no run created at {run.root}")
    click.echo(f"dry run: config, model, tokenizer, data, rewards and batch shape checked; wrote the "
               f"resolved config and {len(paths) - 1} sbatch scripts under {out} ({state}; "
               "nothing submitted)")
    if check_cluster:
        refused = 0
        for path, ok, answer in sbatch.test_only(paths[1:]):
            refused += not ok
            click.echo(f"sbatch --test-only {path.name}: {'accepted' if ok else 'REFUSED'}: {answer}")
        if refused:
            _fail(f"Slurm would refuse {refused} of the run's kinds of job (above); fix their [executor] "
                  "sections")


@main.command("sbatch")
@click.argument("experiment", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--stage", type=click.Choice([*ORDER, "resident"]),
              help="A stage script (or the resident job's) instead of the controller's.")
@click.option("--iteration", type=int, default=0, show_default=True)
def sbatch_cmd(experiment: Path, stage: str | None, iteration: int) -> None:
    """Print the exact sbatch script of the controller or of one stage, to submit by hand: creates
    (or continues) the run directory and its logs/ folder, which the script needs."""
    from hpcrl import sbatch

    exp, run, _ = _prepare(experiment)
    run.logs.mkdir(exist_ok=True)  # the script's --output folder must exist at submission
    try:
        k = iteration if stage in ORDER else None
        click.echo(sbatch.render(run, exp, stage or "controller", k), nl=False)
    except ConfigError as err:
        _fail(str(err))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
def cancel(run_dir: Path) -> None:
    """Cancel every Slurm job of RUN_DIR (controller and stages); committed outputs stay."""
    import subprocess

    from hpcrl import runs

    try:
        run, _ = runs.open_run(run_dir)
    except ConfigError as err:
        _fail(str(err))
    ids = sorted({j["job_id"] for j in run.jobs()})
    if not ids:
        click.echo("no jobs recorded for this run")
        return
    subprocess.run(["scancel", *ids], check=False)
    click.echo(f"cancelled jobs {', '.join(ids)}; continue later with: hpcrl submit or hpcrl resume "
               f"{run.root}")


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
def resume(run_dir: Path) -> None:
    """Continue RUN_DIR at its first uncommitted stage."""
    from hpcrl import runs

    try:
        run, exp = runs.open_run(run_dir)
    except ConfigError as err:
        _fail(str(err))
    requeue.install_by_hand(str(run_dir))  # the controller's script submitted by hand
    _drive(run, exp)


@main.command()
@click.argument("experiment", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=False)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
def doctor(experiment: Path | None, sets: tuple[str, ...]) -> None:
    """Versions, devices (this task's GPUs, NCCL) and backends each stage will use, and with an
    EXPERIMENT the GPU placement its jobs would use; non-zero exit if anything is missing."""
    from hpcrl.doctor import plan_lines, report

    lines, problems = report()
    if experiment is not None:
        lines += plan_lines(_validated(experiment, sets))
    for line in lines:
        click.echo(line)
    for p in problems:
        click.echo(f"problem: {p}", err=True)
    sys.exit(1 if problems else 0)


@main.command()
@click.argument("runs_root", type=click.Path(file_okay=False, path_type=Path), default="runs")
@click.option("--port", default=5000, show_default=True)
def ui(runs_root: Path, port: int) -> None:
    """Open the MLflow UI on the local store under RUNS_ROOT (bound to 127.0.0.1)."""
    from hpcrl.tracking import default_uri

    db = runs_root / "mlflow.db"
    if not db.is_file():
        _fail(f"{db}: no MLflow store here; pass the runs_root of your experiment")
    click.echo(f"MLflow UI on http://127.0.0.1:{port} (Ctrl-C to stop)")
    os.execvp(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri",
                               default_uri(runs_root), "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1"])


@main.command("config")
@click.option("--markdown", is_flag=True,
              help="The reference as Markdown, one table per section (docs/configuration.md is this output).")
def config_reference(markdown: bool) -> None:
    """Print every experiment.toml key with its default and meaning."""
    from hpcrl import config_reference

    click.echo(config_reference.reference_markdown() if markdown else config_reference.reference(),
               nl=not markdown)


# ---- debugging a run: inspect, plot, export (hpcrl/inspection.py, plots.py, export.py) -------------
@main.command("inspect")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--iteration", "-i", type=int, default=None,
              help="Detail of one iteration: rewards by data source, lengths, finish reasons, "
                   "best/worst samples.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@click.option("--samples", type=click.IntRange(0), default=3, show_default=True,
              help="Best and worst samples shown per split with --iteration.")
def inspect_command(run_dir: Path, iteration: int | None, fmt: str, samples: int) -> None:
    """Per-iteration metrics of RUN_DIR (reward, val, KL, clip fraction, length, stage times)."""
    from hpcrl import inspection as run_inspect
    from hpcrl import runs

    try:
        run, exp = runs.open_run(run_dir)
        if iteration is None:
            text = run_inspect.render_table(run_inspect.iteration_table(run, exp), exp, fmt)
            if fmt == "table":  # and what the alerts said
                from hpcrl import alerts

                complete = plan.next_stage(run, exp) is None
                text = "\n".join([text, *alerts.report(run.read_run_info(), run.root, complete)])
        else:
            text = run_inspect.render_detail(run_inspect.iteration_detail(run, iteration, samples), fmt)
    except (ConfigError, run_inspect.InspectError) as err:
        _fail(str(err))
    except commit.CorruptOutputError as err:
        _fail(str(err), 1)
    click.echo(text)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for the PNG files [default: RUN_DIR/plots].")
def plot(run_dir: Path, out: Path | None) -> None:
    """PNG figures of RUN_DIR: reward and validation score, KL and clip fraction, length, stage times."""
    from hpcrl import runs
    from hpcrl.inspection import InspectError
    from hpcrl.plots import write_plots

    try:
        run, exp = runs.open_run(run_dir)
        paths = write_plots(run, exp, out or run.root / "plots")
    except (ConfigError, InspectError) as err:
        _fail(str(err))
    except commit.CorruptOutputError as err:
        _fail(str(err), 1)
    for path in paths:
        click.echo(str(path))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--version", "version", type=int, required=True, help="Policy version (0 is the base model).")
@click.option("--adapters", is_flag=True, help="Write the version's LoRA adapters (peft's format) instead "
              "of the merged model ([update.lora]).")
@click.argument("dest", type=click.Path(path_type=Path))
def export(run_dir: Path, version: int, adapters: bool, dest: Path) -> None:
    """Write policy VERSION of RUN_DIR as a standalone HF model folder DEST (new or empty)."""
    from hpcrl import runs
    from hpcrl.export import ExportError, export_policy

    try:
        run, exp = runs.open_run(run_dir)
        files = export_policy(run, exp, version, dest, adapters)
    except (ConfigError, ExportError) as err:
        _fail(str(err))
    except (commit.CorruptOutputError, OSError) as err:
        _fail(str(err), 1)
    size = sum(f.stat().st_size for f in files)
    what = "the LoRA adapters of policy" if adapters else "policy"
    click.echo(f"exported {what} v{version} of {run.root} to {dest} ({len(files)} files, "
               f"{size / 2**20:.1f} MiB, checksums verified)")


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--iteration", type=int, required=True)
@click.option("--stage", type=click.Choice(ORDER), required=True)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a config key for the replay (TOML value, e.g. algorithm.clip_ratio=0.1).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Replay directory (default: under <runs_root>/replays/).")
def replay(run_dir: Path, iteration: int, stage: str, sets: tuple[str, ...], out: Path | None) -> None:
    """Run one committed stage again from its committed inputs, elsewhere, and compare.

    Exit 0 only when the replay matches (byte-identical, or within tolerance for generate/update).
    """
    from hpcrl import replay as rp
    from hpcrl import replay_forced, runs

    try:
        overrides = config.parse_assignments(sets)
        run, exp = runs.open_run(run_dir)
        replay_run, replay_exp = rp.prepare(run, exp, iteration, stage, overrides, out)
        click.echo(f"replaying {stage} of iteration {iteration} in {replay_run.root}")
        rp.run_stage(replay_run, replay_exp, iteration, stage)
    except ConfigError as err:
        _fail(str(err))
    except (commit.CorruptOutputError, FileExistsError, RuntimeError) as err:
        _fail(str(err), 1)
    original, replayed = run.stage_dir(iteration, stage), replay_run.stage_dir(iteration, stage)
    sampled_from = run.policy_dir(plan.policy_version(exp, iteration), exp.model.path)
    report = rp.compare(original, replayed, stage, run.policy_dir(iteration, exp.model.path),
                        rp.bits(replay_exp.model.dtype), replay_forced.for_replay(sampled_from, replay_exp))
    click.echo(rp.format_report(report, original, replayed, overrides))
    sys.exit(0 if report.match else 1)


main.add_command(cli_retention.pin)
main.add_command(cli_status.status)


def entry() -> None:
    """The `hpcrl` command: `main`, with an exit that skips the interpreter's last garbage collection
    (see hpcrl.stage.skip_final_collection: 2 s after a run, whose pre-flight imported transformers)."""
    try:
        main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    entry()
