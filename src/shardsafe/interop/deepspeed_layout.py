"""Where each trained parameter's slices lie in a DeepSpeed ZeRO checkpoint's flat partitions, checked against what the
ranks hold.

ZeRO-3 splits every parameter of a sub-group evenly (padded) over the ranks: rank ``r`` holds
elements ``[r * ceil(n / world), ...)`` of each, one after the other, in its flat sub-group.
ZeRO-1/2 concatenate a param group's parameters (each followed by its alignment padding) and cut
the concatenation into one partition per rank. Both layouts are derived from the model file's
``param_shapes`` and checked against the lengths of the ranks' flat tensors, which hold bytes of the
files: so no shape from a file leads to an allocation larger than the checkpoint, and every element
of a gathered tensor is covered by some rank's slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardsafe.core.format import numel
from shardsafe.errors import FormatError
from shardsafe.interop.deepspeed_values import shapes_of, short, small_int

__all__ = ["Layout", "Param", "zero12_layout", "zero3_layout"]


@dataclass(frozen=True)
class Param:
    """Where a trained parameter's slices live."""

    name: str
    shape: tuple[int, ...]
    group: int  # index of its param group in the inner optimizer
    flat: int  # ZeRO-3: sub-group index; ZeRO-1/2: param group index
    # ZeRO-3: offset in every rank's flat sub-group; ZeRO-1/2: offset in the group's concatenation over ranks
    offset: int


@dataclass(frozen=True)
class Layout:
    """The trained parameters by name, the param group of each flat group, and (ZeRO-1/2) each rank's (start, length)
    per group."""

    params: dict[str, Param] = field(default_factory=dict)
    owner: list[int] = field(default_factory=list)
    partitions: list[list[tuple[int, int]]] = field(default_factory=list)


def _group_of_flat(count: int, groups: list[dict[str, Any]] | None, where: str) -> list[int]:
    """ZeRO-3: the param group owning each flat sub-group (the inner optimizer's groups list sub-group indices)."""
    if groups is None:
        return list(range(count))
    owner = [-1] * count
    for g, group in enumerate(groups):
        params = group.get("params", [])
        for k in params if isinstance(params, list) else []:
            if isinstance(k, int) and 0 <= k < count:
                owner[k] = g
    if -1 in owner:
        raise FormatError(f"{where}: flat sub-group {owner.index(-1)} belongs to no optimizer param group")
    return owner


def zero3_layout(
    param_shapes: list[Any],
    lengths: list[list[int]],
    groups: list[dict[str, Any]] | None,
    where: str,
    rank_file: Callable[[int], str],
) -> Layout:
    """The ZeRO-3 layout; ``lengths[r][k]`` is the element count of rank ``r``'s flat sub-group ``k``, which must match
    exactly."""
    world = len(lengths)
    if len(lengths[0]) != len(param_shapes) or any(len(x) != len(lengths[0]) for x in lengths):
        raise FormatError(
            f"{where}: {len(param_shapes)} sub-groups in param_shapes, but the ranks hold "
            f"{[len(x) for x in lengths][:8]} flat groups"
        )
    owner = _group_of_flat(len(param_shapes), groups, rank_file(0))
    params: dict[str, Param] = {}
    for k, shapes in enumerate(param_shapes):
        offset = 0
        for name, shape in shapes_of(shapes, f"{where}: param_shapes[{k}]").items():
            if name in params:
                raise FormatError(f"{where}: parameter {short(name)} listed twice in param_shapes")
            params[name] = Param(name, shape, owner[k], k, offset)
            offset += math.ceil(numel(shape) / world)
        for r in range(world):
            if lengths[r][k] != offset:
                raise FormatError(
                    f"{rank_file(r)}: flat sub-group {k} holds {lengths[r][k]} elements, but its parameters need "
                    f"{offset} on each rank"
                )
    return Layout(params, owner)


def zero12_layout(
    param_shapes: list[Any],
    lengths: list[list[int]],
    first: dict[str, Any],
    where: str,
    rank_file: Callable[[int], str],
) -> Layout:
    """The ZeRO-1/2 layout; ``first`` is rank 0's optimizer state (partition counts, alignment paddings)."""
    world = len(lengths)
    counts = first.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if any(c != world for c in counts):
        raise FormatError(
            f"{rank_file(0)}: partition counts {short(counts)} differ from the {world} ranks (MoE groups are not "
            "supported)"
        )
    if len(lengths[0]) != len(param_shapes) or any(len(x) != len(param_shapes) for x in lengths):
        raise FormatError(
            f"{where}: {len(param_shapes)} param groups in param_shapes, but the ranks hold "
            f"{[len(x) for x in lengths][:8]} flat groups"
        )
    paddings = first.get("param_alignment_paddings")
    params: dict[str, Param] = {}
    partitions: list[list[tuple[int, int]]] = []
    align = 2 * world
    for g, shapes in enumerate(param_shapes):
        parsed = shapes_of(shapes, f"{where}: param_shapes[{g}]")
        pads = (
            paddings[g]
            if isinstance(paddings, list) and g < len(paddings) and isinstance(paddings[g], list)
            else [0] * len(parsed)
        )
        if len(pads) != len(parsed) or not all(small_int(p) is not None and p >= 0 for p in pads):
            raise FormatError(
                f"{rank_file(0)}: param_alignment_paddings[{g}] does not match the group's {len(parsed)} parameters"
            )
        offset = end = 0
        for (name, shape), pad in zip(parsed.items(), pads):
            if name in params:
                raise FormatError(f"{where}: parameter {short(name)} listed twice in param_shapes")
            params[name] = Param(name, shape, g, g, offset)
            end = offset + numel(shape)
            offset = end + pad
        start, parts = 0, []
        for r in range(world):
            parts.append((start, lengths[r][g]))
            start += lengths[r][g]
        # zero_to_fp32's check, and every element covered
        if math.ceil(offset / align) != math.ceil(start / align) or end > start:
            raise FormatError(f"{where}: param group {g} needs {offset} elements, the ranks hold {start}")
        partitions.append(parts)
    return Layout(params, list(range(len(param_shapes))), partitions)
