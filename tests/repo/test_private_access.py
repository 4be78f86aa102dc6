"""No module reads another module's private names.

A name with one leading underscore is its module's own: a module may read `obj._name` only when
`_name` is defined in that same module (an attribute it assigns, a slot, a function or class it
defines), and may not import `_name` from another project module. `self._x` and `cls._x` are
always the object's own. Checked statically over every source file (the tests are exempt: they
may look inside what they test).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import CODE_PACKAGES, code_files

ROOT = Path(__file__).resolve().parents[2]
PROJECT = set(CODE_PACKAGES)

# Private names of code outside the project, read on purpose: (file, `obj._name`) -> why.
ALLOWED = {
    ("validate/gpu_check.py", "os._exit"): "the standard library's documented exit without cleanup",
    ("sim/output/workers.py", "os._exit"): "the standard library's documented exit without cleanup",
    ("engine/kernels/aot.py", "kernel._pack_args"): "Triton's launcher packs the arguments of an AOT kernel",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: attributes it assigns, slots, functions, classes, globals."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _private(n)}


def private_reads(path: Path) -> list[str]:
    """`file:line obj._name` for each read of another module's private name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = defined_names(tree)
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            text = ast.unparse(node)
            if (rel, text) not in ALLOWED:
                found.append(f"{rel}:{node.lineno} {text}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PROJECT:
            found += [f"{rel}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                      if _private(a.name)]
    return found


@pytest.mark.parametrize("path", code_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_reads_another_modules_private_names(path):
    found = private_reads(path)
    assert not found, "private names read across modules (make them public, or ask through a method):\n" + \
        "\n".join(found)


def test_the_scan_catches_a_private_read():
    probe = ROOT / "sim" / "core" / "_private_probe.py"
    try:
        probe.write_text("from sim.core.fast.cohort import _run_seq\n\n"
                         "def f(sched, req):\n    self = sched\n    return req._computed + self._mine + sched._step\n")
        found = [line.split(" ", 1)[1] for line in private_reads(probe)]
        assert sorted(found) == ["from sim.core.fast.cohort import _run_seq", "req._computed", "sched._step"]
    finally:
        probe.unlink()
