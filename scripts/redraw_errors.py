"""Redraw every committed reports/<device>/**/errors.png from the comparison.csv beside it.

The figure only draws that table, so this is exact and needs no engine run (the GPU check's dry
run would re-measure everything). Run from the repository root: python scripts/redraw_errors.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from validate.plots import plot_relative_errors  # noqa: E402


def main() -> int:
    for csv in sorted((ROOT / "reports").glob("**/comparison.csv")):
        table = pd.read_csv(csv).set_index("metric")
        table["within"] = table["within"].map({True: True, False: False, "True": True, "False": False})
        plot_relative_errors(table, csv.parent / "errors.png")
        print(f"redrew {csv.parent.relative_to(ROOT)}/errors.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
