"""Attacker pass on the save side of each integration: names holding ``/``, ``..``, NUL, thousands of characters,
or shardsafe's own markers, as parameter names, state names and keys of saved values. Each is either saved and
loaded back exactly (names are data, never paths: nothing appears outside the checkpoint folder) or refused by
the save, naming the key, with nothing published. One process each (ShardsafeTrainer, LightningCheckpoints,
ShardsafeCheckpointManager)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from shardsafe.errors import SaveError, ShardsafeError  # noqa: E402
from shardsafe.integrations.lightning.checkpoints import LightningCheckpoints  # noqa: E402

ODD = ["a/b", "x\x00y", "L" * 300, "model/w", "..", "../../etc"]  # "." is refused by torch itself in module names


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


class OddNames(torch.nn.Module):
    """Parameters registered under odd (but torch-legal: no '.') names; a loss from all of them."""

    def __init__(self, names: list[str], size: int = 32) -> None:
        super().__init__()
        self.names = names
        for i, name in enumerate(names):
            self.register_parameter(name, torch.nn.Parameter(torch.full((size,), float(i + 1))))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"loss": sum(getattr(self, n)[input_ids].pow(2).mean() for n in self.names)}  # type: ignore[dict-item]


LEGAL = [n for n in ODD if "." not in n]


# ---------------------------------------------------------------------------------------------------- Lightning


def test_lightning_odd_parameter_names_round_trip(tmp_path: Path) -> None:
    model = OddNames(LEGAL, size=4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.tensor([0, 1]))["loss"].backward()
    optimizer.step()
    LightningCheckpoints().save(
        tmp_path / "ckpt", {"state_dict": {}, "optimizer_states": [{}], "epoch": 0}, model, [optimizer]
    )
    fresh = OddNames(LEGAL, size=4)
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    LightningCheckpoints().load(tmp_path / "ckpt", fresh, [fresh_optimizer])
    for name in LEGAL:
        assert torch.equal(getattr(fresh, name), getattr(model, name)), repr(name)
        saved, loaded = optimizer.state[getattr(model, name)], fresh_optimizer.state[getattr(fresh, name)]
        assert torch.equal(saved["exp_avg"], loaded["exp_avg"]), repr(name)
    assert tree(tmp_path)[0] == "ckpt" and all(p.startswith("ckpt") for p in tree(tmp_path))


def test_lightning_odd_keys_in_the_rest_round_trip(tmp_path: Path) -> None:
    """Keys of Lightning's other entries (callbacks' states...), shardsafe's own tensor marker among them."""
    callbacks: dict[Any, Any] = {name: {"v": i} for i, name in enumerate(ODD)}
    callbacks["L" * 100_000] = 1
    callbacks[7] = "an int key"
    callbacks["marker"] = {"__tensor__": "state_dict/weight"}  # looks like shardsafe's tensor reference
    callbacks["tensor"] = torch.arange(3)
    checkpoint = {"state_dict": {}, "epoch": 0, "callbacks": callbacks}
    LightningCheckpoints().save(tmp_path / "ckpt", checkpoint, torch.nn.Linear(2, 2), [])
    rest = LightningCheckpoints().load(tmp_path / "ckpt", torch.nn.Linear(2, 2), [])
    loaded = rest["callbacks"]
    assert sorted(map(str, loaded)) == sorted(map(str, callbacks))
    assert all(loaded[k] == v for k, v in callbacks.items() if k != "tensor")
    assert torch.equal(loaded["tensor"], callbacks["tensor"])
    assert all(p.startswith("ckpt") for p in tree(tmp_path))


@pytest.mark.parametrize(
    ("value", "match"),
    [({("a", 1): 1}, r"dict key \('a', 1\) of type tuple"), ({"k": b"\x00"}, "has type bytes")],
    ids=["tuple-key", "bytes"],
)
def test_lightning_unstorable_rest_is_refused_before_writing(tmp_path: Path, value: Any, match: str) -> None:
    checkpoint = {"state_dict": {}, "epoch": 0, "callbacks": value}
    with pytest.raises(ShardsafeError, match=rf"entry 'callbacks' cannot be saved.*{match}.*Remedy"):
        LightningCheckpoints().save(tmp_path / "ckpt", checkpoint, torch.nn.Linear(2, 2), [])
    assert tree(tmp_path) == []


