"""No import circle among kvtwin's modules (sim, engine, validate).

A circle means neither module can be read, tested or moved without the other. Two scans:
module-level imports (including those under a module-level `if` or `try`), where a circle can
break an import outright; and every import, since a lazy import inside a function only hides a
circle (sim/core/catalog.py <-> hf_config.py and validate/bench.py <-> compare_sweep.py were
such). Relative imports count. An import names the deepest project module it reaches (`from
sim.core import catalog` is sim.core.catalog); importing a module's package `__init__` is not counted.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sim", "engine", "validate")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run on import: the module's own, and those under its `if` / `try`."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return found


def import_graph(modules: dict[str, Path], lazy: bool = True) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (`lazy`), or at module level."""
    graph = {}
    for module, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in (ast.walk(tree) if lazy else _module_level(tree)):
            if isinstance(node, ast.Import):
                deps |= {_deepest(a.name, modules) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, path.name == "__init__.py")
                deps |= {_deepest(f"{base}.{a.name}", modules) for a in node.names}
        graph[module] = deps - {None, module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "lazy-included"])
def test_no_import_circle(lazy):
    graph = import_graph(project_modules(), lazy=lazy)
    found = cycles(graph)
    described = ["; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(group)))}" for m in group) for group in found]
    assert not found, "import circles:\n" + "\n".join(described)


def test_the_scan_finds_a_lazy_and_a_relative_circle(tmp_path):
    pkg = tmp_path / "sim"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from sim.core.b import g\n")
    (pkg / "core" / "b.py").write_text("from . import a\n")
    (pkg / "core" / "c.py").write_text("import sim.core.a\n")
    graph = import_graph(project_modules(tmp_path))
    assert graph["sim.core.b"] == {"sim.core.a"} and graph["sim.core.c"] == {"sim.core.a"}
    assert cycles(graph) == [["sim.core.a", "sim.core.b"]]
    assert cycles(import_graph(project_modules(tmp_path), lazy=False)) == []     # a's import is lazy
