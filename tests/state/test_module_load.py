"""Modules that customise loading are loaded through their own code, after every byte is verified.

The motivating model is transformers' ``test_resume_batch_order`` one: a buffer that grows during
training and a ``load_state_dict`` override that resizes it. Around it: ``_load_from_state_dict``
overrides with a version upgrade, load hooks paired with state-dict hooks that rename keys, a
custom subtree inside an otherwise in-place model, atomicity (a damaged file, a later failure, the
module's own refusal), ``atomic=False``, and FSDP2 / DDP on 2 gloo ranks with resharding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from dist_utils import run_ranks
from shardsafe.errors import IntegrityError, StateMismatchError
from shardsafe.state.module_load import custom_roots


class OrderModel(nn.Module):
    """transformers' test_resume_batch_order model: ``data_order`` grows with every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10, bias=False)
        self.register_buffer("data_order", torch.empty(0, dtype=torch.long))
        self.loads = 0

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        self.loads += 1
        if "data_order" in state_dict and self.data_order.shape != state_dict["data_order"].shape:
            self.data_order = state_dict["data_order"].clone()
        return super().load_state_dict(state_dict, strict=strict)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.data_order = torch.cat([self.data_order, x[:, 0].long()])
        return self.fc(x)


class Legacy(nn.Module):
    """Version 2 renamed ``w`` to ``weight``; its _load_from_state_dict upgrades version-1 dicts."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, *args: Any) -> None:
        self.seen_version = local_metadata.get("version")
        if (local_metadata.get("version") or 1) < 2 and prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


class Packed(nn.Module):
    """Saves ``packed`` as two halves ``lo``/``hi`` (a state-dict hook) and joins them on load (a pre-hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.packed = nn.Parameter(torch.randn(4, 3))
        self._register_state_dict_hook(Packed._split)
        self.register_load_state_dict_pre_hook(Packed._join)

    @staticmethod
    def _split(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        packed = state.pop(prefix + "packed")
        state[prefix + "lo"], state[prefix + "hi"] = packed[:2].clone(), packed[2:].clone()

    @staticmethod
    def _join(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "lo" in state:
            state[prefix + "packed"] = torch.cat([state.pop(prefix + "lo"), state.pop(prefix + "hi")])


class Mixed(nn.Module):
    """Plain layers (read in place) around customised ones (through their own code)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.legacy = Legacy()
        self.packed = Packed()
        self.norm = nn.BatchNorm1d(4)
        self.last = nn.Linear(4, 4)


class Failing:
    """A stateful object whose load_state_dict raises: everything loaded before it is undone."""

    def state_dict(self) -> dict[str, Any]:
        return {"x": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("refused on purpose")


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def _trained_order_model() -> OrderModel:
    torch.manual_seed(0)
    model = OrderModel()
    for step in range(6):
        model(torch.arange(step * 2, step * 2 + 2, dtype=torch.float).repeat(10, 1).T)
    return model


def test_which_modules_take_their_own_path() -> None:
    """Own code: overrides and user hooks. In place: plain layers, torch's norm layers."""
    mixed = Mixed()
    assert [(r.prefix, type(r.module).__name__) for r in custom_roots(mixed, True)] == [
        ("legacy", "Legacy"),
        ("packed", "Packed"),
    ]
    assert custom_roots(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.InstanceNorm1d(2)), True) == []
    assert [r.prefix for r in custom_roots(nn.Sequential(nn.LazyLinear(2)), True)] == ["0"]  # its load pre-hook
    assert [r.prefix for r in custom_roots(OrderModel(), True)] == [""]
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), torch.compile(nn.Linear(2, 2)))
    assert custom_roots(wrapped, True) == []  # their prefix hooks keep the in-place path exact


