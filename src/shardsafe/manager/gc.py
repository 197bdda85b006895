"""``gc``: remove what interrupted saves and deletions left under a root, and nothing else.

What counts as garbage: hidden folders carrying one of shardsafe's temporary marks
(:func:`~shardsafe.protocol.temppath.is_hidden_temp`: a save, overwrite or retirement that died),
and step folders without a manifest (a retirement that kept stored-once data, minus the files a
checkpoint still references; on object stores, an interrupted save). A folder moved aside by an
overwrite that died between its two renames is the only copy of its checkpoint: it is put back.

A checkpoint whose manifest is present but cannot be read is never garbage: it is left in place
and reported. Since nobody can tell which files such a checkpoint references, while one exists
the manifest-less step folders (whose files it may point into) are left too, and reported.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardsafe.api.checkpoint import location
from shardsafe.core.format import MANIFEST_NAME
from shardsafe.core.nodes import folder_node_id
from shardsafe.manager.catalog import Catalog, DamagedCheckpoint, scan, step_folders, where
from shardsafe.manager.naming import STEP_NAMING
from shardsafe.manager.nodes import DEFAULT_LOCAL_DIR, node_dir
from shardsafe.manager.retention import remove_unreferenced
from shardsafe.manager.tier import check_own_folders, tier_folder_name
from shardsafe.protocol.commit import is_committed
from shardsafe.protocol.temppath import OLD_MARK, is_hidden_temp, original_name
from shardsafe.storage.local import fsync_dir, remove_tree
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir

__all__ = ["collect", "collect_garbage", "collect_local"]

log = logging.getLogger("shardsafe")


@dataclass  # mutable: collects what it removes and leaves while the root is walked
class GarbageReport:
    """What ``gc`` removed (or would remove), and what it left on purpose."""

    removed: list[Path | str] = field(default_factory=list)
    damaged: list[DamagedCheckpoint] = field(default_factory=list)  # present but unreadable: left in place
    # manifest-less step folders a damaged checkpoint may reference
    left: list[Path | str] = field(default_factory=list)


def collect_garbage(root: str | os.PathLike[str], *, dry_run: bool = False, min_age: float = 0.0) -> list[Path | str]:
    """Remove what interrupted saves and deletions left: hidden temporary, old and deleting folders,
    and step folders without a manifest. Only entries older than ``min_age`` seconds are touched,
    so a save in progress in another job is not disturbed. Returns what was (or would be) removed.

    Damaged checkpoints (and, while one exists, manifest-less step folders) are left in place and
    named in a logged warning; :func:`collect` returns them too.
    """
    return collect(root, dry_run=dry_run, min_age=min_age).removed


def collect(root: str | os.PathLike[str], *, dry_run: bool = False, min_age: float = 0.0) -> GarbageReport:
    """:func:`collect_garbage`, returning what was left on purpose as well."""
    where_ = location(root)
    catalog = scan(where_, warn=_warn_left)
    report = GarbageReport(damaged=list(catalog.damaged))
    as_location(where_).choose(
        local=lambda path: _collect_local(path, catalog, report, dry_run, min_age),
        remote=lambda folder: _collect_remote(folder, catalog, report, dry_run, min_age),
    )
    if report.left:
        log.warning(
            "shardsafe gc: left %d step folder(s) without a manifest under %s: the damaged checkpoint(s) %s may "
            "reference "
            "their files; repair or delete those, then run gc again",
            len(report.left),
            where(where_),
            ", ".join(where(d.path) for d in report.damaged),
        )
    return report


def _warn_left(damaged: DamagedCheckpoint) -> None:
    log.warning(
        "shardsafe gc: %s is a damaged checkpoint, left in place (delete it yourself if unneeded): %s",
        where(damaged.path),
        damaged.reason,
    )


def _collect_local(root: Path, catalog: Catalog, report: GarbageReport, dry_run: bool, min_age: float) -> None:
    now = time.time()
    referenced = catalog.references()
    for entry in sorted(os.scandir(root), key=lambda e: e.name) if root.is_dir() else []:
        if not entry.is_dir(follow_symlinks=False) or now - entry.stat(follow_symlinks=False).st_mtime < min_age:
            continue
        path = Path(entry.path)
        original = _moved_aside_from(root, entry.name)
        if original is not None:
            # An overwrite without RENAME_EXCHANGE died between its two renames: this is the only
            # copy of the checkpoint. Put it back rather than delete it.
            report.removed.append(path)
            if not dry_run:
                if original.exists():
                    original.rmdir()  # an empty folder left in its place
                os.rename(path, original)
                fsync_dir(root)
                log.warning(
                    "shardsafe: restored %s from %s (an overwrite was interrupted between its two renames)",
                    original,
                    path,
                )
            continue
        if is_hidden_temp(entry.name):
            report.removed.append(path)
            if not dry_run:
                remove_tree(path)
            continue
        step = STEP_NAMING.parse(entry.name)
        if step is None:
            continue  # not shardsafe's
        if os.path.lexists(path / MANIFEST_NAME):
            if not is_committed(path):  # a manifest that is not a regular file: damaged, not garbage
                damaged = DamagedCheckpoint(step, path, f"{MANIFEST_NAME} is not a regular file")
                report.damaged.append(damaged)
                _warn_left(damaged)
            continue
        if report.damaged:
            report.left.append(path)
        elif entry.name in referenced:
            keep = referenced[entry.name]
            report.removed += [Path(e.path) for e in os.scandir(path) if e.name not in keep]
            if not dry_run:
                remove_unreferenced(path, keep)
        else:
            report.removed.append(path)
            if not dry_run:
                remove_tree(path)


def _moved_aside_from(root: Path, name: str) -> Path | None:
    """For ``.NAME.shardsafe-old-ID`` holding a committed checkpoint while NAME holds none: NAME."""
    original_of = original_name(name, OLD_MARK)
    if original_of in (None, "", ".", ".."):
        return None
    original = root / original_of
    if is_committed(original) or not is_committed(root / name):
        return None
    if original.exists() and (not original.is_dir() or any(original.iterdir())):
        return None
    return original


def _collect_remote(root: RemoteDir, catalog: Catalog, report: GarbageReport, dry_run: bool, min_age: float) -> None:
    """Step prefixes without a manifest (interrupted saves or retirements), minus referenced data.

    A prefix holding any object younger than ``min_age`` (or of unknown age) is left alone: it may
    be a save in progress in another job, whose manifest is simply not written yet.
    """
    referenced = catalog.references()
    now = time.time()
    for _, name in sorted(step_folders(root).items()):
        folder = root.child(name)
        if folder.exists(MANIFEST_NAME):
            continue
        if report.damaged:
            report.left.append(folder.url)
            continue
        present = folder.list()
        if min_age > 0 and any((stamp := folder.modified(n)) is None or now - stamp < min_age for n in present):
            log.info(
                "shardsafe gc: %s has objects younger than %.0f s (a save in progress?); left alone",
                folder.url,
                min_age,
            )
            continue
        doomed = [n for n in present if n not in referenced.get(name, set())]
        report.removed += [f"{folder.url}/{n}" for n in doomed]
        if not dry_run:
            folder.remove(doomed)


def collect_local(
    root: str | os.PathLike[str],
    local_dir: str | os.PathLike[str] = DEFAULT_LOCAL_DIR,
    *,
    dry_run: bool = False,
    min_age: float = 0.0,
) -> list[Path]:
    """This node's local-tier folder of ``root`` (``shardsafe gc ROOT --local``): what a job that
    died left in host memory (``close()`` removes it otherwise). ``local_dir`` as the manager was
    given it (``{node}`` is this node's id, ``$SHARDSAFE_NODE`` or the hostname). Every step and
    temporary folder older than ``min_age`` seconds is removed (a running job's newest step is
    younger), then the folder itself once empty. Returns what was (or would be) removed.
    PermissionError when the folder or its node's folder is not this user's alone (a symlink, another
    user's, or writable by others): nothing is removed through it."""
    folder = node_dir(local_dir, folder_node_id()) / tier_folder_name(where(location(root)))
    if not os.path.lexists(folder):
        return []
    check_own_folders(folder)
    now = time.time()
    removed = [entry for entry in sorted(folder.iterdir()) if now - entry.lstat().st_mtime >= min_age]
    if dry_run:
        return removed
    for entry in removed:
        if entry.is_dir() and not entry.is_symlink():
            remove_tree(entry)
        else:
            entry.unlink()
    if not any(folder.iterdir()):
        folder.rmdir()
        try:
            folder.parent.rmdir()  # the node's folder, when no other root's tier is in it
        except OSError:
            pass
    return removed
