"""What each module offers is declared: ``__all__`` in every public module of ``src/shardsafe``, kept true.

Read from the source (no imports, so it runs in a second):

* every module whose dotted name has no part starting with ``_`` defines a literal ``__all__``;
* every name in an ``__all__`` is bound at the module's top level (not only under ``TYPE_CHECKING``),
  listed once;
* every name one shardsafe module imports from another (``from shardsafe.x import name``, lazy
  imports included) is in that module's ``__all__``: what crosses a module boundary is declared.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_dotted(p): p for p in sorted((SRC / "shardsafe").rglob("*.py")) if p.name != "__main__.py"}
PUBLIC = sorted(m for m in MODULES if not any(part.startswith("_") for part in m.split(".")))


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), str(MODULES[module]))


def _declared(module: str) -> list[str] | None:
    for node in _tree(module).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert node.value is not None, f"{module}: __all__ without a value"
            value = ast.literal_eval(node.value)
            assert isinstance(value, list) and all(isinstance(n, str) for n in value), (
                f"{module}: __all__ must be a literal list of names"
            )
            return value
    return None


def _bound(module: str) -> set[str]:
    """Names bound at the top level at run time (an ``if TYPE_CHECKING:`` body is not)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    names.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.If) and "TYPE_CHECKING" not in ast.unparse(n.test):
                visit(n.body)
                visit(n.orelse)
            elif isinstance(n, ast.Try):
                visit(n.body)
                for handler in n.handlers:
                    visit(handler.body)
                visit(n.orelse)
                visit(n.finalbody)

    visit(_tree(module).body)
    return names


def test_every_public_module_declares_all() -> None:
    missing = [m for m in PUBLIC if _declared(m) is None]
    assert len(PUBLIC) > 100 and not missing, f"public modules without __all__: {missing}"


def test_every_declared_name_exists() -> None:
    problems = []
    for module in PUBLIC:
        declared = _declared(module) or []
        if len(declared) != len(set(declared)):
            problems.append(f"{module}: a name listed twice")
        unbound = sorted(set(declared) - _bound(module))
        if unbound:
            problems.append(f"{module}: __all__ names {unbound}, not bound there")
    assert not problems, "\n".join(problems)


def test_every_name_imported_across_modules_is_declared() -> None:
    undeclared: dict[str, set[str]] = {}
    for importer in MODULES:
        for node in ast.walk(_tree(importer)):
            if (
                not isinstance(node, ast.ImportFrom)
                or node.level
                or node.module not in MODULES
                or node.module == importer
            ):
                continue
            declared = set(_declared(node.module) or [])
            for alias in node.names:
                name = alias.name
                if name.startswith("_") or f"{node.module}.{name}" in MODULES or name in declared:
                    continue
                undeclared.setdefault(f"{node.module}.{name}", set()).add(importer)
    assert not undeclared, "imported from another module but not in its __all__:\n" + "\n".join(
        f"  {name} (by {', '.join(sorted(by))})" for name, by in sorted(undeclared.items())
    )
