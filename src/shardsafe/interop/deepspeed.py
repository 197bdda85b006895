"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3), read without DeepSpeed and without running pickled code.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/`` holding
``*_model_states.pt`` and ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (one per
data-parallel rank). Those are ``torch.save`` pickles; the optimizer files also hold a few DeepSpeed
objects (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``). :func:`load_pt` opens them with
``torch.load(weights_only=True, mmap=True)``, i.e. torch's restricted unpickler, with those few
DeepSpeed globals mapped to plain stand-in classes defined here: any other global (``os.system``,
anything of DeepSpeed's beyond those) is refused, nothing of DeepSpeed is imported, and tensor
bytes stay in the file (memory-mapped) until a slice of them is copied out.

:class:`DeepSpeedCheckpoint` is a :class:`~shardsafe.export.TensorSource`: ``tensors()`` /
``names()`` / ``shape(name)`` / ``dtype(name)`` describe the consolidated model and ``read(name)``
assembles one full tensor from the ranks' slices, touching only those bytes; the pages it read are
then unmapped again (``madvise``), so resident memory stays about one tensor whatever the model size.
Values and dtypes are those of DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``: fp32 master
weights for trained parameters, frozen parameters in their stored dtype, persistent buffers
(16-bit floating buffers upcast to fp32, as DeepSpeed does; fp64 ones are kept, where DeepSpeed
narrows them). Where DeepSpeed's consolidation drops frozen parameters (ZeRO-1 with bf16 records
none), they are taken whole from the model file. ``optimizer_state(name, key)`` and
``param_groups()`` give the optimizer state per parameter, which :func:`convert_deepspeed` writes
as a shardsafe checkpoint that ``shardsafe.load({"model": model, "optim": AdamW(...)})`` restores on
any world size.
With ``for_engine=True`` it writes the layout of :mod:`shardsafe.deepspeed_engine` instead, which
``shardsafe.load({"engine": engine})`` restores into a fresh ZeRO-3 engine on any world size.

Layout facts: docs/DEEPSPEED.md. Not supported (refused with a message): tensor or pipeline
parallel checkpoints (``mp_rank_01``, ``layer_*``), MoE / AutoEP expert partitions, elastic
ZeRO-1/2 optimizer state (weights are still read). Untested: CPU/NVMe optimizer offload.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap as mmap_module
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from shardsafe._version import __version__
from shardsafe.api.source import DTYPE_CHOICES, CheckpointSource, TensorInfo, find_config_files
from shardsafe.core.comm import Comm
from shardsafe.core.format import (
    MANIFEST_NAME,
    ChunkEntry,
    FileEntry,
    HeaderEntry,
    TensorEntry,
    build_safetensors_header,
    dump_json,
    numel,
)
from shardsafe.core.integrity import HASH_BLOCK_SIZE
from shardsafe.core.values import TENSOR_REF, encode_value
from shardsafe.errors import CheckpointNotFoundError, FormatError, ShardsafeError
from shardsafe.protocol.commit import agree_and_publish, new_manifest, prepare_save
from shardsafe.state.deepspeed_engine import KIND_DEEPSPEED_ENGINE, SECTIONS, engine_meta, tensor_key
from shardsafe.storage.local import safe_child

log = logging.getLogger(__name__)

LATEST = "latest"
_OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE_Z3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_FILE_Z12 = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_UNSUPPORTED_FILES = re.compile(r"^(layer_\d+|expp_rank_\d+|.*_moe_).*\.pt$")
_HALF = (torch.float16, torch.bfloat16)

# ----------------------------------------------------------------------------- restricted loading


class LossScalerState:
    """Stand-in for DeepSpeed's ``LossScaler`` / ``DynamicLossScaler``: just the pickled attributes."""

    cur_scale: float
    dynamic: bool

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class DynamicLossScalerState(LossScalerState):
    """Stand-in for DeepSpeed's ``DynamicLossScaler``."""


class ZeroStage(int):
    """Stand-in for DeepSpeed's ``ZeroStageEnum`` (an int enum: 1, 2 or 3)."""


class FragmentAddress:
    """Stand-in for DeepSpeed's ``fragment_address`` dataclass (``numel``, ``start``) of ZeRO-1/2 files."""

    numel: int
    start: int

    def __repr__(self) -> str:
        return f"FragmentAddress({self.__dict__})"


# The only globals beyond what torch.load(weights_only=True) allows (tensors, storages, dtypes,
# OrderedDict, torch.Size, ...), each mapped to a class that has no behaviour.
STAND_INS: list[tuple[Any, str]] = [
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_pt(path: str | os.PathLike[str], *, mmap: bool = True) -> Any:
    """Unpickle a ``torch.save`` file of a DeepSpeed checkpoint without running code from it.

    torch's weights-only unpickler, plus the :data:`STAND_INS` (only while this call runs). Tensors
    are memory-mapped (``mmap=True``): their bytes are read from the file when used. Raises
    :class:`FormatError` naming the file (and the refused global) on anything else.
    """
    return _load_pt(Path(path), mmap)[0]


def _load_pt(path: Path, mmap: bool) -> tuple[Any, bool]:
    """(unpickled object, whether its tensors are memory-mapped)."""
    try:
        with torch.serialization.safe_globals(cast(Any, STAND_INS)):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap), mmap
            except RuntimeError as exc:
                if not mmap or "zip" not in str(exc).lower():
                    raise
                log.warning("%s: not in torch's zip format, so it cannot be memory-mapped; reading it whole", path)
                return torch.load(path, map_location="cpu", weights_only=True), False
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing") from None
    except Exception as exc:
        first = str(exc).strip().splitlines()
        detail = next((line for line in first if "GLOBAL" in line or "global" in line), first[0] if first else "")
        raise FormatError(f"{path}: refused or unreadable ({type(exc).__name__}: {detail[:300]})") from None


def _libc_madvise() -> Any:
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    function = getattr(ctypes.CDLL(name, use_errno=True), "madvise", None) if name else None
    if function is not None:
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        function.restype = ctypes.c_int
    return function


_madvise = _libc_madvise()
_MADV_DONTNEED = 4
_PAGE = mmap_module.PAGESIZE


_COPY_PIECE = 8 << 20  # bytes copied out of a memory-mapped file (then unmapped) at a time


def _drop_mapped_pages(view: torch.Tensor) -> None:
    """Unmap the resident pages wholly inside ``view``, a contiguous slice of a memory-mapped file that nobody writes.

    The bytes stay in the file (and the page cache); touching them again reads them back. Without
    this, every page a consolidation reads stays mapped into the process until the file is closed,
    so its resident memory would grow to the size of the checkpoint.
    """
    if view.numel():
        _drop_range(view.data_ptr(), view.data_ptr() + view.numel() * view.element_size())


def _drop_range(start: int, end: int) -> None:
    """Unmap the resident pages wholly inside the mapped addresses [start, end) (see :func:`_drop_mapped_pages`)."""
    lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if _madvise is not None and lo < hi:
        _madvise(lo, hi - lo, _MADV_DONTNEED)  # advice only: a failure changes nothing


def _copy_out(dest: torch.Tensor, src: torch.Tensor, mapped: bool) -> None:
    """``dest.copy_(src)``; from a memory-mapped file (``mapped``), piece by piece, unmapping each piece after copying it.

    Pieces end on page boundaries, so each piece's pages are unmapped whole and at most one piece
    of the file is mapped at a time (not the whole slice). The bytes are copied by one ``memmove``
    per piece rather than by torch's parallel ``copy_``, whose threads fault on the same file pages
    together: several times slower on a cold page cache (measured with 2 threads).
    """
    if not mapped or not src.is_contiguous():
        dest.copy_(src)
        return
    if dest.dtype != src.dtype or not dest.is_contiguous() or dest.numel() != src.numel():
        dest.copy_(src)
        _drop_mapped_pages(src)
        return
    nbytes = src.numel() * src.element_size()
    begin, target = src.data_ptr(), dest.data_ptr()
    pos = 0
    while pos < nbytes:
        end = min(nbytes, (begin + pos + _COPY_PIECE) // _PAGE * _PAGE - begin)
        ctypes.memmove(target + pos, begin + pos, end - pos)
        _drop_range(begin + pos, begin + end)
        pos = end


# ----------------------------------------------------------------------------- locating a checkpoint


def _is_tag_folder(folder: Path) -> bool:
    try:
        return folder.is_dir() and any(_OPTIM_FILE.match(p.name) for p in folder.iterdir())
    except OSError:
        return False


def is_deepspeed_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint folder (holding ``latest``) or one of its tag folders."""
    folder = Path(path)
    if (folder / MANIFEST_NAME).is_file():
        return False
    if (folder / LATEST).is_file():
        return True
    return _is_tag_folder(folder)


def find_deepspeed_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> tuple[Path, Path, str]:
    """(root folder, tag folder, tag) of a DeepSpeed checkpoint given its root folder or a tag folder."""
    folder = Path(path).absolute()
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such folder")
    if tag is None and _is_tag_folder(folder):
        return folder.parent, folder, folder.name
    if tag is None:
        latest = folder / LATEST
        if not latest.is_file():
            tags = sorted(p.name for p in folder.iterdir() if _is_tag_folder(p))
            hint = f"; it holds the tag folders {tags}, pick one with tag=/--tag or pass that folder" if tags else ""
            raise CheckpointNotFoundError(f"{folder}: not a DeepSpeed checkpoint (no {LATEST!r} file and no *_optim_states.pt files){hint}")
        with open(latest, "rb") as f:
            tag = f.read(4096).decode(errors="replace").strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\0" in tag:
        raise FormatError(f"{folder}: bad checkpoint tag {tag!r}; it must be one folder name")
    inner = safe_child(folder, tag)
    if not _is_tag_folder(inner):
        raise CheckpointNotFoundError(f"{inner}: tag folder is missing or holds no *_optim_states.pt files")
    return folder, inner, tag


# ----------------------------------------------------------------------------- validation helpers


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise FormatError(f"{where}: no {key!r} entry; not a DeepSpeed ZeRO checkpoint file")
    value = obj[key]
    if not isinstance(value, kind):
        raise FormatError(f"{where}: {key!r} is a {type(value).__name__}, expected {kind}")
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise FormatError(f"{where}: bad shape {value!r:.80}")
    return tuple(int(d) for d in value)


def _shapes(value: Any, where: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise FormatError(f"{where}: expected a mapping of parameter names to shapes")
    return {k: _shape(v, f"{where}[{k!r}]") for k, v in value.items()}


def _flat(value: Any, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise FormatError(f"{where}: expected a 1-D tensor, got {type(value).__name__} {list(getattr(value, 'shape', []))}")
    return value


def _is_scalar(value: Any) -> bool:
    """A plain value or a one-element tensor: optimizer state shared by a flat group's parameters (``step``)."""
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() <= 1)


@dataclass(frozen=True)
class _Param:
    """Where a trained parameter's slices live."""

    name: str
    shape: tuple[int, ...]
    group: int  # index of its param group in the inner optimizer
    flat: int  # ZeRO-3: sub-group index; ZeRO-1/2: param group index
    offset: int  # ZeRO-3: offset in every rank's flat sub-group; ZeRO-1/2: offset in the group's concatenation over ranks


# ----------------------------------------------------------------------------- the reader


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint as named whole tensors (a :class:`~shardsafe.export.TensorSource`).

    ``path`` is the folder ``engine.save_checkpoint`` wrote (holding ``latest``) or a tag folder;
    ``tag`` picks another tag. Files are memory-mapped; each :meth:`read` allocates one tensor and
    copies each rank's slice of it in, touching only those bytes.
    """

    default_dtype: torch.dtype | None = None  # export keeps DeepSpeed's dtypes unless told otherwise
    aliases_recorded = True  # tied weights come from the checkpoint's shared_params

    def __init__(self, path: str | os.PathLike[str], tag: str | None = None) -> None:
        self.model_folder, self.folder, self.tag = find_deepspeed_checkpoint(path, tag)
        self._optim_files, self._model_files = self._list_files()
        self.world_size = len(self._optim_files)
        self._optim: dict[int, Any] = {}
        self._models: dict[int, Any] = {}
        self._mapped: set[int] = set()  # ranks whose optimizer file is memory-mapped
        self._mapped_models: set[int] = set()  # the same for model files (-1: ZeRO-1/2's single file)
        first = self._optim_state(0)
        stage = _get(first, "zero_stage", int, self._where(0))
        if int(stage) not in (1, 2, 3):
            raise FormatError(f"{self._where(0)}: unknown ZeRO stage {int(stage)}")
        self.stage = int(stage)
        if self.stage == 3 and any(k in first for k in ("ds_zero_partition_groups",)):
            raise FormatError(f"{self._where(0)}: ZeRO-3 expert-partitioned (AutoEP) checkpoints are not supported")
        model = self._model_state(0)
        where = str(self._model_path(0))
        self.ds_version = str(model.get("ds_version", "?"))
        if model.get("mp_world_size", 1) != 1:
            raise FormatError(f"{where}: tensor-parallel checkpoints (mp_world_size={model.get('mp_world_size')}) are not supported")
        recorded = model.get("dp_world_size", self.world_size)
        if recorded != self.world_size:
            raise FormatError(
                f"{self.folder}: {self.world_size} optimizer state files, but the checkpoint was saved by {recorded} data-parallel ranks "
                "(a rank's file is missing, or files of another save were left here)"
            )
        self._check_file_set()
        if any(k in model for k in ("ds_autoep_layers", "autoep_layers")) and model.get("ds_autoep_layers", model.get("autoep_layers")):
            raise FormatError(f"{where}: AutoEP expert-parallel checkpoints are not supported")
        self._module: dict[str, Any] = _get(model, "module", dict, where)
        buffer_names = _get(model, "buffer_names", list, where)
        self._buffer_names = [b for b in buffer_names if isinstance(b, str) and b in self._module]
        param_shapes = _get(model, "param_shapes", list, where)
        self._frozen = _shapes(model.get("frozen_param_shapes") or {}, f"{where}: frozen_param_shapes")
        shared = model.get("shared_params") or {}
        if not isinstance(shared, dict):
            raise FormatError(f"{where}: shared_params is a {type(shared).__name__}")
        self._params: dict[str, _Param] = {}
        self._owner: list[int] = []  # flat group -> param group
        if self.stage == 3:
            self._layout_zero3(param_shapes, where)
        else:
            self._layout_zero12(param_shapes, where)
        known = set(self._params) | set(self._frozen) | set(self._buffer_names)
        self.aliases: dict[str, str] = {str(a): str(s) for a, s in shared.items() if s in known and a not in known}
        # ZeRO-1/2 keep whole parameters in the model file; with bf16 on, DeepSpeed records no frozen_param_shapes (and
        # zero_to_fp32 drops frozen parameters): take those from the model file, in its dtype.
        self._whole: set[str] = set()
        for name, value in self._module.items():
            if name in known or name in self.aliases or not isinstance(name, str):
                continue
            if self.stage < 3 and isinstance(value, torch.Tensor) and value.numel():
                self._whole.add(name)
            else:
                log.warning("%s: state-dict entry %r is neither optimized, frozen, a buffer nor tied, and not stored whole; left out", where, name)
        known |= self._whole
        self._order = self._ordered_names(known)

    # -- files

    def _list_files(self) -> tuple[list[Path], dict[int, Path]]:
        optim: dict[int, Path] = {}
        models: dict[int, Path] = {}
        for entry in sorted(self.folder.iterdir()):
            name = entry.name
            if m := _OPTIM_FILE.match(name):
                rank, mp = int(m.group(2)), int(m.group(3))
                if mp != 0:
                    raise FormatError(f"{entry}: tensor-parallel checkpoints (mp_rank {mp}) are not supported")
                if rank in optim:
                    raise FormatError(f"{self.folder}: two optimizer files for rank {rank} ({optim[rank].name}, {name})")
                optim[rank] = entry
            elif m := _MODEL_FILE_Z3.match(name):
                if int(m.group(2)) != 0:
                    raise FormatError(f"{entry}: tensor-parallel checkpoints (mp_rank {m.group(2)}) are not supported")
                models[int(m.group(1))] = entry
            elif m := _MODEL_FILE_Z12.match(name):
                if int(m.group(1)) != 0:
                    raise FormatError(f"{entry}: tensor-parallel checkpoints (mp_rank {m.group(1)}) are not supported")
                models[-1] = entry
            elif _UNSUPPORTED_FILES.match(name):
                raise FormatError(f"{entry}: pipeline-parallel or MoE expert checkpoint files are not supported")
        ranks = sorted(optim)
        if ranks != list(range(len(ranks))):
            raise FormatError(f"{self.folder}: optimizer files for ranks {ranks}; expected 0..{len(ranks) - 1} (a rank's file is missing)")
        for path in [*optim.values(), *models.values()]:
            safe_child(self.folder, path.name)  # regular files inside the tag folder, no symlinks out
        return [optim[r] for r in ranks], models

    def _check_file_set(self) -> None:
        if self.stage == 3:
            ranks = sorted(r for r in self._model_files if r >= 0)
            if ranks != list(range(self.world_size)):
                raise FormatError(f"{self.folder}: ZeRO-3 model state files for ranks {ranks}; expected 0..{self.world_size - 1}")
        elif -1 not in self._model_files:
            raise FormatError(f"{self.folder}: no mp_rank_00_model_states.pt (ZeRO-{self.stage} keeps one model file)")

    def _model_path(self, rank: int) -> Path:
        key = rank if self.stage == 3 else -1
        if key not in self._model_files:
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if self.stage == 3 else "mp_rank_00_model_states.pt"
            raise FormatError(f"{self.folder}: {name} is missing (ZeRO-{self.stage})")
        return self._model_files[key]

    def _where(self, rank: int) -> str:
        return str(self._optim_files[rank])

    def _optim_state(self, rank: int) -> dict[str, Any]:
        """``optimizer_state_dict`` of rank ``rank``'s optimizer file (memory-mapped, kept open)."""
        if rank not in self._optim:
            raw, mapped = _load_pt(self._optim_files[rank], True)
            self._optim[rank] = _get(raw, "optimizer_state_dict", dict, self._where(rank))
            if mapped:
                self._mapped.add(rank)
        return self._optim[rank]

    def _model_state(self, rank: int) -> dict[str, Any]:
        key = rank if self.stage == 3 else -1
        if key not in self._models:
            raw, mapped = _load_pt(self._model_path(rank), True)
            if not isinstance(raw, dict):
                raise FormatError(f"{self._model_path(rank)}: not a model states dict")
            self._models[key] = raw
            if mapped:
                self._mapped_models.add(key)
        return self._models[key]

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
        return inner

    def _flats(self, rank: int) -> list[torch.Tensor]:
        key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        flats = _get(self._optim_state(rank), key, list, self._where(rank))
        return [_flat(f, f"{self._where(rank)}: {key}[{i}]") for i, f in enumerate(flats)]

    def _group_of_flat(self, count: int) -> list[int]:
        groups = self._inner(0).get("param_groups")
        if self.stage != 3 or groups is None:
            return list(range(count))
        owner = [-1] * count
        for g, group in enumerate(groups):
            for k in group.get("params", []) if isinstance(group, dict) else []:
                if isinstance(k, int) and 0 <= k < count:
                    owner[k] = g
        if -1 in owner:
            raise FormatError(f"{self._where(0)}: flat sub-group {owner.index(-1)} belongs to no optimizer param group")
        return owner

    def _layout_zero3(self, param_shapes: list[Any], where: str) -> None:
        world = self.world_size
        lengths = [[f.numel() for f in self._flats(r)] for r in range(world)]
        if len(lengths[0]) != len(param_shapes) or any(len(x) != len(lengths[0]) for x in lengths):
            raise FormatError(f"{where}: {len(param_shapes)} sub-groups in param_shapes, but the ranks hold {[len(x) for x in lengths]} flat groups")
        owner = self._owner = self._group_of_flat(len(param_shapes))
        for k, shapes in enumerate(param_shapes):
            offset = 0
            for name, shape in _shapes(shapes, f"{where}: param_shapes[{k}]").items():
                if name in self._params:
                    raise FormatError(f"{where}: parameter {name!r} listed twice in param_shapes")
                self._params[name] = _Param(name, shape, owner[k], k, offset)
                offset += math.ceil(numel(shape) / world)
            for r in range(world):
                if lengths[r][k] != offset:
                    raise FormatError(
                        f"{self._where(r)}: flat sub-group {k} holds {lengths[r][k]} elements, but its parameters need {offset} on each rank"
                    )

    def _layout_zero12(self, param_shapes: list[Any], where: str) -> None:
        world = self.world_size
        first = self._optim_state(0)
        counts = first.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(c != world for c in counts):
            raise FormatError(f"{self._where(0)}: partition counts {counts} differ from the {world} ranks (MoE groups are not supported)")
        flats = [[f.numel() for f in self._flats(r)] for r in range(world)]
        if len(flats[0]) != len(param_shapes) or any(len(x) != len(param_shapes) for x in flats):
            raise FormatError(f"{where}: {len(param_shapes)} param groups in param_shapes, but the ranks hold {[len(x) for x in flats]} flat groups")
        paddings = first.get("param_alignment_paddings")
        self._owner = list(range(len(param_shapes)))
        self._partitions: list[list[tuple[int, int]]] = []  # per group, per rank: (start, length) in the group's concatenation
        align = 2 * world
        for g, shapes in enumerate(param_shapes):
            parsed = _shapes(shapes, f"{where}: param_shapes[{g}]")
            pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) and isinstance(paddings[g], list) else [0] * len(parsed)
            if len(pads) != len(parsed) or not all(isinstance(p, int) and p >= 0 for p in pads):
                raise FormatError(f"{self._where(0)}: param_alignment_paddings[{g}] does not match the group's {len(parsed)} parameters")
            offset = 0
            for (name, shape), pad in zip(parsed.items(), pads):
                if name in self._params:
                    raise FormatError(f"{where}: parameter {name!r} listed twice in param_shapes")
                self._params[name] = _Param(name, shape, g, g, offset)
                offset += numel(shape) + pad
            start, parts = 0, []
            for r in range(world):
                parts.append((start, flats[r][g]))
                start += flats[r][g]
            if math.ceil(offset / align) != math.ceil(start / align):  # the check zero_to_fp32 makes
                raise FormatError(f"{where}: param group {g} needs {offset} elements, the ranks hold {start}")
            self._partitions.append(parts)

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

    def shape(self, name: str) -> tuple[int, ...]:
        name = self.aliases.get(name, name)
        if name in self._params:
            return self._params[name].shape
        if name in self._frozen:
            return self._frozen[name]
        if name in self._buffer_names or name in self._whole:
            return tuple(self._buffer(name).shape)
        raise KeyError(name)

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
        self._optim.clear()
        self._models.clear()

    def __enter__(self) -> DeepSpeedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- pieces

    def _buffer(self, name: str, upcast: bool = True) -> torch.Tensor:
        """A tensor stored whole in the model file; 16-bit floating buffers upcast to fp32 as DeepSpeed does."""
        value = self._module[name]
        if not isinstance(value, torch.Tensor):
            raise FormatError(f"{self._model_path(0)}: {name!r} is a {type(value).__name__}")
        return value.float() if upcast and value.dtype in _HALF else value

    def _frozen_dtype(self, name: str) -> torch.dtype:
        fragments = self._model_state(0).get("frozen_param_fragments") or {}
        value = fragments.get(name)
        if not isinstance(value, torch.Tensor):
            raise FormatError(f"{self._model_path(0)}: no fragment of frozen parameter {name!r}")
        return value.dtype

    def _read_frozen(self, name: str) -> torch.Tensor:
        shape = self._frozen[name]
        n = numel(shape)
        out = torch.empty(n, dtype=self._frozen_dtype(name))
        ranks = range(self.world_size) if self.stage == 3 else range(1)  # ZeRO-1/2 store frozen parameters whole
        pos = 0
        for r in ranks:
            if pos >= n:
                break
            fragment = (self._model_state(r).get("frozen_param_fragments") or {}).get(name)
            if not isinstance(fragment, torch.Tensor) or fragment.dtype != out.dtype:
                raise FormatError(f"{self._model_path(r)}: no {out.dtype} fragment of frozen parameter {name!r}")
            take = min(fragment.numel(), n - pos)
            src = fragment.reshape(-1)[:take]
            _copy_out(out[pos : pos + take], src, (r if self.stage == 3 else -1) in self._mapped_models and fragment.is_contiguous())
            pos += take
        if pos != n:
            raise FormatError(f"{self.folder}: frozen parameter {name!r} has {pos} of its {n} elements in the checkpoint")
        return out.view(shape)

    def _gather(self, param: _Param, piece: Callable[[int], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Assemble a whole tensor of ``param``'s shape from each rank's 1-D ``piece(rank)`` of the flat group."""
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
        _copy_out(dest, src, rank in self._mapped)

    # -- optimizer state

    @property
    def trainable(self) -> list[str]:
        """Names of the parameters the optimizer updates, in the inner optimizer's order."""
        return list(self._params)

    def _flat_state(self, rank: int, flat: int) -> dict[str, Any]:
        """The inner optimizer's state of one flat group; a step kept in the param group (DeepSpeed's fused Adam) joins it."""
        inner = self._inner(rank)
        state = inner["state"].get(flat)
        state = dict(state) if isinstance(state, dict) else {}
        if state and "step" not in state:
            groups = inner.get("param_groups")
            owner = self._owner[flat]
            group = groups[owner] if isinstance(groups, list) and owner < len(groups) and isinstance(groups[owner], dict) else {}
            if isinstance(group.get("step"), (int, float)) and not isinstance(group.get("step"), bool):
                state["step"] = group["step"]
        return state

    def _is_elementwise(self, rank: int, flat: int, value: Any) -> bool:
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            return False
        length = self._flats(rank)[flat].numel()
        if self.stage == 3:
            return value.numel() == length
        paddings = self._optim_state(rank).get("group_paddings")  # ZeRO-1/2 keep the rank's padding at the end of its state
        pad = paddings[flat] if isinstance(paddings, list) and flat < len(paddings) and isinstance(paddings[flat], int) else 0
        return value.numel() in (length, length + pad)

    def optimizer_state_spec(self, name: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]] | Any]:
        """Optimizer state entries of parameter ``name``: key -> (dtype, shape) for tensors, the value for others."""
        param = self._params[name]
        out: dict[str, Any] = {}
        for key, value in self._flat_state(0, param.flat).items():
            if self._is_elementwise(0, param.flat, value):
                out[key] = (value.dtype, param.shape)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                out[key] = (value.dtype, ())
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = (torch.float32, ())  # a step counter kept as a number: stored as torch optimizers keep it
            else:
                raise FormatError(
                    f"{self._where(0)}: optimizer state {key!r} of {name!r} is a {type(value).__name__} {list(getattr(value, 'shape', []))}"
                )
        return out

    def optimizer_state(self, name: str, key: str) -> torch.Tensor:
        """The optimizer state ``key`` (``exp_avg``, ``step``, ...) of parameter ``name``, whole (per-element entries) or as stored."""
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
                raise FormatError(f"{self._where(rank)}: optimizer state {key!r} of flat group {param.flat} does not match its fp32 partition")
            assert isinstance(stored, torch.Tensor)
            return stored

        return self._gather(param, piece, value.dtype)

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups (hyper-parameters as saved) with ``params`` as parameter names."""
        groups = self._inner(0).get("param_groups")
        if not isinstance(groups, list):
            raise FormatError(f"{self._where(0)}: elastic ZeRO-{self.stage} optimizer state records no param groups; cannot convert the optimizer")
        out = []
        for g, group in enumerate(groups):
            if not isinstance(group, dict):
                raise FormatError(f"{self._where(0)}: param group {g} is a {type(group).__name__}")
            hyper = {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in group.items() if k != "params"}
            hyper["params"] = [p.name for p in self._params.values() if p.group == g]
            out.append(hyper)
        return out

    @property
    def buffers(self) -> list[str]:
        """Names of the persistent buffers."""
        return list(self._buffer_names)

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype the model file gives ``name``: the engine's (16-bit) parameter dtype, a buffer's own (not upcast)."""
        value = self._module.get(self.aliases.get(name, name))
        return value.dtype if isinstance(value, torch.Tensor) else self.dtype(name)

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
                if self._is_elementwise(0, flat, value):
                    elementwise.append(key)
                elif _is_scalar(value):
                    scalars[key] = value
                else:
                    raise FormatError(f"{self._where(0)}: optimizer state {key!r} of flat group {flat} is a {type(value).__name__}")
            out.append((names, scalars, elementwise))
        return out

    def loss_scaling(self) -> tuple[tuple[str, dict[str, Any]] | None, bool, bool]:
        """(loss scaler as (DeepSpeed class name, attributes) or None, ``dynamic_loss_scale``, ``overflow``) as saved."""
        opt = self._optim_state(0)
        scaler = opt.get("loss_scaler")
        names = {stand_in: qualified.rsplit(".", 1)[1] for stand_in, qualified in STAND_INS}
        saved = (names[type(scaler)], dict(vars(scaler))) if isinstance(scaler, LossScalerState) else None
        return saved, bool(opt.get("dynamic_loss_scale", False)), bool(opt.get("overflow", False))

    def describe(self) -> dict[str, Any]:
        """Facts about the run, recorded by :func:`convert_deepspeed`."""
        model = self._model_state(0)
        return {
            "format": "deepspeed_zero",
            "zero_stage": self.stage,
            "dp_world_size": self.world_size,
            "tag": self.tag,
            "ds_version": self.ds_version,
            "global_steps": model.get("global_steps"),
            "global_samples": model.get("global_samples"),
            "skipped_steps": model.get("skipped_steps"),
            "path": str(self.model_folder),
        }


