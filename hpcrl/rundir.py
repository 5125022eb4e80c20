"""The run directory layout: where every file of a run lives, and nothing else.

    <runs_root>/<run_name>/
      experiment.toml         frozen, fully resolved config
      run.json                run id, MLflow run id, code version, created
      iter_000000/{generate,score,update}/   committed stage outputs (see hpcrl.commit)
      policy/v000001 -> ../iter_000000/update/policy   HF weights of each trained version
      logs/                   one folder per stage job
      retention.jsonl         what retention pruned (hpcrl.pruning); pins.json: pinned versions

Policy version 0 is the configured base model; version v > 0 is written, with the DeepSpeed
state that produced it (and, for PPO, the critic trained with it: `critic/`, its DeepSpeed state
in `trainer/critic/`), by the update stage of iteration v - 1 and committed with it. The staged
mode saves every version; the resident mode saves every `executor.resident.checkpoint_every`-th (and the
last), so there a committed update may hold no `policy/`. A run continues from its latest saved
version: stages committed after it are moved aside (`rollback`), never overwritten.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcrl import commit
from hpcrl.stage_kinds import ORDER, UPDATE

CONFIG_FILE = "experiment.toml"
RUN_FILE = "run.json"


# What flock(2) fails with on a filesystem without working locks: Lustre mounted `noflock` (ENOSYS),
# NFS without a lock manager (ENOLCK), others that do not implement it (EINVAL, EOPNOTSUPP).
NO_LOCKS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP})


class RunLockedError(RuntimeError):
    """The run's lock cannot be taken: another controller holds it."""


class LocksUnsupportedError(RunLockedError):
    """The run's lock cannot be taken: flock(2) does not work on the run's filesystem."""


def locks_unsupported(where: str | os.PathLike, err: OSError) -> str:
    """Why runs cannot be locked in `where` (flock failed with `err`), and what to do."""
    name = errno.errorcode.get(err.errno, str(err.errno))
    return (f"file locks do not work on the filesystem of {where}: flock(2) fails with {name} "
            f"({os.strerror(err.errno)}); hpcrl needs them to let one controller drive a run. Expected a "
            "filesystem with working locks: mount Lustre with the option `flock` (not `localflock` or "
            "`noflock`), NFS with a running lock manager (not `nolock`) (see `mount | grep <filesystem>`), "
            "or set run.runs_root to a filesystem where they work (docs/slurm.md, \"Shared filesystems: "
            "tracking and locks\")")


