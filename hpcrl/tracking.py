"""MLflow tracking: one MLflow run per hpcrl run, fed by the controller from stage manifests.

Compute jobs never talk to MLflow; the controller logs what each committed manifest says, so a
run directory can always be re-logged. A tracking failure is reported once and is never fatal:
the controller goes on without tracking, since MLflow is a view of the run directory, not its truth.
The default store is one SQLite file shared by every run under the runs root; on a network
filesystem, or with many runs at once, it is better replaced by a tracking server.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path, PurePosixPath

from hpcrl import config, utilisation
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir

SHARED_FS_DOC = 'docs/slurm.md, "Shared filesystems: tracking and locks"'
# Filesystem types (as /proc/mounts names them) shared over the network.
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph",
                                 "fuse.ceph-fuse", "glusterfs", "fuse.glusterfs", "panfs", "wekafs",
                                 "fuse.sshfs", "9p", "afs"})


def default_uri(runs_root: str | Path) -> str:
    return f"sqlite:///{Path(runs_root).resolve() / 'mlflow.db'}"


def tracking_uri(exp: Experiment) -> str:
    return exp.tracking.tracking_uri or default_uri(exp.run.runs_root)


def stage_metrics(stage: str, manifest: dict) -> dict[str, float]:
    """Metrics of one committed stage under verl-style names, and its device utilisation under
    `util/<stage>/...` (busy, allocated, idle device-seconds; hpcrl.utilisation)."""
    out = {k: float(v) for k, v in manifest["metrics"].items()}
    timings = manifest.get("timings", {})
    if "total" in timings:
        out[f"timing_s/{stage}"] = float(timings["total"])
    for usage in utilisation.by_role([manifest]).values():  # none for a stage that recorded none
        out.update(utilisation.metrics({stage: usage}))
    return out


def iteration_utilisation(run: RunDir, k: int) -> dict[str, float]:
    """Each role's utilisation in iteration k: `util/<role>/...` (a role may run several stages)."""
    from hpcrl import commit
    from hpcrl.stage_kinds import ORDER

    return utilisation.metrics(utilisation.by_role(commit.read_manifest(run.stage_dir(k, s)) for s in ORDER))


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def _restrict(uri: str, dir_mode: int) -> None:
    """The local store (mlflow.db) readable as the run directories are (group, not others)."""
    import os

    path = _sqlite_path(uri)
    if path is not None and path.is_file() and path.stat().st_uid == os.getuid():
        os.chmod(path, dir_mode & 0o660)


def filesystem_type(path: str | Path, mounts: str) -> str | None:
    """The type of the filesystem that holds the absolute `path`, from the text of /proc/mounts:
    that of the longest mount point above it (the last one mounted there, if several)."""
    best, found = None, None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040: a space
        if PurePosixPath(path).is_relative_to(point) and (best is None or len(point) >= len(best)):
            best, found = point, fields[2]
    return found


def store_warning(uri: str, mounts: str) -> str | None:
    """A warning when the SQLite store of `uri` lies on a network filesystem (`mounts`: /proc/mounts)."""
    path = _sqlite_path(uri)
    fstype = None if path is None else filesystem_type(path.resolve(), mounts)
    if fstype not in NETWORK_FILESYSTEMS:
        return None
    return (f"warning: the MLflow tracking store {path} is on a {fstype} filesystem, where SQLite's locks "
            "are slow or unreliable: with several runs at once a controller can lose its tracking to "
            "`database is locked`; for many concurrent runs set tracking.tracking_uri to an MLflow "
            f"tracking server backed by a real database ({SHARED_FS_DOC})")


def failure_message(uri: str, err: Exception) -> str:
    """What a tracking failure says: the store, the error, that the run goes on, and what to do."""
    text = str(err).strip()
    error = type(err).__name__ + (f": {text.splitlines()[0]}" if text else "")
    if _sqlite_path(uri) is not None:
        todo = ("the SQLite store is for one or a few runs at a time: for many concurrent runs set "
                "tracking.tracking_uri to an MLflow tracking server backed by a real database")
    else:
        todo = "check that this tracking server is up and reachable from this node (its /health URL)"
    return (f"warning: MLflow tracking at {uri} failed ({error}); the run goes on without tracking (its "
            f"directory still has every metric: hpcrl status, hpcrl inspect). To fix it: {todo} "
            f"({SHARED_FS_DOC})")


