"""One folder interface over both kinds of storage: :class:`LocalDir` here, :class:`~shardsafe.storage.remote.RemoteDir` for fsspec URLs.

Code that only needs to name, list, read and write small files of a checkpoint root (the
manager's catalog, say) takes a :data:`Location` and calls the same methods on either, instead of
branching on the kind of storage. What differs by nature stays where it belongs: how a
checkpoint becomes visible (rename vs manifest PUT, protocol/commit.py) and how one disappears
(manager/retention.py) are two implementations each of one protocol.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardsafe.core.format import check_component
from shardsafe.storage.local import read_small_file, safe_child, write_small_file
from shardsafe.storage.remote import RemoteDir

__all__ = ["as_location", "public_path"]


class LocalDir:
    """A folder on a local or shared filesystem, with the methods of :class:`RemoteDir`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.url = str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    def child(self, name: str) -> LocalDir:
        check_component(name, self.url)
        return LocalDir(self.path / name)

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

    def stamp(self, name: str) -> tuple[int, int, int] | None:
        """(inode, mtime, size) of a file, to tell a rewritten file from the same one; None if missing."""
        try:
            st = os.stat(self.path / name)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)


Location = LocalDir | RemoteDir


def as_location(folder: Path | RemoteDir | LocalDir) -> Location:
    """The folder interface for a local path or an fsspec folder."""
    return folder if isinstance(folder, (RemoteDir, LocalDir)) else LocalDir(folder)


def public_path(folder: Path | RemoteDir | LocalDir) -> Path | str:
    """What a public call returns for a folder: a ``Path`` on a local disk, the URL string on an object store."""
    if isinstance(folder, RemoteDir):
        return folder.url
    return folder.path if isinstance(folder, LocalDir) else Path(folder)
