"""A small transformer-style model laid out the ways N-D training lays it out, with torchtitan's names.

``build(layout, rank, world_size, seed)`` returns (model, optimizer) for one rank:

* ``one``: a plain module (one process);
* ``fsdp``: FSDP2 ``fully_shard`` per block and at the root, over all ranks;
* ``tp``: tensor parallel only (``w1``/``w3`` colwise, ``w2`` rowwise; norms replicated);
* ``2d``: ``(dp, tp)`` = (world/2, 2): tensor parallel, then ``fully_shard`` over ``dp`` (the
  standard torchtitan layout: the colwise weights become ``_StridedShard``);
* ``hsdp``: ``(replicate, shard)`` = (2, world/2) ``fully_shard`` (HSDP);
* ``pp``: pipeline stages: rank r keeps only its stage's blocks, under their full names
  (``layers.0`` on stage 0, ...), and the head on the last stage;
* ``pp_fsdp``: ``(pp, dp)`` = (2, world/2): stages as ``pp``, each stage ``fully_shard`` over ``dp``;
* ``pp_tp``: ``(pp, tp)`` = (2, world/2): stages as ``pp``, each stage tensor parallel over ``tp``;
* ``ep``: a stacked ``experts`` tensor ``[E, D, D]`` sharded on dim 0 over all ranks (expert
  parallel), the rest plain on every rank; ``one_ep``: the same model in one process.

Every layout starts from the same values (same seed, built whole, then laid out), so whole
tensors compare across layouts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

DIM, HIDDEN, LAYERS, OUT, EXPERTS = 8, 10, 4, 3, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self, experts: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, OUT)
        if experts:
            self.experts = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        if hasattr(self, "experts"):
            e = self.experts.full_tensor() if isinstance(self.experts, DTensor) else self.experts
            x = x + torch.einsum("bd,edk->bk", x, e) / EXPERTS
        if not hasattr(self, "output"):  # a pipeline stage before the last: its activations
            return x
        return self.output(self.norm(x))


def stage_layers(stage: int, stages: int) -> list[str]:
    per = -(-LAYERS // stages)
    return [str(i) for i in range(stage * per, min(LAYERS, (stage + 1) * per))]


def make_model(seed: int, experts: bool = False) -> Model:
    torch.manual_seed(seed)
    return Model(experts)


def _tensor_parallel(model: Model, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})


def _keep_stage(model: Model, stage: int, stages: int) -> None:
    keep = set(stage_layers(stage, stages))
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != stages - 1:
        del model.norm
        del model.output


def build(layout: str, rank: int, world_size: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(model, AdamW) of ``layout`` for this rank (see the module docstring)."""
    model = make_model(seed, experts=layout.startswith("ep") or layout == "one_ep")
    if layout in ("one", "one_ep"):
        pass
    elif layout == "fsdp":
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        _tensor_parallel(model, init_device_mesh("cpu", (world_size,)))
    elif layout == "2d":
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, mesh["tp"])
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "pp":
        _keep_stage(model, rank, world_size)
    elif layout == "pp_fsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
        stage = mesh.get_coordinate()[0]
        _keep_stage(model, stage, 2)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "pp_tp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "tp"))
        _keep_stage(model, mesh.get_coordinate()[0], 2)
        _tensor_parallel(model, mesh["tp"])
    elif layout == "ep":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
        # the rest: plain, on every rank
        model.experts = nn.Parameter(distribute_tensor(model.experts.detach(), mesh, [Shard(0)]))
    else:
        raise ValueError(layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optimizer


def batch(step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank (data parallel ranks then compute the single-process gradient)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(4, DIM, generator=g), torch.randn(4, OUT, generator=g)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, index: int, seed: int = 0) -> float:
    x, y = batch(index, seed)
    out = model(x)
    # A pipeline stage without the head trains on its own activations (state to save, not a real schedule).
    loss = (out - y).square().mean() if out.shape == y.shape else out.square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every optimizer moment this rank's model has, whole, keyed by FQN."""
    out = {name: whole(p) for name, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, entries in optimizer.state.items():
        for k, v in entries.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[id(param)]}/{k}"] = whole(v)
    return out


def local_layout(model: nn.Module) -> dict[str, str]:
    """Parameter FQN -> its placements (what the test asserts the layout really is)."""
    return {n: str(tuple(p.placements)) if isinstance(p, DTensor) else "plain" for n, p in model.named_parameters()}
