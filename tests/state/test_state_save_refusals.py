"""One validation, both directions: what a load refuses, a save refuses first, before writing.

For every limit a reader enforces on the JSON and tensor keys of a checkpoint, a save of a value
that would break it must raise the same error class (FormatError) and leave nothing on disk (no
folder, no hidden temporary); at the boundary, the largest value the save accepts must load back
exactly, and a checkpoint crafted one step past it must be refused by the load. A manager root
is not poisoned: a refused save leaves the root as it was and the next save works.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardsafe
from dist_utils import typed
from reliability import record
from shardsafe.core.integrity import hash_bytes
from shardsafe.errors import FormatError, ShardsafeError


def _nothing_written(folder: Path) -> None:
    assert os.listdir(folder) == [], f"a refused save left {os.listdir(folder)}"


def _circular() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


# (state, metadata, regex of the FormatError)
REFUSED: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[], Any], str]] = {
    "int with 5000 digits": (lambda: {"v": 10**5000}, lambda: None, "cannot be stored as JSON"),
    "circular list": (lambda: {"v": _circular()}, lambda: None, "deeper than 64 levels .or circular"),
    "lists 100 deep": (lambda: {"v": _nest(100)}, lambda: None, "deeper"),
    "tuple key": (lambda: {"v": {(1, 2): 3}}, lambda: None, "cannot be stored"),
    "object value": (lambda: {"v": object()}, lambda: None, "cannot store without pickle"),
    "tensor named __metadata__": (lambda: {"__metadata__": torch.ones(2)}, lambda: None, "invalid tensor key"),
    "tensor under a lone surrogate": (lambda: {"v": {"\ud800": torch.ones(2)}}, lambda: None, "not valid UTF-8"),
    "tensor of 17 dimensions": (lambda: {"t": torch.zeros([1] * 17)}, lambda: None, "more than 16 dimensions"),
    "complex128 tensor": (
        lambda: {"t": torch.zeros(2, dtype=torch.complex128)},
        lambda: None,
        "cannot be stored by shardsafe",
    ),
    "metadata int key": (lambda: {"v": 1}, lambda: {1: "a"}, "JSON keys must be strings"),
    "metadata int and str key 1": (lambda: {"v": 1}, lambda: {1: "a", "1": "b"}, "JSON keys must be strings"),
    "metadata nested int key": (lambda: {"v": 1}, lambda: {"a": [{"b": {2.5: 1}}]}, "JSON keys must be strings"),
    "metadata not a dict": (lambda: {"v": 1}, lambda: [1, 2], "must be a dict"),
    "metadata numpy float": (lambda: {"v": 1}, lambda: {"loss": np.float32(1.5)}, "cannot be stored as JSON"),
    "metadata tensor": (lambda: {"v": 1}, lambda: {"loss": torch.tensor(1.0)}, "cannot be stored as JSON"),
    "metadata int with 5000 digits": (lambda: {"v": 1}, lambda: {"n": 10**5000}, "cannot be stored as JSON"),
    "metadata circular": (lambda: {"v": 1}, lambda: {"loop": _circular()}, "deeper than 64|circular"),
    "metadata 64 deep": (lambda: {"v": 1}, lambda: {"m": _nest(64)}, "deeper"),
    # JSON would turn an escaped high+low surrogate pair into one character: not exact, refused
    "surrogate pair in a string": (lambda: {"v": ["\ud83d\ude00"]}, lambda: None, "surrogate pair"),
    "surrogate pair in a key": (lambda: {"v": {"a\udbff\udfff": 1}}, lambda: None, "surrogate pair"),
    "surrogate pair in metadata": (lambda: {"v": 1}, lambda: {"s": {"x": "\ud800\udc00"}}, "surrogate pair"),
    "surrogate pair in a metadata key": (lambda: {"v": 1}, lambda: {"\ud800\udc00": 1}, "surrogate pair"),
}


def _nest(depth: int, inner: Any = None) -> Any:
    value = inner if inner is not None else []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("name", list(REFUSED))
def test_save_refuses_before_writing(tmp_path: Path, name: str) -> None:
    make_state, make_metadata, pattern = REFUSED[name]
    with pytest.raises(FormatError, match=pattern):
        shardsafe.save(tmp_path / "ckpt", make_state(), metadata=make_metadata())
    _nothing_written(tmp_path)
    record("save refuses before writing what load refuses", faults=1)


def test_bad_state_names_are_refused_before_writing(tmp_path: Path) -> None:
    for bad in ["", "a/b", 3]:
        with pytest.raises(ShardsafeError, match="state keys must be non-empty strings"):
            shardsafe.save(tmp_path / "ckpt", {bad: 1})  # type: ignore[dict-item]
    _nothing_written(tmp_path)


# ----------------------------------------------------------------------------- at the boundary


def _nested_dicts(depth: int) -> Any:
    value: Any = {}
    for i in range(depth - 1):
        value = {f"k{i}": value}
    return value


def _nested_tuples(depth: int) -> Any:
    value: Any = ()
    for _ in range(depth - 1):
        value = (value,)
    return value


def _nested_int_keys(depth: int) -> Any:
    value: Any = {}
    for i in range(depth - 1):
        value = {i: value}
    return value


FAMILIES: dict[str, Callable[[int], Any]] = {
    "lists": _nest,
    "dicts": _nested_dicts,
    "tuples": _nested_tuples,
    "int-keyed dicts": _nested_int_keys,
}


def _saves(folder: Path, state: dict[str, Any], metadata: Any = None) -> bool:
    try:
        shardsafe.save(folder, state, metadata=metadata)
    except FormatError:
        assert not folder.exists() and not [n for n in os.listdir(folder.parent) if n.startswith(".")], (
            "a refused save left files"
        )
        return False
    return True


def _deepest(folder: Path, make: Callable[[int], Any], as_metadata: bool = False) -> int:
    """The largest nesting the save accepts (it refuses every deeper one: checked up to 120)."""
    accepted = []
    for depth in range(1, 121):
        target = folder / f"d{depth}"
        target.parent.mkdir(exist_ok=True)
        ok = _saves(target, {"v": 0}, {"m": make(depth)}) if as_metadata else _saves(target, {"v": make(depth)})
        if ok:
            accepted.append(depth)
    assert accepted == list(range(1, len(accepted) + 1)), "the accepted depths are not a prefix"
    return len(accepted)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_deepest_value_a_save_accepts_loads_and_one_deeper_is_refused_both_ways(
    tmp_path: Path, family: str
) -> None:
    make = FAMILIES[family]
    deepest = _deepest(tmp_path, make)
    assert 20 <= deepest <= 64, deepest
    state: dict[str, Any] = {"v": None}
    shardsafe.load(tmp_path / f"d{deepest}", state)
    assert typed(state["v"]) == typed(make(deepest))
    # Deeper, written by hand (three JSON levels, as one more int-keyed dict takes): the load
    # refuses it with the error the save gave.
    crafted = tmp_path / f"d{deepest}"
    tree = json.loads((crafted / "state.json").read_text())
    tree["v"]["state"] = [[[tree["v"]["state"]]]]
    data = json.dumps(tree).encode()
    (crafted / "state.json").write_bytes(data)
    manifest = json.loads((crafted / "manifest.json").read_text())
    manifest["state"].update(size=len(data), hash=hash_bytes(data))
    (crafted / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="deeper than 64"):
        shardsafe.load(crafted, {"v": None})
    with pytest.raises(FormatError, match="deeper than 64"):
        shardsafe.verify(crafted)
    record("save refuses before writing what load refuses", cases=120, faults=120 - deepest + 2)


def test_the_deepest_metadata_a_save_accepts_loads(tmp_path: Path) -> None:
    deepest = _deepest(tmp_path, _nested_dicts, as_metadata=True)
    assert 20 <= deepest <= 64, deepest
    assert shardsafe.load(tmp_path / f"d{deepest}", {"v": None}) == {"m": _nested_dicts(deepest)}
    manifest = json.loads((tmp_path / f"d{deepest}" / "manifest.json").read_text())
    manifest["metadata"] = {"m": {"deeper": manifest["metadata"]["m"]}}
    (tmp_path / f"d{deepest}" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="deeper than 64"):
        shardsafe.load(tmp_path / f"d{deepest}", {"v": None})


def test_values_the_load_accepts_round_trip(tmp_path: Path) -> None:
    """The positive side: NaN, infinities, -0.0, a 4300-digit int, surrogates and long strings are
    accepted by both directions, and come back exactly (types included)."""
    value = {
        "floats": [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308],
        "int": -(10**4299),
        "surrogates": "a\ud800b\udfff",
        "keys": {None: 1, True: 2, 3: 3, 2.5: 4, "\udc80": 5, "__tensor__": 6},
        "long": "x" * (1 << 20),
        "tuple": (1, (2.0, [3])),
        "dtype": torch.bfloat16,
    }
    metadata = {"nan": math.nan, "inf": [math.inf], "text": "\U0001f600 \ud800"}
    shardsafe.save(tmp_path / "ckpt", {"v": value}, metadata=metadata)
    state: dict[str, Any] = {"v": None}
    got = shardsafe.load(tmp_path / "ckpt", state)
    assert typed(state["v"]).__repr__() == typed(value).__repr__()  # repr: nan != nan, but 'nan' == 'nan'
    assert repr(got) == repr(metadata)


# ----------------------------------------------------------------------------- a manager root


def test_a_refused_manager_save_does_not_poison_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = torch.nn.Linear(3, 2)
    with shardsafe.CheckpointManager(root, save_every=1, keep_last=2) as manager:
        manager.save(1, {"model": model})
        before = sorted(os.listdir(root))
        with pytest.raises(FormatError, match="deeper"):
            manager.save(2, {"model": model, "deep": _nest(80)})
        with pytest.raises(FormatError, match="cannot be stored as JSON"):
            manager.save(3, {"model": model}, metrics={"loss": np.float32(0.5)})
        assert sorted(os.listdir(root)) == before, "a refused save left something in the root"
        manager.save(4, {"model": model}, metrics={"loss": 0.5})
    assert [c.step for c in shardsafe.list_checkpoints(root)] == [1, 4]
    fresh = torch.nn.Linear(3, 2)
    shardsafe.load(root / "step-0000000004", {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)
    record("save refuses before writing what load refuses", faults=2, checked=1)
