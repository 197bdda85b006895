"""benchmarks/summary.py: the table at the top of BENCHMARKS.md is read from the sections below it.

Guards against drift: every section the summary knows, as it stands in BENCHMARKS.md today, yields at least
one row (a benchmark whose table changed shape would otherwise silently drop out of the summary), and
writing the block twice leaves one block.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
summary = pytest.importorskip("summary")


def test_every_known_section_of_benchmarks_md_gives_rows() -> None:
    found = summary.sections((REPO / "BENCHMARKS.md").read_text())
    for name, extract in summary.EXTRACTORS.items():
        if name in found:
            rows = extract(found[name])
            assert rows, f"section {name!r} of BENCHMARKS.md gives no summary row: did its table change shape?"
            for row in rows:
                assert row.ratio.endswith("x") and float(row.ratio.rstrip("x")) > 0, (name, row)


def test_the_block_goes_before_results_once_and_is_replaced(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    shutil.copy(REPO / "BENCHMARKS.md", md)
    text = md.read_text()
    if summary.START in text:  # start from a file without the block
        before, rest = text.split(summary.START, 1)
        md.write_text(before + rest.split(summary.END, 1)[1])
    first = summary.summarize(md)
    second = summary.summarize(md)
    text = md.read_text()
    assert first == second and text.count(summary.START) == 1 and text.count(summary.END) == 1
    assert text.index(summary.END) < text.index("\n## Results\n")
