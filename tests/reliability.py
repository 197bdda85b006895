"""What the fault-injection and hostile-input tests tried, counted for docs/RELIABILITY.md.

A test calls :func:`record` once its assertions have passed (so every recorded case lost no
data: a lost or altered checkpoint fails the test before it records). Records go, one JSON
object a line, to the file named by ``SHARDSAFE_RELIABILITY_LOG``; unset (the normal run),
:func:`record` does nothing. The table::

    rm -f /tmp/reliability.jsonl
    SHARDSAFE_RELIABILITY_LOG=/tmp/reliability.jsonl .venv/bin/python -m pytest -q -m "stress or not stress" \\
        tests/faults/test_crash.py tests/api/test_corruption.py tests/faults/test_faults_crash.py
        tests/faults/test_faults_io.py \\
        tests/api/test_hostile.py tests/core/test_properties.py tests/api/test_atomic_load.py
    .venv/bin/python tests/reliability.py /tmp/reliability.jsonl
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections import defaultdict
from pathlib import Path


def record(category: str, *, cases: int = 1, faults: int = 0, checked: int = 0, note: str = "") -> None:
    """Count ``cases`` cases of ``category`` that injected ``faults`` faults and found ``checked``
    earlier checkpoints (or states) intact, bit for bit."""
    target = os.environ.get("SHARDSAFE_RELIABILITY_LOG")
    if not target:
        return
    line = json.dumps({"category": category, "cases": cases, "faults": faults, "checked": checked, "note": note}) + "\n"
    with open(target, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)


def table(path: str | os.PathLike[str]) -> str:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        row = totals[entry["category"]]
        row[0] += entry["cases"]
        row[1] += entry["faults"]
        row[2] += entry["checked"]
    lines = [
        "| what the suite tries | cases | faults / hostile inputs injected | earlier checkpoints / states checked "
        "bit-exact | data lost |",
        "|---|---:|---:|---:|---:|",
    ]
    for category in sorted(totals):
        cases, faults, checked = totals[category]
        lines.append(f"| {category} | {cases} | {faults} | {checked} | 0 |")
    cases, faults, checked = (sum(r[i] for r in totals.values()) for i in range(3))
    lines.append(f"| **total** | **{cases}** | **{faults}** | **{checked}** | **0** |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
