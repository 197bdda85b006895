"""How a checkpoint becomes visible: the two-phase commit protocol.

1. The coordinator alone checks the destination and creates a hidden temporary folder
   ``.<name>.shardsafe-tmp-<uuid>`` next to it (protocol/temppath.py), then tells every rank its name.
2. Every rank writes only its own file into it and fsyncs it (shard_write.py).
3. Every rank reports its :class:`~shardsafe.core.comm.Outcome` (success or its error) to the
   coordinator (the agreement step).
4. Only if all succeeded, the coordinator writes ``state.json`` then ``manifest.json`` (the
   commit marker), fsyncs the folder, moves it into place and fsyncs the parent. Overwriting
   swaps the folders atomically (renameat2 RENAME_EXCHANGE) before removing the old one.
5. The coordinator tells every rank the outcome; all ranks return or raise the same error.

On object stores (no rename) step 1 picks a save id that every object name carries, and the
single PUT of ``manifest.json`` is step 4's commit. Both are one interface, :class:`CommitTarget`,
whose docstring numbers who calls what.

No path is created by more than one rank, so concurrent ranks or nodes sharing a filesystem
cannot collide, and a crash at any point leaves either the old checkpoint or the new one visible,
never a mix: a folder without a manifest is never loaded (and hidden temporaries are garbage for
``shardsafe gc``).
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from shardsafe import errors
from shardsafe.core.comm import Comm, Outcome
from shardsafe.core.faults import crash_point
from shardsafe.core.format import (
    INDEX_PATTERN,
    INDEX_SUFFIX,
    MANIFEST_NAME,
    MAX_JSON_BYTES,
    SHARD_PATTERN,
    STATE_NAME,
    FileEntry,
    Manifest,
    TensorEntry,
    parse_json,
    parse_manifest,
)
from shardsafe.core.integrity import hash_bytes
from shardsafe.errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, SaveError
from shardsafe.protocol.shard_write import plain_file_name
from shardsafe.protocol.temppath import TemporaryPath
from shardsafe.storage.local import read_small_file, safe_child, write_small_file
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir
from shardsafe.storage.safetensors import write_tensor_file

__all__ = [
    "CommitTarget",
    "LocalCommit",
    "agree_and_publish",
    "is_committed",
    "new_manifest",
    "open_checkpoint",
    "prepare",
    "prepare_save",
]

log = logging.getLogger("shardsafe")


def is_committed(folder: Path) -> bool:
    return (folder / MANIFEST_NAME).is_file()


class CommitTarget(ABC):
    """How one save's files become one visible checkpoint: the interface of a commit protocol.

    Two implementations: :class:`LocalCommit` (a hidden folder renamed into place) and
    :class:`RemoteCommit` (object stores, no rename: the manifest PUT is the commit). The calls, in
    this order (DCP's ``StorageWriter`` and Orbax's ``TemporaryPath`` number theirs the same way):

    1. :func:`prepare_save` (every rank, collective): the coordinator alone checks the destination
       and sets the save up (the hidden folder, or the save's id); every rank gets its target.
    2. :meth:`shard_name`, :meth:`write_shard`, :meth:`write_index` (every rank, for its own file
       only; no two ranks write one name). May raise: the rank reports it at step 3.
    3. :func:`agree_and_publish` (every rank, collective): each rank's
       :class:`~shardsafe.core.comm.Outcome` is gathered on the coordinator, which goes on to 4-5
       only if every rank succeeded.
    4. :meth:`state_name` (coordinator): the name the manifest gives ``state.json``.
    5. :meth:`commit` (coordinator, once): the small files, then the atomic step that makes the
       checkpoint visible. May raise; then step 6.
    6. :meth:`abort` (coordinator, after a failure anywhere in 2-5): remove what the save wrote,
       unless it may already be visible. Never raises.

    A crash at any step leaves the previous checkpoint (or none) visible, or the new one complete.
    """

    @abstractmethod
    def shard_name(self, rank: int) -> str:
        """Every rank: the name of ``rank``'s shard file. Never raises."""

    def plain_name(self, rank: int) -> str:
        """Every rank: the name of ``rank``'s file of plainly named whole tensors (``save(plain_names=...)``),
        written with :meth:`write_shard` like a shard; by default its shard's name with ``model-`` for ``shard-``.
        A target may name it as a model loader expects (the Trainer's one-process checkpoints: ``model.safetensors``).
        Never raises."""
        return plain_file_name(self.shard_name(rank))

    @abstractmethod
    def write_shard(
        self, name: str, prefix: bytes, tensors: Iterable[torch.Tensor], block_size: int, rank: int
    ) -> tuple[int, list[list[str]]]:
        """Every rank, once, for its own file: stream ``prefix`` (the safetensors header) and the
        tensors' bytes, hashing each ``block_size`` block; returns (size, per-tensor block digests).
        May raise (``OSError``, ...): the file is then garbage of this save, removed at step 6."""

    @abstractmethod
    def write_index(self, rank: int, data: bytes) -> str:
        """Every rank with split parts (format version 2+): write its index next to its shard;
        returns the index's name. May raise, as :meth:`write_shard`."""

    @abstractmethod
    def state_name(self) -> str:
        """Coordinator: the name of this save's state file (the manifest records it). Never raises."""

    @abstractmethod
    def commit(self, state_bytes: bytes, manifest: Manifest, rank: int) -> None:
        """Coordinator, once, after every rank wrote its files: write the state file and the
        manifest, then make the checkpoint visible atomically (replacing what was there). May raise;
        the caller then runs :meth:`abort`."""

    @abstractmethod
    def abort(self) -> None:
        """Coordinator, after any failure: remove this save's files unless the checkpoint is (or may
        be) visible. Never raises (what it cannot remove is invisible garbage for ``gc``)."""


class LocalCommit(CommitTarget):
    """Rename protocol: shards go into a hidden temporary folder that is moved into place."""

    def __init__(self, temp: TemporaryPath) -> None:
        self.temp = temp

    @property
    def tmp(self) -> Path:
        return self.temp.path

    @property
    def fsync(self) -> bool:
        return self.temp.fsync

    def shard_name(self, rank: int) -> str:
        return SHARD_PATTERN.format(rank=rank)

    def write_shard(
        self, name: str, prefix: bytes, tensors: Iterable[torch.Tensor], block_size: int, rank: int
    ) -> tuple[int, list[list[str]]]:
        return write_tensor_file(self.tmp / name, prefix, tensors, block_size, self.fsync, rank)

    def write_index(self, rank: int, data: bytes) -> str:
        name = INDEX_PATTERN.format(rank=rank)
        write_small_file(self.tmp / name, data, self.fsync)
        return name

    def state_name(self) -> str:
        return STATE_NAME

    def commit(self, state_bytes: bytes, manifest: Manifest, rank: int) -> None:
        write_small_file(self.tmp / manifest.state_file, state_bytes, self.fsync)
        crash_point("save:before-manifest", rank)
        write_small_file(self.tmp / MANIFEST_NAME, manifest.to_bytes(), self.fsync)
        self.temp.publish(before_rename=lambda: crash_point("save:before-publish", rank))

    def abort(self) -> None:
        self.temp.remove()


class RemoteCommit(CommitTarget):
    """Commit-file protocol for object stores (no rename): every object of a save carries the
    save's id in its name, and the single PUT of ``manifest.json`` is the commit. Overwriting
    replaces the manifest (atomic on S3), then deletes the previous save's objects."""

    def __init__(self, folder: RemoteDir, save_id: str) -> None:
        self.folder, self.save_id = folder, save_id
        self.manifest_sent = False  # the manifest PUT was attempted: it may be visible even if it "failed"
        self.committed = False

    def shard_name(self, rank: int) -> str:
        return f"shard-{rank:05d}-{self.save_id}.safetensors"

    def write_shard(
        self, name: str, prefix: bytes, tensors: Iterable[torch.Tensor], block_size: int, rank: int
    ) -> tuple[int, list[list[str]]]:
        return self.folder.write_tensors(name, prefix, tensors, block_size)

    def write_index(self, rank: int, data: bytes) -> str:
        name = f"shard-{rank:05d}-{self.save_id}{INDEX_SUFFIX}"
        self.folder.write_bytes(name, data)
        return name

    def state_name(self) -> str:
        return f"state-{self.save_id}.json"

    def commit(self, state_bytes: bytes, manifest: Manifest, rank: int) -> None:
        previous: set[str] = set()
        if self.folder.exists(MANIFEST_NAME):
            old = parse_manifest(
                self.folder.read_bytes(MANIFEST_NAME, MAX_JSON_BYTES), f"{self.folder.url}/{MANIFEST_NAME}"
            )
            previous = old.stored_names()
        self.folder.write_bytes(manifest.state_file, state_bytes)
        crash_point("save:before-manifest", rank)
        data = manifest.to_bytes()
        self.manifest_sent = True
        try:
            self.folder.write_bytes(MANIFEST_NAME, data)
        except Exception:
            # The PUT may have been stored even though its answer was lost: then the save is committed.
            if self._manifest_is(data) is not True:
                raise
        self.committed = True
        crash_point("save:after-publish", rank)
        try:
            self.folder.remove(sorted(previous - manifest.stored_names()))
        except Exception as exc:  # committed already; what is left over is garbage for collect_garbage
            log.warning(
                "shardsafe: %s: committed, but removing the previous save's objects failed: %s", self.folder.url, exc
            )

    def _manifest_is(self, data: bytes) -> bool | None:
        """Whether the visible manifest is ``data`` (None: cannot tell)."""
        try:
            return self.folder.read_bytes(MANIFEST_NAME, MAX_JSON_BYTES) == data
        except FileNotFoundError:
            return False
        except Exception:
            return None

    def abort(self) -> None:
        if self.committed:
            return
        try:
            if self.manifest_sent and self._manifest_is_ours() is not False:
                log.warning(
                    "shardsafe: %s: the manifest of the failed save may be visible; keeping its objects",
                    self.folder.url,
                )
                return
            self.folder.remove([name for name in self.folder.list() if self.save_id in name])
        except Exception as exc:  # leftovers are invisible (no manifest names them) and collected by gc
            log.warning("shardsafe: %s: could not remove the objects of the failed save: %s", self.folder.url, exc)

    def _manifest_is_ours(self) -> bool | None:
        try:
            data = self.folder.read_bytes(MANIFEST_NAME, MAX_JSON_BYTES)
        except FileNotFoundError:
            return False
        except Exception:
            return None
        try:
            return parse_manifest(data, f"{self.folder.url}/{MANIFEST_NAME}").state_file == self.state_name()
        except FormatError:
            return None


def prepare(comm: Comm, final: Path, overwrite: bool, fsync: bool = True) -> TemporaryPath:
    """Coordinator: check a local destination and create the temporary folder; every rank: a handle
    on it (only the coordinator's publishes or removes it). For folders that are not checkpoints
    but are published the same way (model folders, DCP exports)."""
    token = comm.on_coordinator(lambda: str(_make_tmp(final, overwrite).path), default=SaveError)
    return TemporaryPath.attach(Path(token), final, owner=comm.is_coordinator, fsync=fsync)


def prepare_save(comm: Comm, final: Path | RemoteDir, overwrite: bool, fsync: bool = True) -> CommitTarget:
    """Step 1 of :class:`CommitTarget`. Coordinator: check the destination and set up the save;
    every rank: learn where to write."""
    where = as_location(final)

    def setup() -> str:
        return where.choose(
            local=lambda path: str(_make_tmp(path, overwrite).path),
            remote=lambda folder: _check_remote(folder, overwrite),
        )

    token = comm.on_coordinator(setup, default=SaveError)
    return where.choose(
        local=lambda path: LocalCommit(TemporaryPath.attach(Path(token), path, owner=comm.is_coordinator, fsync=fsync)),
        remote=lambda folder: RemoteCommit(folder, token),
    )


def _check_remote(final: RemoteDir, overwrite: bool) -> str:
    if final.exists(MANIFEST_NAME) and not overwrite:
        raise CheckpointExistsError(f"{final.url}: a checkpoint already exists here; pass overwrite=True to replace it")
    return uuid.uuid4().hex[:12]


def _make_tmp(final: Path, overwrite: bool) -> TemporaryPath:
    if is_committed(final) and not overwrite:
        raise CheckpointExistsError(f"{final}: a checkpoint already exists here; pass overwrite=True to replace it")
    if final.exists() and not final.is_dir():
        raise SaveError(f"{final}: exists and is not a folder")
    if final.is_dir() and not is_committed(final) and any(final.iterdir()) and not overwrite:
        raise CheckpointExistsError(
            f"{final}: folder exists, is not empty and holds no checkpoint; pass overwrite=True to replace it"
        )
    return TemporaryPath.create(final)  # a new root's name is durable before anything is published into it


def agree_and_publish(
    comm: Comm,
    target: CommitTarget,
    rank_result: Outcome[Any],
    build: Callable[[list[Any]], tuple[Manifest, bytes]],
    before_publish: Callable[[], None] | None = None,
) -> Manifest | None:
    """Steps 3-6 of :class:`CommitTarget` (every rank, collective): agreement, then the commit.

    ``rank_result`` is this rank's :class:`~shardsafe.core.comm.Outcome` (its value, or its error
    from :meth:`Outcome.failure <shardsafe.core.comm.Outcome.failure>`). If any rank failed, the
    coordinator aborts and every rank raises one :class:`SaveError` naming each failure. Else
    ``build(values)`` runs on the coordinator and returns (manifest, state bytes), the manifest
    naming ``target.state_name()`` as its state file (:func:`new_manifest`), and
    ``before_publish()`` runs there right before the checkpoint becomes visible (fencing)."""
    results: list[Outcome[Any]] | None = comm.gather(rank_result)

    def commit() -> Manifest:
        assert results is not None
        failures = [_failure_line(r) for r in results if not r.ok]
        if failures:
            raise SaveError("save failed, nothing was published:\n  " + "\n  ".join(failures))
        manifest, state_bytes = build([r.value for r in results])
        assert manifest.state_file == target.state_name(), "build names the target's state file"
        if before_publish is not None:
            before_publish()
        target.commit(state_bytes, manifest, comm.rank)
        return manifest

    manifest = comm.on_coordinator(commit, default=SaveError, on_error=target.abort)
    return manifest if comm.is_coordinator else None


def _failure_line(outcome: Outcome[Any]) -> str:
    """``rank N: ErrorClass: message`` for a failed rank (a non-shardsafe error's message already starts so)."""
    prefix = f"rank {outcome.rank}: "
    return outcome.message if outcome.message.startswith(prefix) else f"{prefix}{outcome.error}: {outcome.message}"


def new_manifest(
    world_size: int,
    files: dict[str, FileEntry],
    state_bytes: bytes,
    metadata: dict[str, Any] | None,
    version: str,
    *,
    tensors: dict[str, TensorEntry],
    state_file: str,
) -> Manifest:
    """The manifest of a save about to commit (``state_file``: the target's :meth:`CommitTarget.state_name`)."""
    return Manifest(
        world_size=world_size,
        tensors=tensors,
        files=files,
        state_file=state_file,
        state_size=len(state_bytes),
        state_hash=hash_bytes(state_bytes),
        metadata=dict(metadata or {}),
        created=time.time(),
        writer_version=version,
    )


def open_checkpoint(folder: Path | RemoteDir) -> tuple[Manifest, dict[str, Any]]:
    """Read and validate a committed checkpoint's manifest and state tree."""
    return as_location(folder).choose(local=_open_local, remote=_open_remote)


def _open_local(folder: Path) -> tuple[Manifest, dict[str, Any]]:
    manifest_path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such checkpoint folder")
    if not manifest_path.is_file():
        raise CheckpointNotFoundError(
            f"{folder}: no {MANIFEST_NAME}; this is not a committed checkpoint (an interrupted save leaves none)"
        )
    gone = f"{folder}: removed while it was being opened (retired or replaced by another run?)"
    try:
        manifest = parse_manifest(
            read_small_file(safe_child(folder, MANIFEST_NAME), MAX_JSON_BYTES), str(manifest_path)
        )
    except FileNotFoundError:
        raise CheckpointNotFoundError(gone) from None
    state_path = safe_child(folder, manifest.state_file)
    try:
        data = read_small_file(state_path, MAX_JSON_BYTES)
    except FileNotFoundError:
        if not manifest_path.is_file():  # the whole folder went away under us, not a damaged checkpoint
            raise CheckpointNotFoundError(gone) from None
        raise errors.IntegrityError(f"{state_path}: missing") from None
    return manifest, _parse_state(manifest, data, str(state_path))


def _open_remote(folder: RemoteDir) -> tuple[Manifest, dict[str, Any]]:
    if not folder.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(f"{folder.url}: no {MANIFEST_NAME}; this is not a committed checkpoint")
    manifest = parse_manifest(folder.read_bytes(MANIFEST_NAME, MAX_JSON_BYTES), f"{folder.url}/{MANIFEST_NAME}")
    where = f"{folder.url}/{manifest.state_file}"
    try:
        data = folder.read_bytes(manifest.state_file, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise errors.IntegrityError(f"{where}: missing") from None
    return manifest, _parse_state(manifest, data, where)


def _parse_state(manifest: Manifest, data: bytes, where: str) -> dict[str, Any]:
    if len(data) != manifest.state_size or hash_bytes(data) != manifest.state_hash:
        raise errors.IntegrityError(f"{where}: size or hash differs from the manifest (corrupted)")
    tree = parse_json(data, where)
    if not isinstance(tree, dict):
        raise FormatError(f"{where}: not an object")
    return tree
