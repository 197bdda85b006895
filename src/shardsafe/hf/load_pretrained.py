"""Hugging Face weights straight into a sharded model: :func:`load_pretrained`.

Starting a sharded run from a model folder usually means every rank loading the whole
``from_pretrained`` model (or rank 0 loading it and broadcasting), which does not fit for large
models. Here every rank reads only the rows it owns: for each parameter, the local shard's box is
known (an FSDP2 ``Shard(0)`` DTensor owns a contiguous block of rows, a plain or DDP parameter all
of it), and the safetensors header gives where the tensor's bytes start, so the rank preads that
byte range, converts the dtype and copies it into its local tensor, at most :data:`READ_BUDGET`
bytes (or one row, if larger) at a time.

A DeepSpeed ZeRO-3 parameter (``engine.module``, the engine, or a model built under
``deepspeed.zero.Init``) is partitioned flat: rank r holds elements ``[r*part, (r+1)*part)`` of the
flattened tensor. That is one contiguous byte range of the stored tensor too, so the rank preads
exactly it (whole rows and the partial rows at its ends) into its fp32 master partition or its
``ds_tensor`` (state/zero3.py's :class:`Zero3Targets` says which, and refreshes the rest after).

Before any parameter is written, every rank has checked every name, shape and byte range against
the files, and the ranks agree: missing and unexpected keys, shape mismatches and damaged headers
are reported together, and nothing is modified.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardsafe.core.comm import Comm, get_comm
from shardsafe.core.format import element_size
from shardsafe.errors import FormatError, ShardsafeError, StateMismatchError
from shardsafe.hf.guard import INDEX_FILE, SINGLE_FILE, check_model_folder
from shardsafe.hf.weights_file import read_weights_file
from shardsafe.state.base import Piece, pieces, unwrap_module
from shardsafe.state.deepspeed_engine import is_deepspeed_engine
from shardsafe.state.zero3 import Zero3Targets, is_zero3_param
from shardsafe.storage.local import open_regular, pread_into, read_small_file, safe_child, tensor_bytes

__all__ = ["load_pretrained"]

READ_BUDGET = 64 << 20  # bytes read per step (at least one row of the tensor)
HF_PREFIX = "hf://"
_DOWNLOAD_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", INDEX_FILE]


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a model folder."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class _Target:
    """One destination: the local data of a parameter or buffer, and which global rows it holds."""

    name: str
    stored: StoredTensor
    local: torch.Tensor
    offsets: tuple[int, ...]
    # local is elements [offsets[0], offsets[0] + local.numel()) of the flattened tensor (a ZeRO-3 partition)
    flat: bool = False


def _resolve(source: str | os.PathLike[str], revision: str | None, comm: Comm) -> Path:
    """A local folder, or ``hf://owner/name`` downloaded (config and safetensors only) by the coordinator."""
    text = str(source)
    if not text.startswith(HF_PREFIX):
        if revision is not None:
            raise ShardsafeError(f"{text}: revision= applies to hf:// sources only")
        return Path(text).absolute()
    repo_id = text[len(HF_PREFIX) :].strip("/")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ShardsafeError(f"{text}: expected hf://owner/name")

    def download() -> str:
        # Into a folder of real files (the Hub cache's snapshots are symlinks into blobs/, which the
        # folder checks refuse); offline, snapshot_download returns it when it is already complete.
        from huggingface_hub import constants, snapshot_download

        owner, name = repo_id.split("/")
        local = Path(constants.HF_HUB_CACHE).parent / "shardsafe-weights" / f"{owner}--{name}" / (revision or "main")
        return str(snapshot_download(repo_id, revision=revision, allow_patterns=_DOWNLOAD_PATTERNS, local_dir=local))

    folder = Path(comm.on_coordinator(download))
    if not folder.is_dir():  # another host: download (or find in the cache) here as well
        folder = Path(download())
    return folder


def _files_of(folder: Path) -> list[str]:
    if (folder / INDEX_FILE).is_file():
        index = json.loads(read_small_file(safe_child(folder, INDEX_FILE), 64 << 20))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise FormatError(f"{folder / INDEX_FILE}: no weight_map")
        return sorted({str(f) for f in weight_map.values()})
    return [SINGLE_FILE]


