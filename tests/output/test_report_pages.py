"""The committed measurements keep their data and figures; their report.html pages are generated
(scripts/make_report_pages.py), never committed."""
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pages_script():
    spec = importlib.util.spec_from_file_location("make_report_pages", ROOT / "scripts" / "make_report_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_committed_validation_folder_is_found():
    found = [f.relative_to(ROOT / "reports").as_posix() for f in pages_script().validation_folders()]
    assert "cpu/bench_prefix_reuse" in found and "cpu/seed_static_vs_continuous/static" in found


def test_a_page_is_rebuilt_from_the_committed_files(tmp_path):
    script = pages_script()
    source = ROOT / "reports" / "cpu" / "seed_static_vs_continuous" / "static"
    folder = tmp_path / "cpu" / "seed_static_vs_continuous" / "static"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("report.html"))
    page = script.write_page(folder, tmp_path).read_text()
    assert "<title>kvtwin validation: seed_static_vs_continuous/static</title>" in page
    for heading in ("Summary", "Predicted vs measured", "Step time: cost model vs measured steps", "Figures"):
        assert f"<h2>{heading}</h2>" in page
    figures = [p.stem for p in folder.glob("*.png")]
    assert figures and all(f'alt="{name}"' in page for name in figures)
    measured = json.loads((folder / "measured" / "summary.json").read_text())
    assert f"<td>{measured['requests_finished']:,}</td>" in page      # the measured run's own figures


def test_a_folder_without_a_comparison_is_refused(tmp_path, capsys):
    (tmp_path / "measured").mkdir()
    assert pages_script().main([str(tmp_path)]) == 2
    assert "not a validation folder" in capsys.readouterr().err


def test_no_generated_page_is_committed():
    try:
        tracked = subprocess.run(["git", "ls-files", "reports"], cwd=ROOT, capture_output=True, text=True,
                                 check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    if not tracked:
        pytest.skip("git lists no files here (an exported tree)")
    assert not [f for f in tracked if f.endswith(".html")], "generated pages are committed under reports/"
    assert any(f.endswith("comparison.csv") for f in tracked)
