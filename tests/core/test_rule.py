"""core/rule.py: layout rules (mesh + placements) against core/boxes.py and brute force.

For random meshes, placements and shapes (uneven dims included):

* the boxes of part ``part_of(rank)`` are the non-empty boxes :func:`local_boxes` gives for that
  rank's mesh coordinate (the function every save describes its DTensors with);
* the parts' boxes tile the tensor exactly once (replicas hold the same part, it is stored once);
* every part has exactly one writer, a rank that holds it;
* :meth:`parts_overlapping` finds exactly the parts a brute force over all parts finds, for random boxes;
* the JSON form round-trips, and hostile forms are refused with a FormatError.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsafe.core.boxes import DimSplit, local_boxes
from shardsafe.core.rule import LayoutRule, Placement, spread_writers
from shardsafe.errors import FormatError


@st.composite
def rules(draw: st.DrawFn) -> tuple[tuple[int, ...], LayoutRule]:
    shape = tuple(draw(st.lists(st.integers(1, 11), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(["r", "s", "ss"]))
        dim = draw(st.integers(0, len(shape) - 1))
        placements.append(
            Placement(None) if kind == "r" else Placement(dim, draw(st.integers(2, 4)) if kind == "ss" else 1)
        )
    if all(p.dim is None for p in placements):
        placements[0] = Placement(0)
    rule = LayoutRule(mesh, tuple(placements))
    return shape, LayoutRule(mesh, tuple(placements), draw(st.integers(0, rule.replicas - 1)))


def _coordinate(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major, as init_device_mesh numbers ranks (written apart from core/rule.py's own)."""
    return tuple(itertools.product(*(range(n) for n in mesh)))[rank]


def _rank_boxes(shape: tuple[int, ...], rule: LayoutRule, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    coordinate = _coordinate(rank, rule.mesh)
    steps: list[list[DimSplit]] = [[] for _ in shape]
    for m, p in enumerate(rule.placements):
        if p.dim is not None:
            steps[p.dim].append(DimSplit(rule.mesh[m], coordinate[m], p.split_factor))
    return [(b.offsets, b.shape) for b in local_boxes(shape, tuple(tuple(s) for s in steps)) if all(b.shape)]


@settings(max_examples=150, deadline=None)
@given(rules())
def test_parts_writers_and_tiling(case: tuple[tuple[int, ...], LayoutRule]) -> None:
    shape, rule = case
    rule.check(shape, rule.world_size, "test")
    writers: dict[int, list[int]] = {}
    for rank in range(rule.world_size):
        part = rule.part_of(rank)
        assert [(b.offsets, b.shape) for b in rule.boxes(shape, part)] == _rank_boxes(shape, rule, rank)
        if rule.writes(rank):
            writers.setdefault(part, []).append(rank)
    assert sorted(writers) == list(range(rule.parts)) and all(len(w) == 1 for w in writers.values())
    assert all(rule.part_of(rule.writer_of(p)) == p for p in range(rule.parts))
    covered: dict[tuple[int, ...], int] = {}
    for part in range(rule.parts):
        for b in rule.boxes(shape, part):
            for index in itertools.product(*(range(o, o + n) for o, n in zip(b.offsets, b.shape))):
                covered[index] = covered.get(index, 0) + 1
    assert covered == dict.fromkeys(itertools.product(*(range(n) for n in shape)), 1)
    assert LayoutRule.from_json(rule.to_json(), "test") == rule
    assert rule.stored_boxes(shape) == sum(len(rule.boxes(shape, p)) for p in range(rule.parts))


@settings(max_examples=150, deadline=None)
@given(rules(), st.data())
def test_parts_overlapping_matches_brute_force(case: tuple[tuple[int, ...], LayoutRule], data: st.DataObject) -> None:
    shape, rule = case
    lo = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, lo))

    def meets(b_off: tuple[int, ...], b_shape: tuple[int, ...]) -> bool:
        return all(o < l + s and l < o + n for o, n, l, s in zip(b_off, b_shape, lo, size))

    expected = [p for p in range(rule.parts) if any(meets(b.offsets, b.shape) for b in rule.boxes(shape, p))]
    assert rule.parts_overlapping(shape, lo, size) == expected
    for p in expected:
        for b in rule.boxes(shape, p):
            assert rule.part_holding(shape, b.offsets, b.shape) == p


@st.composite
def stage_rules(draw: st.DrawFn) -> tuple[tuple[int, ...], LayoutRule]:
    """A rule of :func:`rules` with some of its replicate dims turned into ``["at", k]`` (a
    pipeline stage's tensors on its slice of the world mesh)."""
    shape, rule = draw(rules())
    placements = list(rule.placements)
    for i in rule.replica_dims:
        if rule.mesh[i] > 1 and draw(st.booleans()):  # on a dim of size 1, at 0 is replicate
            placements[i] = Placement(None, at=draw(st.integers(0, rule.mesh[i] - 1)))
    staged = LayoutRule(rule.mesh, tuple(placements))
    return shape, LayoutRule(rule.mesh, tuple(placements), draw(st.integers(0, staged.replicas - 1)))


