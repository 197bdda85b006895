"""Turning live training objects into named tensor chunks plus JSON, and back.

Supported ``state`` values: ``nn.Module`` (plain, DDP, FSDP2), ``torch.optim.Optimizer`` (keyed
by the parameter names of the module in the same dict, so it reshards), a DeepSpeed ZeRO-3 engine
(``deepspeed_engine.py``: its partitions, optimizer state and counters), anything with
``state_dict()``/``load_state_dict()``, tensors and DTensors, per-rank objects (``per_rank = True``,
like :class:`~shardsafe.rng.RNGState`), and JSON-able values.

Tensor keys are ``<state name>/<path>``, e.g. ``model/layer.0.weight`` or
``optim/state/layer.0.weight/exp_avg``; the same function names them on save and on load.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardsafe.core.format import decode_value, encode_value
from shardsafe.core.plan import LocalChunk
from shardsafe.errors import ShardsafeError, StateMismatchError
from shardsafe.protocol.transfer import ReadTarget
from shardsafe.state.deepspeed_engine import KIND_DEEPSPEED_ENGINE, bind_engine, describe_engine, is_deepspeed_engine

KIND_MODULE = "module"
KIND_OPTIMIZER = "optimizer"
KIND_STATEFUL = "stateful"
KIND_PER_RANK = "per_rank"
KIND_TENSOR = "tensor"
KIND_VALUE = "value"


def local_placement(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local data, global shape, global offsets of the local data) of a tensor or DTensor."""
    if is_dtensor(tensor):
        from torch.distributed.tensor import DTensor, Replicate

        assert isinstance(tensor, DTensor)
        if any(not (p.is_shard() or isinstance(p, Replicate)) for p in tensor.placements):
            raise ShardsafeError(f"cannot save a DTensor with placements {tensor.placements}: reduce partial values first")
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(tensor.shape), tuple(int(o) for o in offsets)
    return tensor, tuple(tensor.shape), (0,) * tensor.dim()


def is_dtensor(tensor: object) -> bool:
    """isinstance(tensor, DTensor) without importing torch.distributed.tensor (over a second of a
    CLI start): a DTensor can only exist once that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(tensor, cls)


def unwrap_module(module: nn.Module) -> nn.Module:
    inner = getattr(module, "module", None)
    if isinstance(module, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        return inner
    return module


def _param_names(module: nn.Module) -> dict[int, str]:
    """Parameter id -> FQN; a tied parameter gets its first name, as torch's get_optimizer_state_dict keys it."""
    names: dict[int, str] = {}
    for name, p in unwrap_module(module).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def owner_module(state: dict[str, Any], optimizer: torch.optim.Optimizer, name: str) -> nn.Module:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and params <= set(_param_names(value)):
            return value
    raise ShardsafeError(
        f"state[{name!r}] is an optimizer, but no nn.Module in the same state dict owns all of its "
        "parameters; put the model in the dict too (its parameter names key the optimizer state)"
    )


def _model_state(module: nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module)


