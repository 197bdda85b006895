"""A version-1 checkpoint written by an earlier release keeps loading, bit for bit.

The fixture (tests/fixtures/v1, see its README) was written by shardsafe at format version 1 on 2
FSDP2 ranks; here it is loaded into a plain module + AdamW in one process (a reshard 2 -> 1) and
checked, and ``verify`` checks every block of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

import shardsafe
from dist_utils import full_model_state, full_optimizer_state, make_model, make_optimizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v1"


def test_version_1_checkpoint_loads_bit_exactly(tmp_path: Path) -> None:
    ckpt = tmp_path / "v1"
    shutil.copytree(FIXTURE / "fsdp2-2ranks", ckpt)  # loading never writes, but keep the fixture pristine
    assert json.loads((ckpt / "manifest.json").read_text())["format_version"] == 1
    model = make_model(seed=999)
    optimizer = make_optimizer(model, lr=0.5)
    shardsafe.load(ckpt, {"model": model, "optim": optimizer})
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    got = {f"model/{k}": v for k, v in full_model_state(model).items()}
    optim = full_optimizer_state(model, optimizer)
    for name, entries in optim["state"].items():
        for k, v in entries.items():
            got[f"optim/{name}/{k}"] = v
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key
    groups = json.loads((FIXTURE / "expected_groups.json").read_text())
    assert [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in optim["param_groups"]] == groups


def test_version_1_checkpoint_verifies() -> None:
    summary = shardsafe.verify(FIXTURE / "fsdp2-2ranks")
    assert summary["format_version"] == 1
    assert summary["bytes_checked"] > 0
    assert summary["world_size"] == 2