def open_source(path: str | os.PathLike[str], key: str = "model", *, verify: bool = True) -> Any:
    """The export source for ``path``: a :class:`DeepSpeedCheckpoint` for a DeepSpeed folder, else a shardsafe :class:`CheckpointSource`."""
    if is_deepspeed_checkpoint(path):
        if key not in ("model", ""):
            raise ShardsafeError(f"{path}: a DeepSpeed checkpoint holds one model; key={key!r} does not apply")
        return DeepSpeedCheckpoint(path)
    return CheckpointSource(path, key, verify=verify)


# ----------------------------------------------------------------------------- conversion


@dataclass
class _Planned:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


class _Produced:
    """The planned tensors, each computed only when the file writer reaches it."""

    def __init__(self, planned: list[_Planned], progress: Any) -> None:
        self.planned, self.progress = planned, progress

    def __len__(self) -> int:
        return len(self.planned)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for item in self.planned:
            tensor = item.produce()
            if tensor.dtype != item.dtype or tuple(tensor.shape) != item.shape:
                raise ShardsafeError(f"{item.key}: produced {tensor.dtype} {list(tensor.shape)}, planned {item.dtype} {list(item.shape)}")
            yield tensor.contiguous()
            if self.progress is not None:
                self.progress.update(tensor.numel() * tensor.element_size())
            del tensor