def _optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter names.

    An optimizer that has not stepped yet is described without touching it: torch's helper would
    run a dummy step to create its state, changing what training does next.
    """
    if optimizer.state:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer)
    names = _param_names(module)
    groups = []
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[id(p)] for p in group["params"]]
        groups.append(g)
    return {"state": {}, "param_groups": groups}


SavedLayout = Callable[[str], "tuple[tuple[int, ...], torch.dtype] | None"]
"""Global shape and dtype of a stored tensor key (None when the checkpoint lacks it)."""


def allocate_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, saved_state: Any, layout: SavedLayout) -> bool:
    """Give a fresh optimizer empty state tensors shaped like the checkpoint's, to be read into.

    torch's get_optimizer_state_dict creates missing state with a dummy optimizer step, which on
    a large model costs more than reading the checkpoint. Here a parameter-shaped entry
    (``exp_avg``) becomes ``empty_like(param)`` (same sharding and dtype as the parameter, as the
    optimizer itself would make it); any other tensor (``step``) gets the stored shape and dtype,
    on the parameter's device only for ``fused``/``capturable`` groups, as torch places it.
    Every element is then overwritten by the load (the manifest's chunks tile each tensor).

    Sizes come from the checkpoint, so nothing is allocated unless every non-parameter-shaped
    entry is at most as large as its parameter (true of torch's optimizers); otherwise this
    returns False and allocates nothing, and the caller creates the state the optimizer's own way.
    """
    by_name = {n: p for n, p in unwrap_module(module).named_parameters(remove_duplicate=False)}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    entries = decode_value(saved_state, lambda key: key).get("state", {})
    planned: list[tuple[torch.Tensor, str, tuple[int, ...], torch.dtype]] = []
    for fqn, saved in entries.items():
        param = by_name.get(fqn)
        if param is None or id(param) not in group_of or not isinstance(saved, dict):
            continue  # reported by the key comparison
        for k, key in saved.items():
            found = layout(key) if isinstance(key, str) else None
            if found is None:
                continue
            shape, dtype = found
            if not (param.dim() and shape == tuple(param.shape)) and math.prod(shape) > max(param.numel(), 1):
                return False
            planned.append((param, k, shape, dtype))
    with torch.no_grad():
        for owner, k, shape, dtype in planned:
            if owner.dim() and shape == tuple(owner.shape):
                optimizer.state[owner][k] = torch.empty_like(owner)
            else:
                group = group_of[id(owner)]
                device = _local(owner).device if group.get("fused") or group.get("capturable") else torch.device("cpu")
                optimizer.state[owner][k] = torch.empty(shape, dtype=dtype, device=device)
    return True


def _create_state_by_stepping(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """torch's way to give a fresh optimizer its state: a step with zero gradients (get_optimizer_state_dict)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(module, optimizer)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


@dataclass
class SaveView:
    """What this rank contributes to a save."""

    chunks: list[LocalChunk] = field(default_factory=list)
    tree: dict[str, Any] = field(default_factory=dict)  # shared entries (coordinator's copy is saved)
    per_rank: dict[str, Any] = field(default_factory=dict)  # this rank's per-rank entries


def _unique_paths(name: str) -> Callable[[str], None]:
    """Refuse a second tensor under the same key: a dict key containing '/' can spell another entry's
    path (``{"a/0": t1, "a": [t2]}``), and one of the two tensors would silently take the other's place."""
    seen: set[str] = set()

    def check(path: str) -> None:
        if path in seen:
            raise ShardsafeError(f"state[{name!r}]: two tensors map to the checkpoint key {path!r} (a dict key containing '/'?); rename one")
        seen.add(path)

    return check


def _collector(chunks: list[LocalChunk], name: str) -> Callable[[str, torch.Tensor], str]:
    unique = _unique_paths(name)

    def ref(path: str, tensor: torch.Tensor) -> str:
        unique(path)
        local, global_shape, offsets = local_placement(tensor)
        if local.numel() or not any(global_shape):
            chunks.append(LocalChunk(path, local, global_shape, offsets))
        return path

    return ref


def describe_for_save(state: dict[str, Any], rank: int) -> SaveView:
    view = SaveView()
    for name, value in state.items():
        _check_name(name)
        ref = _collector(view.chunks, name)
        if is_deepspeed_engine(value):  # before nn.Module: an engine is one
            view.tree[name], chunks = describe_engine(value, name)
            view.chunks += chunks
        elif isinstance(value, nn.Module):
            view.tree[name] = {"kind": KIND_MODULE, "state": encode_value(_model_state(value), name, ref)}
        elif isinstance(value, torch.optim.Optimizer):
            osd = _optimizer_state(owner_module(state, value, name), value)
            view.tree[name] = {"kind": KIND_OPTIMIZER, "state": encode_value(osd, name, ref)}
        elif getattr(value, "per_rank", False) and hasattr(value, "state_dict"):
            view.per_rank[name] = encode_value(value.state_dict(), f"{name}/rank{rank}", ref)
        elif isinstance(value, torch.Tensor):
            view.tree[name] = {"kind": KIND_TENSOR, "state": encode_value(value, name, ref)}
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            view.tree[name] = {"kind": KIND_STATEFUL, "state": encode_value(value.state_dict(), name, ref)}
        else:
            view.tree[name] = {"kind": KIND_VALUE, "state": encode_value(value, name, ref)}
    return view


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise ShardsafeError(f"state keys must be non-empty strings without '/', got {name!r}")


@dataclass
class LoadBinding:
    """Destinations for an in-place load, and what to do once tensors are in."""

    targets: dict[str, ReadTarget] = field(default_factory=dict)
    finalizers: list[Callable[[dict[str, Any], Callable[[str], torch.Tensor]], None]] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # state name -> kind expected


def _bind_tensors(binding: LoadBinding, value: Any, name: str) -> None:
    unique = _unique_paths(name)

    def ref(path: str, tensor: torch.Tensor) -> str:
        unique(path)
        local, global_shape, offsets = local_placement(tensor)
        binding.targets[path] = ReadTarget(path, local, global_shape, offsets)
        return path

    encode_value(value, name, ref)


def bind_for_load(state: dict[str, Any], rank: int, saved_tree: dict[str, Any] | None = None, layout: SavedLayout | None = None) -> LoadBinding:
    """Destinations for loading into ``state``; with the checkpoint's tree and ``layout``, a
    fresh optimizer first gets state tensors shaped like the stored ones."""
    binding = LoadBinding()
    for name, value in state.items():
        _check_name(name)
        if is_deepspeed_engine(value):  # before nn.Module: an engine is one
            binding.names[name] = KIND_DEEPSPEED_ENGINE
            targets, finish = bind_engine(value, name, saved_tree.get(name) if saved_tree is not None else None)
            binding.targets.update(targets)
            binding.finalizers.append(finish)
        elif isinstance(value, nn.Module):
            binding.names[name] = KIND_MODULE
            _bind_tensors(binding, _model_state(value), name)
        elif isinstance(value, torch.optim.Optimizer):
            binding.names[name] = KIND_OPTIMIZER
            module = owner_module(state, value, name)
            if not value.state:
                saved = saved_tree.get(name) if saved_tree is not None else None
                if not (layout is not None and isinstance(saved, dict) and allocate_optimizer_state(module, value, saved.get("state"), layout)):
                    _create_state_by_stepping(module, value)
            osd = _optimizer_state(module, value)
            _bind_tensors(binding, osd["state"], f"{name}/state")
            binding.finalizers.append(_optimizer_finalizer(name, module, value))
        elif getattr(value, "per_rank", False) and hasattr(value, "load_state_dict"):
            binding.names[name] = KIND_PER_RANK
            binding.finalizers.append(_per_rank_finalizer(name, value, rank))
        elif isinstance(value, torch.Tensor):
            binding.names[name] = KIND_TENSOR
            _bind_tensors(binding, value, name)
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            binding.names[name] = KIND_STATEFUL
            binding.finalizers.append(_stateful_finalizer(name, value))
        else:
            binding.names[name] = KIND_VALUE
            binding.finalizers.append(_value_finalizer(name, state))
    return binding


def _optimizer_finalizer(name: str, module: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[..., None]:
    def finish(tree: dict[str, Any], lookup: Callable[[str], torch.Tensor]) -> None:
        saved = decode_value(tree[name]["state"], lambda key: None)
        names = _param_names(module)
        by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            for k, v in saved_group.items():
                if k != "params":
                    group[k] = v
        for fqn, entries in saved["state"].items():
            param = by_name[fqn]
            for k, v in entries.items():
                if v is not None:  # tensors were read in place
                    optimizer.state[param][k] = v

    return finish


def check_optimizer_groups(name: str, module: nn.Module, optimizer: torch.optim.Optimizer, saved_state: Any) -> list[str]:
    """Problems that would make restoring param groups wrong (run before anything is modified)."""
    names = _param_names(module)
    saved = decode_value(saved_state, lambda key: None)
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    stored = [list(g.get("params", [])) for g in saved.get("param_groups", [])]
    if current != stored:
        return [f"{name}: optimizer parameter groups differ (saved {[len(g) for g in stored]} params per group, now {[len(g) for g in current]})"]
    return []


def _stateful_finalizer(name: str, obj: Any) -> Callable[..., None]:
    def finish(tree: dict[str, Any], lookup: Callable[[str], torch.Tensor]) -> None:
        obj.load_state_dict(decode_value(tree[name]["state"], lookup))

    return finish


def _per_rank_finalizer(name: str, obj: Any, rank: int) -> Callable[..., None]:
    def finish(tree: dict[str, Any], lookup: Callable[[str], torch.Tensor]) -> None:
        ranks = tree[name]["ranks"]
        obj.load_state_dict(decode_value(ranks[rank % len(ranks)], lookup))

    return finish


def _value_finalizer(name: str, state: dict[str, Any]) -> Callable[..., None]:
    def finish(tree: dict[str, Any], lookup: Callable[[str], torch.Tensor]) -> None:
        state[name] = decode_value(tree[name]["state"], lookup)

    return finish


def tensor_keys_of(tree_entry: Any) -> list[str]:
    """Every tensor key referenced inside an encoded tree."""
    keys: list[str] = []

    def collect(key: str) -> None:
        keys.append(key)
        return None

    decode_value(tree_entry, collect)
    return keys


def describe_mismatch(problems: list[str]) -> StateMismatchError:
    shown = "\n  ".join(problems[:50])
    more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
    return StateMismatchError(f"checkpoint does not fit the state ({len(problems)} problems):\n  {shown}{more}")
