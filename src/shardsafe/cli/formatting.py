"""How every command prints sizes, counts, names and tables.

One formatter each, so `inspect`, `verify`, `list` and the demo agree, and one place that makes
text taken from a checkpoint safe to print: names and keys come from files an attacker may have
written, so control characters (ANSI escapes that rewrite the terminal, bidi overrides that
reorder it) and unpaired surrogates are shown escaped, never emitted.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Collection

__all__ = ["format_bytes", "natural_key", "plural", "positive_int", "printable", "table"]

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB", "EB")

# C0 and C1 controls (tab and newline allowed only where the caller says), unpaired surrogates
# (from non-UTF-8 file names or "\ud800" escapes in JSON), and the bidi controls of "Trojan Source".
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_LINE = re.compile("[\t\n\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, *, newlines: bool = False) -> str:
    """``str(text)`` with every character that could act on a terminal shown as an escape
    (``\\x1b``, ``\\u202e``); with ``newlines``, line breaks and tabs are kept (multi-line messages)."""
    return (_UNSAFE if newlines else _UNSAFE_LINE).sub(_escape, str(text))


def format_bytes(n: float) -> str:
    """Decimal units (kB, MB, GB), as disk sizes are usually quoted.

    Never raises: a size read from a hostile manifest may be an integer far beyond a float's
    range, or not finite, and is still shown (as ``~1e400 B``) rather than crashing the command.
    """
    if isinstance(n, float) and not math.isfinite(n):
        return f"{n} B"
    size = abs(n)
    if size >= 1000 ** len(_UNITS):
        return f"{'-' if n < 0 else ''}~1e{math.floor(math.log10(size))} B"
    for i, unit in enumerate(_UNITS):
        if size < 1000 ** (i + 1) or i == len(_UNITS) - 1:
            return f"{n:.0f} B" if i == 0 else f"{n / 1000**i:.1f} {unit}"
    raise AssertionError("unreachable")


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 file``, ``3 files``; ``many`` for irregular plurals (``plural(2, "entry", "entries")``)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def natural_key(text: str) -> tuple[tuple[int, str], ...]:
    """Sort key that orders digit runs by value: ``layer.2`` before ``layer.10``.

    ``re.split`` with a capturing group puts text at even and digit runs at odd positions, so two
    keys always compare text with text and numbers with numbers.
    """
    parts = re.split(r"(\d+)", text)
    return tuple((int(p), p) if i % 2 else (0, p) for i, p in enumerate(parts))


def table(headers: list[str], rows: list[list[str]], right: Collection[int] = ()) -> list[str]:
    """Aligned columns; ``right`` holds the indices of right-aligned (numeric) columns.

    Every cell goes through :func:`printable`, so a table of names read from a file is safe to print.
    """
    cells = [[printable(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(x) for x in col) for col in zip(*cells)]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  " + "  ".join(parts).rstrip()

    return [line(r) for r in cells]


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (steps, ranks, intervals)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