# ---------------------------------------------------------------------------------------------------- torchtitan


class Values:
    """A stateful of plain values (what torchtitan passes in ``states``)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = dict(state)


def titan_manager(base: Path, states: dict[str, Any]) -> Any:
    """ShardsafeCheckpointManager as torchtitan's Trainer builds it, on one process (a plain optimizer, no
    dataloader or scheduler)."""
    pytest.importorskip("torchtitan")
    from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager

    model = torch.nn.Linear(2, 2)
    config = ShardsafeCheckpointManager.Config(enable=True, folder="ckpt", interval=1)
    return config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=torch.optim.Adam(model.parameters()),
        lr_schedulers=None,
        states=states,
        sd_adapter=None,
        base_folder=str(base),
    )


@pytest.mark.parametrize("name", ["a/b", "../../etc"])
def test_torchtitan_state_name_with_a_slash_is_refused_by_the_save(tmp_path: Path, name: str) -> None:
    manager = titan_manager(tmp_path, {name: Values({"x": 1})})
    try:
        with pytest.raises(ShardsafeError, match=rf"state keys must be non-empty strings without '/', got '{name}'"):
            manager.save(curr_step=1)
    finally:
        manager.close()
    assert not [p for p in tree(tmp_path) if "step-" in p], "nothing published"
    assert all(p.startswith("ckpt") for p in tree(tmp_path))


def test_torchtitan_odd_state_names_and_value_keys_round_trip(tmp_path: Path) -> None:
    names = ["..", "x\x00y", "L" * 300]
    values = {
        name: {**{k: i for i, k in enumerate(ODD)}, "t": torch.full((2,), float(i))} for i, name in enumerate(names)
    }
    manager = titan_manager(tmp_path, {name: Values(v) for name, v in values.items()})
    manager.save(curr_step=1)
    manager.close()
    restored = {name: Values({}) for name in names}
    resumed = titan_manager(tmp_path, restored)
    resumed.load(step=-1)
    resumed.close()
    for name in names:
        got = restored[name].values
        assert {k: v for k, v in got.items() if k != "t"} == {k: i for i, k in enumerate(ODD)}, repr(name)
        assert torch.equal(got["t"], values[name]["t"])
    assert all(p.startswith("ckpt") for p in tree(tmp_path))


# ------------------------------------------------------------------------------------------------ ShardsafeTrainer


def _odd_model() -> torch.nn.Module:
    return OddNames(LEGAL)


def test_trainer_odd_parameter_names_save_resume_and_stay_a_model_folder(tmp_path: Path) -> None:
    """The names go into model.safetensors as they are (a model folder) and the resume restores them."""
    pytest.importorskip("transformers")
    from safetensors import safe_open

    from hf_trainer_utils import small_trainer

    first = small_trainer(tmp_path / "out", max_steps=2, model=_odd_model)
    first.train()
    with safe_open(str(tmp_path / "out" / "checkpoint-1" / "model.safetensors"), "pt") as weights:
        assert sorted(weights.keys()) == sorted(LEGAL)
    resumed = small_trainer(tmp_path / "out", max_steps=2, model=_odd_model)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), repr(name)
    assert all(p.startswith("out") for p in tree(tmp_path))


def test_trainer_parameter_named_like_the_safetensors_metadata_is_refused(tmp_path: Path) -> None:
    """A parameter named ``__metadata__`` (safetensors' reserved header key): the first save refuses, naming it,
    and publishes nothing."""
    pytest.importorskip("transformers")
    from hf_trainer_utils import small_trainer

    trainer = small_trainer(tmp_path / "out", max_steps=1, model=lambda: OddNames(["w", "__metadata__"]))
    with pytest.raises(SaveError, match="__metadata__") as caught:
        trainer.train()
    assert "nothing was published" in str(caught.value)
    assert not [p for p in tree(tmp_path) if "checkpoint-" in p and not os.path.basename(p).startswith(".")]
