"""Copies between a CUDA device and host memory: through the pinned pool, on a side stream, double-buffered.

Saving a CUDA tensor streams it out piece by piece (:func:`device_pieces`): the copy of piece
i+1 into one pinned buffer runs on a dedicated side stream while piece i, in the other, is
hashed and written. Loading into a CUDA tensor is the mirror (:class:`HostToDevice`): piece i+1
is read from the file and verified on the host while piece i is copied up.

Ordering is by streams and events, never a device-wide ``torch.cuda.synchronize()``:

- before its first copy the side stream waits for the caller's current stream
  (``wait_stream``), so a device-to-host copy sees every value the caller's queued kernels
  produce, and a host-to-device copy cannot overwrite memory a queued kernel still reads;
- a pinned buffer is read on the host (or refilled) only after the event recorded behind its
  copy has completed, and goes back to the pool only when no copy of it is pending;
- after a load the caller's current stream waits for the side stream, so kernels it queues next
  see the loaded values.

Only CUDA tensors come here; CPU tensors never touch the pool, the streams or this module's state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from shardsafe.storage.pinned import PinnedPool, pinned_pool, split_range

__all__ = ["HostToDevice", "device_pieces", "host_view", "side_stream"]

DOUBLE = 2  # buffers per transfer: one being copied while the other is used on the host

_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream shardsafe copies on for ``device`` (one per device per process, created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
        return stream


def _side(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream for a CUDA device, ordered after the caller's current stream; None for a CPU "device"
    (the unit tests' stand-in, where every copy is synchronous and program order is the only order)."""
    if device.type != "cuda":
        return None
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _on(stream: torch.cuda.Stream | None) -> AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _mark(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event behind the work queued so far on ``stream`` (None without a stream: already done)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait(event: Any) -> None:
    if event is not None:
        event.synchronize()


def host_view(buffer: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 host buffer, zero-copy."""
    if buffer.numel() == 0:
        return memoryview(b"")
    array: Any = buffer.numpy()
    return memoryview(array).cast("B")


def device_pieces(tensor: torch.Tensor, pool: PinnedPool | None = None) -> Iterator[memoryview]:
    """A CUDA tensor's bytes in order, copied through pinned buffers on the side stream, double-buffered.

    Each yielded view stays valid until the next one is asked for (the buffer is then refilled).
    The values are those the caller's current stream holds when this starts.
    """
    pool = pool or pinned_pool()
    # a non-contiguous tensor is made contiguous on the caller's stream, before the wait
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return
    source = flat.view(torch.uint8)
    stream = _side(flat.device)
    ranges = split_range(0, source.numel(), pool.buffer_bytes)
    with pool.lease(DOUBLE) as buffers:
        pending: list[Any] = [None] * len(buffers)

        def start(i: int) -> None:
            lo, hi = ranges[i]
            slot = i % len(buffers)
            with _on(stream):
                buffers[slot][: hi - lo].copy_(source[lo:hi], non_blocking=stream is not None)
                pending[slot] = _mark(stream)

        try:
            for i in range(min(len(buffers), len(ranges))):
                start(i)
            for i, (lo, hi) in enumerate(ranges):
                slot = i % len(buffers)
                _wait(pending[slot])
                pending[slot] = None
                yield host_view(buffers[slot][: hi - lo])
                if i + len(buffers) < len(ranges):
                    start(i + len(buffers))  # the consumer is done with this buffer: refill it
        finally:
            for event in pending:  # abandoned early: no copy may still land in a buffer the pool lends again
                _wait(event)


class HostToDevice:
    """One load's uploads to ``device``: fill :meth:`host` buffers on the host, then :meth:`upload` them.

    Double-buffered: :meth:`host` hands out the pinned buffers in turn, waiting (on its event) only
    for the upload that last used the one it returns. A context manager: on exit every upload has
    completed (the buffers go back to the pool) and the caller's current stream is ordered after them.
    """

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        self.device = device
        self.pool = pool or pinned_pool()
        self.piece_bytes = self.pool.buffer_bytes
        self.stream: Any = None
        self._lease: Any = None
        self._buffers: list[torch.Tensor] = []
        self._pending: list[Any] = []
        self._next = 0
        self._slot: int | None = None

    def __enter__(self) -> HostToDevice:
        # ordered after the caller's stream: queued kernels may still read the destination
        self.stream = _side(self.device)
        self._lease = self.pool.lease(DOUBLE)
        self._buffers = self._lease.__enter__()
        self._pending = [None] * len(self._buffers)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for event in self._pending:
                _wait(event)
            self._pending = [None] * len(self._buffers)
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
        finally:
            self._lease.__exit__(None, None, None)

    def host(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of ``nbytes`` to fill: the next pinned buffer (once its last upload is done),
        or, for more than a buffer holds, a temporary pageable one."""
        if nbytes > self.piece_bytes:
            self._slot = None
            return torch.empty(nbytes, dtype=torch.uint8)
        slot = self._slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        _wait(self._pending[slot])
        self._pending[slot] = None
        return self._buffers[slot][:nbytes]

    def upload(
        self, host: torch.Tensor, dest: torch.Tensor | None = None, place: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        """Copy the buffer last returned by :meth:`host` (viewed as ``host``) to the device, on the side stream:
        into ``dest`` (same shape and dtype), or to a device temporary that ``place`` puts where it belongs."""
        asynchronous = self.stream is not None
        with _on(self.stream), torch.no_grad():
            if dest is not None:
                dest.copy_(host, non_blocking=asynchronous)
            else:
                assert place is not None
                # the temporary is the side stream's: stream-ordered reuse
                place(host.to(self.device, non_blocking=asynchronous))
            event = _mark(self.stream)
        if self._slot is None:
            _wait(event)  # a temporary host buffer: done before it is freed
        else:
            self._pending[self._slot] = event
