"""Layout rules: where a tensor's stored parts lie, described by a mesh and placements, not listed.

Format version 2 knew one regular layout, dim 0 split over the world the way ``torch.chunk``
splits it (``"split": {"dim": 0, "parts": W, "size": R}``). Version 3 describes any DTensor layout
on a mesh whose ranks are numbered row-major and span the world (``init_device_mesh``'s numbering)::

    "layout": {"mesh": [2, 2], "placements": [["strided", 0, 2], ["shard", 0]], "writer": 0}

A placement is ``["shard", d]`` (``Shard(d)``), ``["strided", d, sf]`` (``_StridedShard(d, sf)``:
FSDP2 over tensor parallel), ``["replicate"]`` or (version 4) ``["at", k]``, one per mesh dim,
applied left to right as core/boxes.py says. ``["at", k]`` says only the ranks whose coordinate on
that mesh dim is ``k`` hold the tensor: a pipeline stage's tensors, parallelised on the stage's
slice ``world_mesh["dp_shard", "tp"]`` of a ``(pp, dp_shard, tp)`` mesh, are ``at`` the stage on
``pp``. A rank cannot see that alone (its slice looks like a TP-replicated norm's, which every
coordinate of the dropped dim holds): it describes ``Replicate`` there, and the save's merge of the
ranks' descriptions (:meth:`LayoutRule.held_by`, core/layout.stage_rules) makes it ``at`` from the
set of ranks that hold the tensor. The version 2 rule is the special case ``mesh [W], [["shard", 0]]``.

Words used below:

* a **part** is what one coordinate on the *sharding* mesh dims holds (ranks that differ only on
  ``Replicate`` dims hold the same bytes). Parts are numbered row-major over the sharding dims.
  A part is one box of the tensor, or several (``_StridedShard``), or nothing (past the end of an
  uneven split);
* a rank **holds** the tensor when its coordinate on every ``at`` dim is that dim's ``k`` (every
  rank, without ``at`` dims); ``at`` dims are neither sharding nor replicate dims, and the ranks
  at other coordinates hold nothing of the tensor and read nothing for it;
* a part's **writer** is one of its replicas among the holders: the one whose number on the
  replicate dims is ``(part + writer) mod replicas``; the save picks ``writer`` per tensor to spread the writes
  (:func:`spread_writers`). The writer's per-rank index (core/index.py) says where the part's
  boxes lie in its shard file.

Everything a reader needs follows from the rule and the shape, in time independent of the world
size for the parts one rank reads (:meth:`LayoutRule.parts_overlapping` works one tensor dim at a
time). This module is pure: no torch, no process group.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any

from shardsafe.core.boxes import MAX_BOXES, DimSplit, LocalBox, Run, dim_runs, local_boxes
from shardsafe.errors import FormatError

# ranks a rule may span: far beyond any job, and a bound on the work a hostile rule can ask for
MAX_WORLD_SIZE = 1 << 20
MAX_MESH_DIMS = 8


@dataclass(frozen=True)
class Placement:
    """One mesh dim's placement: shard tensor dim ``dim`` into ``split_factor`` strided pieces first
    (1: a plain ``Shard``); ``dim`` None: replicate, or, with ``at`` set, held only by the ranks whose
    coordinate on this mesh dim is ``at`` (a pipeline stage's tensors: neither shard nor replica)."""

    dim: int | None
    split_factor: int = 1
    at: int | None = None

    def to_json(self) -> list[Any]:
        if self.at is not None:
            return ["at", self.at]
        if self.dim is None:
            return ["replicate"]
        if self.split_factor == 1:
            return ["shard", self.dim]
        return ["strided", self.dim, self.split_factor]

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Placement:
        if isinstance(raw, list) and raw == ["replicate"]:
            return cls(None)
        if isinstance(raw, list) and len(raw) == 2 and raw[0] == "shard" and _is_int(raw[1]):
            return cls(raw[1])
        if isinstance(raw, list) and len(raw) == 3 and raw[0] == "strided" and _is_int(raw[1]) and _is_int(raw[2]):
            return cls(raw[1], raw[2])
        if isinstance(raw, list) and len(raw) == 2 and raw[0] == "at" and _is_int(raw[1]):
            return cls(None, at=raw[1])
        raise FormatError(
            f'{where}: placement {raw!r:.80} is not ["shard", d], ["strided", d, factor], ["replicate"] or ["at", k]'
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unravel(index: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(sizes):
        index, r = divmod(index, size)
        out.append(r)
    return tuple(reversed(out))


def _ravel(coordinate: Iterable[int], sizes: Iterable[int]) -> int:
    index = 0
    for c, size in zip(coordinate, sizes):
        index = index * size + c
    return index


@dataclass(frozen=True)
class LayoutRule:
    """A tensor laid out by ``placements`` over a row-major mesh of shape ``mesh`` (see the module doc)."""

    mesh: tuple[int, ...]
    placements: tuple[Placement, ...]
    writer: int = 0

    @classmethod
    def split(cls, world_size: int) -> LayoutRule:
        """Format version 2's rule: dim 0 split over the world, part p written by rank p."""
        return cls((world_size,), (Placement(0),))

    # --------------------------------------------------------------- the mesh

    @cached_property
    def world_size(self) -> int:
        return math.prod(self.mesh)

    @cached_property
    def shard_dims(self) -> tuple[int, ...]:
        """The mesh dims that shard (their coordinates number the parts)."""
        return tuple(i for i, p in enumerate(self.placements) if p.dim is not None)

    @cached_property
    def replica_dims(self) -> tuple[int, ...]:
        """The mesh dims whose every coordinate holds the same bytes (``Replicate``)."""
        return tuple(i for i, p in enumerate(self.placements) if p.dim is None and p.at is None)

    @cached_property
    def at_dims(self) -> tuple[int, ...]:
        """The mesh dims on which only one coordinate holds the tensor (``["at", k]``)."""
        return tuple(i for i, p in enumerate(self.placements) if p.at is not None)

    @cached_property
    def _at_offset(self) -> int:
        """The rank-number contribution of the ``at`` coordinates (every holder's share)."""
        return sum((self.placements[i].at or 0) * self._strides[i] for i in self.at_dims)

    @cached_property
    def parts(self) -> int:
        return math.prod(self.mesh[i] for i in self.shard_dims)

    @cached_property
    def replicas(self) -> int:
        return math.prod(self.mesh[i] for i in self.replica_dims)

    @property
    def is_v2_split(self) -> bool:
        """Whether format version 2's ``split`` field says the same (it is written that way)."""
        return len(self.mesh) == 1 and self.placements == (Placement(0),) and self.writer == 0

    @cached_property
    def _strides(self) -> tuple[int, ...]:
        """Row-major strides of the mesh (rank = sum of coordinate x stride)."""
        return tuple(math.prod(self.mesh[i + 1 :]) for i in range(len(self.mesh)))

    @cached_property
    def _numbering(self) -> tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...]]:
        """(mesh size, rank stride, part or replica stride) of the sharding dims and of the replicate dims."""

        def of(dims: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
            sizes = [self.mesh[i] for i in dims]
            return tuple((self.mesh[i], self._strides[i], math.prod(sizes[k + 1 :])) for k, i in enumerate(dims))

        return of(self.shard_dims), of(self.replica_dims)

    def part_of(self, rank: int) -> int:
        """The part rank ``rank`` holds."""
        return sum((rank // stride) % size * inner for size, stride, inner in self._numbering[0])

    def holds(self, rank: int) -> bool:
        """Whether rank ``rank`` holds the tensor at all: its coordinate on every ``at`` dim is that dim's."""
        return all((rank // self._strides[i]) % self.mesh[i] == self.placements[i].at for i in self.at_dims)

    def writer_of(self, part: int) -> int:
        """The rank that writes ``part`` (always one that holds it)."""
        shard, replica = self._numbering
        replica_number = (part + self.writer) % self.replicas
        rank = self._at_offset + sum((part // inner) % size * stride for size, stride, inner in shard)
        return rank + sum((replica_number // inner) % size * stride for size, stride, inner in replica)

    def writes(self, rank: int) -> bool:
        """Whether ``rank`` writes its part (never a rank that does not hold the tensor)."""
        return self.writer_of(self.part_of(rank)) == rank

    def held_by(self, ranks: Iterable[int]) -> LayoutRule | None:
        """This rule (``Replicate`` where a rank's own mesh lacks a dim of the mesh it is a slice of)
        made exact for the ranks that really hold the tensor: a replicate dim on which the holders
        take one coordinate k becomes ``["at", k]`` (a pipeline stage's slice of the world mesh);
        None when the holders are not every coordinate of the sharding dims times, per replicate
        dim, all coordinates or one (the tensor's chunks are then listed). Cost: O(holders x dims)."""
        held = set(ranks)
        seen: list[set[int]] = [set() for _ in self.mesh]
        for rank in held:
            if not 0 <= rank < self.world_size:
                return None
            for i, size in enumerate(self.mesh):
                seen[i].add((rank // self._strides[i]) % size)
        placements = list(self.placements)
        for i, coordinates in enumerate(seen):
            full = len(coordinates) == self.mesh[i]
            if i in self.replica_dims and not full:
                if len(coordinates) != 1:
                    return None
                placements[i] = Placement(None, at=next(iter(coordinates)))
            elif i in self.at_dims and coordinates != {placements[i].at}:
                return None
            elif i in self.shard_dims and not full:
                return None
        exact = LayoutRule(self.mesh, tuple(placements))
        if len(held) != math.prod(n for i, n in enumerate(self.mesh) if i not in exact.at_dims):
            return None
        return _interned(exact.mesh, exact.placements, self.writer % exact.replicas)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its three fields (never the answers it remembers), interned again on arrival."""
        return _interned, (self.mesh, self.placements, self.writer)

    # --------------------------------------------------------------- the tensor

    def _acting(self, dim: int) -> tuple[int, ...]:
        """The mesh dims that split tensor dim ``dim``, in mesh order."""
        return tuple(i for i in self.shard_dims if self.placements[i].dim == dim)

    @cached_property
    def _memo(self) -> dict[tuple[object, ...], object]:
        """Answers already computed for this rule (rules are interned when parsed, so a manifest's
        tensors of one layout share them; keys are plain tuples of ints, cheap to hash)."""
        return {}

    def boxes(self, shape: tuple[int, ...], part: int) -> list[LocalBox]:
        """The non-empty boxes of ``part`` (in the local tensor's row-major order)."""
        key = ("boxes", shape, part)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = _part_boxes(self.mesh, self.placements, shape, part)
        return list(found)  # type: ignore[call-overload]

    def box_shapes(self, shape: tuple[int, ...], part: int) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Offsets -> shape of the boxes of ``part`` (shared: read only)."""
        key = ("shapes", shape, part)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = {b.offsets: b.shape for b in self.boxes(shape, part)}
        return found  # type: ignore[return-value]

    def parts_overlapping(
        self, shape: tuple[int, ...], offsets: tuple[int, ...], box_shape: tuple[int, ...]
    ) -> list[int]:
        """The parts holding any element of the box (``offsets``, ``box_shape``), without visiting
        the others: per tensor dim, the coordinates of the mesh dims splitting it whose indices meet
        the box's range; the parts are their products. Small answers are remembered: a load asks
        the same question for every layer of a model (same shape, same rule, same box)."""
        key = ("overlap", shape, offsets, box_shape)
        found = self._memo.get(key)
        if found is None:
            found = tuple(self._find_overlapping(shape, offsets, box_shape))
            if len(found) <= 64 and len(self._memo) < 1 << 14:  # small answers only: a whole-tensor query is asked once
                self._memo[key] = found
        return list(found)  # type: ignore[call-overload]

    def _find_overlapping(
        self, shape: tuple[int, ...], offsets: tuple[int, ...], box_shape: tuple[int, ...]
    ) -> list[int]:
        if not all(box_shape):
            return []
        per_dim: list[list[tuple[int, ...]]] = []
        for d, size in enumerate(shape):
            acting = self._acting(d)
            sizes, factors = tuple(self.mesh[i] for i in acting), tuple(self.placements[i].split_factor for i in acting)
            per_dim.append(_coordinates_meeting(size, sizes, factors, offsets[d], offsets[d] + box_shape[d]))
        shard_sizes = tuple(self.mesh[i] for i in self.shard_dims)
        position = {mesh_dim: k for k, mesh_dim in enumerate(self.shard_dims)}
        out = []
        for combo in itertools.product(*per_dim):
            coordinate = [0] * len(self.shard_dims)
            for d, sub in enumerate(combo):
                for mesh_dim, c in zip(self._acting(d), sub):
                    coordinate[position[mesh_dim]] = c
            out.append(_ravel(coordinate, shard_sizes))
        return sorted(out)

    def part_holding(self, shape: tuple[int, ...], offsets: tuple[int, ...], box_shape: tuple[int, ...]) -> int | None:
        """The part one of whose boxes is exactly (``offsets``, ``box_shape``), if any."""
        for part in self.parts_overlapping(shape, offsets, box_shape):
            if any(b.offsets == offsets and b.shape == box_shape for b in self.boxes(shape, part)):
                return part
        return None

    def stored_boxes(self, shape: tuple[int, ...]) -> int:
        """How many non-empty boxes the whole tensor is stored as: a part's boxes are the products of
        one run per dim, so the count is a product over dims of the runs all coordinates hold."""
        total = 1
        for d, size in enumerate(shape):
            acting = self._acting(d)
            sizes, factors = tuple(self.mesh[i] for i in acting), tuple(self.placements[i].split_factor for i in acting)
            subs = _coordinates_meeting(size, sizes, factors, 0, size)
            total *= sum(
                len(dim_runs(size, tuple(DimSplit(n, c, f) for n, c, f in zip(sizes, sub, factors)))) for sub in subs
            )
        return total

    # --------------------------------------------------------------- records

    def to_json(self) -> dict[str, Any]:
        return {"mesh": list(self.mesh), "placements": [p.to_json() for p in self.placements], "writer": self.writer}

    def describe(self) -> str:
        """For people: ``mesh [2, 2], (_StridedShard(dim=0, sf=2), Shard(dim=0))``."""
        names = []
        for p in self.placements:
            if p.at is not None:
                names.append(f"At({p.at})")
            elif p.dim is None:
                names.append("Replicate()")
            elif p.split_factor == 1:
                names.append(f"Shard(dim={p.dim})")
            else:
                names.append(f"_StridedShard(dim={p.dim}, sf={p.split_factor})")
        return f"mesh {list(self.mesh)}, ({', '.join(names)})"

    def check(self, shape: tuple[int, ...], world_size: int, where: str) -> None:
        """Refuse a rule a reader cannot follow for a tensor of ``shape`` in a checkpoint of ``world_size`` ranks."""
        if not 1 <= len(self.mesh) <= MAX_MESH_DIMS or len(self.placements) != len(self.mesh):
            raise FormatError(
                f"{where}: layout rule needs 1 to {MAX_MESH_DIMS} mesh dims and one placement per mesh dim"
            )
        if (
            any(not _is_int(n) or n < 1 for n in self.mesh)
            or self.world_size != world_size
            or world_size > MAX_WORLD_SIZE
        ):
            raise FormatError(
                f"{where}: layout mesh {list(self.mesh)} does not span the checkpoint's {world_size} ranks"
            )
        for i, p in enumerate(self.placements):
            if p.dim is not None and (not 0 <= p.dim < len(shape) or not 1 <= p.split_factor <= MAX_BOXES):
                raise FormatError(f"{where}: placement {p.to_json()} does not split a dim of shape {list(shape)}")
            if p.at is not None and not 0 <= p.at < self.mesh[i]:
                raise FormatError(
                    f"{where}: placement {p.to_json()} on mesh dim {i} names a coordinate outside 0..{self.mesh[i] - 1}"
                )
        if not self.shard_dims or not 0 <= self.writer < self.replicas:
            raise FormatError(
                f"{where}: layout rule shards nothing, or its writer {self.writer} is not a replica number below "
                f"{self.replicas}"
            )
        if not shape or not all(shape):
            raise FormatError(f"{where}: a layout rule describes a tensor with elements, not shape {list(shape)}")

    @classmethod
    def from_json(cls, raw: Any, where: str) -> LayoutRule:
        if not isinstance(raw, dict) or set(raw) != {"mesh", "placements", "writer"}:
            raise FormatError(f"{where}: layout must be an object with exactly mesh, placements and writer")
        mesh, placements, writer = raw["mesh"], raw["placements"], raw["writer"]
        if (
            not isinstance(mesh, list)
            or not all(_is_int(n) for n in mesh)
            or not isinstance(placements, list)
            or not _is_int(writer)
        ):
            raise FormatError(f"{where}: layout mesh must be a list of integers, placements a list, writer an integer")
        if len(mesh) > MAX_MESH_DIMS or any(n < 1 or n > MAX_WORLD_SIZE for n in mesh):
            raise FormatError(
                f"{where}: layout mesh {mesh!r:.80} is not a list of at most {MAX_MESH_DIMS} sizes in "
                f"1..{MAX_WORLD_SIZE}"
            )
        if len(placements) > MAX_MESH_DIMS:
            raise FormatError(
                f"{where}: layout rule needs 1 to {MAX_MESH_DIMS} mesh dims and one placement per mesh dim"
            )
        return _interned(tuple(mesh), tuple(Placement.from_json(p, where) for p in placements), writer)


@lru_cache(maxsize=1 << 12)
def _interned(mesh: tuple[int, ...], placements: tuple[Placement, ...], writer: int) -> LayoutRule:
    """One object per distinct rule: a manifest's thousands of tensors share a few, and their
    computed properties and the caches keyed by them are then built once."""
    return LayoutRule(mesh, placements, writer)


@lru_cache(maxsize=1 << 14)
def _part_boxes(
    mesh: tuple[int, ...], placements: tuple[Placement, ...], shape: tuple[int, ...], part: int
) -> tuple[LocalBox, ...]:
    """The non-empty boxes of ``part`` (cached: a model's layers repeat a few shapes and layouts,
    and a load asks for the same part of every tensor)."""
    shard_dims = tuple(i for i, p in enumerate(placements) if p.dim is not None)
    coordinate = dict(zip(shard_dims, _unravel(part, tuple(mesh[i] for i in shard_dims))))
    steps = tuple(
        tuple(
            DimSplit(mesh[i], coordinate[i], placements[i].split_factor) for i in shard_dims if placements[i].dim == d
        )
        for d in range(len(shape))
    )
    return tuple(b for b in local_boxes(shape, steps) if all(b.shape))


def _local_intervals(runs: tuple[Run, ...], lo: int, hi: int) -> list[tuple[int, int]]:
    """The local positions [a, b) whose global indices (``runs``) lie in [lo, hi)."""
    out = []
    for r in runs:
        a, b = max(lo, r.start), min(hi, r.start + r.length)
        if a < b:
            out.append((r.local_start + a - r.start, r.local_start + b - r.start))
    return out


def _pieces_meeting(length: int, parts: int, factor: int, intervals: list[tuple[int, int]]) -> list[int]:
    """The coordinates c of one split (``parts``, ``factor``) of ``length`` local positions whose
    piece holds any of ``intervals`` (only the strided pieces the intervals touch are visited)."""
    found: set[int] = set()
    stride = -(-length // factor)
    for a, b in intervals:
        for j in range(a // stride, (b - 1) // stride + 1):
            begin, end = j * stride, min((j + 1) * stride, length)
            size = -(-(end - begin) // parts)
            x, y = max(a, begin), min(b, end)
            if x < y and size:
                found.update(range((x - begin) // size, min(parts - 1, (y - 1 - begin) // size) + 1))
    return sorted(found)


def _coordinates_meeting(
    size: int, parts: tuple[int, ...], factors: tuple[int, ...], lo: int, hi: int
) -> list[tuple[int, ...]]:
    """The coordinates of the mesh dims (``parts`` sizes) splitting one tensor dim of ``size`` whose
    indices meet [lo, hi): a search down the splits that never enters a piece outside the range, so
    its cost follows what it finds, not the product of the mesh sizes."""
    out: list[tuple[int, ...]] = []

    def visit(prefix: tuple[DimSplit, ...]) -> None:
        level = len(prefix)
        if level == len(parts):
            out.append(tuple(step.coordinate for step in prefix))
            return
        runs = dim_runs(size, prefix)
        length = sum(r.length for r in runs)
        for c in _pieces_meeting(length, parts[level], factors[level], _local_intervals(runs, lo, hi)):
            visit((*prefix, DimSplit(parts[level], c, factors[level])))

    if lo < hi:
        visit(())
    return out


SPREAD_MIN_PART_BYTES = 64 << 10  # a smaller part is not worth another index for its replicas to read


def spread_writers(rules: list[tuple[str, int, LayoutRule]]) -> dict[str, LayoutRule]:
    """Each replicated-and-sharded tensor's rule with its ``writer`` set, from (key, nbytes, rule)
    triples every rank knows alike: largest tensors first, each turned one replica further than the
    previous one on the same mesh, so part p of successive tensors is written by successive
    replicas and every rank of the mesh gets writes (O(T), the same on every rank).

    Tensors whose parts are small (norms, biases: under :data:`SPREAD_MIN_PART_BYTES`) all keep
    ``writer`` 0: spreading them saves nothing, and a rank that loads them reads one more index per
    replica that writes them."""
    turned: dict[tuple[int, ...], int] = {}
    out: dict[str, LayoutRule] = {}
    for key, nbytes, rule in sorted(rules, key=lambda kr: (-kr[1], kr[0])):
        if rule.replicas == 1 or nbytes < SPREAD_MIN_PART_BYTES * rule.parts:
            out[key] = rule
            continue
        start = turned.get(rule.mesh, 0)
        out[key] = replace(rule, writer=start % rule.replicas)
        turned[rule.mesh] = start + 1
    return out


__all__ = ["MAX_WORLD_SIZE", "LayoutRule", "Placement", "spread_writers"]
