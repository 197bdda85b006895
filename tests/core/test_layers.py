"""The parts of the layer contract import-linter has no contract type for (the layers themselves
are in pyproject.toml and checked by ``lint-imports`` in ``make lint``).

* no import cycle between any two modules of the package, lazy imports included;
* no module below the package root imports the root (``import shardsafe``): the root only
  re-exports, so importing it from inside would be an upward import of everything;
* no module imports another module's private name (``from x import _helper``): what crosses a
  module boundary is public and named as such.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

SRC = Path(__file__).resolve().parents[2] / "src" / "shardsafe"


@pytest.fixture(scope="module")
def graph():  # type: ignore[no-untyped-def]
    return grimp.build_graph("shardsafe", cache_dir=None)


def _cycles(graph) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    modules = sorted(m for m in graph.modules if m.startswith("shardsafe"))
    edges = {
        m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x.startswith("shardsafe")) for m in modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in modules:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            succ = edges.get(node, [])
            if i < len(succ):
                work.append((node, i + 1))
                nxt = succ[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_no_import_cycles(graph) -> None:  # type: ignore[no-untyped-def]
    # The root re-exports from its submodules; that they never import it back is the next test.
    cycles = [c for c in _cycles(graph) if "shardsafe" not in c]
    assert cycles == [], f"import cycles: {cycles}"


def test_no_module_imports_the_package_root(graph) -> None:  # type: ignore[no-untyped-def]
    offenders = sorted(m for m in graph.find_modules_that_directly_import("shardsafe") if m != "shardsafe")
    assert offenders == [], f"modules importing the package root (import the defining module instead): {offenders}"


def _private_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardsafe"):
            for alias in node.names:
                if alias.name.startswith("_") and alias.name != "__version__":
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_no_private_names_cross_modules() -> None:
    found = [hit for path in sorted(SRC.rglob("*.py")) for hit in _private_imports(path)]
    assert found == [], "private names imported across modules:\n" + "\n".join(found)


def test_architecture_doc_matches_the_package() -> None:
    """docs/ARCHITECTURE.md's layer tables are generated from the package: `make docs` after moving a module."""
    import subprocess
    import sys

    tool = SRC.parents[1] / "tools" / "architecture.py"
    result = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
