"""The one table of state adapters: which adapter takes which value, and what ``inspect`` can ask it.

Every kind has exactly one adapter; a live value is matched in the table's order (a per-rank
stateful before a plain stateful, a plain value last); save, load and the entry summaries all go
through it, and no module of api/ or state/ branches on kinds any more.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.cli.inspect import describe_checkpoint
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.state import base
from shardsafe.state.registry import ADAPTERS, adapter_for, adapter_for_kind, display_shapes, summarize_entry

SRC = Path(__file__).resolve().parents[2] / "src" / "shardsafe"


class PerRank:
    per_rank = True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class OnlyStateDict:
    def state_dict(self) -> dict[str, Any]:
        return {}


def test_every_kind_has_exactly_one_adapter() -> None:
    kinds = [getattr(base, name) for name in dir(base) if name.startswith("KIND_")]
    assert sorted(a.kind for a in ADAPTERS) == sorted(kinds)
    for kind in kinds:
        adapter = adapter_for_kind(kind)
        assert adapter is not None and adapter.kind == kind
    assert adapter_for_kind("pickle") is None and adapter_for_kind(None) is None


def _values() -> list[tuple[Any, str]]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return [
        (model, base.KIND_MODULE),
        (optimizer, base.KIND_OPTIMIZER),
        (shardsafe.RNGState(), base.KIND_PER_RANK),
        (PerRank(), base.KIND_PER_RANK),
        (torch.ones(2), base.KIND_TENSOR),
        (torch.optim.lr_scheduler.StepLR(optimizer, 1), base.KIND_STATEFUL),
        ({"step": 3}, base.KIND_VALUE),
        (OnlyStateDict(), base.KIND_VALUE),  # no load_state_dict: a plain value (which the save then refuses)
    ]


@pytest.mark.parametrize("index", range(8))
def test_a_value_gets_the_first_adapter_that_matches(index: int) -> None:
    value, kind = _values()[index]
    assert adapter_for(value).kind == kind


def test_summaries_are_what_inspect_shows(tmp_path: Path) -> None:
    """inspect's own per-kind description and the registry's summaries agree, entry for entry."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": model,
        "optim": optimizer,
        "sched": torch.optim.lr_scheduler.StepLR(optimizer, 2),
        "rng": shardsafe.RNGState(),
        "t": torch.arange(5),
        "step": {"n": 7},
    }
    shardsafe.save(tmp_path / "ckpt", state)
    manifest, tree = open_checkpoint(tmp_path / "ckpt")
    ours = [summarize_entry(name, entry, manifest) for name, entry in tree.items()]
    assert ours == describe_checkpoint(tmp_path / "ckpt")["state"]
    assert [e["kind"] for e in ours] == ["module", "optimizer", "stateful", "tensor", "value", "per_rank"]
    assert ours[0]["tensors"] == 4 and ours[1]["tensors"] == 12 and ours[5]["ranks"] == 1
    assert summarize_entry("odd", {"kind": "pickle"}, manifest) == {"name": "odd", "kind": "pickle"}
    assert display_shapes(tree) == {}


# api/source.py (whole tensors for export) still reads engine entries itself: not part of this table's work.
CHECKED = [
    *(SRC / "state").glob("*.py"),
    *(SRC / "api" / name for name in ("checkpoint.py", "load.py", "save.py", "verify.py", "location.py")),
]


def test_no_kind_dispatch_left_outside_the_registry() -> None:
    """The save, load and verify paths ask the table: a kind compared with a constant, or a value
    tested for being an engine or an optimizer, would be a parallel chain."""
    pattern = re.compile(
        r"(\.get\(\"kind\"\)|\bkind)\s*(==|!=|in)\s*(\(|KIND_)|==\s*KIND_|is_deepspeed_engine\(|isinstance\([^)]*Optimizer\)"
    )
    hits = []
    for path in sorted(CHECKED):
        if path.name in ("deepspeed_engine.py", "optimizer.py"):  # the engine's and the optimizer's own adapters
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and not line.lstrip().startswith(("def ", "#")):
                hits.append(f"{path.name}:{number}: {line.strip()}")
    assert hits == [], "\n".join(hits)
