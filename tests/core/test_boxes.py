"""core/boxes.py: which global boxes a rank's local tensor covers, against torch's own split functions.

For random meshes (1-3 dims), tensor shapes (uneven and empty dims included) and placements
(``Replicate``, ``Shard(d)``, ``_StridedShard(d, sf)``), on every mesh coordinate:

* the oracle is torch itself: an index tensor split mesh dim by mesh dim with each placement's
  ``_split_tensor`` (what ``distribute_tensor`` does), keeping the coordinate's piece;
* the boxes :func:`local_boxes` gives, read out of the oracle's local tensor at their local
  offsets, hold exactly the global indices of those boxes;
* the boxes of all coordinates cover every element exactly once per replica (the product of the
  sizes of the mesh dims that replicate).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from shardsafe.core.boxes import MAX_BOXES, DimSplit, dim_runs, local_boxes, local_shape
from shardsafe.errors import FormatError


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], list[object]]:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements: list[object] = []
    for _ in mesh:
        kind = draw(st.sampled_from(["r", "s", "ss"]))
        dim = draw(st.integers(0, len(shape) - 1))
        if kind == "r":
            placements.append(Replicate())
        elif kind == "s":
            placements.append(Shard(dim))
        else:
            placements.append(_StridedShard(dim, split_factor=draw(st.integers(1, 4))))
    return shape, mesh, placements


def _steps(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[object], coordinate: tuple[int, ...]
) -> tuple[tuple[DimSplit, ...], ...]:
    steps: list[list[DimSplit]] = [[] for _ in shape]
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            steps[p.dim].append(DimSplit(mesh[m], coordinate[m], int(p.split_factor)))
        elif isinstance(p, Shard):
            steps[p.dim].append(DimSplit(mesh[m], coordinate[m]))
    return tuple(tuple(s) for s in steps)


def _oracle(
    index: torch.Tensor, mesh: tuple[int, ...], placements: list[object], coordinate: tuple[int, ...]
) -> torch.Tensor:
    local = index
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            pieces, _ = p._split_tensor(local, mesh[m], with_padding=False)  # type: ignore[union-attr]
            local = pieces[coordinate[m]]
    return local


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_boxes_match_torch_and_tile_once_per_replica(
    layout: tuple[tuple[int, ...], tuple[int, ...], list[object]],
) -> None:
    shape, mesh, placements = layout
    total = 1
    for n in shape:
        total *= n
    index = torch.arange(total, dtype=torch.int64).reshape(shape)
    coverage = torch.zeros(total, dtype=torch.int64)
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        steps = _steps(shape, mesh, placements, coordinate)
        local = _oracle(index, mesh, placements, coordinate)
        assert local_shape(shape, steps) == tuple(local.shape)
        held = 0
        for box in local_boxes(shape, steps):
            part = local
            glob = index
            for d in range(len(shape)):
                part = part.narrow(d, box.local_offsets[d], box.shape[d])
                glob = glob.narrow(d, box.offsets[d], box.shape[d])
            assert torch.equal(part, glob), (box, coordinate)
            coverage[glob.reshape(-1)] += 1
            held += part.numel()
        assert held == local.numel()  # the boxes are the whole local tensor, nothing twice
    replicas = 1
    for n, p in zip(mesh, placements):
        replicas *= n if isinstance(p, Replicate) else 1
    assert torch.all(coverage == replicas)


def test_fsdp_over_tp_is_two_boxes_per_rank() -> None:
    """torchtitan's layout of a colwise weight of 10 rows on (dp=2, tp=2): (_StridedShard(0, sf=2), Shard(0))."""
    rows = {}
    for dp, tp in itertools.product(range(2), range(2)):
        boxes = local_boxes((10, 4), ((DimSplit(2, dp, 2), DimSplit(2, tp)), ()))
        rows[dp, tp] = [(b.offsets[0], b.shape[0]) for b in boxes]
    assert rows == {(0, 0): [(0, 3)], (0, 1): [(5, 3)], (1, 0): [(3, 2)], (1, 1): [(8, 2)]}


def test_runs_stay_few_at_scale() -> None:
    """A million rows over 16,384 ranks on a 3-D split is a few runs, not a million indices."""
    runs = dim_runs(1_000_000, (DimSplit(8, 3, 4), DimSplit(64, 17), DimSplit(32, 5)))
    assert 1 <= len(runs) <= 4


def test_invalid_splits_are_format_errors() -> None:
    with pytest.raises(FormatError):
        dim_runs(10, (DimSplit(2, 2),))
    with pytest.raises(FormatError):
        local_boxes((4,), ())
    many = tuple((DimSplit(2, 0, 70),) for _ in range(2))  # 70 separate rows on each dim
    with pytest.raises(FormatError, match=str(MAX_BOXES)):
        local_boxes((140, 140), many)
