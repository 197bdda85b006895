"""Which checkpoints to keep, and how one that is not kept disappears (the deleter).

The rule (:func:`choose_kept`) is pure: it sees the readable checkpoints and the options, never
the disk, so the manager and the Trainer integration (whose ``save_total_limit`` counts
differently) share it. The deleter (:func:`retire`) makes a checkpoint stop being one in a single
atomic step before any of its data goes, so a crash mid-delete never leaves a visible checkpoint
with missing files; what it leaves behind is hidden, and ``gc`` removes it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardsafe.core.faults import crash_point
from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, RETAINED_MANIFEST_NAME
from shardsafe.manager.catalog import CheckpointInfo, ranked
from shardsafe.protocol.temppath import DELETING_MARK, hidden_sibling
from shardsafe.storage.local import fsync_dir, remove_tree
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir

__all__ = ["choose_kept", "remove_unreferenced", "retire"]


@dataclass(frozen=True)
class Kept:
    """The steps retention keeps, and the best step (None if nothing is ranked)."""

    steps: frozenset[int]
    best: int | None


def choose_kept(
    infos: Sequence[CheckpointInfo],
    keep_last: int | None,
    keep_best: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    *,
    best: int | None = None,
) -> Kept:
    """Steps to keep: the ``keep_last`` newest, the ``keep_best`` best by ``best_metric``, and always
    the latest and the best. With neither limit set, everything is kept.

    ``best`` pins the best step when the caller ranks checkpoints itself (the Trainer's
    ``best_model_checkpoint``); otherwise the best is the top of ``best_metric``.
    """
    steps = sorted(i.step for i in infos)
    if not steps:
        return Kept(frozenset(), None)
    order = ranked(infos, best_metric, best_mode)
    top = best if best is not None and best in steps else (order[0] if order else None)
    if keep_last is None and keep_best is None:
        return Kept(frozenset(steps), top)
    keep = {steps[-1]}
    if top is not None:
        keep.add(top)
    if keep_last is not None and keep_last > 0:
        keep.update(steps[-keep_last:])
    if keep_best is not None:
        keep.update(order[:keep_best])
    return Kept(frozenset(keep), top)


def retire(folder: Path | RemoteDir, keep_files: set[str] | None = None) -> None:
    """Make the checkpoint ``folder`` disappear atomically, then delete its data.

    Unreferenced: rename to a hidden ``deleting`` sibling, remove its manifest (no part of it can
    pass for a checkpoint again), then the rest; a crash in between leaves only a hidden folder
    for ``gc``. Referenced by a kept checkpoint (``keep_files``, stored-once data): rename its
    manifest to ``manifest.retained.json`` first (it is no longer a checkpoint, but a load that
    follows a dedup reference checks the file against it), then delete every file nothing points into. On an
    object store (no rename) deleting the manifest, the commit marker, retires it at once.
    """
    crash_point("retention:before-rename", 0)
    as_location(folder).choose(
        local=lambda path: _retire_local(path, keep_files), remote=lambda prefix: _retire_remote(prefix, keep_files)
    )


def _retire_remote(folder: RemoteDir, keep_files: set[str] | None) -> None:
    if keep_files:  # readers check references into the kept files against the retained manifest
        folder.write_bytes(RETAINED_MANIFEST_NAME, folder.read_bytes(MANIFEST_NAME, MAX_JSON_BYTES))
    folder.remove([MANIFEST_NAME])
    crash_point("retention:after-rename", 0)
    keep = keep_files or set()
    folder.remove([name for name in folder.list() if name not in keep])


def _retire_local(folder: Path, keep_files: set[str] | None) -> None:
    if keep_files:
        os.replace(folder / MANIFEST_NAME, folder / RETAINED_MANIFEST_NAME)  # kept: readers check references against it
        fsync_dir(folder)
        crash_point("retention:after-rename", 0)
        remove_unreferenced(folder, keep_files)
        return
    hidden = hidden_sibling(folder, DELETING_MARK)
    os.rename(folder, hidden)
    fsync_dir(folder.parent)
    crash_point("retention:after-rename", 0)
    (hidden / MANIFEST_NAME).unlink(missing_ok=True)  # first, so no part of it can pass for a checkpoint again
    crash_point("retention:mid-delete", 0)
    remove_tree(hidden)


def remove_unreferenced(folder: Path, keep: set[str]) -> list[Path]:
    """Delete every entry of ``folder`` not named in ``keep``; returns what was deleted."""
    removed = []
    for entry in os.scandir(folder):
        if entry.name not in keep:
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                remove_tree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed
