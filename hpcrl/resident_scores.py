"""The score stages the resident generator runs beside its generations (with
algorithm.max_staleness >= 1 and `executor.resident.overlap_score`).

Iteration k + 1 samples with a policy that does not need update k, so the generator need not wait
for iteration k's rewards: it hands score k to one background thread and goes on to generation
k + 1. The thread runs the scores in iteration order; once score k commits, it commands update k
itself, so the trainers start it while the generation samples. A slow reward (a sandbox, a judge
over HTTP, a reward model) then costs no device time; a score stage still commits only once its
generation has, and an update is commanded only once its score is committed.

The generator's own thread learns which updates were commanded (`collect`) before it decides what
to run next; it never commands an update whose score it handed over (`owns`). A score that fails
raises in the generator's thread at its next `collect`.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BesideScores:
    """`score(k)` runs and commits the score stage of iteration k; `command(k)` commands update k
    and returns its command number; `trains(k)`: whether iteration k has an update."""

    def __init__(self, score: Callable[[int], object], command: Callable[[int], int],
                 trains: Callable[[int], bool]):
        self._score, self._command, self._trains = score, command, trains
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hpcrl-score")
        self._pending: dict[int, Future] = {}  # handed over, not collected yet
        self._commanded: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._failed: int | None = None  # the first score that raised: none after it runs

    def submit(self, k: int) -> None:
        """Score iteration k on the thread, after those handed over before it."""
        self._pending[k] = self._thread.submit(self._run, k)

    def _run(self, k: int) -> None:
        if self._failed is not None:  # its update was never commanded: no later one may be
            raise RuntimeError(f"the score of iteration {k} did not run: that of iteration {self._failed} "
                               "failed")
        try:
            self._score(k)
            if self._trains(k):
                self._commanded.put((k, self._command(k)))
        except BaseException:
            self._failed = k
            raise

    def owns(self, k: int) -> bool:
        """Whether score k (and so the command of update k) is the thread's, not collected yet."""
        return k in self._pending

    def collect(self, until: int | None = None) -> list[tuple[int, int]]:
        """The updates commanded since the last call, (iteration, command number) in order, once
        the scores of iterations up to `until` (none when None) have ended; a score that ended
        with an error raises it here."""
        for k in sorted(self._pending):
            if until is not None and k <= until or self._pending[k].done():
                self._pending.pop(k).result()  # its error, in the generator's thread
        out = []
        while not self._commanded.empty():
            out.append(self._commanded.get())
        return out

    def close(self, wait: bool = True) -> None:
        """Wait for the score on the thread (if any) to end, unless not `wait` (after an error: it
        may wait on the trainers, whom the failure flag stops); drop those not started."""
        self._thread.shutdown(wait=wait, cancel_futures=True)
