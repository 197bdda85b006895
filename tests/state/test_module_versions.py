"""Per-module ``_version`` (torch's ``state_dict()._metadata``) is saved with a module entry and handed
to the module's own ``_load_from_state_dict`` (its ``local_metadata``) on the custom load path, so a
class at version 2 migrates what its version-1 predecessor saved; a checkpoint without versions
(written before they were saved) gets the live classes' versions, as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.errors import FormatError


class OldLayer(nn.Module):
    """Version 1 of the layer: its weight was called ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))


class NewLayer(nn.Module):
    """Version 2 renamed ``w`` to ``weight``; its _load_from_state_dict migrates version-1 dicts."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, 4))
        self.seen: list[Any] = []

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, *args: Any) -> None:
        version = local_metadata.get("version")
        self.seen.append(version)
        if (version or 1) < 2:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _model(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), layer)


def test_version_1_checkpoint_migrated_by_version_2_class(tmp_path: Path) -> None:
    old = _model(OldLayer())
    shardsafe.save(tmp_path / "v1", {"model": old})
    entry = json.loads((tmp_path / "v1" / "state.json").read_text())["model"]
    assert entry["versions"] == {"1": 2}  # BatchNorm1d is at version 2; version 1 (the default) is left out
    new = _model(NewLayer())
    shardsafe.load(tmp_path / "v1", {"model": new})
    assert new[2].seen == [1] and torch.equal(new[2].weight, old[2].w)

    shardsafe.save(tmp_path / "v2", {"model": new})  # saved at version 2: no migration
    again = _model(NewLayer())
    shardsafe.load(tmp_path / "v2", {"model": again})
    assert again[2].seen == [2] and torch.equal(again[2].weight, old[2].w)


def test_checkpoint_without_versions_gets_live_versions(tmp_path: Path) -> None:
    new = _model(NewLayer())
    new[2].weight.data.normal_()
    shardsafe.save(tmp_path / "ck", {"model": new})
    state_file = tmp_path / "ck" / "state.json"
    tree = json.loads(state_file.read_text())
    del tree["model"]["versions"]  # as an earlier release wrote it
    _rewrite_state(tmp_path / "ck", tree)
    target = _model(NewLayer())
    shardsafe.load(tmp_path / "ck", {"model": target})
    assert target[2].seen == [2] and torch.equal(target[2].weight, new[2].weight)

    tree["model"]["versions"] = {"2": "two"}
    _rewrite_state(tmp_path / "ck", tree)
    with pytest.raises(FormatError, match="'versions' must map module names to integer versions"):
        shardsafe.load(tmp_path / "ck", {"model": _model(NewLayer())})


def _rewrite_state(folder: Path, tree: dict[str, Any]) -> None:
    """Replace state.json and update its size and hash in the manifest (a test of the reader, not of integrity)."""
    import xxhash

    path = folder / "state.json"
    path.write_text(json.dumps(tree))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["state"] |= {"size": path.stat().st_size, "hash": xxhash.xxh3_64_hexdigest(path.read_bytes())}
    (folder / "manifest.json").write_text(json.dumps(manifest))
