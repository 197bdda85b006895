"""A ``torch.save`` file of a DeepSpeed checkpoint, read without running code from it and without trusting its numbers.

DeepSpeed's checkpoint files are ``torch.save`` zip archives: ``<name>/data.pkl`` (a protocol-2
pickle) and one stored record ``<name>/data/<key>`` per tensor storage. :func:`load_file` reads one:

1. the archive: a regular file opened without following a symlink, its zip directory parsed, every
   record stored uncompressed inside the file, the pickle at most
   :data:`~shardsafe.interop.pickle_scan.MAX_PICKLE_BYTES`, its CRC checked;
2. the pickle's opcodes pre-scanned (:func:`~shardsafe.interop.pickle_scan.scan_pickle`) against the
   exact allow-lists below, before anything is unpickled;
3. unpickled by a :class:`pickle.Unpickler` whose ``find_class`` answers only from :data:`GLOBALS` (each
   name mapped to a checking wrapper, a stand-in class or a plain value: nothing of DeepSpeed is
   imported, no torch rebuild function runs) and whose ``persistent_load`` turns a storage id into a
   view of that record's bytes after checking its dtype, device label and size against the record;
4. each tensor built by :func:`_tensor` only when its size, stride and storage offset describe a
   contiguous tensor lying wholly inside its record (negative or zero strides, broadcast views,
   offsets or extents past the record, misaligned records refused), as a view of the file's bytes;
5. the value graph checked for cycles, depth and expansion
   (:func:`~shardsafe.interop.pickle_scan.check_value_graph`).

With ``mmap=True`` the file is mapped privately (``mmap``, never written) and tensors are views of the
mapping (:class:`~shardsafe.interop.mapped_copy.FileMapping` says where, for ``copy_out``); else the
file's bytes are read into memory. Either way a tensor's bytes are bytes of the file: no tensor is
ever a meta, device or out-of-bounds tensor, and what the load allocates is bounded by the file's size.
Storage device labels (``cpu``, ``cuda:0``, ...) are read onto the CPU, as ``torch.load(map_location="cpu")``
does (the bytes are in the file either way); ``meta`` (no bytes) and unknown labels are refused.
Every refusal is a :class:`FormatError` naming the file.
"""

from __future__ import annotations

import io
import math
import mmap as mmap_module
import os
import re
import stat
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from shardsafe.errors import CheckpointNotFoundError, FormatError
from shardsafe.interop import pickle_scan
from shardsafe.interop.mapped_copy import FileMapping
from shardsafe.interop.pickle_scan import MAX_DIMS, GlobalRules, RestrictedUnpickler, check_value_graph, scan_pickle

__all__ = ["LossScalerState", "RULES", "STAND_INS", "TensorAt", "load_bytes", "load_file", "load_pt", "locate_tensor"]

MAX_RECORDS = 1_000_000  # records in one archive (DeepSpeed writes one per tensor)
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, name length, extra length of a zip local file header
_KEY = re.compile(r"^[0-9]{1,19}$")
_DEVICE = re.compile(r"^(cpu|cuda|xpu|hpu|npu|mps|mlu|privateuseone)(:[0-9]{1,5})?$")

# ----------------------------------------------------------------------------- stand-ins for DeepSpeed's classes


def _plain_state(obj: Any, state: Any) -> None:
    """``BUILD`` of a stand-in: only a dict of plain attributes (no dunder names, no containers beyond short tuples)."""
    if not isinstance(state, dict):
        raise FormatError(f"the state of a {type(obj).__name__} is a {type(state).__name__}, not a dict")
    for key, value in state.items():
        if not isinstance(key, str) or key.startswith("__"):
            raise FormatError(f"a {type(obj).__name__} attribute named {key!r:.80}")
        items = value if isinstance(value, (tuple, list)) and len(value) <= 16 else (value,)
        if not all(item is None or isinstance(item, (bool, int, float, str, torch.dtype)) for item in items):
            raise FormatError(f"the {type(obj).__name__} attribute {key!r:.80} is a {type(value).__name__}")
    obj.__dict__.update(state)