def _read_mounts() -> str:
    try:
        return Path("/proc/mounts").read_text()
    except OSError:
        return ""


class Tracker:
    def __init__(self, run: RunDir, exp: Experiment):
        self.enabled = exp.tracking.enabled
        self.run_id: str | None = None
        self.uri = tracking_uri(exp)
        if not self.enabled:
            return
        if warning := store_warning(self.uri, _read_mounts()):
            print(warning, file=sys.stderr)
        info = run.read_run_info()
        self._guard(lambda: self._start(run, exp, info))

    def _start(self, run: RunDir, exp: Experiment, info: dict) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self._mlflow = mlflow
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id = info.get("mlflow_run_id")
        if self.run_id is None:
            exp_id = self._experiment_id(exp)
            mlrun = self.client.create_run(exp_id, run_name=exp.run.name,
                                           tags={"hpcrl.run_dir": str(run.root)})
            self.run_id = mlrun.info.run_id
            run.write_run_info({**info, "mlflow_run_id": self.run_id, "mlflow_tracking_uri": self.uri})
            params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in config.flat(exp).items()]
            self.client.log_batch(self.run_id, params=params)
            self.client.log_artifact(self.run_id, str(run.config_path))
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        _restrict(self.uri, int(exp.run.dir_mode, 8))

    def _experiment_id(self, exp: Experiment) -> str:
        found = self.client.get_experiment_by_name(exp.tracking.experiment)
        if found is not None:
            return found.experiment_id
        artifacts = None
        if not exp.tracking.tracking_uri:  # local store: artifacts beside it
            artifacts = (Path(exp.run.runs_root).resolve() / "mlartifacts").as_uri()
        return self.client.create_experiment(exp.tracking.experiment, artifact_location=artifacts)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled or not metrics:
            return
        import time

        now = int(time.time() * 1000)
        batch = [self._mlflow.entities.Metric(k, v, now, step) for k, v in metrics.items()]
        self._guard(lambda: self.client.log_batch(self.run_id, metrics=batch))

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.enabled and tags:
            self._guard(lambda: [self.client.set_tag(self.run_id, k, v) for k, v in tags.items()])

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        if not self.enabled or not rows:
            return
        import pandas as pd

        self._guard(lambda: self.client.log_table(self.run_id, pd.DataFrame(rows), artifact_file))

    def log_utilisation(self, run: RunDir, k: int) -> None:
        """Each role's utilisation in iteration k, once all its stages are committed (step k)."""
        if self.enabled:
            self.log_metrics(iteration_utilisation(run, k), step=k)

    def log_plots(self, run: RunDir, exp: Experiment) -> None:
        """Write the run's figures under RUN/plots and log them as artifacts (plots/); log the run's
        utilisation so far (`util/run/...`, step: the last iteration present)."""
        if not self.enabled:
            return
        if manifests := utilisation.run_manifests(run):
            self.log_metrics(utilisation.run_metrics(manifests), step=max(m["iteration"] for m in manifests))
        from hpcrl.plots import write_plots

        paths = write_plots(run, exp, run.root / "plots")
        for path in paths:
            self._guard(lambda p=path: self.client.log_artifact(self.run_id, str(p), "plots"))

    def finish(self, status: str) -> None:
        if self.enabled:
            self._guard(lambda: self.client.set_terminated(self.run_id, status=status))

    def _guard(self, call) -> None:
        """Make one MLflow call; at its first failure say so once and go on without tracking."""
        if not self.enabled:
            return
        try:
            call()
        except Exception as err:  # noqa: BLE001 - never fatal, whatever MLflow or its store raises
            self.enabled = False
            print(failure_message(self.uri, err), file=sys.stderr)
