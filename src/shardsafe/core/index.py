"""The per-rank index of format versions 2 to 4: where the parts of rule-described tensors lie in a shard.

``shard-RRRRR.index.json`` is written by rank R right after its shard file (the safetensors header
is written first, before the block hashes are known, and a trailer would make the file unreadable
by safetensors readers)::

    {"format": "shardsafe-index", "rank": 3, "file": "shard-00003.safetensors",
     "chunks": {"model/w": {"offsets": [21, 0], "shape": [7, 16], "begin": 1192, "end": 1640,
                            "hashes": ["81791884979b2347"]}}}

A tensor whose part is several boxes (a ``_StridedShard`` layout, format version 3 or later) has a list of
such objects, one per box. The manifest records the index's exact size and xxh3 hash (integrity
chain: manifest -> index -> blocks). :func:`parse_index` trusts nothing: the bytes must match the
manifest's record, the rank must be the writer of the part it holds under the tensor's rule,
every entry must be exactly one box of that part (not one stored elsewhere), its byte range must
hold that box and lie inside the shard, and no two entries (nor an entry and a chunk the manifest
lists in the same file) may share a byte. A rank reads only the indexes of the writers whose parts
it needs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shardsafe.core.fields import check_tensor_key, expect_field, int_list, is_int_list, numel
from shardsafe.core.format import ChunkEntry, FileEntry, Manifest, TensorEntry, element_size
from shardsafe.core.integrity import hash_bytes, num_blocks
from shardsafe.core.jsonsafe import dump_json, parse_json
from shardsafe.errors import FormatError, IntegrityError

__all__ = ["IndexParts", "build_index", "parse_index"]

INDEX_FORMAT = "shardsafe-index"


def build_index(rank: int, file: str, entries: list[tuple[str, ChunkEntry]]) -> bytes:
    """The index bytes of rank ``rank``'s shard ``file`` (compact JSON: one line, fast to make and parse)."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for key, c in entries:
        item = {
            "offsets": list(c.offsets),
            "shape": list(c.shape),
            "begin": c.begin,
            "end": c.end,
            "hashes": list(c.hashes),
        }
        by_key.setdefault(key, []).append(item)
    chunks = {
        key: items[0] if len(items) == 1 else sorted(items, key=lambda i: i["offsets"])
        for key, items in sorted(by_key.items())
    }
    return dump_json(
        {"format": INDEX_FORMAT, "rank": rank, "file": file, "chunks": chunks}, f"index of {file}", compact=True
    )


IndexParts = dict[str, dict[tuple[int, ...], ChunkEntry]]  # key -> box offsets -> where that box lies


def parse_index(data: bytes, manifest: Manifest, file: str, where: str) -> IndexParts:
    """Validate the index of shard ``file`` (read from ``where``) against ``manifest``; key -> the boxes of its part."""
    entry: FileEntry = manifest.files[file]
    ref = entry.index
    assert ref is not None
    if len(data) != ref.size or hash_bytes(data) != ref.hash:
        raise IntegrityError(f"{where}: size or hash differs from the manifest (corrupted or replaced)")
    raw = parse_json(data, where)
    if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT:
        raise FormatError(f"{where}: not a shardsafe index")
    if expect_field(raw, "rank", int, where) != entry.rank or expect_field(raw, "file", str, where) != file:
        raise FormatError(f"{where}: index names another rank or file than the manifest ({entry.rank}, {file!r})")
    out: IndexParts = {}
    ranges: list[tuple[int, int, str]] = []
    expected_of: dict[tuple[int, tuple[int, ...]], dict[tuple[int, ...], tuple[int, ...]]] = {}
    for key, item in expect_field(raw, "chunks", dict, where).items():
        check_tensor_key(key, where)
        boxes = out[key] = {}
        for chunk in _parse_part(key, item, manifest, file, entry, where, expected_of):
            if chunk.offsets in boxes:
                raise FormatError(f"{where} tensor {key!r:.200}: box at {list(chunk.offsets)} is listed twice")
            boxes[chunk.offsets] = chunk
            ranges.append((chunk.begin, chunk.end, key))
    ranges += manifest.explicit_ranges.get(file, [])  # chunks the manifest lists in the same file
    ranges = sorted(r for r in ranges if r[1] > r[0])
    for (_, end, key), (begin, _, other) in zip(ranges, ranges[1:]):
        if begin < end:
            raise FormatError(
                f"{where}: tensors {key!r:.100} and {other!r:.100} claim the same bytes of {file} (from {begin})"
            )
    return out


