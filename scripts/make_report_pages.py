"""Rebuild the report.html pages of the committed measurements under reports/ from their files.

    python scripts/make_report_pages.py              # every reports/**/ folder with predicted/ and measured/
    python scripts/make_report_pages.py FOLDER ...   # only these

The pages are generated, so they are not committed (.gitignore): each validation folder keeps
what was measured and predicted (predicted/ and measured/ with summary.json, requests.csv,
steps.csv and manifest.json; comparison.csv; step_errors.json) and the figures, and this script
puts them on one page with the same code `simrun validate` uses (validate.run.write_validation_page).
Nothing is re-simulated or redrawn.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REPORTS = ROOT / "reports"
RUN_FILES = ("summary.json", "requests.csv", "manifest.json")


def is_validation_folder(folder: Path) -> bool:
    """A predicted and a measured run and their comparison."""
    return (folder / "comparison.csv").is_file() and all(
        (folder / side / name).is_file() for side in ("predicted", "measured") for name in RUN_FILES)


def validation_folders(root: Path = REPORTS) -> list[Path]:
    return sorted(p.parent.parent for p in root.glob("**/measured/summary.json")
                  if is_validation_folder(p.parent.parent))


def run_view(folder: Path, label: str):
    """A committed run's files as the page code sees them (the figures are already drawn)."""
    import pandas as pd

    from sim.output.views import RunView

    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    requests = pd.read_csv(folder / "requests.csv", keep_default_na=False, na_values=[""])
    return RunView(label, summary, requests, pd.DataFrame(), int(summary.get("kv_blocks_total") or 0))


def figures_of(folder: Path) -> dict[str, Path]:
    """The folder's figures, in the order `simrun validate` places them."""
    from sim.output.report import PLOTS

    order = [name for name in PLOTS if name != "overview"] + ["step_scatter", "errors"]
    return {name: folder / f"{name}.png" for name in order if (folder / f"{name}.png").is_file()}


def title_of(folder: Path, root: Path = REPORTS) -> str:
    """'kvtwin validation: <folder under the device folder>', e.g. seed_static_vs_continuous/static."""
    return "kvtwin validation: " + "/".join(folder.relative_to(root).parts[1:])


def write_page(folder: Path, root: Path = REPORTS) -> Path:
    import pandas as pd

    from validate.run import write_validation_page

    views = {side: run_view(folder / side, side) for side in ("predicted", "measured")}
    table = pd.read_csv(folder / "comparison.csv").set_index("metric")
    errors_file = folder / "step_errors.json"
    step_errors = json.loads(errors_file.read_text(encoding="utf-8")) if errors_file.is_file() else {}
    manifests = [json.loads((folder / side / "manifest.json").read_text(encoding="utf-8"))
                 for side in ("predicted", "measured")]
    return write_validation_page(folder / "report.html", title_of(folder, root), views, figures_of(folder),
                                 table, step_errors, *manifests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="validation folders (default: all under reports/)")
    args = parser.parse_args(argv)
    folders = [f.resolve() for f in args.folders] or validation_folders()
    unusable = [f for f in folders if not is_validation_folder(f)]
    if unusable:
        print("not a validation folder (needs predicted/, measured/ and comparison.csv): "
              + ", ".join(map(str, unusable)), file=sys.stderr)
        return 2
    for folder in folders:
        print(f"wrote {write_page(folder, REPORTS if REPORTS in folder.parents else folder.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
