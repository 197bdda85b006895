"""Property-based tests of the format parsers (hypothesis).

On any input - random bytes, random JSON, and mutations of valid manifests and headers - the
parsers either return a valid object or raise FormatError; never any other exception. And the
encoders round-trip: ``decode_value(encode_value(x)) == x`` (types included, through JSON too),
``parse_safetensors_header(build_safetensors_header(e))`` gives back every entry, and
``parse_manifest(m.to_bytes())`` gives back ``m``. And end to end: ``shardsafe.save`` of arbitrary
JSON-able values (nested containers, big ints, NaN and infinities, surrogates, deep nesting, long
strings, non-string keys) and metadata either refuses with a ShardsafeError before writing
anything, or round-trips exactly through ``shardsafe.load``.

The normal run tries ``EXAMPLES`` examples per property; ``-m stress`` runs each again with
``STRESS_EXAMPLES``.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardsafe
from reliability import record
from shardsafe.core.format import (
    ChunkEntry,
    FileEntry,
    HeaderEntry,
    Manifest,
    TensorEntry,
    build_safetensors_header,
    dump_json,
    element_size,
    parse_json,
    parse_manifest,
    parse_safetensors_header,
)
from shardsafe.core.integrity import hash_blocks, num_blocks
from shardsafe.core.values import decode_value, encode_value
from shardsafe.errors import FormatError, ShardsafeError

EXAMPLES = 200
STRESS_EXAMPLES = 2000
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float64,
    torch.complex64,
]

# ----------------------------------------------------------------------------- strategies

json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


def _tagged(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """JSON that looks like shardsafe's tags, to reach decode_value's branches."""
    tags = st.sampled_from(["__tensor__", "__tuple__", "__pairs__", "__dtype__"])
    return (
        st.builds(lambda tag, value: {tag: value}, tags, inner)
        | st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | tags, inner, max_size=4)
    )


tagged_json = st.recursive(json_scalars | st.sampled_from(["float32", "bfloat16", "bogus"]), _tagged, max_leaves=25)

python_keys = (
    st.none()
    | st.booleans()
    | st.integers(-1000, 1000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
python_values = st.recursive(
    json_scalars | st.sampled_from(DTYPES) | st.integers(0, 3).map(lambda i: TensorMarker(i)),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        | st.dictionaries(python_keys, inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["__tensor__", "__tuple__", "__pairs__", "__dtype__", "x"]), inner, max_size=3
        )
    ),
    max_leaves=25,
)


class TensorMarker:
    """Stands for a tensor in a generated value: encode_value sees a real tensor in its place."""

    def __init__(self, index: int) -> None:
        self.index = index


# ----------------------------------------------------------------------------- helpers


def _only_format_errors(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except FormatError:
        return None


def _valid_manifest() -> Manifest:
    block = 4096
    tensors = {}
    offset = 64
    chunks_a = []
    for row in range(3):
        nbytes = 5 * 4
        chunks_a.append(
            ChunkEntry(
                (row * 2, 0), (2, 5), "shard-00000.safetensors", offset, offset + 2 * nbytes, ("0123456789abcdef",)
            )
        )
        offset += 2 * nbytes
    tensors["model/w"] = TensorEntry(torch.float32, (6, 5), tuple(chunks_a))
    tensors["model/b"] = TensorEntry(
        torch.bfloat16,
        (3,),
        (ChunkEntry((0,), (3,), "shard-00000.safetensors", offset, offset + 6, ("fedcba9876543210",)),),
    )
    offset += 6
    big = 3 * block // 4 + 1
    hashes = tuple(hash_blocks([bytes(big * 4)], block))
    tensors["optim/state/w/exp_avg"] = TensorEntry(
        torch.float32, (big,), (ChunkEntry((0,), (big,), "shard-00001.safetensors", 64, 64 + 4 * big, hashes),)
    )
    files = {"shard-00000.safetensors": FileEntry(offset, 0), "shard-00001.safetensors": FileEntry(64 + 4 * big, 1)}
    return Manifest(
        world_size=2,
        tensors=tensors,
        files=files,
        state_size=10,
        state_hash="00",
        metadata={"step": 3},
        created=1.5,
        writer_version="t",
        hash_block_size=block,
    )


VALID_MANIFEST = _valid_manifest().to_bytes()
VALID_HEADER, _ = build_safetensors_header(
    [HeaderEntry("a", torch.float32, (3, 2)), HeaderEntry("b@2,0", torch.bfloat16, (5,))]
)


def _mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    """Byte-level mutations of a valid input: flips, cuts, splices and insertions."""

    def apply(ops: list[tuple[int, int, int, bytes]]) -> bytes:
        data = bytearray(seed)
        for kind, position, length, junk in ops:
            if not data:
                break
            at = position % len(data)
            if kind == 0:
                data[at] ^= 1 << (length % 8)
            elif kind == 1:
                del data[at : at + length]
            elif kind == 2:
                data[at:at] = junk
            else:
                data = data[:at]
        return bytes(data)

    op = st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 64), st.binary(max_size=16))
    return st.lists(op, min_size=1, max_size=4).map(apply)


def _json_mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    """Structural mutations: replace one node of the valid JSON with a random JSON value."""
    base = json.loads(seed)

    def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        out = [prefix]
        if isinstance(value, dict):
            for k, v in value.items():
                out += paths(v, (*prefix, k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                out += paths(v, (*prefix, i))
        return out

    all_paths = paths(base)

    def apply(index: int, replacement: Any) -> bytes:
        path = all_paths[index % len(all_paths)]
        doc = json.loads(seed)
        if not path:
            return json.dumps(replacement).encode()
        node = doc
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = replacement
        return json.dumps(doc).encode()

    return st.builds(
        apply,
        st.integers(0, 10**6),
        json_values | st.integers(-(2**64), 2**64) | st.sampled_from(["", "..", "/etc/passwd", "a/b", -1, 1e300]),
    )


# ----------------------------------------------------------------------------- properties


def prop_parse_json_never_crashes(data: bytes) -> None:
    value = _only_format_errors(lambda: parse_json(data, "fuzz"))
    if value is not None:
        json.dumps(value)  # whatever it returns is plain JSON


def prop_parse_json_round_trip(value: Any) -> None:
    assert parse_json(json.dumps(value).encode(), "rt") == value


def prop_parse_manifest_bytes(data: bytes) -> None:
    manifest = _only_format_errors(lambda: parse_manifest(data, "fuzz"))
    if manifest is not None:
        assert isinstance(manifest, Manifest)
        _check_manifest_invariants(manifest)


def _check_manifest_invariants(manifest: Manifest) -> None:
    """What readers rely on after parse_manifest returns."""
    for key, entry in manifest.tensors.items():
        assert sum(math.prod(c.shape) for c in entry.chunks) == math.prod(entry.shape), key
        for chunk in entry.chunks:
            assert chunk.end - chunk.begin == math.prod(chunk.shape) * element_size(entry.dtype)
            assert len(chunk.hashes) == num_blocks(chunk.end - chunk.begin, manifest.hash_block_size)
            assert "/" not in chunk.file and chunk.file not in ("..", ".")
            if chunk.checkpoint is None:
                assert chunk.end <= manifest.files[chunk.file].size
    assert "/" not in manifest.state_file


def prop_parse_header_bytes(data: bytes, file_size: int) -> None:
    header = _only_format_errors(lambda: parse_safetensors_header(data, file_size, "fuzz"))
    if header is not None:
        base = 8 + struct.unpack("<Q", data[:8])[0]
        for dtype, shape, begin, end in header.values():
            assert base <= begin <= end <= file_size
            assert end - begin == math.prod(shape) * element_size(dtype)


def prop_decode_value_never_crashes(value: Any) -> None:
    _only_format_errors(lambda: decode_value(value, lambda key: ("tensor", key)))


def prop_value_round_trip(value: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}

    def ref(path: str, tensor: torch.Tensor) -> str:
        tensors[path] = tensor
        return path

    encoded = encode_value(_materialize(value), "v", ref)
    through_json = parse_json(dump_json(encoded), "rt")
    for encoded_form in (encoded, through_json):
        decoded = decode_value(encoded_form, lambda key: tensors[key])
        assert _typed(decoded) == _typed(_materialize(value))


def _materialize(value: Any) -> Any:
    if isinstance(value, TensorMarker):
        return torch.arange(value.index + 1, dtype=torch.int64)
    if isinstance(value, list):
        return [_materialize(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialize(v) for k, v in value.items()}
    return value


def _typed(value: Any) -> Any:
    """Compare with types: 1 != 1.0 != True, (1,) != [1], -0.0 != 0.0."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return ("dict", sorted((repr(_typed(k)), _typed(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_typed(v) for v in value])
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


