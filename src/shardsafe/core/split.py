"""The split rule of format version 2: a regular dim-0 split described by three integers.

A tensor split on dim 0 the way ``torch.chunk`` / FSDP2 ``Shard(0)`` / DeepSpeed ZeRO-3 flat
partitions split it is fully described by ``(dim 0, parts W, size R)``: part p holds indices
``[p*R, min((p+1)*R, N))`` and is written by rank p; parts past the end hold nothing. A rank that
owns rows ``[a, b)`` finds the parts it needs in O(1): ``a//R .. (b-1)//R``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SplitRule:
    """Part p of dim ``dim`` holds ``[p*size, min((p+1)*size, N))``; written by rank ``p``."""

    dim: int
    parts: int
    size: int

    def bounds(self, part: int, length: int) -> tuple[int, int]:
        """[start, stop) of ``part`` along the split dimension (empty, at the end, past the end)."""
        return min(part * self.size, length), min((part + 1) * self.size, length)

    def box(self, part: int, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, shape) of ``part`` in a tensor of global ``shape``."""
        start, stop = self.bounds(part, shape[0])
        return (start, *([0] * (len(shape) - 1))), (stop - start, *shape[1:])

    def parts_between(self, start: int, stop: int) -> range:
        """The parts that hold any of the indices [start, stop) of the split dimension."""
        if stop <= start:
            return range(0)
        return range(start // self.size, min(self.parts, -(-stop // self.size)))

    def nonempty_parts(self, length: int) -> range:
        return range(min(self.parts, -(-length // self.size)))

    def to_json(self) -> dict[str, int]:
        return {"dim": self.dim, "parts": self.parts, "size": self.size}