def _cast(dtype: torch.dtype | None, stored: torch.dtype) -> torch.dtype:
    return dtype if dtype is not None and stored.is_floating_point else stored


def convert_deepspeed(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype | str | None = torch.float32,
    model_key: str = "model",
    optim_key: str = "optim",
    overwrite: bool = False,
    fsync: bool = True,
    progress: bool = False,
    for_engine: bool = False,
    engine_key: str = "engine",
) -> Path:
    """Turn a DeepSpeed ZeRO checkpoint into a shardsafe checkpoint at ``out``, in this process.

    Written: ``model/<name>`` for every entry of the model's state dict (fp32 master weights of
    trained parameters, frozen parameters and buffers cast to ``dtype`` when floating, None keeps
    DeepSpeed's dtypes; tied aliases as copies), ``optim/state/<param name>/<key>`` (``exp_avg``,
    ``exp_avg_sq``, ``step`` as a 0-dim float32 tensor, ...) and the param groups with parameter
    names, keyed exactly as :func:`shardsafe.save` keys a module and a torch optimizer, plus
    ``step`` (DeepSpeed's global step) and, when DeepSpeed saved one, ``sched`` (the LR scheduler's
    state). So ``shardsafe.load(out, {"model": model, "optim": AdamW(groups)})`` resumes on any
    world size (plain, DDP or FSDP2) when ``groups`` hold the same parameters in the same order as
    the DeepSpeed run's. One tensor is in memory at a time. Returns ``out``.

    ``for_engine=True`` writes instead what ``shardsafe.save({engine_key: engine})`` writes for a live
    ZeRO-3 engine (see :mod:`shardsafe.deepspeed_engine`; ``dtype`` does not apply), so that
    ``shardsafe.load(out, {"engine": engine})`` resumes in a fresh ZeRO-3 engine of the same model on any
    number of ranks, which ``engine.load_checkpoint`` refuses; ``step`` and ``sched`` as above.
    """
    from shardsafe.api.checkpoint import location

    if isinstance(dtype, str):
        dtype = None if dtype in ("keep", "none") else DTYPE_CHOICES[dtype]
    final = location(out)
    with DeepSpeedCheckpoint(src, tag) as ckpt:
        if isinstance(final, Path) and final in (ckpt.model_folder, ckpt.folder):
            raise ShardsafeError(f"{final}: the output folder must not be the source")
        if for_engine:
            planned, tree = _plan_engine(ckpt, engine_key)
        else:
            planned, tree = _plan_module(ckpt, dtype, model_key, optim_key)
        info = ckpt.describe()
        if isinstance(info["global_steps"], int):
            tree["step"] = {"kind": "value", "state": info["global_steps"]}
        scheduler = ckpt._model_state(0).get("lr_scheduler")
        if isinstance(scheduler, dict):
            try:
                tree["sched"] = {"kind": "stateful", "state": encode_value(scheduler, "sched", _no_tensors)}
            except ShardsafeError as exc:
                log.warning("the LR scheduler state is not stored (%s)", exc)
        planned.sort(key=lambda p: p.key)  # the manifest lists tensors by key; files follow the same order
        _write(final, planned, tree, {"converted_from": info}, overwrite=overwrite, fsync=fsync, progress=progress)
    return Path(final) if isinstance(final, Path) else Path(str(out))