header_entries = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=12).filter(lambda s: s != "__metadata__"),
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 6), max_size=4),
    ),
    max_size=6,
    unique_by=lambda e: e[0],
)


def prop_header_round_trip(entries: list[tuple[str, torch.dtype, list[int]]]) -> None:
    header = [HeaderEntry(name, dtype, tuple(shape)) for name, dtype, shape in entries]
    prefix, ranges = build_safetensors_header(header)
    size = ranges[-1][1] if ranges else len(prefix)
    parsed = parse_safetensors_header(prefix, size, "rt")
    assert len(prefix) % 8 == 0 and len(parsed) == len(header)
    for entry, (begin, end) in zip(header, ranges):
        assert parsed[entry.name] == (entry.dtype, entry.shape, begin, end)


def prop_manifest_round_trip(metadata: dict[str, Any], created: float, world_size: int) -> None:
    manifest = dataclasses.replace(_valid_manifest(), metadata=metadata, created=created, world_size=world_size)
    again = parse_manifest(manifest.to_bytes(), "rt")
    assert again.to_json() == manifest.to_json()


HEADER_JSON_MUTATIONS = _json_mutations(VALID_HEADER[8:].strip()).map(lambda b: struct.pack("<Q", len(b)) + b)
metadata = st.dictionaries(st.text(max_size=8), json_values, max_size=4)

