"""Hugging Face model folders: shard planning, a streaming safetensors writer, and export.

A Hugging Face model folder holds ``model.safetensors`` (or ``model-0000k-of-0000N.safetensors``
plus ``model.safetensors.index.json``), ``config.json`` and, for generative models,
``generation_config.json``. This module writes one tensor at a time: every file's header is
computed up front from names, dtypes and shapes (known before any byte is read), then each
tensor is fetched, cast and streamed straight after it, so memory is bounded by the largest
tensor, not the model.

:func:`export_hf` consolidates a sharded shardsafe checkpoint (or a model folder written by
``save_pretrained(..., gather_16bit=False)``) into such a folder in one process. What it reads
from is a :class:`TensorSource` (names, dtypes, shapes, ``read(name)``), so other checkpoint
formats can plug in. ``shardsafe export`` is its command line (:mod:`shardsafe.cli.export`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardsafe.api.source import DTYPE_CHOICES, TensorInfo, TensorSource
from shardsafe.core.comm import Comm
from shardsafe.core.dtypes import output_dtype
from shardsafe.core.format import (
    MAX_JSON_BYTES,
    HeaderEntry,
    build_safetensors_header,
    dtype_from_name,
    dtype_name,
    numel,
    parse_json,
)
from shardsafe.core.values import subclass_records
from shardsafe.errors import FormatError, ShardsafeError
from shardsafe.hf.guard import INDEX_FILE, SINGLE_FILE, check_model_folder
from shardsafe.hf.weights_file import METADATA_KEY, show_name
from shardsafe.protocol.commit import prepare
from shardsafe.storage.local import read_small_file, safe_child, write_small_file
from shardsafe.storage.safetensors import LocalSink, SafetensorsWriter

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "SINGLE_FILE",
    "SafetensorsStreamWriter",
    "ShardPlan",
    "export_hf",
    "iter_output",
    "parse_size",
    "plan_shards",
    "write_index",
]

log = logging.getLogger(__name__)

SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"

# Decimal units, as huggingface_hub.parse_size_to_int uses (5GB = 5 * 10**9 bytes); binary ones too.
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"``, ``"500MB"``, ``"20KB"`` (decimal, as Hugging Face
    uses)."""
    if isinstance(size, bool):
        raise ValueError(f"invalid size {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(str(size))
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS and unit != "":
            raise ValueError(f"invalid size {size!r}: expected a number with a unit such as 5GB, 500MB, 20KB")
        value = int(float(match.group(1)) * _UNITS[unit or "B"])
    if value <= 0:
        raise ValueError(f"invalid size {size!r}: must be positive")
    return value


# ----------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go into which file, in write order."""

    files: list[tuple[str, list[TensorInfo]]]

    @property
    def is_sharded(self) -> bool:
        return len(self.files) > 1

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for _, infos in self.files for t in infos)

    @property
    def tensors(self) -> list[TensorInfo]:
        return [t for _, infos in self.files for t in infos]

    def weight_map(self) -> dict[str, str]:
        return {t.name: file for file, infos in self.files for t in infos}

    def describe(self) -> list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]:
        """A small, comparable description (ranks check they planned the same thing)."""
        return [(file, [(t.name, dtype_name(t.dtype), t.shape) for t in infos]) for file, infos in self.files]


def check_tensor_names(names: Iterable[str], where: str) -> None:
    """Refuse names that would make a safetensors file no loader opens, before anything is written.

    safetensors keeps its metadata under the key ``__metadata__`` (a tensor of that name would
    overwrite it, or be refused), stores names as UTF-8 JSON (a lone surrogate, which a Python
    string can hold, is not UTF-8), and needs each name once (two tensors whose names only
    differed by the stripped ``key/`` prefix would collide).
    """
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or not name:
            raise FormatError(f"{where}: tensor name {name!r} is not a non-empty string; safetensors cannot store it")
        if name == METADATA_KEY:
            raise FormatError(
                f"{where}: a tensor is named {METADATA_KEY!r}, the key safetensors keeps its metadata under; rename it"
            )
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise FormatError(
                f"{where}: tensor name {show_name(name)} is not valid UTF-8 (a lone surrogate); safetensors cannot "
                "store it"
            ) from None
        if name in seen:
            raise FormatError(
                f"{where}: two tensors would both be named {show_name(name)} in the model folder (after the key prefix "
                "is stripped)"
            )
        seen.add(name)


