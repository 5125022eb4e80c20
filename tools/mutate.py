#!/usr/bin/env python
"""Mutation testing of hpcrl's core modules with mutmut 3: each group of modules against the fast
tests that exercise it, one table of scores at the end (`make mutate`; docs/testing.md).

    python tools/mutate.py [--list] [--diffs] [--max-children N] [GROUP ...]

GROUPS below names each group's modules and test files; \
DEFAULT runs the groups that fit in 30 min, `all` every
group. A group runs in its own scratch directory, mutants/<group>/: \
links to the sources and a setup.cfg whose [mutmut]
section is the project's with `only_mutate` and `pytest_add_cli_args_test_selection` set to the
group. There mutmut copies the project into mutants/<group>/mutants/, records which of the
group's tests call each function, and runs every mutant against those tests only, forked from a
process that has imported everything. Each run starts from scratch: mutmut keeps a cached verdict
even when a new test would now kill the mutant.

The score is (killed + timeout) / mutants, mutmut's own; a mutant no test reaches counts against
it. --diffs prints each surviving mutant's diff (`mutmut show NAME`, run in mutants/<group>/).
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINKED = ("hpcrl", "stages", "sbatch", "containers", "tests", "tools", "configs", "docs",
          "README.md")  # what the tests read
GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # name: (modules, test files)
    "algorithms": (("advantages", "losses", "kl_control"),
                   ("test_algorithms", "test_parity", "test_off_policy")),
    "batches": (("batches",), ("test_batches",)),
    "dynamic_sampling": (("dynamic_sampling",), ("test_dynamic_sampling",)),
    "config": (("config", "config_section", "config_training", "config_reward", "config_jobs",
                "config_reference", "runs", "plan", "stage_kinds"),
               ("test_config", "test_plan", "test_run_creation", "test_docs", "test_stage_kinds",
                "test_shards")),
    "commit": (("commit", "stage"), ("test_commit", "test_shards", "test_stage_runner", "test_utilisation")),
    "replay": (("replay", "replay_forced"),
               ("test_replay_verdicts", "test_replay_across", "test_replay_forced")),
    "weight_sync": (("weight_sync", "transports", "agreement"), ("test_weight_sync", "test_agreement")),
    "preemption": (("preemption",), ("test_preemption_ranks",)),
    "critic": (("critic",), ("test_critic",)),
    "colocation": (("colocation",), ("test_colocation",)),
    "versions": (("versions", "resident_scores", "resident_commits"),
                 ("test_versions", "test_resident_scores", "test_resident_commits")),
    "megatron": (("megatron_convert", "config_megatron"), ("test_megatron_convert", "test_config")),
    "utilisation": (("utilisation",), ("test_utilisation", "test_utilisation_edges")),
    "scoring": (("scoring", "rewards"), ("test_scoring", "test_rewards", "test_reward_backends")),
    "retention": (("retention", "pruning"), ("test_retention",)),
    "alerts": (("alerts",), ("test_alerts", "test_alert_rules")),
    "update_ahead": (("update_ahead",), ("test_update_ahead",)),
}
DEFAULT = ("algorithms", "dynamic_sampling", "config", "commit", "replay", "critic",
           "versions", "utilisation", "retention", "alerts", "update_ahead")  # ~20 min on 2 cores
KILLED = {1, 3}  # mutmut's exit codes (mutmut.stats.status_by_exit_code)
SURVIVED = {0}
TIMEOUT = {36, -24, 24, 152, 255}


def plain_failures(root: Path, group: str, env: dict[str, str]) -> str:
    """The last lines of the group's tests run plainly in mutmut's copy of the project."""
    tests = [f"tests/{t}.py" for t in GROUPS[group][1]]
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", *tests],
                         cwd=root / "mutants", env=env, capture_output=True, text=True)
    return "\n   ".join((out.stdout + out.stderr).strip().splitlines()[-6:])


def project_config() -> configparser.ConfigParser:
    """setup.cfg, checked: its [mutmut] lists exactly the modules and test files of GROUPS."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(REPO / "setup.cfg")
    modules = {f"hpcrl/{m}.py" for ms, _ in GROUPS.values() for m in ms}
    tests = {f"tests/{t}.py" for _, ts in GROUPS.values() for t in ts}
    if set(cfg["mutmut"]["only_mutate"].split()) != modules or \
            set(cfg["mutmut"]["pytest_add_cli_args_test_selection"].split()) != tests:
        raise SystemExit("mutate: setup.cfg [mutmut] only_mutate / pytest_add_cli_args_test_selection differ "
                         "from tools/mutate.py GROUPS")
    return cfg


