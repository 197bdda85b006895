"""core/plan.py and core/layout.py: who writes what, and how a rank's chunks are classified (hypothesis).

The writer assignment (:func:`assign_writers`), for random tensors cut into random grids of boxes,
each box held by a random non-empty set of ranks (replicas), listed in a random order per rank:

* every distinct box (key, offsets, shape) gets exactly one writer, and that writer holds it;
* the written boxes tile each tensor: every element is written exactly once (no gaps, no overlaps);
* each box goes to its least loaded holder, largest boxes first (the balance the docstring promises;
  with the small-chunk threshold at 0, so that every box counts as large);
* with the default threshold, small replicated boxes (all of these are small) are packed: each goes to
  its lowest holder rank while that rank has room (SMALL_PER_WRITER), so a reader opens few files;
* a box no rank holds (a gap), a box held twice under two shapes (an overlap that changes the
  volume) and ranks that disagree on a tensor's dtype or global shape are refused with a SaveError
  naming the tensor. (Overlaps of the same total volume pass this volume check; the manifest
  parser's coverage check, core/format.py, refuses them before anything is published.)

Chunk classification (:func:`classify`) against the dim-0 split rule (core/rule.py
``LayoutRule.split``), for random global shapes (empty dim 0 and scalars included) and world sizes:

* the box of part ``rank`` is SPLIT on that rank (WHOLE when it is the whole tensor), and the two
  implementations of the rule agree (:func:`follows_rule` with ``LayoutRule.split``);
* the whole tensor is WHOLE on every rank; any other box is IRREGULAR;
* the SPLIT chunks of all ranks tile the tensor.

Replicated tensors' writers (:func:`whole_writers`): one writer per key, within the world, the same
for any input order.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardsafe.core.layout import IRREGULAR, SPLIT, WHOLE, classify, follows_rule, rule_for, whole_writers
from shardsafe.core.plan import SMALL_CHUNK_BYTES, SMALL_PER_WRITER, ChunkSpec, LocalChunk, assign_writers
from shardsafe.core.rule import LayoutRule
from shardsafe.errors import SaveError

DTYPES = ["torch.float32", "torch.bfloat16", "torch.int64", "torch.uint8"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
# world, key -> (dtype, shape, boxes), specs
Holdings = tuple[int, dict[str, tuple[str, tuple[int, ...], list[Box]]], list[list[ChunkSpec]]]


def _elements(offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(o, o + n) for o, n in zip(offsets, shape))))


@st.composite
def grid_tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A global shape and the boxes of a grid cut of it (each dim cut at random points)."""
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3)))
    cuts_per_dim = []
    for n in shape:
        inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        bounds = [0, *inner, n]
        cuts_per_dim.append([(a, b - a) for a, b in itertools.pairwise(bounds)])
    boxes = [(tuple(o for o, _ in cell), tuple(s for _, s in cell)) for cell in itertools.product(*cuts_per_dim)]
    return shape, boxes


@st.composite
def holdings(draw: st.DrawFn) -> Holdings:
    """World size, the tensors (key -> dtype, shape, boxes) and each rank's specs, in a random order."""
    world = draw(st.integers(1, 5))
    tensors: dict[str, tuple[str, tuple[int, ...], list[Box]]] = {}
    for i in range(draw(st.integers(1, 4))):
        shape, boxes = draw(grid_tilings())
        tensors[f"t{i}"] = (draw(st.sampled_from(DTYPES)), shape, boxes)
    specs: list[list[ChunkSpec]] = [[] for _ in range(world)]
    for key, (dtype, shape, boxes) in tensors.items():
        for offsets, box_shape in boxes:
            for rank in draw(st.sets(st.integers(0, world - 1), min_size=1)):
                specs[rank].append(ChunkSpec(key, dtype, shape, offsets, box_shape))
    for rank_specs in specs:
        draw(st.randoms(use_true_random=False)).shuffle(rank_specs)
    return world, tensors, specs


def _written(specs: list[list[ChunkSpec]], assignment: list[list[int]]) -> list[tuple[int, ChunkSpec]]:
    return [(rank, specs[rank][i]) for rank, indices in enumerate(assignment) for i in indices]