def _plan_module(ckpt: DeepSpeedCheckpoint, dtype: torch.dtype | None, model_key: str, optim_key: str) -> tuple[list[_Planned], dict[str, Any]]:
    """The tensors and state entries of a module + torch optimizer (``convert_deepspeed`` without ``for_engine``)."""
    planned: list[_Planned] = []

    def ref(path: str, tensor: torch.Tensor) -> str:
        return path

    model_tree: dict[str, Any] = {}
    for name in [*ckpt.names(), *ckpt.aliases]:
        stored = ckpt.dtype(name)
        target = _cast(dtype, stored)
        planned.append(_Planned(f"{model_key}/{name}", target, ckpt.shape(name), functools.partial(_read_as, ckpt, name, target)))
        model_tree[name] = torch.empty(0)
    order = {name: i for i, name in enumerate(ckpt._module)}
    model_tree = dict(sorted(model_tree.items(), key=lambda kv: order.get(kv[0], len(order))))

    optim_tree: dict[str, Any] = {"state": {}, "param_groups": ckpt.param_groups()}
    for name in ckpt.trainable:
        entries: dict[str, Any] = {}
        for key, (state_dtype, shape) in ckpt.optimizer_state_spec(name).items():
            planned.append(_Planned(f"{optim_key}/state/{name}/{key}", state_dtype, shape, functools.partial(ckpt.optimizer_state, name, key)))
            entries[key] = torch.empty(0)
        if entries:
            optim_tree["state"][name] = entries
    return planned, {
        model_key: {"kind": "module", "state": encode_value(model_tree, model_key, ref)},
        optim_key: {"kind": "optimizer", "state": encode_value(optim_tree, optim_key, ref)},
    }


