"""Field-level validation shared by every parser of the format: safe names, bounded integer lists,
typed fields, tensor keys and the size limits."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, TypeGuard

from shardsafe.errors import FormatError

__all__ = [
    "MAX_DIMS",
    "MAX_HASH_BLOCK_SIZE",
    "MAX_HEADER_BYTES",
    "MAX_NUMEL",
    "MIN_HASH_BLOCK_SIZE",
    "RESERVED_HEADER_NAME",
    "all_safe_components",
    "check_component",
    "check_tensor_key",
    "expect_field",
    "int_list",
    "is_int_list",
    "numel",
]

MAX_HEADER_BYTES = 256 << 20
MAX_NUMEL = 1 << 48
MAX_DIMS = 16
MIN_HASH_BLOCK_SIZE = 4 << 10
MAX_HASH_BLOCK_SIZE = 1 << 30
RESERVED_HEADER_NAME = "__metadata__"


# One rule for a safe name, in two forms: one name (``\Z`` ends it), and many names joined by
# "/" checked in one pass (a manifest names 10^4+ files). "/" is a character no safe name holds:
# once no name holds one, the joined form accepts exactly the lists whose every name the single
# form accepts.
_COMPONENT = r"(?!\.\.?{end})(?!~)[^/\\\x00]{{1,255}}"
_SAFE_COMPONENT = re.compile(_COMPONENT.format(end=r"\Z") + r"\Z")
_SAFE_JOINED = re.compile("(?:" + _COMPONENT.format(end="/") + "/)*\\Z")


def check_component(name: object, where: str) -> str:
    """A file or folder name that cannot leave its folder: one component, not '.' or '..', no '/',
    '\\' or NUL, not starting with '~', at most 255 characters."""
    if not isinstance(name, str) or _SAFE_COMPONENT.match(name) is None:
        raise FormatError(f"{where}: unsafe or invalid file name {name!r}")
    return name


def all_safe_components(names: Iterable[object]) -> bool:
    """Whether every name of ``names`` passes :func:`check_component`, in one regex pass (on False,
    check them one by one for the message)."""
    listed = list(names)
    if not all(type(n) is str for n in listed) or "/" in "".join(listed):  # type: ignore[arg-type]
        return False
    return _SAFE_JOINED.match("".join(f"{n}/" for n in listed)) is not None


def is_int_list(value: object, max_len: int = MAX_DIMS) -> TypeGuard[list[int]]:
    """Whether ``value`` is a list of at most ``max_len`` non-negative ints (bools and floats are not:
    ``True == 1`` and ``1.0 == 1`` would otherwise pass a comparison with an expected box). One
    C-speed pass, no message: the fast paths of the index and header parsers call it per entry."""
    return type(value) is list and len(value) <= max_len and all(type(v) is int and v >= 0 for v in value)


def int_list(value: object, where: str, *, max_len: int = MAX_DIMS) -> tuple[int, ...]:
    """A list of at most ``max_len`` non-negative ints (not bools), as a tuple. Called for every box of
    every index and header a load reads: the common case is :func:`is_int_list`, the checks below only
    run to say what is wrong."""
    if is_int_list(value, max_len):
        return tuple(value)
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


def expect_field(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise FormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FormatError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value
