"""One live run per checkpoint root: a lease with a fencing epoch.

Two jobs saving into one root (the same ``output_dir`` twice, a requeued job while the preempted
one still runs) would delete each other's checkpoints and overwrite each other's steps. So the
coordinator of a run takes a *lease* on the root before its first save or deletion, renews it from
a background thread, and checks at the last moment before every commit and every deletion that
it still holds it (the *fencing* check). A run whose lease was taken over (a paused process that
resumes after its replacement started) can then publish nothing and delete nothing.

The record store needs one primitive only, *create if absent*:

* each lease generation is its own record ``<root>/.shardsafe-lease/epoch-<N>.json``; the holder
  is the record with the highest epoch;
* taking the lease (first time, or over a lapsed holder) creates ``epoch-<N+1>``: if two runs race,
  exactly one create succeeds; the other sees a live holder;
* renewing rewrites the holder's own record (no one else writes it);
* fencing: the holder lists the records; a higher epoch than its own means it was taken over.

Local and shared filesystems create with ``os.link`` of a fully written temporary file (atomic
on POSIX filesystems and on NFS, unlike ``flock``). Object stores create with a conditional PUT
(S3 ``If-None-Match: *``, what s3fs calls ``mode="create"``); stores without conditional writes
fall back to check-then-write, which two runs starting within the same instant can both pass
(documented in docs/RELIABILITY.md).

A lease lapses when its heartbeat is older than the holder's ``lease_timeout`` (recorded in it): judged first from the
holder's own clock (tolerating :data:`CLOCK_SKEW` seconds of skew), and otherwise by watching the
heartbeat not change for ``lease_timeout`` seconds of the waiting run's own monotonic clock, which
needs no synchronised clocks at all. A holder on the same host whose process is gone is taken over
at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from shardsafe.core.comm import Comm
from shardsafe.errors import LeaseHeldError, LeaseLostError, ShardsafeError
from shardsafe.protocol.temppath import hidden_name
from shardsafe.storage.local import fsync_dir, make_dirs, read_small_file
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir

__all__ = ["DEFAULT_LEASE_TIMEOUT", "LEASE_DIR", "Lease", "LeaseRecord", "LocalRecords", "RemoteRecords", "RootLease"]

log = logging.getLogger(__name__)

LEASE_DIR = ".shardsafe-lease"
DEFAULT_LEASE_TIMEOUT = 60.0
CLOCK_SKEW = 5.0  # seconds of wall-clock difference between hosts tolerated before trusting a heartbeat's age
MAX_RECORD_BYTES = 4096
_RECORD = "epoch-{epoch:010d}.json"
_UNREADABLE = -1.0  # heartbeat of a record that could not be read: it lapses only by being seen unchanged for a timeout
RELEASED_PID = -1  # with heartbeat 0: the record a run leaves when it gives the lease up at a clean close


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds a root: the run, where it runs, and the generation (epoch) of its lease."""

    run_id: str
    host: str
    pid: int
    started: float
    heartbeat: float
    epoch: int
    timeout: float = DEFAULT_LEASE_TIMEOUT  # the holder's: its lease lapses this long after its last heartbeat

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> LeaseRecord:
        try:
            raw = json.loads(data)
            record = cls(
                run_id=str(raw["run_id"]),
                host=str(raw["host"]),
                pid=int(raw["pid"]),
                started=float(raw["started"]),
                heartbeat=float(raw["heartbeat"]),
                epoch=int(raw["epoch"]),
                timeout=float(raw.get("timeout", DEFAULT_LEASE_TIMEOUT)),
            )
            if not (0 < record.timeout < 1e9):
                raise ValueError("timeout out of range")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ShardsafeError(f"{where}: not a valid lease record ({type(exc).__name__})") from None
        return record

    @property
    def released(self) -> bool:
        """Given up by its run at a clean close (:meth:`RootLease.release` marks it so)."""
        return self.pid == RELEASED_PID and self.heartbeat == 0.0

    def describe(self, now: float | None = None) -> str:
        if self.released:
            return f"run {self.run_id} (host {self.host}, epoch {self.epoch}, released at its close)"
        age = (now if now is not None else time.time()) - self.heartbeat
        return (
            f"run {self.run_id} (host {self.host}, pid {self.pid}, epoch {self.epoch}, last heartbeat {age:.0f} s ago)"
        )