def test_wrapped_model_stays_in_place(tmp_path: Path) -> None:
    """get_model_state_dict's keys drop the wrappers' names: that is no hook-made key (no copy)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build() -> nn.Module:
        return nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), torch.compile(nn.Linear(2, 2)))

    torch.manual_seed(0)
    saved = build()
    shardsafe.save(tmp_path / "ck", {"model": saved})
    target = build()
    calls: list[int] = []
    original = target.load_state_dict
    target.load_state_dict = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore[method-assign]
    shardsafe.load(tmp_path / "ck", {"model": target})
    assert calls == []  # read in place: the custom path would have called it
    for a, b in zip(saved.parameters(), target.parameters()):
        assert torch.equal(a, b)


def test_resume_batch_order_model_loads_through_its_override(tmp_path: Path) -> None:
    model = _trained_order_model()
    assert model.data_order.shape == (12,)
    shardsafe.save(tmp_path / "ck", {"model": model})
    fresh = OrderModel()
    shardsafe.load(tmp_path / "ck", {"model": fresh})
    assert fresh.loads == 1
    _assert_same(_values(fresh), _values(model))


def test_damaged_checkpoint_leaves_custom_module_untouched(tmp_path: Path) -> None:
    model = _trained_order_model()
    shardsafe.save(tmp_path / "ck", {"model": model})
    shard = next(p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's bytes
    shard.write_bytes(bytes(data))
    fresh = OrderModel()
    before = _values(fresh)
    with pytest.raises(IntegrityError):
        shardsafe.load(tmp_path / "ck", {"model": fresh})
    assert fresh.loads == 0  # its code never ran: the bytes were checked first
    _assert_same(_values(fresh), before)


def test_later_failure_undoes_custom_load(tmp_path: Path) -> None:
    """The module's load_state_dict ran (phase 3), then another object's raised: the module gets its
    own buffer object back, with its values."""
    model = _trained_order_model()
    shardsafe.save(tmp_path / "ck", {"model": model, "other": Failing()})
    fresh = OrderModel()
    buffer, before = fresh.data_order, _values(fresh)
    with pytest.raises(StateMismatchError, match="refused on purpose"):
        shardsafe.load(tmp_path / "ck", {"model": fresh, "other": Failing()})
    assert fresh.loads == 1
    assert fresh.data_order is buffer
    _assert_same(_values(fresh), before)


def test_module_own_refusal_is_reported_and_undone(tmp_path: Path) -> None:
    """A key the module has but the checkpoint lacks: torch's strict load_state_dict refuses it."""
    saved = Mixed()
    shardsafe.save(tmp_path / "ck", {"model": saved})
    target = Mixed()
    target.legacy.register_buffer("extra", torch.ones(2))
    before = _values(target)
    with pytest.raises(StateMismatchError, match="extra"):
        shardsafe.load(tmp_path / "ck", {"model": target})
    _assert_same(_values(target), before)
    shardsafe.load(tmp_path / "ck", {"model": target}, strict=False)
    assert torch.equal(target.legacy.weight, saved.legacy.weight)


def test_mixed_model_custom_subtrees_and_in_place_rest(tmp_path: Path) -> None:
    """Hooks renaming keys: the checkpoint holds what state_dict() gives (lo/hi, not packed); the
    plain layers are read in place (same storage), the custom ones through their code; the version
    handed to _load_from_state_dict is the live class's (no spurious upgrade); atomic=False too."""
    torch.manual_seed(1)
    saved = Mixed()
    saved.norm(torch.randn(8, 4))  # running stats and num_batches_tracked move
    shardsafe.save(tmp_path / "ck", {"model": saved})
    keys = set(json.loads((tmp_path / "ck" / "manifest.json").read_text())["tensors"])
    assert {"model/packed.lo", "model/packed.hi"} <= keys and "model/packed.packed" not in keys
    for atomic in (True, False):
        torch.manual_seed(2)
        target = Mixed()
        first = target.first.weight.data_ptr()
        shardsafe.load(tmp_path / "ck", {"model": target}, atomic=atomic)
        assert target.first.weight.data_ptr() == first
        assert target.legacy.seen_version == 2
        _assert_same(_values(target), _values(saved))


# ----------------------------------------------------------------------------- 2 gloo ranks


def _order_job(rank: int, world_size: int, path: str, layout: str, save: bool, mode: str = "") -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = OrderModel()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model.fc, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: nn.Module = model
    elif layout == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    else:
        wrapped = model
    if save:
        for step in range(6):
            wrapped(torch.arange(step * 2, step * 2 + 2, dtype=torch.float).repeat(10, 1).T)
        shardsafe.save(path, {"model": wrapped, "other": Failing()})
    elif mode == "undo":  # the module's code runs, then another object refuses: every rank undoes it
        before = model.fc.weight.full_tensor() if isinstance(model.fc.weight, DTensor) else model.fc.weight.clone()
        with pytest.raises(StateMismatchError, match="refused on purpose"):
            shardsafe.load(path, {"model": wrapped, "other": Failing()})
        after = model.fc.weight.full_tensor() if isinstance(model.fc.weight, DTensor) else model.fc.weight
        assert model.loads == 1 and model.data_order.shape == (0,) and torch.equal(after, before)
    else:
        shardsafe.load(path, {"model": wrapped})
    weight = model.fc.weight
    whole = weight.full_tensor() if isinstance(weight, DTensor) else weight.detach().clone()
    return {"order": model.data_order.clone(), "weight": whole.detach().clone(), "loads": model.loads}


@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_custom_module_on_two_ranks_and_resharded(tmp_path: Path, layout: str) -> None:
    path = str(tmp_path / "ck")
    saved = run_ranks(_order_job, 2, path, layout, True, work_dir=tmp_path)
    assert saved[0]["order"].shape == (12,)
    loaded = run_ranks(_order_job, 2, path, layout, False, work_dir=tmp_path)
    for result in loaded:
        assert result["loads"] == 1
        assert torch.equal(result["order"], saved[0]["order"])
        assert torch.equal(result["weight"], saved[0]["weight"])
    if layout == "fsdp":
        run_ranks(_order_job, 2, path, layout, False, "undo", work_dir=tmp_path)
    one = _order_job(0, 1, path, "one", False)  # resharded: 2 ranks -> one process
    assert torch.equal(one["order"], saved[0]["order"]) and torch.equal(one["weight"], saved[0]["weight"])
