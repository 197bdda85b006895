"""Leases on a checkpoint root (shardsafe.manager.lease): one live run per root, takeover, fencing.

Holders run in real subprocesses, so "another job" is another process with its own pid, and a
zombie is a process stopped with SIGSTOP and continued with SIGCONT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardsafe.errors import LeaseHeldError, LeaseLostError
from shardsafe.manager.lease import LEASE_DIR, Lease, LeaseRecord, LocalRecords
from shardsafe.storage.remote import RemoteDir

pytest_plugins = ["servers.fixtures"]  # moto_server, s3_bucket

SRC = str(Path(__file__).resolve().parents[2] / "src")

HOLDER = textwrap.dedent(
    """
    import sys, time
    from shardsafe.manager.lease import Lease
    from shardsafe.errors import LeaseLostError
    root, timeout = sys.argv[1], float(sys.argv[2])
    if "://" in root:
        from shardsafe.storage.remote import RemoteDir
        root = RemoteDir(root)
    lease = Lease(root, timeout=timeout, run_id="holder")
    lease.acquire()
    print("acquired", lease.epoch, flush=True)
    for line in sys.stdin:  # each line: "check" -> the fencing check, as before a commit
        try:
            lease.check("commit a checkpoint")
            print("ok", flush=True)
        except LeaseLostError as exc:
            print("lost", exc, flush=True)
    """
)


def _start_holder(root: str, timeout: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root, str(timeout)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("acquired"), line
    return proc


def _ask(proc: subprocess.Popen[str]) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("check\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=10)


def test_second_run_is_refused_and_names_the_holder(tmp_path: Path) -> None:
    holder = _start_holder(str(tmp_path), timeout=4)
    try:
        start = time.monotonic()
        with pytest.raises(LeaseHeldError) as info:
            Lease(tmp_path, timeout=1.0).acquire()  # the holder renews every 1 s and lapses after 4 s: alive
        waited = time.monotonic() - start
        message = str(info.value)
        assert (
            "run holder" in message and f"pid {holder.pid}" in message and "host " in message and "heartbeat" in message
        )
        assert 4.5 <= waited < 15  # the holder's 4 s timeout (+1 s), being longer than its own 1 s
        assert _ask(holder) == "ok"  # the first run is untouched
    finally:
        _stop(holder)


def test_killed_holder_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    holder = _start_holder(str(tmp_path), timeout=600)
    _stop(holder)  # SIGKILL: no release
    start = time.monotonic()
    lease = Lease(tmp_path, timeout=600)
    record = lease.acquire()
    assert time.monotonic() - start < 5  # not the 600 s timeout: the pid is provably gone
    assert record.epoch == 2
    lease.release()


def test_zombie_holder_can_publish_nothing_after_takeover(tmp_path: Path) -> None:
    holder = _start_holder(str(tmp_path), timeout=1.5)
    try:
        os.kill(holder.pid, signal.SIGSTOP)  # paused: no heartbeat
        lease = Lease(tmp_path, timeout=1.5)
        record = lease.acquire()  # waits for the heartbeat to lapse, then takes over
        assert record.epoch == 2
        os.kill(holder.pid, signal.SIGCONT)
        answer = _ask(holder)
        assert answer.startswith("lost") and "taken over" in answer and "epoch 1" in answer
        lease.check("commit")  # the new holder is fine
        lease.release()
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        _stop(holder)


def test_release_lets_the_next_run_in_with_a_higher_epoch(tmp_path: Path) -> None:
    first = Lease(tmp_path, timeout=30)
    assert first.acquire().epoch == 1
    first.release()
    second = Lease(tmp_path, timeout=30)
    start = time.monotonic()
    assert second.acquire().epoch == 2
    assert time.monotonic() - start < 2
    with pytest.raises(LeaseLostError):
        first.check("delete a checkpoint")  # released: holds nothing
    second.release()


def test_a_released_lease_is_taken_without_a_takeover_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A clean close hands the root over: the next run says so quietly; a lapsed lease is warned about."""
    first = Lease(tmp_path, timeout=30, run_id="first")
    first.acquire()
    first.release()
    with caplog.at_level("INFO", logger="shardsafe"):
        second = Lease(tmp_path, timeout=30, run_id="second")
        second.acquire()
    taken = [r for r in caplog.records if "took over the lease" in r.getMessage()]
    assert [r.levelname for r in taken] == ["INFO"], [(r.levelname, r.getMessage()) for r in taken]
    assert "released at its close" in taken[0].getMessage() and "heartbeat" not in taken[0].getMessage()
    second.release()


def test_heartbeat_keeps_a_live_holder(tmp_path: Path) -> None:
    lease = Lease(tmp_path, timeout=0.8)
    lease.acquire()
    time.sleep(2.5)  # several timeouts: the renewal thread keeps the heartbeat fresh
    with pytest.raises(LeaseHeldError):
        Lease(tmp_path, timeout=0.8).acquire()
    lease.check("commit")
    lease.release()


def test_damaged_record_counts_as_a_lapsed_holder(tmp_path: Path) -> None:
    (tmp_path / LEASE_DIR).mkdir()
    (tmp_path / LEASE_DIR / "epoch-0000000003.json").write_bytes(b"\xff not json")
    lease = Lease(tmp_path, timeout=0.5)
    assert lease.acquire().epoch == 4
    lease.release()


def test_concurrent_creates_of_one_epoch_have_one_winner(tmp_path: Path) -> None:
    store = LocalRecords(tmp_path)
    records = [LeaseRecord(f"run{i}", "h", i + 100, 0.0, 0.0, 1) for i in range(8)]
    assert [store.create(r) for r in records].count(True) == 1


def test_s3_root_lease_and_fencing(s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run"
    holder = _start_holder(url, timeout=1.5)
    try:
        with pytest.raises(LeaseHeldError):
            Lease(RemoteDir(url), timeout=0.5).acquire()
        os.kill(holder.pid, signal.SIGSTOP)
        lease = Lease(RemoteDir(url), timeout=1.5)
        assert lease.acquire().epoch == 2
        os.kill(holder.pid, signal.SIGCONT)
        assert _ask(holder).startswith("lost")
        lease.release()
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        _stop(holder)


def test_s3_conditional_create_has_one_winner(s3_bucket: str) -> None:
    from shardsafe.manager.lease import RemoteRecords

    store = RemoteRecords(RemoteDir(f"s3://{s3_bucket}/race"))
    results = [store.create(LeaseRecord(f"run{i}", "h", i, 0.0, 0.0, 7)) for i in range(4)]
    assert results.count(True) == 1 and store.conditional  # the store refused the later creates itself
