#!/usr/bin/env python
"""Asynchronous generation against lock-step, side by side in one run: the resident demo and a
~100M-parameter CPU configuration at algorithm.max_staleness = 0, 1 and 2, with the trainer and
the generator pinned to cores of their own (HPCRL_ROLE_CPUS), as each role owns its GPUs on a GPU
node.

    python tools/bench_async.py [--models demo,100m] [--staleness 0,1,2] [--iterations 8] [--repeats 1]
                                [--reward-wait-ms 0] [--reward-workers 0] [--overlap-score on]

`--reward-wait-ms W` makes the reward wait W ms per sample, holding no CPU, as a remote judge or a
sandbox does (tools/latency_reward.py), on `--reward-workers` processes (reward.workers);
`--overlap-score on,off` runs each s > 0 both with the
scores beside the next generation (executor.resident.overlap_score, hpcrl.resident_scores) and
between two generations.

Each run goes through the real controller and resident job (as `hpcrl submit`). The iteration time
is the median wall time between the commits of consecutive updates over the steady iterations
(s+2..N-2: the earlier ones include the job's start and the first weight sync, which maps the
shared buffer; the last one saves the final checkpoint); samples per second = the update batch
over it. Utilisation per role is busy / allocated device-seconds
from the stages' manifests (hpcrl.utilisation) over the same iterations; "mean" is the
device-weighted total.

A second table splits the generator's allocated time per iteration: busy (sampling and rewards),
waiting for trainer 0's weights (sync/wait_s), loading them into vLLM (sync/load_s), the probe
(sync/probe_s), the score stage beyond its rewards' compute (reading the rollouts, writing and
committing the scores; none when the scores run beside the generations, on a thread whose time
is the generation's), and the rest (the loop between stages, and what of the generation's writes and
commit, on a thread behind the next one, holds up its core);
beside them, the trainer's busy time per iteration (its update's compute, with the forward
passes it computed ahead while the generation was scored: hpcrl.update_ahead). An iteration takes at
least the generator's floor, busy + load + probe (all on its device, between two generations), and
at least the trainer's busy time, which bounds the mean utilisation by
(generator busy + trainer busy) / (2 x the longer of the two).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path

from hpcrl import commit, config, runs, utilisation
from hpcrl.controller import Controller

REPO = Path(__file__).resolve().parents[1]


def _bench_resident():
    spec = importlib.util.spec_from_file_location("bench_resident", REPO / "tools" / "bench_resident.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def experiment(model: str, staleness: int, root: Path, iterations: int, tag: str, overlap: bool = True,
               reward_wait: bool = False, reward_workers: int = 0) -> config.Experiment:
    exp = config.load(REPO / "configs" / "demo.toml")
    overrides = {"run.name": f"{model}-s{staleness}-{'beside' if overlap else 'between'}-{tag}",
                 "run.runs_root": str(root), "run.iterations": iterations, "run.eval_every": 0,
                 "data.test": "", "tracking.enabled": False,
                 "executor.mode": "resident", "executor.resident.checkpoint_every": iterations,
                 "executor.resident.overlap_score": overlap, "algorithm.max_staleness": staleness,
                 "reward.workers": reward_workers}
    if reward_wait:
        overrides["reward.functions"] = ["latency_reward:exact_match_after_a_wait"]
    return config.with_overrides(exp, {**overrides, **_bench_resident().model_overrides(model)}, "bench")


def measure(exp: config.Experiment) -> dict[str, float]:
    run, _ = runs.prepare(exp, "bench")
    Controller(run, exp, echo=lambda line: print("   ", line, file=sys.stderr), show_progress=False).run_all()
    # after the first weight sync (at iteration s + 1: it maps the shared buffer), before the last
    # update (it saves the final checkpoint)
    steady = range(exp.algorithm.max_staleness + 2, exp.run.iterations - 1)
    updates = [commit.read_manifest(run.stage_dir(k, "update")) for k in range(exp.run.iterations)]
    wall = statistics.median(updates[k]["committed_at"] - updates[k - 1]["committed_at"] for k in steady)
    batch = exp.algorithm.prompts_per_iteration * exp.algorithm.group_size
    row = {"iteration": wall, "samples/s": batch / wall}
    manifests = [commit.read_manifest(run.stage_dir(k, s)) for k in steady
                 for s in ("generate", "score", "update")]
    roles = utilisation.by_role(m for m in manifests if m)
    for role, usage in (("generator", roles.get("generator")), ("trainer", roles.get("trainer")),
                        ("mean", utilisation.total(roles))):
        row[role] = usage.utilisation if usage is not None and usage.utilisation is not None else float("nan")
    return {**row, **generator_split(manifests, roles, len(steady))}


def generator_split(manifests: list[dict], roles: dict, iterations: int) -> dict[str, float]:
    """The generator's allocated seconds per iteration, split (module docstring), and the bound on
    the mean utilisation that its floor (busy + load + probe) and the trainer's busy time set."""
    gen, trainer = roles.get("generator"), roles.get("trainer")
    if gen is None or trainer is None:
        return {}
    generations = [m["metrics"] for m in manifests if m and m["stage"] == "generate"]
    sync = {name: sum(g.get(f"sync/{name}", 0.0) for g in generations) / iterations
            for name in ("wait_s", "load_s", "probe_s")}
    score = sum(m["utilisation"]["allocated_s"] - m["utilisation"]["busy_s"]
                for m in manifests if m and m["stage"] == "score") / iterations
    busy, allocated = gen.busy / iterations, gen.allocated / iterations
    floor = max(busy + sync["load_s"] + sync["probe_s"], trainer.busy / iterations)
    return {"gen busy": busy, "gen wait": sync["wait_s"], "gen load": sync["load_s"],
            "gen probe": sync["probe_s"], "gen score": score,
            "gen rest": allocated - busy - sum(sync.values()) - score,
            "trainer busy": trainer.busy / iterations,
            "bound": (gen.busy + trainer.busy) / iterations / (2 * floor)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,100m", help="comma-separated: demo, 100m")
    parser.add_argument("--staleness", default="0,1,2", help="comma-separated max_staleness values")
    parser.add_argument("--iterations", type=int, default=8, help="iterations per run (>= s + 4)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cpus", default="trainer=0;generator=1", help="HPCRL_ROLE_CPUS for the runs")
    parser.add_argument("--reward-wait-ms", type=float, default=0.0, help="the reward's wait per sample")
    parser.add_argument("--reward-workers", type=int, default=0, help="reward.workers of the runs")
    parser.add_argument("--overlap-score", default="on", help="comma-separated: on, off (for s > 0)")
    args = parser.parse_args()
    os.environ["HPCRL_ROLE_CPUS"] = args.cpus
    if args.reward_wait_ms:  # the jobs import tools/latency_reward.py
        os.environ["LATENCY_REWARD_WAIT_S"] = str(args.reward_wait_ms / 1000)
        paths = (str(REPO / "tools"), os.environ.get("PYTHONPATH"))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    levels = [int(s) for s in args.staleness.split(",")]
    overlaps = [o == "on" for o in args.overlap_score.split(",")]
    configs = [(s, o) for s in levels for o in (overlaps if s > 0 else overlaps[:1])]
    results: dict[tuple[str, int, bool], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-async-") as tmp:
        for model in args.models.split(","):
            for r in range(args.repeats):
                for s, o in configs if r % 2 == 0 else configs[::-1]:
                    print(f"{model} max_staleness {s} overlap_score {o} repeat {r + 1}/{args.repeats}",
                          file=sys.stderr)
                    exp = experiment(model, s, Path(tmp), args.iterations, str(r), o, args.reward_wait_ms > 0,
                                     args.reward_workers)
                    results.setdefault((model, s, o), []).append(measure(exp))
    wait = f"; the reward waits {args.reward_wait_ms:g} ms per sample" if args.reward_wait_ms else ""
    wait += f"; {args.reward_workers} reward workers" if args.reward_workers else ""
    print(f"median over iterations s+2..{args.iterations - 2} and {args.repeats} repeat(s); roles pinned "
          f"({args.cpus}); utilisation = busy / allocated device-seconds{wait}")
    print_table(args.models.split(","), configs, results)
    print_split(args.models.split(","), [c for c in configs if c[0] > 0], results)


def print_table(models: list[str], configs: list[tuple[int, bool]], results: dict) -> None:
    cols = ("iteration", "samples/s", "generator", "trainer", "mean")
    print("| model | max_staleness | scores | iteration s | samples/s | util generator | util trainer "
          "| util mean | samples/s vs s=0 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in models:
        med = {c: {col: statistics.median(r[col] for r in results[(model, *c)]) for col in cols}
               for c in configs}
        base = med[configs[0]]["samples/s"]
        for (s, o), row in med.items():
            print(f"| {model} | {s} | {scores(s, o)} | {row['iteration']:.2f} | {row['samples/s']:.1f} "
                  f"| {row['generator']:.0%} | {row['trainer']:.0%} | {row['mean']:.0%} "
                  f"| {row['samples/s'] / base:.2f}x |")


def scores(s: int, overlap: bool) -> str:
    """Where the score stages ran: beside the next generation, or between two."""
    return "beside" if s > 0 and overlap else "between"


SPLIT = ("gen busy", "gen wait", "gen load", "gen probe", "gen score", "gen rest", "trainer busy", "bound")


def print_split(models: list[str], configs: list[tuple[int, bool]], results: dict) -> None:
    """Where the generator's time goes at each s > 0, and the bound its floor sets (docstring)."""
    print("\ngenerator's allocated ms per iteration (medians); bound = the most mean utilisation an "
          "iteration no shorter than the generator's busy + load + probe, nor the trainer's busy, allows")
    print("| model | max_staleness | scores | busy | waiting for weights | loading them | probe "
          "| score stage | rest | trainer busy | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for s, o in configs:
            runs = results[(model, s, o)]
            med = {c: statistics.median(r.get(c, float("nan")) for r in runs) for c in SPLIT}
            ms = " | ".join(f"{med[c] * 1000:.1f}" for c in SPLIT[:-1])
            print(f"| {model} | {s} | {scores(s, o)} | {ms} | {med['bound']:.0%} |")


if __name__ == "__main__":
    main()
