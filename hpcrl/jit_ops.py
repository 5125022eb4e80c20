"""DeepSpeed's just-in-time compiled ops, loaded so that a killed job cannot stall every later one.

DeepSpeed compiles its C++ ops (on CPU the shared-memory collective that every process group builds;
on GPUs its Adam variants) with torch.utils.cpp_extension into ~/.cache/torch_extensions (or
$TORCH_EXTENSIONS_DIR), shared by every job of the user. Each load, even of an op already built,
first creates the build directory's `lock` file and deletes it afterwards; a process that finds the
file waits, without a timeout, until it is gone. A job killed in that window (scancel, preemption,
a time limit, the out-of-memory killer: a first build takes 40 s on two cores) leaves the file
behind, and every later job that loads the op waits forever.

`import_deepspeed` returns DeepSpeed with each op's load serialised under a kernel lock (flock, which
the kernel releases when its holder dies). Whoever holds that lock knows that a `lock` file it finds
was left by a dead holder, removes it and builds. A process outside hpcrl that builds the same op
at that moment (not under the kernel lock) would have its lock file removed; builds of different
ops, and ranks of one job loading the same op, are unaffected.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def build_directory(name: str) -> Path:
    """Where torch builds (and finds) the extension `name`."""
    from torch.utils import cpp_extension

    # private, but the one place that knows the layout: ~/.cache/torch_extensions/py311_cpu/<name>,
    # or $TORCH_EXTENSIONS_DIR/<name>
    return Path(cpp_extension._get_build_directory(name, verbose=False))


def guarded(load, directory=build_directory):
    """`load(builder, ...)` (OpBuilder.jit_load) under the kernel lock of the builder's op, after
    removing the `lock` file a killed build left."""
    from filelock import FileLock

    @functools.wraps(load)
    def guarded_load(builder, *args, **kwargs):
        where = directory(builder.name)
        with FileLock(str(where.parent / f"{where.name}.hpcrl.lock")):
            baton = where / "lock"
            if baton.exists():
                log.warning("removing %s, left by a build of DeepSpeed's %s op that was killed", baton,
                            builder.name)
                baton.unlink(missing_ok=True)
            return load(builder, *args, **kwargs)

    guarded_load.hpcrl_guarded = True
    return guarded_load


def import_deepspeed():
    """DeepSpeed, with its op builds guarded (once per process)."""
    import deepspeed
    from deepspeed.ops.op_builder.builder import OpBuilder

    if not getattr(OpBuilder.jit_load, "hpcrl_guarded", False):
        OpBuilder.jit_load = guarded(OpBuilder.jit_load)
    return deepspeed