def _plan_engine(ckpt: DeepSpeedCheckpoint, name: str) -> tuple[list[_Planned], dict[str, Any]]:
    """The tensors and state entry a live ZeRO-3 engine's ``shardsafe.save`` would write, from the checkpoint.

    Each tensor is the whole 1-D parameter (one chunk), so any world size reads its partition from it;
    the meta comes from :func:`~shardsafe.deepspeed_engine.engine_meta`, the live save's own builder.
    Sub-groups and their step counts are the DeepSpeed run's (the load re-cuts them at its world size).
    """
    planned: list[_Planned] = []
    state: dict[str, Any] = {section: {} for section in SECTIONS}

    def plan(section: str, pname: str, dtype: torch.dtype, produce: Callable[[], torch.Tensor], sub: str | None = None) -> None:
        key = tensor_key(name, section, *([sub] if sub else []), pname)
        shape = ckpt.shape(pname) if section == "buffers" else (numel(ckpt.shape(pname)),)
        planned.append(_Planned(key, dtype, shape, produce))
        node = state[section].setdefault(sub, {}) if sub else state[section]
        node[pname] = {TENSOR_REF: key}

    groups = ckpt.param_groups()
    group_of = {pname: g for g, group in enumerate(groups) for pname in group["params"]}
    params: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]] = {}
    scalars: list[tuple[list[str], dict[str, Any]]] = []
    for names, flat_scalars, elementwise in ckpt.flat_groups():
        for pname in names:
            plan("fp32", pname, ckpt.dtype(pname), functools.partial(_read_flat, ckpt.read, pname))
            params[pname] = (ckpt.shape(pname), ckpt.stored_dtype(pname), group_of[pname])
            spec = ckpt.optimizer_state_spec(pname)
            for key in elementwise:
                plan("optim", pname, spec[key][0], functools.partial(_read_flat, functools.partial(ckpt.optimizer_state, key=key), pname), key)
        if flat_scalars:
            scalars.append((names, flat_scalars))
    for pname in ckpt.names():
        if pname in group_of:
            continue
        if pname in ckpt.buffers:
            dtype = ckpt.stored_dtype(pname)
            plan("buffers", pname, dtype, functools.partial(_read_as, ckpt, pname, dtype))
        else:  # frozen: as stored (the 16-bit partitions a ZeRO-3 engine keeps)
            plan("frozen", pname, ckpt.dtype(pname), functools.partial(_read_flat, ckpt.read, pname))
            params[pname] = (ckpt.shape(pname), ckpt.dtype(pname), None)
    scaler, dynamic, overflow = ckpt.loss_scaling()
    info = ckpt.describe()
    meta = engine_meta(
        name,
        world_size=ckpt.world_size,
        deepspeed_version=ckpt.ds_version,
        params=params,
        aliases={a: s for a, s in ckpt.aliases.items() if s in params},
        param_groups=[(group.pop("params"), group) for group in groups],
        optimizer_scalars=scalars,
        loss_scaler=scaler,
        dynamic_loss_scale=dynamic,
        overflow=overflow,
        counters={c: info[c] for c in ("global_steps", "global_samples", "skipped_steps") if isinstance(info[c], int)},
    )
    return planned, {name: {"kind": KIND_DEEPSPEED_ENGINE, "state": state, "meta": meta}}