@settings(max_examples=150, deadline=None)
@given(stage_rules())
def test_stage_holders_tile_once_per_replica(case: tuple[tuple[int, ...], LayoutRule]) -> None:
    """Under ``at`` dims the holders' parts tile the tensor once per replica, each part has one
    writer among the holders, and the ranks at other coordinates hold and write nothing."""
    shape, rule = case
    rule.check(shape, rule.world_size, "test")
    holders = [r for r in range(rule.world_size) if rule.holds(r)]
    at = {i: p.at for i, p in enumerate(rule.placements) if p.at is not None}
    assert holders == [
        r for r in range(rule.world_size) if all(_coordinate(r, rule.mesh)[i] == k for i, k in at.items())
    ]
    assert len(holders) == rule.parts * rule.replicas
    covered: dict[tuple[int, ...], int] = {}
    writers: dict[int, list[int]] = {}
    for rank in holders:
        part = rule.part_of(rank)
        assert [(b.offsets, b.shape) for b in rule.boxes(shape, part)] == _rank_boxes(shape, rule, rank)
        for b in rule.boxes(shape, part):
            for index in itertools.product(*(range(o, o + n) for o, n in zip(b.offsets, b.shape))):
                covered[index] = covered.get(index, 0) + 1
        if rule.writes(rank):
            writers.setdefault(part, []).append(rank)
    assert covered == dict.fromkeys(itertools.product(*(range(n) for n in shape)), rule.replicas)
    assert sorted(writers) == list(range(rule.parts)) and all(len(w) == 1 for w in writers.values())
    assert all(rule.holds(rule.writer_of(p)) for p in range(rule.parts))
    assert not any(rule.writes(r) for r in range(rule.world_size) if not rule.holds(r))
    assert LayoutRule.from_json(rule.to_json(), "test") == rule
    # the save's merge: the replicate form every holder describes, made exact by who holds the tensor
    candidate = LayoutRule(rule.mesh, tuple(Placement(p.dim, p.split_factor) for p in rule.placements))
    assert candidate.held_by(holders) == replace(rule, writer=0)
    fewer = candidate.held_by(holders[1:])  # a holder missing: a rule only if it holds exactly the rest
    assert fewer is None or [r for r in range(rule.world_size) if fewer.holds(r)] == holders[1:]


def test_held_by_makes_a_stage_rule_only_for_a_product_of_coordinates() -> None:
    candidate = LayoutRule((2, 2, 2), (Placement(None), Placement(0), Placement(None)))  # (pp, dp, tp): FSDP on dp
    assert candidate.held_by(range(8)) == candidate  # every rank: replicated on pp and tp (a norm under 2-D)
    stage1 = candidate.held_by([4, 5, 6, 7])
    assert stage1 is not None and stage1.to_json()["placements"] == [["at", 1], ["shard", 0], ["replicate"]]
    assert [stage1.writer_of(p) for p in range(2)] == [4, 7] and not stage1.holds(0)
    assert stage1.describe() == "mesh [2, 2, 2], (At(1), Shard(dim=0), Replicate())"
    assert candidate.held_by([4, 6]).to_json()["placements"] == [["at", 1], ["shard", 0], ["at", 0]]  # type: ignore[union-attr]
    assert candidate.held_by([0, 2, 4, 6]).to_json()["placements"] == [["replicate"], ["shard", 0], ["at", 0]]  # type: ignore[union-attr]
    assert candidate.held_by([0, 2, 5, 7]) is None  # stage 0 at tp 0 and stage 1 at tp 1: no single rule
    assert candidate.held_by([4]) is None  # one dp coordinate: a sharded part missing
    assert candidate.held_by([4, 5, 6, 8]) is None  # a rank outside the mesh


def test_version_2_split_is_the_one_dim_rule() -> None:
    rule = LayoutRule.split(3)
    assert rule.is_v2_split and rule.parts == 3 and rule.replicas == 1
    # torch.chunk of 7 rows over 3: 3, 3, 1
    assert [[(b.offsets, b.shape) for b in rule.boxes((7, 2), p)] for p in range(3)] == [
        [((0, 0), (3, 2))],
        [((3, 0), (3, 2))],
        [((6, 0), (1, 2))],
    ]
    # 2 rows over 3: the last part is empty
    assert rule.boxes((2, 2), 2) == [] and rule.parts_overlapping((2, 2), (0, 0), (2, 2)) == [0, 1]


def test_hsdp_writers_spread_over_replicas() -> None:
    hsdp = LayoutRule((4, 2), (Placement(None), Placement(0)))  # 4 replicas of a 2-way shard
    spread = spread_writers(
        [(f"w{i}", (100 - i) << 20, hsdp) for i in range(4)] + [(f"n{i}", 1024, hsdp) for i in range(4)]
    )
    written = {k: sorted(r for r in range(8) if spread[k].writes(r)) for k in spread}
    assert len({tuple(written[f"w{i}"]) for i in range(4)}) == 4  # each large tensor written by other replicas
    assert all(len(v) == 2 for v in written.values())
    assert {tuple(written[f"n{i}"]) for i in range(4)} == {tuple(written["w0"])}  # small ones: one index to read


