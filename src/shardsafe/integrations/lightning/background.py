"""Async saves for the Lightning strategies (``async_save=True``): the CheckpointManager's guarantees, at the
paths Lightning chooses.

Lightning offers ``AsyncCheckpointIO`` only to strategies that go through a ``CheckpointIO`` plugin, which
its sharded strategies bypass; and the CheckpointManager names its folders ``step-N`` itself, while
``ModelCheckpoint`` picks each path. So the strategy keeps one of these, built from the manager's own
parts (:mod:`shardsafe.manager.staging`: the reused host staging buffers, the copy, the one writer thread;
:func:`~shardsafe.core.comm.gloo_copy`: a gloo group of the background's own) and the API's
``write_checkpoint``. What it adds is only the order the manager keeps:

- the caller waits for the describe and the copy of its local state into host buffers, nothing else:
  training then changes the live tensors while the checkpoint is written from the copy;
- at most one save in flight: a save waits for the previous one first;
- a background failure is raised by the next save, load or ``wait`` (the strategy's teardown), never lost;
- work queued behind a save (ModelCheckpoint's removals) runs only once that save has committed, and not
  at all when it failed (the checkpoint it would replace stays).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardsafe.api.checkpoint import describe_collectively, write_checkpoint
from shardsafe.core.comm import Comm, gloo_copy
from shardsafe.errors import SaveError, ShardsafeError
from shardsafe.manager.staging import SaveWorker, StagingBuffers, copy_all
from shardsafe.storage.remote import RemoteDir

__all__ = ["BackgroundSaves", "background_saves"]

log = logging.getLogger(__name__)


class BackgroundSaves:
    """One strategy's async saves: a save copies the state and returns; one thread writes and commits."""

    def __init__(self) -> None:
        self._worker = SaveWorker("shardsafe-lightning-save")
        self._staging = StagingBuffers()
        self._comm: Comm | None = None  # the background's gloo group, made at the first save (collective)
        self._error: BaseException | None = None
        self._at_exit = False

    @property
    def in_flight(self) -> bool:
        """Whether a save (or the removals queued behind it) is still running."""
        return self._worker.busy

    def save(
        self,
        target: Path | RemoteDir,
        state: dict[str, Any],
        comm: Comm,
        *,
        overwrite: bool,
        metadata: dict[str, Any],
        committed: Callable[[], None],
    ) -> None:
        """Collective: describe ``state`` (checked as a sync save checks it), copy it, and hand the write of
        ``target`` to the thread; ``committed`` runs there once the checkpoint is published. The caller has
        called :meth:`settle` (so the previous save is committed before it decides where to save)."""
        if self.in_flight:
            raise RuntimeError("BackgroundSaves.save: call settle() first (at most one save in flight)")
        view = describe_collectively(state, comm, default=SaveError)
        background = self._background_comm(comm)
        staged = self._staging.prepare(view)
        copy_all(staged)

        def write() -> None:
            try:
                write_checkpoint(target, staged.view, background, overwrite=overwrite, metadata=metadata)
                committed()
            except BaseException as exc:  # raised by the next save / load / wait
                self._error = exc

        self._worker.submit(write)
        if not self._at_exit:
            atexit.register(self._finish_at_exit)
            self._at_exit = True

    def after_commit(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the thread once the save in flight (if any) has committed; skipped if it failed.
        Its own failure is raised as the save's would be."""

        def run() -> None:
            if self._error is None:
                try:
                    job()
                except BaseException as exc:
                    self._error = exc

        self._worker.submit(run)

    def settle(self, comm: Comm) -> None:
        """Collective :meth:`wait`: if the previous save (or a job behind it) failed on any rank, every rank
        raises, rather than the others going on into a collective that rank has left."""
        problem: BaseException | None = None
        try:
            self.wait()
        except SaveError as exc:
            problem = exc
        comm.agree(problem, default=SaveError)

    def wait(self) -> None:
        """Block until the save in flight and what is queued behind it are done; raise the save's error."""
        self._worker.join()
        if self._error is not None:
            exc, self._error = self._error, None
            if isinstance(exc, ShardsafeError):
                raise SaveError(f"background save failed: {exc}") from exc
            raise SaveError(f"background save failed: {type(exc).__name__}: {exc}") from exc

    def _background_comm(self, comm: Comm) -> Comm:
        if self._comm is None:
            self._comm = gloo_copy(comm)
        return self._comm

    def _finish_at_exit(self) -> None:
        """A save still in flight at interpreter exit (``trainer.save_checkpoint`` after ``fit``) is finished,
        not killed with the daemon thread."""
        if not self._worker.busy:
            return
        log.warning("shardsafe: finishing the Lightning checkpoint save in flight at exit")
        try:
            self.wait()
        except SaveError as exc:
            log.error("shardsafe: %s", exc)


def background_saves(async_save: bool) -> BackgroundSaves | None:
    """A strategy's ``async_save`` argument: its background saver, or None (saves write in the call)."""
    if not isinstance(async_save, bool):
        raise ValueError(f"async_save must be True or False, not {async_save!r}")
    return BackgroundSaves() if async_save else None
