"""JSON in and out, bounded: what every reader of a checkpoint's JSON files accepts.

Size at most :data:`MAX_JSON_BYTES`, depth at most :data:`MAX_JSON_DEPTH`, no duplicate keys. The
writer side (:func:`dump_json`) turns everything json cannot write faithfully into a FormatError,
so a save fails before writing rather than with a TypeError or RecursionError halfway.
"""

from __future__ import annotations

import json
import re
from typing import Any

from shardsafe.errors import FormatError

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "check_depth",
    "check_json_string",
    "check_plain_json",
    "dump_json",
    "parse_json",
]

MAX_JSON_BYTES = 1 << 30
MAX_JSON_DEPTH = 64
_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # one C-speed pass; a key seen twice makes the dict shorter than the pairs
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                shown = key if len(key) <= 64 else key[:64] + "..."  # a name, never a long run of the file's text
                raise FormatError(f"duplicate JSON key {shown!r}")
            seen.add(key)
    return out


def check_depth(value: Any, where: str) -> None:
    """No value deeper than :data:`MAX_JSON_DEPTH` (the root is at depth 0): one level at a time,
    only containers visited, so a wide document costs one pass over its containers."""
    level = [value] if type(value) in (dict, list) else []
    depth = 0
    while level:
        if depth >= MAX_JSON_DEPTH and any(level):
            raise FormatError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        below: list[Any] = []
        for item in level:
            below += [c for c in (item.values() if type(item) is dict else item) if type(c) in (dict, list)]
        level, depth = below, depth + 1


def parse_json(data: bytes, where: str, *, depth: bool = True) -> Any:
    """Parse untrusted JSON: bounded size and depth, no duplicate keys.

    ``depth=False``: the caller checks the depth of the parts it keeps (:func:`check_depth`), for
    a document whose shape it validates field by field and whose other parts it drops (the
    manifest: 16,384 file entries would cost a tenth of a second to walk). json itself stops at
    Python's recursion limit either way."""
    if len(data) > MAX_JSON_BYTES:
        raise FormatError(f"{where}: {len(data)} bytes of JSON is more than the {MAX_JSON_BYTES} allowed")
    try:
        value = json.loads(data, object_pairs_hook=_reject_duplicates)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply") from None
    except UnicodeDecodeError as exc:  # its message quotes the file's bytes: only say where
        raise FormatError(f"{where}: not valid JSON (not UTF-8 at byte {exc.start})") from None
    except ValueError as exc:  # json's own message gives the line and column, no content
        raise FormatError(f"{where}: not valid JSON ({exc})") from None
    if depth:
        check_depth(value, where)
    return value


def dump_json(value: Any, where: str = "JSON", compact: bool = False) -> bytes:
    """Encode ``value`` (indented, for people reading the files; ``compact``: one line, json's fast C
    encoder); anything json cannot write faithfully is a FormatError naming ``where`` (an int of
    more than 4300 digits, a circular or absurdly deep value, an unsupported type)."""
    try:
        return json.dumps(value, indent=None if compact else 1, sort_keys=False).encode()
    except RecursionError:
        raise FormatError(f"{where}: value nested too deeply to store (at most {MAX_JSON_DEPTH} levels)") from None
    except (ValueError, TypeError) as exc:
        raise FormatError(f"{where}: cannot be stored as JSON ({exc})") from None


def check_json_string(text: str, where: str) -> None:
    """Refuse a string JSON cannot give back as it is: a high surrogate followed by a low one is
    written as two escapes that every reader decodes as one character. (Lone surrogates survive.)"""
    if not text.isascii() and _SURROGATE_PAIR.search(text):
        raise FormatError(
            f"{where}: {text[:40]!r} holds a surrogate pair (two code points JSON reads back as one character)"
        )


def check_plain_json(value: Any, where: str) -> None:
    """Refuse what json.dumps would silently change in a plain-JSON value (user metadata): dict keys
    that are not strings (``1`` becomes ``"1"``, and ``{1: a, "1": b}`` a duplicate key that every
    reader refuses) and strings holding surrogate pairs."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise FormatError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels (or circular)")
        if isinstance(item, str):
            check_json_string(item, where)
        elif isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise FormatError(f"{where}: dict key {k!r:.60} is a {type(k).__name__}; JSON keys must be strings")
                check_json_string(k, where)
                stack.append((v, depth + 1))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