def _read_flat(read: Callable[[str], torch.Tensor], name: str) -> torch.Tensor:
    return read(name).reshape(-1)


def _read_as(ckpt: DeepSpeedCheckpoint, name: str, dtype: torch.dtype) -> torch.Tensor:
    return ckpt.read(name).to(dtype)


def _no_tensors(path: str, tensor: torch.Tensor) -> str:
    raise FormatError(f"{path}: holds a tensor")


def _write(
    final: Any, planned: list[_Planned], tree: dict[str, Any], metadata: dict[str, Any], *, overwrite: bool, fsync: bool, progress: bool
) -> None:
    """Stream ``planned`` into one shard file and commit it like :func:`shardsafe.save` (temp folder, manifest last, atomic publish)."""
    comm = Comm(None, 0, 1)
    target = prepare_save(comm, final, overwrite, fsync)
    try:
        name = target.shard_name(0)
        prefix, ranges = build_safetensors_header([HeaderEntry(p.key, p.dtype, p.shape) for p in planned])
        from tqdm.auto import tqdm

        total = sum(numel(p.shape) * p.dtype.itemsize for p in planned)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=not progress) as bar:
            size, digests = target.write_shard(name, prefix, _Produced(planned, bar), HASH_BLOCK_SIZE, 0)  # type: ignore[arg-type]
    except BaseException:
        target.abort()
        raise
    state_bytes = dump_json(tree)

    def build(results: list[Any]) -> tuple[Any, bytes]:
        manifest = new_manifest(1, {name: FileEntry(size, 0)}, state_bytes, metadata, __version__)
        manifest.tensors = {
            p.key: TensorEntry(p.dtype, p.shape, (ChunkEntry((0,) * len(p.shape), p.shape, name, begin, end, tuple(d)),))
            for p, (begin, end), d in zip(planned, ranges, digests)
        }
        return manifest, state_bytes

    agree_and_publish(comm, target, ("ok",), build)


# ----------------------------------------------------------------------------- command line


__all__ = [
    "DeepSpeedCheckpoint",
    "convert_deepspeed",
    "find_deepspeed_checkpoint",
    "is_deepspeed_checkpoint",
    "load_pt",
    "open_source",
]
