"""The tensor-subclass policy (docs/FORMAT.md, "Tensor subclasses"), with torchao's real classes:
a wrapper of a plain tensor (float8 training weights) stores its value and loads back exactly;
a quantized subclass not allowlisted (here: torchao's NF4Tensor taken off the list) and subclasses
with their own dispatch and no ``__tensor_flatten__`` are refused at save, naming the key and the
remedy, nothing written; a plain Python subclass of torch.Tensor is a plain tensor. Allowlisted
quantized subclasses, stored by their parts: test_subclass_parts.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.errors import FormatError

logging.getLogger("torchao").setLevel(logging.ERROR)
torchao = pytest.importorskip("torchao")


class Tagged(torch.Tensor):
    """A Python subclass that keeps torch's dispatch: its values are its own memory."""


class OwnDispatch(torch.Tensor):
    """A wrapper subclass with its own dispatch and no __tensor_flatten__: where its values are is unknown."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(func)


def test_float8_training_wrapper_stores_its_value(tmp_path: Path) -> None:
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weight = torch.randn(8, 4)
    model = nn.Linear(4, 8, bias=False)
    model.weight = nn.Parameter(
        WeightWithDynamicFloat8CastTensor(weight.clone(), LinearMMConfig(), torch.float8_e4m3fn)
    )
    shardsafe.save(tmp_path / "ck", {"model": model})
    plain = nn.Linear(4, 8, bias=False)
    shardsafe.load(tmp_path / "ck", {"model": plain})
    assert torch.equal(plain.weight, weight)


def test_plain_python_subclass_is_a_plain_tensor(tmp_path: Path) -> None:
    value = torch.arange(6.0).as_subclass(Tagged)
    shardsafe.save(tmp_path / "ck", {"t": value})
    into = torch.zeros(6)
    shardsafe.load(tmp_path / "ck", {"t": into})
    assert torch.equal(into, torch.arange(6.0))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: OwnDispatch(torch.ones(64, 64)), r"OwnDispatch .*no __tensor_flatten__.* plain tensor"),
    ],
    ids=["own-dispatch"],
)
def test_refused_at_save_nothing_written(tmp_path: Path, make: Any, message: str) -> None:
    value = make()
    if isinstance(value, OwnDispatch):
        model: Any = {"weight": value}  # nn.Parameter would run its dispatch (detach)
    else:
        model = nn.Linear(64, 64, bias=False)
        model.weight = nn.Parameter(value, requires_grad=False)
    with pytest.raises(FormatError, match=message):
        shardsafe.save(tmp_path / "ck", {"model": model})
    assert list(tmp_path.iterdir()) == []