def plan_shards(
    tensors: list[TensorInfo], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, *, where: str = "model folder"
) -> ShardPlan:
    """Split ``tensors`` (in state-dict order) into files the way ``huggingface_hub`` does.

    Greedy, in order: a tensor that would push the current file over ``max_shard_size`` starts a
    new one; a tensor larger than the limit gets a file of its own. One file is named
    ``model.safetensors``, several ``model-0000k-of-0000N.safetensors``. Names safetensors
    cannot store are refused first (:func:`check_tensor_names`, a :class:`FormatError`).
    """
    limit = parse_size(max_shard_size)
    check_tensor_names((t.name for t in tensors), where)
    groups: list[list[TensorInfo]] = []
    current: list[TensorInfo] = []
    current_size = 0
    for info in tensors:
        if info.nbytes > limit:
            groups.append([info])
            continue
        if current and current_size + info.nbytes > limit:
            groups.append(current)
            current, current_size = [], 0
        current.append(info)
        current_size += info.nbytes
    if current:
        groups.append(current)
    if not groups:
        raise ShardsafeError("no tensors to write")
    if len(groups) == 1:
        return ShardPlan([(SINGLE_FILE, groups[0])])
    return ShardPlan([(SHARD_FILE.format(index=i + 1, count=len(groups)), g) for i, g in enumerate(groups)])


def _refuse_subclasses(source: Any) -> None:
    """A model folder holds plain weights: a tensor subclass stored by its parts (an NF4 base weight)
    is refused, naming it, rather than exported as its inner tensors under ``<name>/<inner>``."""
    tree, key = getattr(source, "tree", None), getattr(source, "key", None)
    entry = tree.get(key) if isinstance(tree, dict) and isinstance(key, str) else None
    records = subclass_records(entry.get("state"), "state.json") if isinstance(entry, dict) else {}
    if records:
        path, record = next(iter(records.items()))
        raise ShardsafeError(
            f"export: {len(records)} tensor(s) of {key!r} are tensor subclasses stored by their parts ({path!r}: a "
            f"{record.cls}); a model folder holds plain weights: load the checkpoint into the model, replace them by "
            "dequantized weights (NF4: t.get_original_weight()) and export with save_pretrained"
        )


# ----------------------------------------------------------------------------- writing


class SafetensorsStreamWriter:
    """A model folder's weights file, written tensor by tensor in header order (the one streaming
    writer, :class:`~shardsafe.storage.safetensors.SafetensorsWriter`, over a new local file).

    The header is written first (all shapes are known up front); each :meth:`write` streams one
    tensor's bytes and checks it is the dtype and shape the header promised. The file is created
    with ``O_EXCL`` and must be completed by :meth:`close`. ``write_behind`` (for files that will
    be fsynced) starts writeback while writing, so the final fsync has little left to do.
    """

    def __init__(self, path: Path, tensors: list[TensorInfo], write_behind: bool = True) -> None:
        self.path = path
        self.tensors = tensors
        check_tensor_names((t.name for t in tensors), str(path))
        prefix, _ = build_safetensors_header([HeaderEntry(t.name, t.dtype, t.shape) for t in tensors])
        self._writer = SafetensorsWriter(
            LocalSink(path, write_behind), prefix, [t.nbytes for t in tensors], where=str(path)
        )
        self.size = self._writer.size

    def write(self, tensor: torch.Tensor) -> None:
        index = self._writer.count
        if index >= len(self.tensors):
            raise ShardsafeError(f"{self.path}: more tensors written than its header lists")
        info = self.tensors[index]
        if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
            raise ShardsafeError(
                f"{self.path}: tensor {info.name!r} is {tensor.dtype} {list(tensor.shape)}, the header says "
                f"{info.dtype} {list(info.shape)}"
            )
        self._writer.write(tensor)

    def close(self, fsync: bool = True) -> None:
        try:
            self._writer.close(fsync)
        except ValueError as exc:
            raise ShardsafeError(str(exc)) from None

    def abort(self) -> None:
        self._writer.abort()


def index_bytes(plan: ShardPlan, total_parameters: int | None = None) -> bytes:
    """``model.safetensors.index.json`` as transformers writes it (sorted keys, indent 2)."""
    metadata: dict[str, Any] = {"total_size": plan.total_size}
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    index = {"metadata": metadata, "weight_map": plan.weight_map()}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def write_index(folder: Path, plan: ShardPlan, total_parameters: int | None = None, fsync: bool = True) -> None:
    if plan.is_sharded:
        write_small_file(folder / INDEX_FILE, index_bytes(plan, total_parameters), fsync)


