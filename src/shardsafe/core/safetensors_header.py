"""The safetensors layout of shard files: the header built before any byte is written, and parsed
(validated before it is trusted) when a file is opened."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from shardsafe.core.dtypes import (
    dtype_from_safetensors_name,
    dtype_or_none,
    element_size,
    is_packed,
    safetensors_dtype,
    safetensors_shape,
    torch_shape,
)
from shardsafe.core.fields import (
    MAX_HEADER_BYTES,
    RESERVED_HEADER_NAME,
    expect_field,
    int_list,
    is_int_list,
    numel,
)
from shardsafe.core.jsonsafe import parse_json
from shardsafe.errors import FormatError

__all__ = ["HeaderEntry", "build_safetensors_header", "header_sizes", "parse_safetensors_header"]


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
            raise FormatError(
                f"safetensors header: two entries named {e.name!r:.100} (a tensor key containing '@'?), or the "
                "reserved name"
            )
        size = numel(e.shape) * element_size(e.dtype)
        header[e.name] = {
            "dtype": safetensors_dtype(e.dtype),
            "shape": safetensors_shape(e.dtype, e.shape),  # packed FP4: values, not bytes
            "data_offsets": [pos, pos + size],
        }
        relative.append((pos, pos + size))
        pos += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    if len(body) > MAX_HEADER_BYTES:
        raise FormatError(
            f"safetensors header: {len(body)} bytes for {len(entries)} entries is more than the {MAX_HEADER_BYTES} "
            "readers accept"
        )
    prefix = struct.pack("<Q", len(body)) + body
    return prefix, [(len(prefix) + b, len(prefix) + e) for b, e in relative]


def header_sizes(prefix: bytes) -> list[int]:
    """The byte size of each tensor of a prefix :func:`build_safetensors_header` made, in file order:
    what a writer needs to know up front, without asking the tensors (which a converter computes
    only when the writer reaches them)."""
    (length,) = struct.unpack("<Q", prefix[:8])
    raw = json.loads(prefix[8 : 8 + length])
    spans = sorted(tuple(e["data_offsets"]) for name, e in raw.items() if name != RESERVED_HEADER_NAME)
    return [end - begin for begin, end in spans]


def parse_safetensors_header(
    head: bytes, file_size: int, where: str
) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
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
        found = _valid_entry(entry, base, file_size)
        out[name] = found if found is not None else _checked_entry(name, entry, base, file_size, where)
    return out


def _valid_entry(entry: Any, base: int, file_size: int) -> tuple[torch.dtype, tuple[int, ...], int, int] | None:
    """A well-formed entry's (dtype, shape, absolute begin, end); None if anything is wrong, for
    :func:`_checked_entry` to say what. A shard's header lists thousands of entries and every rank
    that reads from the shard parses it: the fast path builds no message and calls no checker."""
    if type(entry) is not dict:
        return None
    dtype = dtype_or_none(entry.get("dtype"))
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if dtype is None or not is_int_list(offsets, 2) or len(offsets) != 2:
        return None
    if is_packed(dtype):  # its shape counts values, not bytes: the checked path converts it
        return None
    if not is_int_list(shape):
        return None
    begin, end = offsets
    if base + end > file_size:
        return None
    dims = tuple(shape)
    if end - begin != numel(dims) * element_size(dtype):
        return None
    return dtype, dims, base + begin, base + end


def _checked_entry(
    name: str, entry: Any, base: int, file_size: int, where: str
) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """The entry checked field by field: raises the FormatError that names what is wrong."""
    ewhere = f"{where} entry {name!r}"
    dtype = dtype_from_safetensors_name(expect_field(entry, "dtype", str, ewhere), ewhere)
    shape = torch_shape(dtype, int_list(expect_field(entry, "shape", list, ewhere), ewhere), ewhere)
    offsets = int_list(expect_field(entry, "data_offsets", list, ewhere), ewhere, max_len=2)
    if len(offsets) != 2:
        raise FormatError(f"{ewhere}: data_offsets must be [begin, end]")
    begin, end = offsets
    if end - begin != numel(shape) * element_size(dtype) or base + end > file_size:
        raise FormatError(f"{ewhere}: data offsets [{begin}, {end}) do not fit its shape or the file")
    return (dtype, shape, base + begin, base + end)
