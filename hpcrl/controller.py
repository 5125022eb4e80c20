"""The pipeline controller: runs the first uncommitted stage until the run is complete.

It decides from the run directory alone (hpcrl.plan), so it can be killed at any point and a new
controller continues; it holds the run lock, submits each stage through the executor, shows
progress, retries failed stages, and feeds MLflow from the committed manifests.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable

import submitit

from hpcrl import adoption, alerts, commit, executors, plan, pruning
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir, RunLock
from hpcrl.stage_kinds import GENERATE, KINDS, ORDER, SCORE, UPDATE
from hpcrl.tracking import Tracker, stage_metrics


class StageFailedError(RuntimeError):
    pass


class AlertStopError(StageFailedError):
    """A rule in alerts.stop fired: the run stops after the stage that fired it."""


# Errors a retry cannot cure: the same inputs give the same failure (non-finite values, a reward
# that is not a number, bad input). A stage failing with one stops the run at once.
DETERMINISTIC = ("FloatingPointError", "RewardValueError", "ConfigError", "SchemaError", "DatasetError",
                 "CorruptOutputError", "PrunedError", "WeightSyncError")
# torch.distributed's elastic error handler prefixes a rank's traceback lines with "[rank0]: "
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


def failure_reason(stderr_tail: str) -> tuple[str, str] | None:
    """(error type, message) of the last exception line in a job's stderr, if any."""
    found = [m for line in stderr_tail.splitlines() if (m := _ERROR_LINE.match(line.strip()))]
    return (found[-1].group(1), found[-1].group(2)) if found else None


def iteration_line(exp: Experiment, run: RunDir, k: int) -> str:
    """One line per iteration: reward, validation score, KL, stage times."""
    manifests = {s: commit.read_manifest(run.stage_dir(k, s)) for s in plan.stages_of(exp, k)}
    metrics = {key: v for m in manifests.values() if m for key, v in m["metrics"].items()}
    kl_key = alerts.kl_metric(exp.algorithm)
    parts = [f"iter {k:>4}/{exp.run.iterations}"]
    for label, key, fmt in (("reward", "critic/score/mean", ".3f"), ("val", "val/score", ".3f"),
                            ("kl", kl_key, ".2e"), ("len", "response_length/mean", ".1f")):
        parts.append(f"{label} {format(metrics[key], fmt)}" if key in metrics else f"{label} -")
    times = "  ".join(f"{KINDS[s].short} {m['timings']['total']:.1f}s" for s, m in manifests.items() if m)
    return "  ".join(parts) + "  | " + times


def summary(exp: Experiment, run: RunDir) -> str:
    """How the reward and the validation score (and PPO's explained variance) moved over the run."""
    def series(key: str, stage: str = SCORE) -> list[float]:
        values = []
        for k, s in plan.all_stages(exp):
            m = commit.read_manifest(run.stage_dir(k, s)) if s == stage else None
            if m and key in m["metrics"]:
                values.append(m["metrics"][key])
        return values

    reward, val = series("critic/score/mean"), series("val/score")
    ev = [x for x in series("critic/explained_variance", UPDATE) if x == x]  # NaN: the returns did not vary
    parts = []
    if reward:
        last = reward[-3:]
        parts.append(f"reward {reward[0]:.3f} (first iteration) -> {sum(last) / len(last):.3f} "
                     f"(mean of last {len(last)})")
    if val:
        parts.append(f"val/score {val[0]:.3f} -> {val[-1]:.3f}")
    if ev:
        last = ev[-3:]
        parts.append(f"critic/explained_variance {ev[0]:.3f} -> max {max(ev):.3f} -> "
                     f"{sum(last) / len(last):.3f} (mean of last {len(last)})")
    return "; ".join(parts)


def _wait(job: executors.StageJob, show_progress: bool) -> None:
    """Block until the job ends, with a progress indicator when a person is watching."""
    from tqdm import tqdm

    desc = f"iter {job.iteration} {job.stage} (job {job.job_id})"
    with tqdm(desc=desc, bar_format="{desc}: {elapsed}", disable=not show_progress, leave=False,
              file=sys.stderr) as bar:
        try:
            while not job.done():
                time.sleep(0.2)
                bar.refresh()
        except KeyboardInterrupt:
            job.cancel()
            raise


