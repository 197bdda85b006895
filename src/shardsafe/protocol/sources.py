"""Where a reader's bytes come from: a local (or shared) folder, or an object-store prefix.

Both give the reader the same few operations (open and size a file, positional reads, a small
file whole, a sibling checkpoint's manifest), so every check of transfer.ChunkReader runs the same
way on both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, RETAINED_MANIFEST_NAME
from shardsafe.errors import IntegrityError
from shardsafe.storage.local import open_regular, pread_into, read_small_file, safe_child
from shardsafe.storage.remote import RemoteDir

__all__ = ["FileHandle", "LocalSource", "RemoteSource"]

# an open file: a descriptor (LocalSource), or an object's folder and name (RemoteSource)
FileHandle = int | tuple[RemoteDir, str]


class LocalSource:
    """Shard files of a checkpoint folder on the local filesystem (or a shared mount)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._fds: dict[tuple[str | None, str], int] = {}
        self._paths: dict[tuple[str | None, str], Path] = {}

    def describe(self, checkpoint: str | None, file: str) -> str:
        return str(self._path(checkpoint, file))

    def _path(self, checkpoint: str | None, file: str) -> Path:
        """The checked path (resolved once per file: errors name it on every read)."""
        ident = (checkpoint, file)
        path = self._paths.get(ident)
        if path is None:
            folder = self.folder if checkpoint is None else safe_child(self.folder.parent, checkpoint)
            path = self._paths[ident] = safe_child(folder, file)
        return path

    def open(self, checkpoint: str | None, file: str) -> tuple[int, int]:
        ident = (checkpoint, file)
        if ident not in self._fds:
            path = self._path(checkpoint, file)
            try:
                fd = self._fds[ident] = open_regular(path, follow=False)  # never blocks on a planted FIFO
            except FileNotFoundError:
                raise IntegrityError(f"{path}: shard file is missing") from None
            except OSError as exc:
                raise IntegrityError(f"{path}: cannot open shard file ({exc.strerror})") from None
            _read_sequentially(fd)
        fd = self._fds[ident]
        return fd, os.fstat(fd).st_size

    def read_into(self, handle: Any, views: list[memoryview], offset: int, where: object) -> None:
        pread_into(handle, views, offset, where)

    def stream(self, handle: Any) -> int | None:
        """A second open file description of the file behind ``handle`` (already opened and checked),
        or None where that cannot be had: the kernel keeps readahead state per open file, so each
        of several threads reading their own region of one file needs its own to be read ahead as
        a sequential stream. Reopened through ``/proc/self/fd``, it is the very same inode (a file
        replaced at the path meanwhile is not what it opens). The caller closes it."""
        try:
            fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        opened, checked = os.fstat(fd), os.fstat(handle)
        if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
            os.close(fd)
            return None
        _read_sequentially(fd)
        return fd

    def read_small(self, name: str, limit: int) -> bytes:
        """A small file of this checkpoint (an index), whole; IntegrityError when it is missing."""
        path = self._path(None, name)
        try:
            return read_small_file(path, limit)
        except FileNotFoundError:
            raise IntegrityError(f"{path}: missing") from None

    def sibling_manifest(self, checkpoint: str) -> tuple[bytes, str]:
        """(bytes, path) of the manifest of sibling checkpoint ``checkpoint`` (or the one it kept when
        retired with referenced files); FileNotFoundError when it has neither."""
        folder = safe_child(self.folder.parent, checkpoint)
        if not folder.is_dir():
            raise FileNotFoundError(folder)
        for name in (MANIFEST_NAME, RETAINED_MANIFEST_NAME):
            path = safe_child(folder, name)
            if os.path.lexists(path):
                return read_small_file(path, MAX_JSON_BYTES), str(path)
        raise FileNotFoundError(folder / MANIFEST_NAME)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _read_sequentially(fd: int) -> None:
    """Reads go through the file in order: ask for a larger readahead window (as ``cat`` does)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


class RemoteSource:
    """Shard objects of a checkpoint under an fsspec URL; each read is one ranged GET."""

    def __init__(self, folder: RemoteDir) -> None:
        self.folder = folder
        self._sizes: dict[tuple[str | None, str], int] = {}

    def _dir(self, checkpoint: str | None) -> RemoteDir:
        return self.folder if checkpoint is None else self.folder.parent.child(checkpoint)

    def describe(self, checkpoint: str | None, file: str) -> str:
        return f"{self._dir(checkpoint).url}/{file}"

    def open(self, checkpoint: str | None, file: str) -> tuple[tuple[RemoteDir, str], int]:
        ident = (checkpoint, file)
        if ident not in self._sizes:
            folder = self._dir(checkpoint)
            try:
                self._sizes[ident] = folder.size(file)
            except FileNotFoundError:
                raise IntegrityError(f"{folder.url}/{file}: shard object is missing") from None
        return (self._dir(checkpoint), file), self._sizes[ident]

    def read_into(self, handle: Any, views: list[memoryview], offset: int, where: object) -> None:
        folder, file = handle
        folder.read_into(file, views, offset, where)

    def stream(self, handle: Any) -> int | None:
        """None: every ranged GET is its own request already (see :meth:`LocalSource.stream`)."""
        return None

    def read_small(self, name: str, limit: int) -> bytes:
        try:
            return self.folder.read_bytes(name, limit)
        except FileNotFoundError:
            raise IntegrityError(f"{self.folder.url}/{name}: missing") from None

    def sibling_manifest(self, checkpoint: str) -> tuple[bytes, str]:
        folder = self._dir(checkpoint)
        name = MANIFEST_NAME if folder.exists(MANIFEST_NAME) else RETAINED_MANIFEST_NAME
        return folder.read_bytes(name, MAX_JSON_BYTES), f"{folder.url}/{name}"

    def close(self) -> None:
        self._sizes.clear()
