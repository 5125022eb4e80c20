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

from hpcrl import agreement, commit, config, executors, plan, pruning, schemas
from hpcrl.config import Experiment
from hpcrl.replay_forced import Forced
from hpcrl.retention import POLICY, TRAINER
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import GENERATE, UPDATE

# Metrics that measure speed, not results: reported, never part of the verdict.
NOISY = ("perf/", "timing_s/")
LOGPROB_TOL = 1e-3
WEIGHT_TOL = 1e-6
LOSS_TOL = 1e-6  # absolute, per optimizer step
# An update replayed on other hardware (another device, core or thread count, torch): kernels sum in
# another order, so the weights are not compared one by one (Adam's first steps move a weight by
# about lr x the sign of its gradient, which flips where a gradient is near 0) but as one update:
# |new - start| of the replay against the original's, relative to the original's (32-bit, 16-bit).
# Measured on the demo: at most 1.9e-4, losses within 4.3e-6, between 2 and 1 CPU threads; on an H200
# against a CPU, losses within 1.2e-7 (docs/debugging.md). A doubled learning rate is 1.0.
ACROSS_LOSS_TOL = {32: 1e-4, 16: 1e-2}  # relative to max(1, |loss|)
ACROSS_UPDATE_TOL = {32: 0.05, 16: 0.5}


def bits(dtype: str) -> int:
    """The tolerances' precision class of a model.dtype."""
    return 32 if dtype == "float32" else 16


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


def _generate_diff(a: Path, b: Path, judging: Judging) -> tuple[bool, list[str]]:
    """Token agreement per sample, and the logprob difference on the samples that agree; across
    environments (`generate_across`) the original samples teacher-forced through the policy."""
    cols = ["response_ids", "logprobs", *(["prompt_ids"] if judging.across else [])]
    ra, rb = _rows(a, "rollouts", cols), _rows(b, "rollouts", ["response_ids", "logprobs"])
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
    if judging.across:
        return generate_across(ra, judging.forced, lines)
    if worst >= LOGPROB_TOL:
        lines.append(f"logprobs beyond the tolerance {LOGPROB_TOL:.0e}: worst at {_sample_name(worst_row)}")
    return all(same) and worst < LOGPROB_TOL, lines


def generate_across(rows: list[dict], forced: Forced | None, lines: list[str]) -> tuple[bool, list[str]]:
    """A generate stage replayed on another environment: its tokens may differ; the original
    samples' tokens, scored by the policy here (hpcrl.replay_forced), must have the logprobs the
    sampler recorded, within `forced.tol` on average."""
    if forced is None:
        lines.append("judged across environments: not judged without the policy the stage sampled from")
        return False, lines
    here = forced.score(rows)
    sampled = [r["logprobs"] for r in rows]
    gap = agreement.sampler_mismatch(dict(enumerate(here)), sampled)  # as the update measures it
    mean = gap["rollout/logprob_diff_mean"]
    lines.append(f"judged across environments: the original samples teacher-forced through the policy here "
                 f"against the sampler's logprobs: mean difference {mean:.2e} (tolerance {forced.tol:.0e}), "
                 f"max {gap['rollout/logprob_diff_max']:.2e}, KL {gap['rollout/sampler_kl']:.2e}")
    ok = bool(np.isfinite(mean)) and mean <= forced.tol
    if not ok:
        worst = max(range(len(rows)),
                    key=lambda i: float(np.max(np.abs(np.subtract(here[i], sampled[i])), initial=0.0)))
        lines.append("teacher-forced logprobs beyond the tolerance across environments: worst at "
                     + _sample_name(rows[worst]))
    return ok, lines


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
    tensor's largest weight difference, each update's per-step losses, and (given the policy they
    started from) how far apart the two updates are, relative to the first's size."""

    unmatched: list[str]
    weights: dict[str, float] = field(default_factory=dict)
    losses: tuple[list[float], list[float]] = ([], [])
    update: float | None = None

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.weights, key=self.weights.get)
        return name, self.weights[name]

    @property
    def loss(self) -> float:
        """The largest difference of the steps both made."""
        return max((abs(x - y) for x, y in zip(*self.losses, strict=False)), default=0.0)


def update_gaps(a: Path, b: Path, start: Path | None = None) -> UpdateGaps:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "policy" / "model.safetensors"), load_file(b / "policy" / "model.safetensors")
    if set(wa) != set(wb):
        return UpdateGaps(sorted(set(wa) ^ set(wb)))
    weights = {k: float((wa[k].double() - wb[k].double()).abs().max()) if wa[k].shape == wb[k].shape
               else float("inf") for k in wa}
    losses = tuple(commit.read_table(d, "stats", ["loss"])["loss"].to_pylist() for d in (a, b))
    gaps = UpdateGaps([], weights, losses)
    if start is not None and all(g < float("inf") for g in weights.values()):
        gaps.update = update_disagreement(wa, wb, start)
    return gaps


