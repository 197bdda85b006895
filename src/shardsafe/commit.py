"""How a checkpoint becomes visible: the two-phase commit protocol.

1. The coordinator alone checks the destination and creates a hidden temporary folder
   ``.<name>.shardsafe-tmp-<uuid>`` next to it, then tells every rank its name.
2. Every rank writes only its own file into it and fsyncs it (transfer.py).
3. Every rank reports success or its error to the coordinator (the agreement step).
4. Only if all succeeded, the coordinator writes ``state.json`` then ``manifest.json`` (the
   commit marker), fsyncs the folder, moves it into place and fsyncs the parent. Overwriting
   swaps the folders atomically (renameat2 RENAME_EXCHANGE) before removing the old one.
5. The coordinator tells every rank the outcome; all ranks return or raise the same error.

No path is created by more than one rank, so concurrent ranks or nodes sharing a filesystem
cannot collide, and a crash at any point leaves either the old checkpoint or the new one visible,
never a mix: a folder without a manifest is never loaded (and hidden temporaries are garbage for
``shardsafe gc``).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from . import errors
from .comm import Comm
from .errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, SaveError, ShardsafeError
from .faults import crash_point
from .format import MANIFEST_NAME, MAX_JSON_BYTES, STATE_NAME, FileEntry, Manifest, parse_json, parse_manifest
from .integrity import hash_bytes
from .storage import exchange_paths, fsync_dir, read_small_file, remove_tree, safe_child, write_small_file

TMP_MARK = ".shardsafe-tmp-"
OLD_MARK = ".shardsafe-old-"


def is_committed(folder: Path) -> bool:
    return (folder / MANIFEST_NAME).is_file()


def _raise_shared(outcome: tuple[Any, ...]) -> None:
    """Re-raise on every rank the error one rank reported (same class, same message)."""
    if outcome[0] == "ok":
        return
    _, cls_name, message = outcome
    cls = getattr(errors, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, ShardsafeError)):
        cls = SaveError
    raise cls(message)


def _error_outcome(exc: BaseException) -> tuple[str, str, str]:
    name = type(exc).__name__ if isinstance(exc, ShardsafeError) else "SaveError"
    message = str(exc) if isinstance(exc, ShardsafeError) else f"{type(exc).__name__}: {exc}"
    return ("error", name, message)


def prepare(comm: Comm, final: Path, overwrite: bool) -> Path:
    """Coordinator: check the destination and create the temporary folder; all ranks: learn it."""
    outcome: tuple[Any, ...] = ("ok", "")
    if comm.is_coordinator:
        try:
            outcome = ("ok", str(_make_tmp(final, overwrite)))
        except Exception as exc:  # reported to every rank below
            outcome = _error_outcome(exc)
    outcome = comm.broadcast(outcome)
    _raise_shared(outcome)
    return Path(outcome[1])


def _make_tmp(final: Path, overwrite: bool) -> Path:
    if is_committed(final) and not overwrite:
        raise CheckpointExistsError(f"{final}: a checkpoint already exists here; pass overwrite=True to replace it")
    if final.exists() and not final.is_dir():
        raise SaveError(f"{final}: exists and is not a folder")
    if final.is_dir() and not is_committed(final) and any(final.iterdir()) and not overwrite:
        raise CheckpointExistsError(f"{final}: folder exists, is not empty and holds no checkpoint; pass overwrite=True to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}{TMP_MARK}{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def agree_and_publish(comm: Comm, tmp: Path, final: Path, rank_result: tuple[Any, ...], build: Any, fsync: bool = True) -> Manifest | None:
    """Agreement + commit. ``build(results)`` runs on the coordinator and returns (manifest, state bytes)."""
    results = comm.gather(rank_result)
    outcome: tuple[Any, ...] = ("ok",)
    manifest = None
    if comm.is_coordinator:
        assert results is not None
        try:
            failures = [r[1] for r in results if r[0] != "ok"]
            if failures:
                raise SaveError("save failed, nothing was published:\n  " + "\n  ".join(failures))
            manifest, state_bytes = build(results)
            write_small_file(tmp / STATE_NAME, state_bytes, fsync)
            crash_point("save:before-manifest", comm.rank)
            write_small_file(tmp / MANIFEST_NAME, manifest.to_bytes(), fsync)
            if fsync:
                fsync_dir(tmp)
            crash_point("save:before-publish", comm.rank)
            publish(tmp, final, fsync)
        except Exception as exc:
            remove_tree(tmp)
            outcome = _error_outcome(exc)
    outcome = comm.broadcast(outcome)
    _raise_shared(outcome)
    return manifest


def publish(tmp: Path, final: Path, fsync: bool = True) -> None:
    """Move a complete folder into place atomically, replacing whatever is there."""
    if not final.exists():
        os.rename(tmp, final)
    elif exchange_paths(tmp, final):
        if fsync:
            fsync_dir(final.parent)
        crash_point("save:after-publish", 0)
        remove_tree(tmp)  # now holds the old checkpoint
        return
    else:  # no atomic swap on this filesystem: move the old one aside first
        old = final.parent / f".{final.name}{OLD_MARK}{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
        os.rename(tmp, final)
        if fsync:
            fsync_dir(final.parent)
        remove_tree(old)
        return
    if fsync:
        fsync_dir(final.parent)


def new_manifest(world_size: int, files: dict[str, FileEntry], state_bytes: bytes, metadata: dict[str, Any] | None, version: str) -> Manifest:
    return Manifest(
        world_size=world_size,
        tensors={},
        files=files,
        state_size=len(state_bytes),
        state_hash=hash_bytes(state_bytes),
        metadata=dict(metadata or {}),
        created=time.time(),
        writer_version=version,
    )


def open_checkpoint(folder: Path) -> tuple[Manifest, dict[str, Any]]:
    """Read and validate a committed checkpoint's manifest and state tree."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such checkpoint folder")
    if not manifest_path.is_file():
        raise CheckpointNotFoundError(f"{folder}: no {MANIFEST_NAME}; this is not a committed checkpoint (an interrupted save leaves none)")
    manifest = parse_manifest(read_small_file(safe_child(folder, MANIFEST_NAME), MAX_JSON_BYTES), str(manifest_path))
    state_path = safe_child(folder, STATE_NAME)
    try:
        data = read_small_file(state_path, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise errors.IntegrityError(f"{state_path}: missing") from None
    if len(data) != manifest.state_size or hash_bytes(data) != manifest.state_hash:
        raise errors.IntegrityError(f"{state_path}: size or hash differs from the manifest (corrupted)")
    tree = parse_json(data, str(state_path))
    if not isinstance(tree, dict):
        raise FormatError(f"{state_path}: not an object")
    return manifest, tree
