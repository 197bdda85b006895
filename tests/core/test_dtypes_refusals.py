"""Tensors shardsafe cannot store (sparse COO/CSR, nested, meta, quantized dtypes) are refused
before anything is written, with a FormatError naming the key and the remedy; loading into a meta
model is refused the same way, before anything is read."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.errors import FormatError


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


CASES: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "sparse coo": (lambda: torch.eye(3).to_sparse(), r"sparse_coo tensor cannot be stored; store t\.to_dense\(\)"),
    "sparse csr": (lambda: torch.eye(3).to_sparse_csr(), r"sparse_csr tensor cannot be stored; store t\.to_dense\(\)"),
    "nested": (_nested, r"nested tensor cannot be stored; store its parts as a list \(t\.unbind\(\)\)"),
    "jagged": (
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "nested tensor cannot be stored",
    ),
    "meta": (lambda: torch.empty(3, device="meta"), "meta tensor has no values .* materialize it first"),
    "qint8": (_quantized, r"dtype torch\.qint8 cannot be stored .* t\.dequantize\(\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_anything_is_written(tmp_path: Path, case: str) -> None:
    make, message = CASES[case]
    with pytest.raises(FormatError, match=message) as caught:
        shardsafe.save(tmp_path / "ck", {"state": {"good": torch.ones(2), "bad": make()}})
    assert "'state/bad'" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_sparse_buffer_in_a_module_is_named(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("mask", torch.eye(2).to_sparse())
    with pytest.raises(FormatError, match=r"'model/mask'.*to_dense"):
        shardsafe.save(tmp_path / "ck", {"model": model})
    assert list(tmp_path.iterdir()) == []


def test_load_into_meta_model_refused_untouched(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "ck", {"model": nn.Linear(2, 2)})
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(FormatError, match=r"'model/(weight|bias)'.*meta tensor"):
        shardsafe.load(tmp_path / "ck", {"model": model})
    assert model.weight.is_meta
