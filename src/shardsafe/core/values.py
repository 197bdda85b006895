"""The state tree: nested Python values <-> JSON with tagged tensors, tuples, non-string keys, dtypes.

``state.json`` holds one entry per state name, ``{"kind": ..., "state": <encoded value>}`` (or
``"ranks": [...]`` for per-rank values). A tensor subclass stored by its parts (an allowlisted
quantized class, state/subclasses.py) is one ``{"__subclass__": {...}}`` record: its class name, outer
shape and stride, its inner tensors by reference and its flatten context as JSON; here it decodes
to a :class:`SubclassRecord`, which the state layer rebuilds. :func:`encode_value` and :func:`decode_value` are exact
inverses for what they accept (types included); :func:`check_state_tree` is what every reader
requires of a tree, and :func:`encode_state` runs it on the bytes a save is about to write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardsafe.core.dtypes import dtype_from_name, dtype_name
from shardsafe.core.format import MAX_DIMS, STATE_NAME, Manifest, check_tensor_key
from shardsafe.core.jsonsafe import MAX_JSON_DEPTH, check_json_string, dump_json, parse_json
from shardsafe.errors import FormatError, SaveError

__all__ = [
    "DTYPE_TAG",
    "SUBCLASS_TAG",
    "SubclassRecord",
    "TENSOR_REF",
    "TUPLE_TAG",
    "check_state_tree",
    "decode_value",
    "encode_state",
    "encode_value",
    "merge_values",
    "subclass_entry",
    "subclass_records",
    "state_tensor_keys",
]

TENSOR_REF = "__tensor__"
TUPLE_TAG = "__tuple__"
PAIRS_TAG = "__pairs__"
DTYPE_TAG = "__dtype__"
SUBCLASS_TAG = "__subclass__"
_TAGS = (TENSOR_REF, TUPLE_TAG, PAIRS_TAG, DTYPE_TAG, SUBCLASS_TAG)
_RECORD_FIELDS = frozenset({"class", "shape", "stride", "inner", "context"})
MAX_CLASS_NAME = 300


@dataclass(frozen=True)
class SubclassRecord:
    """A stored tensor subclass, decoded: ``inner`` holds what the lookup gave for each inner
    tensor (loaded tensors, or stand-ins while checking); ``context`` is still JSON (its types are
    decoded by the class's registration, state/subclasses.py). ``path`` is the tensor's own key:
    the inner tensors are stored as ``<path>/<inner name>``."""

    path: str
    cls: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    inner: dict[str, Any]
    context: Any


def subclass_entry(
    cls: str, shape: tuple[int, ...], stride: tuple[int, ...], inner_keys: dict[str, str], context: Any
) -> dict[str, Any]:
    """The ``state.json`` record of a tensor subclass stored by its parts (``context`` already JSON)."""
    return {
        SUBCLASS_TAG: {
            "class": cls,
            "shape": list(shape),
            "stride": list(stride),
            "inner": {name: {TENSOR_REF: key} for name, key in inner_keys.items()},
            "context": context,
        }
    }


def _int_list(value: Any, where: str, what: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_DIMS
        or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 62 for n in value)
    ):
        raise FormatError(f"{where}: a tensor subclass record's {what} is not a list of at most {MAX_DIMS} sizes")
    return tuple(value)


def _subclass_record(raw: Any, tensor_lookup: Any, where: str) -> SubclassRecord:
    """A ``__subclass__`` record, checked field by field (it comes from the file)."""
    if not isinstance(raw, dict) or set(raw) != _RECORD_FIELDS:
        raise FormatError(f"{where}: a tensor subclass record needs exactly the fields {sorted(_RECORD_FIELDS)}")
    cls, inner = raw["class"], raw["inner"]
    if not isinstance(cls, str) or not 0 < len(cls) <= MAX_CLASS_NAME:
        raise FormatError(f"{where}: a tensor subclass record's class is not a name")
    shape = _int_list(raw["shape"], where, "shape")
    stride = _int_list(raw["stride"], where, "stride")
    if len(stride) != len(shape):
        raise FormatError(f"{where}: a tensor subclass record's stride {list(stride)} does not fit its shape")
    if not isinstance(inner, dict) or not inner:
        raise FormatError(f"{where}: the {cls!r:.100} record has no inner tensors")
    path: str | None = None
    values: dict[str, Any] = {}
    for name, ref in inner.items():
        key = ref.get(TENSOR_REF) if isinstance(ref, dict) and len(ref) == 1 else None
        if not isinstance(key, str) or not name or "/" in name or not key.endswith("/" + name):
            raise FormatError(
                f"{where}: the {cls!r:.100} record's inner tensor {name!r:.100} is not a reference to "
                "<tensor key>/<inner name>"
            )
        own = key[: -len(name) - 1]
        if path is not None and own != path:
            raise FormatError(f"{where}: the {cls!r:.100} record's inner tensors belong to different keys")
        path = own
        values[name] = tensor_lookup(key)
    assert path is not None
    return SubclassRecord(path, cls, shape, stride, values, raw["context"])


def subclass_records(value: Any, where: str = STATE_NAME) -> dict[str, SubclassRecord]:
    """Every subclass record inside an encoded value, by its tensor's key (inner tensors not looked up)."""
    found: dict[str, SubclassRecord] = {}

    def walk(v: Any) -> None:
        if type(v) is dict:
            if len(v) == 1:
                if TENSOR_REF in v:  # most values: one test each
                    return
                if SUBCLASS_TAG in v:
                    record = _subclass_record(v[SUBCLASS_TAG], lambda key: None, where)
                    found[record.path] = record
                    return
            for item in v.values():
                if type(item) is dict or type(item) is list:
                    walk(item)
        elif type(v) is list:
            for item in v:
                if type(item) is dict or type(item) is list:
                    walk(item)

    walk(value)
    return found


def encode_value(value: Any, path: str, tensor_ref: Any, depth: int = 0) -> Any:
    """Turn a nested Python value into JSON; ``tensor_ref(path, tensor)`` returns a tensor's key.

    ``depth`` is the JSON depth of ``value`` (tags count): deeper than :data:`MAX_JSON_DEPTH` is
    refused here, as the reader would refuse it (and before a circular value recurses forever).
    """
    if depth > MAX_JSON_DEPTH:
        raise FormatError(
            f"state value at {path[:200]!r}: nested deeper than {MAX_JSON_DEPTH} levels (or circular); readers refuse "
            "deeper JSON"
        )
    if isinstance(value, str):
        check_json_string(value, f"state value at {path[:200]!r}")
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, torch.Tensor):
        ref = tensor_ref(path, value)  # a key, or a whole subclass record (see subclass_entry)
        return ref if isinstance(ref, dict) else {TENSOR_REF: ref}
    if isinstance(value, torch.dtype):
        return {DTYPE_TAG: dtype_name(value)}
    if isinstance(value, (tuple, torch.Size)):
        return {TUPLE_TAG: [encode_value(v, f"{path}/{i}", tensor_ref, depth + 2) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{path}/{i}", tensor_ref, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if isinstance(k, str):
                check_json_string(k, f"state value at {path[:200]!r}: dict key")
            elif not isinstance(k, (int, float, bool)) and k is not None:
                raise FormatError(
                    f"state value at {path!r}: dict key {k!r} of type {type(k).__name__} cannot be stored"
                )
        if all(isinstance(k, str) for k in value) and not any(t in value for t in _TAGS):
            return {k: encode_value(v, f"{path}/{k}", tensor_ref, depth + 1) for k, v in value.items()}
        pairs = [[k, encode_value(v, f"{path}/{k}", tensor_ref, depth + 3)] for k, v in value.items()]
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
        if tag == SUBCLASS_TAG:
            return _subclass_record(inner, tensor_lookup, where)
        if tag == PAIRS_TAG and isinstance(inner, list):
            out = {}
            for pair in inner:
                if (
                    not isinstance(pair, list)
                    or len(pair) != 2
                    or not (pair[0] is None or isinstance(pair[0], (str, int, float)))
                ):
                    raise FormatError(f"{where}: bad key/value pair {pair!r:.60}")
                out[pair[0]] = decode_value(pair[1], tensor_lookup, where)
            return out
    return {k: decode_value(v, tensor_lookup, where) for k, v in value.items()}


def state_tensor_keys(entry: Any, where: str = STATE_NAME) -> list[str]:
    """Every tensor key referenced inside an encoded value, in order (decoding it checks its tags)."""
    keys: list[str] = []

    def collect(key: str) -> None:
        keys.append(key)

    decode_value(entry, collect, where)
    return keys


def check_state_tree(tree: Any, where: str = STATE_NAME, manifest: Manifest | None = None) -> dict[str, list[str]]:
    """What every reader requires of a state tree: an object of entries, each an object with a
    string ``kind``; a per-rank entry has a non-empty list of ``ranks``; every tag decodes, and
    every tensor it refers to is a valid key (listed in ``manifest``, when given). Returns each
    entry's tensor keys. Run by load and verify on what they read, and by save on what it is
    about to write (:func:`encode_state`), so neither direction accepts what the other refuses."""
    if not isinstance(tree, dict):
        raise FormatError(f"{where}: not an object")
    keys: dict[str, list[str]] = {}
    for name, entry in tree.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
            raise FormatError(f"{where}: entry {name!r:.100} has no kind")
        if "ranks" in entry and "state" not in entry:
            ranks = entry["ranks"]
            if not isinstance(ranks, list) or not ranks:
                raise FormatError(f"{where}: {name!r:.100} has no per-rank entries")
            keys[name] = [k for r in ranks for k in state_tensor_keys(r, where)]
        else:
            keys[name] = state_tensor_keys(entry.get("state"), where)
        for key in keys[name]:
            check_tensor_key(key, f"{where}: {name!r:.100}")
            if manifest is not None and key not in manifest.tensors:
                raise FormatError(
                    f"{where}: {name!r:.100} refers to tensor {key!r:.200}, which the manifest does not list"
                )
    return keys


def encode_state(tree: dict[str, Any], where: str = STATE_NAME, compact: bool = False) -> bytes:
    """``state.json`` bytes for ``tree``, checked with the very parser and checks a load runs on them.

    ``compact``: without indentation (json's C encoder, several times faster), for a check before
    anything is written; the bytes then differ from the file's only in whitespace (the final,
    indented bytes are checked again before the commit: the size limit applies to those)."""
    data = dump_json(tree, where, compact)
    check_state_tree(parse_json(data, where), where)
    return data


# ----------------------------------------------------------------------------- merging the ranks' trees


def _is_plain_dict(value: Any) -> bool:
    """A JSON object that is a dict of the state (not a tagged tensor, tuple, pairs or dtype)."""
    return isinstance(value, dict) and not (len(value) == 1 and next(iter(value)) in _TAGS)


def _shown(value: Any) -> str:
    text = dump_json(value, "a merged value", compact=True).decode() if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def merge_values(values: list[tuple[int, Any]], where: str) -> Any:
    """One encoded value from ``(rank, value)`` pairs of several ranks: objects are merged key by key
    (a key only some ranks hold is taken from them: pipeline stages hold different layers), and
    anything else must be equal on every rank that holds it.

    Raises SaveError naming the first two ranks that disagree and where: one name in a checkpoint
    means one value, and which rank's copy a load would get must not depend on who wrote it.
    """
    first_rank, first = values[0]
    if all(_is_plain_dict(v) for _, v in values):
        keys: dict[str, None] = {}
        for _, v in values:
            keys.update(dict.fromkeys(v))
        return {k: merge_values([(r, v[k]) for r, v in values if k in v], f"{where}/{k}") for k in keys}
    for rank, value in values[1:]:
        if value != first or type(value) is not type(first):
            raise SaveError(
                f"{where[:300]}: rank {first_rank} saves {_shown(first)}, rank {rank} saves {_shown(value)}; a value "
                "several ranks save "
                "under one name must be the same on all of them (give per-stage values their own names, or make the "
                "object per_rank)"
            )
    return first
