"""Host staging buffers for async saves: the only part of an async save the training loop waits for.

An async save copies every local chunk of the state into a host buffer (pinned when the source is
on a GPU, so the copy is a DMA), then writes from the buffers in the background while training
changes the originals. The buffers are kept from one save to the next (the same chunks have the
same shapes every time), so a save allocates nothing after the first. Copies from a GPU run on
shardsafe's side stream (:func:`~shardsafe.storage.device_copy.side_stream`), ordered after the
caller's stream at the save call, and are waited for by event, never by a device-wide synchronize.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsafe.state.registry import SaveView
from shardsafe.storage.device_copy import side_stream

__all__ = ["SaveWorker", "Staged", "StagingBuffers", "copy_all"]

Copy = tuple[torch.Tensor, torch.Tensor]  # (staging buffer, source)


@dataclass(frozen=True)
class Staged:
    """The view one async save writes (its chunks point at staging buffers), the copies that fill
    those buffers, and where their CUDA sources are ready.

    ``ready`` holds, per CUDA device, an event recorded on the caller's current stream when the
    save was called: the side stream waits for it before copying, so the copies see every value
    queued before the call, even when they are issued later from the background thread (overlap
    mode), whose current stream is not the caller's.
    """

    view: SaveView
    copies: list[Copy]
    ready: dict[torch.device, Any] = field(default_factory=dict)


class StagingBuffers:
    """Host buffers the state is copied into for an async save, reused from one save to the next."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def prepare(self, view: SaveView) -> Staged:
        """The view with its chunks pointed at staging buffers, and the (buffer, source) copies to make.

        Called in the caller's thread at the save call: that is where CUDA sources' readiness is recorded.
        """
        copies = []
        chunks = []
        used = set()
        for chunk in view.chunks:
            ident = (chunk.key, chunk.offsets)
            source = chunk.tensor.detach()
            buffer = self.buffers.get(ident)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
                self.buffers[ident] = buffer
            used.add(ident)
            copies.append((buffer, source))
            chunks.append(dataclasses.replace(chunk, tensor=buffer))  # the same chunk (per-rank flag included), staged
        for ident in set(self.buffers) - used:
            del self.buffers[ident]
        return Staged(dataclasses.replace(view, chunks=chunks), copies, _record_ready(copies))


def _record_ready(copies: list[Copy]) -> dict[torch.device, Any]:
    """An event on the current stream of every CUDA device a source lives on (none for CPU-only state)."""
    ready = {}
    for _, source in copies:
        if source.is_cuda and source.device not in ready:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(source.device))
            ready[source.device] = event
    return ready


def copy_all(staged: Staged) -> None:
    """Make the copies; returns once every buffer holds its source's bytes.

    CPU sources are copied in this thread. CUDA sources are copied non-blocking into their pinned
    buffers on the side stream of their device, after it waits for the save call's ``ready``
    event; then only those copies are waited for (an event per device), not the whole device, so
    the training stream keeps running.
    """
    done = []
    with torch.no_grad():
        for buffer, source in staged.copies:
            if not source.is_cuda:
                buffer.copy_(source)
        for device in {source.device for _, source in staged.copies if source.is_cuda}:
            stream = side_stream(device)
            stream.wait_event(staged.ready[device])
            with torch.cuda.stream(stream):
                for buffer, source in staged.copies:
                    if source.device == device:
                        buffer.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            done.append(event)
    for event in done:
        event.synchronize()


class SaveWorker:
    """The one long-lived thread that writes async saves, one after another.

    Starting a thread per save costs the caller a few milliseconds (the start handshake competes
    for the GIL with the training loop); a save through a thread that already waits is one queue
    put. Jobs run in submission order; :meth:`join` returns once the last one submitted has
    finished (a job reports its own errors: the manager's ``_background`` keeps them).
    """

    def __init__(self, name: str = "shardsafe-save") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0  # jobs submitted and not finished
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """Whether a job submitted is still running (or waiting to)."""
        return not self._idle.is_set()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker thread (started on first use), after the jobs submitted before it."""
        with self._lock:
            self._pending += 1
            self._idle.clear()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def join(self) -> None:
        """Wait until every job submitted has finished."""
        self._idle.wait()

    def close(self) -> None:
        """Finish the job in flight and stop the thread (a later :meth:`submit` starts a new one)."""
        self.join()
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            thread.join()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # the manager's jobs keep their own errors; anything else must not end the thread
                logging.getLogger("shardsafe").exception("shardsafe: a background save job failed")
            finally:
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.set()