class Controller:
    def __init__(self, run: RunDir, exp: Experiment, echo: Callable[[str], None] = print,
                 show_progress: bool | None = None):
        self.run, self.exp, self.echo = run, exp, echo
        self.show_progress = sys.stderr.isatty() if show_progress is None else show_progress
        self.plotted_the_end = False  # the plots of a complete run are written once
        self.progress: plan.Progress | None = None  # the drive loop's view of the commits

    def run_all(self) -> None:
        with RunLock(self.run):
            for moved in plan.rollback(self.run, self.exp):
                self.echo(f"moved aside {moved.name}: it depends on a policy version that was not saved "
                          "(executor.resident.checkpoint_every); the run continues from the last saved "
                          "version")
            self._check_history()
            tracker = Tracker(self.run, self.exp)
            status, reason = "FAILED", ""
            self.run.record_stop(None)  # a new attempt at the run
            try:
                executor = executors.make(self.run, self.exp)
                self._prune()  # rules changed on resume, or a prune interrupted by a crash
                if self.exp.executor.mode == "resident":
                    self._drive_resident(executor, tracker)
                else:
                    self._drive(executor, tracker)
                status = "FINISHED"
            except KeyboardInterrupt:
                status, reason = "KILLED", "interrupted"
                raise
            except Exception as err:
                reason = (self.run.read_run_info().get("stopped") or {}).get("reason") or \
                    f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                raise
            finally:
                tracker.finish(status)
                self._notify("completed" if status == "FINISHED" else "stopped", reason)

    def _notify(self, status: str, reason: str) -> None:
        """[executor.notify] webhook: the run completed or stopped (never fatal)."""
        url = self.exp.executor.notify.webhook
        if url and (error := alerts.post(url, {"run": self.run.root.name, "status": status, "reason": reason},
                                         self.exp.alerts.webhook_timeout_s)):
            self.echo(f"notify webhook {url}: not delivered ({error})")

    def _check_history(self) -> None:
        """Before a run continues: every committed output was computed from the outputs committed
        now (manifests only; files are checked when a stage reads them)."""
        problems = [p for k in self.run.iterations_present() for stage in ORDER
                    for p in commit.lineage(self.run.stage_dir(k, stage))]
        if problems:
            raise commit.CorruptOutputError(
                f"{self.run.root}: the committed outputs do not form one history; nothing was run:\n  "
                + "\n  ".join(problems) + "\nmove the named stage directories aside to run them again")

    def _drive(self, executor, tracker: Tracker) -> None:
        """Run the uncommitted stages in order; with Slurm, keep `lookahead` more queued, each
        behind the queued jobs of its inputs (afterok): queue wait overlaps work, and with
        algorithm.max_staleness > 0 the generation of later iterations runs beside an update."""
        queue = self._adopted(executor)
        failures: dict[tuple[int, str], int] = {}
        progress = self.progress = plan.Progress(self.run, self.exp)
        try:
            while True:
                pending = progress.pending()
                if not pending and not queue:
                    return
                queued = {(j.iteration, j.stage) for j in queue}
                for k, stage in pending:
                    if len(queue) > executor.lookahead:
                        break
                    if (k, stage) not in queued:
                        inputs = set(plan.inputs(self.exp, k, stage))
                        after = [j for j in queue if (j.iteration, j.stage) in inputs]
                        queue.append(executor.submit(stage, k, after=after))
                        self.run.record_job(queue[-1].job_id, stage, k, queue[-1].array)
                head = queue.pop(0)
                _wait(head, self.show_progress)
                if (head.error() is None
                        and commit.is_committed(self.run.stage_dir(head.iteration, head.stage))):
                    self._after_commit(tracker, head.iteration, head.stage)
                    continue
                for job in queue:  # they depend on the failed one
                    job.cancel()
                queue.clear()
                self._failed(head, failures)
        except BaseException:  # interrupted, or an alert stops the run
            for job in queue:
                job.cancel()
            raise

    def _adopted(self, executor) -> list[executors.StageJob]:
        """The live jobs an earlier controller of this run left for its first pending stages, to
        wait for instead of submitting them again; stranded ones cancelled (hpcrl.adoption)."""
        records = [r for r in self.run.jobs() if r["role"] in ORDER]
        if not records or not hasattr(executor, "adopt"):
            return []
        adopt, stranded = adoption.plan(plan.pending_stages(self.run, self.exp), records,
                                        adoption.states_of(records))
        for job_id in stranded:
            self.echo(f"job {job_id} waits behind a stage that has no live job; cancelled")
            executor.cancel(job_id)
        for r in adopt:
            self.echo(f"iter {r['iteration']} {r['role']}: job {r['job_id']} of an earlier controller is "
                      "still queued or running; waiting for it (not submitted again)")
        return [executor.adopt(r["job_id"], r["role"], r["iteration"], r.get("array", 0)) for r in adopt]

    def _resident_job(self, executor) -> executors.StageJob:
        """The live resident job an earlier controller submitted, or a new one."""
        records = [r for r in self.run.jobs() if r["role"] == "resident"]
        live = adoption.live_resident(records, adoption.states_of(records)) \
            if records and hasattr(executor, "adopt") else None
        from hpcrl import sbatch

        # a heterogeneous job: not submitit's
        script = executors.generator_node(self.exp.executor, "resident") is not None
        if live is not None:
            self.echo(f"resident job {live['job_id']} of an earlier controller is still queued or running; "
                      "following it (not submitted again)")
            return (sbatch.follow(self.run, self.exp, "resident", live["job_id"]) if script
                    else executor.adopt(live["job_id"], "resident", None))
        job = sbatch.submit(self.run, self.exp, "resident") if script else executor.submit("resident", None)
        self.run.record_job(job.job_id, "resident", None)
        return job

    def _drive_resident(self, executor, tracker: Tracker) -> None:
        """One job runs every stage; follow its commits as they land (same lines, same MLflow
        logging as the staged mode) and resubmit it, continuing, if it fails."""
        failures: dict[tuple[int, str], int] = {}
        progress = self.progress = plan.Progress(self.run, self.exp)
        while progress.pending():
            reported = set(progress.committed)
            job = self._resident_job(executor)
            self.echo(f"resident job {job.job_id}: {self.exp.update.world_size} trainer rank(s) + 1 "
                      f"generator; logs in {job.log_paths()[0].parent}")
            try:
                while True:
                    done = job.done()
                    progress.pending()
                    new = progress.committed - reported
                    for k, stage in [ks for ks in progress.stages if ks in new]:  # in run order
                        reported.add((k, stage))
                        self._after_commit(tracker, k, stage)
                    if done:
                        break
                    time.sleep(0.5)
            except BaseException:  # interrupted, or an alert stops the run
                job.cancel()
                raise
            pending = progress.pending()
            if pending:
                rolled = plan.rollback(self.run, self.exp)
                progress = self.progress = plan.Progress(self.run, self.exp)  # rollback moved stages aside
                for moved in rolled:
                    self.echo(f"moved aside {moved.name} (its policy version was not saved)")
                head = executors.StageJob(job.job, "resident", pending[0][0])
                self._failed(head, failures, key=(None, "resident"))

    def _failed(self, job: executors.StageJob, failures: dict, key: tuple | None = None) -> None:
        key = key or (job.iteration, job.stage)
        failures[key] = failures.get(key, 0) + 1
        attempts = self.exp.executor.max_retries + 1
        _, err = job.log_paths()
        what = (f"the resident job stopped at iteration {job.iteration}" if job.stage == "resident"
                else f"stage {job.stage} of iteration {job.iteration} failed")
        tail = job.stderr_tail()
        reason = failure_reason(tail)
        msg = (f"{what} (job {job.job_id}, attempt "
               f"{failures[key]}/{attempts}{job.where()}); log: {err}\n--- last lines of stderr ---\n{tail}")
        deterministic = reason is not None and reason[0] in DETERMINISTIC
        if failures[key] >= attempts or deterministic:
            self.run.record_stop({"iteration": job.iteration, "stage": job.stage, "job_id": job.job_id,
                                  "log": str(err),
                                  "reason": f"{reason[0]}: {reason[1]}" if reason else "see the log"})
            raise StageFailedError(msg + (f"\nnot retried: {reason[0]} is not cured by a retry"
                                          if deterministic and failures[key] < attempts else ""))
        self.echo(msg + "\nretrying")

    def _after_commit(self, tracker: Tracker, k: int, stage: str) -> None:
        manifest = commit.read_manifest(self.run.stage_dir(k, stage))
        tracker.log_metrics(stage_metrics(stage, manifest), step=k)
        self._check_alerts(tracker, k, stage, manifest)
        if self.exp.executor.kind == "slurm" and manifest.get("job_id"):
            from hpcrl.slurm import lineage

            metrics, tags = lineage(str(manifest["job_id"]), stage)
            tracker.log_metrics(metrics, step=k)
            tracker.set_tags(tags)
        if stage == UPDATE:
            self.run.publish_policy(k + 1)
            self._prune()
        if stage == SCORE and tracker.enabled:
            tracker.log_table(sample_rows(self.run, k), f"samples/iter_{k:06d}.json")
        if stage == plan.stages_of(self.exp, k)[-1]:
            self.echo(iteration_line(self.exp, self.run, k))
            tracker.log_utilisation(self.run, k)
            every = self.exp.tracking.plot_every
            # a resident run may be complete while the controller still logs earlier iterations: the
            # plots (read from the run directory) are written once, at the first it sees of the end
            progress = self.progress or plan.Progress(self.run, self.exp)  # its look: a few stats
            the_end = not self.plotted_the_end and not progress.pending()
            if the_end or (every and (k + 1) % every == 0):
                tracker.log_plots(self.run, self.exp)
                self.plotted_the_end |= the_end

    def _prune(self) -> None:
        """Remove what [run.retention] lets go now; say what, by which rule (retention.jsonl records it)."""
        for e in pruning.prune(self.run, self.exp):
            self.echo(f"retention: pruned the {pruning.NAMES[e['part']]} {e['version']} "
                      f"({pruning.size(e['bytes'])}; {e['rule']})")

    def _check_alerts(self, tracker: Tracker, k: int, stage: str, manifest: dict) -> None:
        """Evaluate [alerts] on a committed stage: report each alert; stop on one in alerts.stop."""
        cfg = self.exp.alerts
        history = [m for j in range(max(0, k - cfg.window), k)
                   if (m := commit.read_manifest(self.run.stage_dir(j, stage)))]
        fired = alerts.evaluate(cfg, alerts.kl_metric(self.exp.algorithm), stage, k, manifest, history)
        for alert in fired:
            self.echo(alert.line())
            self.run.record_alert(alert.as_dict())
            tracker.set_tags({f"alert/{k}/{stage}/{alert.rule}": alert.message})
            payload = {"run": self.run.root.name, **alert.as_dict()}
            if cfg.webhook and (error := alerts.post(cfg.webhook, payload, cfg.webhook_timeout_s)):
                self.echo(f"alert webhook {cfg.webhook}: not delivered ({error})")
        stop = next((alert for alert in fired if alert.stops), None)
        if stop is not None:
            self.run.record_stop({"iteration": k, "stage": stage, "alert": stop.rule,
                                  "reason": f"{stop.rule}: {stop.message}"})
            raise AlertStopError(f"{stop.line()}\nthe run stops here (alerts.stop); fix the cause (or "
                                 f"[alerts]), then `hpcrl resume {self.run.root}`")


class ControllerCall(submitit.helpers.Checkpointable):
    """The controller as a Slurm job (`hpcrl submit` with executor.kind = "slurm"); requeued by
    submitit before its time limit, it continues from the run directory."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> None:
        from hpcrl import runs

        run, exp = runs.open_run(self.run_dir)
        Controller(run, exp, show_progress=False).run_all()


def submit_controller(run: RunDir, exp: Experiment) -> str:
    """Submit the controller of `run` as a Slurm job; returns its job id."""
    job = executors.submitit_executor(run, exp, "controller").submit(ControllerCall(str(run.root)))
    run.record_job(str(job.job_id), "controller", None)
    return str(job.job_id)


def sample_rows(run: RunDir, k: int, limit: int = 16) -> list[dict]:
    """A few scored generations of an iteration, for a look in the MLflow UI."""
    rollouts = commit.read_table(run.stage_dir(k, GENERATE), "rollouts",
                                 columns=["split", "prompt_index", "sample_index", "prompt_text",
                                          "response_text"])
    scores = commit.read_table(run.stage_dir(k, SCORE), "scores", columns=["reward"])
    rows = rollouts.append_column("reward", scores["reward"]).slice(0, limit).to_pylist()
    return rows
