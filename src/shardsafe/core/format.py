"""The on-disk format: one module owns the schema.

A checkpoint is a folder holding

* ``manifest.json`` - written last by the coordinator; its presence is the commit marker;
* ``state.json`` - the non-tensor part of the saved state (JSON, tensors replaced by references);
* ``shard-RRRRR.safetensors`` - one per rank that had data to write, in the safetensors layout
  (8-byte little-endian header length, JSON header, raw little-endian tensor bytes).

See docs/FORMAT.md for the prose version. Every parser here validates before it trusts: names
must be single safe path components, sizes are bounded and cross-checked, JSON has no duplicate
keys and bounded depth.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsafe.core.integrity import HASH_ALGORITHM, HASH_BLOCK_SIZE, num_blocks
from shardsafe.errors import FormatError

FORMAT_NAME = "shardsafe"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.json"
SHARD_PATTERN = "shard-{rank:05d}.safetensors"

MAX_JSON_BYTES = 1 << 30
MAX_HEADER_BYTES = 256 << 20
MAX_NUMEL = 1 << 48
MAX_DIMS = 16
MAX_JSON_DEPTH = 64

# torch dtype <-> (manifest name, safetensors name)
_DTYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.float64: ("float64", "F64"),
    torch.float32: ("float32", "F32"),
    torch.float16: ("float16", "F16"),
    torch.bfloat16: ("bfloat16", "BF16"),
    torch.int64: ("int64", "I64"),
    torch.int32: ("int32", "I32"),
    torch.int16: ("int16", "I16"),
    torch.int8: ("int8", "I8"),
    torch.uint8: ("uint8", "U8"),
    torch.bool: ("bool", "BOOL"),
    torch.float8_e4m3fn: ("float8_e4m3fn", "F8_E4M3"),
    torch.float8_e5m2: ("float8_e5m2", "F8_E5M2"),
    torch.uint16: ("uint16", "U16"),
    torch.uint32: ("uint32", "U32"),
    torch.uint64: ("uint64", "U64"),
    torch.complex64: ("complex64", "C64"),
}
_BY_NAME = {name: dtype for dtype, (name, _) in _DTYPES.items()}
_BY_ST_NAME = {st: dtype for dtype, (_, st) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        raise FormatError(f"dtype {dtype} cannot be stored by shardsafe") from None


def dtype_from_name(name: object, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _BY_NAME:
        raise FormatError(f"{where}: unknown dtype {name!r}")
    return _BY_NAME[name]


def safetensors_dtype(dtype: torch.dtype) -> str:
    return _DTYPES[dtype][1]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_component(name: object, where: str) -> str:
    """A file or folder name that cannot leave its folder: one component, no '..', no '/'."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name.startswith("~")
        or len(name) > 255
    ):
        raise FormatError(f"{where}: unsafe or invalid file name {name!r}")
    return name


def _int_list(value: object, where: str, *, max_len: int = MAX_DIMS) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > max_len:
        raise FormatError(f"{where}: expected a list of at most {max_len} integers, got {value!r:.80}")
    out = []
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise FormatError(f"{where}: expected non-negative integers, got {v!r:.40}")
        out.append(v)
    return tuple(out)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# ----------------------------------------------------------------------------- JSON safety


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"duplicate JSON key {key!r}")
        out[key] = value
    return out


def _check_depth(value: Any, where: str) -> None:
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise FormatError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def parse_json(data: bytes, where: str) -> Any:
    """Parse untrusted JSON: bounded size and depth, no duplicate keys."""
    if len(data) > MAX_JSON_BYTES:
        raise FormatError(f"{where}: {len(data)} bytes of JSON is more than the {MAX_JSON_BYTES} allowed")
    try:
        value = json.loads(data, object_pairs_hook=_reject_duplicates)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{where}: not valid JSON ({exc})") from None
    _check_depth(value, where)
    return value


def dump_json(value: Any) -> bytes:
    return json.dumps(value, indent=1, sort_keys=False).encode()


