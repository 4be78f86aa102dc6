"""The import directions of docs/architecture.md's "Layers": core <- simulation <- output/whatif <- cli,
and the engine's model side on core only. Checked statically (every import, lazy ones included)
and, for `sim.core`, by what importing it actually loads."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# the layer a module belongs to, from its dotted name
def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "sim":
        if len(parts) == 1:
            return "simulation"
        if parts[1] in ("core", "output", "whatif", "vllm"):
            return parts[1]
        return "cli" if parts[1] == "cli" else "simulation"
    if parts[0] == "engine":
        return "engine_front" if len(parts) > 1 and parts[1] in ("replay", "serve") else "engine"
    return parts[0]


ALLOWED = {
    "core": {"core"},
    "simulation": {"core", "simulation"},
    "output": {"core", "simulation", "output"},
    "whatif": {"core", "simulation", "output", "whatif"},
    # vLLM interop (serve flags, result files, logs): reads files, writes scenarios
    "vllm": {"core", "simulation", "output", "vllm"},
    "cli": {"core", "simulation", "output", "whatif", "vllm", "cli"},
    # the model, runner, kernels: the shared policy only, never the simulator
    "engine": {"core", "engine"},
    # replay and the server drive the engine from scenarios: they sit beside the cli
    "engine_front": {"core", "simulation", "output", "engine", "engine_front"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] in ("sim", "engine")]


def source_files():
    for package in ("sim", "engine"):
        yield from sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", list(source_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_the_allowed_way(path):
    own = layer_of(module_name(path))
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name} ({layer_of(name)})"
             for line, name in project_imports(path) if layer_of(name) not in ALLOWED[own]]
    assert not wrong, f"{own} may import only {sorted(ALLOWED[own])}:\n" + "\n".join(wrong)


def test_layer_rule_catches_a_wrong_import(tmp_path):
    bad = ROOT / "sim" / "core" / "_layer_probe.py"
    try:
        bad.write_text("from sim.simulator import simulate\n")
        wrong = [n for _, n in project_imports(bad) if layer_of(n) not in ALLOWED["core"]]
        assert wrong == ["sim.simulator"]
    finally:
        bad.unlink()


def test_importing_core_loads_no_heavy_dependency():
    code = ("import sys, json, sim.core.scheduler, sim.core.kv, sim.core.memory, sim.core.fast.cohort, "
            "sim.core.request, sim.core.catalog; print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout)
    heavy = {"simpy", "pandas", "torch", "matplotlib", "triton", "sim.simulator", "sim.output"}
    assert not heavy & {m.split(".")[0] if not m.startswith("sim.") else m for m in loaded}
