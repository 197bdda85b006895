"""Hidden sibling paths, and the rename that makes a folder visible: one place for both.

Every folder shardsafe makes visible by rename (a checkpoint, a model folder, a Trainer
checkpoint, a staged upload) is first built as a hidden sibling ``.<name><mark><id>`` of its
final path, then published with :func:`publish`. Folders on their way out are renamed to a hidden
``deleting`` sibling first, so a crash mid-delete never leaves a half folder under a visible name.
``collect_garbage`` recognises every mark here (:func:`is_hidden_temp`) and nothing else.

This is Orbax's ``TemporaryPath`` idea, kept small: :class:`TemporaryPath` owns one hidden folder
until it is published or removed.
"""

from __future__ import annotations

import os
import uuid
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
    """A hidden folder next to ``final``, created now, that becomes ``final`` on :meth:`publish`.

    Used as a context manager it removes the hidden folder if the block fails (or returns
    without publishing), so nothing half-built is left under any name but a hidden one.
    """

    def __init__(self, final: Path, *, mark: str = TMP_MARK, create: bool = True) -> None:
        self.final = Path(final)
        self.path = hidden_sibling(self.final, mark)
        self.published = False
        if create:
            make_dirs(self.final.parent)  # durably: what is published there must not vanish with a new parent
            self.path.mkdir()

    def publish(self, fsync: bool = True) -> Path:
        publish(self.path, self.final, fsync)
        self.published = True
        return self.final

    def remove(self) -> None:
        if not self.published:
            remove_tree(self.path)

    def __enter__(self) -> TemporaryPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
