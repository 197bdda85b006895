"""shardsafe.load_pretrained: a Hugging Face model folder (or hf:// repo) into plain, DDP and FSDP2
models, each rank reading only the rows it owns; equal to from_pretrained tensor for tensor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_export import llama_config  # the same tiny, unevenly split Llama

import shardsafe
from dist_utils import run_ranks
from shardsafe.errors import ModelFolderError, StateMismatchError

transformers = pytest.importorskip("transformers")
pytest_plugins = ["servers.fixtures"]  # hub


def make_folder(path: Path, *, tie: bool, dtype: torch.dtype = torch.float32, shard_size: str | None = None) -> Path:
    torch.manual_seed(7 + tie)
    model = transformers.LlamaForCausalLM(llama_config(tie)).to(dtype)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def reference_state(folder: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fresh_model(tie: bool, seed: int = 99) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(tie))


def assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype, key
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_plain_model_equals_from_pretrained(tmp_path: Path, tie: bool, shard_size: str | None) -> None:
    folder = make_folder(tmp_path / "m", tie=tie, shard_size=shard_size)
    assert ((folder / "model.safetensors.index.json").is_file()) == (shard_size is not None)
    model = fresh_model(tie)
    result = shardsafe.load_pretrained(model, folder)
    assert result["missing_keys"] == [] and result["unexpected_keys"] == []
    assert_equal({k: v.detach() for k, v in model.state_dict().items()}, reference_state(folder))
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bf16_files_into_fp32_parameters(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", tie=False, dtype=torch.bfloat16)
    model = fresh_model(False)
    shardsafe.load_pretrained(model, folder)
    expected = reference_state(folder, dtype=torch.float32)  # from_pretrained upcasts the same way
    assert_equal({k: v.detach() for k, v in model.state_dict().items()}, expected)


def test_mismatches_are_reported_together_and_nothing_is_written(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", tie=False)
    config = llama_config(False)
    config.intermediate_size = 70  # every MLP weight has another shape
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    model.extra = torch.nn.Linear(2, 2)  # a parameter the folder does not have
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError) as info:
        shardsafe.load_pretrained(model, folder)
    message = str(info.value)
    assert "mlp.gate_proj.weight" in message and "missing in the model folder: extra.weight" in message
    assert_equal({k: v.detach() for k, v in model.state_dict().items()}, before)
    relaxed = fresh_model(False)
    relaxed.extra = torch.nn.Linear(2, 2)
    result = shardsafe.load_pretrained(relaxed, folder, strict=False)
    assert result["missing_keys"] == ["extra.bias", "extra.weight"]


def test_dummy_folder_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "dummy"
    folder.mkdir()
    llama_config(False).save_pretrained(folder)
    save_file({}, str(folder / "model.safetensors"))  # what a ZeRO-3 save without gathering leaves
    model = fresh_model(False)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises((ModelFolderError, StateMismatchError)):
        shardsafe.load_pretrained(model, folder)
    assert_equal({k: v.detach() for k, v in model.state_dict().items()}, before)


def test_truncated_file_is_refused_before_writing(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", tie=False)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(shardsafe.ShardsafeError):
        shardsafe.load_pretrained(fresh_model(False), folder)


def _fsdp_job(rank: int, world_size: int, folder: str, tie: bool) -> dict[str, Any]:
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = fresh_model(tie, seed=100 + rank)  # different garbage on every rank: all of it must be overwritten
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    result = shardsafe.load_pretrained(model, folder)
    whole = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }
    return {"state": whole if rank == 0 else None, "bytes_read": result["bytes_read"]}


@pytest.mark.parametrize("world_size,tie,shard_size", [(2, True, None), (3, False, "20KB")])
def test_fsdp2_ranks_read_only_their_rows(tmp_path: Path, world_size: int, tie: bool, shard_size: str | None) -> None:
    folder = make_folder(tmp_path / "m", tie=tie, shard_size=shard_size)
    results = run_ranks(_fsdp_job, world_size, str(folder), tie, work_dir=tmp_path / "run")
    assert_equal(results[0]["state"], reference_state(folder))
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    per_rank = [r["bytes_read"] for r in results]
    assert sum(per_rank) <= total  # together the ranks read each byte at most once (norm weights are split too)
    assert max(per_rank) < 0.7 * total  # no rank reads the whole model


def _ddp_job(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    model = torch.nn.parallel.DistributedDataParallel(fresh_model(False, seed=5 + rank))
    shardsafe.load_pretrained(model, folder)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_ddp_model(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", tie=False)
    results = run_ranks(_ddp_job, 2, str(folder), work_dir=tmp_path / "run")
    for state in results:
        assert_equal(state, reference_state(folder))


def test_hf_source_through_the_local_hub(tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as constants

    # downloads stay in the test's folder
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache" / "hub"))
    folder = make_folder(tmp_path / "m", tie=True)
    shardsafe.push(folder, "hf://tester/tiny-llama", progress=False)
    model = fresh_model(True)
    shardsafe.load_pretrained(model, "hf://tester/tiny-llama")
    assert_equal({k: v.detach() for k, v in model.state_dict().items()}, reference_state(folder))
    assert any((tmp_path / "hf-cache").rglob("model.safetensors"))


def _2d_job(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """FSDP2 over tensor parallel (torchtitan's layout): the MLP's colwise weights are _StridedShard."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = fresh_model(False, seed=100 + rank)
    for layer in model.model.layers:
        parallelize_module(
            layer.mlp,
            mesh["tp"],
            {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()},
        )
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = str(tuple(model.model.layers[0].mlp.gate_proj.weight.placements))
    result = shardsafe.load_pretrained(model, folder)
    whole = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }
    return {"state": whole if rank == 0 else None, "bytes_read": result["bytes_read"], "placements": placements}


def test_fsdp2_over_tensor_parallel_reads_each_rank_its_boxes(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", tie=False)
    results = run_ranks(_2d_job, 4, str(folder), work_dir=tmp_path / "run")
    assert results[0]["placements"].startswith("(_StridedShard(dim=0")
    assert_equal(results[0]["state"], reference_state(folder))
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    # no rank reads the whole model (TP-replicated norms: each tp rank its copy)
    assert max(r["bytes_read"] for r in results) < 0.7 * total
