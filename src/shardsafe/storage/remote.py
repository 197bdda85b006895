"""Object stores and other fsspec URLs (``s3://bucket/prefix``, ``memory://``, ...).

There is no rename on an object store, so the commit protocol differs from the local one (see
commit.py): every save writes its data under names unique to that save, and the single PUT of
``manifest.json`` is the commit. This module only moves bytes; it knows nothing of checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from shardsafe.core.format import check_component
from shardsafe.errors import FormatError, IntegrityError
from shardsafe.storage.local import FileStamp
from shardsafe.storage.safetensors import write_tensor_stream

__all__ = ["RemoteDir", "is_url", "local_path_of"]

L = TypeVar("L")  # what the local implementation gives
R = TypeVar("R")  # what the object-store implementation gives


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for fsspec URLs other than plain local paths (``file://`` counts as local)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def local_path_of(path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    if isinstance(path, str) and path.startswith("file://"):
        return path[len("file://") :]
    return path


class RemoteDir:
    """A "folder" (key prefix) on an fsspec filesystem: a :class:`~shardsafe.storage.location.Location`
    (checked by mypy there: this module is below it), plus what only object stores have (keys, sizes,
    ranged reads, listing, deletes)."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/")

    def child(self, name: str) -> RemoteDir:
        check_component(name, self.url)
        return RemoteDir(f"{self.url}/{name}")

    @property
    def parent(self) -> RemoteDir:
        return RemoteDir(self.url.rsplit("/", 1)[0])

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[1]

    @property
    def native(self) -> RemoteDir:
        return self

    def public_path(self) -> str:
        return self.url

    def sibling(self, name: str) -> RemoteDir:
        return self.parent.child(name)

    def choose(self, *, local: Callable[[Path], L], remote: Callable[[RemoteDir], R]) -> L | R:
        return remote(self)

    def key(self, name: str) -> str:
        check_component(name, self.url)
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.key(name)))

    def size(self, name: str) -> int:
        return int(self.fs.size(self.key(name)))

    def read_bytes(self, name: str, limit: int) -> bytes:
        size = self.size(name)
        if size > limit:
            raise FormatError(f"{self.url}/{name}: {size} bytes is more than the {limit} allowed")
        data = bytes(self.fs.cat_file(self.key(name)))
        if len(data) != size:  # a response cut short (or an object replaced meanwhile)
            raise IntegrityError(f"{self.url}/{name}: read {len(data)} bytes, the object has {size}")
        return data

    def write_bytes(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.key(name), data)

    def write_tensors(
        self, name: str, prefix: bytes, tensors: Iterable[torch.Tensor], block_size: int
    ) -> tuple[int, list[list[str]]]:
        """Stream ``prefix`` and the tensors into one object (multipart upload), hashing blocks."""
        return write_tensor_stream(
            self.fs.open(self.key(name), "wb"), prefix, tensors, block_size, f"{self.url}/{name}"
        )

    def read_into(self, name: str, views: Iterable[memoryview], offset: int, where: object) -> None:
        """Fill ``views`` from consecutive bytes at ``offset`` with one ranged GET."""
        views = [v for v in views if len(v)]
        total = sum(len(v) for v in views)
        if not total:
            return
        data = self.fs.cat_file(self.key(name), start=offset, end=offset + total)
        if len(data) != total:
            raise IntegrityError(f"{where}: object ends early at byte {offset + len(data)} (truncated)")
        pos = 0
        for v in views:
            v[:] = data[pos : pos + len(v)]
            pos += len(v)

    def folders(self) -> list[str]:
        """Names under this prefix (an object store has no folders: every common prefix counts)."""
        return self.list()

    def stamp(self, name: str) -> FileStamp | None:
        """Object stores give no cheap identity of an object: never cached."""
        return None

    def list(self) -> list[str]:
        """The names under this folder as the store holds them now: fsspec's listing cache is dropped
        first, so checkpoints other processes wrote (or removed) since this process last listed are
        seen (retention, "latest", leases all decide from this listing)."""
        self.fs.invalidate_cache(self.root)
        try:
            entries: Any = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def modified(self, name: str) -> float | None:
        """When the object was last written (seconds since the epoch); None if the store cannot say."""
        try:
            info = self.fs.info(self.key(name))
        except FileNotFoundError:
            return None
        for field in ("LastModified", "mtime", "last_modified", "updated", "created"):
            stamp = info.get(field)
            if hasattr(stamp, "timestamp"):
                return float(stamp.timestamp())
            if isinstance(stamp, (int, float)):
                return float(stamp)
        try:
            return float(self.fs.modified(self.key(name)).timestamp())
        except (NotImplementedError, AttributeError, FileNotFoundError):
            return None

    def remove(self, names: Iterable[str]) -> None:
        """Delete the objects ``names`` (one request for all of them)."""
        keys = [self.key(n) for n in names]
        if keys:
            self.fs.rm(keys)
