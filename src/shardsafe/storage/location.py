"""One folder interface over both kinds of storage: :class:`Location`, :class:`LocalDir` here,
``storage.remote.RemoteDir`` for fsspec URLs.

Code that names, lists, reads and writes small files of a folder (the manager's catalog, the
commit's open, a save's sibling checkpoint) takes a :class:`Location` and calls the same methods
on either, instead of branching on the kind of storage. What differs by nature (how a checkpoint
becomes visible: rename vs manifest PUT, protocol/commit.py; how its bytes are read,
protocol/sources.py; how one disappears, manager/retention.py; lease records, gc) has two
implementations of one protocol each, one taking a local ``Path`` and one a ``RemoteDir``:
:meth:`Location.choose` picks between them, so no module above this one tests the class of a folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from shardsafe.core.format import check_component
from shardsafe.storage.local import FileStamp, read_small_file, safe_child, write_small_file
from shardsafe.storage.remote import RemoteDir

__all__ = ["LocalDir", "Location", "as_location", "public_path"]

L = TypeVar("L")  # what the local implementation gives
R = TypeVar("R")  # what the object-store implementation gives


class Location(Protocol):
    """A folder of checkpoint files: a local (or shared) directory, or a prefix on an object store.

    Every method is called by whichever rank needs the folder (none is collective); each may raise
    ``OSError`` (``FileNotFoundError`` for a file that is not there) or, for a name that could
    leave the folder, :class:`~shardsafe.errors.FormatError`.
    """

    url: str  # the folder as errors and summaries name it

    @property
    def name(self) -> str:
        """The folder's last path component."""
        ...

    @property
    def native(self) -> Path | RemoteDir:
        """The folder as the layers above pass it around: a ``Path``, or the ``RemoteDir`` itself."""
        ...

    def public_path(self) -> Path | str:
        """What a public call returns for the folder: a ``Path`` on a local disk, the URL string on an object store."""
        ...

    def child(self, name: str) -> Location:
        """The sub-folder ``name`` (one safe path component)."""
        ...

    def sibling(self, name: str) -> Location:
        """The folder ``name`` next to this one (never outside the parent, not through a symlink)."""
        ...

    def exists(self, name: str) -> bool:
        """Whether the file ``name`` is here."""
        ...

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The small file ``name``, whole (at most ``limit`` bytes)."""
        ...

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write the small file ``name`` (durably, where the storage can say)."""
        ...

    def folders(self) -> list[str]:
        """Names of the sub-folders, sorted."""
        ...

    def stamp(self, name: str) -> FileStamp | None:
        """An identity of the file ``name`` that changes when it is rewritten (None: cannot tell)."""
        ...

    def choose(self, *, local: Callable[[Path], L], remote: Callable[[RemoteDir], R]) -> L | R:
        """``local(path)`` for a local folder, ``remote(folder)`` for an object-store prefix: the one
        place a protocol with two implementations learns which one a folder needs."""
        ...


class LocalDir(Location):
    """A folder on a local or shared filesystem."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.url = str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def native(self) -> Path:
        return self.path

    def public_path(self) -> Path:
        return self.path

    def child(self, name: str) -> LocalDir:
        check_component(name, self.url)
        return LocalDir(self.path / name)

    def sibling(self, name: str) -> LocalDir:
        return LocalDir(safe_child(self.path.parent, name))

    def exists(self, name: str) -> bool:
        """Whether ``name`` is a regular file here (a symlink or folder does not count)."""
        candidate = self.path / name
        return candidate.is_file() and not candidate.is_symlink()

    def read_bytes(self, name: str, limit: int) -> bytes:
        """A small file, never through a symlink out of the folder (its content could end up in an error)."""
        return read_small_file(safe_child(self.path, name), limit)

    def write_bytes(self, name: str, data: bytes) -> None:
        write_small_file(self.path / name, data)

    def folders(self) -> list[str]:
        """Names of the sub-folders (symlinks not followed)."""
        if not self.path.is_dir():
            return []
        return sorted(e.name for e in os.scandir(self.path) if e.is_dir(follow_symlinks=False))

    def stamp(self, name: str) -> FileStamp | None:
        """The inode, mtime and size of a file, to tell a rewritten file from the same one; None if missing."""
        try:
            st = os.stat(self.path / name)
        except OSError:
            return None
        return FileStamp(st.st_ino, st.st_mtime_ns, st.st_size)

    def choose(self, *, local: Callable[[Path], L], remote: Callable[[RemoteDir], R]) -> L | R:
        return local(self.path)


_REMOTE_IS_A_LOCATION: type[Location] = RemoteDir  # mypy checks RemoteDir against the interface here


def as_location(folder: str | os.PathLike[str] | Location) -> Location:
    """The folder interface for a local path (``str`` or ``PathLike``) or a folder that already is one."""
    return LocalDir(folder) if isinstance(folder, (str, os.PathLike)) else folder


def public_path(folder: Path | Location) -> Path | str:
    """What a public call returns for a folder: a ``Path`` on a local disk, the URL string on an object store."""
    return as_location(folder).public_path()
