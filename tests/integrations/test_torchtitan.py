"""shardsafe with torchtitan as the client: its llama3 model, laid out by its own parallelize code.

A tiny llama3 (the "debugmodel" recipe with dim 64, 2 layers, a 256-token vocabulary) is built from
torchtitan's model config, given torchtitan's llama3 sharding config and parallelized by
torchtitan's ``parallelize_llama`` on meshes from its ``ParallelDims`` (CPU, gloo):

* ``2d``: 4 ranks, dp_shard=2 x tp=2: torchtitan's tensor/sequence parallel plan, then its FSDP2
  wrapping (``apply_fsdp_to_decoder``) over ``fsdp``;
* ``fsdp``: 2 ranks, dp_shard=2 only;
* ``one``: one process, not parallelized;
* pipeline stages: torchtitan's ``pipeline_llm`` split over 2 ranks (1F1B), loaded into ``one``.

Two AdamW steps on random token ids in ``2d``, ``shardsafe.save`` on every rank; then a load into
``fsdp`` (and into ``one``) built from another seed: every parameter and optimizer moment, whole,
equals the saved one bit for bit, and two more steps give the losses of an uninterrupted run.

Two things are adapted to a CPU-only machine, neither touching what is saved: torchtitan picks its
device type at import time and falls back to "cuda" without an accelerator (its meshes are made
on "cpu" here), and ``torchtitan.models.common`` imports a triton kernel module at import time for
expert parallelism, which is stubbed out when triton is absent (the dense llama3 never calls it).
Attention uses torchtitan's ``ScaledDotProductAttention`` (causal) instead of its compiled
FlexAttention, which would need inductor to compile on CPU.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

torchtitan = pytest.importorskip("torchtitan")

if importlib.util.find_spec("triton") is None:  # MoE dispatch kernels: imported by models.common, unused here
    _kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def _no_triton(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("triton is not installed")

    for _name in (
        "copy_full_counts_to_peers_kernel",
        "copy_rows_to_peers_kernel",
        "expand_topk_grad_kernel",
        "fill_combine_metadata_kernel",
        "fill_dispatch_metadata_kernel",
        "invert_flat_indices_kernel",
        "reduce_topk_slots_kernel",
        "topk_scores_grad_kernel",
    ):
        setattr(_kernels, _name, _no_triton)
    sys.modules.setdefault(_kernels.__name__, _kernels)

import torchtitan.distributed.parallel_dims as tt_parallel_dims  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, parallelize_llama  # noqa: E402
from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # noqa: E402

import nd_utils  # noqa: E402
import shardsafe  # noqa: E402
from dist_utils import assert_tensors_equal, run_ranks  # noqa: E402

tt_parallel_dims.device_type = "cpu"  # torchtitan falls back to "cuda" when no accelerator is found

DIM, HEADS, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 256, 16, 4
LAYOUTS = {"2d": (2, 2), "fsdp": (2, 1)}  # layout -> (dp_shard, tp)
BACKEND = "partial_dtensor"  # DTensor on the model-parallel axes, FSDP2 for data parallel


def tiny_config(fuse_qkv: bool = False) -> Llama3Model.Config:
    """torchtitan's llama3 debugmodel recipe, smaller, with its sharding config filled in."""
    layers = llama3._build_llama3_layers(
        fuse_qkv=fuse_qkv,
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=layers,
    )
    set_llama3_sharding_config(config, enable_sp=True)
    return config


