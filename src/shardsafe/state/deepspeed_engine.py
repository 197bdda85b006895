"""A live DeepSpeed ZeRO-3 engine as a ``state`` value of :func:`shardsafe.save` / :func:`shardsafe.load`.

``shardsafe.save(path, {"engine": engine, "sched": scheduler})`` writes, from every rank, exactly the
partition that rank owns of each trainable parameter's fp32 master weights and optimizer moments and
of each frozen parameter; persistent buffers and the small JSON part (param-group hyper-parameters,
optimizer step counts, loss scaler, engine counters) are written once. ``shardsafe.load`` reads each
rank's new partition straight into the engine's own flat buffers, at the saving world size or at any
other (which ``engine.load_checkpoint`` refuses), then refreshes the 16-bit partitions from the fp32
master, as DeepSpeed's own ``_rigid_load_state_dict`` does.

Why this layout: ZeRO-3 gives rank r elements ``[r*part, (r+1)*part)`` of each flattened parameter
(``part = ceil(numel / W)``, the last rank's slice padded). Stored as a 1-D tensor of ``numel``
elements per parameter (padding never stored), that slice is a contiguous chunk at offset
``r*part``; at another world size each rank's new slice is a contiguous range of the same tensor,
so the normal resharding reader (``plan.plan_reads``) serves it with one ``preadv`` per stored chunk
it overlaps, straight into a view of the flat partition. Keying by parameter name (not by DeepSpeed's
sub-group index, whose boundaries depend on W) is what makes the load independent of the world size.

DeepSpeed is never imported at import time: :func:`is_deepspeed_engine` looks in ``sys.modules``.
Internals relied on (DeepSpeed 0.19.8, ``deepspeed/runtime/zero/stage3.py``): the optimizer's
``fp32_partitioned_groups_flat`` / ``fp16_partitioned_groups_flat`` (one flat tensor per sub-group),
``fp16_groups`` (the parameters of each sub-group, in flat order), ``sub_group_to_group_id``,
``grad_position[param_id] = (sub_group, offset, partition numel)`` and ``get_param_id``, the inner
torch optimizer's ``state`` keyed by the fp32 flat tensors, ``loss_scaler``, ``dynamic_loss_scale``,
``overflow``, ``_unflatten_partitioned_parameters``, ``checkpoint_event_prologue`` and
``invalidate_secondary_tensor``; per parameter ``ds_tensor``, ``ds_shape``, ``ds_numel``,
``partition_numel()`` and ``ds_process_group``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shardsafe.core.format import TENSOR_REF, decode_value, dtype_from_name, dtype_name, encode_value
from shardsafe.core.plan import LocalChunk
from shardsafe.errors import FormatError, ShardsafeError
from shardsafe.protocol.transfer import ReadTarget

KIND_DEEPSPEED_ENGINE = "deepspeed_engine"
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
SECTIONS = ("fp32", "optim", "frozen", "buffers")

Lookup = Callable[[str], torch.Tensor]
Finalizer = Callable[[dict[str, Any], Lookup], None]


def is_deepspeed_engine(value: object) -> bool:
    """True for a ``deepspeed.DeepSpeedEngine``; never imports DeepSpeed (a value can only be an engine
    if DeepSpeed is already imported)."""
    if "deepspeed" not in sys.modules:
        return False
    try:
        engine_module = importlib.import_module("deepspeed.runtime.engine")
    except Exception:  # a half-imported or broken DeepSpeed: then nothing is an engine
        return False
    return isinstance(value, engine_module.DeepSpeedEngine)


def fresh_engine_optimizers(values: Iterable[Any]) -> list[torch.optim.Optimizer]:
    """The inner torch optimizers of engines that have not stepped yet: a failed load empties their state
    again (the load creates state tensors to read into, as for a fresh plain optimizer)."""
    out = []
    for value in values:
        if is_deepspeed_engine(value):
            inner = getattr(getattr(value, "optimizer", None), "optimizer", None)
            if isinstance(inner, torch.optim.Optimizer) and not inner.state:
                out.append(inner)
    return out


# ----------------------------------------------------------------------------- the engine's layout


@dataclass
class _Param:
    """One parameter of the engine and this rank's share of it."""

    name: str
    param: Any  # a ZeRO-3 parameter (torch.nn.Parameter with ds_* attributes)
    numel: int
    shape: tuple[int, ...]
    part: int  # elements per rank (ceil(numel / W)); the last ranks' shares are padded
    rank: int  # this rank's index in the parameter's partition group
    sub_group: int = -1  # trainable only: index of its flat sub-group
    flat_offset: int = 0  # trainable only: where its partition starts in the flat sub-group

    @property
    def start(self) -> int:
        """Global element offset of this rank's share (clipped, so an empty share still has a valid offset)."""
        return min(self.rank * self.part, self.numel)

    @property
    def count(self) -> int:
        """Elements of this rank's share that belong to the parameter (padding excluded)."""
        return max(0, min(self.numel, (self.rank + 1) * self.part) - self.rank * self.part)


