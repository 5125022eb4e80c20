"""Replaying one committed stage offline, into a separate directory, and comparing with the original.

The replay directory is a small run directory of its own: the (possibly overridden) frozen
config, and links to the committed inputs of the stage (the generate output for score; generate,
score and the previous update for update; the previous update's policy for generate). The stage
then runs exactly as in the run, through the local executor, with the seed derived from the same
(run seed, iteration, stage). The original run is only read.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcrl import commit, config, executors
from hpcrl.config import Experiment
from hpcrl.rundir import RunDir

# Metrics that measure speed, not results: reported, never part of the verdict.
NOISY = ("perf/", "timing_s/")
LOGPROB_TOL = 1e-3
WEIGHT_TOL = 1e-6


def inputs_of(stage: str, iteration: int) -> list[tuple[int, str]]:
    """The committed stage outputs a stage reads."""
    prev = [(iteration - 1, "update")] if iteration > 0 else []
    return {"generate": prev, "score": [(iteration, "generate")],
            "update": [(iteration, "generate"), (iteration, "score"), *prev]}[stage]


def prepare(run: RunDir, exp: Experiment, iteration: int, stage: str, overrides: dict[str, str],
            out: Path | None = None) -> tuple[RunDir, Experiment]:
    original = run.stage_dir(iteration, stage)
    if not commit.is_committed(original):
        raise commit.CorruptOutputError(f"{original}: not committed; there is nothing to replay")
    for k, s in [*inputs_of(stage, iteration), (iteration, stage)]:
        problems = commit.verify(run.stage_dir(k, s))
        if problems:
            raise commit.CorruptOutputError("; ".join(problems))
    replay_exp = config.with_overrides(exp, overrides, "--set") if overrides else exp
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = out or Path(exp.run.runs_root) / "replays" / run.root.name / f"iter_{iteration:06d}-{stage}-{stamp}"
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root}: exists and is not empty; choose another --out")
    replay = RunDir.at(root)
    root.mkdir(parents=True, exist_ok=True)
    replay.config_path.write_text("# Replay config (written by hpcrl replay).\n" + config.dumps(replay_exp))
    for k, s in inputs_of(stage, iteration):
        link = replay.stage_dir(k, s)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(run.stage_dir(k, s), target_is_directory=True)
    return replay, replay_exp


def run_stage(replay: RunDir, exp: Experiment, iteration: int, stage: str) -> None:
    job = executors.LocalExecutor(replay, exp).submit(stage, iteration)
    error = job.job.exception()
    if error is not None or not commit.is_committed(replay.stage_dir(iteration, stage)):
        raise RuntimeError(f"the replayed {stage} stage failed (log {job.log_paths()[1]}):\n{job.stderr_tail()}")


@dataclass
class Report:
    identical: bool
    match: bool
    lines: list[str] = field(default_factory=list)
    metrics: list[tuple[str, float | None, float | None]] = field(default_factory=list)


def _generate_diff(a: Path, b: Path) -> tuple[bool, list[str]]:
    cols = ["response_ids", "logprobs"]
    ra, rb = commit.read_table(a, "rollouts", cols).to_pylist(), commit.read_table(b, "rollouts", cols).to_pylist()
    same_tokens = sum(x["response_ids"] == y["response_ids"] for x, y in zip(ra, rb, strict=True))
    diffs = [abs(p - q) for x, y in zip(ra, rb, strict=True) if x["response_ids"] == y["response_ids"]
             for p, q in zip(x["logprobs"], y["logprobs"], strict=True)]
    worst = max(diffs, default=0.0)
    agreement = same_tokens / max(len(ra), 1)
    ok = len(ra) == len(rb) and agreement == 1.0 and worst < LOGPROB_TOL
    return ok, [f"token agreement: {same_tokens}/{len(ra)} samples identical ({agreement:.1%})",
                f"logprob difference on identical samples: max {worst:.2e}, mean {np.mean(diffs or [0]):.2e}"]


def _update_diff(a: Path, b: Path) -> tuple[bool, list[str]]:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "policy" / "model.safetensors"), load_file(b / "policy" / "model.safetensors")
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    la = commit.read_table(a, "stats", ["loss"])["loss"].to_pylist()
    lb = commit.read_table(b, "stats", ["loss"])["loss"].to_pylist()
    loss = max(abs(x - y) for x, y in zip(la, lb, strict=True))
    return worst < WEIGHT_TOL, [f"policy weights: max difference {worst:.2e}", f"per-step loss: max difference {loss:.2e}"]


def compare(original: Path, replayed: Path, stage: str) -> Report:
    ma, mb = commit.read_manifest(original), commit.read_manifest(replayed)
    identical = ma["files"] == mb["files"]
    lines = [f"files: {'byte-identical' if identical else 'different'} ({len(ma['files'])} files checked)"]
    match = identical
    if not identical:
        differing = sorted(k for k in set(ma["files"]) | set(mb["files"]) if ma["files"].get(k) != mb["files"].get(k))
        lines.append("differing files: " + ", ".join(differing[:8]))
    # The numeric view of the stages that need not be bit-exact, shown even when they are.
    if stage in ("generate", "update"):
        ok, more = (_generate_diff if stage == "generate" else _update_diff)(original, replayed)
        lines += more
        match = identical or ok
    keys = sorted(set(ma["metrics"]) | set(mb["metrics"]))
    metrics = [(k, ma["metrics"].get(k), mb["metrics"].get(k)) for k in keys]
    return Report(identical, match, lines, metrics)


def format_report(report: Report, original: Path, replayed: Path, overrides: dict) -> str:
    out = [f"original: {original}", f"replay:   {replayed}"]
    if overrides:
        out.append("overrides: " + ", ".join(f"{k}={v!r}" for k, v in overrides.items()))
    out += report.lines
    out.append(f"{'metric':<32} {'original':>12} {'replay':>12} {'delta':>12}")
    for key, a, b in report.metrics:
        delta = "" if a is None or b is None else f"{b - a:+12.4g}"
        fa = "-" if a is None else f"{a:12.4g}"
        fb = "-" if b is None else f"{b:12.4g}"
        mark = "  (speed)" if key.startswith(NOISY) else ""
        out.append(f"{key:<32} {fa:>12} {fb:>12} {delta:>12}{mark}")
    verdict = ("MATCH: byte-identical" if report.identical else
               "MATCH within tolerance" if report.match else "DIFFERENT")
    out.append(f"verdict: {verdict}")
    return "\n".join(out)