def build(
    layout: str, world_size: int, seed: int, fuse_qkv: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """(model, AdamW, data-parallel mesh or None); every layout starts from the same whole values."""
    set_spmd_backend(BACKEND)
    torch.manual_seed(seed)
    model = tiny_config(fuse_qkv).build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    dp_mesh = None
    if layout != "one":
        dp, tp = LAYOUTS[layout]
        dims = ParallelDims(
            dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=world_size, spmd_backend=BACKEND
        )
        dims.build_mesh()
        model = parallelize_llama(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(
                data_parallel_shard_degree=dp, tensor_parallel_degree=tp, spmd_backend=BACKEND
            ),
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
        )
        dp_mesh = dims.get_mesh("fsdp")
        for module in model.modules():  # gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's divide factor 1
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optimizer, dp_mesh


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, index: int, dp_mesh: Any) -> float:
    """One step on the global batch of ``index``: each data-parallel rank takes its rows; the loss is
    summed over tokens and divided by the global token count (torchtitan disables FSDP's gradient
    division), so the summed gradient is that of the global mean."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + index))
    if dp_mesh is not None:
        rows = BATCH // dp_mesh.size()
        tokens = tokens[dp_mesh.get_local_rank() * rows : (dp_mesh.get_local_rank() + 1) * rows]
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):  # tensor parallel: the logits come sharded over the vocabulary
        logits = logits.full_tensor()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum") / (BATCH * SEQ)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    if dp_mesh is not None:
        dist.all_reduce(total, group=dp_mesh.get_group())
    return float(total.item())


def job(
    rank: int, world_size: int, layout: str, path: str, load: bool, steps: list[int], fuse_qkv: bool = False
) -> dict[str, Any]:
    model, optimizer, dp_mesh = build(layout, world_size, seed=99 if load else 0, fuse_qkv=fuse_qkv)
    loaded = None
    if load:
        shardsafe.load(path, {"model": model, "optim": optimizer})
        loaded = nd_utils.whole_state(model, optimizer)
    losses = [step(model, optimizer, i, dp_mesh) for i in steps]
    saved = None
    if not load:
        shardsafe.save(path, {"model": model, "optim": optimizer})
        saved = nd_utils.whole_state(model, optimizer)
    return {"losses": losses, "loaded": loaded, "saved": saved, "layout": nd_utils.local_layout(model)}


def test_torchtitan_llama3_2d_to_fsdp_and_one(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    uninterrupted = job(0, 1, "one", str(tmp_path / "ref"), False, [0, 1, 2, 3])
    first = run_ranks(job, 4, "2d", path, False, [0, 1], work_dir=tmp_path)
    placements = first[0]["layout"]
    # torchtitan's layout really is FSDP2 over TP: colwise weights strided, rowwise weights 2-D boxes
    assert placements["layers.0.feed_forward.w1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", placements
    assert placements["layers.0.feed_forward.w2.weight"] == "(Shard(dim=0), Shard(dim=1))", placements
    saved = first[0]["saved"]
    for other in first[1:]:
        assert_tensors_equal(other["saved"], saved, "ranks of the 2d job")
    assert any(k.endswith("exp_avg_sq") for k in saved)
    assert shardsafe.verify(path)["world_size"] == 4

    second = run_ranks(job, 2, "fsdp", path, True, [2, 3], work_dir=tmp_path)
    for rank, result in enumerate(second):
        assert_tensors_equal(result["loaded"], saved, f"2d@4 -> fsdp@2 rank {rank}")
    one = job(0, 1, "one", path, True, [2, 3])
    assert_tensors_equal(one["loaded"], saved, "2d@4 -> one")

    losses = first[0]["losses"] + second[0]["losses"]
    assert losses == pytest.approx(uninterrupted["losses"], rel=1e-4, abs=1e-4)
    assert one["losses"] == pytest.approx(uninterrupted["losses"][2:], rel=1e-4, abs=1e-4)


def test_torchtitan_fused_qkv_debugmodel(tmp_path: Path) -> None:
    """The debugmodel as shipped fuses Q/K/V (``FusedQKVLinear``), whose state_dict post-hook
    replaces ``wqkv.weight`` with ``wq``/``wk``/``wv.weight`` (torch's ``get_model_state_dict``
    cannot map those back to parameters). shardsafe saves what ``state_dict()`` gives and loads
    through ``load_state_dict`` (the hook's pre-load merge): the fused weights come back exactly."""
    set_spmd_backend(BACKEND)
    torch.manual_seed(0)
    model = tiny_config(fuse_qkv=True).build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    shardsafe.save(str(tmp_path / "ck"), {"model": model})
    keys = set(__import__("json").loads((tmp_path / "ck" / "manifest.json").read_text())["tensors"])
    assert any(k.endswith("wq.weight") for k in keys) and not any("wqkv" in k for k in keys)
    torch.manual_seed(5)
    fresh = tiny_config(fuse_qkv=True).build()
    with torch.no_grad():
        fresh.init_weights(buffer_device=torch.device("cpu"))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    shardsafe.load(str(tmp_path / "ck"), {"model": fresh})
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name


def test_torchtitan_fused_qkv_2d_to_fsdp(tmp_path: Path) -> None:
    """The fused-QKV debugmodel parallelised by torchtitan at dp_shard=2 x tp=2 (``wqkv`` colwise,
    under FSDP2), saved, and resumed at FSDP2@2: every parameter and moment equal, losses continue."""
    path = str(tmp_path / "ck")
    uninterrupted = job(0, 1, "one", str(tmp_path / "ref"), False, [0, 1, 2, 3], True)
    first = run_ranks(job, 4, "2d", path, False, [0, 1], True, work_dir=tmp_path)
    placements = first[0]["layout"]
    fused = "layers.0.attention.qkv_linear.wqkv.weight"
    assert placements.get(fused, "").startswith("(_StridedShard"), placements  # FSDP2 over a colwise fused weight
    saved = first[0]["saved"]
    assert fused in saved and f"optim/{fused}/exp_avg" in saved, sorted(saved)[:8]
    second = run_ranks(job, 2, "fsdp", path, True, [2, 3], True, work_dir=tmp_path)
    for rank, result in enumerate(second):
        assert_tensors_equal(result["loaded"], saved, f"fused qkv 2d@4 -> fsdp@2 rank {rank}")
    assert first[0]["losses"] + second[0]["losses"] == pytest.approx(uninterrupted["losses"], rel=1e-4, abs=1e-4)


def pp_job(rank: int, world_size: int, path: str, steps: list[int]) -> dict[str, Any]:
    """torchtitan's own pipeline split (``pipeline_llm``, 1F1B, 2 microbatches) over 2 stages: each
    rank's model part holds its stage's layers under their full names."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    set_spmd_backend(BACKEND)
    torch.manual_seed(0)
    config = tiny_config()
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=world_size, spmd_backend=BACKEND)
    dims.build_mesh()

    # torchtitan's (loss, extras)
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / (BATCH * SEQ), {}

    parallelism = ParallelismConfig(
        pipeline_parallel_degree=2, pipeline_parallel_microbatch_size=BATCH // 2, spmd_backend=BACKEND
    )
    schedule, parts, first, last = pipeline_llm(
        model,
        parallel_dims=dims,
        training=TrainingConfig(local_batch_size=BATCH, mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
        device=torch.device("cpu"),
        model_config=config,
        parallelize_fn=parallelize_llama,
        loss_fn=loss_fn,
    )
    (part,) = parts
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for index in steps:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + index))
        micro: list[torch.Tensor] = []
        if first:
            schedule.step(tokens[:, :-1], target=tokens[:, 1:] if last else None, losses=micro if last else None)
        else:
            schedule.step(target=tokens[:, 1:], losses=micro)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(sum(m.item() for m in micro)) if last else None)
    shardsafe.save(path, {"model": part, "optim": optimizer})
    return {
        "saved": nd_utils.whole_state(part, optimizer),
        "losses": losses,
        "names": sorted(n for n, _ in part.named_parameters()),
    }


def test_torchtitan_pipeline_stages_to_one(tmp_path: Path) -> None:
    """PP2 (torchtitan's split) saved, loaded into one process: the merge of the stages' state, equal."""
    path = str(tmp_path / "ck")
    stages = run_ranks(pp_job, 2, path, [0, 1], work_dir=tmp_path)
    assert not set(stages[0]["names"]) & set(stages[1]["names"]), "the stages hold different layers"
    saved = stages[0]["saved"] | stages[1]["saved"]
    one = job(0, 1, "one", path, True, [2, 3])
    assert_tensors_equal(one["loaded"], saved, "pp2 -> one")
    uninterrupted = job(0, 1, "one", str(tmp_path / "ref"), False, [0, 1, 2, 3])
    assert stages[1]["losses"] + one["losses"] == pytest.approx(uninterrupted["losses"], rel=1e-4, abs=1e-4)
