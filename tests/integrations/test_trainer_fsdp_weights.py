"""The FSDP2 path of a ShardsafeTrainer checkpoint that is a model folder (issue 38), below the Trainer (on CPU the
Trainer runs DDP, so it never builds an FSDP2 model here): 2 gloo ranks, a ``fully_shard``ed model, the ``weights``
entry of whole tensors each gathered by both ranks and kept by one, committed with its index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from dist_utils import make_model, run_ranks, shard  # noqa: E402

WORLD = 2


def save_fsdp_checkpoint(rank: int, world_size: int, path: str) -> list[str]:
    from shardsafe.api.checkpoint import describe_collectively, location, write_checkpoint
    from shardsafe.core.comm import get_comm
    from shardsafe.integrations.transformers.model_index import ModelIndexCommit, full_state_tensors, whole_weights
    from shardsafe.protocol.commit import LocalCommit, prepare_save

    model = shard(make_model(0), world_size)
    comm = get_comm()
    weights = whole_weights(*full_state_tensors(model), comm)
    state: dict[str, Any] = {"model": model, "weights": weights}
    target = prepare_save(comm, location(path), overwrite=False)
    assert isinstance(target, LocalCommit)
    write_checkpoint(
        location(path),
        describe_collectively(state, comm),
        comm,
        target=ModelIndexCommit(target, "weights/", {}),
        plain_names="weights/",
    )
    return sorted(weights)


def test_fsdp2_weights_entry_makes_the_checkpoint_a_model_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    import shardsafe

    path = tmp_path / "checkpoint-1"
    kept = run_ranks(save_fsdp_checkpoint, WORLD, str(path), work_dir=tmp_path / "work")
    expected = make_model(0).state_dict()
    assert sorted(kept[0] + kept[1]) == sorted(expected) and kept[0] and kept[1], "each tensor kept by one rank"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00000.safetensors", "model-00001.safetensors"]
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        loaded |= load_file(path / file)
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    assert shardsafe.verify(path)["state_entries"] == ["model", "weights"]
