"""How every command prints sizes and tables (one formatter, so `inspect` and `list` agree)."""

from __future__ import annotations

import argparse
from collections.abc import Collection


def format_bytes(n: float) -> str:
    """Decimal units (kB, MB, GB), as disk sizes are usually quoted."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def table(headers: list[str], rows: list[list[str]], right: Collection[int] = ()) -> list[str]:
    """Aligned columns; ``right`` holds the indices of right-aligned (numeric) columns."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  " + "  ".join(parts).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
