"""A DCP checkpoint's ``.metadata``, read without running code from it and checked against the folder's files.

``torch.distributed.checkpoint.save`` with its default ``FileSystemWriter`` writes a ``.metadata``
file (``pickle.dump`` of a ``Metadata`` dataclass, protocol 4) next to one ``__<rank>_<n>.distcp``
file per writer. Each item (a tensor chunk, or a non-tensor value as ``BytesIO``) is one
``torch.save`` archive at ``(relative_path, offset, length)`` in a ``.distcp`` file.

:func:`read_metadata` scans the pickle against the DCP profile of the restricted loader (only DCP's
metadata classes, ``torch.Size``, dtypes, the layout and memory-format encodings, ``pathlib`` paths
as strings, plain containers), unpickles it into the stand-ins below (nothing of torch's DCP is
imported or constructed), and turns it into a :class:`DcpMetadata` whose every path is a plain file
name in the folder and every ``(offset, length)`` lies inside that file (no two items sharing bytes),
and whose chunks lie inside their tensors and hold at most as many bytes as their item. Every refusal is a
:class:`FormatError`
naming the file.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardsafe.errors import CheckpointNotFoundError, FormatError
from shardsafe.interop.pickle_scan import (
    MAX_DIMS,
    MAX_PICKLE_BYTES,
    GlobalRules,
    RestrictedUnpickler,
    check_value_graph,
    scan_pickle,
)

__all__ = ["DcpItem", "DcpMetadata", "METADATA_NAME", "RULES", "is_dcp_folder", "read_metadata"]

METADATA_NAME = ".metadata"
_DATA_FILE = re.compile(r"^[A-Za-z0-9_.-]{1,200}\.distcp$")
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# a stored item: its flattened key, and its chunk's offsets (None for a non-tensor value)
_ItemKey = tuple[str, tuple[int, ...] | None]


class _StandIn:
    """A DCP metadata class with no behaviour: ``BUILD`` may give it only plain attributes by name."""

    FIELDS: tuple[str, ...] = ()

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not all(isinstance(k, str) and k in self.FIELDS for k in state):
            raise FormatError(f"a {type(self).__name__} with attributes other than {list(self.FIELDS)}")
        self.__dict__.update(state)

    def get(self, name: str) -> Any:
        return self.__dict__.get(name)


class MetadataStandIn(_StandIn):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class TensorStorageStandIn(_StandIn):
    FIELDS = ("properties", "size", "chunks")


class BytesStorageStandIn(_StandIn):
    FIELDS = ()


class ChunkStandIn(_StandIn):
    FIELDS = ("offsets", "sizes")


class MetadataIndexStandIn(_StandIn):
    FIELDS = ("fqn", "offset", "index")


class StorageInfoStandIn(_StandIn):
    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


class StorageMetaStandIn(_StandIn):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class TensorPropertiesStandIn(_StandIn):
    """``TensorProperties`` pickles a tuple: (dtype, layout, requires_grad, memory-format encoding, pin_memory)."""

    dtype: torch.dtype

    def __setstate__(self, state: Any) -> None:
        if (
            not isinstance(state, tuple)
            or len(state) != 5
            or not isinstance(state[0], torch.dtype)
            or state[1] is not torch.strided
        ):
            raise FormatError(
                "a TensorProperties that is not (dtype, torch.strided, requires_grad, memory format, pin_memory)"
            )
        self.dtype = state[0]


_LAYOUTS = {"torch.strided": torch.strided}
_MEMORY_FORMATS = {0: "contiguous", 1: "channels_last", 2: "preserve"}


def _get_layout(name: Any) -> torch.layout:
    if name not in _LAYOUTS:
        raise FormatError(f"a tensor layout other than torch.strided ({str(name)[:40]!r})")
    return _LAYOUTS[name]


def _memory_format(code: Any) -> str:
    if code not in _MEMORY_FORMATS or isinstance(code, bool):
        raise FormatError("an unknown memory-format encoding")
    return _MEMORY_FORMATS[code]


def _path(*parts: Any) -> str:
    if not parts or not all(isinstance(p, str) for p in parts):
        raise FormatError("a pathlib path of values that are not strings")
    return "/".join(parts)


def _size(*args: Any) -> torch.Size:
    if len(args) != 1 or not isinstance(args[0], (list, tuple)) or len(args[0]) > MAX_DIMS:
        raise FormatError(f"a torch.Size that is not one list of at most {MAX_DIMS} integers")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 62) for d in args[0]):
        raise FormatError("a torch.Size holding something other than non-negative integers")
    return torch.Size(args[0])


_QUANTIZED = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}
DTYPES = {
    n: d for n, d in vars(torch).items() if isinstance(d, torch.dtype) and d not in _QUANTIZED and d.itemsize >= 1
}
_CLASSES: dict[str, type] = {
    f"{_MD}.Metadata": MetadataStandIn,
    f"{_MD}.TensorStorageMetadata": TensorStorageStandIn,
    f"{_MD}.BytesStorageMetadata": BytesStorageStandIn,
    f"{_MD}.ChunkStorageMetadata": ChunkStandIn,
    f"{_MD}.TensorProperties": TensorPropertiesStandIn,
    f"{_MD}.MetadataIndex": MetadataIndexStandIn,
    f"{_MD}.StorageMeta": StorageMetaStandIn,
    f"{_FS}._StorageInfo": StorageInfoStandIn,
}
_CALLABLES: dict[str, Callable[..., Any]] = {
    "torch.Size": _size,
    "torch.serialization._get_layout": _get_layout,
    f"{_MD}._MEM_FORMAT_ENCODING": _memory_format,
    "pathlib.PosixPath": _path,
    "pathlib.PurePosixPath": _path,
}
_VALUES: dict[str, Any] = {f"torch.{name}": d for name, d in DTYPES.items()}
GLOBALS: dict[str, Any] = {**_VALUES, **_CALLABLES, **_CLASSES}
RULES = GlobalRules(
    values=frozenset(_VALUES),
    callables=frozenset(_CALLABLES),
    classes=frozenset(_CLASSES),
    protocols=frozenset({2, 3, 4, 5}),
    tuple_state=frozenset({f"{_MD}.TensorProperties"}),
    persistent_ids=False,
)


# ----------------------------------------------------------------------------- the checked result


@dataclass(frozen=True)
class DcpItem:
    """Where one item's ``torch.save`` archive lies: a file of the folder, a byte offset and length inside it."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of a tensor: its offsets and sizes in the whole tensor, and its item."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: DcpItem