class RecordStore(Protocol):
    """Where lease records live: list epochs, read one, create one if absent, overwrite one's own."""

    where: str

    def epochs(self) -> list[int]: ...

    def read(self, epoch: int) -> LeaseRecord | None: ...

    def create(self, record: LeaseRecord) -> bool: ...

    def overwrite(self, record: LeaseRecord) -> None: ...

    def remove(self, epoch: int) -> None: ...


def _epoch_of(name: str) -> int | None:
    if name.startswith("epoch-") and name.endswith(".json") and name[6:-5].isdigit():
        return int(name[6:-5])
    return None


class LocalRecords:
    """Lease records in a folder on a local or shared filesystem."""

    def __init__(self, root: Path) -> None:
        self.folder = Path(root) / LEASE_DIR
        self.where = str(self.folder)

    def epochs(self) -> list[int]:
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        return sorted(e for e in map(_epoch_of, names) if e is not None)

    def _path(self, epoch: int) -> Path:
        return self.folder / _RECORD.format(epoch=epoch)

    def read(self, epoch: int) -> LeaseRecord | None:
        path = self._path(epoch)
        try:
            data = read_small_file(path, MAX_RECORD_BYTES)
        except FileNotFoundError:
            return None
        return LeaseRecord.parse(data, str(path))

    def _write_tmp(self, record: LeaseRecord) -> Path:
        make_dirs(self.folder)  # durably: an epoch record in a folder that a power cut removes is no record
        tmp = self.folder / hidden_name(_RECORD.format(epoch=record.epoch))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, record.to_bytes())
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def create(self, record: LeaseRecord) -> bool:
        tmp = self._write_tmp(record)
        try:
            os.link(tmp, self._path(record.epoch))  # fails if the record exists: the one atomic step
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        fsync_dir(self.folder)
        return True

    def overwrite(self, record: LeaseRecord) -> None:
        tmp = self._write_tmp(record)
        os.replace(tmp, self._path(record.epoch))

    def remove(self, epoch: int) -> None:
        try:
            os.unlink(self._path(epoch))
        except FileNotFoundError:
            pass


class RemoteRecords:
    """Lease records under an object-store prefix; created with a conditional PUT where the store has one."""

    def __init__(self, root: RemoteDir) -> None:
        self.dir = root.child(LEASE_DIR)
        self.where = self.dir.url
        self.conditional = True

    def epochs(self) -> list[int]:
        return sorted(e for e in map(_epoch_of, self.dir.list()) if e is not None)

    def read(self, epoch: int) -> LeaseRecord | None:
        name = _RECORD.format(epoch=epoch)
        key = self.dir.key(name)
        self.dir.fs.invalidate_cache(key)  # the holder rewrites its record; never trust a cached size
        try:
            data = bytes(self.dir.fs.cat_file(key, start=0, end=MAX_RECORD_BYTES + 1))
        except FileNotFoundError:
            return None
        if len(data) > MAX_RECORD_BYTES:
            raise ShardsafeError(f"{self.dir.url}/{name}: more than {MAX_RECORD_BYTES} bytes, not a lease record")
        return LeaseRecord.parse(data, f"{self.dir.url}/{name}")

    def create(self, record: LeaseRecord) -> bool:
        key = self.dir.key(_RECORD.format(epoch=record.epoch))
        if self.conditional:
            try:
                self.dir.fs.pipe_file(key, record.to_bytes(), mode="create")
                return True
            except FileExistsError:
                return False
            except (TypeError, NotImplementedError):  # the store has no conditional create
                self.conditional = False
                log.warning(
                    "%s: the store has no conditional writes; lease creation falls back to check-then-write", self.where
                )
            except OSError as exc:
                if "PreconditionFailed" in repr(exc) or "412" in str(exc):
                    return False
                raise
        if self.dir.fs.exists(key):
            return False
        self.dir.fs.pipe_file(key, record.to_bytes())
        return True

    def overwrite(self, record: LeaseRecord) -> None:
        self.dir.write_bytes(_RECORD.format(epoch=record.epoch), record.to_bytes())

    def remove(self, epoch: int) -> None:
        try:
            self.dir.remove([_RECORD.format(epoch=epoch)])
        except FileNotFoundError:
            pass


