"""Running independent I/O tasks a few at a time, failing as a serial loop would.

A reader reading several files (a rank whose share spans other ranks' shards after a resharding,
a dedup sibling's files) spends its time waiting on the disk, and ``os.preadv`` releases the GIL:
one thread per file keeps each file's stream going at once. The tasks are independent, so the only
rule to keep is the serial loop's failure: the error reported is the one the first failing task
(in the given order) raised, and once a task fails no later task that has not started yet runs.
Every task before the first failure runs (a thread that took an earlier task off the queue may
see a later task's failure before it starts it: skipping it then would report a later error).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["TaskRunner"]

Task = Callable[[], None]


class TaskRunner:
    """A small thread pool kept for the life of one reader (threads start on first use)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, tasks: Sequence[Task]) -> None:
        """Run every task; raise what the first failing one (in order) raised, after the others stopped."""
        if self.threads == 1 or len(tasks) < 2:
            for task in tasks:
                task()
            return
        pool = self._get_pool()
        first_failed = [len(tasks)]  # the lowest index of a task that failed so far
        lock = threading.Lock()

        def guarded(index: int, task: Task) -> Task:
            def run_unless_after_a_failure() -> None:
                if index > first_failed[0]:  # only later tasks are skipped: an earlier one may fail first
                    return
                try:
                    task()
                except BaseException:
                    with lock:
                        first_failed[0] = min(first_failed[0], index)
                    raise

            return run_unless_after_a_failure

        futures: list[Future[None]] = [pool.submit(guarded(i, task)) for i, task in enumerate(tasks)]
        first: BaseException | None = None
        for future in futures:
            exc = future.exception()  # waits: every task has finished or been skipped once this loop ends
            if exc is not None and first is None:
                first = exc
        if first is not None:
            raise first

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="shardsafe-read")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
