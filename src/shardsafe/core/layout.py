"""Layouts described by a rule instead of a list of chunks (format versions 2 to 4).

The rule itself is core/rule.py: a DTensor's mesh and placements when its mesh spans the job, or
format version 2's dim-0 split over the world for the flat shards of FSDP2 ``Shard(0)``, FSDP1
and DeepSpeed (recognised from offsets alone). Save side: each rank classifies its chunks *locally* (no exchange of
chunk lists) and sends the
coordinator only a digest of what it holds (:func:`layout_digest`); equal digests mean every rank
holds the same tensors, with the same dtypes, shapes and classes. Replicated ("whole") tensors get
their writer from :func:`whole_writers`, a deterministic function of that common list, so every
rank computes the same assignment without a gather. Unequal digests (pipeline stages hold
different tensors): :func:`stage_rules`, on the coordinator, keeps a rule for each tensor whose
holders are a slice of the mesh (``["at", k]`` on the dims they share one coordinate of).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from shardsafe.core.dtypes import dtype_from_torch_text, element_size
from shardsafe.core.fields import numel
from shardsafe.core.plan import SMALL_CHUNK_BYTES, ChunkSpec, LocalChunk, SmallPacking
from shardsafe.core.rule import LayoutRule, spread_writers

__all__ = [
    "IRREGULAR",
    "LocalLayout",
    "RuleHeld",
    "SPLIT",
    "WHOLE",
    "classify",
    "describe_layout",
    "follows_rule",
    "is_stored",
    "rule_for",
    "stage_rules",
    "whole_writers",
]


class ChunkClass(str, Enum):
    """How a save stores one of this rank's chunks (the value is what the layout digest hashes)."""

    SPLIT = "split"  # exactly the part of a layout rule this rank holds (core/rule.py)
    WHOLE = "whole"  # the whole tensor (replicated: written once)
    IRREGULAR = "irregular"  # anything else: listed explicitly, writers chosen by the coordinator


SPLIT, WHOLE, IRREGULAR = ChunkClass.SPLIT, ChunkClass.WHOLE, ChunkClass.IRREGULAR


def rule_for(global_shape: tuple[int, ...], world_size: int) -> LayoutRule | None:
    """The ``torch.chunk`` split of dim 0 over ``world_size`` parts (None for a scalar or an empty dim 0)."""
    if not global_shape or global_shape[0] == 0:
        return None
    return LayoutRule.split(world_size)