def hf_tied_aliases(config: Any) -> dict[str, str]:
    """{alias: source} of the weights a transformers model built from ``config`` ties (e.g. lm_head.weight).

    Builds the model named by ``config.architectures`` on the meta device (no memory) and reads
    its ``all_tied_weights_keys``; {} when transformers is missing or the model cannot be built.
    """
    try:
        import transformers
    except ImportError:
        return {}
    try:
        if isinstance(config, dict):
            config = transformers.AutoConfig.for_model(**config)  # model_type is its first parameter
        architectures = getattr(config, "architectures", None) or []
        cls = getattr(transformers, architectures[0], None) if architectures else None
        with torch.device("meta"):  # no architectures recorded: the causal-LM head is what ties weights
            model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
        tied = getattr(model, "all_tied_weights_keys", None)
        return {str(k): str(v) for k, v in (tied or {}).items()}
    except Exception as exc:  # a config transformers cannot build: export everything
        log.warning(
            "could not determine tied weights from the config (%s: %s); exporting every tensor", type(exc).__name__, exc
        )
        return {}


def _load_config(config: Any, files: dict[str, Path]) -> tuple[Any, bytes | None]:
    """(config for tie detection, config.json bytes to write) from ``config=`` or the source's files."""
    if config is None:
        path = files.get("config.json")
        if path is None:
            return None, None
        data = read_small_file(path, MAX_JSON_BYTES)
        parsed = parse_json(data, str(path))
        return (parsed if isinstance(parsed, dict) else None), data
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        data = read_small_file(path, MAX_JSON_BYTES)
        return parse_json(data, str(path)), data
    if isinstance(config, dict):
        return config, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    if hasattr(config, "to_json_string"):
        return config, config.to_json_string(use_diff=True).encode()
    raise TypeError(f"config must be a transformers config, a dict or a path, got {type(config).__name__}")


def _with_dtype(config_json: bytes, dtype: torch.dtype | None) -> bytes:
    """config.json with its dtype field set to what the weights were exported in."""
    if dtype is None:
        return config_json
    try:
        data = json.loads(config_json)
    except ValueError:
        return config_json
    if not isinstance(data, dict):
        return config_json
    field = "torch_dtype" if "torch_dtype" in data and "dtype" not in data else "dtype"
    data[field] = dtype_name(dtype)
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


# ----------------------------------------------------------------------------- export


def stream_weights(
    folder: Path,
    plan: ShardPlan,
    fetch: Callable[[TensorInfo], torch.Tensor],
    *,
    fsync: bool = True,
    progress: Any = None,
) -> None:
    """Write every file of ``plan`` into ``folder``, fetching each tensor only when it is written."""
    for file, infos in plan.files:
        writer = SafetensorsStreamWriter(folder / file, infos, write_behind=fsync)
        try:
            for info in infos:
                tensor = fetch(info)
                writer.write(tensor)
                del tensor
                if progress is not None:
                    progress.update(info.nbytes)
            writer.close(fsync)
        finally:
            writer.abort()


def _dtype_argument(name: str) -> torch.dtype:
    """A manifest dtype name given as ``export_hf(dtype=...)``: the caller's own argument, so the error names it."""
    try:
        return dtype_from_name(name, "dtype")
    except FormatError:
        raise ShardsafeError(
            f"export_hf(dtype={name!r:.40}): not a dtype name; use one of {', '.join(DTYPE_CHOICES)} "
            "(or another manifest dtype name such as float64), or a torch.dtype"
        ) from None