def records_for(root: Path | RemoteDir) -> RecordStore:
    return as_location(root).choose(local=LocalRecords, remote=RemoteRecords)


def _process_gone(record: LeaseRecord) -> bool:
    """True only when the holder provably no longer runs: same host, and no process with its pid."""
    if record.host != socket.gethostname() or record.pid <= 0:
        return False
    if record.pid == os.getpid():
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Lease:
    """The coordinator's lease on one root: :meth:`acquire`, :meth:`check` before each commit or
    deletion, :meth:`release` at the end. Renewed by a daemon thread every ``timeout / 4`` seconds."""

    def __init__(
        self, root: Path | RemoteDir, *, timeout: float = DEFAULT_LEASE_TIMEOUT, run_id: str | None = None
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"lease_timeout must be positive, got {timeout!r}")
        self.store = records_for(root)
        self.timeout = float(timeout)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.record: LeaseRecord | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int | None:
        return self.record.epoch if self.record is not None else None

    def _current(self) -> LeaseRecord | None:
        for epoch in reversed(self.store.epochs()):
            try:
                record = self.store.read(epoch)
            except ShardsafeError as exc:  # unreadable now: a holder whose heartbeat we cannot see
                log.warning("%s", exc)
                return LeaseRecord("unknown", "unknown", -1, 0.0, _UNREADABLE, epoch, self.timeout)
            if record is not None:
                return record
        return None

    def acquire(self) -> LeaseRecord:
        """Take the lease, waiting for a live holder's lease to lapse: at most ``timeout`` seconds, or
        the holder's own timeout (plus a poll) when that is longer, so a run whose predecessor died
        on another host always gets in."""
        start = time.monotonic()
        watched: tuple[int, float] | None = None  # (epoch, heartbeat) last seen, and since when
        watched_since = time.monotonic()
        while True:
            holder = self._current()
            now = time.time()
            if holder is None or self._lapsed(holder, now, watched, watched_since):
                if self._take(holder, now):
                    return self.record  # type: ignore[return-value]
                continue  # another run won the race to the next epoch: look again
            seen = (holder.epoch, holder.heartbeat)
            if seen != watched:
                watched, watched_since = seen, time.monotonic()
            if time.monotonic() >= start + max(self.timeout, holder.timeout + 1.0):
                raise LeaseHeldError(
                    f"{self.store.where}: the checkpoint root is in use by {holder.describe(now)}; "
                    f"waited {time.monotonic() - start:.0f} s for its lease to lapse. Stop that run, or save into "
                    "another root; if it is gone, "
                    f"its lease lapses {self.timeout:.0f} s after its last heartbeat (or remove {self.store.where} by "
                    "hand)"
                )
            time.sleep(min(0.5, max(0.05, self.timeout / 20)))

    def _lapsed(self, holder: LeaseRecord, now: float, watched: tuple[int, float] | None, since: float) -> bool:
        if holder.run_id == self.run_id:
            return True
        if holder.heartbeat != _UNREADABLE and (
            _process_gone(holder) or now - holder.heartbeat > holder.timeout + CLOCK_SKEW
        ):
            return True
        # Clock-free: the heartbeat has not changed for a whole (holder's) timeout of our own monotonic clock.
        return watched == (holder.epoch, holder.heartbeat) and time.monotonic() - since > holder.timeout

    def _take(self, holder: LeaseRecord | None, now: float) -> bool:
        epoch = (holder.epoch + 1) if holder is not None else 1
        record = LeaseRecord(self.run_id, socket.gethostname(), os.getpid(), now, now, epoch, self.timeout)
        if not self.store.create(record):
            return False
        if holder is not None and holder.run_id != self.run_id:
            # a lease its run released is the normal hand-over; one that lapsed deserves a warning
            report = log.info if holder.released else log.warning
            report("%s: took over the lease from %s", self.store.where, holder.describe(now))
        for old in self.store.epochs():
            if old < epoch:
                self.store.remove(old)
        with self._lock:
            self.record, self.lost = record, None
        self._start_renewal()
        return True

    def _start_renewal(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew_loop, name="shardsafe-lease", daemon=True)
            self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.timeout / 4):
            try:
                self.renew()
            except LeaseLostError:
                return
            except Exception as exc:  # a transient store error: try again at the next beat
                log.warning("%s: lease renewal failed: %s", self.store.where, exc)

    def renew(self) -> None:
        with self._lock:
            self._check_locked()
            assert self.record is not None
            self.record = LeaseRecord(**{**asdict(self.record), "heartbeat": time.time()})
            self.store.overwrite(self.record)

    def check(self, what: str) -> None:
        """Fencing: raise :class:`LeaseLostError` unless this run still holds the lease (call right before ``what``)."""
        with self._lock:
            self._check_locked(what)

    def _check_locked(self, what: str = "renew the lease") -> None:
        if self.record is None:
            raise LeaseLostError(f"{self.store.where}: this run holds no lease on the root; cannot {what}")
        if self.lost is None:
            newer = [e for e in self.store.epochs() if e > self.record.epoch]
            if newer:
                holder = self.store.read(newer[-1])
                taker = holder.describe() if holder is not None else f"epoch {newer[-1]}"
                self.lost = f"the lease (epoch {self.record.epoch}) was taken over by {taker}"
        if self.lost is not None:
            raise LeaseLostError(
                f"{self.store.where}: {self.lost}; this run ({self.run_id}) must not {what}, and did not"
            )

    def release(self) -> None:
        """Stop renewing and give the root up (only if still ours), so a next run starts at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if (
                self.record is not None
                and self.lost is None
                and max(self.store.epochs(), default=0) == self.record.epoch
            ):
                # Leave the epoch record (so the next epoch is higher) but mark it lapsed.
                self.store.overwrite(LeaseRecord(**{**asdict(self.record), "heartbeat": 0.0, "pid": RELEASED_PID}))
            self.record = None


class RootLease:
    """A :class:`Lease` held by a group's coordinator for all its ranks (the manager, the Trainer, Accelerate saving).

    :meth:`ensure` is collective (every rank waits while the coordinator takes the lease, and all
    raise the same :class:`LeaseHeldError`); :meth:`fence` runs on the coordinator right before it
    publishes or deletes anything. ``run_id`` and ``epoch`` are known on every rank once held.
    """

    def __init__(self, root: Path | RemoteDir, comm: Comm, *, timeout: float = DEFAULT_LEASE_TIMEOUT) -> None:
        self.comm = comm
        self.lease = Lease(root, timeout=timeout) if comm.is_coordinator else None
        self.run_id: str | None = None
        self.epoch: int | None = None

    def ensure(self) -> None:
        if self.epoch is not None:
            return

        def take() -> tuple[str, int]:
            assert self.lease is not None
            record = self.lease.acquire()
            return record.run_id, record.epoch

        self.run_id, self.epoch = self.comm.on_coordinator(take, default=LeaseHeldError)

    def fence(self, what: str) -> None:
        """Coordinator: raise :class:`LeaseLostError` unless this run still holds the root."""
        if self.lease is not None:
            self.lease.check(what)

    def metadata(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "lease_epoch": self.epoch}

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.epoch = None