def _parse_part(
    key: str,
    item: Any,
    manifest: Manifest,
    file: str,
    entry: FileEntry,
    where: str,
    expected_of: dict[tuple[int, tuple[int, ...]], dict[tuple[int, ...], tuple[int, ...]]],
) -> list[ChunkEntry]:
    """The boxes of the part rank ``entry.rank`` writes of tensor ``key`` (one object, or a list of them).

    ``expected_of`` remembers the boxes per (rule, shape): an index lists thousands of tensors that
    share a few layouts (rules are interned, so their identity is the key while the manifest lives)."""
    tensor = manifest.tensors.get(key)
    if tensor is None or tensor.rule is None:
        raise FormatError(f"{where} tensor {key!r:.200}: the manifest lists no layout rule for this tensor")
    rule = tensor.rule
    expected = expected_of.get((id(rule), tensor.shape))
    if expected is None:
        part = rule.part_of(entry.rank)
        if rule.writer_of(part) != entry.rank:
            raise FormatError(
                f"{where} tensor {key!r:.200}: rank {entry.rank} holds part {part}, which rank "
                f"{rule.writer_of(part)} writes under the layout rule"
            )
        expected = expected_of[(id(rule), tensor.shape)] = rule.box_shapes(tensor.shape, part)
    items = item if isinstance(item, list) else [item]
    if not items or len(items) > len(expected):
        raise FormatError(
            f"{where} tensor {key!r:.200}: lists {len(items)} boxes; part {rule.part_of(entry.rank)} has "
            f"{len(expected)}"
        )
    part_of = _PartOf(tensor, expected, manifest.hash_block_size, file, entry)
    out = []
    for raw in items:
        chunk = _valid_box(raw, part_of)
        out.append(chunk if chunk is not None else _parse_box(f"{where} tensor {key!r:.200}", raw, part_of))
    return out


class _PartOf(NamedTuple):
    """What an index box of one tensor is checked against: the tensor, the boxes its writer's part
    has under the rule (offsets -> shape), and the file (name, manifest entry) it is in."""

    tensor: TensorEntry
    expected: dict[tuple[int, ...], tuple[int, ...]]
    block_size: int
    file: str
    entry: FileEntry


def _valid_box(item: Any, part_of: _PartOf) -> ChunkEntry | None:
    """A well-formed index entry as a chunk; None if anything is wrong, for :func:`_parse_box` to say
    what. Every rank that reads from a shard parses its whole index (thousands of boxes): this path
    builds no message and calls no checker. Ints are checked by type (``True == 1`` and ``1.0 == 1``
    would otherwise compare equal to the expected box)."""
    if type(item) is not dict:
        return None
    offsets, shape = item.get("offsets"), item.get("shape")
    if not is_int_list(offsets) or not is_int_list(shape):
        return None
    box, box_shape = tuple(offsets), tuple(shape)
    tensor = part_of.tensor
    if part_of.expected.get(box) != box_shape or box in tensor.overrides:
        return None
    begin, end, hashes = item.get("begin"), item.get("end"), item.get("hashes")
    nbytes = numel(box_shape) * element_size(tensor.dtype)
    if type(begin) is not int or type(end) is not int or begin < 0 or end - begin != nbytes:
        return None
    if end > part_of.entry.size:
        return None
    if type(hashes) is not list or len(hashes) != num_blocks(nbytes, part_of.block_size):
        return None
    if not all(type(h) is str and len(h) <= 64 for h in hashes):
        return None
    return ChunkEntry(box, box_shape, part_of.file, begin, end, tuple(hashes))


def _parse_box(kwhere: str, item: Any, part_of: _PartOf) -> ChunkEntry:
    """:func:`_valid_box`'s checks one by one, raising the FormatError that says what is wrong."""
    tensor, expected, file, entry = part_of.tensor, part_of.expected, part_of.file, part_of.entry
    if not isinstance(item, dict):
        raise FormatError(f"{kwhere}: an index entry is not an object")
    offsets = int_list(expect_field(item, "offsets", list, kwhere), kwhere)
    shape = int_list(expect_field(item, "shape", list, kwhere), kwhere)
    if expected.get(offsets) != shape or offsets in tensor.overrides:
        boxes = ", ".join(f"{list(o)} of shape {list(s)}" for o, s in list(expected.items())[:4])
        raise FormatError(
            f"{kwhere}: entry at {list(offsets)} of shape {list(shape)} contradicts the layout rule "
            f"(the part rank {entry.rank} writes is at {boxes or 'nothing'}"
            f"{'; that box is stored elsewhere' if offsets in tensor.overrides else ''})"
        )
    begin = expect_field(item, "begin", int, kwhere)
    end = expect_field(item, "end", int, kwhere)
    nbytes = numel(shape) * element_size(tensor.dtype)
    if begin < 0 or end - begin != nbytes or end > entry.size:
        raise FormatError(
            f"{kwhere}: byte range [{begin}, {end}) does not hold {nbytes} bytes inside {file} ({entry.size} bytes)"
        )
    hashes = expect_field(item, "hashes", list, kwhere)
    blocks = num_blocks(nbytes, part_of.block_size)
    if len(hashes) != blocks or not all(isinstance(h, str) and len(h) <= 64 for h in hashes):
        raise FormatError(f"{kwhere}: expected {blocks} block hashes")
    return ChunkEntry(offsets, shape, file, begin, end, tuple(hashes))
