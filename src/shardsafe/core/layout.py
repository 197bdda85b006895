"""Layouts described by a rule instead of a list of chunks (format version 2).

The rule itself is core/split.py. Save side: each rank classifies its chunks *locally* (no exchange of chunk lists) and sends the
coordinator only a digest of what it holds (:func:`layout_digest`); equal digests mean every rank
holds the same tensors, with the same dtypes, shapes and classes. Replicated ("whole") tensors get
their writer from :func:`whole_writers`, a deterministic function of that common list, so every
rank computes the same assignment without a gather.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass
from enum import Enum

from shardsafe.core.fields import numel
from shardsafe.core.plan import ChunkSpec, LocalChunk
from shardsafe.core.split import SplitRule


class ChunkClass(str, Enum):
    """How a save stores one of this rank's chunks (the value is what the layout digest hashes)."""

    SPLIT = "split"  # exactly part `rank` of the rule for its global shape over the world size
    WHOLE = "whole"  # the whole tensor (replicated: written once)
    IRREGULAR = "irregular"  # anything else: listed explicitly, writers chosen by the coordinator


SPLIT, WHOLE, IRREGULAR = ChunkClass.SPLIT, ChunkClass.WHOLE, ChunkClass.IRREGULAR


def rule_for(global_shape: tuple[int, ...], world_size: int) -> SplitRule | None:
    """The ``torch.chunk`` split of dim 0 over ``world_size`` parts (None for a scalar or an empty dim 0)."""
    if not global_shape or global_shape[0] == 0:
        return None
    return SplitRule(0, world_size, -(-global_shape[0] // world_size))


def classify(spec: ChunkSpec, rank: int, world_size: int) -> ChunkClass:
    """This rank's chunk: part ``rank`` of the split rule, the whole tensor, or irregular.

    Whole wins over split (a replicated tensor is whole on every rank, so all ranks agree; the one
    ambiguous case, a dim 0 of 1 split over several ranks, then differs between ranks and the save
    falls back to listing chunks). An empty chunk is split when part ``rank`` of the rule is empty
    too (FSDP2 ranks past the end of dim 0, DeepSpeed ranks whose share is all padding).
    """
    shape, full = spec.shape, spec.global_shape
    if shape == full and not any(spec.offsets):
        return WHOLE
    rule = rule_for(full, world_size)
    if rule is None:
        return IRREGULAR
    offsets, part_shape = rule.box(rank, full)
    if part_shape[0] == 0:
        return SPLIT if 0 in shape else IRREGULAR
    return SPLIT if (spec.offsets, shape) == (offsets, part_shape) else IRREGULAR


def layout_digest(entries: list[tuple[str, str, tuple[int, ...], ChunkClass]]) -> str:
    """One digest of (key, dtype, global shape, class) of every tensor this rank holds, in key order.
    Equal on all ranks exactly when they hold the same tensors laid out the same way."""
    data = json.dumps(sorted(entries), separators=(",", ":")).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def whole_writers(whole: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Writer of each replicated tensor, from (key, nbytes) pairs every rank knows alike: largest
    first, each to the least loaded rank (ties: lowest rank). O(T log W), the same on every rank."""
    heap = [(0, r) for r in range(min(world_size, max(1, len(whole))))]
    out: dict[str, int] = {}
    for key, nbytes in sorted(whole, key=lambda kv: (-kv[1], kv[0])):
        load, rank = heapq.heappop(heap)
        out[key] = rank
        heapq.heappush(heap, (load + nbytes, rank))
    return out


def is_stored(chunk: LocalChunk) -> bool:
    """Whether a chunk has a place in the files: data, or the whole of a tensor with no elements
    (a scalar, a (0,) or (0, 4) tensor: without a chunk the manifest would not list a tensor that
    state.json names). Empty shards of other tensors are only described (they say which part this
    rank holds), never written."""
    return bool(numel(chunk.shape)) or not any(chunk.global_shape) or (chunk.shape == chunk.global_shape and not any(chunk.offsets))


@dataclass
class LocalLayout:
    """This rank's chunks, classified without talking to any other rank."""

    classes: list[ChunkClass | None]  # per chunk of the view (None: neither described nor stored)
    tensors: list[tuple[str, str, tuple[int, ...], ChunkClass]]  # (key, dtype, global shape, class), every key held
    digest: str

    def keys_of(self, kind: ChunkClass) -> set[str]:
        return {key for key, _, _, cls in self.tensors if cls == kind}


def describe_layout(chunks: list[LocalChunk], rank: int, world_size: int) -> LocalLayout:
    """Classify every chunk (:func:`classify`) and digest the result (:func:`layout_digest`)."""
    classes: list[ChunkClass | None] = []
    tensors = []
    count: dict[str, int] = {}
    for chunk in chunks:
        count[chunk.key] = count.get(chunk.key, 0) + 1
    for chunk in chunks:
        if not is_stored(chunk) and numel(chunk.global_shape) == 0:
            classes.append(None)  # a tensor with no elements but not of shape (0,): never listed
            continue
        spec = chunk.spec()
        # A per-rank value (RNG state) exists on one rank only: listed explicitly, which is always
        # correct, and kept out of the digest below.
        # So does a tensor of which this rank holds several boxes (a _StridedShard local tensor).
        cls = IRREGULAR if chunk.per_rank or count[chunk.key] > 1 else classify(spec, rank, world_size)
        if cls == IRREGULAR and not is_stored(chunk):
            classes.append(None)
        else:
            classes.append(cls)
        tensors.append((spec.key, spec.dtype, spec.global_shape, cls))
    # Irregular chunks travel to the coordinator explicitly (their agreement is checked there), so they
    # stay out of the digest: per-rank tensors (RNG state, keyed by rank) would otherwise make every
    # rank's digest differ and send every save to the fully listed layout.
    return LocalLayout(classes, tensors, layout_digest([t for t in tensors if t[3] != IRREGULAR]))
