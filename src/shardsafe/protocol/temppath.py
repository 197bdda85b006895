"""Hidden sibling paths, and the rename that makes a folder visible: one place for both.

Every folder shardsafe makes visible by rename (a checkpoint, a model folder, a Trainer
checkpoint, a staged upload) is first built as a hidden sibling ``.<name><mark><id>`` of its
final path, then published with :func:`publish`. Folders on their way out are renamed to a hidden
``deleting`` sibling first, so a crash mid-delete never leaves a half folder under a visible name.
``collect_garbage`` recognises every mark here (:func:`is_hidden_temp`) and nothing else.

This is Orbax's ``TemporaryPath`` idea, kept small: :class:`TemporaryPath` owns one hidden folder
until it is published or removed. Every folder built by hand elsewhere was a copy of its three
steps (make the hidden folder, publish it, remove it on error); checkpoints (``LocalCommit``),
``export_hf``, ``export_dcp`` and ``save_pretrained`` all use this one object instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

from shardsafe.core.faults import crash_point
from shardsafe.storage.local import exchange_paths, fsync_dir, make_dirs, remove_tree

__all__ = [
    "DELETING_MARK",
    "OLD_MARK",
    "PUSH_MARK",
    "TMP_MARK",
    "TemporaryPath",
    "exchange_paths",
    "hidden_name",
    "hidden_sibling",
    "is_hidden_temp",
    "original_name",
    "publish",
    "retire_folder",
]

TMP_MARK = ".shardsafe-tmp-"  # being written; published by rename
OLD_MARK = ".shardsafe-old-"  # the previous copy, moved aside where no atomic swap exists
DELETING_MARK = ".shardsafe-deleting-"  # on its way out (retention, overwrite)
PUSH_MARK = ".shardsafe-push-"  # a staged upload on an fsspec destination
MARKS = (TMP_MARK, OLD_MARK, DELETING_MARK)


def hidden_name(name: str, mark: str = TMP_MARK) -> str:
    """``.<name><mark><12 hex>``: hidden, unique, and traceable to the folder it belongs to."""
    return f".{name}{mark}{uuid.uuid4().hex[:12]}"


def hidden_sibling(final: Path, mark: str = TMP_MARK) -> Path:
    return final.parent / hidden_name(final.name, mark)


def is_hidden_temp(name: str, marks: tuple[str, ...] = MARKS) -> bool:
    return name.startswith(".") and any(mark in name for mark in marks)


def original_name(name: str, mark: str) -> str | None:
    """The visible name a hidden ``mark`` entry belongs to (None if ``name`` has no such mark)."""
    if not name.startswith(".") or mark not in name:
        return None
    return name[1:].rsplit(mark, 1)[0]


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
        old = hidden_sibling(final, OLD_MARK)
        os.rename(final, old)
        try:
            crash_point("save:between-renames", 0)
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)  # put the old checkpoint back (after a crash here, collect_garbage does)
            raise
        if fsync:
            fsync_dir(final.parent)
        crash_point("save:after-publish", 0)
        remove_tree(old)
        return
    if fsync:
        fsync_dir(final.parent)
    crash_point("save:after-publish", 0)


def retire_folder(folder: Path, fsync: bool = True) -> None:
    """Delete ``folder`` crash-safely: rename it to a hidden ``deleting`` sibling, then remove that."""
    hidden = hidden_sibling(folder, DELETING_MARK)
    os.rename(folder, hidden)
    if fsync:
        fsync_dir(folder.parent)
    remove_tree(hidden)


class TemporaryPath:
    """A hidden folder next to ``final`` that becomes ``final`` only once complete.

    The life of one (who calls what, in this order):

    1. :meth:`create` (the one process that owns it; in a collective, the coordinator): checks
       nothing, makes ``final``'s parent durably, then the hidden sibling. May raise ``OSError``;
       then nothing was made. The other ranks of a collective learn its name and build their handle
       with :meth:`attach` (``owner=False``): it never creates, publishes or removes anything.
    2. Whoever writes: files go into :attr:`path` (each file fsynced by its writer).
    3. :meth:`publish` (owner only): fsync the folder (so the names in it are durable), then rename
       it to ``final`` atomically (swapping it with what is there, where the filesystem can), fsync
       the parent. May raise; if it does before the rename, ``final`` is untouched; after it, the
       new folder is complete at ``final`` (whatever was there before is then only in a hidden
       folder). A half folder never has the final name.
    4. :meth:`remove` (owner only, on any failure): remove the hidden folder; never raises, does
       nothing once published or removed.

    As a context manager (``with TemporaryPath.create(final) as tmp: ...; tmp.publish()``) step 4
    runs when the block raises or ends without publishing.
    """

    def __init__(self, path: Path, final: Path, *, owner: bool = True, fsync: bool = True) -> None:
        self.path, self.final = Path(path), Path(final)
        self.owner, self.fsync = owner, fsync
        self.published = False
        self.removed = False

    @classmethod
    def create(cls, final: Path, *, mark: str = TMP_MARK, fsync: bool = True) -> TemporaryPath:
        """Make the hidden folder now (its parent first, durably: what is published there must not
        vanish with a new parent); the caller owns it."""
        final = Path(final)
        temp = cls(hidden_sibling(final, mark), final, fsync=fsync)
        make_dirs(final.parent)
        temp.path.mkdir()
        return temp

    @classmethod
    def attach(cls, path: Path, final: Path, *, owner: bool, fsync: bool = True) -> TemporaryPath:
        """A handle on a hidden folder another call created (every rank of a collective holds one;
        only the ``owner``, the rank that created it, publishes or removes it)."""
        return cls(path, final, owner=owner, fsync=fsync)

    def publish(self, before_rename: Callable[[], None] | None = None) -> Path:
        """Fsync the complete folder, run ``before_rename`` (a crash point), move it to :attr:`final`."""
        if not self.owner:
            raise RuntimeError(f"{self.path}: only the rank that created a temporary folder publishes it")
        if self.fsync:
            fsync_dir(self.path)
        if before_rename is not None:
            before_rename()
        publish(self.path, self.final, self.fsync)
        self.published = True
        return self.final

    def remove(self) -> None:
        """Remove the hidden folder (owner only; nothing once published); never raises."""
        if self.owner and not self.published and not self.removed:
            remove_tree(self.path)
            self.removed = True

    def __enter__(self) -> TemporaryPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