# ----------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class ChunkEntry:
    """One stored piece of a tensor: where it sits in the global tensor and in which file."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    begin: int
    end: int
    hashes: tuple[str, ...]
    checkpoint: str | None = None  # a sibling checkpoint of the same root holding ``file``

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "file": self.file,
            "begin": self.begin,
            "end": self.end,
            "hashes": list(self.hashes),
        }
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        return out


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * element_size(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "chunks": [c.to_json() for c in self.chunks],
        }


@dataclass(frozen=True)
class FileEntry:
    size: int
    rank: int


@dataclass
class Manifest:
    world_size: int
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    state_size: int
    state_hash: str
    metadata: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    writer_version: str = ""
    hash_algorithm: str = HASH_ALGORITHM
    hash_block_size: int = HASH_BLOCK_SIZE
    format_version: int = FORMAT_VERSION
    state_file: str = STATE_NAME

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "writer_version": self.writer_version,
            "created": self.created,
            "world_size": self.world_size,
            "hash_algorithm": self.hash_algorithm,
            "hash_block_size": self.hash_block_size,
            "state": {"file": self.state_file, "size": self.state_size, "hash": self.state_hash},
            "files": {name: {"size": f.size, "rank": f.rank} for name, f in sorted(self.files.items())},
            "metadata": self.metadata,
            "tensors": {key: t.to_json() for key, t in self.tensors.items()},
        }

    def to_bytes(self) -> bytes:
        return dump_json(self.to_json())


def _expect(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise FormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FormatError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _parse_chunk(raw: Any, key: str, dtype: torch.dtype, shape: tuple[int, ...], files: dict[str, FileEntry], block: int) -> ChunkEntry:
    where = f"manifest tensor {key!r}"
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: chunk is not an object")
    offsets = _int_list(_expect(raw, "offsets", list, where), where)
    cshape = _int_list(_expect(raw, "shape", list, where), where)
    if len(offsets) != len(shape) or len(cshape) != len(shape):
        raise FormatError(f"{where}: chunk rank does not match tensor shape {list(shape)}")
    for o, s, g in zip(offsets, cshape, shape):
        if o + s > g:
            raise FormatError(f"{where}: chunk at {list(offsets)} of shape {list(cshape)} lies outside {list(shape)}")
    file = check_component(_expect(raw, "file", str, where), where)
    checkpoint = raw.get("checkpoint")
    if checkpoint is not None:
        check_component(checkpoint, where)
    begin = _expect(raw, "begin", int, where)
    end = _expect(raw, "end", int, where)
    nbytes = numel(cshape) * element_size(dtype)
    if begin < 0 or end - begin != nbytes:
        raise FormatError(f"{where}: byte range [{begin}, {end}) does not hold {nbytes} bytes")
    if checkpoint is None:
        if file not in files:
            raise FormatError(f"{where}: chunk refers to unlisted file {file!r}")
        if end > files[file].size:
            raise FormatError(f"{where}: byte range [{begin}, {end}) runs past the end of {file} ({files[file].size} bytes)")
    hashes = _expect(raw, "hashes", list, where)
    if len(hashes) != num_blocks(nbytes, block) or not all(isinstance(h, str) and len(h) <= 64 for h in hashes):
        raise FormatError(f"{where}: expected {num_blocks(nbytes, block)} block hashes")
    return ChunkEntry(offsets, cshape, file, begin, end, tuple(hashes), checkpoint)


MAX_OVERLAP_CHECKS = 1 << 22  # box comparisons per tensor; real tilings need about n * sqrt(n) at most


def _check_coverage(key: str, shape: tuple[int, ...], chunks: list[ChunkEntry]) -> None:
    """Chunks must tile the tensor: no two overlap and their total volume is numel.

    Boxes inside the tensor with the right total volume and no overlap cover it exactly, so no
    element can be left unread (keeping whatever the destination held). Overlaps are found with a
    sweep along the dimension whose chunk starts vary most, which compares few pairs for any real
    sharding; a manifest that would need more than ``MAX_OVERLAP_CHECKS`` comparisons is refused.
    """
    total = sum(numel(c.shape) for c in chunks)
    if total != numel(shape):
        raise FormatError(f"manifest tensor {key!r}: chunks hold {total} elements, shape {list(shape)} needs {numel(shape)}")
    boxes = [c for c in chunks if numel(c.shape)]
    if len(boxes) < 2 or not shape:
        return
    dim = max(range(len(shape)), key=lambda d: len({c.offsets[d] for c in boxes}))
    boxes.sort(key=lambda c: c.offsets[dim])
    active: list[ChunkEntry] = []
    budget = MAX_OVERLAP_CHECKS
    for b in boxes:
        start = b.offsets[dim]
        active = [a for a in active if a.offsets[dim] + a.shape[dim] > start]
        budget -= len(active)
        if budget < 0:
            raise FormatError(f"manifest tensor {key!r}: {len(chunks)} chunks are too many to check for overlaps")
        for a in active:
            if box_overlap(a.offsets, a.shape, b.offsets, b.shape) is not None:
                raise FormatError(f"manifest tensor {key!r}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap")
        active.append(b)


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    raw = parse_json(data, where)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a shardsafe manifest")
    version = _expect(raw, "format_version", int, where)
    if version > FORMAT_VERSION:
        raise FormatError(f"{where}: format version {version} is newer than this shardsafe understands ({FORMAT_VERSION}); upgrade shardsafe")
    algorithm = _expect(raw, "hash_algorithm", str, where)
    if algorithm != HASH_ALGORITHM:
        raise FormatError(f"{where}: unknown hash algorithm {algorithm!r}")
    block = _expect(raw, "hash_block_size", int, where)
    if block < 4096:
        raise FormatError(f"{where}: hash block size {block} is too small")
    world_size = _expect(raw, "world_size", int, where)
    if world_size < 1:
        raise FormatError(f"{where}: world size {world_size} is invalid")
    files: dict[str, FileEntry] = {}
    for name, entry in _expect(raw, "files", dict, where).items():
        check_component(name, where)
        size = _expect(entry, "size", int, f"{where} file {name!r}")
        rank = _expect(entry, "rank", int, f"{where} file {name!r}")
        if size < 0:
            raise FormatError(f"{where}: file {name!r} has a negative size")
        files[name] = FileEntry(size, rank)
    state = _expect(raw, "state", dict, where)
    state_file = check_component(state.get("file"), where)
    if not (state_file.startswith("state") and state_file.endswith(".json")):
        raise FormatError(f"{where}: state file {state_file!r} must be named state*.json")
    state_size = _expect(state, "size", int, where)
    if not 0 <= state_size <= MAX_JSON_BYTES:
        raise FormatError(f"{where}: state size {state_size} is out of range")
    tensors: dict[str, TensorEntry] = {}
    for key, entry in _expect(raw, "tensors", dict, where).items():
        twhere = f"{where} tensor {key!r}"
        dtype = dtype_from_name(_expect(entry, "dtype", str, twhere), twhere)
        shape = _int_list(_expect(entry, "shape", list, twhere), twhere)
        if numel(shape) > MAX_NUMEL:
            raise FormatError(f"{twhere}: shape {list(shape)} is absurdly large")
        chunks = [_parse_chunk(c, key, dtype, shape, files, block) for c in _expect(entry, "chunks", list, twhere)]
        _check_coverage(key, shape, chunks)
        tensors[key] = TensorEntry(dtype, shape, tuple(chunks))
    metadata = raw.get("metadata", {})
    if not isinstance(metadata, dict):
        raise FormatError(f"{where}: metadata must be an object")
    created = raw.get("created", 0.0)
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise FormatError(f"{where}: field 'created' has the wrong type ({type(created).__name__})")
    return Manifest(
        world_size=world_size,
        tensors=tensors,
        files=files,
        state_size=state_size,
        state_hash=str(_expect(state, "hash", str, where)),
        metadata=metadata,
        created=float(created),
        writer_version=str(raw.get("writer_version", "")),
        hash_algorithm=algorithm,
        hash_block_size=block,
        format_version=version,
        state_file=state_file,
    )


def box_overlap(
    a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...], b_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Intersection of two boxes as (offsets, shape), or None when they do not meet."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + sa, b + sb) for a, sa, b, sb in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


# ----------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def build_safetensors_header(entries: list[HeaderEntry]) -> tuple[bytes, list[tuple[int, int]]]:
    """The file prefix (length + JSON header) and each entry's absolute byte range.

    Shapes are known before any byte is written, so the header is computed up front and tensor
    bytes can be streamed straight after it.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "shardsafe"}}
    relative: list[tuple[int, int]] = []
    pos = 0
    for e in entries:
        size = numel(e.shape) * element_size(e.dtype)
        header[e.name] = {"dtype": safetensors_dtype(e.dtype), "shape": list(e.shape), "data_offsets": [pos, pos + size]}
        relative.append((pos, pos + size))
        pos += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    prefix = struct.pack("<Q", len(body)) + body
    return prefix, [(len(prefix) + b, len(prefix) + e) for b, e in relative]


