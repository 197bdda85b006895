"""Which boxes of a global tensor a rank's local tensor covers, for any DTensor placement.

A DTensor's placements are applied left to right over the mesh dims, each one to the local tensor
the previous ones left (``Shard(d)``: ``torch.chunk`` along ``d`` over the mesh dim's size, the
rank keeping the piece of its coordinate; ``_StridedShard(d, sf)``: first ``torch.chunk`` into
``sf`` pieces, each of those into the mesh dim's size, the rank keeping its piece of every one,
concatenated; ``Replicate``: nothing). FSDP2 over tensor parallel yields ``_StridedShard``; its
local tensor is then not one box of the global tensor but several.

Every tensor dim is split independently, so the local tensor is the product over dims of an
ordered set of global indices. Each set is kept as a list of runs (global start, length) and
never as a list of indices: a dim of a million rows split over 16,384 ranks costs a few runs. The
local tensor's boxes are the products of one run per dim (:func:`local_boxes`).

This module is pure (no torch, no process group): ``state/base.py`` turns a DTensor into the
:class:`DimSplit` steps below; hypothesis tests check that the boxes of every coordinate tile the
tensor exactly once per replica, and agree with torch's own split functions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

from shardsafe.errors import FormatError

MAX_BOXES = 4096  # boxes of one local tensor; real layouts have 1 (Shard) to a few (strided), never thousands


@dataclass(frozen=True)
class DimSplit:
    """One placement's effect on one tensor dim: split into ``parts`` (the mesh dim's size), keep
    the piece of ``coordinate``; ``split_factor`` > 1 for ``_StridedShard`` (1 for ``Shard``)."""

    parts: int
    coordinate: int
    split_factor: int = 1


@dataclass(frozen=True)
class Run:
    """``length`` consecutive global indices from ``start``, found at ``local_start`` locally."""

    start: int
    length: int
    local_start: int


@dataclass(frozen=True)
class LocalBox:
    """A box of the global tensor (``offsets``, ``shape``) held at ``local_offsets`` of the local tensor."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    local_offsets: tuple[int, ...]


Runs = tuple[tuple[int, int], ...]  # (global start, length), in local order


def _take(runs: Runs, begin: int, end: int) -> Runs:
    """Positions [begin, end) of the index sequence ``runs`` describes, as runs."""
    out: list[tuple[int, int]] = []
    position = 0
    for start, length in runs:
        lo, hi = max(begin, position), min(end, position + length)
        if lo < hi:
            out.append((start + lo - position, hi - lo))
        position += length
        if position >= end:
            break
    return tuple(out)


def _chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """[begin, end) of piece ``index`` of ``torch.chunk(length, parts)`` (empty past the end)."""
    size = -(-length // parts) if length else 0
    return min(index * size, length), min((index + 1) * size, length)


def _merge(runs: list[tuple[int, int]]) -> Runs:
    out: list[tuple[int, int]] = []
    for start, length in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        elif length:
            out.append((start, length))
    return tuple(out)


def _apply(runs: Runs, step: DimSplit) -> Runs:
    length = sum(n for _, n in runs)
    kept: list[tuple[int, int]] = []
    for piece in range(step.split_factor):
        begin, end = _chunk_bounds(length, step.split_factor, piece)
        lo, hi = _chunk_bounds(end - begin, step.parts, step.coordinate)
        kept += _take(runs, begin + lo, begin + hi)
    return _merge(kept)


@lru_cache(maxsize=4096)
def dim_runs(size: int, steps: tuple[DimSplit, ...]) -> tuple[Run, ...]:
    """The global indices of one tensor dim of ``size`` that the local tensor holds, after ``steps``
    (in mesh-dim order), as runs in local order. Cached: every tensor of a layer shares them."""
    runs: Runs = ((0, size),) if size else ()
    for step in steps:
        if step.parts < 1 or not 0 <= step.coordinate < step.parts or step.split_factor < 1:
            raise FormatError(f"invalid split {step} of a dim of size {size}")
        runs = _apply(runs, step)
    out, local = [], 0
    for start, length in runs:
        out.append(Run(start, length, local))
        local += length
    return tuple(out)


def local_boxes(global_shape: tuple[int, ...], steps_per_dim: tuple[tuple[DimSplit, ...], ...]) -> list[LocalBox]:
    """The boxes of the global tensor the local tensor holds (products of one run per dim), in
    local row-major order. A local tensor with no elements has no boxes; a scalar has one."""
    if len(steps_per_dim) != len(global_shape):
        raise FormatError(f"{len(steps_per_dim)} dims of splits for a tensor of shape {list(global_shape)}")
    per_dim = [dim_runs(size, steps) for size, steps in zip(global_shape, steps_per_dim)]
    count = 1
    for runs in per_dim:
        count *= len(runs)
    if count > MAX_BOXES:
        raise FormatError(
            f"a local tensor of shape {list(global_shape)} would cover {count} separate boxes (at most {MAX_BOXES})"
        )
    return [
        LocalBox(tuple(r.start for r in combo), tuple(r.length for r in combo), tuple(r.local_start for r in combo))
        for combo in itertools.product(*per_dim)
    ]


def local_shape(global_shape: tuple[int, ...], steps_per_dim: tuple[tuple[DimSplit, ...], ...]) -> tuple[int, ...]:
    """The shape of the local tensor these splits leave."""
    return tuple(sum(r.length for r in dim_runs(size, steps)) for size, steps in zip(global_shape, steps_per_dim))


__all__ = ["MAX_BOXES", "DimSplit", "LocalBox", "Run", "dim_runs", "local_boxes", "local_shape"]
