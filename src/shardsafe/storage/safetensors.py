"""The one streaming safetensors writer: header first, then each tensor's bytes, hashed as they pass.

Every safetensors-layout file shardsafe writes goes through :class:`SafetensorsWriter`: a rank's
shard file on a local disk, the same on an object store (a multipart upload), and the weights
files of a Hugging Face model folder. All shapes are known up front, so the header is written
first and every tensor streams straight after it; memory stays bounded by one staging piece for
device tensors. Where the bytes go is a small sink: a local file created with ``O_EXCL`` (with
write-behind, so the final fsync has little left to do) or an fsspec file object.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from shardsafe.core.faults import crash_point
from shardsafe.core.integrity import BlockHasher
from shardsafe.core.safetensors_header import header_sizes
from shardsafe.storage.local import WRITE_BEHIND_WINDOW, WriteBehind, create_or_recycle, tensor_pieces

__all__ = ["LocalSink", "SafetensorsWriter", "write_tensor_file", "write_tensor_stream"]


class Sink(Protocol):
    """Where a stream of bytes lands."""

    def write(self, view: memoryview) -> None: ...

    def finish(self, fsync: bool) -> None: ...

    def abort(self) -> None: ...


class LocalSink:
    """A new local file (``O_EXCL``: one writer per file by construction, so an existing file is a
    bug), or a ``recycled`` one written over and truncated to what was written
    (:func:`~shardsafe.storage.local.create_or_recycle`)."""

    def __init__(self, path: Path, write_behind: bool = True, recycled: Path | None = None) -> None:
        self.path = path
        fd, self.recycled = create_or_recycle(path, recycled)
        self.fd: int | None = fd
        self.behind = WriteBehind(self.fd, write_behind)
        self.written = 0

    def write(self, view: memoryview) -> None:
        assert self.fd is not None
        for start in range(0, len(view), WRITE_BEHIND_WINDOW):
            part = view[start : start + WRITE_BEHIND_WINDOW]
            while len(part):
                n = os.write(self.fd, part[: 1 << 30])
                part = part[n:]
                self.written += n
            self.behind.advance(self.written)

    def finish(self, fsync: bool) -> None:
        if self.fd is None:
            return
        try:
            if self.recycled:  # an older, longer file's tail
                os.ftruncate(self.fd, self.written)
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class StreamSink:
    """An open binary file object, e.g. ``fsspec`` ``open(key, "wb")`` (a multipart upload on S3)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, view: memoryview) -> None:
        self.stream.write(view)

    def finish(self, fsync: bool) -> None:
        self.stream.close()  # an object store commits the object on close; there is nothing to fsync

    def abort(self) -> None:
        discard = getattr(self.stream, "discard", None)
        if callable(discard):
            discard()  # an fsspec buffered upload: abort the multipart upload, no partial object
        else:
            self.stream.close()


class SafetensorsWriter:
    """One safetensors-layout file: ``prefix`` (8-byte length + JSON header) first, then tensors in header order.

    ``sizes`` are the byte sizes the header promises for each tensor; :meth:`write` refuses a tensor
    of another size and :meth:`close` refuses to finish a file with tensors missing. With
    ``block_size``, each tensor's bytes are hashed per block while they are written
    (:meth:`write` returns the digests), so nothing is read back to hash it.
    """

    def __init__(
        self, sink: Sink, prefix: bytes, sizes: list[int], *, block_size: int | None = None, where: str = ""
    ) -> None:
        self.sink = sink
        self.sizes = sizes
        self.block_size = block_size
        self.where = where
        self.size = len(prefix) + sum(sizes)
        self.count = 0
        self.written = 0
        self._put(memoryview(prefix))

    def _put(self, view: memoryview) -> None:
        self.sink.write(view)
        self.written += len(view)

    def write(self, tensor: torch.Tensor) -> list[str]:
        """Stream the next tensor; returns its block digests (empty without ``block_size``)."""
        if self.count >= len(self.sizes):
            raise ValueError(f"{self.where}: more tensors written than its header lists")
        expected = self.sizes[self.count]
        actual = tensor.numel() * tensor.element_size()
        if actual != expected:
            raise ValueError(f"{self.where}: tensor {self.count} has {actual} bytes, the header says {expected}")
        hasher = BlockHasher(self.block_size) if self.block_size else None
        for piece in tensor_pieces(tensor):
            if hasher is not None:
                hasher.update(piece)
            self._put(piece)
        self.count += 1
        return hasher.finish() if hasher is not None else []

    def close(self, fsync: bool = True) -> int:
        """Finish the file (fsync it where that applies); returns its size."""
        if self.count != len(self.sizes) or self.written != self.size:
            self.sink.abort()
            raise ValueError(
                f"{self.where}: {self.count} of {len(self.sizes)} tensors written ({self.written} of {self.size} bytes)"
            )
        self.sink.finish(fsync)
        return self.size

    def abort(self) -> None:
        self.sink.abort()


def write_tensor_file(
    path: Path,
    prefix: bytes,
    tensors: Iterable[torch.Tensor],
    block_size: int,
    fsync: bool = True,
    rank: int = 0,
    recycled: Path | None = None,
) -> tuple[int, list[list[str]]]:
    """A rank's shard file: ``prefix`` then each tensor's bytes into a new local file, hashed while written.

    ``tensors`` is iterated once, in header order (a converter computes each only when it is
    reached); the sizes come from ``prefix``. Returns the file size and, per tensor, its block
    digests. With ``fsync`` the data is also pushed to the disk while writing (write-behind).
    ``recycled``: a retired file to write over instead of a new one (:class:`LocalSink`).
    """
    sizes = header_sizes(prefix)
    try:
        writer = SafetensorsWriter(
            LocalSink(path, fsync, recycled), prefix, sizes, block_size=block_size, where=str(path)
        )
        digests = []
        try:
            for tensor in tensors:
                digests.append(writer.write(tensor))
                if len(digests) == len(sizes) // 2 + 1:
                    crash_point("save:mid-write", rank)
            crash_point("save:before-fsync", rank)
            return writer.close(fsync), digests
        except BaseException:
            writer.abort()
            raise
    except OSError as exc:  # os.write / fsync errors carry no file name; the user needs it (ENOSPC, EIO)
        raise OSError(exc.errno, f"{exc.strerror or exc} while writing {path}") from exc


def write_tensor_stream(
    stream: Any, prefix: bytes, tensors: Iterable[torch.Tensor], block_size: int, where: str
) -> tuple[int, list[list[str]]]:
    """The same into an open binary stream (an object-store upload); ``tensors`` iterated once; returns size and
    digests."""
    writer = SafetensorsWriter(StreamSink(stream), prefix, header_sizes(prefix), block_size=block_size, where=where)
    try:
        digests = [writer.write(tensor) for tensor in tensors]
        return writer.close(), digests
    except BaseException:
        writer.abort()
        raise
