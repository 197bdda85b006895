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

from shardsafe.core.dtypes import dtype_from_name, dtype_from_safetensors_name, dtype_name, element_size, safetensors_dtype
from shardsafe.core.integrity import HASH_ALGORITHM, HASH_BLOCK_SIZE, num_blocks
from shardsafe.core.jsonsafe import MAX_JSON_BYTES, check_plain_json, dump_json, parse_json
from shardsafe.errors import FormatError

FORMAT_NAME = "shardsafe"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# A retired checkpoint whose files later checkpoints still store tensors in (dedup) keeps its
# manifest under this name: no longer a checkpoint, but readers can check a reference against it.
RETAINED_MANIFEST_NAME = "manifest.retained.json"
STATE_NAME = "state.json"
SHARD_PATTERN = "shard-{rank:05d}.safetensors"

MAX_HEADER_BYTES = 256 << 20
MAX_NUMEL = 1 << 48
MAX_DIMS = 16
MIN_HASH_BLOCK_SIZE = 4 << 10
MAX_HASH_BLOCK_SIZE = 1 << 30
RESERVED_HEADER_NAME = "__metadata__"


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


def check_tensor_key(key: object, where: str) -> str:
    """A tensor key every reader can use: a non-empty string that is valid UTF-8 (a lone surrogate
    makes a safetensors header other readers refuse) and not the safetensors metadata name."""
    if not isinstance(key, str) or not key or key == RESERVED_HEADER_NAME:
        raise FormatError(f"{where}: invalid tensor key {key!r:.80}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(f"{where}: tensor key {key!r:.80} is not valid UTF-8 (a lone surrogate?)") from None
    return key


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
        if checkpoint.startswith("."):  # hidden temporaries and retired folders are never committed siblings
            raise FormatError(f"{where}: chunk refers to hidden folder {checkpoint!r}, not a committed sibling checkpoint")
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


def _check_disjoint_ranges(tensors: dict[str, TensorEntry], where: str) -> None:
    """No two chunks share a byte of a file (as every writer lays them out). Without this, 10,000
    tensor entries could name the same bytes and make a reader allocate 10,000 copies of them:
    with it, what the chunks hold adds up to at most the bytes of the files they lie in."""
    by_file: dict[tuple[str | None, str], list[tuple[int, int, str]]] = {}
    for key, entry in tensors.items():
        for c in entry.chunks:
            if c.end > c.begin:
                by_file.setdefault((c.checkpoint, c.file), []).append((c.begin, c.end, key))
    for (checkpoint, file), ranges in by_file.items():
        ranges.sort()
        for (_, end, key), (begin, _, other) in zip(ranges, ranges[1:]):
            if begin < end:
                shown = f"{checkpoint}/{file}" if checkpoint is not None else file
                raise FormatError(f"{where}: tensors {key!r:.100} and {other!r:.100} claim the same bytes of {shown} (from {begin})")


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    raw = parse_json(data, where)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a shardsafe manifest")
    version = _expect(raw, "format_version", int, where)
    if version > FORMAT_VERSION:
        raise FormatError(f"{where}: format version {version} is newer than this shardsafe understands ({FORMAT_VERSION}); upgrade shardsafe")
    algorithm = _expect(raw, "hash_algorithm", str, where)
    if algorithm != HASH_ALGORITHM:
        raise FormatError(f"{where}: unknown hash algorithm (a {len(algorithm)}-character string; expected {HASH_ALGORITHM})")
    block = _expect(raw, "hash_block_size", int, where)
    if not MIN_HASH_BLOCK_SIZE <= block <= MAX_HASH_BLOCK_SIZE or block & (block - 1):
        raise FormatError(f"{where}: hash block size {block} is not a power of two between {MIN_HASH_BLOCK_SIZE} and {MAX_HASH_BLOCK_SIZE}")
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
        twhere = f"{where} tensor {key!r:.200}"
        check_tensor_key(key, where)
        dtype = dtype_from_name(_expect(entry, "dtype", str, twhere), twhere)
        shape = _int_list(_expect(entry, "shape", list, twhere), twhere)
        if numel(shape) > MAX_NUMEL:
            raise FormatError(f"{twhere}: shape {list(shape)} is absurdly large")
        chunks = [_parse_chunk(c, key, dtype, shape, files, block) for c in _expect(entry, "chunks", list, twhere)]
        _check_coverage(key, shape, chunks)
        tensors[key] = TensorEntry(dtype, shape, tuple(chunks))
    _check_disjoint_ranges(tensors, where)
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
    header: dict[str, Any] = {RESERVED_HEADER_NAME: {"format": "pt", "writer": "shardsafe"}}
    relative: list[tuple[int, int]] = []
    pos = 0
    for e in entries:
        if e.name in header:  # a second entry would silently replace the first: its bytes unlisted
            raise FormatError(f"safetensors header: two entries named {e.name!r:.100} (a tensor key containing '@'?), or the reserved name")
        size = numel(e.shape) * element_size(e.dtype)
        header[e.name] = {"dtype": safetensors_dtype(e.dtype), "shape": list(e.shape), "data_offsets": [pos, pos + size]}
        relative.append((pos, pos + size))
        pos += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    if len(body) > MAX_HEADER_BYTES:
        raise FormatError(f"safetensors header: {len(body)} bytes for {len(entries)} entries is more than the {MAX_HEADER_BYTES} readers accept")
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
        if name == RESERVED_HEADER_NAME:
            continue
        ewhere = f"{where} entry {name!r}"
        dtype = dtype_from_safetensors_name(_expect(entry, "dtype", str, ewhere), ewhere)
        shape = _int_list(_expect(entry, "shape", list, ewhere), ewhere)
        offsets = _int_list(_expect(entry, "data_offsets", list, ewhere), ewhere, max_len=2)
        if len(offsets) != 2:
            raise FormatError(f"{ewhere}: data_offsets must be [begin, end]")
        begin, end = offsets
        if end - begin != numel(shape) * element_size(dtype) or base + end > file_size:
            raise FormatError(f"{ewhere}: data offsets [{begin}, {end}) do not fit its shape or the file")
        out[name] = (dtype, shape, base + begin, base + end)
    return out


def check_metadata(metadata: Any, where: str = "metadata") -> None:
    """User metadata a manifest can carry and every reader accepts: a JSON object with string keys
    that survives :func:`parse_manifest` (depth counted where it sits in the manifest)."""
    if not isinstance(metadata, dict):
        raise FormatError(f"{where}: must be a dict, got {type(metadata).__name__}")
    check_plain_json(metadata, where)
    probe = Manifest(world_size=1, tensors={}, files={}, state_size=0, state_hash="", metadata=metadata)
    data = dump_json(probe.to_json(), where)
    parse_manifest(data, where)
