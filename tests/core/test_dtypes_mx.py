"""MX / FP4 dtypes: ``float8_e8m0fnu`` (MX scales), ``float4_e2m1fn_x2`` (packed FP4, two values a
byte) and the ``fnuz`` float8 variants are stored, loaded, resharded and exported bit-exact, and
the files are read by safetensors' own reader (``F8_E8M0``, ``F4`` with the last dim in values)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import shardsafe
from dist_utils import run_ranks
from shardsafe.cli.inspect import describe_checkpoint
from shardsafe.core.dtypes import dtype_name, safetensors_dtype, torch_shape
from shardsafe.core.safetensors_header import parse_safetensors_header
from shardsafe.errors import FormatError

NEW = [torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)


def test_names_follow_safetensors() -> None:
    assert [safetensors_dtype(d) for d in NEW] == ["F8_E8M0", "F4", "F8_E4M3FNUZ", "F8_E5M2FNUZ"]
    assert [dtype_name(d) for d in NEW] == [str(d).removeprefix("torch.") for d in NEW]


def test_roundtrip_bit_exact_and_read_by_safetensors(tmp_path: Path) -> None:
    state = {dtype_name(d): _random(d, (6, 4), i) for i, d in enumerate(NEW)}
    shardsafe.save(tmp_path / "ck", {"w": state})
    target = {"w": {k: torch.zeros_like(_bytes(v)).view(v.dtype) for k, v in state.items()}}
    shardsafe.load(tmp_path / "ck", target)
    for key, value in state.items():
        assert target["w"][key].dtype == value.dtype
        assert torch.equal(_bytes(target["w"][key]), _bytes(value)), key
    shardsafe.verify(tmp_path / "ck")
    shown = {t["key"]: t["dtype"] for t in describe_checkpoint(tmp_path / "ck")["tensors"]}
    assert shown == {f"w/{key}": key for key in state}  # `shardsafe inspect` names each dtype
    (shard,) = (tmp_path / "ck").glob("*.safetensors")
    with safe_open(str(shard), "pt") as f:
        assert f.get_slice("w/float4_e2m1fn_x2").get_shape() == [6, 8]  # safetensors counts FP4 values
        assert f.get_slice("w/float8_e8m0fnu").get_dtype() == "F8_E8M0"
        for key, value in state.items():
            got = f.get_tensor(f"w/{key}")
            assert got.dtype == value.dtype and torch.equal(_bytes(got), _bytes(value)), key


def test_export_keeps_bytes(tmp_path: Path) -> None:
    weights = {
        "blocks.0.w": _random(torch.float4_e2m1fn_x2, (4, 8), 1),
        "blocks.0.s": _random(torch.float8_e8m0fnu, (4, 1), 2),
    }
    shardsafe.save(tmp_path / "ck", {"model": weights})
    out = shardsafe.export_hf(
        tmp_path / "ck",
        tmp_path / "hf",
        config={"model_type": "llama", "quantization_config": {"quant_method": "mxfp4"}},
        progress=False,
    )
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("blocks.0.w").get_shape() == [4, 16]
        for key, value in weights.items():
            assert torch.equal(_bytes(f.get_tensor(key)), _bytes(value)), key


def test_export_cast_leaves_fp4_and_scales_as_stored(tmp_path: Path) -> None:
    """export_hf(dtype=...) casts the floating-point weights; packed FP4 values and E8M0 scales (the
    parts of a block-scaled weight, meaningless cast alone; FP4 torch cannot cast) keep their bytes."""
    weights = {
        "blocks.0.w": _random(torch.float4_e2m1fn_x2, (4, 8), 1),
        "blocks.0.s": _random(torch.float8_e8m0fnu, (4, 1), 2),
        "norm.weight": torch.randn(8, dtype=torch.bfloat16),
    }
    shardsafe.save(tmp_path / "ck", {"model": weights})
    config = {"model_type": "llama", "quantization_config": {"quant_method": "mxfp4"}}
    out = shardsafe.export_hf(tmp_path / "ck", tmp_path / "hf", config=config, dtype="float16", progress=False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("norm.weight"), weights["norm.weight"].half())
        for key in ("blocks.0.w", "blocks.0.s"):
            got = f.get_tensor(key)
            assert got.dtype == weights[key].dtype and torch.equal(_bytes(got), _bytes(weights[key])), key
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"


def test_fp4_split_inside_a_byte_is_refused() -> None:
    """A safetensors F4 entry whose last dim is an odd count of values would split a byte."""
    assert torch_shape(torch.float4_e2m1fn_x2, (3, 8), "x") == (3, 4)
    with pytest.raises(FormatError, match="two per byte"):
        torch_shape(torch.float4_e2m1fn_x2, (3, 7), "x")
    header = json.dumps({"w": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * 3
    with pytest.raises(FormatError, match="boundary inside a byte"):
        parse_safetensors_header(data, len(data), "f.safetensors")


def test_zero_dim_fp4_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="0-dimensional"):
        shardsafe.save(tmp_path / "ck", {"w": torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)})
    assert list(tmp_path.iterdir()) == []


def _mx_job(rank: int, world_size: int, path: str, dim: int, save: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    whole = {"fp4": _random(torch.float4_e2m1fn_x2, (6, 8), 3), "e8m0": _random(torch.float8_e8m0fnu, (6, 2), 4)}
    state = {}
    for key, value in whole.items():
        source = value if save else torch.zeros_like(_bytes(value)).view(value.dtype)
        part = source.view(torch.uint8).chunk(world_size, dim)[rank].contiguous().view(value.dtype)
        state[key] = DTensor.from_local(
            part, mesh, [Shard(dim)], run_check=False, shape=value.shape, stride=value.stride()
        )
    if save:
        shardsafe.save(path, state)
    else:
        shardsafe.load(path, state)  # top-level tensors: read in place, each rank its Shard(dim) part
    return {k: _bytes(v.to_local()).clone() for k, v in state.items()}


def test_mx_dtypes_resharded_on_two_ranks(tmp_path: Path) -> None:
    """Saved as Shard(0) on 2 ranks; loaded as Shard(1) on 2 ranks (FP4 split between bytes) and whole."""
    path = str(tmp_path / "ck")
    run_ranks(_mx_job, 2, path, 0, True, work_dir=tmp_path)
    whole = {"fp4": _random(torch.float4_e2m1fn_x2, (6, 8), 3), "e8m0": _random(torch.float8_e8m0fnu, (6, 2), 4)}
    loaded = run_ranks(_mx_job, 2, path, 1, False, work_dir=tmp_path)
    for rank, parts in enumerate(loaded):
        for key, value in whole.items():
            assert torch.equal(parts[key], _bytes(value).chunk(2, 1)[rank]), (rank, key)
    one = {k: torch.zeros_like(_bytes(v)).view(v.dtype) for k, v in whole.items()}
    shardsafe.load(path, one)
    for key, value in whole.items():
        assert torch.equal(_bytes(one[key]), _bytes(value)), key


def test_whole_weights_of_a_model_cast_only_what_export_casts() -> None:
    """The Trainer's model-folder weights (integrations/transformers/model_index.full_state_tensors) follow
    export's one rule (core/dtypes.output_dtype): the float weight is cast, the FP4 buffer and its E8M0
    scales keep their bytes (the stream used to cast every floating tensor and failed on FP4)."""
    from torch import nn

    from shardsafe.integrations.transformers.model_index import full_state_tensors

    module = nn.Linear(8, 4)
    module.register_buffer("packed", _random(torch.float4_e2m1fn_x2, (4, 4), 3))
    module.register_buffer("scales", _random(torch.float8_e8m0fnu, (4, 1), 4))
    infos, stream = full_state_tensors(module, torch.bfloat16)
    got = dict(stream)
    assert {i.name: i.dtype for i in infos} == {n: t.dtype for n, t in got.items()}
    assert got["weight"].dtype == torch.bfloat16 and torch.equal(got["weight"], module.weight.detach().bfloat16())
    for name in ("packed", "scales"):
        assert torch.equal(_bytes(got[name]), _bytes(getattr(module, name))), name
