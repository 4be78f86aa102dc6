"""bench/instructions.py: its driver runs every line's scenario in a tree, and bad trees are refused."""
import argparse
import subprocess
import sys

import pytest

from bench.instructions import DRIVER, ENTRY, LINES, ROOT, _tree


@pytest.mark.parametrize("line", ["vidur-one-by-one", "gpt-oss-sliding", "mistral-sliding"])
def test_the_driver_simulates_each_kind_of_line(line):
    name, _, fast, overrides = LINES[line]
    argv = [sys.executable, "-c", DRIVER + "\nprint('recorded', len(records.requests))",
            str(ROOT / "scenarios" / f"{name}.yaml"), "20", "1" if fast else "0", "0", "simulate", *overrides]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "recorded 20"


@pytest.mark.parametrize("line", sorted(ENTRY))
def test_the_driver_runs_the_users_path_of_each_user_line(line):
    """vidur-predict runs predict(), vidur-simrun simrun's entry point with --no-plots --quiet,
    vidur-simrun-plots without --no-plots, vidur-simrun-terminal without --quiet and with its
    output on a terminal, after the same set-up; sweep-task a sweep's point as a worker runs it, after
    a small point at another seed."""
    name, _, fast, overrides = LINES[line]
    simrun = ("import sys, sim.cli as c; c.main = lambda argv: print('simrun', *argv[:3], '--no-plots' in argv, "
              "'--quiet' in argv, sys.stdout.isatty(), sys.stderr.isatty(), file=sys.__stdout__) or 0")
    point = ("import sim.whatif.sweep as w; w.run_point = lambda t: print('point', t.label, t.scenario().seed, "
             "t.scenario().workload.num_requests, t.scenario().workload.arrival.rate) or {}")
    probe = {"predict": "import sim.predict as p; p.predict = lambda s: print('predicted', s.workload.num_requests)",
             "simrun": simrun, "simrun-plots": simrun, "simrun-terminal": simrun, "sweep-task": point}[ENTRY[line]]
    argv = [sys.executable, "-c", probe + "\n" + DRIVER,
            str(ROOT / "scenarios" / f"{name}.yaml"), "20", "1" if fast else "0", "0", ENTRY[line], *overrides]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    simrun = f"simrun {ROOT / 'scenarios' / (name + '.yaml')} --set workload.num_requests=20"
    expected = {"predict": "predicted 20", "simrun": f"{simrun} True True False False",
                "simrun-plots": f"{simrun} False True False False", "simrun-terminal": f"{simrun} True False True True",
                "sweep-task": "point warm 1 50 200.0\npoint point 0 20 200.0"}
    assert out.stdout.strip() == expected[ENTRY[line]]


def test_a_tree_must_be_label_equals_a_checkout(tmp_path):
    assert _tree(f"base={ROOT}") == ("base", ROOT)
    for bad in (str(ROOT), f"base={tmp_path}"):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=DIR"):
            _tree(bad)
