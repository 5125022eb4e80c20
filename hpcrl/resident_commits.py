"""The generations the resident generator commits behind it, on one background thread
(hpcrl.resident_generator).

Once a generation has sampled, the rest of its stage runs on the thread while the engine loads
the next weights and samples the next generation: waiting until the update that made its policy
is committed (the trainers commit it, checkpoint included, while the engine samples), writing
the rollouts and committing them (a write and fsyncs, on a shared filesystem). The engine's
devices wait for neither.

Generations commit in the order handed over. A score stage reads its generation only once that
is committed (`wait`), so no stage commits on an input that is not, and takes the rollouts as
they were committed (`written`) rather than reading them back. Once a commit fails, none after it
commits; the failure is raised where its generation is next needed (`wait`, `check`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from hpcrl.stage import OpenStage, StageContext


class CommitsBehind:
    """The generate stages handed to the background thread, by iteration."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hpcrl-commit")
        self._handed: set[int] = set()
        self._pending: dict[int, Future] = {}  # those not seen committed yet (`check`)
        self._failed: int | None = None  # the first generation whose commit failed: none after it commits
        self._written: dict[int, dict] = {}  # the tables of each committed generation not taken yet

    def submit(self, k: int, attempt: OpenStage, rest: Callable[[StageContext], None]) -> None:
        """Finish the generate stage of iteration k (`attempt`, its sampling done) on the thread:
        `rest` of its body, then its commit."""
        self._handed.add(k)
        self._pending[k] = self._thread.submit(self._finish, k, attempt, rest)

    def _finish(self, k: int, attempt: OpenStage, rest: Callable[[StageContext], None]) -> None:
        if self._failed is not None:
            attempt.close()
            raise RuntimeError(f"the generation of iteration {k} was not committed: that of iteration "
                               f"{self._failed} failed")
        try:
            attempt.run(rest)
            attempt.commit()
        except BaseException:
            self._failed = k
            raise
        self._written[k] = attempt.ctx.writer.written

    def handed(self, k: int) -> bool:
        """Whether generation k is the thread's (committed, or to be)."""
        return k in self._handed

    def wait(self, k: int | None = None) -> None:
        """Until generation k (when None, every one handed over) is committed; raises its failure.
        Safe from any thread."""
        futures = list(self._pending.values()) if k is None else [self._pending.get(k)]
        for future in futures:
            if future is not None:
                future.result()

    def written(self, k: int) -> dict:
        """The tables generation k committed, by name, once (after `wait(k)`); none when this
        object did not commit it (an earlier attempt did). Safe from any thread."""
        return self._written.pop(k, {})

    def check(self) -> None:
        """Raise the failure of a commit that has ended, if any; forget those that succeeded."""
        for k, future in list(self._pending.items()):
            if future.done():
                future.result()
                del self._pending[k]

    def close(self, wait: bool = True) -> None:
        """Wait for the commit under way (if any) to end, unless not `wait` (after an error: it may
        wait on the trainers' commit, which the failure flag stops); drop those not started."""
        self._thread.shutdown(wait=wait, cancel_futures=True)