def scratch(group: str, cfg: configparser.ConfigParser) -> Path:
    """A fresh mutants/<group>/ with the group's [mutmut] config."""
    modules, tests = GROUPS[group]
    root = REPO / "mutants" / group
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    cfg["mutmut"]["only_mutate"] = "".join(f"\nhpcrl/{m}.py" for m in modules)
    cfg["mutmut"]["pytest_add_cli_args_test_selection"] = "".join(f"\ntests/{t}.py" for t in tests)
    with open(root / "setup.cfg", "w") as f:
        cfg.write(f)
    return root


def counts(root: Path, module: str) -> tuple[dict[str, int], list[str]]:
    """Mutants, killed, survived, timeout and score of one module; the names of its survivors."""
    meta = json.loads((root / "mutants" / "hpcrl" / f"{module}.py.meta").read_text())["exit_code_by_key"]
    codes = list(meta.values())
    row = {"mutants": len(codes), "killed": sum(c in KILLED for c in codes),
           "survived": sum(c in SURVIVED for c in codes), "timeout": sum(c in TIMEOUT for c in codes)}
    row["other"] = row["mutants"] - row["killed"] - row["survived"] - row["timeout"]
    return row, sorted(k for k, c in meta.items() if c in SURVIVED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", metavar="GROUP",
                        help=f"{', '.join(GROUPS)} or all (default: {' '.join(DEFAULT)})")
    parser.add_argument("--list", action="store_true", help="print the groups and exit")
    parser.add_argument("--diffs", action="store_true", help="print the diff of every surviving mutant")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1,
                        help="mutants tested at once")
    args = parser.parse_args(argv)
    groups = list(GROUPS) if args.groups == ["all"] else args.groups or list(DEFAULT)
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        parser.error(f"unknown group(s) {', '.join(unknown)}; known: {', '.join(GROUPS)}")
    if args.list:
        for name, (modules, tests) in GROUPS.items():
            print(f"{name:18} {', '.join(modules):36} {', '.join(tests)}")
        return 0
    cfg = project_config()
    mutmut = Path(sys.executable).with_name("mutmut")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("HPCRL_TINY_TASK_DIR", str(REPO / ".cache" / "tiny-addition"))
    rows: list[tuple[str, dict[str, int]]] = []
    survivors: list[tuple[Path, str]] = []
    failed: list[str] = []
    start = time.monotonic()
    for group in groups:
        root = scratch(group, cfg)
        t0 = time.monotonic()
        print(f"== {group}: {', '.join(GROUPS[group][0])} against {', '.join(GROUPS[group][1])}", flush=True)
        run = subprocess.run([str(mutmut), "run", "--max-children", str(args.max_children)], cwd=root,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = run.stdout.strip().splitlines()[-3:]
        print(f"   {time.monotonic() - t0:.0f} s; " + " | ".join(line.strip() for line in tail), flush=True)
        if run.returncode:
            print(f"   mutmut failed (exit {run.returncode}); its output: {root}/mutmut.log", flush=True)
            (root / "mutmut.log").write_text(run.stdout)
            if "failed to collect stats" in run.stdout:  # the group's tests fail on the unmutated copy
                print("   the group's tests fail in mutmut's copy of the project (a file they read is not "
                      f"in LINKED?):\n   {plain_failures(root, group, env)}", flush=True)
            failed.append(group)
            continue
        for module in GROUPS[group][0]:
            row, names = counts(root, module)
            rows.append((f"hpcrl/{module}.py", row))
            survivors += [(root, name) for name in names]
    print(f"\nwall time {time.monotonic() - start:.0f} s\n")
    print(f"{'module':28} {'mutants':>7} {'killed':>7} {'survived':>8} {'timeout':>7} {'other':>5} "
          f"{'score':>6}")
    for module, r in rows:
        score = (r["killed"] + r["timeout"]) / max(r["mutants"], 1)
        print(f"{module:28} {r['mutants']:7} {r['killed']:7} {r['survived']:8} {r['timeout']:7} "
              f"{r['other']:5} {score:6.1%}")
    print(f"\n{len(survivors)} surviving mutants" + (":" if survivors else ""))
    for root, name in survivors:
        if args.diffs:
            shown = subprocess.run([str(mutmut), "show", name], cwd=root, env=env, capture_output=True,
                                   text=True)
            print(shown.stdout.rstrip() or shown.stderr.rstrip())
        else:
            print(f"  {name}")
    if failed:
        print(f"\nfailed groups: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
