"""sim/core/scheduler.py stays the readable reference policy (issue 27): short enough to read top to
bottom, and with no empty hook that every step pays for while only a variant fills it (a variant
overrides the method that runs at that moment instead: sim/core/scheduler_variants.py)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = ROOT / "sim" / "core" / "scheduler.py"
MAX_LINES = 450


def _does_nothing(func: ast.FunctionDef) -> bool:
    """A body of only a docstring and/or `pass`."""
    for stmt in func.body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue
        return False
    return True


def test_scheduler_module_stays_short():
    lines = len(SCHEDULER.read_text().splitlines())
    assert lines <= MAX_LINES, f"sim/core/scheduler.py has {lines} lines, more than {MAX_LINES}"


def test_reference_scheduler_has_no_empty_hooks():
    tree = ast.parse(SCHEDULER.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"]
    empty = [f.name for f in cls.body if isinstance(f, ast.FunctionDef) and _does_nothing(f)]
    assert not empty, f"Scheduler methods that do nothing (hooks for a variant): {empty}"


def test_empty_body_is_detected():
    """The check above can fail: a hook like the removed `_batch_formed` is caught."""
    (func,) = ast.parse('def _batch_formed(self, batch):\n    """A pass formed a batch."""\n').body
    assert _does_nothing(func)
    (func,) = ast.parse("def f(self):\n    return False\n").body
    assert not _does_nothing(func)
