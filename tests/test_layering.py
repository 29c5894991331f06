"""The import graph of the library, read from the source (ast), not by importing.

Layers, highest first: app -> connector -> transport, statemachines.  A
layer imports only layers below it; nothing in the library imports the
checkout-only ``bench`` package; and no module imports itself back through
other modules (an import circle), lazy imports inside functions included.
"""
from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("statemachines", "transport", "connector", "app")
KNOWN = LIBRARY + ("bench",)
# What each layer must not import (besides itself and the layers not named,
# which it may).
FORBIDDEN: dict[str, frozenset[str]] = {
    "statemachines": frozenset({"transport", "connector", "app", "bench"}),
    "transport": frozenset({"connector", "app", "bench"}),
    "connector": frozenset({"app", "bench"}),
    "app": frozenset({"bench"}),
}


@attrs.frozen
class Import:
    importer: str  # dotted module name without the kvplane prefix
    imported: str
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for layer in LIBRARY:
        folder = ROOT / layer
        if folder.is_dir():
            for path in sorted(folder.rglob("*.py")):
                found[_module_name(path)] = path
    return found


def _strip_namespace(name: str) -> str | None:
    """``kvplane.transport.wire`` -> ``transport.wire``; None outside our layers."""
    if name.startswith("kvplane."):
        name = name[len("kvplane."):]
    return name if name.split(".")[0] in KNOWN else None


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [_strip_namespace(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve(module, is_package, node.level, node.module) if node.level
                    else _strip_namespace(node.module or ""))
            if base is None:
                continue
            # ``from pkg import sub`` imports the submodule pkg.sub when there is one.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.extend(Import(module, n, node.lineno) for n in dict.fromkeys(names) if n is not None and n != module)
    return out


def _graph() -> tuple[dict[str, Path], list[Import]]:
    modules = _modules()
    edges = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    return modules, edges


def _cycles(nodes, edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    succ: dict[str, set[str]] = {n: set() for n in nodes}
    for e in edges:
        if e.imported in succ:
            succ[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for n in sorted(succ):
        if n not in index:
            visit(n)
    return found


def test_the_library_is_found():
    modules, edges = _graph()
    assert "statemachines.machine" in modules and "connector.driver" in modules
    assert any(e.importer == "statemachines.machine" and e.imported == "statemachines.validate" for e in edges)


def test_no_import_circle():
    modules, edges = _graph()
    assert _cycles(modules, edges) == []


@pytest.mark.parametrize("layer", LIBRARY)
def test_no_import_from_a_higher_layer(layer):
    _, edges = _graph()
    bad = [f"{e.importer}:{e.line} imports {e.imported}" for e in edges
           if e.importer.split(".")[0] == layer and e.imported.split(".")[0] in FORBIDDEN[layer]]
    assert bad == []


def test_the_checker_sees_a_circle_and_a_lazy_import(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from .b import g\n")
    b = tmp_path / "b.py"
    b.write_text("from . import a\n")
    mods = {"statemachines.a": a, "statemachines.b": b}
    edges = [i for n, p in mods.items() for i in imports_of(n, p, mods)]
    assert _cycles(mods, edges) == [["statemachines.a", "statemachines.b"]]
