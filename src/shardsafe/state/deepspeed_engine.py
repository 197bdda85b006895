"""A live DeepSpeed ZeRO-3 engine as a ``state`` value of :func:`shardsafe.save` / :func:`shardsafe.load`.

``shardsafe.save(path, {"engine": engine, "sched": scheduler})`` writes, from every rank, exactly the
partition that rank owns of each trainable parameter's fp32 master weights and optimizer moments and
of each frozen parameter; persistent buffers and the small JSON part (param-group hyper-parameters,
optimizer step counts, loss scaler, engine counters) are written once. ``shardsafe.load`` reads each
rank's new partition straight into the engine's own flat buffers, at the saving world size or at any
other (which ``engine.load_checkpoint`` refuses), then refreshes the 16-bit partitions from the fp32
master, as DeepSpeed's own ``_rigid_load_state_dict`` does.

The live engine's layout (which share of which parameter this rank holds) is in zero3.py; the JSON
entry's format in engine_entry.py. This module is the adapter, and the only one that imports
DeepSpeed (never at import time: :func:`is_deepspeed_engine` looks in ``sys.modules``). Also relied
on here: ``loss_scaler``, ``dynamic_loss_scale``, ``overflow``, ``_unflatten_partitioned_parameters``,
``checkpoint_event_prologue`` and ``invalidate_secondary_tensor`` of DeepSpeed 0.19.8's ZeRO-3 optimizer.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Any

import torch

from shardsafe.core.format import Manifest
from shardsafe.core.plan import LocalChunk
from shardsafe.core.values import TENSOR_REF, decode_value, state_tensor_keys
from shardsafe.errors import FormatError
from shardsafe.protocol.transfer import ReadTarget
from shardsafe.state.base import (
    KIND_DEEPSPEED_ENGINE,
    Bound,
    Described,
    LoadContext,
    LoadStep,
    Lookup,
    SaveContext,
    check_storable,
    tensor_summary,
    type_problems,
)
from shardsafe.state.engine_entry import (
    engine_meta,
    flat_tensor_shapes,
    same_scalars,
    saved_meta,
    saved_params,
    saved_sections,
    scalars_by_param,
)
from shardsafe.state.zero3 import COUNTERS, SECTIONS, Zero3Layout, ZeroParam, refresh_16bit_partitions, tensor_key

__all__ = [
    "DeepSpeedEngineAdapter",
    "ENGINE_ADAPTER",
    "KIND_DEEPSPEED_ENGINE",
    "SECTIONS",
    "engine_meta",
    "flat_tensor_shapes",
    "is_deepspeed_engine",
    "tensor_key",
]


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


# a parameter's saved metadata: its original shape, the dtype of its partition, its param group (None if frozen)
_ParamMeta = tuple[tuple[int, ...], torch.dtype, int | None]


def describe_engine(engine: Any, name: str) -> tuple[dict[str, Any], list[LocalChunk]]:
    """This rank's chunks of the engine's state, and the JSON entry for ``state.json``.

    Trainable parameters: ``<name>/fp32/<fqn>`` and ``<name>/optim/<key>/<fqn>``, 1-D of numel
    elements, this rank's chunk at offset ``rank * part``; frozen: ``<name>/frozen/<fqn>`` likewise
    (in the parameter's dtype); persistent buffers: ``<name>/buffers/<fqn>`` whole, replicated (the
    coordinator's planner picks one writer). Nothing is copied: chunks are views of DeepSpeed's
    buffers (an async save copies them into its staging buffers in the call).
    """
    z = Zero3Layout(engine, name)
    chunks: list[LocalChunk] = []
    state: dict[str, Any] = {section: {} for section in SECTIONS}
    sync_engine(z)
    scalars_meta = _describe_optim(z, name, state, chunks)
    groups = z.group_params()
    params_meta = _describe_params(z, name, groups, state, chunks)
    _describe_buffers(z, name, state, chunks)
    meta = _engine_entry_meta(engine, z, name, groups, params_meta, scalars_meta)
    return {"kind": KIND_DEEPSPEED_ENGINE, "state": state, "meta": meta}, chunks


def _partition_chunk(chunks: list[LocalChunk], key: str, view: torch.Tensor, p: ZeroParam) -> dict[str, str]:
    """This rank's partition of a parameter-shaped tensor as a chunk of its 1-D whole; returns the JSON reference."""
    # A rank whose share is all padding holds nothing of the tensor: its empty chunk is never
    # written, only described (it is the empty part of the split rule, core/layout).
    chunks.append(LocalChunk(key, view, (p.numel,), (p.start,)))
    return {TENSOR_REF: key}


def _describe_optim(
    z: Zero3Layout, name: str, state: dict[str, Any], chunks: list[LocalChunk]
) -> list[tuple[list[str], dict[str, Any]]]:
    """The per-element optimizer state as chunks, sub-group by sub-group (the order DeepSpeed keeps it in);
    returns each sub-group's scalars (step counts...) with the parameters they belong to."""
    scalars_meta: list[tuple[list[str], dict[str, Any]]] = []
    by_sub: dict[int, list[ZeroParam]] = {}
    for p in z.trainable:
        by_sub.setdefault(p.sub_group, []).append(p)
    for sub_group in range(len(z.flats)):
        elementwise, scalars = z.sub_group_state(sub_group)
        members = by_sub.get(sub_group, [])
        for p in members:
            for key, tensor in elementwise.items():
                view = tensor.narrow(0, p.flat_offset, p.count)
                ref = _partition_chunk(chunks, tensor_key(name, "optim", key, p.name), view, p)
                state["optim"].setdefault(key, {})[p.name] = ref
        if scalars:
            scalars_meta.append(([p.name for p in members], scalars))
    return scalars_meta


def _describe_params(
    z: Zero3Layout, name: str, groups: list[list[str]], state: dict[str, Any], chunks: list[LocalChunk]
) -> dict[str, _ParamMeta]:
    """The fp32 master weights of the trainable parameters and the frozen parameters as chunks; returns each
    one's shape, dtype and param group, which a load checks against the live engine."""
    params_meta: dict[str, _ParamMeta] = {}
    group_index = {n: g for g, members in enumerate(groups) for n in members}
    for p in z.trainable:
        state["fp32"][p.name] = _partition_chunk(chunks, tensor_key(name, "fp32", p.name), z.fp32_view(p), p)
        params_meta[p.name] = (p.shape, p.param.ds_tensor.dtype, group_index[p.name])
    for p in z.frozen:
        state["frozen"][p.name] = _partition_chunk(chunks, tensor_key(name, "frozen", p.name), z.frozen_view(p), p)
        params_meta[p.name] = (p.shape, p.param.ds_tensor.dtype, None)
    return params_meta


def _describe_buffers(z: Zero3Layout, name: str, state: dict[str, Any], chunks: list[LocalChunk]) -> None:
    """The persistent buffers, whole and replicated (contiguous, so a writer can take their bytes as they are)."""
    for bname, buf in z.buffers.items():
        key = tensor_key(name, "buffers", bname)
        tensor = buf.detach()
        chunks.append(
            LocalChunk(
                key, tensor if tensor.is_contiguous() else tensor.contiguous(), tuple(tensor.shape), (0,) * tensor.dim()
            )
        )
        state["buffers"][bname] = {TENSOR_REF: key}


def _engine_entry_meta(
    engine: Any,
    z: Zero3Layout,
    name: str,
    groups: list[list[str]],
    params_meta: dict[str, _ParamMeta],
    scalars_meta: list[tuple[list[str], dict[str, Any]]],
) -> dict[str, Any]:
    """The small JSON part of the entry: what a load needs beyond the tensors to rebuild the engine's state."""
    scaler = getattr(z.opt, "loss_scaler", None)
    import deepspeed

    return engine_meta(
        name,
        world_size=z.world_size,
        deepspeed_version=str(getattr(deepspeed, "__version__", "unknown")),
        params=params_meta,
        aliases=z.aliases,
        param_groups=[
            (groups[g], {k: v for k, v in group.items() if k != "params"})
            for g, group in enumerate(z.inner.param_groups)
        ],
        optimizer_scalars=scalars_meta,
        loss_scaler=None if scaler is None else (type(scaler).__name__, dict(vars(scaler))),
        dynamic_loss_scale=bool(getattr(z.opt, "dynamic_loss_scale", False)),
        overflow=bool(getattr(z.opt, "overflow", False)),
        counters={c: int(getattr(engine, c)) for c in COUNTERS if hasattr(engine, c)},
    )


def sync_engine(z: Zero3Layout) -> None:
    """Wait for DeepSpeed's side streams (an accelerator's async partition copies) before reading its buffers."""
    if any(flat.device.type != "cpu" for flat in z.flats):
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()


def bind_engine(engine: Any, name: str, saved_entry: Any = None) -> Bound:
    """Read targets (views of this rank's new partitions) of the engine; ``context`` keeps its layout
    and the buffers staged through contiguous copies.

    An engine that has not stepped has no optimizer state yet: it gets zero-filled state tensors for
    the per-element keys the checkpoint holds (what the optimizer would create; the padding of the
    last rank's share stays zero), so there is memory to read into. ``api.load`` empties them again
    if the load fails before reading.
    """
    z = Zero3Layout(engine, name)
    saved_optim = saved_sections(saved_entry).get("optim")
    if not z.inner.state and isinstance(saved_optim, dict):
        with torch.no_grad():
            for flat in z.flats:
                slot = z.inner.state[flat]
                for key in saved_optim:
                    slot[key] = torch.zeros_like(flat)
    targets: dict[str, ReadTarget] = {}

    def target(key: str, view: torch.Tensor, p: ZeroParam) -> None:
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
    return Bound(name, engine, ENGINE_ADAPTER, targets, context=(z, staged))


def _hyper(meta: dict[str, Any], where: str) -> list[dict[str, Any]]:
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise FormatError(f"state.json: {where} has malformed param_groups")
    out = []
    for g in groups:
        hyper = decode_value(g.get("hyper"), lambda key: None, f"state.json {where} param group")
        if not isinstance(hyper, dict):
            raise FormatError(f"state.json: {where} has a param group without hyper-parameters")
        out.append({k: v for k, v in hyper.items() if k != "params"})
    return out


def _scaler_state(meta: dict[str, Any], scaler: Any, where: str) -> dict[str, Any]:
    """The saved loss-scaler attributes; only attributes the live scaler has, of the same types."""
    saved = meta.get("loss_scaler")
    if not isinstance(saved, dict) or scaler is None:
        return {}
    state = decode_value(saved.get("state"), lambda key: None, f"state.json {where}")
    if not isinstance(state, dict):
        raise FormatError(f"state.json: {where} has a malformed loss scaler state")
    unknown = sorted(k for k in state if not hasattr(scaler, k) or k.startswith("__"))
    if unknown:
        raise FormatError(f"state.json: {where}: the loss scaler has no attributes {unknown[:5]}")
    return state


def _counters(meta: dict[str, Any], where: str) -> dict[str, int]:
    counters = meta.get("counters") or {}
    if not isinstance(counters, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for k, v in counters.items() if k in COUNTERS
    ):
        raise FormatError(f"state.json: {where} has malformed counters")
    return {k: int(v) for k, v in counters.items() if k in COUNTERS}


def check_engine(name: str, engine: Any, saved_entry: Any, z: Zero3Layout | None = None) -> list[str]:
    """Problems beyond the per-tensor key/shape/dtype checks, found before anything is modified:
    original parameter shapes, trainable vs frozen, param groups and the types of their
    hyper-parameters, optimizer scalars per sub-group, loss scaler, counters."""
    z = z or Zero3Layout(engine, name)
    meta = saved_meta(saved_entry, name)
    where = f"{name!r} (DeepSpeed engine)"
    problems: list[str] = []
    if meta.get("zero_stage") != 3:
        problems.append(
            f"{where}: the checkpoint holds a ZeRO stage {meta.get('zero_stage')!r} engine; only stage 3 is supported"
        )
    stored_params = meta.get("params")
    if not isinstance(stored_params, dict):
        raise FormatError(f"state.json: {where} has no parameter table")
    for p, trainable in [*((p, True) for p in z.trainable), *((p, False) for p in z.frozen)]:
        info = stored_params.get(p.name)
        if not isinstance(info, dict):
            problems.append(f"{where}: parameter {p.name!r} is not in the checkpoint")
            continue
        if info.get("shape") != list(p.shape):
            problems.append(
                f"{where}: parameter {p.name!r} has shape {info.get('shape')} in the checkpoint, {list(p.shape)} in "
                "the engine"
            )
        if (info.get("group") is not None) != trainable:
            saved_as, now = ("frozen", "trainable") if trainable else ("trainable", "frozen")
            problems.append(f"{where}: parameter {p.name!r} is {saved_as} in the checkpoint but {now} in the engine")
    live = {p.name for p in (*z.trainable, *z.frozen)}
    extra = sorted(set(stored_params) - live)
    if extra:
        problems.append(
            f"{where}: the checkpoint has parameters the engine lacks: {extra[:10]}{' ...' if len(extra) > 10 else ''}"
        )

    hyper = _hyper(meta, where)
    current = z.group_params()
    stored = [g["params"] for g in meta["param_groups"]]
    if len(stored) != len(current) or any(set(a) != set(b) for a, b in zip(stored, current)):
        problems.append(
            f"{where}: optimizer param groups differ (checkpoint {[len(g) for g in stored]} parameters per group, "
            f"engine {[len(g) for g in current]}); build the optimizer with the same groups"
        )
    for g, (group, saved) in enumerate(zip(z.inner.param_groups, hyper)):
        for k in (group.keys() & saved.keys()) - {"params"}:
            problems += type_problems(group[k], saved[k], f"{where}: param group {g} {k!r}", same_length=True)

    problems += _check_scalars(z, meta, where)
    saved_scaler = meta.get("loss_scaler")
    scaler = getattr(z.opt, "loss_scaler", None)
    if isinstance(saved_scaler, dict) and scaler is not None and saved_scaler.get("class") != type(scaler).__name__:
        problems.append(
            f"{where}: the checkpoint's loss scaler is a {saved_scaler.get('class')}, the engine's a "
            f"{type(scaler).__name__} "
            "(fp16 vs bf16/fp32 configuration?)"
        )
    else:
        for k, v in _scaler_state(meta, scaler, where).items():
            problems += type_problems(getattr(scaler, k), v, f"{where}: loss scaler {k!r}")
    _counters(meta, where)
    return problems


def _scalars_for_sub_groups(
    z: Zero3Layout, meta: dict[str, Any], where: str
) -> tuple[list[dict[str, tuple[str, Any]] | None], list[str]]:
    """For each live sub-group, the saved scalar state its parameters share (None: none saved)."""
    by_param = scalars_by_param(meta, where)
    stored_params = saved_params(meta)
    problems: list[str] = []
    chosen: list[dict[str, tuple[str, Any]] | None] = []
    for sub_group in range(len(z.flats)):
        # parameters the checkpoint lacks altogether are reported by the key comparison
        members = [p.name for p in z.trainable if p.sub_group == sub_group and p.name in stored_params]
        found = [by_param[n] for n in members if n in by_param]
        if not found:
            chosen.append(None)
            continue
        if len(found) != len(members) or any(not same_scalars(found[0], f) for f in found[1:]):
            problems.append(
                f"{where}: the parameters of ZeRO sub-group {sub_group} "
                f"({members[:4]}{' ...' if len(members) > 4 else ''}) have different "
                "optimizer step counts (or none) in the checkpoint; they must share one in the engine"
            )
        chosen.append(found[0])
    return chosen, problems


def _check_scalars(z: Zero3Layout, meta: dict[str, Any], where: str) -> list[str]:
    chosen, problems = _scalars_for_sub_groups(z, meta, where)
    stored_params = saved_params(meta)
    stored = {p.sub_group for p in z.trainable if p.name in stored_params}
    missing = [i for i, c in enumerate(chosen) if c is None and i in stored]
    if missing and meta.get("optimizer_scalars"):
        problems.append(
            f"{where}: the checkpoint has no optimizer step count for the parameters of ZeRO sub-groups {missing}"
        )
    return problems


def prepare_engine(z: Zero3Layout, staged: list[tuple[torch.Tensor, torch.Tensor]], saved_entry: Any) -> LoadStep:
    """Everything the engine takes besides its tensors, decoded and checked now; applied (with the
    16-bit partitions refreshed from the fp32 master) once the tensors are read."""
    meta = saved_meta(saved_entry, z.name)
    where = f"{z.name!r} (DeepSpeed engine)"
    opt, inner = z.opt, z.inner
    chosen, _ = _scalars_for_sub_groups(z, meta, where)
    hyper = _hyper(meta, where)
    scaler = getattr(opt, "loss_scaler", None)
    scaler_state = _scaler_state(meta, scaler, where)
    counters = _counters(meta, where)

    def apply() -> None:
        with torch.no_grad():
            for buf, tmp in staged:
                buf.copy_(tmp)
            # Gathered copies (persistent parameters, leftovers) now hold the old values: release them,
            # locally, as engine.load_checkpoint does first. The next forward gathers them again from
            # the partitions refreshed below (no collective here, so a failure elsewhere cannot hang it).
            opt.checkpoint_event_prologue()
            for sub_group, (flat, scalars) in enumerate(zip(z.flats, chosen)):
                if scalars is None:
                    continue
                slot = inner.state[flat]
                flags = inner.param_groups[z.group_of_sub[sub_group]]
                # where torch's Optimizer.load_state_dict puts `step`: on the parameter's device only for
                # fused/capturable
                on_device = bool(flags.get("fused") or flags.get("capturable"))
                for key, (kind, value) in scalars.items():
                    if kind == "tensor":
                        old = slot.get(key)
                        device = (
                            old.device
                            if isinstance(old, torch.Tensor)
                            else flat.device
                            if on_device
                            else torch.device("cpu")
                        )
                        slot[key] = value.to(device, copy=True)  # its own tensor: AdamW increments `step` in place
                    else:
                        slot[key] = value
            for group, values in zip(inner.param_groups, hyper):
                group.update(values)
            for k, v in scaler_state.items():
                setattr(scaler, k, v)
            if "dynamic_loss_scale" in meta:
                opt.dynamic_loss_scale = bool(meta["dynamic_loss_scale"])
            if "overflow" in meta:
                opt.overflow = bool(meta["overflow"])
            for counter, value in counters.items():
                setattr(z.engine, counter, value)
        refresh_16bit_partitions(opt, range(len(z.flats)))
        sync_engine(z)

    return LoadStep(z.name, apply, after_tensors=True)


class DeepSpeedEngineAdapter:
    """A DeepSpeed ZeRO-3 engine (checked before ``nn.Module`` in the registry: an engine is one)."""

    kind = KIND_DEEPSPEED_ENGINE
    in_place = True

    def matches(self, value: Any) -> bool:
        return is_deepspeed_engine(value)

    def fresh_optimizers(self, value: Any) -> list[torch.optim.Optimizer]:
        return fresh_engine_optimizers([value])

    def describe(self, name: str, value: Any, ctx: SaveContext) -> Described:
        entry, chunks = describe_engine(value, name)
        for c in chunks:
            check_storable(c.key, c.tensor, c.global_shape)
        return Described(entry, chunks=chunks)

    def bind(self, name: str, value: Any, ctx: LoadContext) -> Bound:
        return bind_engine(value, name, ctx.saved)

    def check(self, bound: Bound, ctx: LoadContext, manifest: Manifest) -> list[str]:
        return check_engine(bound.name, bound.value, ctx.saved, bound.context[0])

    def prepare(self, bound: Bound, ctx: LoadContext, lookup: Lookup) -> LoadStep:
        z, staged = bound.context
        return prepare_engine(z, staged, ctx.saved)

    def summarize(self, entry: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
        return tensor_summary(state_tensor_keys(entry.get("state")), manifest)

    def display_shapes(self, name: str, entry: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Stored key -> the parameter's real shape (the stored tensors are flattened)."""
        return flat_tensor_shapes(entry, name)


ENGINE_ADAPTER = DeepSpeedEngineAdapter()
