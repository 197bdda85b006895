"""DeepSpeed ZeRO-3 models, for writing a model folder or checkpoint of a model no rank holds whole.

Under ZeRO-3 every rank holds a slice of each parameter (``ds_id``, ``ds_shape``); a model
folder needs whole tensors. :func:`zero3_gathered_tensors` streams the 16-bit model one module's
parameters at a time (memory bounded by the largest module, as ``engine.save_16bit_model``);
:func:`zero3_sharded_model` builds a stand-in that shardsafe saves as a sharded checkpoint (fp32
master weights, each rank holding its dim-0 slice), for ``stage3_gather_16bit_weights_on_model_save:
false``. DeepSpeed is imported only inside the functions that need it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardsafe.api.source import TensorInfo
from shardsafe.compat.deepspeed import z3_optimizer
from shardsafe.core.comm import Comm, get_comm
from shardsafe.core.dtypes import output_dtype
from shardsafe.errors import ShardsafeError
from shardsafe.hf.pretrained import tied_aliases

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["is_zero3_model", "parameter_count", "zero3_gathered_tensors", "zero3_sharded_model"]


def is_zero3_model(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are DeepSpeed ZeRO-3 partitions (``ds_id`` set by ``deepspeed.zero.Init`` or the
    engine)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _state_entries(module: nn.Module) -> list[tuple[str, nn.Module, str, bool]]:
    """(state-dict name, owning module, attribute, is a parameter) in ``nn.Module.state_dict`` order."""
    entries = []
    for prefix, owner in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        entries += [(dot + name, owner, name, True) for name, p in owner._parameters.items() if p is not None]
        skip = owner._non_persistent_buffers_set
        entries += [
            (dot + name, owner, name, False) for name, b in owner._buffers.items() if b is not None and name not in skip
        ]
    return entries


def parameter_count(module: nn.Module) -> int:
    """Parameters of the model, each tied one once (ZeRO-3 partitions count whole)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


@contextmanager
def _checkpoint_event(engine: Any) -> Iterator[None]:
    """Around whole-model gathers: partition everything first, re-gather the persistent parameters after (as DeepSpeed
    does)."""
    optimizer: Any = getattr(engine, "optimizer", None) if engine is not None else None
    if hasattr(optimizer, "checkpoint_event_prologue"):
        optimizer.checkpoint_event_prologue()
    try:
        yield
    finally:
        if hasattr(optimizer, "checkpoint_event_epilogue"):
            optimizer.checkpoint_event_epilogue()


def zero3_gathered_tensors(
    module: nn.Module, engine: Any = None, dtype: torch.dtype | None = None
) -> tuple[list[TensorInfo], Iterator[tuple[str, torch.Tensor]]]:
    """The 16-bit model of a ZeRO-3 ``module`` for :func:`~shardsafe.hf.pretrained.save_pretrained_stream`.

    Returns the tensor list (state-dict order, tied aliases left out as transformers does) and a
    generator every rank must run to its end: it gathers one module's parameters at a time
    (``deepspeed.zero.GatheredParameters``, a collective) and yields each whole tensor while it is
    gathered, so memory is bounded by the largest module. The values are DeepSpeed's own
    (``engine.save_16bit_model`` gathers the same way); ``dtype`` casts the floating-point ones.
    """
    entries = _state_entries(module)
    aliases = tied_aliases(module, [name for name, *_ in entries])
    wanted = [(name, owner, attr, is_param) for name, owner, attr, is_param in entries if name not in aliases]
    infos = []
    for name, owner, attr, is_param in wanted:
        tensor = getattr(owner, attr)
        shape = tuple(int(d) for d in (tensor.ds_shape if is_param and hasattr(tensor, "ds_shape") else tensor.shape))
        infos.append(TensorInfo(name, output_dtype(tensor.dtype, dtype), shape))

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        import deepspeed

        with _checkpoint_event(engine):
            for _, entries_of_module in itertools.groupby(wanted, key=lambda item: id(item[1])):
                group = list(entries_of_module)
                params = [getattr(owner, attr) for _, owner, attr, is_param in group if is_param]
                with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                    for name, owner, attr, _ in group:
                        yield name, getattr(owner, attr).detach()

    return infos, stream()


def zero3_sharded_model(module: nn.Module, engine: Any = None) -> nn.Module:
    """A stand-in for a ZeRO-3 ``module`` that shardsafe can save: each rank holds its dim-0 slice of every tensor.

    Same state-dict names and order as ``module``. Trainable parameters come from the optimizer's
    fp32 master weights (``deepspeed.utils.safe_get_full_fp32_param``; what ``zero_to_fp32``
    recovers), frozen ones in their own dtype, gathered one parameter at a time; each rank keeps
    only its ``torch.chunk`` slice along dim 0, as a DTensor ``Shard(0)`` over all ranks, so a rank
    holds about 1/world of the fp32 model. Buffers (not partitioned) are kept whole and saved once.
    Tied parameters stay tied (one stand-in parameter under both names).
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from torch.distributed.tensor import DTensor, Shard

    comm = get_comm()
    mesh = _cpu_mesh(comm)
    root = nn.Module()
    mirrors: dict[str, nn.Module] = {"": root}
    made: dict[int, nn.Parameter] = {}
    with _checkpoint_event(engine):
        for name, owner, attr, is_param in _state_entries(module):
            prefix, _, leaf = name.rpartition(".")
            holder = _mirror(mirrors, prefix)
            tensor = getattr(owner, attr)
            if not is_param:
                holder.register_buffer(leaf, tensor.detach())
                continue
            if id(tensor) not in made:
                _check_partition_group(tensor, comm, name)
                full = (
                    safe_get_full_fp32_param(tensor)
                    if tensor.requires_grad and z3_optimizer(tensor) is not None
                    else None
                )
                if full is None:
                    with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                        full = tensor.detach().clone()
                if full.dim() == 0 or mesh is None:  # whole on every rank: saved once
                    local = full.cpu().clone()
                else:
                    pieces = full.chunk(comm.world_size, dim=0)
                    mine = pieces[comm.rank] if comm.rank < len(pieces) else full[full.shape[0] :]
                    local = DTensor.from_local(
                        mine.cpu().clone(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
                    )
                del full
                made[id(tensor)] = nn.Parameter(local, requires_grad=False)
            holder.register_parameter(leaf, made[id(tensor)])
    return root


def _mirror(mirrors: dict[str, nn.Module], prefix: str) -> nn.Module:
    if prefix not in mirrors:
        parent, _, leaf = prefix.rpartition(".")
        holder = nn.Module()
        _mirror(mirrors, parent).add_module(leaf, holder)
        mirrors[prefix] = holder
    return mirrors[prefix]


def _cpu_mesh(comm: Comm) -> DeviceMesh | None:
    """A 1-D CPU device mesh over every rank (the stand-in's slices live in host memory); None on one process."""
    if not comm.distributed:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (comm.world_size,))


def _check_partition_group(param: Any, comm: Comm, name: str) -> None:
    group = getattr(param, "ds_process_group", None)
    if group is not None and comm.distributed:
        import torch.distributed as dist

        if dist.get_world_size(group) != comm.world_size:
            raise ShardsafeError(
                f"{name}: partitioned over {dist.get_world_size(group)} of {comm.world_size} ranks (ZeRO++ / MiCS); "
                "not supported"
            )