class LossScalerState:
    """Stand-in for DeepSpeed's ``LossScaler`` / ``DynamicLossScaler``: just the pickled attributes."""

    cur_scale: float
    dynamic: bool

    def __setstate__(self, state: Any) -> None:
        _plain_state(self, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class DynamicLossScalerState(LossScalerState):
    """Stand-in for DeepSpeed's ``DynamicLossScaler``."""


class ZeroStage(int):
    """Stand-in for DeepSpeed's ``ZeroStageEnum`` (an int enum: 0 to 3)."""


class FragmentAddress:
    """Stand-in for DeepSpeed's ``fragment_address`` dataclass (``numel``, ``start``) of ZeRO-1/2 files."""

    numel: int
    start: int

    def __setstate__(self, state: Any) -> None:
        _plain_state(self, state)

    def __repr__(self) -> str:
        return f"FragmentAddress({self.__dict__})"


# The DeepSpeed classes its checkpoint files name, each mapped to a class here that has no behaviour.
STAND_INS: list[tuple[Any, str]] = [
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]
_CONTAINERS = (LossScalerState, FragmentAddress)


def _zero_stage(value: Any) -> ZeroStage:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 3:
        raise FormatError(f"a ZeroStageEnum of {type(value).__name__} {value!r:.20}")
    return ZeroStage(value)


# ----------------------------------------------------------------------------- storages and tensors


@dataclass(frozen=True)
class _StorageType:
    """What a ``torch.<X>Storage`` global stands for in a persistent id: the element dtype (None: untyped bytes)."""

    dtype: torch.dtype | None


@dataclass(frozen=True)
class _Stored:
    """One storage record: its bytes (a storage sharing the file's mapped or read bytes), how many, as what dtype.

    ``storage`` is None when the archive is only located (:func:`locate_tensor`): then a tensor
    becomes a :class:`TensorAt`, ``start`` (the record's byte offset in the archive) saying where.
    """

    storage: torch.UntypedStorage | None  # exactly the record's claimed bytes
    nbytes: int
    dtype: torch.dtype | None
    key: str
    start: int = 0


@dataclass(frozen=True)
class TensorAt:
    """Where a contiguous tensor of a ``torch.save`` archive lies, found without reading its bytes:
    its dtype and shape, the archive offset of its first byte, and its record ``(start, length, crc32)``."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    key: str
    record: tuple[int, int, int] = (0, 0, 0)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# The typed storages torch.save names (one per classic dtype); newer dtypes come as untyped bytes + a dtype (v3).
_STORAGE_TYPES = {
    "torch.DoubleStorage": _StorageType(torch.float64),
    "torch.FloatStorage": _StorageType(torch.float32),
    "torch.HalfStorage": _StorageType(torch.float16),
    "torch.BFloat16Storage": _StorageType(torch.bfloat16),
    "torch.LongStorage": _StorageType(torch.int64),
    "torch.IntStorage": _StorageType(torch.int32),
    "torch.ShortStorage": _StorageType(torch.int16),
    "torch.CharStorage": _StorageType(torch.int8),
    "torch.ByteStorage": _StorageType(torch.uint8),
    "torch.BoolStorage": _StorageType(torch.bool),
    "torch.ComplexDoubleStorage": _StorageType(torch.complex128),
    "torch.ComplexFloatStorage": _StorageType(torch.complex64),
    "torch.storage.UntypedStorage": _StorageType(None),
}
_QUANTIZED = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}
_DTYPES = {
    str(d).split(".", 1)[1]: d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d not in _QUANTIZED and d.itemsize >= 1
}
_TENSOR_TYPE = object()  # what the `torch.Tensor` global stands for (only as _rebuild_from_type_v2's type)


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise FormatError(f"{what} is a {type(value).__name__}, not an integer")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > MAX_DIMS:
        raise FormatError(f"{what} is not a tuple of at most {MAX_DIMS} integers")
    return tuple(_int(d, what) for d in value)


def _tensor(
    stored: Any, offset: Any, size: Any, stride: Any, hooks: Any, metadata: Any, dtype: torch.dtype | None
) -> torch.Tensor | TensorAt:
    """A contiguous view of a storage record's bytes, after checking that it lies wholly inside the record
    (a :class:`TensorAt` saying where, when the archive is only located)."""
    if not isinstance(stored, _Stored):
        raise FormatError(f"a tensor whose storage is a {type(stored).__name__}, not a storage record")
    dtype = dtype or stored.dtype
    if dtype is None or dtype not in _DTYPES.values():
        raise FormatError(f"storage {stored.key}: a tensor of no dtype this reader knows")
    offset = _int(offset, f"storage {stored.key}: the storage offset")
    shape, strides = _dims(size, f"storage {stored.key}: the size"), _dims(stride, f"storage {stored.key}: the stride")
    if len(shape) != len(strides) or offset < 0 or any(d < 0 for d in shape) or any(s < 0 for s in strides):
        raise FormatError(
            f"storage {stored.key}: negative or mismatched size {list(shape)}, stride {list(strides)}, offset {offset}"
        )
    if not all(x is None or (isinstance(x, dict) and not x) for x in (hooks, metadata)):
        raise FormatError(f"storage {stored.key}: a tensor with backward hooks or metadata")
    count = math.prod(shape)
    expected = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        if d > 1 and s != expected:
            raise FormatError(
                f"storage {stored.key}: size {list(shape)} with stride {list(strides)} is not a contiguous tensor "
                "(a broadcast, strided or overlapping view); only contiguous tensors are read"
            )
        expected *= d
    itemsize = dtype.itemsize
    if (offset + count) * itemsize > stored.nbytes:
        raise FormatError(
            f"storage {stored.key}: a tensor of {count} {dtype} elements at offset {offset} extends past its "
            f"{stored.nbytes}-byte record"
        )
    if stored.storage is None:
        return TensorAt(dtype, shape, stored.start + offset * itemsize, stored.key)
    if stored.storage.data_ptr() % itemsize:
        raise FormatError(f"storage {stored.key}: its bytes are not aligned to its {itemsize}-byte elements")
    return torch.empty(0, dtype=dtype).set_(stored.storage, offset, shape, strides)


def _rebuild_tensor_v2(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None
) -> torch.Tensor | TensorAt:
    """``torch._utils._rebuild_tensor_v2``, checked (the tensor's dtype is its storage's; requires_grad is dropped: data
    only)."""
    if not isinstance(requires_grad, bool):
        raise FormatError("a tensor whose requires_grad is not a bool")
    return _tensor(storage, offset, size, stride, hooks, metadata, None)


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, metadata: Any = None
) -> torch.Tensor | TensorAt:
    """``torch._utils._rebuild_tensor_v3`` (newer dtypes over untyped storage), checked."""
    if not isinstance(requires_grad, bool) or not isinstance(dtype, torch.dtype):
        raise FormatError("a tensor whose requires_grad or dtype is malformed")
    return _tensor(storage, offset, size, stride, hooks, metadata, dtype)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> torch.Tensor | TensorAt:
    """``torch._tensor._rebuild_from_type_v2`` for a plain tensor carrying attributes (DeepSpeed's ``ds_id``): the
    attributes are dropped."""
    if (
        func not in (_rebuild_tensor_v2, _rebuild_tensor_v3)
        or new_type is not _TENSOR_TYPE
        or not isinstance(args, tuple)
    ):
        raise FormatError("a tensor rebuilt by anything but torch's own tensor rebuild")
    if state is not None and not (isinstance(state, dict) and all(isinstance(k, str) for k in state)):
        raise FormatError("a tensor whose attributes are not a dict")
    return func(*args)  # type: ignore[no-any-return]


class _StateDict(OrderedDict[Any, Any]):
    """The OrderedDict a pickle builds; ``BUILD`` may give it only a module state dict's ``_metadata``, which is
    dropped.

    (Attributes set on a dict would shadow its methods: ``d.items`` could become a value of the file.)
    """

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) - {"_metadata"}:
            raise FormatError("an OrderedDict with attributes other than a state dict's _metadata")

    def __reduce__(self) -> Any:  # pickled again (torch.save of a loaded state) as the plain OrderedDict it stands for
        return (OrderedDict, (), None, None, iter(self.items()))


def _ordered_dict(*args: Any) -> OrderedDict[Any, Any]:
    if args:
        raise FormatError("an OrderedDict built from arguments (torch.save fills it item by item)")
    return _StateDict()


def _size(*args: Any) -> torch.Size:
    if len(args) != 1:
        raise FormatError("a torch.Size of more than one argument")
    value = args[0]
    return torch.Size(_dims(tuple(value) if isinstance(value, list) else value, "a torch.Size"))


# Every global a checkpoint pickle may name, by what it may do (see GlobalRules), and what it stands for here.
_CALLABLES: dict[str, Callable[..., Any]] = {
    "collections.OrderedDict": _ordered_dict,
    "torch.Size": _size,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
}
_CLASSES: dict[str, type] = {name: cls for cls, name in STAND_INS if cls is not ZeroStage}
_VALUES: dict[str, Any] = {
    **_STORAGE_TYPES,
    **{f"torch.{name}": d for name, d in _DTYPES.items()},
    "torch.Tensor": _TENSOR_TYPE,
}
GLOBALS: dict[str, Any] = {**_VALUES, **_CALLABLES, **_CLASSES}
RULES = GlobalRules(values=frozenset(_VALUES), callables=frozenset(_CALLABLES), classes=frozenset(_CLASSES))


# ----------------------------------------------------------------------------- the archive


@dataclass(frozen=True)
class LoadedFile:
    """An unpickled checkpoint file: its value, and where its tensors' bytes are mapped (None: read into memory)."""

    path: Path
    value: Any
    mapping: FileMapping | None


def load_pt(path: str | os.PathLike[str], *, mmap: bool = True) -> Any:
    """Unpickle a ``torch.save`` file of a DeepSpeed checkpoint without running code from it (see the module
    docstring)."""
    return load_file(Path(path), mmap).value


def load_file(path: Path, mmap: bool = True) -> LoadedFile:
    """Read ``path`` as described in the module docstring; :class:`FormatError` naming it on anything outside what it
    accepts."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing") from None
    except OSError as exc:
        if os.path.islink(path):
            raise FormatError(f"{path}: is a symbolic link; checkpoint files must be regular files") from None
        raise FormatError(f"{path}: cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FormatError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        return _load(path, fd, info.st_size, mmap)
    except OSError as exc:  # a seek or read the zip directory sends astray, an I/O error
        raise FormatError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    finally:
        os.close(fd)


def _load(path: Path, fd: int, size: int, use_mmap: bool) -> LoadedFile:
    where = str(path)
    with open(fd, "rb", closefd=False) as f:
        if f.read(4) != b"PK\x03\x04":
            raise FormatError(
                f"{path}: not in torch's zip format (torch.save writes it since torch 1.6; DeepSpeed with "
                "checkpoint_serialization "
                "false writes the legacy format, which this reader does not read): save it again with serialization on"
            )
        pickle_at, pickle_info, records = _archive(path, f, size)
        if pickle_info.file_size > pickle_scan.MAX_PICKLE_BYTES:  # before reading it
            raise FormatError(
                f"{path}: a pickle of {pickle_info.file_size} bytes is more than the {pickle_scan.MAX_PICKLE_BYTES} "
                "allowed"
            )
        f.seek(pickle_at)
        data = f.read(pickle_info.file_size)
    if len(data) != pickle_info.file_size or zlib.crc32(data) != pickle_info.CRC:
        raise FormatError(f"{path}: data.pkl is damaged (its CRC does not match)")
    scan_pickle(data, where, RULES)
    if use_mmap:
        mapped: Any = mmap_module.mmap(
            fd, size, flags=mmap_module.MAP_PRIVATE, prot=mmap_module.PROT_READ | mmap_module.PROT_WRITE
        )
    else:
        with open(fd, "rb", closefd=False) as f:
            f.seek(0)
            mapped = bytearray(f.read(size))
        if len(mapped) != size:
            raise FormatError(f"{path}: changed size while it was read")
    base = torch.frombuffer(mapped, dtype=torch.uint8)
    value = _unpickle(where, data, base, records)
    mapping = FileMapping(where, base.data_ptr(), size) if use_mmap else None
    return LoadedFile(path, value, mapping)


def _checked_pickle(where: str, f: Any, size: int) -> tuple[bytes, dict[str, tuple[int, int, int]]]:
    """The scanned pickle of the archive ``f`` (``size`` bytes, positioned anywhere) and its records, every size checked
    first."""
    f.seek(0)
    if f.read(4) != b"PK\x03\x04":
        raise FormatError(f"{where}: not in torch's zip format")
    try:
        pickle_at, pickle_info, records = _archive(where, f, size)
        if pickle_info.file_size > pickle_scan.MAX_PICKLE_BYTES:
            raise FormatError(
                f"{where}: a pickle of {pickle_info.file_size} bytes is more than the {pickle_scan.MAX_PICKLE_BYTES} "
                "allowed"
            )
        f.seek(pickle_at)
        data = f.read(pickle_info.file_size)
    except OSError as exc:
        raise FormatError(f"{where}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) != pickle_info.file_size or zlib.crc32(data) != pickle_info.CRC:
        raise FormatError(f"{where}: data.pkl is damaged (its CRC does not match)")
    scan_pickle(data, where, RULES)
    return data, records


def load_bytes(buffer: bytearray, where: str) -> Any:
    """A ``torch.save`` archive held in memory (a DCP item's bytes), read as :func:`load_file` reads a file; its tensors
    are views of ``buffer``."""
    data, records = _checked_pickle(where, io.BytesIO(buffer), len(buffer))
    return _unpickle(
        where,
        data,
        torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8),
        records,
    )


def locate_tensor(f: Any, size: int, where: str) -> TensorAt:
    """Where the one tensor of the ``torch.save`` archive ``f`` (``size`` bytes: a DCP item) lies, without reading its
    bytes.

    Only the zip directory, the local headers and the pickle are read, each checked as
    :func:`load_file` checks them; the tensor must be contiguous and lie inside its record, which
    lies inside the archive. The record's CRC-32 comes along, for a caller that reads it whole.
    """
    data, records = _checked_pickle(where, f, size)
    value = _unpickle(where, data, None, records)
    if not isinstance(value, TensorAt):
        raise FormatError(f"{where}: holds a {type(value).__name__}, not one tensor")
    return replace(value, record=records[value.key])


def _unpickle(where: str, data: bytes, base: torch.Tensor | None, records: dict[str, tuple[int, int, int]]) -> Any:
    """The scanned pickle ``data`` unpickled, its storages views of ``base`` (the archive's bytes; None: tensors only
    located, as :class:`TensorAt`), its value graph checked."""
    seen: dict[str, _Stored] = {}

    def storage(pid: Any) -> _Stored:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise FormatError("refused pickle: a persistent id that is not a torch storage")
        _, kind, key, location, count = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str) or not _KEY.match(key):
            raise FormatError("refused pickle: a storage id with an unknown storage type or key")
        if not isinstance(location, str) or not _DEVICE.match(location):
            raise FormatError(
                f"storage {key}: on device {location!r:.40}; only storages holding their bytes in the file are read"
            )
        itemsize = kind.dtype.itemsize if kind.dtype is not None else 1
        nbytes = _int(count, f"storage {key}: the element count") * itemsize
        if key not in records:
            raise FormatError(f"storage {key}: no record data/{key} in the archive")
        start, length, _ = records[key]
        if not 0 <= nbytes <= length:
            raise FormatError(f"storage {key}: claims {nbytes} bytes; its record holds {length}")
        if key not in seen:
            view = None if base is None else base.untyped_storage()[start : start + nbytes]
            seen[key] = _Stored(view, nbytes, kind.dtype, key, start)
        elif (seen[key].nbytes, seen[key].dtype) != (nbytes, kind.dtype):
            raise FormatError(f"storage {key}: named twice with different types or sizes")
        return seen[key]

    try:
        value = RestrictedUnpickler(data, GLOBALS, storage).load()
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    # the unpickler on values the scan let through but that do not fit together (TypeError, ...)
    except Exception as exc:
        raise FormatError(f"{where}: refused or unreadable ({type(exc).__name__}: {str(exc)[:200]})") from None
    check_value_graph(value, where, _CONTAINERS)
    return value


def _archive(path: Path | str, f: Any, size: int) -> tuple[int, zipfile.ZipInfo, dict[str, tuple[int, int, int]]]:
    """(byte offset of data.pkl, its entry, storage key -> (byte offset, size, CRC-32) of its record), all checked to
    lie in the file."""
    try:
        entries = zipfile.ZipFile(f).infolist()
    except Exception as exc:  # zipfile on a damaged directory: BadZipFile, ValueError, struct.error, ...
        raise FormatError(f"{path}: not a readable zip archive ({type(exc).__name__})") from None
    if len(entries) > MAX_RECORDS:
        raise FormatError(f"{path}: {len(entries)} archive entries is more than the {MAX_RECORDS} allowed")
    names = [e.filename for e in entries]
    prefix = names[0].split("/", 1)[0] if names else ""
    if (
        len(set(names)) != len(names)
        or not all(n.startswith(prefix + "/") for n in names)
        or f"{prefix}/data.pkl" not in names
    ):
        raise FormatError(f"{path}: not a torch.save archive (one folder holding data.pkl, no duplicate names)")
    offsets: dict[str, int] = {}
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.flag_bits & 1 or entry.file_size != entry.compress_size:
            raise FormatError(
                f"{path}: archive entry {entry.filename[:120]!r} is compressed or encrypted; torch.save stores entries "
                "as they are"
            )
        if not 0 <= entry.header_offset <= size - _LOCAL_HEADER.size:
            raise FormatError(f"{path}: archive entry {entry.filename[:120]!r} lies past the end of the file")
        f.seek(entry.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            raise FormatError(f"{path}: archive entry {entry.filename[:120]!r} lies past the end of the file")
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        start = entry.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if signature != b"PK\x03\x04" or f.read(name_length) != entry.filename.encode(
            "utf-8" if entry.flag_bits & 0x800 else "cp437"
        ):
            raise FormatError(f"{path}: archive entry {entry.filename[:120]!r} does not match its local header")
        if start + entry.file_size > size:
            raise FormatError(f"{path}: archive entry {entry.filename[:120]!r} extends past the end of the file")
        offsets[entry.filename] = start
    byteorder = next((e for e in entries if e.filename == f"{prefix}/byteorder"), None)
    if byteorder is not None:
        f.seek(offsets[byteorder.filename])
        if f.read(min(byteorder.file_size, 16)) != b"little":
            raise FormatError(f"{path}: saved on a big-endian machine; only little-endian files are read")
    records = {
        e.filename[len(prefix) + 6 :]: (offsets[e.filename], e.file_size, e.CRC)
        for e in entries
        if e.filename.startswith(f"{prefix}/data/")
    }
    pickle_info = next(e for e in entries if e.filename == f"{prefix}/data.pkl")
    return offsets[pickle_info.filename], pickle_info, records
