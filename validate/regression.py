"""Re-predict committed measurements (reports/<device>/...) with today's simulator.

A report folder holds measured/summary.json, measured/manifest.json (with the resolved
scenario) and tolerances.yaml; the device folder above it holds the calibrated profile
(profile_<model>.yaml) the prediction used. tests/validate/test_reports.py runs this for every
folder, so a change that makes the simulator worse at predicting real hardware fails CI
even though CI has no GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from sim.predict import predict
from sim.scenario import validate_scenario
from validate.compare import comparison_table

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def report_folders(root: Path = REPORTS) -> list[Path]:
    return sorted(p.parent.parent for p in root.glob("**/measured/summary.json")
                  if (p.parent.parent / "tolerances.yaml").exists())


def device_folder(folder: Path, root: Path = REPORTS) -> Path:
    return root / folder.relative_to(root).parts[0]


def repredict(folder: Path, root: Path = REPORTS):
    """(comparison table with the recorded tolerances, the scenario) for one report folder."""
    manifest = json.loads((folder / "measured" / "manifest.json").read_text())
    measured = json.loads((folder / "measured" / "summary.json").read_text())
    tolerances = yaml.safe_load((folder / "tolerances.yaml").read_text()) or {}
    raw = manifest["scenario"]
    profile = device_folder(folder, root) / f"profile_{raw['model']['name']}.yaml"
    raw["device"]["profile"] = str(profile) if profile.exists() else None
    raw.setdefault("engine", {})["async_scheduling"] = False     # measured on kvtwin's synchronous engine
    raw["engine"]["front_end_s"] = 0.0        # driven in-process: no API server (sim/front_end.py)
    scenario = validate_scenario(raw)
    predicted = predict(scenario).summary
    return comparison_table(predicted, measured, tolerances), scenario
