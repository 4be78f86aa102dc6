"""bench/instructions.py: its driver runs every line's scenario in a tree, and bad trees are refused."""
import argparse
import subprocess
import sys

import pytest

from bench.instructions import DRIVER, LINES, ROOT, _tree


@pytest.mark.parametrize("line", ["vidur-one-by-one", "gpt-oss-sliding", "mistral-sliding"])
def test_the_driver_simulates_each_kind_of_line(line):
    name, _, fast, overrides = LINES[line]
    argv = [sys.executable, "-c", DRIVER + "\nprint('recorded', len(records.requests))",
            str(ROOT / "scenarios" / f"{name}.yaml"), "20", "1" if fast else "0", "0", *overrides]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "recorded 20"


def test_a_tree_must_be_label_equals_a_checkout(tmp_path):
    assert _tree(f"base={ROOT}") == ("base", ROOT)
    for bad in (str(ROOT), f"base={tmp_path}"):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=DIR"):
            _tree(bad)
