"""Shared fixtures: the tiny task (built once, cached) and small experiment configs around it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_tool(name: str):
    """tools/<name>.py as a module (tools/ holds scripts, not a package)."""
    path = REPO / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session", autouse=True)
def measurement_cache(tmp_path_factory) -> Path:
    """One cache of prompt lengths and tokenizer facts (hpcrl.data.cache_dir) for the session's
    runs, in this process and the jobs it starts: each run's pre-flight then skips importing
    transformers (5 s). Entries are named by the bytes measured, so no test sees another's data."""
    path = tmp_path_factory.mktemp("hpcrl-cache")
    os.environ["HPCRL_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_task() -> Path:
    """The demo task's model and data, built by tools/build_tiny_task.py (cached across runs)."""
    out = Path(os.environ.get("HPCRL_TINY_TASK_DIR", REPO / ".cache" / "tiny-addition"))
    subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny_task.py"), "--out", str(out)],
                   check=True)
    return out


def stand_in_model(tiny_task: Path, dest: Path, positions: int = 32768) -> Path:
    """A copy of the tiny model at `dest` that claims `positions` positions (as Qwen2.5 does), for
    configs whose model.max_model_len is beyond the tiny model's 64; no vLLM is started on it."""
    import json
    import shutil

    shutil.copytree(tiny_task / "model", dest, dirs_exist_ok=True)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
    return dest


def experiment_toml(task: Path, runs_root: Path, name: str = "t", **sections) -> str:
    """A small experiment over the tiny task; `sections` override keys, e.g. update={"world_size": 2}.
    MLflow is off (a new store, its logging and the plots cost a run about 5 s here): the runs whose
    MLflow record a test reads turn it on with tracking={"enabled": True}."""
    base = {
        "run": {"name": name, "runs_root": str(runs_root), "seed": 3, "iterations": 2, "eval_every": 1},
        "model": {"path": str(task / "model"), "max_model_len": 64},
        "data": {"train": str(task / "data" / "train.parquet"), "test": str(task / "data" / "test.parquet"),
                 "max_val_prompts": 8},
        "algorithm": {"group_size": 4, "prompts_per_iteration": 8},
        "generate": {"max_tokens": 8, "kv_cache_gib": 0.25},
        "update": {"lr": 2e-4, "mini_batches": 2, "micro_batch_size": 8, "world_size": 1},
        "tracking": {"enabled": False},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    import tomli_w

    return tomli_w.dumps(base)


@pytest.fixture
def write_experiment(tmp_path, tiny_task):
    def write(name: str = "t", **sections) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(experiment_toml(tiny_task, tmp_path / "runs", name, **sections))
        return path

    return write


@pytest.fixture(scope="session")
def staged_ref_submitted(tmp_path_factory, tiny_task):
    """`staged_ref`, and what its `hpcrl submit` printed (tests/test_e2e.py checks the iteration lines)."""
    from hpcrl.rundir import RunDir

    root = tmp_path_factory.mktemp("staged-ref")
    path = root / "ref.toml"
    path.write_text(experiment_toml(tiny_task, root / "runs", "ref", tracking={"enabled": True}))
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return RunDir.at(root / "runs" / "ref"), out.stdout


@pytest.fixture(scope="session")
def staged_ref(staged_ref_submitted):
    """A staged run of `experiment_toml`'s experiment on the local executor, complete: the
    reference the other modes and executors are compared with, and the run whose output, MLflow
    record and status tests/test_e2e.py checks. Tests only read it (a test that changes a run works
    on a copy; test_e2e.py holds its lock for a moment)."""
    return staged_ref_submitted[0]


def task_pid(logs: Path, task: int, timeout: float = 300) -> int:
    """The pid of task `task` of a running submitit job whose folder is under `logs`."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"submitit.core._submit" in cmd and str(logs).encode() in cmd and \
                    f"SUBMITIT_LOCAL_GLOBALID={task}".encode() in env:
                return int(proc.name)
        time.sleep(0.5)
    raise AssertionError(f"no task {task} of a submitit job under {logs}")


@pytest.fixture
def own_engine():
    """vLLM's distributed state torn down before and after a test that starts an engine in the test
    process: every engine sets up its own groups (an MoE model needs an expert-parallel group that
    an engine of a dense model never made), and no test after it finds a process group left behind."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
    yield
    gc.collect()
    cleanup_dist_env_and_memory()
