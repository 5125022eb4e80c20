#!/usr/bin/env python
"""How fast `hpcrl inspect` answers on a big run: a synthetic run directory of 200 iterations x
100k rollouts (valid committed outputs with the real schemas, made by tests/synthetic_run.py),
timed in-process and through the CLI (a fresh interpreter, imports included).

    python tools/bench_inspect.py [--cache .cache/bench-inspect] [--iterations 200] [--rows 100000]

The synthetic run is built once into the cache directory and reused (an interrupted build
resumes). Times are the median of --repeats runs with a warm page cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _synthetic_run_module():
    spec = importlib.util.spec_from_file_location("synthetic_run", REPO / "tests" / "synthetic_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def cli(*args: str) -> Callable[[], None]:
    def run() -> None:
        subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], check=True, stdout=subprocess.DEVNULL,
                       cwd=REPO)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=REPO / ".cache" / "bench-inspect")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--rows", type=int, default=100_000, help="training rollouts per iteration")
    parser.add_argument("--val-rows", type=int, default=1000,
                        help="validation rollouts (every 5th iteration)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration for the detail (default: middle)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    synthetic = _synthetic_run_module()
    from hpcrl import inspection, runs

    root = args.cache / f"run-{args.iterations}x{args.rows}"
    t0 = time.perf_counter()
    run = synthetic.make_run(root, args.iterations, args.rows, val_rows=args.val_rows, progress=True)
    print(f"synthetic run ready in {time.perf_counter() - t0:.1f} s: {synthetic.describe(run)}")
    k = args.iteration if args.iteration is not None else args.iterations // 2
    k_val = k - k % 5  # an iteration that also validates
    run, exp = runs.open_run(root)

    cases = {
        "per-iteration table (in-process)": lambda: inspection.render_table(
            inspection.iteration_table(run, exp), exp, "table"),
        f"--iteration {k_val} detail (in-process)": lambda: inspection.render_detail(
            inspection.iteration_detail(run, k_val), "table"),
        "hpcrl inspect RUN (CLI)": cli("inspect", str(root)),
        "hpcrl inspect RUN --format json (CLI)": cli("inspect", str(root), "--format", "json"),
        f"hpcrl inspect RUN --iteration {k_val} (CLI)": cli("inspect", str(root), "--iteration", str(k_val)),
        f"hpcrl inspect RUN --iteration {k} --format csv (CLI)": cli(
            "inspect", str(root), "--iteration", str(k), "--format", "csv"),
        "python -c 'import hpcrl.cli' (CLI start-up alone)": lambda: subprocess.run(
            [sys.executable, "-c", "import hpcrl.cli"], check=True, cwd=REPO),
    }
    width = max(map(len, cases))
    print(f"\n{'what':<{width}}  {'median':>8}  {'min':>8}  {'max':>8}   (s, {args.repeats} repeats)")
    for name, fn in cases.items():
        fn()  # warm the page cache and the interpreter's imports
        times = timed(fn, args.repeats)
        print(f"{name:<{width}}  {statistics.median(times):8.3f}  {min(times):8.3f}  {max(times):8.3f}")


if __name__ == "__main__":
    main()