class _Zero3:
    """The parts of a ZeRO-3 engine that hold training state, found once and checked."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine = engine
        self.name = name
        where = f"state[{name!r}] (a DeepSpeed engine)"
        stage = int(engine.zero_optimization_stage())
        if stage != 3:
            raise ShardsafeError(
                f"{where} uses ZeRO stage {stage}; only ZeRO stage 3 engines can be saved and loaded as a state value. "
                "Use engine.save_checkpoint for stages 0-2 (shardsafe.convert_deepspeed converts those checkpoints)"
            )
        opt = engine.optimizer
        if opt is None or not hasattr(opt, "fp32_partitioned_groups_flat") or not hasattr(opt, "optimizer"):
            raise ShardsafeError(f"{where} has no ZeRO-3 optimizer (was it initialised without one?); save engine.module instead")
        if getattr(engine, "mp_world_size", 1) != 1 or getattr(engine, "pipeline_parallelism", False) or getattr(engine, "has_moe_layers", False):
            raise ShardsafeError(f"{where} uses tensor, pipeline or expert parallelism, which shardsafe does not support for engines")
        if getattr(opt, "swap_optimizer", False) or any(flat is None for flat in opt.fp16_partitioned_groups_flat):
            raise ShardsafeError(f"{where} offloads parameters or optimizer state to NVMe, which shardsafe does not support for engines")
        if getattr(opt, "offload_optimizer", False) and getattr(opt, "partial_offload", 1.0) != 1.0:
            # part of the sub-groups would keep their state in opt.backup_optimizer
            raise ShardsafeError(f"{where} offloads only part of the optimizer (offload_optimizer.ratio < 1), which shardsafe does not support")
        self.opt = opt
        self.inner: torch.optim.Optimizer = opt.optimizer
        self.flats: list[torch.Tensor] = list(opt.fp32_partitioned_groups_flat)
        self.group_of_sub: list[int] = [int(opt.sub_group_to_group_id[i]) for i in range(len(self.flats))]

        names: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for pname, p in engine.module.named_parameters(remove_duplicate=False):
            if id(p) in names:
                aliases[pname] = names[id(p)]
            else:
                names[id(p)] = pname
        self.aliases = aliases
        self.trainable: list[_Param] = []
        seen: set[int] = set()
        for sub_group, params in enumerate(opt.fp16_groups):
            for p in params:
                if id(p) not in names:
                    raise ShardsafeError(f"{where}: an optimizer parameter (shape {list(p.ds_shape)}) is not a parameter of engine.module")
                sub, offset, _ = opt.grad_position[opt.get_param_id(p)]
                if int(sub) != sub_group:
                    raise ShardsafeError(f"{where}: parameter {names[id(p)]!r} is in sub-group {sub_group} but DeepSpeed places it in {sub}")
                self.trainable.append(self._describe(names[id(p)], p, sub_group=sub_group, flat_offset=int(offset)))
                seen.add(id(p))
        self.frozen = [self._describe(n, p) for n, p in engine.module.named_parameters() if id(p) not in seen]
        self.buffers: dict[str, torch.Tensor] = {}
        for module_name, module in engine.module.named_modules():
            for bname, buf in module.named_buffers(recurse=False):
                if buf is not None and bname not in module._non_persistent_buffers_set:
                    self.buffers.setdefault(f"{module_name}.{bname}" if module_name else bname, buf)

    def _describe(self, name: str, p: Any, sub_group: int = -1, flat_offset: int = 0) -> _Param:
        if not hasattr(p, "ds_tensor") or p.ds_tensor is None:
            raise ShardsafeError(f"state[{self.name!r}]: parameter {name!r} is not partitioned by ZeRO-3 (no ds_tensor)")
        if getattr(p.ds_tensor, "ds_quant_scale", None) is not None:
            raise ShardsafeError(
                f"state[{self.name!r}]: parameter {name!r} is stored quantized (zero_quantized_nontrainable_weights); shardsafe does not support that"
            )
        import torch.distributed as dist

        group = getattr(p, "ds_process_group", None)
        world = dist.get_world_size(group=group)
        rank = dist.get_rank(group=group)
        numel, part = int(p.ds_numel), int(p.partition_numel())
        if part * world < numel or (numel and part != -(-numel // world)) or p.ds_tensor.numel() != part:
            raise ShardsafeError(
                f"state[{self.name!r}]: parameter {name!r} ({numel} elements) is partitioned unexpectedly over {world} ranks "
                f"({part} per rank, local partition {p.ds_tensor.numel()}); this DeepSpeed version's ZeRO-3 layout is not supported"
            )
        return _Param(name, p, numel, tuple(int(d) for d in p.ds_shape), part, rank, sub_group, flat_offset)

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(group=getattr(self.opt, "dp_process_group", None))

    def fp32_view(self, p: _Param) -> torch.Tensor:
        """This rank's share of ``p`` in the fp32 master partition (a view: reading into it loads it)."""
        return self.flats[p.sub_group].narrow(0, p.flat_offset, p.count)

    def frozen_view(self, p: _Param) -> torch.Tensor:
        return p.param.ds_tensor.data.view(-1).narrow(0, 0, p.count)

    def sub_group_state(self, sub_group: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(per-element state tensors, scalar state) of a sub-group's inner optimizer state.

        Per-element tensors (``exp_avg``) are as long as the flat sub-group; scalars (``step``, a 0-dim
        tensor in torch's AdamW) are shared by the sub-group's parameters. Anything else has no
        meaning per parameter and is refused.
        """
        flat = self.flats[sub_group]
        elementwise: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for key, value in self.inner.state.get(flat, {}).items():
            if not isinstance(key, str):
                raise ShardsafeError(f"state[{self.name!r}]: optimizer state key {key!r} of sub-group {sub_group} is not a string")
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == flat.shape:
                elementwise[key] = value
            elif isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() <= 1:
                scalars[key] = value
            elif value is None or isinstance(value, (bool, int, float)):
                scalars[key] = value
            else:
                shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ShardsafeError(
                    f"state[{self.name!r}]: optimizer state {key!r} of sub-group {sub_group} is {shown}, neither one value per "
                    f"element of the flat partition ({flat.numel()}) nor a scalar; shardsafe cannot reshard it"
                )
        return elementwise, scalars

    def group_params(self) -> list[list[str]]:
        """Trainable parameter names of each optimizer param group, in flat order."""
        groups: list[list[str]] = [[] for _ in self.inner.param_groups]
        for p in self.trainable:
            groups[self.group_of_sub[p.sub_group]].append(p.name)
        return groups


def tensor_key(name: str, section: str, *rest: str) -> str:
    """The stored key of an engine tensor: ``<name>/<section>/[<state key>/]<fqn>``."""
    return "/".join((name, section, *rest))


def _no_tensors(where: str) -> Callable[[str, torch.Tensor], str]:
    def refuse(path: str, tensor: torch.Tensor) -> str:
        raise ShardsafeError(f"{where}: {path!r} is a tensor; shardsafe stores engine hyper-parameters and scaler state as JSON only")

    return refuse


def _encode_scalar(value: Any) -> dict[str, Any]:
    """A scalar optimizer state value as exact JSON: a 1-element tensor keeps its dtype, shape and value."""
    if isinstance(value, torch.Tensor):
        item = value.detach().cpu().reshape(-1)[0].item()
        return {"tensor": {"dtype": dtype_name(value.dtype), "shape": list(value.shape), "value": item}}
    return {"value": value}


def _decode_scalar(encoded: Any, where: str) -> tuple[str, Any]:
    """(kind, value) with kind "tensor" (value a CPU tensor) or "value"; FormatError if malformed."""
    if isinstance(encoded, dict) and set(encoded) == {"value"}:
        value = encoded["value"]
        if value is None or isinstance(value, (bool, int, float)):
            return "value", value
    if isinstance(encoded, dict) and set(encoded) == {"tensor"} and isinstance(encoded["tensor"], dict):
        spec = encoded["tensor"]
        shape = spec.get("shape")
        if isinstance(shape, list) and len(shape) <= 1 and all(s == 1 for s in shape) and isinstance(spec.get("value"), (bool, int, float)):
            tensor = torch.tensor(spec["value"], dtype=dtype_from_name(spec.get("dtype"), where)).reshape(shape)
            return "tensor", tensor
    raise FormatError(f"{where}: malformed optimizer scalar {encoded!r:.100}")


# ----------------------------------------------------------------------------- save


def describe_engine(engine: Any, name: str) -> tuple[dict[str, Any], list[LocalChunk]]:
    """This rank's chunks of the engine's state, and the JSON entry for ``state.json``.

    Trainable parameters: ``<name>/fp32/<fqn>`` and ``<name>/optim/<key>/<fqn>``, 1-D of numel
    elements, this rank's chunk at offset ``rank * part``; frozen: ``<name>/frozen/<fqn>`` likewise
    (in the parameter's dtype); persistent buffers: ``<name>/buffers/<fqn>`` whole, replicated (the
    coordinator's planner picks one writer). Nothing is copied: chunks are views of DeepSpeed's
    buffers (an async save copies them into its staging buffers in the call).
    """
    z = _Zero3(engine, name)
    chunks: list[LocalChunk] = []
    state: dict[str, Any] = {section: {} for section in SECTIONS}

    def add(key: str, view: torch.Tensor, p: _Param) -> dict[str, str]:
        if p.count or not p.numel:  # a rank whose share is all padding holds nothing of the tensor
            chunks.append(LocalChunk(key, view, (p.numel,), (p.start,)))
        return {TENSOR_REF: key}

    _sync(z)
    params_meta: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]] = {}
    scalars_meta: list[tuple[list[str], dict[str, Any]]] = []
    by_sub: dict[int, list[_Param]] = {}
    for p in z.trainable:
        by_sub.setdefault(p.sub_group, []).append(p)
    for sub_group in range(len(z.flats)):
        elementwise, scalars = z.sub_group_state(sub_group)
        members = by_sub.get(sub_group, [])
        for p in members:
            for key, tensor in elementwise.items():
                view = tensor.narrow(0, p.flat_offset, p.count)
                state["optim"].setdefault(key, {})[p.name] = add(tensor_key(name, "optim", key, p.name), view, p)
        if scalars:
            scalars_meta.append(([p.name for p in members], scalars))
    groups = z.group_params()
    group_index = {n: g for g, members in enumerate(groups) for n in members}
    for p in z.trainable:
        state["fp32"][p.name] = add(tensor_key(name, "fp32", p.name), z.fp32_view(p), p)
        params_meta[p.name] = (p.shape, p.param.ds_tensor.dtype, group_index[p.name])
    for p in z.frozen:
        state["frozen"][p.name] = add(tensor_key(name, "frozen", p.name), z.frozen_view(p), p)
        params_meta[p.name] = (p.shape, p.param.ds_tensor.dtype, None)
    for bname, buf in z.buffers.items():
        key = tensor_key(name, "buffers", bname)
        tensor = buf.detach()
        chunks.append(LocalChunk(key, tensor if tensor.is_contiguous() else tensor.contiguous(), tuple(tensor.shape), (0,) * tensor.dim()))
        state["buffers"][bname] = {TENSOR_REF: key}

    scaler = getattr(z.opt, "loss_scaler", None)
    import deepspeed

    meta = engine_meta(
        name,
        world_size=z.world_size,
        deepspeed_version=str(getattr(deepspeed, "__version__", "unknown")),
        params=params_meta,
        aliases=z.aliases,
        param_groups=[(groups[g], {k: v for k, v in group.items() if k != "params"}) for g, group in enumerate(z.inner.param_groups)],
        optimizer_scalars=scalars_meta,
        loss_scaler=None if scaler is None else (type(scaler).__name__, dict(vars(scaler))),
        dynamic_loss_scale=bool(getattr(z.opt, "dynamic_loss_scale", False)),
        overflow=bool(getattr(z.opt, "overflow", False)),
        counters={c: int(getattr(engine, c)) for c in COUNTERS if hasattr(engine, c)},
    )
    return {"kind": KIND_DEEPSPEED_ENGINE, "state": state, "meta": meta}, chunks


def engine_meta(
    name: str,
    *,
    world_size: int,
    deepspeed_version: str,
    params: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]],
    aliases: dict[str, str],
    param_groups: list[tuple[list[str], dict[str, Any]]],
    optimizer_scalars: list[tuple[list[str], dict[str, Any]]],
    loss_scaler: tuple[str, dict[str, Any]] | None,
    dynamic_loss_scale: bool,
    overflow: bool,
    counters: dict[str, int],
) -> dict[str, Any]:
    """The JSON ``meta`` of an engine entry, from plain values.

    One builder for both writers, :func:`describe_engine` (a live engine) and
    ``convert_deepspeed(for_engine=True)`` (a DeepSpeed checkpoint), so that what :func:`check_engine`
    and the load's finalizer read has a single format. ``params``: name -> (original shape, 16-bit
    dtype, param group or None when frozen); ``param_groups``: (trainable names in flat order,
    hyper-parameters); ``optimizer_scalars``: (names, scalar state) per optimizer sub-group;
    ``loss_scaler``: (class name, attributes). Hyper-parameters and scaler state must be JSON values
    (tensors are refused).
    """

    def encoded(value: dict[str, Any], path: str, what: str) -> Any:
        return encode_value(value, f"{name}/{path}", _no_tensors(f"state[{name!r}]: {what}"))

    return {
        "zero_stage": 3,
        "world_size": world_size,
        "deepspeed_version": deepspeed_version,
        "params": {n: {"shape": list(shape), "dtype": dtype_name(dtype), "group": group} for n, (shape, dtype, group) in params.items()},
        "aliases": dict(aliases),
        "param_groups": [
            {"params": list(names), "hyper": encoded(hyper, f"param_groups/{g}", f"optimizer param group {g}")}
            for g, (names, hyper) in enumerate(param_groups)
        ],
        "optimizer_scalars": [
            {"params": list(names), "state": {k: _encode_scalar(v) for k, v in state.items()}} for names, state in optimizer_scalars
        ],
        "loss_scaler": None if loss_scaler is None else {"class": loss_scaler[0], "state": encoded(loss_scaler[1], "loss_scaler", "loss scaler")},
        "dynamic_loss_scale": dynamic_loss_scale,
        "overflow": overflow,
        "counters": dict(counters),
    }


def flat_tensor_shapes(entry: Any, name: str) -> dict[str, tuple[int, ...]]:
    """Stored key -> the parameter's real shape, for every flat tensor of a saved engine entry
    (fp32 master or frozen weights, and the moments); for display, so empty for a malformed entry."""
    try:
        layout = engine_model_tensors(entry, name)
    except FormatError:
        return {}
    optim = entry["state"].get("optim") or {}
    out: dict[str, tuple[int, ...]] = {}
    for pname, (key, shape) in layout.items():
        if shape is not None:  # None: a buffer, stored in its own shape
            out[key] = shape
            out.update({tensor_key(name, "optim", moment, pname): shape for moment in optim})
    return out


def engine_model_tensors(entry: Any, where: str) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """For export: model tensor name -> (stored key, original shape) of a saved engine entry.

    Trainable parameters come from their fp32 master (as DeepSpeed's zero_to_fp32 does), frozen
    ones in their own dtype, both reshaped from the stored 1-D form; persistent buffers as stored
    (shape None). A tied parameter is stored once, under its first name, and exported once.
    """
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: not a DeepSpeed engine entry")
    state = decode_value(entry.get("state"), lambda key: key, where)
    meta = _saved_meta(entry, where)
    params = meta.get("params")
    if not isinstance(state, dict) or not isinstance(params, dict):
        raise FormatError(f"{where}: the engine entry has no parameter table")
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for pname, info in params.items():
        section = "frozen" if not isinstance(info, dict) or info.get("group") is None else "fp32"
        key = (state.get(section) or {}).get(pname)
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(key, str) or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise FormatError(f"{where}: parameter {pname!r} has no stored {section} tensor or no valid shape")
        out[pname] = (key, tuple(shape))
    for bname, key in (state.get("buffers") or {}).items():
        if not isinstance(key, str):
            raise FormatError(f"{where}: buffer {bname!r} is not a stored tensor")
        out[bname] = (key, None)
    return out


def _sync(z: _Zero3) -> None:
    """Wait for DeepSpeed's side streams (an accelerator's async partition copies) before reading its buffers."""
    if any(flat.device.type != "cpu" for flat in z.flats):
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()


# ----------------------------------------------------------------------------- load


def _saved_sections(saved_entry: Any) -> dict[str, Any]:
    state = saved_entry.get("state") if isinstance(saved_entry, dict) else None
    return state if isinstance(state, dict) else {}


def _saved_meta(saved_entry: Any, name: str) -> dict[str, Any]:
    meta = saved_entry.get("meta") if isinstance(saved_entry, dict) else None
    if not isinstance(meta, dict):
        raise FormatError(f"state.json: {name!r} (a DeepSpeed engine entry) has no meta object")
    return meta


def bind_engine(engine: Any, name: str, saved_entry: Any = None) -> tuple[dict[str, ReadTarget], Finalizer]:
    """Read targets (views of this rank's new partitions) and the finalizer that completes the load.

    An engine that has not stepped has no optimizer state yet: it gets zero-filled state tensors for
    the per-element keys the checkpoint holds (what the optimizer would create; the padding of the
    last rank's share stays zero), so there is memory to read into. ``api.load`` empties them again
    if the load fails before reading.
    """
    z = _Zero3(engine, name)
    saved_optim = _saved_sections(saved_entry).get("optim")
    if not z.inner.state and isinstance(saved_optim, dict):
        with torch.no_grad():
            for flat in z.flats:
                slot = z.inner.state[flat]
                for key in saved_optim:
                    slot[key] = torch.zeros_like(flat)
    targets: dict[str, ReadTarget] = {}

    def target(key: str, view: torch.Tensor, p: _Param) -> None:
        targets[key] = ReadTarget(key, view, (p.numel,), (p.start,))

    for p in z.trainable:
        target(tensor_key(name, "fp32", p.name), z.fp32_view(p), p)
    for sub_group in range(len(z.flats)):
        elementwise, _ = z.sub_group_state(sub_group)
        for p in (p for p in z.trainable if p.sub_group == sub_group):
            for key, tensor in elementwise.items():
                target(tensor_key(name, "optim", key, p.name), tensor.narrow(0, p.flat_offset, p.count), p)
    for p in z.frozen:
        target(tensor_key(name, "frozen", p.name), z.frozen_view(p), p)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for bname, buf in z.buffers.items():
        key = tensor_key(name, "buffers", bname)
        dest = buf.data
        if not dest.is_contiguous():
            dest = torch.empty_like(dest, memory_format=torch.contiguous_format)
            staged.append((buf.data, dest))
        targets[key] = ReadTarget(key, dest, tuple(buf.shape), (0,) * buf.dim())
    return targets, _finalizer(z, staged)


def check_engine(name: str, engine: Any, saved_entry: Any) -> list[str]:
    """Problems beyond the per-tensor key/shape/dtype checks, found before anything is modified:
    original parameter shapes, trainable vs frozen, param groups, optimizer scalars per sub-group, loss scaler."""
    z = _Zero3(engine, name)
    meta = _saved_meta(saved_entry, name)
    where = f"{name!r} (DeepSpeed engine)"
    problems: list[str] = []
    if meta.get("zero_stage") != 3:
        problems.append(f"{where}: the checkpoint holds a ZeRO stage {meta.get('zero_stage')!r} engine; only stage 3 is supported")
    saved_params = meta.get("params")
    if not isinstance(saved_params, dict):
        raise FormatError(f"state.json: {where} has no parameter table")
    for p, trainable in [*((p, True) for p in z.trainable), *((p, False) for p in z.frozen)]:
        info = saved_params.get(p.name)
        if not isinstance(info, dict):
            problems.append(f"{where}: parameter {p.name!r} is not in the checkpoint")
            continue
        if info.get("shape") != list(p.shape):
            problems.append(f"{where}: parameter {p.name!r} has shape {info.get('shape')} in the checkpoint, {list(p.shape)} in the engine")
        if (info.get("group") is not None) != trainable:
            saved_as, now = ("frozen", "trainable") if trainable else ("trainable", "frozen")
            problems.append(f"{where}: parameter {p.name!r} is {saved_as} in the checkpoint but {now} in the engine")
    live = {p.name for p in (*z.trainable, *z.frozen)}
    extra = sorted(set(saved_params) - live)
    if extra:
        problems.append(f"{where}: the checkpoint has parameters the engine lacks: {extra[:10]}{' ...' if len(extra) > 10 else ''}")

    saved_groups = meta.get("param_groups")
    current = z.group_params()
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved_groups):
        raise FormatError(f"state.json: {where} has malformed param_groups")
    stored = [g["params"] for g in saved_groups]
    if len(stored) != len(current) or any(set(a) != set(b) for a, b in zip(stored, current)):
        problems.append(
            f"{where}: optimizer param groups differ (checkpoint {[len(g) for g in stored]} parameters per group, "
            f"engine {[len(g) for g in current]}); build the optimizer with the same groups"
        )
    for g in saved_groups:
        decode_value(g.get("hyper"), lambda key: None, f"state.json {where} param group")

    problems += _check_scalars(z, meta, where)
    saved_scaler = meta.get("loss_scaler")
    scaler = getattr(z.opt, "loss_scaler", None)
    if isinstance(saved_scaler, dict) and scaler is not None and saved_scaler.get("class") != type(scaler).__name__:
        problems.append(
            f"{where}: the checkpoint's loss scaler is a {saved_scaler.get('class')}, the engine's a {type(scaler).__name__} "
            "(fp16 vs bf16/fp32 configuration?)"
        )
    return problems


def _scalars_by_param(meta: dict[str, Any], where: str) -> dict[str, dict[str, tuple[str, Any]]]:
    entries = meta.get("optimizer_scalars", [])
    if not isinstance(entries, list):
        raise FormatError(f"state.json: {where} has malformed optimizer_scalars")
    out: dict[str, dict[str, tuple[str, Any]]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("params"), list) or not isinstance(entry.get("state"), dict):
            raise FormatError(f"state.json: {where} has a malformed optimizer_scalars entry")
        decoded = {k: _decode_scalar(v, f"state.json {where} optimizer scalar {k!r}") for k, v in entry["state"].items()}
        for pname in entry["params"]:
            out[str(pname)] = decoded
    return out


def _same(a: dict[str, tuple[str, Any]], b: dict[str, tuple[str, Any]]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        (ka, va), (kb, vb) = a[key], b[key]
        if ka != kb:
            return False
        if ka == "tensor" and not (va.dtype == vb.dtype and va.shape == vb.shape and torch.equal(va, vb)):
            return False
        if ka == "value" and (type(va) is not type(vb) or va != vb):
            return False
    return True


def _scalars_for_sub_groups(z: _Zero3, meta: dict[str, Any], where: str) -> tuple[list[dict[str, tuple[str, Any]] | None], list[str]]:
    """For each live sub-group, the saved scalar state its parameters share (None: none saved)."""
    by_param = _scalars_by_param(meta, where)
    saved_params = _saved_params(meta)
    problems: list[str] = []
    chosen: list[dict[str, tuple[str, Any]] | None] = []
    for sub_group in range(len(z.flats)):
        # parameters the checkpoint lacks altogether are reported by the key comparison
        members = [p.name for p in z.trainable if p.sub_group == sub_group and p.name in saved_params]
        found = [by_param[n] for n in members if n in by_param]
        if not found:
            chosen.append(None)
            continue
        if len(found) != len(members) or any(not _same(found[0], f) for f in found[1:]):
            problems.append(
                f"{where}: the parameters of ZeRO sub-group {sub_group} ({members[:4]}{' ...' if len(members) > 4 else ''}) have different "
                "optimizer step counts (or none) in the checkpoint; they must share one in the engine"
            )
        chosen.append(found[0])
    return chosen, problems


def _saved_params(meta: dict[str, Any]) -> dict[str, Any]:
    params = meta.get("params")
    return params if isinstance(params, dict) else {}


def _check_scalars(z: _Zero3, meta: dict[str, Any], where: str) -> list[str]:
    chosen, problems = _scalars_for_sub_groups(z, meta, where)
    saved_params = _saved_params(meta)
    stored = {p.sub_group for p in z.trainable if p.name in saved_params}
    missing = [i for i, c in enumerate(chosen) if c is None and i in stored]
    if missing and meta.get("optimizer_scalars"):
        problems.append(f"{where}: the checkpoint has no optimizer step count for the parameters of ZeRO sub-groups {missing}")
    return problems


def _finalizer(z: _Zero3, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> Finalizer:
    def finish(tree: dict[str, Any], lookup: Lookup) -> None:
        entry = tree[z.name]
        meta = _saved_meta(entry, z.name)
        where = f"{z.name!r} (DeepSpeed engine)"
        opt, inner = z.opt, z.inner
        with torch.no_grad():
            for buf, tmp in staged:
                buf.copy_(tmp)
            # Gathered copies (persistent parameters, leftovers) now hold the old values: release them,
            # locally, as engine.load_checkpoint does first. The next forward gathers them again from
            # the partitions refreshed below (no collective here, so a failure elsewhere cannot hang it).
            opt.checkpoint_event_prologue()
            chosen, _ = _scalars_for_sub_groups(z, meta, where)
            for sub_group, (flat, scalars) in enumerate(zip(z.flats, chosen)):
                if scalars is None:
                    continue
                slot = inner.state[flat]
                flags = inner.param_groups[z.group_of_sub[sub_group]]
                # where torch's Optimizer.load_state_dict puts `step`: on the parameter's device only for fused/capturable
                on_device = bool(flags.get("fused") or flags.get("capturable"))
                for key, (kind, value) in scalars.items():
                    if kind == "tensor":
                        old = slot.get(key)
                        device = old.device if isinstance(old, torch.Tensor) else flat.device if on_device else torch.device("cpu")
                        slot[key] = value.to(device, copy=True)  # its own tensor: AdamW increments `step` in place
                    else:
                        slot[key] = value
            for group, saved in zip(inner.param_groups, meta["param_groups"]):
                for k, v in decode_value(saved["hyper"], lambda key: None, f"state.json {where}").items():
                    if k != "params":
                        group[k] = v
            saved_scaler = meta.get("loss_scaler")
            scaler = getattr(opt, "loss_scaler", None)
            if isinstance(saved_scaler, dict) and scaler is not None:
                for k, v in decode_value(saved_scaler.get("state"), lambda key: None, f"state.json {where}").items():
                    setattr(scaler, k, v)
            if "dynamic_loss_scale" in meta:
                opt.dynamic_loss_scale = bool(meta["dynamic_loss_scale"])
            if "overflow" in meta:
                opt.overflow = bool(meta["overflow"])
            for counter, value in (meta.get("counters") or {}).items():
                if counter in COUNTERS:
                    setattr(z.engine, counter, int(value))
            # The 16-bit partitions (param.ds_tensor, views of fp16_partitioned_groups_flat) from the
            # fp32 master, exactly as DeepSpeed's _rigid_load_state_dict and its optimizer step do.
            for sub_group, (flat32, flat16) in enumerate(zip(z.flats, opt.fp16_partitioned_groups_flat)):
                if flat32.numel():
                    flat16.data.copy_(flat32.data)
                opt._unflatten_partitioned_parameters(sub_group)
            if hasattr(opt, "invalidate_secondary_tensor"):
                opt.invalidate_secondary_tensor()  # ZeRO++ hpZ copies are rebuilt from the partitions
        _sync(z)

    return finish
