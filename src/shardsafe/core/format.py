"""The on-disk format: one module owns the schema.

A checkpoint is a folder holding

* ``manifest.json`` - written last by the coordinator; its presence is the commit marker;
* ``state.json`` - the non-tensor part of the saved state (JSON, tensors replaced by references);
* ``shard-RRRRR.safetensors`` - one per rank that had data to write, in the safetensors layout
  (8-byte little-endian header length, JSON header, raw little-endian tensor bytes);
* ``shard-RRRRR.index.json`` (versions 2 to 4) - where the parts of rule-described tensors lie in that
  shard (byte ranges, block hashes); its size and hash are in the manifest (core/index.py).

On an object store every name but the manifest's carries the save's id (``shard-RRRRR-<id>.safetensors``,
``shard-RRRRR-<id>.index.json``, ``state-<id>.json``); a reader takes every name from the manifest, the state
file's being any ``state*.json``.

Version 2 describes one regular layout by a rule (``split``: dim 0 over the world); version 3 any
DTensor layout on a row-major mesh (``layout``: mesh + placements, core/rule.py); version 4 adds
the ``["at", k]`` placement (a tensor only the ranks at coordinate k of a mesh dim hold: a
pipeline stage's). A save writes the oldest version its tensors need (:func:`version_needed`).

See docs/FORMAT.md for the prose version. Every parser here validates before it trusts: names
must be single safe path components, sizes are bounded and cross-checked, JSON has no duplicate
keys and bounded depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from shardsafe.core.dtypes import dtype_from_name, dtype_name, element_size
from shardsafe.core.fields import (
    MAX_DIMS,
    MAX_HASH_BLOCK_SIZE,
    MAX_HEADER_BYTES,
    MAX_NUMEL,
    MIN_HASH_BLOCK_SIZE,
    RESERVED_HEADER_NAME,
    all_safe_components,
    check_component,
    check_tensor_key,
    numel,
)
from shardsafe.core.fields import expect_field as _expect
from shardsafe.core.fields import int_list as _int_list
from shardsafe.core.integrity import HASH_ALGORITHM, HASH_BLOCK_SIZE, num_blocks
from shardsafe.core.jsonsafe import MAX_JSON_BYTES, check_depth, check_plain_json, dump_json, parse_json
from shardsafe.core.rule import LayoutRule
from shardsafe.core.safetensors_header import HeaderEntry, build_safetensors_header, parse_safetensors_header

__all__ = [
    "ChunkEntry",
    "FileEntry",
    "HeaderEntry",
    "INDEX_PATTERN",
    "INDEX_SUFFIX",
    "IndexRef",
    "MANIFEST_NAME",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "MAX_NUMEL",
    "Manifest",
    "RESERVED_HEADER_NAME",
    "RETAINED_MANIFEST_NAME",
    "SHARD_PATTERN",
    "STATE_NAME",
    "TensorEntry",
    "box_overlap",
    "build_safetensors_header",
    "check_component",
    "check_metadata",
    "check_tensor_key",
    "dtype_from_name",
    "dtype_name",
    "dump_json",
    "element_size",
    "numel",
    "parse_json",
    "parse_manifest",
    "parse_safetensors_header",
]
from shardsafe.errors import FormatError

FORMAT_NAME = "shardsafe"
FORMAT_VERSION = 4
OLDEST_FORMAT_VERSION = 1  # version 1: every chunk listed in the manifest, no split rules, no indexes
RULE_VERSION = 2  # the first version with rules (``split``) and per-rank indexes
LAYOUT_VERSION = 3  # the first version with N-D layout rules (``layout``)
STAGE_VERSION = 4  # the first version with ``["at", k]`` placements (pipeline stages' tensors)
MANIFEST_NAME = "manifest.json"
# A retired checkpoint whose files later checkpoints still store tensors in (dedup) keeps its
# manifest under this name: no longer a checkpoint, but readers can check a reference against it.
RETAINED_MANIFEST_NAME = "manifest.retained.json"
STATE_NAME = "state.json"
SHARD_PATTERN = "shard-{rank:05d}.safetensors"
INDEX_PATTERN = "shard-{rank:05d}.index.json"
INDEX_SUFFIX = ".index.json"

# ----------------------------------------------------------------------------- manifest


MAX_CREATED = 1e15  # seconds: far beyond any real time, well inside a float


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
    """A stored tensor: its global dtype and shape, and where its pieces are.

    Either ``chunks`` lists every piece (version 1, and irregular or replicated tensors), or
    ``rule`` gives the layout (core/rule.py): each part lies in the file its writer wrote, as that
    file's index says. With a rule, ``chunks`` lists only the boxes stored elsewhere (dedup: in a
    sibling checkpoint), each exactly one box of one part; ``overrides`` maps their offsets to them.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]
    rule: LayoutRule | None = None
    overrides: dict[tuple[int, ...], ChunkEntry] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.rule is not None and self.chunks and not self.overrides:
            object.__setattr__(self, "overrides", {c.offsets: c for c in self.chunks})

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * element_size(self.dtype)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": dtype_name(self.dtype), "shape": list(self.shape)}
        if self.rule is None:
            out["chunks"] = [c.to_json() for c in self.chunks]
            return out
        if self.rule.is_v2_split:
            out["split"] = {"dim": 0, "parts": self.rule.world_size, "size": -(-self.shape[0] // self.rule.world_size)}
        else:
            out["layout"] = self.rule.to_json()
        if self.chunks:
            out["chunks"] = [c.to_json() for c in self.chunks]
        return out


def version_needed(tensors: dict[str, TensorEntry]) -> int:
    """The oldest format version that holds these tensors (a save writes that one, so older readers
    keep reading what they can)."""
    rules = [t.rule for t in tensors.values() if t.rule is not None]
    if any(r.at_dims for r in rules):
        return STAGE_VERSION
    if any(not r.is_v2_split for r in rules):
        return LAYOUT_VERSION
    return RULE_VERSION


@dataclass(frozen=True)
class IndexRef:
    """The per-rank index of a shard file (versions 2 to 4): its name, exact size and xxh3 hash."""

    file: str
    size: int
    hash: str


@dataclass(frozen=True)
class FileEntry:
    size: int
    rank: int
    index: IndexRef | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "rank": self.rank}
        if self.index is not None:
            out["index"] = {"file": self.index.file, "size": self.index.size, "hash": self.index.hash}
        return out


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest, built once with every field (derive a changed one with
    :func:`dataclasses.replace`). Its lookups are computed on first use and kept (``cached_property``)."""

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
    format_version: int = RULE_VERSION  # written as at least what the tensors need (:func:`version_needed`)
    state_file: str = STATE_NAME

    @property
    def total_bytes(self) -> int:
        return sum(f.size + (f.index.size if f.index is not None else 0) for f in self.files.values())

    @cached_property
    def _index_by_rank(self) -> dict[int, tuple[str, FileEntry]]:
        return {f.rank: (name, f) for name, f in self.files.items() if f.index is not None}

    def index_of_rank(self, rank: int) -> tuple[str, FileEntry] | None:
        """(shard file, entry) of the file rank ``rank`` wrote with an index, if any (O(1) after the first call)."""
        return self._index_by_rank.get(rank)

    @cached_property
    def explicit_ranges(self) -> dict[str, list[tuple[int, int, str]]]:
        """File -> (begin, end, key) of the chunks the manifest lists in this checkpoint's files
        (not those in a sibling checkpoint; computed once)."""
        out: dict[str, list[tuple[int, int, str]]] = {}
        for key, t in self.tensors.items():
            for c in t.chunks:
                if c.checkpoint is None:
                    out.setdefault(c.file, []).append((c.begin, c.end, key))
        return out

    def stored_names(self) -> set[str]:
        """Every file of the checkpoint the manifest names (shards, their indexes, the state file)."""
        return set(self.files) | {f.index.file for f in self.files.values() if f.index is not None} | {self.state_file}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": max(self.format_version, version_needed(self.tensors)),
            "writer_version": self.writer_version,
            "created": self.created,
            "world_size": self.world_size,
            "hash_algorithm": self.hash_algorithm,
            "hash_block_size": self.hash_block_size,
            "state": {"file": self.state_file, "size": self.state_size, "hash": self.state_hash},
            "files": {name: f.to_json() for name, f in sorted(self.files.items())},
            "metadata": self.metadata,
            "tensors": {key: t.to_json() for key, t in self.tensors.items()},
        }

    def to_bytes(self) -> bytes:
        return dump_json(self.to_json())


def _parse_chunk(
    raw: Any, key: str, dtype: torch.dtype, shape: tuple[int, ...], files: dict[str, FileEntry], block: int
) -> ChunkEntry:
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
            raise FormatError(
                f"{where}: chunk refers to hidden folder {checkpoint!r}, not a committed sibling checkpoint"
            )
    begin = _expect(raw, "begin", int, where)
    end = _expect(raw, "end", int, where)
    nbytes = numel(cshape) * element_size(dtype)
    if begin < 0 or end - begin != nbytes:
        raise FormatError(f"{where}: byte range [{begin}, {end}) does not hold {nbytes} bytes")
    if checkpoint is None:
        if file not in files:
            raise FormatError(f"{where}: chunk refers to unlisted file {file!r}")
        if end > files[file].size:
            raise FormatError(
                f"{where}: byte range [{begin}, {end}) runs past the end of {file} ({files[file].size} bytes)"
            )
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
        raise FormatError(
            f"manifest tensor {key!r}: chunks hold {total} elements, shape {list(shape)} needs {numel(shape)}"
        )
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
                raise FormatError(
                    f"{where}: tensors {key!r:.100} and {other!r:.100} claim the same bytes of {shown} (from {begin})"
                )


def _parse_index_ref(entry: Any, name: str, version: int, where: str) -> IndexRef | None:
    raw = entry.get("index")
    if raw is None:
        return None
    if (
        version >= 2
        and type(raw) is dict
        and type(raw.get("file")) is str
        and type(raw.get("size")) is int
        and type(raw.get("hash")) is str
    ):
        # the common case, checked fast
        file, size, digest = check_component(raw["file"], where), raw["size"], raw["hash"]
    else:  # the same checks, for their messages
        fwhere = f"{where} file {name!r}"
        if version < 2:
            raise FormatError(f"{fwhere}: an index is a format version 2 field, the manifest says version {version}")
        file = check_component(_expect(raw, "file", str, fwhere), fwhere)
        size = _expect(raw, "size", int, fwhere)
        digest = _expect(raw, "hash", str, fwhere)
    if not file.endswith(INDEX_SUFFIX) or not 0 <= size <= MAX_JSON_BYTES or len(digest) > 64:
        raise FormatError(
            f"{where} file {name!r}: index {file!r} must be named *{INDEX_SUFFIX}, at most {MAX_JSON_BYTES} bytes, "
            "with an xxh3 hash"
        )
    return IndexRef(file, size, digest)


def _check_file_names(files: dict[str, FileEntry], world_size: int, where: str) -> None:
    """Index names are not shard names and not shared; at most one indexed file per rank (a part of
    a rule is found through its writer's index), each rank inside the world."""
    seen: set[str] = set(files) | {MANIFEST_NAME, RETAINED_MANIFEST_NAME}
    ranks: set[int] = set()
    for name, f in files.items():
        if f.index is None:
            continue
        if f.index.file in seen or f.index.file.startswith("state"):
            raise FormatError(f"{where}: file {name!r}: index name {f.index.file!r} is another file's name")
        seen.add(f.index.file)
        if f.rank in ranks or f.rank >= world_size:
            raise FormatError(
                f"{where}: file {name!r}: rank {f.rank} is outside the world or has a second indexed file"
            )
        ranks.add(f.rank)


def _parse_rule(entry: Any, shape: tuple[int, ...], world_size: int, version: int, where: str) -> LayoutRule | None:
    """The tensor's rule: version 2's ``split`` (dim 0 over the world) or version 3's ``layout``."""
    if "split" in entry and "layout" in entry:
        raise FormatError(f"{where}: a tensor has a split rule or a layout rule, not both")
    if "layout" in entry:
        if version < LAYOUT_VERSION:
            raise FormatError(
                f"{where}: a layout rule is a format version {LAYOUT_VERSION} field, the manifest says version "
                f"{version}"
            )
        rule = LayoutRule.from_json(entry["layout"], where)
        rule.check(shape, world_size, where)
        if rule.at_dims and version < STAGE_VERSION:
            raise FormatError(
                f'{where}: an ["at", k] placement is a format version {STAGE_VERSION} field, the manifest says '
                f"version {version}"
            )
        return rule
    raw = entry.get("split")
    if raw is None:
        return None
    if version < RULE_VERSION:
        raise FormatError(
            f"{where}: a split rule is a format version {RULE_VERSION} field, the manifest says version {version}"
        )
    dim, parts, size = (_expect(raw, k, int, where) for k in ("dim", "parts", "size"))
    if dim != 0 or not shape or shape[0] == 0 or parts != world_size or size != -(-shape[0] // parts):
        raise FormatError(
            f"{where}: split rule {raw!r:.100} does not split dim 0 of shape {list(shape)} over the {world_size} ranks"
        )
    return LayoutRule.split(world_size)


def _check_overrides(
    rule: LayoutRule, shape: tuple[int, ...], chunks: list[ChunkEntry], where: str
) -> dict[tuple[int, ...], ChunkEntry]:
    """The chunks listed beside a rule (boxes stored in a sibling checkpoint): each exactly one
    non-empty box of one part, no box twice."""
    out: dict[tuple[int, ...], ChunkEntry] = {}
    for c in chunks:
        if c.offsets in out or not all(c.shape) or rule.part_holding(shape, c.offsets, c.shape) is None:
            raise FormatError(
                f"{where}: chunk at {list(c.offsets)} of shape {list(c.shape)} is not a part of its layout rule"
            )
        out[c.offsets] = c
    return out


def _parse_files(raw: dict[str, Any], version: int, where: str) -> dict[str, FileEntry]:
    """The ``files`` section: one entry per shard (16,384 at 16,384 ranks), so the common shape is
    checked in one pass (names by :func:`all_safe_components`, the rest by exact types) and only
    an entry that fails it goes through the checks that build the message."""
    names_safe = all_safe_components(raw)
    files: dict[str, FileEntry] = {}
    for name, entry in raw.items():
        if not names_safe:
            check_component(name, where)
        if (
            type(entry) is dict
            and type(entry.get("size")) is int
            and type(entry.get("rank")) is int
            and entry["size"] >= 0
        ):  # the common case (an index reference has its own fast path)
            files[name] = FileEntry(entry["size"], entry["rank"], _parse_index_ref(entry, name, version, where))
            continue
        size = _expect(entry, "size", int, f"{where} file {name!r}")  # the same checks, for their messages
        rank = _expect(entry, "rank", int, f"{where} file {name!r}")
        if size < 0:
            raise FormatError(f"{where}: file {name!r} has a negative size")
        files[name] = FileEntry(size, rank, _parse_index_ref(entry, name, version, where))
    return files


def _parse_header(raw: Any, where: str) -> tuple[int, str, int, int]:
    """The manifest's identity and parameters: format version, hash algorithm, hash block size, world size."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a shardsafe manifest")
    version = _expect(raw, "format_version", int, where)
    if version > FORMAT_VERSION:
        raise FormatError(
            f"{where}: format version {version} is newer than this shardsafe understands ({FORMAT_VERSION}); upgrade "
            "shardsafe"
        )
    if version < OLDEST_FORMAT_VERSION:
        raise FormatError(f"{where}: format version {version} is not a shardsafe format version")
    algorithm = _expect(raw, "hash_algorithm", str, where)
    if algorithm != HASH_ALGORITHM:
        raise FormatError(
            f"{where}: unknown hash algorithm (a {len(algorithm)}-character string; expected {HASH_ALGORITHM})"
        )
    block = _expect(raw, "hash_block_size", int, where)
    if not MIN_HASH_BLOCK_SIZE <= block <= MAX_HASH_BLOCK_SIZE or block & (block - 1):
        raise FormatError(
            f"{where}: hash block size {block} is not a power of two between {MIN_HASH_BLOCK_SIZE} and "
            f"{MAX_HASH_BLOCK_SIZE}"
        )
    world_size = _expect(raw, "world_size", int, where)
    if world_size < 1:
        raise FormatError(f"{where}: world size {world_size} is invalid")
    return version, algorithm, block, world_size


def _parse_state_ref(state: dict[str, Any], where: str) -> tuple[str, int]:
    """The state file's name and size (its hash is read last, where the manifest is built)."""
    state_file = check_component(state.get("file"), where)
    if not (state_file.startswith("state") and state_file.endswith(".json")):
        raise FormatError(f"{where}: state file {state_file!r} must be named state*.json")
    state_size = _expect(state, "size", int, where)
    if not 0 <= state_size <= MAX_JSON_BYTES:
        raise FormatError(f"{where}: state size {state_size} is out of range")
    return state_file, state_size


def _parse_tensors(
    raw: dict[str, Any], world_size: int, version: int, files: dict[str, FileEntry], block: int, where: str
) -> dict[str, TensorEntry]:
    """The ``tensors`` section, entry by entry, then the byte ranges of all chunks checked disjoint."""
    tensors: dict[str, TensorEntry] = {}
    for key, entry in raw.items():
        twhere = f"{where} tensor {key!r:.200}"
        check_tensor_key(key, where)
        dtype = dtype_from_name(_expect(entry, "dtype", str, twhere), twhere)
        shape = _int_list(_expect(entry, "shape", list, twhere), twhere)
        if numel(shape) > MAX_NUMEL:
            raise FormatError(f"{twhere}: shape {list(shape)} is absurdly large")
        rule = _parse_rule(entry, shape, world_size, version, twhere)
        raw_chunks = _expect(entry, "chunks", list, twhere) if rule is None or "chunks" in entry else []
        chunks = [_parse_chunk(c, key, dtype, shape, files, block) for c in raw_chunks]
        if rule is None:
            _check_coverage(key, shape, chunks)
            tensors[key] = TensorEntry(dtype, shape, tuple(chunks))
        else:
            tensors[key] = TensorEntry(dtype, shape, tuple(chunks), rule, _check_overrides(rule, shape, chunks, twhere))
    _check_disjoint_ranges(tensors, where)
    return tensors


def _parse_metadata(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The user metadata: the one free-form part kept, its depth counted where it sits in the file."""
    metadata = raw.get("metadata", {})
    if not isinstance(metadata, dict):
        raise FormatError(f"{where}: metadata must be an object")
    check_depth({"metadata": metadata}, where)
    return metadata


def _parse_created(raw: dict[str, Any], where: str) -> float:
    """The save's time stamp: a finite number (an int within range, or a float)."""
    created = raw.get("created", 0.0)
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise FormatError(f"{where}: field 'created' has the wrong type ({type(created).__name__})")
    if not (isinstance(created, float) or -MAX_CREATED <= created <= MAX_CREATED) or not math.isfinite(float(created)):
        raise FormatError(f"{where}: field 'created' is not a time (out of range or not finite)")
    return float(created)


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate a manifest, field by field; :class:`FormatError` naming ``where`` on the first problem."""
    raw = parse_json(data, where, depth=False)  # every part kept is checked field by field; metadata's depth below
    version, algorithm, block, world_size = _parse_header(raw, where)
    files = _parse_files(_expect(raw, "files", dict, where), version, where)
    _check_file_names(files, world_size, where)
    state = _expect(raw, "state", dict, where)
    state_file, state_size = _parse_state_ref(state, where)
    tensors = _parse_tensors(_expect(raw, "tensors", dict, where), world_size, version, files, block, where)
    metadata = _parse_metadata(raw, where)
    created = _parse_created(raw, where)
    return Manifest(
        world_size=world_size,
        tensors=tensors,
        files=files,
        state_size=state_size,
        state_hash=str(_expect(state, "hash", str, where)),
        metadata=metadata,
        created=created,
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


def check_metadata(metadata: Any, where: str = "metadata") -> None:
    """User metadata a manifest can carry and every reader accepts: a JSON object with string keys
    that survives :func:`parse_manifest` (depth counted where it sits in the manifest)."""
    if not isinstance(metadata, dict):
        raise FormatError(f"{where}: must be a dict, got {type(metadata).__name__}")
    check_plain_json(metadata, where)
    probe = Manifest(world_size=1, tensors={}, files={}, state_size=0, state_hash="", metadata=metadata)
    data = dump_json(probe.to_json(), where)
    parse_manifest(data, where)
