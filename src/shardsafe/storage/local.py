"""Local filesystem storage: how bytes land on disk and come back.

Kept free of checkpoint semantics: it knows files, folders, fsync, atomic renames and
positional reads. The commit protocol (commit.py) decides what to call when.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import io
import mmap
import os
import shutil
import stat
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from shardsafe.errors import FormatError, IntegrityError
from shardsafe.storage.device_copy import device_pieces

__all__ = [
    "FileStamp",
    "FileWindow",
    "MappedFile",
    "MADV_DONTNEED",
    "PAGE",
    "WRITE_BEHIND_WINDOW",
    "WriteBehind",
    "create_or_recycle",
    "exchange_paths",
    "fsync_dir",
    "fsync_file",
    "madvise_pages",
    "make_dirs",
    "open_regular",
    "pread_into",
    "prefault_writable",
    "prefaulting",
    "read_small_file",
    "remove_tree",
    "safe_child",
    "tensor_bytes",
    "tensor_pieces",
    "write_small_file",
]


class FileStamp(NamedTuple):
    """What tells a rewritten file from the same one (a replaced file has a new inode)."""

    inode: int
    mtime_ns: int
    size: int


# bounds host staging for tensors on devices other than CUDA (CUDA: the pinned pool's buffers)
WRITE_PIECE = 64 * 1024 * 1024


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def tensor_pieces(tensor: torch.Tensor, piece: int = WRITE_PIECE) -> Iterator[memoryview]:
    """Yield a tensor's bytes in order; device tensors are staged through host memory piecewise.

    A CPU tensor is one zero-copy view. A CUDA tensor streams through the process's reused pinned
    buffers, double-buffered on a side stream (:func:`~shardsafe.storage.device_copy.device_pieces`):
    nothing is pinned per call. Any other device is staged through one pageable buffer of ``piece``
    bytes. Each yielded view is valid until the next is asked for.
    """
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        yield tensor_bytes(tensor)
        return
    if tensor.device.type == "cuda":
        yield from device_pieces(tensor)
        return
    flat = tensor.reshape(-1)
    step = max(1, piece // max(1, flat.element_size()))
    staging = torch.empty(min(step, flat.numel()), dtype=flat.dtype)
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        staging[: part.numel()].copy_(part)
        yield tensor_bytes(staging[: part.numel()])


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        written = os.write(fd, view[: 1 << 30])
        view = view[written:]


_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4
WRITE_BEHIND_WINDOW = 32 * 1024 * 1024
WRITE_BEHIND_DEPTH = 2  # windows in flight to the disk before the writer waits for the oldest


def _libc_sync_file_range() -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    function = getattr(ctypes.CDLL(name, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_sync_file_range = _libc_sync_file_range()


class WriteBehind:
    """Streams a large file to the disk while it is being written, instead of all at the final fsync.

    With only an fsync at the end, the kernel holds the whole file dirty in the page cache (it
    starts writeback late, at dirty_background_ratio) and the disk idles while we copy; then the
    writer idles while the disk drains. Every ``WRITE_BEHIND_WINDOW`` bytes this starts writeback
    of that window (Linux ``sync_file_range``), waits for the window ``WRITE_BEHIND_DEPTH`` back
    and drops its now clean pages, so copying overlaps the disk and dirty memory stays bounded.
    It only schedules I/O early: durability still comes from the caller's fsync. A no-op where
    ``sync_file_range`` is missing.
    """

    def __init__(self, fd: int, enabled: bool = True) -> None:
        self.fd = fd
        self.enabled = enabled and _sync_file_range is not None
        self.started = 0  # writeback has been started for bytes [0, started)
        self.pending: list[tuple[int, int]] = []

    def advance(self, written: int) -> None:
        """Tell it the file now holds ``written`` bytes."""
        while self.enabled and written - self.started >= WRITE_BEHIND_WINDOW:
            window = (self.started, WRITE_BEHIND_WINDOW)
            self._call(*window, _SYNC_FILE_RANGE_WRITE)
            self.pending.append(window)
            self.started += WRITE_BEHIND_WINDOW
            if len(self.pending) > WRITE_BEHIND_DEPTH:
                self._retire(self.pending.pop(0))

    def _retire(self, window: tuple[int, int]) -> None:
        self._call(*window, _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)
        if self.enabled:
            os.posix_fadvise(self.fd, window[0], window[1], os.POSIX_FADV_DONTNEED)

    def _call(self, offset: int, length: int, flags: int) -> None:
        assert _sync_file_range is not None  # called only while enabled
        if _sync_file_range(self.fd, offset, length, flags) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ESPIPE):
                self.enabled = False  # this filesystem cannot: fall back to the plain final fsync
                return
            raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def write_small_file(path: Path, data: bytes, fsync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, memoryview(data))
        if fsync:
            os.fsync(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror or exc} while writing {path}") from exc
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Make a file's data durable (for files another library wrote and closed without fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path, fsync: bool = True) -> None:
    """``mkdir -p path``, durably: each folder it creates is fsynced into its parent.

    ``Path.mkdir(parents=True)`` alone leaves a new folder's name in the page cache: after a power
    cut the folder (and every checkpoint later published into it, however well fsynced) can be gone.
    """
    path = Path(path)
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:  # made by another process meanwhile: made durable here all the same
            if not folder.is_dir():
                raise
        if fsync:
            fsync_dir(folder.parent)


def safe_child(folder: Path, name: str) -> Path:
    """``folder/name``, refusing anything that resolves outside ``folder`` (symlinks included) and names
    no file system can hold (a NUL byte)."""
    if "\x00" in name:
        raise FormatError(f"{folder}: a file name with a NUL byte ({name!r:.80}) cannot be a checkpoint file")
    candidate = folder / name
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(candidate)
    if os.path.dirname(real) != real_folder and real != real_folder:
        raise FormatError(f"{candidate}: path leads outside the checkpoint folder {folder}")
    if os.path.islink(candidate):
        raise FormatError(f"{candidate}: is a symbolic link; checkpoint files must be regular files")
    return candidate


def open_regular(path: Path, follow: bool = True) -> int:
    """Open an existing file for reading without blocking on a FIFO or device (and, unless ``follow``,
    without following a symlink); refuses anything but a regular file, so a FIFO planted in a
    checkpoint cannot hang the reader."""
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
        | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    )
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{path}: not a regular file")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_file(path: Path, limit: int) -> bytes:
    """Read a whole small file, refusing one larger than ``limit`` before reading it."""
    with open(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FormatError(f"{path}: {size} bytes is more than the {limit} allowed")
        return f.read(limit + 1)


def pread_into(fd: int, views: list[memoryview], offset: int, where: object) -> None:
    """Fill ``views`` from consecutive bytes at ``offset``; a short read means a truncated file.

    ``where`` names the place in an error: anything whose ``str()`` does (built only if one is raised)."""
    pending = [v for v in views if len(v)]
    while pending:
        try:
            got = os.preadv(fd, pending, offset)
        except OSError as exc:  # EIO from a failing disk, ESTALE on NFS, ...: named, not a traceback
            raise IntegrityError(f"{where}: cannot read at byte {offset} ({exc.strerror or exc})") from exc
        if got == 0:
            raise IntegrityError(f"{where}: file ends early at byte {offset} (truncated)")
        offset += got
        while pending and got >= len(pending[0]):
            got -= len(pending[0])
            pending.pop(0)
        if got:
            pending[0] = pending[0][got:]


class FileWindow(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a read-only seekable file of ``length`` bytes.

    For parsers that want a file object (``zipfile`` on an archive stored inside a larger file):
    every read is a positional read clipped to the window, so nothing outside it is ever read and
    the file's own position is never moved.
    """

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise OSError(errno.EINVAL, "seek before the start of the window")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._offset + self._pos)
        self._pos += got
        return got


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc_renameat2() -> object | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    return getattr(libc, "renameat2", None)


