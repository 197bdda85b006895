"""The async-save peers of ``bench_manager.py``: DCP ``async_save`` in its modes and torch-checkpointing's async save.

Each peer is created once (its stager's buffers, DCP's checkpoint daemon process and
torch-checkpointing's writer subprocess are reused from one save to the next, as a training job
reuses them) and saves through :meth:`AsyncPeers.save`, which returns the two signals every async
saver gives: when the state is free again (the snapshot is taken: the loop may change the
tensors) and when the checkpoint is durable.

* DCP: ``torch.distributed.checkpoint.async_save`` with ``AsyncCheckpointerType.THREAD`` or
  ``PROCESS`` and a reused ``DefaultStager``. With ``use_async_staging=True`` the call returns an
  ``AsyncSaveResponse`` (``staging_completion``, ``upload_completion``); otherwise staging happens
  in the call and one future (the upload) comes back. ``PROCESS`` mode hands the staged state to
  one checkpoint daemon process per rank (spawned by the first such save, with a gloo group of its
  own) through a pipe; with ``use_shared_memory=True`` the staged tensors are shared memory, so
  only handles cross. ``use_pinned_memory`` needs CUDA: on this CPU-only machine the stager would
  warn and ignore it, so it is off here; ``use_non_blocking_copy`` refuses to run without an
  accelerator, so it is off too. This is torchtitan's ``async_with_pinned_mem`` minus the two
  CUDA-only options. DCP's ``FileSystemWriter`` fsyncs every file it writes (``sync_files=True``).
* torch-checkpointing 0.1.1: ``CheckpointManager`` with its default ``AsyncCheckpointSaverConfig``
  (a ``DefaultStager`` into shared memory, staging in a thread, then a writer subprocess; pinned
  memory and non-blocking copies default to off without CUDA). ``save`` returns the write future;
  the staging signal is its documented ``manager.lock()`` (held while the snapshot is taken). It
  fsyncs nothing, so for a durable time it is given :func:`fsync_written` as its
  ``pre_finalize_callback`` (every file and folder it wrote, before its barrier and commit rename)
  and :func:`fsync_parent` as its ``finalize_callback`` (the rename), run in its writer subprocess;
  its files are written with buffered I/O (``use_direct_io=False``): with its default O_DIRECT, the
  unaligned writes of its default layout (``torch.save``) fail on this machine's ext4 with EINVAL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

__all__ = ["DCP_MODES", "TC_NAME", "AsyncPeers", "fsync_parent", "fsync_written"]

# name -> (executor, StagingOptions: pinned, shared, async staging, non-blocking copy); None: DCP's own staging
DCP_MODES: dict[str, tuple[str, tuple[bool, bool, bool, bool] | None]] = {
    "dcp async_save": ("thread", None),
    "dcp async_save + DefaultStager": ("thread", (False, False, False, False)),
    "dcp async_save + DefaultStager(async staging)": ("thread", (False, False, True, False)),
    "dcp async_save(PROCESS) + DefaultStager(shm, async staging)": ("process", (False, True, True, False)),
    "dcp async_save(PROCESS) + DefaultStager(shm)": ("process", (False, True, False, False)),
}
TC_NAME = "torch-checkpointing async save"


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_written(args: Any) -> None:
    """torch-checkpointing ``pre_finalize_callback``: fsync every file and folder under the folder written."""
    root = Path(args.path)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            _fsync(path)
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        _fsync(path, directory=True)
    _fsync(root, directory=True)


def fsync_parent(args: Any) -> None:
    """torch-checkpointing ``finalize_callback``: fsync the folder holding the checkpoint (its commit rename)."""
    _fsync(Path(args.path).parent, directory=True)


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class AsyncPeers:
    """The peers' savers, built once per rank; :meth:`save` starts one save and returns its signals."""

    def __init__(self, dcp_group: Any) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.dcp_group = dcp_group  # DCP's background collectives never share the training group
        self.stagers = {
            name: DefaultStager(StagingOptions(*options)) if options is not None else None
            for name, (_, options) in DCP_MODES.items()
        }
        self.tc = CheckpointManager.Config(
            # its writer subprocess gets 30 s to start by default: not always enough on this shared machine
            save=AsyncCheckpointSaverConfig(process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600)),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),  # O_DIRECT: EINVAL here (above)
            pre_finalize_callback=fsync_written,
            finalize_callback=fsync_parent,
        ).build()

    def names(self) -> list[str]:
        return [*DCP_MODES, TC_NAME]

    def save(self, name: str, state: dict[str, Any], path: Path) -> tuple[float, Callable[[], None], Future[Any]]:
        """Start a save of ``state`` (``model``, ``optim``) to ``path`` by peer ``name``.

        Returns the seconds the call took, a function that returns once the state is free again
        (the snapshot taken: what a loop calls before changing it) and a future done when the
        checkpoint is durable.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        start = time.perf_counter()
        msd, osd = get_state_dict(state["model"], state["optim"])  # both libraries' recipe for FSDP2 state
        payload = {"model": msd, "optim": osd}
        if name == TC_NAME:
            upload = self.tc.save(str(path), payload)
            call = time.perf_counter() - start
            assert upload is not None  # an async saver returns its write future
            return call, self._tc_staged, upload
        staging, upload = self._dcp(name, payload, path)
        return time.perf_counter() - start, staging.result, upload

    def _dcp(self, name: str, payload: dict[str, Any], path: Path) -> tuple[Future[Any], Future[Any]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

        executor, _ = DCP_MODES[name]
        kind = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
        result = dcp.async_save(
            payload,
            checkpoint_id=path,
            process_group=self.dcp_group,
            async_checkpointer_type=kind,
            async_stager=self.stagers[name],
        )
        if isinstance(result, AsyncSaveResponse):  # staging in a thread: one future for it, one for the upload
            return result.staging_completion, result.upload_completion
        return _done(), result  # staged in the call

    def _tc_staged(self) -> None:
        """Returns once torch-checkpointing's snapshot is taken: the save holds its ``lock()`` until then."""
        with self.tc.lock():
            pass

    def close(self) -> None:
        self.tc.close()
        for stager in self.stagers.values():
            if stager is not None:
                stager.close()
