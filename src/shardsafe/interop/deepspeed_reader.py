"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) as named whole tensors, read without DeepSpeed and without running
pickled code.

The rank files (found by :mod:`~shardsafe.interop.deepspeed_files`) are opened by the restricted
loader (:mod:`~shardsafe.interop.unpickler`): an exact allow-list of pickle opcodes and globals,
DeepSpeed's few classes as plain stand-ins, tensors only as contiguous views of bytes inside the
file, memory-mapped until a slice of them is copied out.

:class:`DeepSpeedCheckpoint` is a :class:`~shardsafe.api.source.TensorSource`: ``tensors()`` /
``names()`` / ``shape(name)`` / ``dtype(name)`` describe the consolidated model and ``read(name)``
assembles one full tensor from the ranks' slices, touching only those bytes; the pages it read are
then unmapped again (``madvise``), so resident memory stays about one tensor whatever the model size.
Every shape taken from a file is checked against the bytes the ranks hold before a tensor of it is
allocated. Values and dtypes are those of DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``:
fp32 master weights for trained parameters, frozen parameters in their stored dtype, persistent
buffers (16-bit floating buffers upcast to fp32, as DeepSpeed does; fp64 ones are kept, where
DeepSpeed narrows them). Where DeepSpeed's consolidation drops frozen parameters (ZeRO-1 with bf16
records none), they are taken whole from the model file. ``optimizer_state(name, key)`` and
``param_groups()`` give the optimizer state per parameter, which
:func:`~shardsafe.interop.deepspeed_convert.convert_deepspeed` writes as a shardsafe checkpoint.

Layout facts: docs/DEEPSPEED.md. Not supported (refused with a message): tensor or pipeline
parallel checkpoints (``mp_rank_01``, ``layer_*``), MoE / AutoEP expert partitions, elastic
ZeRO-1/2 optimizer state (weights are still read). Untested: CPU/NVMe optimizer offload.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardsafe.api.source import CheckpointSource, TensorInfo, find_config_files
from shardsafe.core.format import numel
from shardsafe.errors import FormatError, ShardsafeError
from shardsafe.interop.deepspeed_files import DeepSpeedFiles, find_deepspeed_checkpoint, is_deepspeed_checkpoint
from shardsafe.interop.deepspeed_layout import Layout, Param, zero3_layout, zero12_layout
from shardsafe.interop.deepspeed_values import (
    flat_tensor,
    get_entry,
    hyper_parameter,
    is_scalar,
    reading,
    shapes_of,
    short,
    small_int,
)
from shardsafe.interop.mapped_copy import copy_out
from shardsafe.interop.unpickler import STAND_INS, LossScalerState

__all__ = ["DeepSpeedCheckpoint", "LossScaling", "open_source"]

log = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LossScaling:
    """The fp16 loss scaling DeepSpeed saved: the loss scaler as (DeepSpeed class name,
    attributes), or None, and the optimizer's ``dynamic_loss_scale`` and ``overflow`` flags."""

    scaler: tuple[str, dict[str, Any]] | None
    dynamic: bool
    overflow: bool


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint as named whole tensors (a :class:`~shardsafe.api.source.TensorSource`).

    ``path`` is the folder ``engine.save_checkpoint`` wrote (holding ``latest``) or a tag folder;
    ``tag`` picks another tag. Files are memory-mapped; each :meth:`read` allocates one tensor and
    copies each rank's slice of it in, touching only those bytes.
    """

    default_dtype: torch.dtype | None = None  # export keeps DeepSpeed's dtypes unless told otherwise
    aliases_recorded = True  # tied weights come from the checkpoint's shared_params

    @reading
    def __init__(self, path: str | os.PathLike[str], tag: str | None = None) -> None:
        location = find_deepspeed_checkpoint(path, tag)
        self.model_folder, self.folder, self.tag = location.model_folder, location.folder, location.tag
        self._files = DeepSpeedFiles(self.folder)
        self.world_size = self._files.world_size
        first = self._optim_state(0)
        self.stage = self._zero_stage(first)
        self._files.stage = self.stage
        model = self._model_state(0)
        where = str(self._files.model_path(0))
        self.ds_version = self._check_model(model, where)
        self._module: dict[str, Any] = get_entry(model, "module", dict, where)
        buffer_names = get_entry(model, "buffer_names", list, where)
        self._buffer_names = [b for b in buffer_names if isinstance(b, str) and b in self._module]
        param_shapes = get_entry(model, "param_shapes", list, where)
        self._frozen = shapes_of(model.get("frozen_param_shapes") or {}, f"{where}: frozen_param_shapes")
        shared = model.get("shared_params") or {}
        if not isinstance(shared, dict):
            raise FormatError(f"{where}: shared_params is a {type(shared).__name__}")
        layout = self._layout(param_shapes, first, where)
        self._params: dict[str, Param] = layout.params
        self._owner = layout.owner  # flat group -> param group
        # ZeRO-1/2: per group, per rank, (start, length) in the group's concatenation
        self._partitions = layout.partitions
        known = set(self._params) | set(self._frozen) | set(self._buffer_names)
        self.aliases: dict[str, str] = {
            a: s
            for a, s in shared.items()
            if isinstance(a, str) and isinstance(s, str) and s in known and a not in known
        }
        self._whole: set[str] = self._stored_whole(known, where)
        known |= self._whole
        self._order = self._ordered_names(known)

    def _zero_stage(self, first: dict[str, Any]) -> int:
        """The ZeRO stage rank 0's optimizer file records: 1, 2 or 3 (not expert-partitioned), which decides
        how the parameters are laid out in the files."""
        stage = get_entry(first, "zero_stage", int, self._where(0))
        if stage not in (1, 2, 3):
            raise FormatError(f"{self._where(0)}: unknown ZeRO stage {short(stage)}")
        if stage == 3 and "ds_zero_partition_groups" in first:
            raise FormatError(f"{self._where(0)}: ZeRO-3 expert-partitioned (AutoEP) checkpoints are not supported")
        return int(stage)

    def _check_model(self, model: dict[str, Any], where: str) -> str:
        """Refuse what this reader cannot lay out (tensor or expert parallelism, a file missing or of another
        save) before any tensor is read; returns the DeepSpeed version the checkpoint records."""
        version = model.get("ds_version")
        ds_version = version[:64] if isinstance(version, str) else "?"
        if model.get("mp_world_size", 1) != 1:
            raise FormatError(
                f"{where}: tensor-parallel checkpoints (mp_world_size={short(model.get('mp_world_size'))}) are not "
                "supported"
            )
        recorded = model.get("dp_world_size", self.world_size)
        if recorded != self.world_size:
            raise FormatError(
                f"{self.folder}: {self.world_size} optimizer state files, but the checkpoint was saved by "
                f"{short(recorded)} data-parallel "
                "ranks (a rank's file is missing, or files of another save were left here)"
            )
        self._files.check_model_files(self.stage)
        if model.get("ds_autoep_layers", model.get("autoep_layers")):
            raise FormatError(f"{where}: AutoEP expert-parallel checkpoints are not supported")
        return ds_version

    def _layout(self, param_shapes: list[Any], first: dict[str, Any], where: str) -> Layout:
        """Where each trained parameter lies in the ranks' flat groups, from the flats' lengths and the stage's
        rules."""
        lengths = [[f.numel() for f in self._flats(r)] for r in range(self.world_size)]
        if self.stage == 3:
            return zero3_layout(param_shapes, lengths, self._inner(0).get("param_groups"), where, self._where)
        return zero12_layout(param_shapes, lengths, first, where, self._where)

    def _stored_whole(self, known: set[str], where: str) -> set[str]:
        """The model-file entries taken whole: the parameters not optimized, frozen, buffers or tied."""
        # ZeRO-1/2 keep whole parameters in the model file; with bf16 on, DeepSpeed records no frozen_param_shapes (and
        # zero_to_fp32 drops frozen parameters): take those from the model file, in its dtype.
        whole: set[str] = set()
        for name, value in self._module.items():
            if not isinstance(name, str) or name in known or name in self.aliases:
                continue
            if self.stage < 3 and isinstance(value, torch.Tensor) and value.numel():
                whole.add(name)
            else:
                log.warning(
                    "%s: state-dict entry %s is neither optimized, frozen, a buffer nor tied, and not stored whole; "
                    "left out",
                    where,
                    short(name),
                )
        return whole

    # -- files

    def _where(self, rank: int) -> str:
        return str(self._files.optim[rank])

    def _optim_state(self, rank: int) -> dict[str, Any]:
        """``optimizer_state_dict`` of rank ``rank``'s optimizer file (memory-mapped, kept open)."""
        return get_entry(self._files.load(self._files.optim[rank]), "optimizer_state_dict", dict, self._where(rank))  # type: ignore[no-any-return]

    def _model_state(self, rank: int) -> dict[str, Any]:
        path = self._files.model_path(rank)
        raw = self._files.load(path)
        if not isinstance(raw, dict):
            raise FormatError(f"{path}: not a model states dict")
        return raw

    # -- layout

    def _inner(self, rank: int) -> dict[str, Any]:
        """The inner torch optimizer's state dict (state per flat group, param_groups)."""
        opt = self._optim_state(rank)
        key = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        inner = opt.get(key)
        if isinstance(inner, list):  # ZeRO-1/2 with elastic_checkpoint: a lean state per group, no hyper-parameters
            return {"state": dict(enumerate(inner)), "param_groups": None}
        if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict):
            raise FormatError(f"{self._where(rank)}: no inner optimizer state ({key!r})")
        groups = inner.get("param_groups")
        if groups is not None and not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
            raise FormatError(f"{self._where(rank)}: the inner optimizer's param_groups are not a list of dicts")
        return inner

    def _flats(self, rank: int) -> list[torch.Tensor]:
        key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        flats = get_entry(self._optim_state(rank), key, list, self._where(rank))
        return [flat_tensor(f, f"{self._where(rank)}: {key}[{i}]") for i, f in enumerate(flats)]

    def _ordered_names(self, known: set[str]) -> list[str]:
        """Tensor names in the model's state-dict order (tied aliases left out)."""
        order = [k for k in self._module if k in known]
        listed = set(order)
        order += [k for k in [*self._params, *self._frozen, *self._buffer_names] if k in known and k not in listed]
        return order

    # -- TensorSource

    def names(self) -> list[str]:
        """Names of the tensors of the consolidated model, in state-dict order, tied aliases left out."""
        return list(self._order)

    @reading
    def shape(self, name: str) -> tuple[int, ...]:
        name = self.aliases.get(name, name)
        if name in self._params:
            return self._params[name].shape
        if name in self._frozen:
            return self._frozen[name]
        if name in self._buffer_names or name in self._whole:
            return tuple(self._buffer(name).shape)
        raise KeyError(name)

    @reading
    def dtype(self, name: str) -> torch.dtype:
        name = self.aliases.get(name, name)
        if name in self._params:
            return self._flats(0)[self._params[name].flat].dtype
        if name in self._frozen:
            return self._frozen_dtype(name)
        if name in self._buffer_names:
            return self._buffer(name).dtype
        if name in self._whole:
            return self._buffer(name, upcast=False).dtype
        raise KeyError(name)

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(name, self.dtype(name), self.shape(name)) for name in self._order]

    @property
    def total_parameters(self) -> int:
        frozen = [*self._frozen.values(), *(self.shape(n) for n in self._whole)]
        return sum(numel(p.shape) for p in self._params.values()) + sum(numel(s) for s in frozen)

    @reading
    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (a tied alias reads its source), on the CPU."""
        name = self.aliases.get(name, name)
        if name in self._params:
            param = self._params[name]
            return self._gather(param, lambda r: self._flats(r)[param.flat], self.dtype(name))
        if name in self._frozen:
            return self._read_frozen(name)
        if name in self._buffer_names or name in self._whole:
            value = self._buffer(name, upcast=name not in self._whole)
            return value.clone() if value.dtype == self._module[name].dtype else value
        raise KeyError(f"{name!r} is not a tensor of {self.folder}")

    def config_files(self) -> dict[str, Path]:
        return find_config_files(self.model_folder, self.folder)

    def tie(self, aliases: dict[str, str]) -> None:
        """Tied weights are those the checkpoint records (``shared_params``); nothing to add."""

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> DeepSpeedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- pieces

    def _buffer(self, name: str, upcast: bool = True) -> torch.Tensor:
        """A tensor stored whole in the model file; 16-bit floating buffers upcast to fp32 as DeepSpeed does."""
        value = self._module[name]
        if not isinstance(value, torch.Tensor):
            raise FormatError(f"{self._files.model_path(0)}: {short(name)} is a {type(value).__name__}")
        return value.float() if upcast and value.dtype in _HALF else value

    def _fragment(self, rank: int, name: str) -> torch.Tensor | None:
        fragments = self._model_state(rank).get("frozen_param_fragments") or {}
        value = fragments.get(name) if isinstance(fragments, dict) else None
        return value if isinstance(value, torch.Tensor) else None

    def _frozen_dtype(self, name: str) -> torch.dtype:
        value = self._fragment(0, name)
        if value is None:
            raise FormatError(f"{self._files.model_path(0)}: no fragment of frozen parameter {short(name)}")
        return value.dtype

    def _read_frozen(self, name: str) -> torch.Tensor:
        """A frozen parameter from its fragments (one per rank for ZeRO-3, one whole for ZeRO-1/2), checked to cover it
        before allocating."""
        shape = self._frozen[name]
        n = numel(shape)
        dtype = self._frozen_dtype(name)
        pieces: list[tuple[int, torch.Tensor]] = []
        pos = 0
        for r in range(self.world_size) if self.stage == 3 else range(1):  # ZeRO-1/2 store frozen parameters whole
            if pos >= n:
                break
            fragment = self._fragment(r, name)
            if fragment is None or fragment.dtype != dtype:
                raise FormatError(f"{self._files.model_path(r)}: no {dtype} fragment of frozen parameter {short(name)}")
            pieces.append((r, fragment))
            pos += min(fragment.numel(), n - pos)
        if pos != n:
            raise FormatError(
                f"{self.folder}: frozen parameter {short(name)} has {pos} of its {n} elements in the checkpoint"
            )
        out = torch.empty(n, dtype=dtype)
        pos = 0
        for r, fragment in pieces:
            take = min(fragment.numel(), n - pos)
            path = self._files.model_path(r)
            copy_out(out[pos : pos + take], fragment.reshape(-1)[:take], self._files.mapping(path), str(path))
            pos += take
        return out.view(shape)

    def _gather(self, param: Param, piece: Callable[[int], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Assemble a whole tensor of ``param``'s shape from each rank's 1-D ``piece(rank)`` of the flat group.

        The layout checks made sure the ranks' slices cover every element, so nothing of ``torch.empty`` is left
        unwritten.
        """
        n = numel(param.shape)
        out = torch.empty(n, dtype=dtype)
        if self.stage == 3:
            part = math.ceil(n / self.world_size)
            for r in range(self.world_size):
                start = r * part
                if start >= n:
                    break
                take = min(part, n - start)
                self._copy(out[start : start + take], piece(r)[param.offset : param.offset + take], r)
        else:
            end = param.offset + n
            for r, (lo, length) in enumerate(self._partitions[param.flat]):
                a, b = max(lo, param.offset), min(lo + length, end)
                if a < b:
                    self._copy(out[a - param.offset : b - param.offset], piece(r)[a - lo : b - lo], r)
        return out.view(param.shape)

    def _copy(self, dest: torch.Tensor, src: torch.Tensor, rank: int) -> None:
        path = self._files.optim[rank]
        copy_out(dest, src, self._files.mapping(path), str(path))

    # -- optimizer state

    @property
    def trainable(self) -> list[str]:
        """Names of the parameters the optimizer updates, in the inner optimizer's order."""
        return list(self._params)

    def _flat_state(self, rank: int, flat: int) -> dict[str, Any]:
        """The inner optimizer's state of one flat group; a step kept in the param group (DeepSpeed's fused Adam) joins
        it."""
        inner = self._inner(rank)
        state = inner["state"].get(flat)
        state = dict(state) if isinstance(state, dict) else {}
        if state and "step" not in state:
            groups = inner.get("param_groups")
            owner = self._owner[flat]
            group = groups[owner] if isinstance(groups, list) and owner < len(groups) else {}
            if isinstance(group.get("step"), (int, float)) and not isinstance(group.get("step"), bool):
                state["step"] = group["step"]
        return state

    def _is_elementwise(self, rank: int, flat: int, value: Any) -> bool:
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            return False
        length = self._flats(rank)[flat].numel()
        if self.stage == 3:
            return value.numel() == length
        # ZeRO-1/2 keep the rank's padding at the end of its state
        paddings = self._optim_state(rank).get("group_paddings")
        pad = (
            paddings[flat]
            if isinstance(paddings, list) and flat < len(paddings) and small_int(paddings[flat]) is not None
            else 0
        )
        return value.numel() in (length, length + pad)

    @reading
    def optimizer_state_spec(self, name: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]] | Any]:
        """Optimizer state entries of parameter ``name``: key -> (dtype, shape) for tensors, the value for others."""
        param = self._params[name]
        out: dict[str, Any] = {}
        for key, value in self._flat_state(0, param.flat).items():
            if not isinstance(key, str):
                raise FormatError(
                    f"{self._where(0)}: optimizer state of {short(name)} has a key that is a {type(key).__name__}"
                )
            if self._is_elementwise(0, param.flat, value):
                out[key] = (value.dtype, param.shape)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                out[key] = (value.dtype, ())
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = (torch.float32, ())  # a step counter kept as a number: stored as torch optimizers keep it
            else:
                raise FormatError(
                    f"{self._where(0)}: optimizer state {short(key)} of {short(name)} is a {type(value).__name__} "
                    f"{list(getattr(value, 'shape', []))[:8]}"
                )
        return out

    @reading
    def optimizer_state(self, name: str, key: str) -> torch.Tensor:
        """The optimizer state ``key`` (``exp_avg``, ``step``, ...) of parameter ``name``, whole (per-element entries)
        or as stored."""
        param = self._params[name]
        value = self._flat_state(0, param.flat).get(key)
        if value is None:
            raise KeyError(f"{name!r} has no optimizer state {key!r}")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            return value.clone()
        if isinstance(value, (int, float)):
            return torch.tensor(float(value), dtype=torch.float32)

        def piece(rank: int) -> torch.Tensor:
            stored = self._flat_state(rank, param.flat).get(key)
            if not self._is_elementwise(rank, param.flat, stored):
                raise FormatError(
                    f"{self._where(rank)}: optimizer state {short(key)} of flat group {param.flat} does not match its "
                    "fp32 partition"
                )
            assert isinstance(stored, torch.Tensor)
            return stored

        if not self._is_elementwise(0, param.flat, value):
            raise FormatError(
                f"{self._where(0)}: optimizer state {short(key)} of {short(name)} is a {type(value).__name__}"
            )
        return self._gather(param, piece, value.dtype)

    @reading
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups (hyper-parameters as saved, each a number, string or short list) with ``params``
        as parameter names."""
        groups = self._inner(0).get("param_groups")
        if not isinstance(groups, list):
            raise FormatError(
                f"{self._where(0)}: elastic ZeRO-{self.stage} optimizer state records no param groups; cannot convert "
                "the optimizer"
            )
        out = []
        for g, group in enumerate(groups):
            where = f"{self._where(0)}: param group {g}"
            hyper = {
                str(k): hyper_parameter(v, f"{where} {short(k)}")
                for k, v in group.items()
                if k != "params" and isinstance(k, str)
            }
            hyper["params"] = [p.name for p in self._params.values() if p.group == g]
            out.append(hyper)
        return out

    @property
    def buffers(self) -> list[str]:
        """Names of the persistent buffers."""
        return list(self._buffer_names)

    @reading
    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype the model file gives ``name``: the engine's (16-bit) parameter dtype, a buffer's own (not
        upcast)."""
        value = self._module.get(self.aliases.get(name, name))
        return value.dtype if isinstance(value, torch.Tensor) else self.dtype(name)

    @reading
    def flat_groups(self) -> list[tuple[list[str], dict[str, Any], list[str]]]:
        """The optimizer's flat groups (ZeRO-3 sub-groups, ZeRO-1/2 param groups) as saved: their parameter
        names in flat order, their scalar state exactly as the inner optimizer held it (a 0-dim ``step``
        tensor; a fused Adam's step stays in its param group), and their per-element state keys."""
        out = []
        state = self._inner(0)["state"]
        for flat in range(len(self._owner)):
            names = [p.name for p in self._params.values() if p.flat == flat]
            saved = state.get(flat)
            scalars: dict[str, Any] = {}
            elementwise: list[str] = []
            for key, value in saved.items() if isinstance(saved, dict) else ():
                if not isinstance(key, str):
                    raise FormatError(
                        f"{self._where(0)}: optimizer state of flat group {flat} has a key that is a "
                        f"{type(key).__name__}"
                    )
                if self._is_elementwise(0, flat, value):
                    elementwise.append(key)
                elif is_scalar(value):
                    scalars[key] = value
                else:
                    raise FormatError(
                        f"{self._where(0)}: optimizer state {short(key)} of flat group {flat} is a "
                        f"{type(value).__name__}"
                    )
            out.append((names, scalars, elementwise))
        return out

    def loss_scaling(self) -> LossScaling:
        """The loss scaler and the ``dynamic_loss_scale`` and ``overflow`` flags, as saved."""
        opt = self._optim_state(0)
        scaler = opt.get("loss_scaler")
        names = {stand_in: qualified.rsplit(".", 1)[1] for stand_in, qualified in STAND_INS}
        saved = (names[type(scaler)], dict(vars(scaler))) if isinstance(scaler, LossScalerState) else None
        dynamic, overflow = opt.get("dynamic_loss_scale", False), opt.get("overflow", False)
        return LossScaling(
            saved, isinstance(dynamic, int) and bool(dynamic), isinstance(overflow, int) and bool(overflow)
        )

    def lr_scheduler_state(self) -> dict[str, Any] | None:
        """The LR scheduler's state dict DeepSpeed saved, or None."""
        value = self._model_state(0).get("lr_scheduler")
        return value if isinstance(value, dict) else None

    def state_dict_order(self) -> list[str]:
        """Every name of the model's state dict, in its order (tied aliases included)."""
        return [k for k in self._module if isinstance(k, str)]

    def describe(self) -> dict[str, Any]:
        """Facts about the run, recorded by :func:`~shardsafe.interop.deepspeed_convert.convert_deepspeed` (counters
        only when they are integers)."""
        model = self._model_state(0)
        return {
            "format": "deepspeed_zero",
            "zero_stage": self.stage,
            "dp_world_size": self.world_size,
            "tag": self.tag,
            "ds_version": self.ds_version,
            "global_steps": small_int(model.get("global_steps")),
            "global_samples": small_int(model.get("global_samples")),
            "skipped_steps": small_int(model.get("skipped_steps")),
            "path": str(self.model_folder),
        }


def open_source(
    path: str | os.PathLike[str], key: str = "model", *, verify: bool = True
) -> DeepSpeedCheckpoint | CheckpointSource:
    """The export source for ``path``: a :class:`DeepSpeedCheckpoint` for a DeepSpeed folder, else a shardsafe
    :class:`CheckpointSource`."""
    if is_deepspeed_checkpoint(path):
        if key not in ("model", ""):
            raise ShardsafeError(f"{path}: a DeepSpeed checkpoint holds one model; key={key!r} does not apply")
        return DeepSpeedCheckpoint(path)
    return CheckpointSource(path, key, verify=verify)
