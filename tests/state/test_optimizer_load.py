"""Loading into a fresh optimizer: its state is created from the checkpoint's description.

The state must come back exactly as saved (same entries, dtypes and values, no entries for
parameters that had none) and the next step must equal the one the saved run would have taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.errors import StateMismatchError
from shardsafe.state import optimizer as optimizer_adapter


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 2)).to(dtype)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    losses = []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen).to(next(model.parameters()).dtype)
        loss = model(x).float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, lr=0.01, amsgrad=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_fresh_optimizer_gets_exactly_the_saved_state(
    tmp_path: Path, kind: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(dtype)
    model[3].weight.requires_grad_(False)  # in the optimizer, never gets a gradient: no state saved
    optimizer = OPTIMIZERS[kind](model.parameters())
    _train(model, optimizer, 3, seed=1)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": optimizer})
    expected = _train(model, optimizer, 2, seed=2)

    fresh_model = _model(dtype)
    fresh_model[3].weight.requires_grad_(False)
    fresh = OPTIMIZERS[kind](fresh_model.parameters())
    stepped = "torch's dummy step ran; the state should be allocated"
    monkeypatch.setattr(optimizer_adapter, "create_state_by_stepping", lambda *a: pytest.fail(stepped))
    shardsafe.load(tmp_path / "ckpt", {"model": fresh_model, "optim": fresh})
    saved = torch.load(_reference(tmp_path, model, kind, dtype), weights_only=True)
    assert fresh.state_dict()["state"].keys() == saved["state"].keys()
    assert model[3].weight not in fresh.state
    for index, entries in saved["state"].items():
        got = fresh.state_dict()["state"][index]
        assert got.keys() == entries.keys()
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype and got[key].device == value.device, key
                torch.testing.assert_close(got[key], value, rtol=0, atol=0)
            else:
                assert got[key] == value
    assert _train(fresh_model, fresh, 2, seed=2) == expected


def _reference(tmp_path: Path, model: nn.Module, kind: str, dtype: torch.dtype) -> Path:
    """The optimizer state the saved run had, rebuilt by replaying it (torch's own state_dict, saved by us)."""
    again = _model(dtype)
    again[3].weight.requires_grad_(False)
    optimizer = OPTIMIZERS[kind](again.parameters())
    _train(again, optimizer, 3, seed=1)
    path = tmp_path / "reference.pt"
    torch.save(optimizer.state_dict(), path)
    return path


def test_failed_load_leaves_a_fresh_optimizer_without_state(tmp_path: Path) -> None:
    model = _model(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer, 1, seed=1)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": optimizer})

    other = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 3))  # last layer differs
    fresh = torch.optim.AdamW(other.parameters())
    with pytest.raises(StateMismatchError, match="shape mismatch"):
        shardsafe.load(tmp_path / "ckpt", {"model": other, "optim": fresh})
    assert not fresh.state


class _TracingSGD(torch.optim.SGD):
    """A custom optimizer whose state holds a tensor larger than its parameter (a history of 3 gradients)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    history = self.state[p].setdefault("history", torch.zeros(3, *p.shape, dtype=p.dtype))
                    history.copy_(torch.cat([history[1:], p.grad.unsqueeze(0)]))
        return super().step(closure)


def test_state_larger_than_its_parameter_is_created_the_optimizers_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizes from a checkpoint are not trusted for allocation beyond the parameter's own: such state is
    created by the optimizer (torch's zero-gradient step) and the load then fills it, or reports a mismatch."""
    model = _model(torch.float32)
    optimizer = _TracingSGD(model.parameters(), lr=0.01, momentum=0.9)
    _train(model, optimizer, 3, seed=1)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": optimizer})
    expected = _train(model, optimizer, 2, seed=2)

    stepped = []
    create = optimizer_adapter.create_state_by_stepping
    monkeypatch.setattr(optimizer_adapter, "create_state_by_stepping", lambda *a: (stepped.append(1), create(*a)))
    fresh_model = _model(torch.float32)
    fresh = _TracingSGD(fresh_model.parameters(), lr=0.01, momentum=0.9)
    shardsafe.load(tmp_path / "ckpt", {"model": fresh_model, "optim": fresh})
    assert stepped == [1], "the oversized state was not allocated from the checkpoint's sizes"
    assert fresh.state[fresh_model[0].weight]["history"].shape == (3, 5, 6)
    assert _train(fresh_model, fresh, 2, seed=2) == expected