@pytest.mark.parametrize(
    ("raw", "shape", "world", "match"),
    [
        ({"mesh": [2, 2], "placements": [["shard", 0], ["shard", 1]], "writer": 0}, (4, 4), 8, "does not span"),
        ({"mesh": [2, 2], "placements": [["shard", 0], ["shard", 3]], "writer": 0}, (4, 4), 4, "does not split"),
        ({"mesh": [2], "placements": [["replicate"]], "writer": 0}, (4,), 2, "shards nothing"),
        ({"mesh": [2, 2], "placements": [["replicate"], ["shard", 0]], "writer": 2}, (4,), 4, "writer"),
        ({"mesh": [2], "placements": [["strided", 0, 0]], "writer": 0}, (4,), 2, "does not split"),
        ({"mesh": [2], "placements": [["shard", 0]], "writer": 0}, (0,), 2, "with elements"),
        ({"mesh": [2], "placements": [["shard", 0]], "writer": 0}, (), 2, "does not split"),
        ({"mesh": [0], "placements": [["shard", 0]], "writer": 0}, (4,), 0, "sizes in"),
        ({"mesh": [2], "placements": [["shard", True]], "writer": 0}, (4,), 2, "placement"),
        ({"mesh": [2], "placements": [["shard", 0]]}, (4,), 2, "exactly"),
        ({"mesh": [1 << 21], "placements": [["shard", 0]], "writer": 0}, (4,), 1 << 21, "sizes in"),
        ({"mesh": [2, 2], "placements": [["shard", 0]], "writer": 0}, (4,), 4, "one placement per mesh dim"),
        ({"mesh": [2, 2], "placements": [["at", 2], ["shard", 0]], "writer": 0}, (4,), 4, "outside 0..1"),
        ({"mesh": [2, 2], "placements": [["at", -1], ["shard", 0]], "writer": 0}, (4,), 4, "outside 0..1"),
        ({"mesh": [2, 2], "placements": [["at", True], ["shard", 0]], "writer": 0}, (4,), 4, "placement"),
        ({"mesh": [2, 2], "placements": [["at", 0.0], ["shard", 0]], "writer": 0}, (4,), 4, "placement"),
        ({"mesh": [2, 2], "placements": [["at", 0, 1], ["shard", 0]], "writer": 0}, (4,), 4, "placement"),
        ({"mesh": [2, 2], "placements": [["at"], ["shard", 0]], "writer": 0}, (4,), 4, "placement"),
        ({"mesh": [2, 2], "placements": [["at", 0], ["at", 1]], "writer": 0}, (4,), 4, "shards nothing"),
        ({"mesh": [2, 2], "placements": [["at", 1], ["shard", 0]], "writer": 1}, (4,), 4, "writer"),
    ],
)
def test_hostile_rules_are_refused(raw: dict[str, object], shape: tuple[int, ...], world: int, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        LayoutRule.from_json(raw, "manifest").check(shape, world, "manifest")


def test_stage_rules_keep_a_rule_only_where_every_holder_agrees() -> None:
    """The coordinator's merge when ranks hold different tensors (core/layout.stage_rules), on a
    (pp=2, dp=2) world: one rule list per digest, ``at`` the stage where a stage holds the tensor."""
    from shardsafe.core.layout import RuleHeld, stage_rules

    fsdp = LayoutRule((2, 2), (Placement(None), Placement(0)))  # what a stage's rank describes on mesh["dp"]
    other = LayoutRule((2, 2), (Placement(None), Placement(1)))
    stage0 = [RuleHeld("a", "torch.float32", (4, 4), fsdp), RuleHeld("shared", "torch.float32", (4, 4), fsdp)]
    stage1 = [RuleHeld("b", "torch.float32", (4, 4), fsdp), RuleHeld("shared", "torch.float32", (4, 4), fsdp)]
    gathered = [("d0", [], stage0), ("d0", [], stage0), ("d1", ["c"], stage1), ("d1", [], stage1)]
    got = {k: t.rule.to_json()["placements"] for k, t in stage_rules(gathered).items()}
    assert got == {
        "a": [["at", 0], ["shard", 0]],
        "b": [["at", 1], ["shard", 0]],
        "shared": [["replicate"], ["shard", 0]],  # every rank holds it: replicated on pp
    }
    # a rank lists one of them, another disagrees on the rule: both stay listed
    stage1_other = [RuleHeld("b", "torch.float32", (4, 4), other), RuleHeld("shared", "torch.float32", (4, 4), fsdp)]
    gathered = [("d0", ["a"], stage0), ("d0", [], stage0), ("d1", [], stage1), ("d2", [], stage1_other)]
    assert set(stage_rules(gathered)) == {"shared"}
