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

from hpcrl import commit, config, executors, plan, pruning, schemas
from hpcrl.config import Experiment
from hpcrl.retention import POLICY, TRAINER
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import GENERATE, SCORE, UPDATE

# Metrics that measure speed, not results: reported, never part of the verdict.
NOISY = ("perf/", "timing_s/")
LOGPROB_TOL = 1e-3
WEIGHT_TOL = 1e-6
LOSS_TOL = 1e-6  # absolute, per optimizer step


def needs(exp: Experiment, stage: str, iteration: int) -> list[tuple[int, str]]:
    """(version, part) a replay reads: generate samples with the iteration's policy; an update
    starts from that policy and its trainer state, and compares the policy it made."""
    if stage == GENERATE:
        return [(plan.policy_version(exp, iteration), POLICY)]
    if stage == UPDATE:
        return [(iteration, POLICY), (iteration, TRAINER), (iteration + 1, POLICY)]
    return []


def prepare(run: RunDir, exp: Experiment, iteration: int, stage: str, overrides: dict[str, str],
            out: Path | None = None) -> tuple[RunDir, Experiment]:
    original = run.stage_dir(iteration, stage)
    if not commit.is_committed(original):
        raise commit.CorruptOutputError(f"{original}: not committed; there is nothing to replay")
    what = f"replay of {stage} of iteration {iteration}"
    for version, part in needs(exp, stage, iteration):
        pruning.require(run, version, part, what)
    for k, s in [*plan.inputs(exp, iteration, stage), (iteration, stage)]:
        problems = commit.verify(run.stage_dir(k, s))
        if problems:
            raise commit.CorruptOutputError("; ".join(problems))
    replay_exp = config.with_overrides(exp, overrides, "--set") if overrides else exp
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = out or (Path(exp.run.runs_root) / "replays" / run.root.name
                   / f"iter_{iteration:06d}-{stage}-{stamp}")
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root}: exists and is not empty; choose another --out")
    replay = RunDir.at(root)
    root.mkdir(parents=True, exist_ok=True)
    replay.config_path.write_text("# Replay config (written by hpcrl replay).\n" + config.dumps(replay_exp))
    for k, s in plan.inputs(exp, iteration, stage):
        link = replay.stage_dir(k, s)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(run.stage_dir(k, s), target_is_directory=True)
    return replay, replay_exp


def run_stage(replay: RunDir, exp: Experiment, iteration: int, stage: str) -> None:
    job = executors.LocalExecutor(replay, exp).submit(stage, iteration)
    error = job.job.exception()
    if error is not None or not commit.is_committed(replay.stage_dir(iteration, stage)):
        raise RuntimeError(f"the replayed {stage} stage failed (log {job.log_paths()[1]}):\n"
                           f"{job.stderr_tail()}")


@dataclass
class Report:
    identical: bool
    match: bool
    lines: list[str] = field(default_factory=list)
    metrics: list[tuple[str, float | None, float | None]] = field(default_factory=list)


def _sample_name(row: dict) -> str:
    return f"{row['split']} prompt {row['prompt_index']} sample {row['sample_index']}"


def _rows(stage_dir: Path, table: str, columns: list[str]) -> list[dict]:
    return commit.read_table(stage_dir, table, [*schemas.SAMPLE_KEYS, *columns]).to_pylist()


def _generate_diff(a: Path, b: Path) -> tuple[bool, list[str]]:
    """Token agreement per sample, and the logprob difference on the samples that agree."""
    ra, rb = (_rows(a, "rollouts", ["response_ids", "logprobs"]),
              _rows(b, "rollouts", ["response_ids", "logprobs"]))
    if len(ra) != len(rb):
        return False, [f"samples: {len(ra)} in the original, {len(rb)} in the replay"]
    same = [x["response_ids"] == y["response_ids"] for x, y in zip(ra, rb, strict=True)]
    diffs = [(abs(p - q), x) for x, y, s in zip(ra, rb, same, strict=True) if s
             for p, q in zip(x["logprobs"], y["logprobs"], strict=True)]
    worst, worst_row = max(diffs, key=lambda d: d[0], default=(0.0, None))
    lines = [f"token agreement: {sum(same)}/{len(ra)} samples identical ({sum(same) / max(len(ra), 1):.1%})",
             f"logprob difference on identical samples: max {worst:.2e}, "
             f"mean {np.mean([d for d, _ in diffs] or [0]):.2e}"]
    if not all(same):
        lines.append("first sample with other tokens: " + _sample_name(ra[same.index(False)]))
    if worst >= LOGPROB_TOL:
        lines.append(f"logprobs beyond the tolerance {LOGPROB_TOL:.0e}: worst at {_sample_name(worst_row)}")
    return all(same) and worst < LOGPROB_TOL, lines