def export_hf(
    src: str | os.PathLike[str] | TensorSource,
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    key: str = "model",
    config: Any = None,
    progress: bool = True,
    overwrite: bool = False,
    verify: bool = True,
    fsync: bool = True,
) -> Path:
    """Consolidate a sharded checkpoint into a Hugging Face model folder at ``out``, in this process.

    ``src`` is a shardsafe checkpoint, a model folder written by ``save_pretrained(...,
    gather_16bit=False)``, a DCP or DeepSpeed ZeRO folder, or any :class:`TensorSource`. Tensors
    under ``key`` are written under their names without the ``key/`` prefix, one at a time (each
    read with verified positional reads of just its chunks, then cast), into ``model.safetensors`` or
    ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json`` by ``max_shard_size``.
    ``dtype`` casts floating-point tensors (default: what save_pretrained recorded, else the
    stored dtypes). ``config.json`` / ``generation_config.json`` are copied from the source folder,
    or ``config`` (a transformers config, dict or path) is written. Tied weights the config
    declares are written once, as transformers does. The folder is built hidden next to ``out``,
    checked by the model-folder guard and renamed into place. Not collective: one process.

    Args:
        src: a shardsafe checkpoint, a ``save_pretrained(gather_16bit=False)`` folder, a DCP or
            DeepSpeed ZeRO folder, or a :class:`TensorSource`.
        out: the model folder to create.
        dtype: the floating-point dtype of the weights (a torch dtype or a manifest dtype name such as
            ``"bfloat16"``; default None: what save_pretrained recorded, else as stored).
        max_shard_size: split into files of at most this size (``"5GB"`` or bytes; default ``"5GB"``).
        key: the state key holding the model's tensors (default ``"model"``; without a ``model`` entry,
            a checkpoint's one DeepSpeed engine entry).
        config: a transformers config, dict or path written as ``config.json`` (default: the
            source folder's).
        progress: a bytes progress bar (default True).
        overwrite: replace a non-empty ``out`` (default False).
        verify: check the block hash of every byte read (default True).
        fsync: make the folder durable before it is renamed into place (default True).

    Returns:
        ``out`` as an absolute :class:`~pathlib.Path`.

    Raises:
        CheckpointExistsError: ``out`` is a non-empty folder and ``overwrite`` is False.
        FormatError, IntegrityError: the source is damaged or hostile (names the file and tensor).
        ModelFolderError: the guard refuses the result (it is not published).
    """
    final = Path(out).absolute()
    if isinstance(dtype, str):
        dtype = DTYPE_CHOICES.get(dtype) or _dtype_argument(dtype)
    own = not isinstance(src, TensorSource)
    source: Any = src
    if own:
        assert isinstance(src, (str, os.PathLike))
        # a DCP folder, a DeepSpeed ZeRO folder, else a shardsafe checkpoint
        from shardsafe.interop.sources import open_source

        source = open_source(src, key, verify=verify)
    try:
        if final in (getattr(source, "model_folder", None), getattr(source, "folder", None)):
            raise ShardsafeError(f"{final}: the output folder must not be the source")
        _refuse_subclasses(source)
        files = source.config_files()
        cfg, config_json = _load_config(config, files)
        if own and not source.aliases_recorded and cfg is not None:
            source.tie(hf_tied_aliases(cfg))
        target = dtype if dtype is not None else source.default_dtype
        stored = source.tensors()
        where = f"export {getattr(source, 'folder', None) or type(source).__name__} -> {final}"
        plan = plan_shards(
            [TensorInfo(t.name, output_dtype(t.dtype, target), t.shape) for t in stored], max_shard_size, where=where
        )
        total_parameters = getattr(source, "total_parameters", None) or sum(numel(t.shape) for t in stored)
        with prepare(Comm(None, 0, 1), final, overwrite, fsync) as temp:  # removed unless published
            tmp = temp.path
            from tqdm.auto import tqdm

            with tqdm(
                total=plan.total_size, unit="B", unit_scale=True, unit_divisor=1024, desc="export", disable=not progress
            ) as bar:

                def fetch(info: TensorInfo) -> torch.Tensor:
                    return source.read(info.name).to(info.dtype)

                stream_weights(tmp, plan, fetch, fsync=fsync, progress=bar)
            write_index(tmp, plan, total_parameters, fsync)
            if config_json is not None:
                write_small_file(tmp / "config.json", _with_dtype(config_json, target), fsync)
            if "generation_config.json" in files:
                write_small_file(
                    tmp / "generation_config.json",
                    read_small_file(files["generation_config.json"], MAX_JSON_BYTES),
                    fsync,
                )
            check_model_folder(tmp)
            temp.publish()
    finally:
        if own:
            source.close()
    return final


def iter_output(folder: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of a Hugging Face model folder (via safetensors); for tests and tools."""
    from safetensors import safe_open

    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        index = parse_json(read_small_file(folder / INDEX_FILE, MAX_JSON_BYTES), str(folder / INDEX_FILE))
        files = sorted(set(index["weight_map"].values()))
    else:
        files = [SINGLE_FILE]
    for file in files:
        with safe_open(str(safe_child(folder, file)), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