def parse_safetensors_header(head: bytes, file_size: int, where: str) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """Validate a safetensors header; returns name -> (dtype, shape, absolute begin, absolute end).

    ``head`` must start at byte 0 and hold at least the 8-byte length plus the header.
    """
    if len(head) < 8:
        raise FormatError(f"{where}: file too short for a safetensors header")
    (length,) = struct.unpack("<Q", head[:8])
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise FormatError(f"{where}: header length {length} is larger than the file ({file_size} bytes)")
    if len(head) < 8 + length:
        raise FormatError(f"{where}: header truncated")
    raw = parse_json(head[8 : 8 + length], where)
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: header is not an object")
    out = {}
    base = 8 + length
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        ewhere = f"{where} entry {name!r}"
        st = _expect(entry, "dtype", str, ewhere)
        if st not in _BY_ST_NAME:
            raise FormatError(f"{ewhere}: unknown dtype {st!r}")
        dtype = _BY_ST_NAME[st]
        shape = _int_list(_expect(entry, "shape", list, ewhere), ewhere)
        offsets = _int_list(_expect(entry, "data_offsets", list, ewhere), ewhere, max_len=2)
        if len(offsets) != 2:
            raise FormatError(f"{ewhere}: data_offsets must be [begin, end]")
        begin, end = offsets
        if end - begin != numel(shape) * element_size(dtype) or base + end > file_size:
            raise FormatError(f"{ewhere}: data offsets [{begin}, {end}) do not fit its shape or the file")
        out[name] = (dtype, shape, base + begin, base + end)
    return out


