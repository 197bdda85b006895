"""Pinned host buffers for device copies: a small, bounded pool allocated once per process and reused.

A copy between a GPU and pageable host memory is staged by the driver through a bounce buffer of its
own and blocks the host thread; from page-locked ("pinned") memory it is a DMA the host need not
wait for, which is what lets the copy of one piece run while the previous piece is hashed and
written. Pinning is slow (the pages are locked and mapped for the device) and the amount a
process may pin is limited, so pinning per save or per tensor is wrong twice over. The buffers
here are allocated lazily, on first use by a CUDA tensor (a CPU-only process never allocates
one), kept for the life of the process, and never more than ``buffers`` of ``buffer_bytes`` each
(:func:`configure`; 2 x 64 MiB by default).

The pool never blocks: :meth:`PinnedPool.lease` hands out what is free (up to the bound) and,
when another user holds every buffer, one temporary unpinned buffer instead (counted in
``overflows``), so no caller can wait on another forever and the bound always holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_BUFFER_BYTES", "PinnedPool", "configure", "pinned_pool", "split_range"]

DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024
DEFAULT_BUFFERS = 2
log = logging.getLogger(__name__)

BUFFER_ALIGN = 64  # every buffer size is a multiple of this, so a buffer holds whole elements of any dtype


@dataclass(frozen=True)
class PoolStats:
    """What a pool has done, for tests and benchmarks: pinned bytes must not grow save after save."""

    buffer_bytes: int
    limit: int  # most buffers it will ever allocate
    allocated: int  # buffers allocated so far (never freed)
    in_use: int
    leases: int
    overflows: int  # leases that found every buffer taken and got an unpinned temporary

    @property
    def allocated_bytes(self) -> int:
        return self.allocated * self.buffer_bytes


class PinnedPool:
    """At most ``buffers`` host buffers of ``buffer_bytes`` each, allocated on first demand and reused.

    ``pin=False`` gives plain host buffers with the same logic, for the tests of a machine without
    an accelerator (where ``pin_memory=True`` raises).
    """

    def __init__(
        self, buffer_bytes: int = DEFAULT_BUFFER_BYTES, buffers: int = DEFAULT_BUFFERS, *, pin: bool = True
    ) -> None:
        if not isinstance(buffer_bytes, int) or buffer_bytes < BUFFER_ALIGN or buffer_bytes % BUFFER_ALIGN:
            raise ValueError(
                f"pinned buffer size must be a positive multiple of {BUFFER_ALIGN} bytes, not {buffer_bytes!r}"
            )
        if not isinstance(buffers, int) or buffers < 1:
            raise ValueError(f"the number of pinned buffers must be a positive integer, not {buffers!r}")
        self.buffer_bytes = buffer_bytes
        self.limit = buffers
        self.pin = pin
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._in_use = 0
        self._leases = 0
        self._overflows = 0

    def take(self, wanted: int) -> list[torch.Tensor]:
        """Up to ``wanted`` buffers, at once: free ones first, then new ones while under the bound. May be empty."""
        with self._lock:
            got = [self._free.pop() for _ in range(min(wanted, len(self._free)))]
            grow = min(wanted - len(got), self.limit - self._allocated)
            self._allocated += grow  # counted before allocating (outside the lock), so the bound holds under races
            self._in_use += len(got) + grow
        fresh: list[torch.Tensor] = []
        try:
            for _ in range(grow):
                fresh.append(torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin))
        except BaseException as exc:
            with self._lock:
                self._allocated -= grow - len(fresh)
                self._in_use -= grow - len(fresh)
                if isinstance(exc, RuntimeError):  # the host cannot pin more: stop trying, lend what there is
                    self.limit = self._allocated
            if not isinstance(exc, RuntimeError):
                raise
            log.warning(
                "shardsafe: cannot pin another %d-byte host buffer (%s); using %d", self.buffer_bytes, exc, self.limit
            )
        return got + fresh

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """Return buffers from :meth:`take`; the caller guarantees no copy into or out of them is pending."""
        with self._lock:
            for buffer in buffers:
                if buffer.numel() != self.buffer_bytes or any(buffer is b for b in self._free):
                    raise ValueError("a buffer given back to the pinned pool did not come from it")
                self._free.append(buffer)
            self._in_use -= len(buffers)

    @contextmanager
    def lease(self, wanted: int) -> Iterator[list[torch.Tensor]]:
        """``wanted`` buffers or fewer (never none: an unpinned temporary when every buffer is taken), returned on
        exit."""
        buffers = self.take(wanted)
        with self._lock:
            self._leases += 1
            if not buffers:
                self._overflows += 1
        try:
            yield buffers if buffers else [torch.empty(self.buffer_bytes, dtype=torch.uint8)]
        finally:
            if buffers:
                self.give_back(buffers)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                self.buffer_bytes, self.limit, self._allocated, self._in_use, self._leases, self._overflows
            )


def split_range(lo: int, hi: int, piece: int, align: int = 1) -> list[tuple[int, int]]:
    """[lo, hi) cut into consecutive ranges of at most ``piece`` units.

    Inner boundaries fall on multiples of ``align`` (counted from 0, not from ``lo``) when a piece
    can hold at least one ``align``: reads cut at hash-block boundaries verify each block from one
    piece, with no block read twice. ``piece`` must be positive.
    """
    if piece < 1:
        raise ValueError(f"piece size must be positive, not {piece}")
    step = piece // align * align if align > 1 and piece >= align else piece
    out = []
    start = lo
    while start < hi:
        stop = min(hi, (start // step + 1) * step)
        out.append((start, stop))
        start = stop
    return out


_pool: PinnedPool | None = None
_pool_lock = threading.Lock()
_settings = (DEFAULT_BUFFER_BYTES, DEFAULT_BUFFERS)


def pinned_pool() -> PinnedPool:
    """The process's pool of pinned buffers (created on first call; its buffers on first lease)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = PinnedPool(*_settings)
        return _pool


def configure(buffer_bytes: int = DEFAULT_BUFFER_BYTES, buffers: int = DEFAULT_BUFFERS) -> None:
    """Set the size and number of pinned buffers of this process (at most ``buffer_bytes * buffers`` pinned).

    Larger pieces mean fewer, longer copies; two buffers are what double buffering needs. Refused
    while a buffer of the current pool is in use; the old pool's buffers are released.
    """
    global _pool, _settings
    PinnedPool(buffer_bytes, buffers, pin=False)  # validates without allocating
    with _pool_lock:
        if _pool is not None and _pool.stats().in_use:
            raise RuntimeError("the pinned buffer pool cannot be reconfigured while a save or load is using it")
        _settings = (buffer_bytes, buffers)
        _pool = None