_renameat2 = _libc_renameat2()


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE).

    Returns False when the platform or filesystem cannot do it, so the caller can fall back.
    """
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)  # type: ignore[operator]
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+: map pages in (readable) without a fault each
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their contents
PAGE = mmap.PAGESIZE


def _libc_madvise() -> Callable[..., int] | None:
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    function = getattr(ctypes.CDLL(name, use_errno=True), "madvise", None) if name else None
    if function is not None:
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        function.restype = ctypes.c_int
    return function


_madvise = _libc_madvise()


def madvise_pages(start: int, end: int, advice: int) -> bool:
    """``madvise`` over the whole pages inside [start, end) (addresses); False where it is missing or
    refused (advice only: callers go on either way)."""
    lo, hi = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    return _madvise is not None and lo < hi and _madvise(lo, hi - lo, advice) == 0


def prefault_writable(tensors: list[torch.Tensor]) -> None:
    """Fault in the pages of freshly allocated CPU tensors ahead of the reads that fill them.

    A read into new memory pays a page fault per 4 KiB page inside the copy, on the reading thread
    (~0.16 s per 800 MB here). Run on a second thread, ``madvise(MADV_POPULATE_WRITE)`` does that
    work while the reader waits on the disk; it never changes a byte (a page already written by the
    reader stays as it is), so it may run concurrently with the reads. Best effort: nothing happens
    where the call does not exist (another OS, a kernel before 5.14), and errors are ignored.
    """
    if _madvise is None:
        return
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.numel():
            continue
        start = tensor.data_ptr()
        if not madvise_pages(start, start + tensor.numel() * tensor.element_size(), _MADV_POPULATE_WRITE):
            return  # unsupported here (EINVAL on a kernel before 5.14): do not try the others


@contextmanager
def prefaulting(tensors: list[torch.Tensor]) -> Iterator[None]:
    """:func:`prefault_writable` of ``tensors`` on a thread of its own while the block runs (the reads
    or receives that fill them), joined at its end: the page faults are taken while the block waits
    on the disk or the peer, not inside each copy."""
    thread = threading.Thread(target=prefault_writable, args=(tensors,), name="shardsafe-prefault", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def create_or_recycle(path: Path, recycled: Path | None, mode: int = os.O_WRONLY) -> tuple[int, bool]:
    """A new file at ``path``, opened with ``mode`` (``O_EXCL``: one writer per file); or, given
    ``recycled`` (a regular file of a retired step, in the same file system), that file moved to
    ``path`` and opened to be written over. Returns (fd, whether it was recycled).

    Why: on a tmpfs every page of a new file is allocated and zeroed on first write (and in a virtual
    machine whose freed memory went back to the host, faulted in there too); a recycled file's pages
    are already there. The caller writes every byte it keeps and truncates to its size. Anything
    but a regular file with one link under ``recycled`` (a symlink, a folder, a hard link to a file
    elsewhere, whose bytes writing over it would change) is left alone and a new file made; so is any
    recycled file when something is at ``path`` already (a rename would replace it: ``O_EXCL`` refuses)."""
    if recycled is not None and not os.path.lexists(path):
        try:
            if _sole_regular(os.lstat(recycled)):
                os.rename(recycled, path)
                try:
                    fd = os.open(path, mode | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
                except OSError:  # replaced under us between the rename and the open
                    path.unlink(missing_ok=True)
                    raise
                if _sole_regular(os.fstat(fd)):
                    return fd, True
                os.close(fd)
                path.unlink()
        except OSError:  # gone, or not ours to write: a new file
            pass
    return os.open(path, mode | os.O_CREAT | os.O_EXCL, 0o644), False


def _sole_regular(info: os.stat_result) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1


class MappedFile:
    """A regular file mapped shared into memory, as a uint8 tensor (:attr:`bytes`): what the local
    tier's transfers send from and receive into, so that the process group reads a file's pages and
    writes a new file's pages directly (no read or write copy through a buffer).

    :meth:`for_reading` maps an existing regular file (not through a symlink) read-only, after
    checking it has ``size`` bytes;
    :meth:`for_writing` creates one of ``size`` bytes (``O_EXCL``, or a ``recycled`` file sized to
    it: :func:`create_or_recycle`) and *reserves* the byte ranges that will be written
    (``posix_fallocate``), so that a full file system is an error here rather than a SIGBUS at the
    first store into a page it cannot back. A mapped file that shrinks under
    the mapping still raises SIGBUS: only files this process's job owns (its tier folder) are mapped."""

    def __init__(self, fd: int, size: int, writable: bool) -> None:
        self.fd, self.writable = fd, writable
        self._map: mmap.mmap | None = None
        if size:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        self.bytes = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            with warnings.catch_warnings():  # a reader's mapping is read-only, and only ever read
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def for_reading(cls, path: Path, size: int) -> MappedFile:
        fd = open_regular(path, follow=False)  # a symlink planted in the folder could point anywhere
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise IntegrityError(f"{path}: {actual} bytes, the manifest says {size}")
            return cls(fd, size, writable=False)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def for_writing(
        cls, path: Path, size: int, ranges: Iterable[tuple[int, int]], recycled: Path | None = None
    ) -> MappedFile:
        fd, _ = create_or_recycle(path, recycled, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            for begin, end in ranges:
                if end > begin:
                    os.posix_fallocate(fd, begin, end - begin)
            return cls(fd, size, writable=True)
        except BaseException:  # a full file system (ENOSPC here, not a SIGBUS later): nothing left behind
            os.close(fd)
            path.unlink(missing_ok=True)
            raise

    def populate(self, begin: int, end: int) -> None:
        """Map in the pages of bytes [begin, end) in one call (``MADV_POPULATE_READ``/``_WRITE``),
        instead of a page fault per 4 KiB page inside the transfer. Advice only."""
        if self._map is not None and end > begin:
            start = self.bytes.data_ptr()
            madvise_pages(start + begin, start + end, _MADV_POPULATE_WRITE if self.writable else _MADV_POPULATE_READ)

    def sync(self) -> None:
        """The written pages to stable storage (``msync``, then ``fsync``)."""
        if self._map is not None:
            self._map.flush()
        os.fsync(self.fd)

    def close(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)  # the view must go before the mapping can close
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self.fd)
