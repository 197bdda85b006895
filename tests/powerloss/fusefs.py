"""The recording FUSE file system: every operation passes through to a real backing folder and is
logged, in the one order the (single-threaded) FUSE server ran them, with what durability needs.

Run as a program (the harness starts it; ``harness.Mount``)::

    python tests/powerloss/fusefs.py BACKING MOUNTPOINT LOGDIR

``LOGDIR/ops.jsonl`` gets one JSON object per operation that changed something or asked for
durability (create, mkdir, link, symlink, unlink, rmdir, rename with its flags, write, truncate,
fsync, fsyncdir), naming inodes by ids this file system hands out (stable across renames, new for
every created inode); ``LOGDIR/data.bin`` holds the written bytes, referenced by offset. A lookup
of ``MOUNTPOINT/.powerloss-<text>`` answers ENOENT and logs a ``marker`` (how a workload tells the
harness "save returned", "crash point X reached", at the exact place in the operation order).

Nothing here decides what survives a power cut: ``crashfs`` reads the log and does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import stat
import sys
from typing import Any

import mfusepy

MARKER_PREFIX = "/.powerloss-"  # a lookup of MOUNTPOINT/.powerloss-<text> is a marker
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_renameat2 = _libc.renameat2
_renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
_renameat2.restype = ctypes.c_int


class RecordingFS(mfusepy.Operations):
    use_ns = True

    def __init__(self, backing: str, logdir: str) -> None:
        self.backing = os.path.realpath(backing)
        self.log = open(os.path.join(logdir, "ops.jsonl"), "w", buffering=1 << 16)  # noqa: SIM115 - lives as long as the mount
        self.data = open(os.path.join(logdir, "data.bin"), "wb")  # noqa: SIM115
        self.data_size = 0
        self.ids: dict[tuple[int, int], int] = {}  # backing (st_dev, st_ino) -> our inode id
        self.next_id = 1
        root = os.lstat(self.backing)
        self.ids[(root.st_dev, root.st_ino)] = 0
        if os.listdir(self.backing):
            raise SystemExit(f"{self.backing}: the backing folder must start empty")
        self.fd_ids: dict[int, int] = {}
        self.dir_paths: dict[int, str] = {}  # opendir handle -> path (with nullpath_ok, readdir may get no path)
        self.next_dir_handle = 1

    # ------------------------------------------------------------------ bookkeeping

    def _real(self, path: str) -> str:
        return self.backing + path

    def _emit(self, **entry: Any) -> None:
        self.log.write(json.dumps(entry, separators=(",", ":")) + "\n")

    def _id_of(self, real: str) -> int:
        st = os.lstat(real)
        key = (st.st_dev, st.st_ino)
        if key not in self.ids:  # cannot happen when the backing folder started empty; kept total anyway
            self.ids[key] = self.next_id
            self.next_id += 1
        return self.ids[key]

    def _new_id(self, real: str) -> int:
        st = os.lstat(real)
        ident = self.next_id
        self.next_id += 1
        self.ids[(st.st_dev, st.st_ino)] = ident
        return ident

    def _parent(self, path: str) -> tuple[int, str]:
        head, _, name = path.rpartition("/")
        return self._id_of(self._real(head or "/")), name

    @staticmethod
    def _marker(path: str) -> str | None:
        return path[len(MARKER_PREFIX) :] if path.startswith(MARKER_PREFIX) else None

    # ------------------------------------------------------------------ reads

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        text = self._marker(path) if path is not None else None
        if text is not None:
            self._emit(op="marker", text=text)
            raise mfusepy.FuseOSError(errno.ENOENT)
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path or "/"))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_blocks")
        out = {k: getattr(st, k) for k in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def readdir(self, path: str | None, fh: int) -> Any:
        return [".", "..", *os.listdir(self._real(path if path is not None else self.dir_paths[fh]))]

    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._real(path))
        keys = (
            "f_bavail",
            "f_bfree",
            "f_blocks",
            "f_bsize",
            "f_favail",
            "f_ffree",
            "f_files",
            "f_flag",
            "f_frsize",
            "f_namemax",
        )
        return {k: getattr(sv, k) for k in keys}

    def open(self, path: str, flags: int) -> int:
        fd = os.open(self._real(path), flags & ~os.O_CREAT)
        self.fd_ids[fd] = self._id_of(self._real(path))
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def opendir(self, path: str) -> int:
        handle = self.next_dir_handle
        self.next_dir_handle += 1
        self.dir_paths[handle] = path
        return handle

    def releasedir(self, path: str | None, fh: int) -> int:
        self.dir_paths.pop(fh, None)
        return 0

    # ------------------------------------------------------------------ changes

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        real = self._real(path)
        parent, name = self._parent(path)
        fd = os.open(real, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        ident = self._new_id(real)
        self.fd_ids[fd] = ident
        self._emit(op="create", parent=parent, name=name, ino=ident)
        return fd

    def mkdir(self, path: str, mode: int) -> int:
        real = self._real(path)
        parent, name = self._parent(path)
        os.mkdir(real, mode)
        self._emit(op="mkdir", parent=parent, name=name, ino=self._new_id(real))
        return 0

    def symlink(self, target: str, source: str) -> int:
        real = self._real(target)
        parent, name = self._parent(target)
        os.symlink(source, real)
        self._emit(op="symlink", parent=parent, name=name, ino=self._new_id(real), target=source)
        return 0

    def link(self, target: str, source: str) -> int:
        parent, name = self._parent(target)
        ident = self._id_of(self._real(source))
        os.link(self._real(source), self._real(target))
        self._emit(op="link", parent=parent, name=name, ino=ident)
        return 0

    def unlink(self, path: str) -> int:
        real = self._real(path)
        parent, name = self._parent(path)
        ident = self._id_of(real)
        os.unlink(real)
        self._emit(op="unlink", parent=parent, name=name, ino=ident)
        return 0

    def rmdir(self, path: str) -> int:
        real = self._real(path)
        parent, name = self._parent(path)
        ident = self._id_of(real)
        os.rmdir(real)
        self._emit(op="rmdir", parent=parent, name=name, ino=ident)
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        src_parent, src_name = self._parent(old)
        dst_parent, dst_name = self._parent(new)
        moved = self._id_of(self._real(old))
        replaced = self._id_of(self._real(new)) if os.path.lexists(self._real(new)) else None
        if _renameat2(_AT_FDCWD, os.fsencode(self._real(old)), _AT_FDCWD, os.fsencode(self._real(new)), flags) != 0:
            raise mfusepy.FuseOSError(ctypes.get_errno())
        self._emit(
            op="rename",
            sp=src_parent,
            sn=src_name,
            dp=dst_parent,
            dn=dst_name,
            ino=moved,
            replaced=replaced,
            flags=flags,
        )
        return 0

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        written = os.pwrite(fh, data, offset)
        self.data.write(data[:written])
        self._emit(op="write", ino=self.fd_ids[fh], off=offset, len=written, blob=self.data_size)
        self.data_size += written
        return written

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        if fh is not None:
            os.ftruncate(fh, length)
            ident = self.fd_ids[fh]
        else:
            assert path is not None
            os.truncate(self._real(path), length)
            ident = self._id_of(self._real(path))
        self._emit(op="truncate", ino=ident, size=length)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._emit(op="fsync", ino=self.fd_ids[fh], datasync=bool(datasync))
        return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        self._emit(op="fsyncdir", ino=self._id_of(self._real(path if path is not None else self.dir_paths[fh])))
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        self.fd_ids.pop(fh, None)
        os.close(fh)
        return 0

    def chmod(self, path: str | None, mode: int) -> int:
        if path is not None:
            os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str | None, uid: int, gid: int) -> int:
        if path is not None:
            os.lchown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str | None, times: Any = None) -> int:
        real = self._real(path) if path is not None else None
        if real is not None and not stat.S_ISLNK(os.lstat(real).st_mode):
            os.utime(real, ns=times) if times else os.utime(real)
        return 0

    def init_with_config(self, conn_info: Any, config_3: Any) -> None:
        if config_3 is not None:  # no kernel caching: every lookup (markers too) and attribute reaches us
            config_3.entry_timeout = 0.0
            config_3.attr_timeout = 0.0
            config_3.negative_timeout = 0.0
            config_3.hard_remove = 1  # unlink for real, no .fuse_hidden renames in the log
            config_3.nullpath_ok = 1

    def destroy(self, path: str) -> None:
        self.log.flush()
        self.data.flush()
        self.log.close()
        self.data.close()


class FlagsFUSE(mfusepy.FUSE):
    """mfusepy drops rename's flags (RENAME_EXCHANGE, RENAME_NOREPLACE) and truncate's file handle
    (an ``ftruncate`` of an open file comes without a path under ``nullpath_ok``): pass them on."""

    def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
        fh = fip.contents.fh if fip else None
        return self.operations.truncate(None if path is None else path.decode(self.encoding, self.errors), length, fh)

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return self.operations.rename(
            old.decode(self.encoding, self.errors), new.decode(self.encoding, self.errors), flags
        )


def main(argv: list[str]) -> None:
    backing, mountpoint, logdir = argv
    FlagsFUSE(RecordingFS(backing, logdir), mountpoint, foreground=True, nothreads=True, fsname="powerloss")


if __name__ == "__main__":
    main(sys.argv[1:])
