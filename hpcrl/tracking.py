"""MLflow tracking: one MLflow run per hpcrl run, fed by the controller from stage manifests.

Compute jobs never talk to MLflow; the controller logs what each committed manifest says, so a
run directory can always be re-logged. A tracking failure is reported, never fatal: MLflow is a
view of the run directory, not its truth.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hpcrl import config
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir


def default_uri(runs_root: str | Path) -> str:
    return f"sqlite:///{Path(runs_root).resolve() / 'mlflow.db'}"


def tracking_uri(exp: Experiment) -> str:
    return exp.tracking.tracking_uri or default_uri(exp.run.runs_root)


def stage_metrics(stage: str, manifest: dict) -> dict[str, float]:
    """Metrics of one committed stage under verl-style names."""
    out = {k: float(v) for k, v in manifest["metrics"].items()}
    timings = manifest.get("timings", {})
    if "total" in timings:
        out[f"timing_s/{stage}"] = float(timings["total"])
    return out


def _restrict(uri: str, dir_mode: int) -> None:
    """The local store (mlflow.db) readable as the run directories are (group, not others)."""
    import os

    path = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    if path is not None and path.is_file() and path.stat().st_uid == os.getuid():
        os.chmod(path, dir_mode & 0o660)


class Tracker:
    def __init__(self, run: RunDir, exp: Experiment):
        self.enabled = exp.tracking.enabled
        self.run_id: str | None = None
        if not self.enabled:
            return
        import mlflow
        from mlflow.tracking import MlflowClient

        self._mlflow = mlflow
        uri = tracking_uri(exp)
        self.client = MlflowClient(tracking_uri=uri)
        info = run.read_run_info()
        self.run_id = info.get("mlflow_run_id")
        if self.run_id is None:
            exp_id = self._experiment_id(exp)
            mlrun = self.client.create_run(exp_id, run_name=exp.run.name,
                                           tags={"hpcrl.run_dir": str(run.root)})
            self.run_id = mlrun.info.run_id
            run.write_run_info({**info, "mlflow_run_id": self.run_id, "mlflow_tracking_uri": uri})
            params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in config.flat(exp).items()]
            self.client.log_batch(self.run_id, params=params)
            self.client.log_artifact(self.run_id, str(run.config_path))
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        _restrict(uri, int(exp.run.dir_mode, 8))

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

    def log_plots(self, run: RunDir, exp: Experiment) -> None:
        """Write the run's figures under RUN/plots and log them as artifacts (plots/)."""
        if not self.enabled:
            return
        from hpcrl.plots import write_plots

        paths = write_plots(run, exp, run.root / "plots")
        for path in paths:
            self._guard(lambda p=path: self.client.log_artifact(self.run_id, str(p), "plots"))

    def finish(self, status: str) -> None:
        if self.enabled:
            self._guard(lambda: self.client.set_terminated(self.run_id, status=status))

    def _guard(self, call) -> None:
        from mlflow.exceptions import MlflowException

        try:
            call()
        except (MlflowException, OSError) as err:
            print(f"warning: MLflow logging failed ({err}); the run directory still has everything",
                  file=sys.stderr)