@settings(max_examples=150, deadline=None)
@given(holdings())
def test_every_box_has_one_writer_and_the_writes_tile(
    case: Holdings,
) -> None:
    world, tensors, specs = case
    assignment = assign_writers(specs)
    assert len(assignment) == world
    for rank, indices in enumerate(assignment):
        assert indices == sorted(set(indices)) and all(0 <= i < len(specs[rank]) for i in indices)
    written = _written(specs, assignment)
    distinct = {(s.key, s.offsets, s.shape) for rank_specs in specs for s in rank_specs}
    writers: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for rank, s in written:
        writers.setdefault((s.key, s.offsets, s.shape), []).append(rank)
    assert set(writers) == distinct and all(len(w) == 1 for w in writers.values()), "a box with no writer or with two"
    for box, (rank,) in writers.items():
        assert any((s.key, s.offsets, s.shape) == box for s in specs[rank]), "the writer does not hold the box"
    for key, (_, shape, _) in tensors.items():
        covered: dict[tuple[int, ...], int] = {}
        for _, s in written:
            if s.key == key:
                for index in _elements(s.offsets, s.shape):
                    covered[index] = covered.get(index, 0) + 1
        assert covered == dict.fromkeys(_elements((0,) * len(shape), shape), 1), (
            f"{key}: written boxes do not tile {shape}"
        )


@settings(max_examples=100, deadline=None)
@given(holdings())
def test_each_box_goes_to_a_least_loaded_holder(case: Holdings) -> None:
    """Largest boxes first, each to its least loaded holder: so when rank r is given box b, what r
    already writes - at least its boxes larger than b - is no more than any other holder of b ends with."""
    _, _, specs = case
    written = _written(specs, assign_writers(specs, small=0))
    load = [0] * len(specs)
    for rank, s in written:
        load[rank] += s.nbytes
    for rank, s in written:
        before = sum(t.nbytes for r, t in written if r == rank and t.nbytes > s.nbytes)
        for other, rank_specs in enumerate(specs):
            if other != rank and any((t.key, t.offsets, t.shape) == (s.key, s.offsets, s.shape) for t in rank_specs):
                assert before <= load[other], (
                    f"{s.key} {s.offsets} went to rank {rank} though rank {other} was less loaded"
                )


@settings(max_examples=100, deadline=None)
@given(holdings())
def test_small_replicated_boxes_go_to_their_lowest_holder(case: Holdings) -> None:
    """Every box here is far below SMALL_CHUNK_BYTES and all of them together below SMALL_PER_WRITER:
    a box held by several ranks is written by the lowest of them; a box held once, by its holder."""
    _, _, specs = case
    assert sum(s.nbytes for rank_specs in specs for s in rank_specs) < SMALL_PER_WRITER
    for rank, s in _written(specs, assign_writers(specs)):
        holders = [r for r, rank_specs in enumerate(specs) if any(t == s for t in rank_specs)]
        assert rank == min(holders), f"{s.key} {s.offsets} went to rank {rank}, not its lowest holder {min(holders)}"


def test_small_packing_fills_one_writer_then_the_next() -> None:
    """Small replicated boxes fill rank 0 up to SMALL_PER_WRITER, then rank 1; large ones are balanced
    as before, counting the small bytes already placed."""
    per = SMALL_CHUNK_BYTES // 4  # float32 elements of one small box at the threshold
    small = [
        ChunkSpec(f"s{i:03d}", "torch.float32", (per,), (0,), (per,))
        for i in range(SMALL_PER_WRITER // SMALL_CHUNK_BYTES + 1)
    ]
    big = ChunkSpec("big", "torch.float32", (per * 2,), (0,), (per * 2,))
    assignment = assign_writers([[*small, big], [*small, big], [*small, big]])
    assert len(assignment[0]) == SMALL_PER_WRITER // SMALL_CHUNK_BYTES  # rank 0 full
    assert assignment[1] == [len(small) - 1]  # the one small box left over, on rank 1
    assert assignment[2] == [len(small)]  # the large one on the least loaded rank
    writers = whole_writers([(s.key, s.nbytes) for s in small] + [("big", big.nbytes)], 3)
    assert [writers[s.key] for s in small] == [0] * (len(small) - 1) + [1] and writers["big"] == 2


@settings(max_examples=80, deadline=None)
@given(holdings(), st.data())
def test_gaps_overlaps_and_disagreements_are_refused(case: Holdings, data: st.DataObject) -> None:
    world, tensors, specs = case
    key = data.draw(st.sampled_from(sorted(tensors)))
    dtype, shape, boxes = tensors[key]
    held = [i for i, rank_specs in enumerate(specs) if any(s.key == key for s in rank_specs)]
    rank = data.draw(st.sampled_from(held))
    mutation = data.draw(st.sampled_from(["gap", "overlap", "dtype", "shape"]))
    broken = [list(rank_specs) for rank_specs in specs]
    if mutation == "gap":
        assume(len(boxes) > 1 and all(shape))  # a tensor of one box is missing altogether, not a gap in it
        gone = data.draw(st.sampled_from(boxes))
        broken = [[s for s in rank_specs if (s.key, s.offsets, s.shape) != (key, *gone)] for rank_specs in broken]
    elif mutation == "overlap":
        # no elements to overlap, or the whole-tensor box would be the same box again
        assume(all(shape) and len(boxes) > 1)
        # the whole tensor, next to its parts
        broken[rank].append(ChunkSpec(key, dtype, shape, (0,) * len(shape), shape))
    elif mutation == "dtype":
        assume(any(i != rank for i in held))  # another rank holds it, to disagree with
        other = data.draw(st.sampled_from([d for d in DTYPES if d != dtype]))
        broken[rank] = [
            ChunkSpec(s.key, other, s.global_shape, s.offsets, s.shape) if s.key == key else s for s in broken[rank]
        ]
    else:
        assume(any(i != rank for i in held))
        bigger = (*shape, 1)
        broken[rank] = [
            ChunkSpec(s.key, s.dtype, bigger, (*s.offsets, 0), (*s.shape, 1)) if s.key == key else s
            for s in broken[rank]
        ]
    with pytest.raises(SaveError, match=repr(key)):
        assign_writers(broken)


def test_replicated_box_goes_to_the_least_loaded_holder() -> None:
    """The docstring's promise: a replicated tensor is written once, by the least loaded rank holding it."""
    big = ChunkSpec("big", "torch.float32", (100,), (0,), (100,))
    small = [ChunkSpec(f"s{i}", "torch.float32", (10,), (0,), (10,)) for i in range(3)]
    assignment = assign_writers([[big, *small], [*small], [*small]], small=0)
    assert assignment[0] == [0]  # the largest first, to rank 0; the small ones then avoid rank 0
    assert sorted(len(a) for a in assignment[1:]) == [1, 2]


# ----------------------------------------------------------------------------- classification


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], int]:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    return shape, draw(st.integers(1, 8))


