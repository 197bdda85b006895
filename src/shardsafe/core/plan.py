"""Who writes what on save, and which stored byte ranges each rank reads on load.

Save: every rank describes the chunks it holds (:class:`ChunkSpec`, tiny and picklable); the
coordinator sees all descriptions, checks they agree, gives every distinct chunk exactly one
writer (a replicated tensor is written once, by the least loaded rank holding it; small ones are
packed onto the first few ranks, :class:`SmallPacking`) and checks the chunks tile each tensor.
Load: each rank intersects the box it owns with the stored chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardsafe.core.dtypes import dtype_from_torch_text
from shardsafe.core.format import ChunkEntry, TensorEntry, box_overlap, element_size, numel
from shardsafe.core.rule import LayoutRule
from shardsafe.errors import FormatError, SaveError

__all__ = [
    "SMALL_CHUNK_BYTES",
    "SMALL_PER_WRITER",
    "ChunkSpec",
    "LocalChunk",
    "ReadOp",
    "SmallPacking",
    "assign_writers",
    "candidate_chunks",
    "contiguous_span",
    "plan_reads",
]

# A replicated chunk this small costs its readers more (one more file to open, one more index and
# header to parse on every rank that needs it) than its bytes cost a writer: such chunks are packed
# onto the first ranks, SMALL_PER_WRITER bytes each, instead of being spread by size. At 16 FSDP2
# ranks the AdamW step scalars alone, spread one per writer, made every rank open all 16 files.
SMALL_CHUNK_BYTES = 64 << 10
SMALL_PER_WRITER = 4 << 20


@dataclass(frozen=True)
class LocalChunk:
    """A piece of a (possibly sharded) tensor held by this rank."""

    key: str
    tensor: torch.Tensor  # this rank's data for the box below
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    per_rank: bool = False  # part of a per-rank value (RNG state): exists on this rank only
    rule: LayoutRule | None = None  # the DTensor's layout, when its mesh spans the job (core/rule.py)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def spec(self) -> ChunkSpec:
        return ChunkSpec(self.key, str(self.tensor.dtype), self.global_shape, self.offsets, self.shape)


@dataclass(frozen=True)
class ChunkSpec:
    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * element_size(dtype_from_torch_text(self.dtype))


class SmallPacking:
    """Where small replicated chunks go: to the lowest holder rank with room left under
    :data:`SMALL_PER_WRITER` (all full: the holder with the fewest small bytes). Deterministic in
    the order chunks are offered, so ranks that offer the same list agree."""

    def __init__(self, world_size: int) -> None:
        self.small_bytes = [0] * world_size

    def place(self, nbytes: int, holders: list[int]) -> int:
        """The writer of a small chunk of ``nbytes`` among ``holders`` (ascending ranks), recorded."""
        rank = next((r for r in holders if self.small_bytes[r] < SMALL_PER_WRITER), None)
        if rank is None:
            rank = min(holders, key=lambda r: (self.small_bytes[r], r))
        self.small_bytes[rank] += nbytes
        return rank


def assign_writers(specs_by_rank: list[list[ChunkSpec]], small: int = SMALL_CHUNK_BYTES) -> list[list[int]]:
    """For each rank, the indices of its chunks it must write: replicated chunks of at most ``small``
    bytes first, packed by :class:`SmallPacking` in (key, offsets, shape) order; then the rest,
    largest first, each to its least loaded holder. Raises SaveError on disagreement."""
    seen: dict[str, tuple[str, tuple[int, ...], int]] = {}
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] = {}
    for rank, specs in enumerate(specs_by_rank):
        for index, spec in enumerate(specs):
            first = seen.setdefault(spec.key, (spec.dtype, spec.global_shape, rank))
            if first[:2] != (spec.dtype, spec.global_shape):
                raise SaveError(
                    f"tensor {spec.key!r} is {first[0]} {list(first[1])} on rank {first[2]} but {spec.dtype} "
                    f"{list(spec.global_shape)} on rank {rank}"
                )
            holders.setdefault((spec.key, spec.offsets, spec.shape), []).append((rank, index))
    assignment: list[list[int]] = [[] for _ in specs_by_rank]

    def nbytes(owners: list[tuple[int, int]]) -> int:
        return specs_by_rank[owners[0][0]][owners[0][1]].nbytes

    def is_packed(owners: list[tuple[int, int]]) -> bool:
        return len(owners) > 1 and nbytes(owners) <= small

    packed = sorted((box, owners) for box, owners in holders.items() if is_packed(owners))
    packing = SmallPacking(len(specs_by_rank))
    for _, owners in packed:
        index_of = dict(owners)
        rank = packing.place(nbytes(owners), sorted(index_of))
        assignment[rank].append(index_of[rank])
    load = list(packing.small_bytes)
    rest = [owners for owners in holders.values() if not is_packed(owners)]
    for owners in sorted(rest, key=lambda o: -nbytes(o)):
        rank, index = min(owners, key=lambda ri: (load[ri[0]], ri[0]))
        assignment[rank].append(index)
        load[rank] += nbytes(owners)
    _check_tiling(specs_by_rank, assignment)
    for indices in assignment:
        indices.sort()
    return assignment


def _check_tiling(specs_by_rank: list[list[ChunkSpec]], assignment: list[list[int]]) -> None:
    volume: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, indices in enumerate(assignment):
        for i in indices:
            spec = specs_by_rank[rank][i]
            volume[spec.key] = volume.get(spec.key, 0) + numel(spec.shape)
            shapes[spec.key] = spec.global_shape
    for key, total in volume.items():
        if total != numel(shapes[key]):
            raise SaveError(
                f"tensor {key!r}: the ranks' chunks hold {total} elements but its shape {list(shapes[key])} "
                f"has {numel(shapes[key])}; chunks overlap or are missing (is a per-rank tensor saved under a shared "
                "name?)"
            )


@dataclass(frozen=True)
class ReadOp:
    """Copy the box (offsets, shape) from a stored chunk into the destination."""

    chunk: ChunkEntry
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


# (writer rank, box offsets) -> the box, from that rank's index
PartLookup = Callable[[int, tuple[int, ...]], ChunkEntry]


def candidate_chunks(
    entry: TensorEntry, dest_offsets: tuple[int, ...], dest_shape: tuple[int, ...], part: PartLookup | None
) -> list[ChunkEntry]:
    """The stored chunks that may overlap the box: all listed ones, or, for a layout rule, only the
    boxes of the parts that meet it (found without visiting the others, core/rule.py), each resolved
    by ``part`` (its writer's index) unless the manifest lists the box itself (dedup)."""
    rule = entry.rule
    if rule is None:
        return list(entry.chunks)
    if part is None:
        raise FormatError("a tensor described by a layout rule needs the per-rank indexes to be read")
    out = []
    for p in rule.parts_overlapping(entry.shape, dest_offsets, dest_shape):
        for box in rule.boxes(entry.shape, p):
            if box_overlap(box.offsets, box.shape, dest_offsets, dest_shape) is not None:
                out.append(entry.overrides.get(box.offsets) or part(rule.writer_of(p), box.offsets))
    return out


def plan_reads(
    entry: TensorEntry, dest_offsets: tuple[int, ...], dest_shape: tuple[int, ...], part: PartLookup | None = None
) -> list[ReadOp]:
    """The stored pieces overlapping the box this rank owns, in file order."""
    ops = []
    if numel(dest_shape) == 0:
        return []
    for chunk in candidate_chunks(entry, dest_offsets, dest_shape, part):
        hit = box_overlap(chunk.offsets, chunk.shape, dest_offsets, dest_shape)
        if hit is not None:
            ops.append(ReadOp(chunk, hit[0], hit[1]))
    ops.sort(key=lambda op: (op.chunk.checkpoint or "", op.chunk.file, op.chunk.begin))
    return ops


def contiguous_span(
    box_offsets: tuple[int, ...], box_shape: tuple[int, ...], base_offsets: tuple[int, ...], base_shape: tuple[int, ...]
) -> tuple[int, int] | None:
    """Element range [start, stop) of ``box`` inside a row-major ``base`` block, if contiguous.

    A box is contiguous when every dimension after the last partial one is full and every
    dimension before it has extent 1; Shard(0) pieces of a row-major tensor always are.
    """
    ndim = len(base_shape)
    if ndim == 0:
        return (0, 1)
    local = [o - b for o, b in zip(box_offsets, base_offsets)]
    partial = [d for d in range(ndim) if box_shape[d] != base_shape[d]]
    if partial and any(box_shape[d] != 1 for d in range(partial[-1])):
        return None
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * base_shape[d + 1]
    start = sum(l * s for l, s in zip(local, strides))
    return start, start + numel(box_shape)
