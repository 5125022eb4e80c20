#!/usr/bin/env python
"""The submit-time disk estimate (hpcrl.disk_budget) against the bytes finished runs hold, on the
demo experiment and on the ~100M-parameter CPU configuration of tools/bench_resident.py.

    python tools/bench_disk_budget.py [--models demo,100m] [--iterations 3]

Each model runs twice through the real controller and executor (as `hpcrl submit`, staged): once
keeping everything, once with run.retention.keep_last = 2 and keep_trainer_states = 1. The table
prints the estimate of the end state, what the run directory holds at the end (its logs included),
and the error.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hpcrl import config, disk_budget, pruning, runs
from hpcrl.controller import Controller

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bench_resident import experiment  # noqa: E402 - tools/ is not a package

RULES = {"all kept": {}, "keep_last 2, 1 trainer state": {"run.retention.keep_last": 2,
                                                          "run.retention.keep_trainer_states": 1}}


def measure(exp: config.Experiment) -> tuple[int, int]:
    """(estimated bytes at the end, bytes the run directory holds at the end)."""
    estimate = disk_budget.estimate(exp).final
    run, _ = runs.prepare(exp, "bench")
    Controller(run, exp, echo=lambda line: print("   ", line, file=sys.stderr), show_progress=False).run_all()
    return estimate, pruning.disk_use(run.root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,100m", help="comma-separated: demo, 100m")
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-disk-") as tmp:
        for model in args.models.split(","):
            for label, rules in RULES.items():
                print(f"{model}, {label}", file=sys.stderr)
                base = experiment(f"{model}-{len(rules)}", model, "staged", Path(tmp), args.iterations)
                exp = config.with_overrides(base, rules, "bench") if rules else base
                rows.append((model, label, *measure(exp)))
    print(f"| model | retention | estimate | measured | error |  ({args.iterations} iterations, staged)")
    print("|---|---|---|---|---|")
    for model, label, est, got in rows:
        print(f"| {model} | {label} | {pruning.size(est)} | {pruning.size(got)} | {(est - got) / got:+.1%} |")


if __name__ == "__main__":
    main()
