"""Verified reads into CUDA tensors: file bytes land in pinned host buffers, are hashed there, then copied up.

:meth:`ChunkReader.read_into <shardsafe.protocol.transfer.ChunkReader.read_into>` sends every
box whose destination is a CUDA tensor here. The box is read piece by piece into the process's
pinned buffers (:mod:`shardsafe.storage.pinned`); each piece's hash blocks are checked on the host
before it is copied to the device (so bytes that fail verification never reach the GPU), and the
copy runs on the side stream while the next piece is read (:class:`~shardsafe.storage.device_copy.HostToDevice`).

- A box that is one contiguous byte range in both the stored chunk and the destination, in the
  saved dtype, is copied byte for byte, cut at hash-block boundaries (each block read once).
- Any other box (a slice along an inner dimension, a dtype cast with ``strict=False``) is read
  as groups of whole dim-0 rows of the chunk; each group goes up as a contiguous temporary and the
  narrowing and the cast run on the device.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch

from shardsafe.core.format import ChunkEntry, element_size, numel
from shardsafe.core.plan import ReadOp, contiguous_span
from shardsafe.errors import FormatError
from shardsafe.storage.device_copy import HostToDevice, host_view
from shardsafe.storage.pinned import PinnedPool, split_range

__all__ = ["read_into_cuda"]


class ElementReader(Protocol):
    """What this needs of a reader: verified reads of a stored chunk's elements into host memory."""

    block: int

    def read_elements(
        self, key: str, chunk: ChunkEntry, dtype: torch.dtype, start: int, stop: int, dest: memoryview
    ) -> None: ...


def read_into_cuda(
    reader: ElementReader,
    key: str,
    op: ReadOp,
    saved_dtype: torch.dtype,
    dest: torch.Tensor,
    dest_offsets: tuple[int, ...],
    pool: PinnedPool | None = None,
) -> None:
    """Copy the box of ``op`` into CUDA tensor ``dest`` (which holds the box at ``dest_offsets``).

    ``pool``: the process's pinned pool unless given (the CPU unit tests pass an unpinned one).
    """
    chunk = op.chunk
    src = contiguous_span(op.offsets, op.shape, chunk.offsets, chunk.shape)
    dst = contiguous_span(op.offsets, op.shape, dest_offsets, tuple(dest.shape))
    with HostToDevice(dest.device, pool) as up:
        if src is not None and dst is not None and dest.is_contiguous() and dest.dtype == saved_dtype:
            _read_span(reader, up, key, chunk, saved_dtype, src, dst[0], dest)
        else:
            _read_rows(reader, up, key, op, saved_dtype, dest, dest_offsets)


def _read_span(
    reader: ElementReader,
    up: HostToDevice,
    key: str,
    chunk: ChunkEntry,
    dtype: torch.dtype,
    src: tuple[int, int],
    dst_start: int,
    dest: torch.Tensor,
) -> None:
    """Elements [src) of the chunk into elements from ``dst_start`` of contiguous ``dest``, byte for byte."""
    es = element_size(dtype)
    dest_bytes = dest.detach().reshape(-1).view(torch.uint8)
    align = reader.block // es if reader.block % es == 0 else 1
    for a, b in split_range(src[0], src[1], up.piece_bytes // es, align):
        host = up.host((b - a) * es)
        reader.read_elements(key, chunk, dtype, a, b, host_view(host))
        at = (dst_start + a - src[0]) * es
        up.upload(host, dest=dest_bytes[at : at + (b - a) * es])


def _read_rows(
    reader: ElementReader,
    up: HostToDevice,
    key: str,
    op: ReadOp,
    dtype: torch.dtype,
    dest: torch.Tensor,
    dest_offsets: tuple[int, ...],
) -> None:
    """The box as groups of whole dim-0 rows of the chunk, narrowed and cast on the device."""
    chunk = op.chunk
    if not chunk.shape:
        raise FormatError(f"tensor {key!r}: scalar chunk cannot be partially read")
    row_shape = chunk.shape[1:]
    row_elems = numel(row_shape)
    row_bytes = row_elems * element_size(dtype)
    row0 = op.offsets[0] - chunk.offsets[0]
    rows = op.shape[0]
    if rows == 0 or row_elems == 0:
        return
    per = max(1, up.piece_bytes // row_bytes)  # a row larger than a buffer goes through a temporary host buffer
    for r, r_end in split_range(0, rows, per):
        n = r_end - r
        host = up.host(n * row_bytes)
        first = (row0 + r) * row_elems
        reader.read_elements(key, chunk, dtype, first, first + n * row_elems, host_view(host))
        target = dest.detach().narrow(0, op.offsets[0] - dest_offsets[0] + r, n)
        for d in range(1, len(op.shape)):
            target = target.narrow(d, op.offsets[d] - dest_offsets[d], op.shape[d])
        up.upload(host.view(dtype).view(n, *row_shape), place=partial(_place_box, op, chunk, target))


def _place_box(op: ReadOp, chunk: ChunkEntry, target: torch.Tensor, rows: torch.Tensor) -> None:
    """Put an uploaded group of rows where it belongs: narrowed to the box's inner ranges, cast by the copy."""
    box = rows
    for d in range(1, len(op.shape)):
        box = box.narrow(d, op.offsets[d] - chunk.offsets[d], op.shape[d])
    target.copy_(box)