def classify(spec: ChunkSpec, rank: int, world_size: int) -> ChunkClass:
    """This rank's chunk: part ``rank`` of the dim-0 split rule, the whole tensor, or irregular.

    Whole wins over split (a replicated tensor is whole on every rank, so all ranks agree; the one
    ambiguous case, a dim 0 of 1 split over several ranks, then differs between ranks and the save
    falls back to listing chunks). An empty chunk is split when part ``rank`` of the rule is empty
    too (FSDP2 ranks past the end of dim 0, DeepSpeed ranks whose share is all padding).
    """
    shape, full = spec.shape, spec.global_shape
    if shape == full and not any(spec.offsets):
        return WHOLE
    if rule_for(full, world_size) is None:
        return IRREGULAR
    size = -(-full[0] // world_size)
    start, stop = min(rank * size, full[0]), min((rank + 1) * size, full[0])
    if stop == start:
        return SPLIT if 0 in shape else IRREGULAR
    return (
        SPLIT if (spec.offsets, shape) == ((start, *([0] * (len(full) - 1))), (stop - start, *full[1:])) else IRREGULAR
    )


def follows_rule(rule: LayoutRule, chunks: list[LocalChunk], rank: int, world_size: int) -> bool:
    """Whether this rank's chunks of one tensor are exactly the boxes ``rule`` gives its part (a
    self-check: every rank that passes it is described by the rule, so all of them together are)."""
    full = chunks[0].global_shape
    if rule.world_size != world_size or not full or not all(full) or not rule.shard_dims:
        return False
    expected = [(b.offsets, b.shape) for b in rule.boxes(full, rule.part_of(rank))]
    return [(c.offsets, c.shape) for c in chunks if numel(c.shape)] == expected


@dataclass(frozen=True)
class HeldTensor:
    """A tensor this rank holds, as the layout digest sees it (``rule``: for a SPLIT tensor)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    cls: ChunkClass
    rule: LayoutRule | None = None

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * element_size(dtype_from_torch_text(self.dtype))

    def digest_entry(self) -> tuple[object, ...]:
        return (
            self.key,
            self.dtype,
            list(self.shape),
            self.cls.value,
            self.rule.to_json() if self.rule is not None else None,
        )


def layout_digest(tensors: list[HeldTensor]) -> str:
    """One digest of (key, dtype, global shape, class, rule) of every tensor this rank holds, in key
    order. Equal on all ranks exactly when they hold the same tensors laid out the same way."""
    data = json.dumps(sorted(t.digest_entry() for t in tensors), separators=(",", ":")).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def whole_writers(whole: list[tuple[str, int]], world_size: int, small: int = SMALL_CHUNK_BYTES) -> dict[str, int]:
    """Writer of each replicated tensor, from (key, nbytes) pairs every rank knows alike: those of
    at most ``small`` bytes packed onto the first ranks in key order (:class:`SmallPacking`),
    the rest largest first, each to the least loaded rank (ties: lowest rank). O(T log W), the same
    on every rank."""
    packing = SmallPacking(world_size)
    everyone = list(range(world_size))
    out = {key: packing.place(nbytes, everyone) for key, nbytes in sorted(whole) if nbytes <= small}
    large = [(key, nbytes) for key, nbytes in whole if nbytes > small]
    packed = sum(1 for b in packing.small_bytes if b)  # a prefix of the ranks; the next ones are empty
    heap = [(packing.small_bytes[r], r) for r in range(min(world_size, max(1, packed + len(large))))]
    heapq.heapify(heap)
    for key, nbytes in sorted(large, key=lambda kv: (-kv[1], kv[0])):
        load, rank = heapq.heappop(heap)
        out[key] = rank
        heapq.heappush(heap, (load + nbytes, rank))
    return out


class RuleHeld(NamedTuple):
    """A rule-described (SPLIT) tensor a rank holds, as it travels in the save's gather when the
    ranks' layouts differ (pipeline stages): equal records mean the same tensor, laid out alike."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    rule: LayoutRule


def stage_rules(gathered: list[tuple[str, list[str], list[RuleHeld]]]) -> dict[str, RuleHeld]:
    """When the ranks hold different tensors (pipeline stages), the tensors still described by a
    rule, from every rank's (layout digest, keys of its chunks to list, rule-described tensors):
    each tensor that every rank holding it holds under the same rule (dtype and shape too), no rank
    lists, and whose holders are a product of mesh coordinates (:meth:`LayoutRule.held_by`: a
    stage's tensors get ``["at", k]`` on the pipeline dim). Their writers are spread as the rule
    plan spreads them; the rest stay listed (``assign_writers`` checks their agreement).

    Ranks of equal digests hold the same rule-described tensors (the digest covers them), so one
    list per distinct digest is read: O(ranks + stages x tensors) on the coordinator."""
    listed: set[str] = set()
    groups: dict[str, list[int]] = {}
    for rank, (digest, keys, _) in enumerate(gathered):
        listed.update(keys)
        groups.setdefault(digest, []).append(rank)
    first: dict[str, RuleHeld] = {}
    holders: dict[str, list[str]] = {}  # key -> the digests of the ranks holding it
    for digest, ranks in groups.items():
        for t in gathered[ranks[0]][2]:
            if first.setdefault(t.key, t) != t:
                listed.add(t.key)
            holders.setdefault(t.key, []).append(digest)
    exact: dict[tuple[LayoutRule, tuple[str, ...]], LayoutRule | None] = {}  # a stage's tensors share holders
    out: list[tuple[str, int, LayoutRule]] = []
    for key, digests in holders.items():
        if key in listed:
            continue
        rule = first[key].rule
        group = (rule, tuple(digests))
        if group not in exact:
            exact[group] = rule.held_by(r for d in digests for r in groups[d])
        found = exact[group]
        if found is not None:
            held = first[key]
            out.append((key, numel(held.shape) * element_size(dtype_from_torch_text(held.dtype)), found))
    return {key: first[key]._replace(rule=rule) for key, rule in spread_writers(out).items()}


def is_stored(chunk: LocalChunk) -> bool:
    """Whether a chunk has a place in the files: data, or the whole of a tensor with no elements
    (a scalar, a (0,) or (0, 4) tensor: without a chunk the manifest would not list a tensor that
    state.json names). Empty shards of other tensors are only described (they say which part this
    rank holds), never written."""
    return (
        bool(numel(chunk.shape))
        or not any(chunk.global_shape)
        or (chunk.shape == chunk.global_shape and not any(chunk.offsets))
    )


@dataclass(frozen=True)
class LocalLayout:
    """This rank's chunks, classified without talking to any other rank."""

    classes: list[ChunkClass | None]  # per chunk of the view (None: neither described nor stored)
    tensors: list[HeldTensor]  # every key held, once
    digest: str

    def keys_of(self, kind: ChunkClass) -> set[str]:
        return {t.key for t in self.tensors if t.cls == kind}

    def rules(self) -> list[tuple[str, int, LayoutRule]]:
        """(key, bytes, rule) of every rule-described tensor (the input of core/rule.spread_writers)."""
        return [(t.key, t.nbytes, t.rule) for t in self.tensors if t.rule is not None]


def describe_layout(chunks: list[LocalChunk], rank: int, world_size: int) -> LocalLayout:
    """Classify every chunk and digest the result (:func:`layout_digest`): a DTensor that follows
    its mesh's rule (:func:`follows_rule`) is SPLIT under that rule; other tensors are classified by
    their offsets (:func:`classify`)."""
    by_key: dict[str, list[LocalChunk]] = {}
    for chunk in chunks:
        by_key.setdefault(chunk.key, []).append(chunk)
    held: dict[str, HeldTensor] = {}
    classes: list[ChunkClass | None] = []
    for chunk in chunks:
        if not is_stored(chunk) and numel(chunk.global_shape) == 0:
            classes.append(None)  # a tensor with no elements but not of shape (0,): never listed
            continue
        tensor = held.get(chunk.key) or held.setdefault(chunk.key, _held(chunk, by_key[chunk.key], rank, world_size))
        classes.append(None if tensor.cls == IRREGULAR and not is_stored(chunk) else tensor.cls)
    tensors = list(held.values())
    # Irregular chunks travel to the coordinator explicitly (their agreement is checked there), so they
    # stay out of the digest: per-rank tensors (RNG state, keyed by rank) would otherwise make every
    # rank's digest differ and send every save to the fully listed layout.
    return LocalLayout(classes, tensors, layout_digest([t for t in tensors if t.cls != IRREGULAR]))


def _held(chunk: LocalChunk, same_key: list[LocalChunk], rank: int, world_size: int) -> HeldTensor:
    """How this rank holds the tensor of ``chunk`` (all its chunks: ``same_key``)."""
    spec = chunk.spec()

    def held(cls: ChunkClass, rule: LayoutRule | None = None) -> HeldTensor:
        return HeldTensor(spec.key, spec.dtype, spec.global_shape, cls, rule)

    # A per-rank value (RNG state) exists on one rank only: listed explicitly, which is always correct.
    if chunk.per_rank:
        return held(IRREGULAR)
    if len(same_key) == 1 and classify(spec, rank, world_size) == WHOLE:
        return held(WHOLE)
    if chunk.rule is not None and follows_rule(chunk.rule, same_key, rank, world_size):
        return held(SPLIT, chunk.rule)
    if len(same_key) > 1:  # several boxes, not of a rule: listed
        return held(IRREGULAR)
    cls = classify(spec, rank, world_size)
    return held(cls, rule_for(spec.global_shape, world_size) if cls == SPLIT else None)
