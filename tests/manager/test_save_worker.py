"""The async save's writer thread (manager/staging.SaveWorker): order, join, errors, restart."""

from __future__ import annotations

import threading
import time

from shardsafe.manager.staging import SaveWorker


def test_jobs_run_in_order_on_one_thread_and_join_waits_for_all() -> None:
    worker = SaveWorker()
    seen: list[tuple[int, str]] = []

    def job(i: int) -> None:
        time.sleep(0.01)
        seen.append((i, threading.current_thread().name))

    for i in range(5):
        worker.submit(lambda i=i: job(i))
    assert worker.busy or len(seen) == 5
    worker.join()
    assert not worker.busy
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"shardsafe-save"}
    worker.close()
    assert not [t for t in threading.enumerate() if t.name == "shardsafe-save"]


def test_a_job_that_raises_does_not_stop_the_next_one() -> None:
    worker = SaveWorker()
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("disk full")

    worker.submit(boom)
    worker.join()
    worker.submit(done.set)  # the error is logged, the thread goes on
    worker.join()
    assert done.is_set()
    worker.close()


def test_close_then_submit_starts_again() -> None:
    worker = SaveWorker()
    hits: list[int] = []
    worker.submit(lambda: hits.append(1))
    worker.close()
    worker.submit(lambda: hits.append(2))
    worker.join()
    worker.close()
    assert hits == [1, 2]