@dataclass(frozen=True)
class DcpTensor:
    """A whole tensor of the checkpoint: dtype, global shape, the chunks that hold it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class DcpMetadata:
    """A checked ``.metadata``: tensors and non-tensor values by flattened key, their state-dict paths, the files'
    sizes."""

    folder: Path
    tensors: dict[str, DcpTensor] = field(default_factory=dict)
    values: dict[str, DcpItem] = field(default_factory=dict)
    # flattened key -> path in the nested state dict
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    file_sizes: dict[str, int] = field(default_factory=dict)
    version: str | None = None


def is_dcp_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder holding a DCP ``.metadata`` file (and so not a shardsafe checkpoint)."""
    folder = Path(path)
    return (folder / METADATA_NAME).is_file() and not (folder / "manifest.json").exists()


def _read_regular(path: Path, limit: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot be opened ({exc.strerror}; symbolic links are not followed)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FormatError(f"{path}: not a regular file")
        if info.st_size > limit:
            raise FormatError(f"{path}: {info.st_size} bytes is more than the {limit} allowed")
        with open(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def read_metadata(path: str | os.PathLike[str]) -> DcpMetadata:
    """The checked :class:`DcpMetadata` of the DCP folder ``path`` (see the module docstring)."""
    folder = Path(path).absolute()
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such folder")
    where = str(folder / METADATA_NAME)
    data = _read_regular(folder / METADATA_NAME, MAX_PICKLE_BYTES)
    scan_pickle(data, where, RULES)
    try:
        raw = RestrictedUnpickler(data, GLOBALS, what="DCP metadata").load()
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    except Exception as exc:  # values the scan let through that do not fit together (TypeError, ...)
        raise FormatError(f"{where}: refused or unreadable ({type(exc).__name__})") from None
    check_value_graph(raw, where, (_StandIn,))
    return _checked(folder, where, raw)


def _int(value: Any, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FormatError(f"{where}: {what} is not a non-negative integer")
    return value


def _checked(folder: Path, where: str, raw: Any) -> DcpMetadata:
    """The unpickled stand-ins turned into a :class:`DcpMetadata`, refusing anything DCP's FileSystemWriter
    would not have written: checked in one pass so every refusal names the file and the item."""
    if not isinstance(raw, MetadataStandIn):
        raise FormatError(f"{where}: holds a {type(raw).__name__}, not a DCP Metadata")
    meta = DcpMetadata(folder, version=raw.get("version") if isinstance(raw.get("version"), str) else None)
    sd_meta, storage = raw.get("state_dict_metadata"), raw.get("storage_data")
    if not isinstance(sd_meta, dict) or not isinstance(storage, dict):
        raise FormatError(f"{where}: no state_dict_metadata or storage_data (not written by DCP's FileSystemWriter)")
    items: dict[_ItemKey, DcpItem] = {}
    for index, info in storage.items():
        key, item = _storage_item(meta, where, index, info)
        if key in items:
            raise FormatError(f"{where}: {key[0][:120]!r} is stored twice at the same offsets")
        items[key] = item
    _check_disjoint(items, where)
    _describe_entries(meta, where, sd_meta, items)
    _set_paths(meta, sd_meta, raw.get("planner_data"))
    return meta


def _storage_item(meta: DcpMetadata, where: str, index: Any, info: Any) -> tuple[_ItemKey, DcpItem]:
    """One ``storage_data`` entry checked: a plain item inside a ``.distcp`` file of the folder, so a load
    reads only bytes that are there (the file's size is taken once, the first time a file is named)."""
    if not isinstance(index, MetadataIndexStandIn) or not isinstance(info, StorageInfoStandIn):
        raise FormatError(f"{where}: a storage_data entry that is not a MetadataIndex -> _StorageInfo")
    fqn, offset = index.get("fqn"), index.get("offset")
    if not isinstance(fqn, str):
        raise FormatError(f"{where}: a storage_data key without a name")
    if info.get("transform_descriptors"):
        raise FormatError(
            f"{where}: {fqn[:120]!r} is stored through extensions (compression, ...); only plain items are read"
        )
    name = info.get("relative_path")
    if not isinstance(name, str) or not _DATA_FILE.match(name) or name.startswith("."):
        raise FormatError(f"{where}: {fqn[:120]!r} is stored in {str(name)[:120]!r}, not a .distcp file of the folder")
    if name not in meta.file_sizes:
        meta.file_sizes[name] = _data_file_size(meta.folder / name, where)
    begin, length = (
        _int(info.get("offset"), f"{fqn[:120]!r}'s offset", where),
        _int(info.get("length"), f"{fqn[:120]!r}'s length", where),
    )
    if begin + length > meta.file_sizes[name]:
        raise FormatError(
            f"{where}: {fqn[:120]!r} lies at bytes {begin}..{begin + length} of {name}, which holds "
            f"{meta.file_sizes[name]}"
        )
    return (fqn, tuple(offset) if isinstance(offset, torch.Size) else None), DcpItem(name, begin, length)


def _data_file_size(child: Path, where: str) -> int:
    """The size of a ``.distcp`` file the metadata names; missing or not a regular file is refused
    (a symbolic link could point a load outside the folder)."""
    try:
        st = child.lstat()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{child}: missing (named by {where})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{child}: not a regular file (symbolic links are not followed)")
    return st.st_size


def _describe_entries(meta: DcpMetadata, where: str, sd_meta: dict[Any, Any], items: dict[_ItemKey, DcpItem]) -> None:
    """Each ``state_dict_metadata`` entry matched to its stored items: a value to its one item, a tensor
    to its chunks, so nothing is declared that the files do not hold."""
    for fqn, entry in sd_meta.items():
        if not isinstance(fqn, str):
            raise FormatError(f"{where}: a state_dict_metadata key that is not a string")
        if isinstance(entry, BytesStorageStandIn):
            if (fqn, None) not in items:
                raise FormatError(f"{where}: value {fqn[:120]!r} has no storage_data entry")
            meta.values[fqn] = items[(fqn, None)]
        elif isinstance(entry, TensorStorageStandIn):
            meta.tensors[fqn] = _tensor(fqn, entry, items, where)
        else:
            raise FormatError(f"{where}: {fqn[:120]!r} is described by a {type(entry).__name__}")


def _set_paths(meta: DcpMetadata, sd_meta: dict[Any, Any], planner: Any) -> None:
    """Each entry's path in the nested state: the planner's when it is a plain one, else the name itself
    (the planner data is only a hint, so a malformed one is ignored rather than refused)."""
    if isinstance(planner, dict):
        for fqn, path in planner.items():
            if (
                fqn in sd_meta
                and isinstance(path, tuple)
                and path
                and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)
            ):
                meta.paths[fqn] = path
    for fqn in sd_meta:
        meta.paths.setdefault(fqn, (fqn,))


def _check_disjoint(items: dict[tuple[str, tuple[int, ...] | None], DcpItem], where: str) -> None:
    """No two items share bytes of a file (DCP writes each once, one after another): so what a load
    allocates for the tensors the metadata declares is bounded by the bytes on disk."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for (fqn, _), item in items.items():
        if item.length:
            by_file.setdefault(item.file, []).append((item.offset, item.offset + item.length, fqn))
    for name, spans in by_file.items():
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise FormatError(
                    f"{where}: {a[:120]!r} and {b[:120]!r} share bytes of {name} (at {begin}); each item is stored once"
                )


def _tensor(
    fqn: str, entry: TensorStorageStandIn, items: dict[tuple[str, tuple[int, ...] | None], DcpItem], where: str
) -> DcpTensor:
    """A tensor's entry, checked: a known dtype, its chunks inside its shape, each no bigger than its item, together
    covering it once."""
    props, size, chunks = entry.get("properties"), entry.get("size"), entry.get("chunks")
    if (
        not isinstance(props, TensorPropertiesStandIn)
        or not isinstance(size, torch.Size)
        or not isinstance(chunks, list)
    ):
        raise FormatError(f"{where}: tensor {fqn[:120]!r} has no properties, size or chunk list")
    shape = tuple(size)
    out = []
    covered = 0
    for chunk in chunks:
        offsets, sizes = (
            chunk.get("offsets") if isinstance(chunk, ChunkStandIn) else None,
            chunk.get("sizes") if isinstance(chunk, ChunkStandIn) else None,
        )
        if (
            not isinstance(offsets, torch.Size)
            or not isinstance(sizes, torch.Size)
            or len(offsets) != len(shape)
            or len(sizes) != len(shape)
        ):
            raise FormatError(
                f"{where}: tensor {fqn[:120]!r} has a chunk whose offsets or sizes do not match its {len(shape)} "
                "dimensions"
            )
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise FormatError(
                f"{where}: tensor {fqn[:120]!r} {list(shape)} has a chunk at {list(offsets)} of {list(sizes)} outside "
                "it"
            )
        item = items.get((fqn, tuple(offsets)))
        if item is None:
            raise FormatError(
                f"{where}: tensor {fqn[:120]!r} has a chunk at {list(offsets)} with no storage_data entry"
            )
        nbytes = math.prod(sizes) * props.dtype.itemsize
        if nbytes > item.length:
            raise FormatError(f"{where}: tensor {fqn[:120]!r}: a chunk of {nbytes} bytes in an item of {item.length}")
        covered += math.prod(sizes)
        out.append(DcpChunk(tuple(offsets), tuple(sizes), item))
    if len(out) > 4096:
        raise FormatError(f"{where}: tensor {fqn[:120]!r} is saved in {len(out)} chunks; at most 4096 are read")
    for i, a in enumerate(out):  # chunks that overlap would leave others' elements unwritten
        for b in out[i + 1 :]:
            if (
                all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))
                and 0 not in a.sizes
                and 0 not in b.sizes
            ):
                raise FormatError(
                    f"{where}: tensor {fqn[:120]!r} has chunks at {list(a.offsets)} and {list(b.offsets)} that overlap"
                )
    if covered != math.prod(shape):
        raise FormatError(
            f"{where}: tensor {fqn[:120]!r} {list(shape)}: its chunks hold {covered} of its {math.prod(shape)} elements"
        )
    return DcpTensor(props.dtype, shape, tuple(out))
