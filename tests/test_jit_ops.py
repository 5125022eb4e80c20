"""DeepSpeed's op builds survive a killed build: the lock file it leaves is removed by the next
load, under a kernel lock (hpcrl.jit_ops)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from filelock import FileLock, Timeout

from hpcrl import jit_ops


def _guard(tmp_path: Path, load):
    return jit_ops.guarded(load, directory=lambda name: tmp_path / "py311_cpu" / name)


def test_a_killed_builds_lock_file_is_removed_and_the_op_loaded_under_the_kernel_lock(tmp_path):
    where = tmp_path / "py311_cpu" / "op_a"
    where.mkdir(parents=True)
    (where / "lock").touch()
    seen = []

    def load(builder, verbose=True):
        seen.append((builder.name, verbose, (where / "lock").exists()))
        with pytest.raises(Timeout):  # held by this load while it runs
            FileLock(str(where.parent / "op_a.hpcrl.lock")).acquire(timeout=0)
        return "module"

    assert _guard(tmp_path, load)(SimpleNamespace(name="op_a"), verbose=False) == "module"
    assert seen == [("op_a", False, False)]
    FileLock(str(where.parent / "op_a.hpcrl.lock")).acquire(timeout=0)  # released after the load


def test_a_load_without_a_lock_file_leaves_the_build_directory_alone(tmp_path):
    where = tmp_path / "py311_cpu" / "op_b"
    where.mkdir(parents=True)
    (where / "op_b.so").write_bytes(b"built")
    guarded = _guard(tmp_path, lambda builder: sorted(p.name for p in where.iterdir()))
    assert guarded(SimpleNamespace(name="op_b")) == ["op_b.so"]
    assert guarded.hpcrl_guarded


def test_deepspeed_is_guarded_once():
    from deepspeed.ops.op_builder.builder import OpBuilder

    jit_ops.import_deepspeed()
    first = OpBuilder.jit_load
    jit_ops.import_deepspeed()
    assert first.hpcrl_guarded and OpBuilder.jit_load is first


def _build_directory(name: str, env) -> Path:
    code = f"from hpcrl.jit_ops import build_directory; print(build_directory({name!r}))"
    return Path(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               check=True).stdout.strip())


_LOAD_SHM = """
from hpcrl.jit_ops import import_deepspeed
import_deepspeed()
from deepspeed.comm.torch import build_shm_op
assert build_shm_op() is not None
"""


def test_a_process_group_starts_after_a_killed_build_of_its_shared_memory_op(tmp_path):
    """The op every CPU process group of DeepSpeed loads, with a killed build's lock file in its
    build directory: without the guard the load waits forever (the subprocess's timeout fails it)."""
    name = "deepspeed_shm_comm"
    built = _build_directory(name, os.environ)  # the user's cache, where the op may be built
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    where = _build_directory(name, env)
    assert where.parent == tmp_path
    if (built / f"{name}.so").exists():  # spare the test a 40 s compile
        shutil.copytree(built, where, ignore=shutil.ignore_patterns("lock"), dirs_exist_ok=True)
    where.mkdir(parents=True, exist_ok=True)
    (where / "lock").touch()
    done = subprocess.run([sys.executable, "-c", _LOAD_SHM], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "left by a build of DeepSpeed's deepspeed_shm_comm op that was killed" in done.stdout
    assert not (where / "lock").exists() and (where / f"{name}.so").exists()