def _spec(shape: tuple[int, ...], offsets: tuple[int, ...], box: tuple[int, ...]) -> ChunkSpec:
    return ChunkSpec("w", "torch.float32", shape, offsets, box)


def _rule_box(shape: tuple[int, ...], world: int, rank: int) -> Box | None:
    """Part ``rank`` of the dim-0 split rule as one box (None: an empty part), from core/rule.py."""
    rule = LayoutRule.split(world)
    boxes = rule.boxes(shape, rule.part_of(rank))
    assert len(boxes) <= 1
    return (boxes[0].offsets, boxes[0].shape) if boxes else None


@settings(max_examples=200, deadline=None)
@given(split_cases(), st.data())
def test_classify_follows_the_split_rule(case: tuple[tuple[int, ...], int], data: st.DataObject) -> None:
    shape, world = case
    zeros = (0,) * len(shape)
    for rank in range(world):
        assert classify(_spec(shape, zeros, shape), rank, world) == WHOLE
    if rule_for(shape, world) is None:  # a scalar or an empty dim 0: no rule, nothing is SPLIT
        assert not shape or shape[0] == 0
        return
    if not all(shape):
        return  # the rule describes tensors with elements only
    covered: dict[tuple[int, ...], int] = {}
    for rank in range(world):
        box = _rule_box(shape, world, rank)
        if box is None:  # past the end of dim 0 (FSDP2's ranks with an empty shard)
            empty = (0, *shape[1:])
            assert classify(_spec(shape, (shape[0], *zeros[1:]), empty), rank, world) == SPLIT
            continue
        offsets, box_shape = box
        assert classify(_spec(shape, offsets, box_shape), rank, world) == (WHOLE if box_shape == shape else SPLIT)
        chunk = LocalChunk("w", torch.empty(box_shape, device="meta"), shape, offsets)
        assert follows_rule(LayoutRule.split(world), [chunk], rank, world)  # the rule's own reading agrees
        for index in _elements(offsets, box_shape):
            covered[index] = covered.get(index, 0) + 1
    assert covered == dict.fromkeys(_elements(zeros, shape), 1), "the parts do not tile the tensor"
    # any other non-empty box is IRREGULAR
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    box_shape = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets))
    rank = data.draw(st.integers(0, world - 1))
    if (offsets, box_shape) not in ((zeros, shape), _rule_box(shape, world, rank)):
        assert classify(_spec(shape, offsets, box_shape), rank, world) == IRREGULAR
        chunk = LocalChunk("w", torch.empty(box_shape, device="meta"), shape, offsets)
        assert not follows_rule(LayoutRule.split(world), [chunk], rank, world)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.text(max_size=4), st.integers(0, 1 << 20)), unique_by=lambda kv: kv[0], max_size=20),
    st.integers(1, 9),
    st.randoms(use_true_random=False),
)
def test_whole_writers_one_per_key_any_order(whole: list[tuple[str, int]], world: int, rng: random.Random) -> None:
    for small in (0, 1 << 19):
        writers = whole_writers(whole, world, small)
        assert set(writers) == {k for k, _ in whole} and all(0 <= r < world for r in writers.values())
        assert whole_writers(rng.sample(whole, len(whole)), world, small) == writers