# (name, strategy arguments, property)
PROPERTIES: list[tuple[str, tuple[st.SearchStrategy[Any], ...], Callable[..., None]]] = [
    ("parse_json-bytes", (st.binary(max_size=300),), prop_parse_json_never_crashes),
    ("parse_json-mutated-manifest", (_mutations(VALID_MANIFEST),), prop_parse_json_never_crashes),
    ("parse_json-round-trip", (json_values,), prop_parse_json_round_trip),
    ("parse_manifest-bytes", (st.binary(max_size=300),), prop_parse_manifest_bytes),
    ("parse_manifest-byte-mutations", (_mutations(VALID_MANIFEST),), prop_parse_manifest_bytes),
    ("parse_manifest-json-mutations", (_json_mutations(VALID_MANIFEST),), prop_parse_manifest_bytes),
    ("parse_manifest-random-json", (json_values.map(lambda v: json.dumps(v).encode()),), prop_parse_manifest_bytes),
    ("parse_safetensors_header-bytes", (st.binary(max_size=200), st.integers(0, 1 << 40)), prop_parse_header_bytes),
    ("parse_safetensors_header-mutations", (_mutations(VALID_HEADER), st.integers(0, 4096)), prop_parse_header_bytes),
    ("parse_safetensors_header-json-mutations", (HEADER_JSON_MUTATIONS, st.integers(0, 4096)), prop_parse_header_bytes),
    ("decode_value-json", (tagged_json,), prop_decode_value_never_crashes),
    ("encode-decode-round-trip", (python_values,), prop_value_round_trip),
    ("header-round-trip", (header_entries,), prop_header_round_trip),
    ("manifest-round-trip", (metadata, st.floats(allow_nan=False, allow_infinity=False), st.integers(1, 1 << 20)),
     prop_manifest_round_trip),
]  # fmt: skip


def _run(
    prop: Callable[..., None],
    strategies: tuple[st.SearchStrategy[Any], ...],
    examples: int,
    name: str,
    category: str = "property tests of the parsers (hypothesis examples)",
) -> None:
    count = 0

    def counted(args: tuple[Any, ...]) -> None:
        nonlocal count
        count += 1
        prop(*args)

    test = settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))(
        given(st.tuples(*strategies))(counted)
    )
    test()
    record(category, cases=count, note=name)


@pytest.mark.parametrize("name, strategies, prop", PROPERTIES, ids=[p[0] for p in PROPERTIES])
def test_property(name: str, strategies: tuple[st.SearchStrategy[Any], ...], prop: Callable[..., None]) -> None:
    _run(prop, strategies, EXAMPLES, name)


@pytest.mark.stress
@pytest.mark.parametrize("name, strategies, prop", PROPERTIES, ids=[p[0] for p in PROPERTIES])
def test_property_sweep(name: str, strategies: tuple[st.SearchStrategy[Any], ...], prop: Callable[..., None]) -> None:
    _run(prop, strategies, STRESS_EXAMPLES, name)


# ----------------------------------------------------------------------------- save: refuse or round-trip

odd_text = st.sampled_from(
    ["\ud800", "\udfff", "\ud83d\ude00", "a\udc80b", "\x00", "\u2028", "\U0001f600", "__tensor__", "__pairs__"]
)
save_text = (
    st.text(max_size=12)
    | st.builds(lambda a, odd, b: a + odd + b, st.text(max_size=4), odd_text, st.text(max_size=4))
    | st.integers(0, 300_000).map(lambda n: "y" * n)
)
# digits around the 4300 that Python's int <-> str conversion allows (json refuses more, both ways)
big_ints = st.builds(
    lambda digits, sign: sign * 10 ** (digits - 1), st.sampled_from([4299, 4300, 4301, 5000]), st.sampled_from([1, -1])
)
save_ints = st.integers(-(2**70), 2**70) | big_ints
save_scalars = st.none() | st.booleans() | save_ints | st.floats() | save_text
save_keys = st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats() | save_text


