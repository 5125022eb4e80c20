#!/usr/bin/env python
"""Where the wall time of one staged iteration goes: process start-up, model loading, compute and
parquet I/O, per stage, for the demo experiment (or another one).

    python tools/bench_stage_split.py [--config configs/demo.toml] [--repeats 2]

Each repeat runs iteration 0 of a fresh copy of the run through the real LocalExecutor, as
`hpcrl submit` does, and reads the phase timings from the committed manifests. "start-up" is
everything before the stage's own code runs (submitit launching the process, the interpreter,
imports of vLLM / DeepSpeed / transformers); "exit+exec" is what remains of the job's wall time
(interpreter teardown after the commit, and submitit's launch and bookkeeping).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hpcrl import commit, config, executors, runs

REPO = Path(__file__).resolve().parents[1]
PHASES = ("startup", "load", "compute", "io")


def one_iteration(exp: config.Experiment, root: Path, name: str) -> dict[str, dict[str, float]]:
    exp = config.with_overrides(exp, {"run.name": name, "run.runs_root": str(root), "run.iterations": 1,
                                      "run.eval_every": 0, "tracking.enabled": False}, "bench")
    run, _ = runs.prepare(exp, "bench")
    ex = executors.make(run, exp)
    out = {}
    for stage in ("generate", "score", "update"):
        t0 = time.perf_counter()
        job = ex.submit(stage, 0)
        while not job.done():  # poll finely: submitit's own wait() sleeps in whole seconds
            time.sleep(0.02)
        if job.error() is not None:
            raise RuntimeError(f"{stage} failed: {job.stderr_tail()}")
        wall = time.perf_counter() - t0
        timings = commit.read_manifest(run.stage_dir(0, stage))["timings"]
        row = {p: timings.get(p, 0.0) for p in PHASES}
        row["wall"] = wall
        row["exit+exec"] = wall - sum(row[p] for p in PHASES)
        out[stage] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.toml"))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    exp = config.load(args.config)
    results = []
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-") as tmp:
        for r in range(args.repeats):
            results.append(one_iteration(exp, Path(tmp), f"bench{r}"))
            print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    cols = ("wall", "startup", "load", "compute", "io", "exit+exec")
    print(f"one staged iteration of {args.config} (median of {args.repeats}; "
          "seconds, share of stage wall time)")
    print(f"{'stage':<10}" + "".join(f"{c:>16}" for c in cols))
    totals = dict.fromkeys(cols, 0.0)
    for stage in ("generate", "score", "update"):
        med = {c: statistics.median(res[stage][c] for res in results) for c in cols}
        for c in cols:
            totals[c] += med[c]
        print(f"{stage:<10}" + "".join(f"{med[c]:>9.2f} ({med[c] / med['wall']:>4.0%})" for c in cols))
    print(f"{'total':<10}" + "".join(f"{totals[c]:>9.2f} ({totals[c] / totals['wall']:>4.0%})" for c in cols))


if __name__ == "__main__":
    main()
