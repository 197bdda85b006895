"""Merging the ranks' state trees (pipeline stages hold different state): union of names and keys,
one value per name, disagreements refused with both ranks named; optimizer param groups joined."""

from __future__ import annotations

import pytest

from shardsafe.core.values import merge_values
from shardsafe.errors import SaveError
from shardsafe.state.registry import merge_trees


def _optim(params: list[str], lr: float = 0.1, state: dict | None = None) -> dict:
    return {
        "kind": "optimizer",
        "state": {
            "state": state or {},
            "param_groups": [{"lr": lr, "betas": {"__tuple__": [0.9, 0.95]}, "params": params}],
        },
    }


def test_stage_trees_merge() -> None:
    a = {
        "model": {"kind": "module", "state": {"layers.0.w": {"__tensor__": "model/layers.0.w"}}},
        "optim": _optim(["layers.0.w"]),
        "only0": {"kind": "value", "state": 1},
    }
    b = {
        "model": {"kind": "module", "state": {"layers.1.w": {"__tensor__": "model/layers.1.w"}}},
        "optim": _optim(["layers.1.w"]),
    }
    c = {
        "model": {"kind": "module", "state": {"layers.1.w": {"__tensor__": "model/layers.1.w"}}},
        "optim": _optim(["layers.1.w"]),
    }
    merged = merge_trees([a, b, c])
    assert list(merged) == ["model", "optim", "only0"]
    assert merged["model"]["state"] == {
        "layers.0.w": {"__tensor__": "model/layers.0.w"},
        "layers.1.w": {"__tensor__": "model/layers.1.w"},
    }
    assert merged["optim"]["state"]["param_groups"] == [
        {"lr": 0.1, "betas": {"__tuple__": [0.9, 0.95]}, "params": ["layers.0.w", "layers.1.w"]}
    ]


@pytest.mark.parametrize(
    ("a", "b", "where"),
    [
        (
            {"s": {"kind": "stateful", "state": {"last_epoch": 3}}},
            {"s": {"kind": "stateful", "state": {"last_epoch": 4}}},
            "state['s']/state/last_epoch",
        ),
        # 1 and 1.0 are two values
        ({"s": {"kind": "value", "state": 1}}, {"s": {"kind": "value", "state": 1.0}}, "state['s']/state"),
        ({"o": _optim(["a"], lr=0.1)}, {"o": _optim(["b"], lr=0.2)}, "param group 0/lr"),
        (
            {"s": {"kind": "value", "state": {"__tuple__": [1, 2]}}},
            {"s": {"kind": "value", "state": {"__tuple__": [1, 3]}}},
            "state['s']/state",
        ),
    ],
)
def test_disagreements_name_both_ranks_and_where(a: dict, b: dict, where: str) -> None:
    with pytest.raises(SaveError) as info:
        merge_trees([a, b])
    assert where in str(info.value) and "rank 0" in str(info.value) and "rank 1" in str(info.value)


def test_kinds_and_group_counts_must_agree() -> None:
    with pytest.raises(SaveError, match="one name must be one kind"):
        merge_trees([{"x": {"kind": "value", "state": 1}}, {"x": {"kind": "stateful", "state": {}}}])
    two = _optim(["a"])
    two["state"]["param_groups"].append({"lr": 0.1, "params": ["c"]})
    with pytest.raises(SaveError, match="numbers of param groups"):
        merge_trees([{"o": _optim(["a"])}, {"o": two}])


def test_long_values_are_cut_in_messages() -> None:
    with pytest.raises(SaveError) as info:
        merge_values([(0, "x" * 5000), (1, "y" * 5000)], "state['v']")
    assert len(str(info.value)) < 600