def _score_diff(a: Path, b: Path) -> tuple[bool, list[str]]:
    """The score stage is deterministic: every reward, component and message must agree."""
    cols = ["reward", "reward_components", "reward_message"]
    ra, rb = _rows(a, "scores", cols), _rows(b, "scores", cols)
    if len(ra) != len(rb):
        return False, [f"samples: {len(ra)} in the original, {len(rb)} in the replay"]
    differ = [(x, y) for x, y in zip(ra, rb, strict=True) if x != y]
    lines = [f"scores: {len(ra) - len(differ)}/{len(ra)} samples identical"]
    if differ:
        x, y = differ[0]
        lines.append(f"first sample scored differently: {_sample_name(x)}: reward {x['reward']!r} -> "
                     f"{y['reward']!r}")
    return not differ, lines


@dataclass
class UpdateGaps:
    """How far two updates of one iteration are apart: the tensors only one policy has, each
    tensor's largest weight difference, and each update's per-step losses."""

    unmatched: list[str]
    weights: dict[str, float] = field(default_factory=dict)
    losses: tuple[list[float], list[float]] = ([], [])

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.weights, key=self.weights.get)
        return name, self.weights[name]

    @property
    def loss(self) -> float:
        """The largest difference of the steps both made."""
        return max((abs(x - y) for x, y in zip(*self.losses, strict=False)), default=0.0)


def update_gaps(a: Path, b: Path) -> UpdateGaps:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "policy" / "model.safetensors"), load_file(b / "policy" / "model.safetensors")
    if set(wa) != set(wb):
        return UpdateGaps(sorted(set(wa) ^ set(wb)))
    weights = {k: float((wa[k].double() - wb[k].double()).abs().max()) if wa[k].shape == wb[k].shape
               else float("inf") for k in wa}
    losses = tuple(commit.read_table(d, "stats", ["loss"])["loss"].to_pylist() for d in (a, b))
    return UpdateGaps([], weights, losses)


def _update_diff(a: Path, b: Path) -> tuple[bool, list[str]]:
    """The new policy's weights within WEIGHT_TOL, tensor by tensor; the per-step losses shown."""
    gaps = update_gaps(a, b)
    if gaps.unmatched:
        return False, [f"policy weights: tensors differ in name: {gaps.unmatched[:4]}"]
    (worst_name, worst), loss, (la, lb) = gaps.worst, gaps.loss, gaps.losses
    # another number of steps (a replay with other mini_batches) is judged below
    lines = [f"policy weights: max difference {worst:.2e} (in {worst_name})",
             f"per-step loss: max difference {loss:.2e}"]
    if worst >= WEIGHT_TOL:
        lines.append(f"beyond the weight tolerance {WEIGHT_TOL:.0e}: "
                     f"{sum(g >= WEIGHT_TOL for g in gaps.weights.values())} of {len(gaps.weights)} tensors")
    if len(la) != len(lb) or loss >= LOSS_TOL:
        lines.append(f"per-step loss beyond the tolerance {LOSS_TOL:.0e} ({len(la)} and {len(lb)} steps)")
    return worst < WEIGHT_TOL and len(la) == len(lb) and loss < LOSS_TOL, lines


DIFFS = {GENERATE: _generate_diff, SCORE: _score_diff, UPDATE: _update_diff}


def compare(original: Path, replayed: Path, stage: str) -> Report:
    """Byte identity of the committed files, and each stage's numeric view of what differs (shown
    even when the bytes agree); a stage matches when its bytes or its numbers agree."""
    ma, mb = commit.read_manifest(original), commit.read_manifest(replayed)
    identical = ma["files"] == mb["files"]
    lines = [f"files: {'byte-identical' if identical else 'different'} ({len(ma['files'])} files checked)"]
    if not identical:
        differing = sorted(k for k in set(ma["files"]) | set(mb["files"])
                           if ma["files"].get(k) != mb["files"].get(k))
        lines.append("differing files: " + ", ".join(differing[:8]))
    ok, more = DIFFS[stage](original, replayed)
    lines += more
    keys = sorted(set(ma["metrics"]) | set(mb["metrics"]))
    metrics = [(k, ma["metrics"].get(k), mb["metrics"].get(k)) for k in keys]
    return Report(identical, identical or ok, lines, metrics)


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