def flock(fd: int, operation: int, path: str | os.PathLike) -> None:
    """fcntl.flock on the open file `path`; on a filesystem without working locks, LocksUnsupportedError."""
    try:
        fcntl.flock(fd, operation)
    except OSError as err:
        if err.errno in NO_LOCKS:
            raise LocksUnsupportedError(locks_unsupported(path, err)) from err
        raise


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike) -> RunDir:
        return cls(Path(path).resolve())

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def run_file(self) -> Path:
        return self.root / RUN_FILE

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def iteration_dir(self, iteration: int) -> Path:
        return self.root / f"iter_{iteration:06d}"

    def stage_dir(self, iteration: int, stage: str) -> Path:
        if stage not in ORDER:
            raise ValueError(f"unknown stage {stage!r}; expected one of {ORDER}")
        return self.iteration_dir(iteration) / stage

    def shard_dir(self, iteration: int, stage: str, shard: int, shards: int) -> Path:
        """Shard `shard` of `shards` of a stage split over several tasks (hpcrl.shards), committed
        like a stage: iter_K/<stage>.shards/<i>-of-<n>."""
        return self.stage_dir(iteration, stage).with_name(f"{stage}.shards") / f"{shard}-of-{shards}"

    def policy_dir(self, version: int, base_model: str | os.PathLike) -> Path:
        """HF weights of a policy version; version 0 is the base model of the config."""
        if version == 0:
            return Path(base_model)
        return self.stage_dir(version - 1, UPDATE) / "policy"

    def trainer_state_dir(self, version: int) -> Path | None:
        """DeepSpeed state that produced `version` (None for the base model)."""
        return None if version == 0 else self.stage_dir(version - 1, UPDATE) / "trainer"

    def critic_dir(self, version: int, initial: str | os.PathLike) -> Path:
        """PPO's critic trained alongside a policy version (HF-style backbone + value_head.safetensors);
        for version 0, `initial` (algorithm.critic.path, else the base model)."""
        if version == 0:
            return Path(initial)
        return self.stage_dir(version - 1, UPDATE) / "critic"

    def critic_state_dir(self, version: int) -> Path | None:
        """The critic's DeepSpeed state (inside the trainer state); None for version 0."""
        state = self.trainer_state_dir(version)
        return None if state is None else state / "critic"

    def has_policy(self, version: int) -> bool:
        """Whether the weights of `version` were saved (always for 0, the base model)."""
        stage = self.stage_dir(version - 1, UPDATE) if version else None
        return version == 0 or (self.policy_dir(version, "") / "config.json").is_file() and (
            commit.is_committed(stage) and "policy" not in commit.pruned_parts(stage))

    def latest_saved_version(self) -> int:
        """The highest policy version whose weights and trainer state are committed."""
        versions = [k + 1 for k in self.iterations_present() if self.has_policy(k + 1)]
        return max(versions, default=0)

    def rollback(self, version: int | None = None,
                 policy_of: Callable[[int], int] = lambda k: k) -> list[Path]:
        """Move aside every committed stage that depends on a policy version after `version`
        (default: the latest saved; a resident run that stopped between checkpoints), so the run
        continues from `version`: each iteration whose generation sampled with a later version
        (`policy_of`), and each update from `version` on. Returns the moved directories' new paths."""
        v = self.latest_saved_version() if version is None else version
        moved = []
        stamp = _stamp()
        for k in self.iterations_present():
            if policy_of(k) > v:
                targets = [self.iteration_dir(k)]
            elif k >= v:
                targets = [self.stage_dir(k, UPDATE)]
            else:
                continue
            for d in targets:
                if d.exists():
                    dest = d.with_name(f"{d.name}.rolled-back-{stamp}")
                    d.rename(dest)
                    moved.append(dest)
        return moved

    def publish_policy(self, version: int) -> Path | None:
        """Make policy/vNNNNNN point at a saved version (derived state, idempotent)."""
        if not self.has_policy(version):
            return None
        link = self.root / "policy" / f"v{version:06d}"
        link.parent.mkdir(exist_ok=True)
        target = os.path.relpath(self.policy_dir(version, ""), link.parent)
        if not link.is_symlink():
            link.symlink_to(target, target_is_directory=True)
        return link

    def read_run_info(self) -> dict:
        from hpcrl.commit import read_json_object

        return read_json_object(self.run_file, "restore it from a backup (it holds the run's ids and "
                                "history)") if self.run_file.exists() else {}

    def write_run_info(self, info: dict) -> None:
        tmp = self.run_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.run_file)

    def record_stop(self, stop: dict | None) -> None:
        """Why the run stopped (run.json "stopped"; None clears it when a controller starts again)."""
        info = self.read_run_info()
        if stop is None and "stopped" not in info:
            return
        if stop is None:
            info.pop("stopped")
        else:
            info["stopped"] = {"at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                               **stop}
        self.write_run_info(info)

    def record_alert(self, alert: dict) -> None:
        """Append an alert (hpcrl.alerts) to run.json's "alerts"."""
        info = self.read_run_info()
        info.setdefault("alerts", []).append(
            {**alert, "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
        self.write_run_info(info)

    @property
    def jobs_file(self) -> Path:
        return self.root / "jobs.jsonl"

    def record_job(self, job_id: str, role: str, iteration: int | None, array: int = 0) -> None:
        """Append a submitted job to jobs.jsonl (for status, cancel and a restarted controller);
        `array`: the tasks of a job array (a stage's shards), 0 for a plain job."""
        import time

        with open(self.jobs_file, "a") as f:
            f.write(json.dumps({"job_id": job_id, "role": role, "iteration": iteration,
                                "submitted": time.time(), **({"array": array} if array else {})}) + "\n")

    def jobs(self) -> list[dict]:
        if not self.jobs_file.is_file():
            return []
        return [json.loads(line) for line in self.jobs_file.read_text().splitlines() if line.strip()]

    def iterations_present(self) -> list[int]:
        found = []
        names = os.listdir(self.root) if self.root.is_dir() else []
        for name in names:
            if name.startswith("iter_"):
                try:
                    found.append(int(name.split("_", 1)[1]))
                except ValueError:
                    continue
        return sorted(found)


def _stamp() -> str:
    import time

    return time.strftime("%Y%m%dT%H%M%S")


class RunLock:
    """An exclusive lock on a run, held by its controller.

    Uses flock(2): the kernel drops it when the holder dies, so a crash never wedges the run.
    The file records who holds it, to name them in the error.
    """

    def __init__(self, run: RunDir):
        self.path = run.root / ".controller.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.path)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise RunLockedError(
                f"run {self.path.parent} is already driven by another controller ({holder}); "
                "stop it first, or wait for it to finish"
            ) from None
        except (LocksUnsupportedError, OSError):
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