def read_layout(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of a model folder: file, dtype, shape and absolute byte range (headers checked by the guard's
    reader)."""
    layout: dict[str, StoredTensor] = {}
    for file in _files_of(folder):
        weights = read_weights_file(safe_child(folder, file))
        for name, t in weights.tensors.items():
            if name in layout:
                raise FormatError(f"{weights.path}: tensor {name!r} is also in {layout[name].file}")
            layout[name] = StoredTensor(file, t.dtype, t.shape, t.begin, t.end)
    return layout


def _destinations(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Name -> tensor to fill (parameters and persistent buffers), and alias -> name for tied parameters."""
    tensors: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            aliases[name] = first_name[id(param)]
            continue
        first_name[id(param)] = name
        tensors[name] = param
    persistent = set(module.state_dict().keys())
    for name, buf in module.named_buffers(remove_duplicate=False):
        if name in persistent and name not in tensors:
            tensors[name] = buf
    return tensors, aliases


def _match_names(wanted: list[str], stored: dict[str, StoredTensor], prefix: str) -> dict[str, str]:
    """Model name -> stored name, allowing the base-model prefix (``model.``) to differ, as transformers does."""
    out = {}
    for name in wanted:
        candidates = [name]
        if prefix:
            candidates += [f"{prefix}.{name}", name[len(prefix) + 1 :] if name.startswith(prefix + ".") else ""]
        found = next((c for c in candidates if c and c in stored), None)
        if found is not None:
            out[name] = found
    return out


@dataclass(frozen=True)
class _Plan:
    """Every destination to fill, and the names only the model (``missing``) or only the folder (``unexpected``)
    holds."""

    targets: list[_Target]
    missing: list[str]
    unexpected: list[str]


def _plan(module: nn.Module, layout: dict[str, StoredTensor], strict: bool, zero3: Zero3Targets) -> _Plan:
    tensors, aliases = _destinations(module)
    prefix = str(getattr(module, "base_model_prefix", "") or "")
    matched = _match_names(list(tensors), layout, prefix)
    for alias, name in aliases.items():  # a tied weight may be stored under either of its names
        if name not in matched:
            found = _match_names([alias], layout, prefix)
            if alias in found:
                matched[name] = found[alias]
    missing = sorted(n for n in tensors if n not in matched)
    used = set(matched.values())
    alias_names = {c for a in aliases for c in _match_names([a], layout, prefix).values()}
    unexpected = sorted(k for k in layout if k not in used and k not in alias_names)
    problems = []
    targets = []
    for name, stored_name in matched.items():
        stored = layout[stored_name]
        tensor, flat = tensors[name], is_zero3_param(tensors[name])
        shape: tuple[int, ...]
        if flat:
            share, local = zero3.destination(name, tensor)
            shape, held = share.shape, [Piece(local, (share.start,))]
        else:  # one box (FSDP2, TP, DDP) or several (FSDP2 over TP: _StridedShard), each read on its own
            shape, held = pieces(tensor)
        dtype = held[0].local.dtype
        if tuple(shape) != stored.shape:
            problems.append(
                f"{name}: the model has shape {list(shape)}, {stored.file} stores {stored_name} as {list(stored.shape)}"
            )
        elif stored.dtype.is_floating_point != dtype.is_floating_point and stored.dtype != dtype:
            problems.append(f"{name}: cannot load {stored.dtype} weights into a {dtype} tensor")
        else:
            targets += [_Target(name, stored, piece.local, piece.offsets, flat) for piece in held]
    if strict:
        problems += [f"missing in the model folder: {n}" for n in missing] + [
            f"unexpected in the model folder: {n}" for n in unexpected
        ]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise StateMismatchError("the model folder does not fit the model:\n  " + "\n  ".join(shown))
    return _Plan(targets, missing, unexpected)


def _read_elements(fd: int, stored: StoredTensor, first: int, count: int, where: str) -> torch.Tensor:
    """Elements ``[first, first + count)`` of the flattened stored tensor, in its dtype: one pread of exactly their
    bytes."""
    out = torch.empty(count, dtype=stored.dtype)
    pread_into(fd, [tensor_bytes(out)], stored.begin + first * element_size(stored.dtype), where)
    return out


def _read_rows(fd: int, stored: StoredTensor, first_row: int, rows: int, where: str) -> torch.Tensor:
    row_elems = 1
    for d in stored.shape[1:]:
        row_elems *= d
    block = _read_elements(fd, stored, first_row * row_elems, rows * row_elems, where)
    return block.view((rows, *stored.shape[1:]) if stored.shape else ())


def _fill_flat(target: _Target, fd: int, where: str) -> int:
    """A ZeRO-3 partition: its contiguous range of the flattened tensor, :data:`READ_BUDGET` bytes at a time."""
    size = element_size(target.stored.dtype)
    step = max(1, READ_BUDGET // size)
    total = target.local.numel()
    with torch.no_grad():  # the fp32 master partitions require grad (DeepSpeed marks them so)
        for start in range(0, total, step):
            count = min(step, total - start)
            target.local[start : start + count].copy_(
                _read_elements(fd, target.stored, target.offsets[0] + start, count, where)
            )
    return total * size


def _fill(target: _Target, fd: int, where: str) -> int:
    """Copy this rank's box of the stored tensor into ``target.local``, a bounded number of rows at a time."""
    if target.flat:
        return _fill_flat(target, fd, where)
    stored, local = target.stored, target.local
    if not stored.shape:  # a scalar
        local.copy_(_read_rows(fd, stored, 0, 1, where))
        return stored.end - stored.begin
    rows_total = local.shape[0]
    if local.numel() == 0:
        return 0
    row_bytes = (stored.end - stored.begin) // max(1, stored.shape[0])
    step = max(1, READ_BUDGET // max(1, row_bytes))
    box = tuple(slice(o, o + n) for o, n in zip(target.offsets[1:], local.shape[1:]))
    done = 0
    with torch.no_grad():
        for start in range(0, rows_total, step):
            rows = min(step, rows_total - start)
            block = _read_rows(fd, stored, target.offsets[0] + start, rows, where)
            local[start : start + rows].copy_(block[(slice(None), *box)])
            done += rows * row_bytes
    return done


def _unwrap(model: nn.Module) -> tuple[nn.Module, Zero3Targets]:
    """The module whose names the model folder uses (inside DDP or a DeepSpeed engine), and where its ZeRO-3 partitions
    go."""
    if not is_deepspeed_engine(model):
        return unwrap_module(model), Zero3Targets("load_pretrained")
    if (
        getattr(model, "mp_world_size", 1) != 1
        or getattr(model, "pipeline_parallelism", False)
        or getattr(model, "has_moe_layers", False)
    ):
        raise ShardsafeError(
            "load_pretrained: the DeepSpeed engine uses tensor, pipeline or expert parallelism, which shardsafe does "
            "not support"
        )
    module = model.module
    assert isinstance(module, nn.Module)
    return module, Zero3Targets("load_pretrained", getattr(model, "optimizer", None))


def load_pretrained(
    model: nn.Module,
    source: str | os.PathLike[str],
    *,
    process_group: Any = None,
    strict: bool = True,
    revision: str | None = None,
) -> dict[str, Any]:
    """Load a Hugging Face model folder (or ``hf://owner/name``) into ``model``, each rank reading only what it owns.

    Collective: every rank of ``process_group`` calls it. ``model`` may be plain, DDP-wrapped,
    FSDP2-sharded, a DeepSpeed ZeRO-3 engine or its ``engine.module`` (or a model built under
    ``deepspeed.zero.Init``): each rank reads its flat partition only, into the fp32 master weights
    of an engine's optimizer (the 16-bit partitions are refreshed from them). Floating-point weights
    are converted to the parameters' dtype (bf16 files into fp32 parameters); a tied weight stored
    under either name fills both; non-persistent buffers are left as the model built them. With ``strict``, missing and
    unexpected keys are errors
    (all reported at once, before anything is written); otherwise they are returned.
    The guard refuses a folder without real weights first (a ZeRO-3 dummy file, say).

    Args:
        model: the model to fill, in any of the forms above.
        source: a model folder, or ``hf://owner/name`` (config and safetensors downloaded by the
            coordinator; offline, a complete copy in the Hub cache).
        process_group: the ranks that hold the model (default: the default group).
        strict: missing and unexpected keys are an error (all reported at once) rather than returned.
        revision: the Hub revision of an ``hf://`` source.

    Returns:
        ``{"missing_keys": [...], "unexpected_keys": [...], "tensors": n, "bytes_read": b}`` (this
        rank's tensors and bytes).

    Raises:
        ModelFolderError: the guard refuses the folder (no real weights, or weights that do not fit
            its config.json).
        StateMismatchError: with ``strict``, keys missing or unexpected; shapes that do not fit.
        FormatError: a weights file is damaged or hostile (names the file).
    """
    comm = get_comm(process_group)
    module, zero3 = _unwrap(model)
    folder = _resolve(source, revision, comm)
    comm.on_coordinator(lambda: check_model_folder(folder))
    plan: _Plan | None = None
    problem: Exception | None = None
    try:
        plan = _plan(module, read_layout(folder), strict, zero3)
    except Exception as exc:  # every rank raises together below
        problem = exc
    comm.agree(problem)
    assert plan is not None
    targets = plan.targets
    fds: dict[str, int] = {}
    read = 0
    try:
        for target in targets:
            file = target.stored.file
            if file not in fds:
                fds[file] = open_regular(safe_child(folder, file))
            read += _fill(target, fds[file], f"{folder / file}: {target.name}")
    finally:
        for fd in fds.values():
            os.close(fd)
        zero3.finish()  # even after a failed read: the 16-bit partitions match the master, no stale gathered copy
    return {
        "missing_keys": plan.missing,
        "unexpected_keys": plan.unexpected,
        "tensors": len({t.name for t in targets}),
        "bytes_read": read,
    }
