"""core/faults.py: the crash-point registry matches the code, both ways, found by reading the source.

* every ``crash_point(...)`` call in ``src/shardsafe`` names its point with a string literal, and
  that point is in :data:`~shardsafe.core.faults.POINTS` (an unregistered point is one no test
  enumerating the registry can arm);
* every registered point is passed somewhere (a stale entry promises a hook that no longer exists);
* every point a test arms by name (``"save:mid-write@1"`` and the like) is registered: a misspelt
  point would never fire, and the test arming it would pass without testing anything.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from shardsafe.core import faults
from shardsafe.core.faults import POINTS

SRC = Path(faults.__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parents[1]
ARMED = re.compile(r"""["']((?:save|async|retention|push|load|gc):[a-z][a-z-]*)(?:@\d+)?["']""")


def _calls() -> list[tuple[str, int, ast.Call]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == faults.__name__:
                aliased = [a.name for a in node.names if a.asname is not None]
                assert not aliased, (
                    f"{path}:{node.lineno}: {aliased} imported under another name would hide from this scan"
                )
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name == "crash_point":
                    out.append((str(path.relative_to(SRC)), node.lineno, node))
    return out


def _used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for where, line, call in _calls():
        if where == "core/faults.py":
            continue
        first = call.args[0] if call.args else None
        assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
            f"{where}:{line}: crash_point needs a literal point name"
        )
        used.setdefault(first.value, []).append(f"{where}:{line}")
    return used


def test_the_scan_finds_the_calls() -> None:
    used = _used()
    assert (
        len(used) >= 10 and "save:mid-write" in used and any(w.startswith("storage/") for w in used["save:mid-write"])
    )


def test_every_point_used_is_registered() -> None:
    unregistered = {point: where for point, where in _used().items() if point not in POINTS}
    assert not unregistered, f"crash points used but not in core/faults.POINTS: {unregistered}"


def test_every_registered_point_is_used() -> None:
    assert len(POINTS) == len(set(POINTS)), "a point registered twice"
    unused = set(POINTS) - set(_used())
    assert not unused, f"registered in core/faults.POINTS but passed nowhere in src: {sorted(unused)}"


def test_every_point_a_test_arms_is_registered() -> None:
    armed: dict[str, str] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for match in ARMED.finditer(path.read_text()):
            armed.setdefault(match.group(1), str(path.relative_to(TESTS)))
    assert len(armed) >= 5, armed
    unknown = {point: where for point, where in armed.items() if point not in POINTS}
    assert not unknown, f"tests arm crash points that do not exist: {unknown}"