def _nested(depth: int, kind: str, inner: Any) -> Any:
    value = inner
    for i in range(depth):
        value = {"list": [value], "tuple": (value,), "dict": {f"k{i}": value}, "pairs": {i: value}}[kind]
    return value


def _values(leaves: st.SearchStrategy[Any], keys: st.SearchStrategy[Any], tuples: bool) -> st.SearchStrategy[Any]:
    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        out = (
            st.lists(inner, max_size=4)
            | st.dictionaries(save_text, inner, max_size=4)
            | st.dictionaries(keys, inner, max_size=4)
        )
        return out | st.lists(inner, max_size=4).map(tuple) if tuples else out

    shallow = st.recursive(leaves, extend, max_leaves=30)
    kinds = ["list", "tuple", "dict", "pairs"] if tuples else ["list", "dict"]
    deep = st.builds(_nested, st.integers(1, 90), st.sampled_from(kinds), shallow)
    return shallow | deep


save_values = _values(save_scalars, save_keys, tuples=True)
metadata_values = st.dictionaries(
    save_text, _values(save_scalars, save_text | st.integers(0, 3), tuples=False), max_size=4
)


def _scratch() -> Iterator[Path]:
    """A fresh folder per example, under one temporary folder removed at exit."""
    base = Path(tempfile.mkdtemp(prefix="shardsafe-prop-"))
    atexit.register(shutil.rmtree, base, True)
    return (base / str(i) for i in itertools.count())


def _refused_or_round_trips(folder: Path, state_value: Any, metadata: Any) -> None:
    """Either the save refuses (a ShardsafeError, nothing on disk), or the load gives back exactly
    what was saved: the value (types included; NaN compared by its repr) and the metadata."""
    folder.mkdir()
    try:
        shardsafe.save(folder / "ckpt", {"v": state_value}, metadata=metadata, fsync=False)
    except ShardsafeError:
        assert os.listdir(folder) == [], f"a refused save left {os.listdir(folder)}"
        return
    state: dict[str, Any] = {"v": None}
    got = shardsafe.load(folder / "ckpt", state)
    assert repr(_typed(state["v"])) == repr(_typed(state_value))
    assert repr(_typed(got)) == repr(_typed(metadata or {}))
    shutil.rmtree(folder)


SAVE_PROPERTIES: list[tuple[str, tuple[st.SearchStrategy[Any], ...], Callable[..., None]]] = [
    ("save-state-value", (save_values,), lambda value: _refused_or_round_trips(next(SCRATCH), value, None)),
    ("save-metadata", (metadata_values,), lambda metadata: _refused_or_round_trips(next(SCRATCH), 0, metadata)),
]
SCRATCH = _scratch()
SAVE_CATEGORY = "property test: save of arbitrary values refuses before writing or round-trips (hypothesis examples)"


@pytest.mark.parametrize("name, strategies, prop", SAVE_PROPERTIES, ids=[p[0] for p in SAVE_PROPERTIES])
def test_save_property(name: str, strategies: tuple[st.SearchStrategy[Any], ...], prop: Callable[..., None]) -> None:
    _run(prop, strategies, EXAMPLES, name, SAVE_CATEGORY)


@pytest.mark.stress
@pytest.mark.parametrize("name, strategies, prop", SAVE_PROPERTIES, ids=[p[0] for p in SAVE_PROPERTIES])
def test_save_property_sweep(
    name: str, strategies: tuple[st.SearchStrategy[Any], ...], prop: Callable[..., None]
) -> None:
    _run(prop, strategies, STRESS_EXAMPLES, name, SAVE_CATEGORY)


def test_a_json_error_never_shows_the_files_bytes() -> None:
    """Bytes that are not UTF-8 are said by position, not quoted; a repeated key is shown to 64 characters."""
    with pytest.raises(FormatError, match=r"f\.json: not valid JSON \(not UTF-8 at byte 7\)") as caught:
        parse_json(b'{"a": "\xa0SECRET"}', "f.json")
    assert "SECRET" not in str(caught.value) and "xa0" not in str(caught.value)
    key = "k" * 64 + "SECRET"
    with pytest.raises(FormatError, match="duplicate JSON key") as caught:
        parse_json(f'{{"{key}": 1, "{key}": 2}}'.encode(), "f.json")
    assert "SECRET" not in str(caught.value)
