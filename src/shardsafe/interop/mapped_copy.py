"""How bytes leave a memory-mapped checkpoint file: copied out piece by piece, each piece then unmapped.

A DeepSpeed consolidation reads every rank's slice of every tensor; left mapped, those pages would
keep the process's resident memory at the size of the checkpoint. :func:`copy_out` copies a slice
into its destination one :data:`COPY_PIECE` at a time with ``memmove`` and tells the kernel
(``madvise(MADV_DONTNEED)``) it may drop the pages just read: they are file-backed and never written,
so touching them again reads them back from the file.

Both calls take raw addresses, so both are made only for a source whose whole byte range lies inside
a :class:`FileMapping` the restricted loader made, on the CPU, contiguous, with the destination's dtype
and element count; anything else (a tensor of another origin, a meta or device tensor) is copied by
torch's own ``copy_`` or refused. ``MADV_DONTNEED`` on memory that is not a file mapping would zero
it: that is why the range check comes before the advice, not after.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from shardsafe.errors import FormatError
from shardsafe.storage.local import MADV_DONTNEED, PAGE, madvise_pages

__all__ = ["FileMapping", "copy_out"]

COPY_PIECE = 8 << 20  # bytes copied out of a memory-mapped file (then unmapped) at a time


@dataclass(frozen=True)
class FileMapping:
    """The address range ``[base, base + size)`` where one file is mapped (private, read, never written)."""

    where: str
    base: int
    size: int

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a contiguous CPU tensor whose bytes lie wholly inside this mapping."""
        if (
            tensor.device.type != "cpu"
            or tensor.is_meta
            or not tensor.is_contiguous()
            or tensor.layout != torch.strided
        ):
            return False
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        return self.base <= start and start + nbytes <= self.base + self.size


def copy_out(dest: torch.Tensor, src: torch.Tensor, mapping: FileMapping | None, where: str) -> None:
    """``dest.copy_(src)`` for two 1-D slices of the same length; from inside ``mapping``, by pieces, unmapping each
    after copying.

    Pieces end on page boundaries, so each piece's pages are unmapped whole and at most one piece
    of the file is mapped at a time (not the whole slice). The bytes are copied by one ``memmove``
    per piece rather than by torch's parallel ``copy_``, whose threads fault on the same file pages
    together: several times slower on a cold page cache (measured with 2 threads).
    """
    for tensor in (dest, src):
        if tensor.device.type != "cpu" or tensor.is_meta or tensor.layout != torch.strided:
            kind = tensor.device.type if tensor.layout == torch.strided else f"{tensor.device.type} ({tensor.layout})"
            raise FormatError(f"{where}: a tensor on {kind}; only CPU tensors with their bytes in the file are read")
    if dest.numel() != src.numel():
        raise FormatError(f"{where}: a slice of {src.numel()} elements where {dest.numel()} are needed")
    if mapping is None or not mapping.holds(src) or dest.dtype != src.dtype or not dest.is_contiguous():
        dest.copy_(src.reshape(dest.shape))
        if mapping is not None and mapping.holds(src):
            drop_pages(src, mapping)
        return
    nbytes = src.numel() * src.element_size()
    begin, target = src.data_ptr(), dest.data_ptr()
    pos = 0
    while pos < nbytes:
        end = min(nbytes, (begin + pos + COPY_PIECE) // PAGE * PAGE - begin)
        ctypes.memmove(target + pos, begin + pos, end - pos)
        _drop_range(begin + pos, begin + end)
        pos = end


def drop_pages(view: torch.Tensor, mapping: FileMapping) -> None:
    """Unmap the resident pages wholly inside ``view``, a slice of ``mapping`` that nobody writes (nothing for other
    tensors)."""
    if view.numel() and mapping.holds(view):
        _drop_range(view.data_ptr(), view.data_ptr() + view.numel() * view.element_size())


def _drop_range(start: int, end: int) -> None:
    """Unmap the resident pages wholly inside the mapped addresses [start, end); callers checked the range is a file
    mapping."""
    madvise_pages(start, end, MADV_DONTNEED)  # advice only: a failure changes nothing
