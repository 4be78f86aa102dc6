"""`simrun`'s command line: help for every command without loading pandas, matplotlib or torch,
--version, `simrun help`, "did you mean" for mistyped commands, and the import-time check that
sim, engine and validate are kvtwin's own packages."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.cli import COMMANDS, main
from sim.ownership import ShadowedModuleError, check_top_level_modules

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("pandas", "matplotlib", "torch")

PROBE = """
import json, sys
from sim.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def run_help(*args: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    last = out.stdout.strip().splitlines()[-1]
    return json.loads(last), out.stdout + out.stderr


def available(command: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(COMMANDS[command].target.split(":")[0]) is not None
    except ModuleNotFoundError:            # its package is not there either
        return False


@pytest.mark.parametrize("args", [["-h"], ["--version"], ["help"],
                                  *[[c, "-h"] for c in COMMANDS]], ids=lambda a: " ".join(a))
def test_help_loads_no_heavy_module(args):
    if len(args) == 2 and not available(args[0]):
        pytest.skip(f"{args[0]}'s module is not in this tree")
    result, text = run_help(*args)
    assert result["code"] in (0, None), text
    assert result["heavy"] == [], f"simrun {' '.join(args)} imported {result['heavy']}"
    if len(args) == 2:
        assert "examples:" in text and f"simrun {args[0] if args[0] != 'run' else ''}".strip() in text


def test_top_help_lists_every_command(capsys):
    assert main(["-h"]) == 0
    out = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert f"  {name}" in out and command.summary in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("simrun (kvtwin) ")


def test_help_command_shows_the_commands_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["help", "plan"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: simrun plan" in out and "--target-rate" in out and "examples:" in out


def test_mistyped_command_suggests_the_closest(capsys):
    assert main(["plna", "x.yaml"]) == 2
    assert "unknown command 'plna': did you mean 'plan'?" in capsys.readouterr().err
    assert main(["help", "valdate"]) == 2
    assert "did you mean 'validate'?" in capsys.readouterr().err


def test_a_scenario_path_is_still_the_default_command(tmp_path, capsys):
    assert main([str(tmp_path / "missing.yaml")]) == 2          # a path, not a command
    assert "no such file" in capsys.readouterr().err


def test_own_packages_pass_the_check():
    check_top_level_modules()


def test_a_shadowing_package_is_refused(tmp_path):
    (tmp_path / "validate").mkdir()
    (tmp_path / "validate" / "__init__.py").write_text("")
    out = subprocess.run([sys.executable, "-c", "import sim"], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode != 0 and "ShadowedModuleError" in out.stderr
    assert f"would load {tmp_path / 'validate' / '__init__.py'}" in out.stderr


def test_a_hidden_package_is_named_in_a_warning(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    with pytest.warns(RuntimeWarning, match="hide other modules"):
        check_top_level_modules(path=[str(ROOT), str(tmp_path)], root=ROOT)
    with pytest.raises(ShadowedModuleError):
        check_top_level_modules(path=[str(tmp_path), str(ROOT)], root=tmp_path.parent / "elsewhere")


@pytest.mark.parametrize("plots", [False, True], ids=["no-plots", "plots"])
def test_a_run_imports_no_numpy_ma_in_the_main_process(tmp_path, plots):
    """np.percentile and np.unique import numpy.ma on first use (~15 ms a run, for nothing masked):
    the summary and the figures' reductions avoid both (the figure process imports it, through
    matplotlib). Same figures: tests/sim/test_exact_disk.py holds the percentiles to numpy's.
    Nor pandas (~0.4 s: pa.array and pa.scalar import it) nor pyarrow.compute (~0.2 G instructions):
    the CSV writer calls pyarrow's kernels through pyarrow._compute (sim/columns.py)."""
    args = ["scenarios/quickstart.yaml", "--set", "workload.num_requests=30", "--quiet",
            "--out", str(tmp_path / "run"), *([] if plots else ["--no-plots"])]
    probe = PROBE.replace("%r" % (HEAVY,), "('numpy.ma', 'pandas', 'pyarrow.compute')")
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "KVTWIN_PLOT_WORKERS": "2"},
                         timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "heavy": []}, out.stderr[-2000:]
