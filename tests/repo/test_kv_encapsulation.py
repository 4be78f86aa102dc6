"""Outside the KV package (sim/core/kv/), no module reads how the cache is built.

The scheduler, the decode cohort, the leap planner, the simulator and the engine ask the KV
package questions (`KVCacheManager.layout()`, `is_one_full_attention_group`, `find_cached_prefix`
and a `KVCacheBlocks` they hand back unopened); they never branch on the flags that say which
coordinator or pool sits behind it. Checked statically over every source file outside the package.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import code_files

ROOT = Path(__file__).resolve().parents[2]
KV_PACKAGE = ROOT / "sim" / "core" / "kv"
# The attributes that say how a KV cache is built (the coordinator, the pool, the tables).
KV_FLAGS = {"sliding", "grouped", "contiguous", "block_ids", "coordinator", "full_ids", "sliding_ids",
            "sliding_managers"}
# Only these names are taken to hold a KV cache manager, its layout or its coordinator.
KV_HOLDERS = {"kv", "kv_manager", "manager", "layout", "coordinator"}


def _holder(node: ast.expr) -> str:
    """The name an attribute is read on: `kv` for `kv.x`, `self.kv.x` and `sched.kv.x`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):        # kv.layout().x
        return _holder(node.func)
    return ""


def kv_flag_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{node.lineno} {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in KV_FLAGS and _holder(node.value) in KV_HOLDERS]


@pytest.mark.parametrize("path", code_files(skip=KV_PACKAGE), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_outside_the_kv_package_reads_its_flags(path):
    found = kv_flag_reads(path)
    assert not found, "KV cache flags read outside sim/core/kv (ask the KV package a question instead):\n" + \
        "\n".join(found)


def test_the_scan_catches_a_flag_read():
    probe = ROOT / "sim" / "core" / "_kv_probe.py"
    try:
        probe.write_text("def f(sched, kv, cohort):\n"
                         "    return sched.kv.sliding, kv.grouped, cohort.layout.contiguous, kv.layout().block_ids, "
                         "kv.coordinator.window, kv.pool, sched.sliding\n")
        found = [line.split(" ", 1)[1] for line in kv_flag_reads(probe)]
        assert found == ["sched.kv.sliding", "kv.grouped", "cohort.layout.contiguous", "kv.layout().block_ids",
                         "kv.coordinator"]
    finally:
        probe.unlink()
