"""The ``state.json`` entry of a DeepSpeed ZeRO-3 engine (kind ``deepspeed_engine``): how it is built
and read, without a live engine (``convert_deepspeed`` writes it, ``inspect`` and ``export`` read it).

``{"kind": "deepspeed_engine", "state": {section: {fqn: tensor ref}}, "meta": {...}}``: sections
``fp32``, ``optim`` (``{state key: {fqn: ref}}``), ``frozen`` and ``buffers``; ``meta`` holds the
original shapes, param groups, per-sub-group optimizer scalars, loss scaler and counters
(docs/DEEPSPEED.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardsafe.core.dtypes import dtype_from_name, dtype_name
from shardsafe.core.values import decode_value, encode_value
from shardsafe.errors import FormatError, ShardsafeError
from shardsafe.state.base import KIND_DEEPSPEED_ENGINE
from shardsafe.state.zero3 import SECTIONS, tensor_key

__all__ = [
    "KIND_DEEPSPEED_ENGINE",
    "SECTIONS",
    "engine_meta",
    "engine_model_tensors",
    "flat_tensor_shapes",
    "same_scalars",
    "saved_meta",
    "saved_params",
    "saved_sections",
    "scalars_by_param",
    "tensor_key",
]


def no_tensors(where: str) -> Callable[[str, torch.Tensor], str]:
    def refuse(path: str, tensor: torch.Tensor) -> str:
        raise ShardsafeError(
            f"{where}: {path!r} is a tensor; shardsafe stores engine hyper-parameters and scaler state as JSON only"
        )

    return refuse


def encode_scalar(value: Any) -> dict[str, Any]:
    """A scalar optimizer state value as exact JSON: a 1-element tensor keeps its dtype, shape and value."""
    if isinstance(value, torch.Tensor):
        item = value.detach().cpu().reshape(-1)[0].item()
        return {"tensor": {"dtype": dtype_name(value.dtype), "shape": list(value.shape), "value": item}}
    return {"value": value}


def decode_scalar(encoded: Any, where: str) -> tuple[str, Any]:
    """(kind, value) with kind "tensor" (value a CPU tensor) or "value"; FormatError if malformed."""
    if isinstance(encoded, dict) and set(encoded) == {"value"}:
        value = encoded["value"]
        if value is None or isinstance(value, (bool, int, float)):
            return "value", value
    if isinstance(encoded, dict) and set(encoded) == {"tensor"} and isinstance(encoded["tensor"], dict):
        spec = encoded["tensor"]
        shape = spec.get("shape")
        if (
            isinstance(shape, list)
            and len(shape) <= 1
            and all(s == 1 for s in shape)
            and isinstance(spec.get("value"), (bool, int, float))
        ):
            tensor = torch.tensor(spec["value"], dtype=dtype_from_name(spec.get("dtype"), where)).reshape(shape)
            return "tensor", tensor
    raise FormatError(f"{where}: malformed optimizer scalar {encoded!r:.100}")


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
        return encode_value(value, f"{name}/{path}", no_tensors(f"state[{name!r}]: {what}"))

    return {
        "zero_stage": 3,
        "world_size": world_size,
        "deepspeed_version": deepspeed_version,
        "params": {
            n: {"shape": list(shape), "dtype": dtype_name(dtype), "group": group}
            for n, (shape, dtype, group) in params.items()
        },
        "aliases": dict(aliases),
        "param_groups": [
            {"params": list(names), "hyper": encoded(hyper, f"param_groups/{g}", f"optimizer param group {g}")}
            for g, (names, hyper) in enumerate(param_groups)
        ],
        "optimizer_scalars": [
            {"params": list(names), "state": {k: encode_scalar(v) for k, v in state.items()}}
            for names, state in optimizer_scalars
        ],
        "loss_scaler": None
        if loss_scaler is None
        else {"class": loss_scaler[0], "state": encoded(loss_scaler[1], "loss_scaler", "loss scaler")},
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
    meta = saved_meta(entry, where)
    params = meta.get("params")
    if not isinstance(state, dict) or not isinstance(params, dict):
        raise FormatError(f"{where}: the engine entry has no parameter table")
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for pname, info in params.items():
        section = "frozen" if not isinstance(info, dict) or info.get("group") is None else "fp32"
        key = (state.get(section) or {}).get(pname)
        shape = info.get("shape") if isinstance(info, dict) else None
        if (
            not isinstance(key, str)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise FormatError(f"{where}: parameter {pname!r} has no stored {section} tensor or no valid shape")
        out[pname] = (key, tuple(shape))
    for bname, key in (state.get("buffers") or {}).items():
        if not isinstance(key, str):
            raise FormatError(f"{where}: buffer {bname!r} is not a stored tensor")
        out[bname] = (key, None)
    return out


def saved_sections(saved_entry: Any) -> dict[str, Any]:
    state = saved_entry.get("state") if isinstance(saved_entry, dict) else None
    return state if isinstance(state, dict) else {}


def saved_meta(saved_entry: Any, name: str) -> dict[str, Any]:
    meta = saved_entry.get("meta") if isinstance(saved_entry, dict) else None
    if not isinstance(meta, dict):
        raise FormatError(f"state.json: {name!r} (a DeepSpeed engine entry) has no meta object")
    return meta


def scalars_by_param(meta: dict[str, Any], where: str) -> dict[str, dict[str, tuple[str, Any]]]:
    entries = meta.get("optimizer_scalars", [])
    if not isinstance(entries, list):
        raise FormatError(f"state.json: {where} has malformed optimizer_scalars")
    out: dict[str, dict[str, tuple[str, Any]]] = {}
    for entry in entries:
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("params"), list)
            or not isinstance(entry.get("state"), dict)
        ):
            raise FormatError(f"state.json: {where} has a malformed optimizer_scalars entry")
        decoded = {k: decode_scalar(v, f"state.json {where} optimizer scalar {k!r}") for k, v in entry["state"].items()}
        for pname in entry["params"]:
            out[str(pname)] = decoded
    return out


def same_scalars(a: dict[str, tuple[str, Any]], b: dict[str, tuple[str, Any]]) -> bool:
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


def saved_params(meta: dict[str, Any]) -> dict[str, Any]:
    params = meta.get("params")
    return params if isinstance(params, dict) else {}
