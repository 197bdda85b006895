"""The table at the top of BENCHMARKS.md: per peer and operation, where shardsafe stands, from the sections below.

    .venv/bin/python benchmarks/summary.py BENCHMARKS.md       # make bench-summary; also the end of make bench

Each benchmark rewrites its own section; this reads those sections' tables (nothing is measured or typed in
here) and writes the summary between ``<!-- summary -->`` and ``<!-- /summary -->``, which
``benchmarks/run.py`` keeps when it rewrites the top of the file. A section missing or laid out
differently gives no row rather than a wrong one.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

START, END = "<!-- summary -->", "<!-- /summary -->"
Row = dict[str, str]


class Line(NamedTuple):
    """One row of the summary: who against whom, doing what, the ratio (above 1: shardsafe faster or smaller)."""

    peer: str
    operation: str
    ratio: str
    spread: str
    section: str


def sections(text: str) -> dict[str, str]:
    """``## heading`` -> its text (up to the next ``## ``)."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def tables(body: str) -> Iterator[list[Row]]:
    """Each markdown table of ``body`` as rows keyed by the header's cells."""
    block: list[str] = []
    for line in [*body.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if len(block) > 2:
            header = _cells(block[0])
            yield [dict(zip(header, _cells(row))) for row in block[2:]]
        block = []


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _first(body: str) -> list[Row]:
    return next(tables(body), [])


def _range_of(cell: str) -> tuple[str, str]:
    """``0.63x (0.18-1.86)`` -> (``0.63x``, ``0.18-1.86``)."""
    m = re.match(r"\s*([\d.]+x?)\s*(?:\(([\d.]+-[\d.]+)\))?", cell)
    return (m.group(1), m.group(2) or "") if m else (cell, "")


def _inverse(cell: str) -> str:
    """A time ratio shardsafe/peer as a speed ratio peer/shardsafe (``0.63x`` -> ``1.59x``)."""
    m = re.match(r"\s*([\d.]+)x", cell)
    return f"{1 / float(m.group(1)):.2f}x" if m and float(m.group(1)) else cell


def _seconds(cell: str) -> float | None:
    m = re.match(r"\s*([\d,.]+)\s*(ms|s)\b", cell)
    if not m:
        return None
    value = float(m.group(1).replace(",", ""))
    return value / 1000 if m.group(2) == "ms" else value


def core(body: str) -> list[Line]:
    out = []
    for row in _first(body):
        what, ratio = row.get("median of runs", ""), row.get("shardsafe is", "")
        if what and ratio.endswith("DCP") and "RSS" not in what:
            out.append(Line("DCP", what + " (3 GiB FSDP2 state)", ratio.removesuffix(" DCP"), "", "Results"))
    return out


def scale_real(body: str) -> list[Line]:
    """Its header repeats column names (save's and load's): cells by position."""
    out = []
    for line in body.splitlines():
        cells = _cells(line) if line.startswith("|") else []
        if len(cells) >= 7 and cells[0] == "16":
            out += [
                Line("DCP", "save, 16 ranks, 2,000 small tensors", cells[3], "", "Scale (real processes)"),
                Line("DCP", "load, 16 ranks, 2,000 small tensors (cold)", cells[6], "", "Scale (real processes)"),
            ]
    return out


def cold_load_2(body: str) -> list[Line]:
    return [
        Line("DCP", f"load 2 ranks into {row['load into']} (cold)", row["shardsafe vs DCP"], "", "Cold load (2 ranks)")
        for row in _first(body)
        if row.get("shardsafe vs DCP")
    ]


def nd(body: str) -> list[Line]:
    out = []
    for row in _first(body):
        op = row.get("operation", "")
        if row.get("shardsafe speed vs DCP"):
            out.append(Line("DCP", f"{op}, 4 ranks dp x tp", row["shardsafe speed vs DCP"], "", _ND))
        if row.get("vs torch-checkpointing"):
            out.append(Line("torch-checkpointing", f"{op}, 4 ranks dp x tp", row["vs torch-checkpointing"], "", _ND))
    return out


_ND = "N-D save and load (4 ranks, dp=2 x tp=2)"


def manager(body: str) -> list[Line]:
    """The paired-ratio table (shardsafe / peer times, medians with ranges): as speed ratios."""
    out = []
    for table in tables(body):
        if not table or "vs" not in table[0] or "blocked" not in table[0]:
            continue
        for row in table:
            if row.get("shardsafe") != "async":
                continue
            for op in ("blocked", "durable"):
                ratio, spread = _range_of(row[op])
                low_high = spread.split("-") if spread else []
                inverse_spread = (
                    f"{1 / float(low_high[1]):.2f}-{1 / float(low_high[0]):.2f}"
                    if len(low_high) == 2 and float(low_high[0])
                    else ""
                )
                line = Line(row["vs"], f"async save, time {op}", _inverse(ratio), inverse_spread, "CheckpointManager")
                out.append(line)
    return out


def two_rows(peer: str, operation: str, section: str, column: str) -> Callable[[str], list[Line]]:
    """Sections whose first table has shardsafe's row first and the peer's second, times in ``column``."""

    def extract(body: str) -> list[Line]:
        rows = _first(body)
        if len(rows) < 2:
            return []
        ours, theirs = _seconds(rows[0].get(column, "")), _seconds(rows[1].get(column, ""))
        if not ours or not theirs:
            return []
        return [Line(peer, operation, f"{theirs / ours:.2f}x", "", section)]

    return extract


def _unquoted(cell: str) -> str:
    """A cell that is one code span (```x```) without its backticks; any other cell as it is."""
    if len(cell) > 1 and cell.startswith("`") and cell.endswith("`") and cell.count("`") == 2:
        return cell[1:-1]
    return cell


def speedup_table(peer: str, section: str, ours: str, theirs: str) -> Callable[[str], list[Line]]:
    """Sections with one row per operation and a column of times for each library."""

    def extract(body: str) -> list[Line]:
        out = []
        for row in _first(body):
            op = next(iter(row.values()), "")
            a, b = _seconds(row.get(ours, "")), _seconds(row.get(theirs, ""))
            if op and a and b:
                out.append(Line(peer, _unquoted(op), f"{b / a:.2f}x", "", section))
        return out

    return extract


def guard(body: str) -> list[Line]:
    """bench-compare's table against DCP: HEAD's column (with its range over the rounds)."""
    out = []
    for table in tables(body):
        if table and "HEAD" in table[0] and "probe" in table[0] and "operation" in table[0]:
            for row in table:
                ratio, spread = _range_of(row["HEAD"])
                out.append(Line("DCP", f"{row['operation']}, {row['probe']}", ratio, spread, GUARD))
    return out


GUARD = "Change guard: HEAD against a reference commit"
EXTRACTORS: dict[str, Callable[[str], list[Line]]] = {
    "Results": core,
    GUARD: guard,
    "Scale (real processes)": scale_real,
    "Cold load (2 ranks)": cold_load_2,
    _ND: nd,
    "CheckpointManager": manager,
    "Export": two_rows("transformers save_pretrained", "export a 2-rank FSDP2 model", "Export", "wall time"),
    "DeepSpeed export": two_rows("DeepSpeed zero_to_fp32", "ZeRO-3 to safetensors", "DeepSpeed export", "wall time"),
    "Lightning (2 ranks, FSDP2)": speedup_table(
        "Lightning ModelParallelStrategy",
        "Lightning (2 ranks, FSDP2)",
        "ShardsafeModelParallelStrategy",
        "Lightning ModelParallelStrategy",
    ),
    "torchtitan checkpoint managers (4 ranks, dp_shard=2 x tp=2)": speedup_table(
        "torchtitan DCP CheckpointManager",
        "torchtitan checkpoint managers (4 ranks, dp_shard=2 x tp=2)",
        "ShardsafeCheckpointManager",
        "torchtitan DCP CheckpointManager",
    ),
}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return "#" + re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def render(found: list[Line]) -> str:
    lines = [
        START,
        "## Where shardsafe stands",
        "",
        "Collected from the sections below by `benchmarks/summary.py` (`make bench-summary`); each ratio is the peer's "
        "time over shardsafe's in the same run (above 1: shardsafe faster), the median of that section's runs; the "
        "range is over the runs where the section records it. Each section says when, on which commit and under "
        "what machine load it ran.",
        "",
        "| peer | operation | peer's time / shardsafe's | range | section |",
        "|---|---|---:|---|---|",
    ]
    for line in sorted(found, key=lambda l: (l.peer != "DCP", l.peer, l.section)):
        lines.append(
            f"| {line.peer} | {line.operation} | {line.ratio} | {line.spread or '-'} | "
            f"[{line.section}]({_anchor(line.section)}) |"
        )
    return "\n".join([*lines, "", END]) + "\n"


def summarize(md: Path) -> str:
    text = md.read_text()
    found = [line for name, body in sections(text).items() if name in EXTRACTORS for line in EXTRACTORS[name](body)]
    block = render(found)
    if START in text and END in text:
        before, rest = text.split(START, 1)
        new = before + block.rstrip("\n") + rest.split(END, 1)[1]
    else:
        marker = "\n## Results\n"
        head, tail = text.split(marker, 1) if marker in text else (text, "")
        new = head.rstrip("\n") + "\n\n" + block + (marker + tail if tail else "")
    md.write_text(new)
    return block


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1] if len(sys.argv) > 1 else "BENCHMARKS.md")))