def update_disagreement(wa: dict, wb: dict, start: Path) -> float:
    """|b - a| / |a - start| over all tensors (b - a is the replay's update minus the original's):
    `start` is the policy folder both began from (its safetensors files); the size counts the
    tensors it holds under the same names."""
    from safetensors import safe_open

    apart = sum(float((wb[k].double() - wa[k].double()).square().sum()) for k in wa)
    size = 0.0
    for path in sorted(start.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                if name in wa and tuple(f.get_slice(name).get_shape()) == tuple(wa[name].shape):
                    size += float((wa[name].double() - f.get_tensor(name).double()).square().sum())
    if size == 0.0:
        return 0.0 if apart == 0.0 else float("inf")
    return (apart / size) ** 0.5


@dataclass(frozen=True)
class Judging:
    """How a replay is judged: `across` environments (they differ: hpcrl.replay.environment), an
    update from the policy folder it started from (`start`), in a model of `bits` (32 or 16), a
    generation by teacher forcing its samples (`forced`: hpcrl.replay_forced)."""

    across: bool = False
    start: Path | None = None
    bits: int = 32
    forced: Forced | None = None


def _update_diff(a: Path, b: Path, judging: Judging = Judging()) -> tuple[bool, list[str]]:
    """On the same environment the new policy's weights within WEIGHT_TOL, tensor by tensor, and
    the per-step losses within LOSS_TOL; across environments (`_across`) the losses and the update."""
    gaps = update_gaps(a, b, judging.start if judging.across else None)
    if gaps.unmatched:
        return False, [f"policy weights: tensors differ in name: {gaps.unmatched[:4]}"]
    (worst_name, worst), loss, (la, lb) = gaps.worst, gaps.loss, gaps.losses
    # another number of steps (a replay with other mini_batches) is judged below
    lines = [f"policy weights: max difference {worst:.2e} (in {worst_name})",
             f"per-step loss: max difference {loss:.2e}"]
    if judging.across:
        return _across(gaps, judging, lines)
    if worst >= WEIGHT_TOL:
        lines.append(f"beyond the weight tolerance {WEIGHT_TOL:.0e}: "
                     f"{sum(g >= WEIGHT_TOL for g in gaps.weights.values())} of {len(gaps.weights)} tensors")
    if len(la) != len(lb) or loss >= LOSS_TOL:
        lines.append(f"per-step loss beyond the tolerance {LOSS_TOL:.0e} ({len(la)} and {len(lb)} steps)")
    return worst < WEIGHT_TOL and len(la) == len(lb) and loss < LOSS_TOL, lines


def _across(gaps: UpdateGaps, judging: Judging, lines: list[str]) -> tuple[bool, list[str]]:
    """An update replayed on another environment: the same number of steps, each step's loss within
    ACROSS_LOSS_TOL of the original's (relative to max(1, |loss|)), and the replay's weight update
    within ACROSS_UPDATE_TOL of the original's, relative to its size."""
    (la, lb), loss_tol = gaps.losses, ACROSS_LOSS_TOL[judging.bits]
    update_tol = ACROSS_UPDATE_TOL[judging.bits]
    losses_agree = len(la) == len(lb) and all(abs(x - y) <= loss_tol * max(1.0, abs(x))
                                              for x, y in zip(la, lb, strict=True))
    lines.append(f"judged across environments: per-step loss within {loss_tol:.0e} (relative), the weight "
                 f"update within {update_tol:.0%} of the original's")
    if gaps.update is None:
        why = "without the policy the update started from" if judging.start is None else (
            "between tensors of other shapes")
        lines.append(f"weight update: not judged {why}")
    else:
        lines.append(f"weight update: the replay's differs from the original's by {gaps.update:.2e} "
                     "of its size")
    if not losses_agree:
        lines.append(f"per-step loss beyond the tolerance across environments ({len(la)} and {len(lb)} "
                     "steps)")
    update_agrees = gaps.update is not None and gaps.update <= update_tol
    if gaps.update is not None and not update_agrees:
        lines.append(f"weight update beyond the tolerance across environments ({update_tol:.0%})")
    return losses_agree and update_agrees, lines


ENVIRONMENT = ("device type", "devices", "device", "threads", "ranks", "torch")


def environment(manifest: dict) -> dict:
    """What a stage ran on, as far as its manifest records it (None: not recorded)."""
    use, dev = manifest.get("utilisation") or {}, manifest.get("device") or {}
    values = (use.get("device_type"), use.get("devices"), dev.get("name"), dev.get("threads"),
              manifest.get("world_size"), (manifest.get("packages") or {}).get("torch"))
    return dict(zip(ENVIRONMENT, values, strict=True))


def environment_changes(a: dict, b: dict) -> list[str]:
    """What differs between the environments of two manifests ("threads 2 -> 1"); what either one
    does not record is not compared."""
    ea, eb = environment(a), environment(b)
    return [f"{k} {ea[k]} -> {eb[k]}" for k in ENVIRONMENT
            if ea[k] is not None and eb[k] is not None and ea[k] != eb[k]]


def compare(original: Path, replayed: Path, stage: str, start: Path | None = None, bits: int = 32,
            forced: Forced | None = None) -> Report:
    """Byte identity of the committed files, and each stage's numeric view of what differs (shown
    even when the bytes agree); a stage matches when its bytes or its numbers agree. On another
    environment an update is judged with the tolerances across environments, from `start` (the
    policy folder it started from) in a model of `bits`, and a generation by `forced`; a score
    stage is deterministic on any environment."""
    ma, mb = commit.read_manifest(original), commit.read_manifest(replayed)
    identical = ma["files"] == mb["files"]
    lines = [f"files: {'byte-identical' if identical else 'different'} ({len(ma['files'])} files checked)"]
    if not identical:
        differing = sorted(k for k in set(ma["files"]) | set(mb["files"])
                           if ma["files"].get(k) != mb["files"].get(k))
        lines.append("differing files: " + ", ".join(differing[:8]))
    changes = environment_changes(ma, mb)
    lines.append("environment: " + (", ".join(changes) if changes else "the same"))
    judging = Judging(bool(changes), start, bits, forced)
    ok, more = (_update_diff(original, replayed, judging) if stage == UPDATE
                else _generate_diff(original, replayed, judging) if stage == GENERATE
                else _score_diff(original, replayed))
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