# ----------------------------------------------------------------------------- state tree

TENSOR_REF = "__tensor__"
TUPLE_TAG = "__tuple__"
PAIRS_TAG = "__pairs__"
DTYPE_TAG = "__dtype__"
_TAGS = (TENSOR_REF, TUPLE_TAG, PAIRS_TAG, DTYPE_TAG)


def encode_value(value: Any, path: str, tensor_ref: Any) -> Any:
    """Turn a nested Python value into JSON; ``tensor_ref(path, tensor)`` returns a tensor's key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {TENSOR_REF: tensor_ref(path, value)}
    if isinstance(value, torch.dtype):
        return {DTYPE_TAG: dtype_name(value)}
    if isinstance(value, (tuple, torch.Size)):
        return {TUPLE_TAG: [encode_value(v, f"{path}/{i}", tensor_ref) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{path}/{i}", tensor_ref) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(t in value for t in _TAGS):
            return {k: encode_value(v, f"{path}/{k}", tensor_ref) for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise FormatError(f"state value at {path!r}: dict key {k!r} of type {type(k).__name__} cannot be stored")
            pairs.append([k, encode_value(v, f"{path}/{k}", tensor_ref)])
        return {PAIRS_TAG: pairs}
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "shape", None) == ():
        return value.item()  # numpy scalar
    raise FormatError(
        f"state value at {path!r} has type {type(value).__name__}, which shardsafe cannot store without pickle; "
        "convert it to tensors, numbers, strings, lists or dicts"
    )


def decode_value(value: Any, tensor_lookup: Any, where: str = STATE_NAME) -> Any:
    """Inverse of :func:`encode_value`; ``tensor_lookup(key)`` returns the loaded tensor."""
    if isinstance(value, list):
        return [decode_value(v, tensor_lookup, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == TENSOR_REF:
            if not isinstance(inner, str):
                raise FormatError(f"{where}: bad tensor reference {inner!r:.60}")
            return tensor_lookup(inner)
        if tag == TUPLE_TAG and isinstance(inner, list):
            return tuple(decode_value(v, tensor_lookup, where) for v in inner)
        if tag == DTYPE_TAG:
            return dtype_from_name(inner, where)
        if tag == PAIRS_TAG and isinstance(inner, list):
            out = {}
            for pair in inner:
                if not isinstance(pair, list) or len(pair) != 2 or not (pair[0] is None or isinstance(pair[0], (str, int, float))):
                    raise FormatError(f"{where}: bad key/value pair {pair!r:.60}")
                out[pair[0]] = decode_value(pair[1], tensor_lookup, where)
            return out
    return {k: decode_value(v, tensor_lookup, where) for k, v in value.items()}
