"""Fidelity regression on public measured vLLM runs (validate/fidelity.py; docs/validation.md "Fidelity on public
vLLM runs"): today's simulator must reproduce each recorded error (datasheet, operator tables,
calibrated on the deployment's other runs) within its band. A change in the model that moves an
error shows here, in either direction; rerun `python -m validate.fidelity` to record a new table."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sim.costmodel import CostCoefficients, DeviceProfile
from validate.fidelity import errors_of, public_runs, tables_cover

REPORT = Path(__file__).resolve().parents[2] / "reports" / "fidelity"
MAX_REQUESTS = 100          # the cheap runs; the table's others are checked when it is regenerated


def band(recorded: float) -> float:
    return max(0.02, 0.1 * abs(recorded))


@pytest.fixture(scope="module")
def recorded() -> pd.DataFrame:
    return pd.read_csv(REPORT / "table.csv").set_index("run")


RUNS, _ = public_runs(MAX_REQUESTS)


def test_the_table_covers_enough_runs_gpus_and_models(recorded):
    assert len(recorded) >= 8
    deployments = recorded["deployment"].str.split(" / ", expand=True)
    assert deployments[1].nunique() >= 3 and deployments[0].nunique() >= 2
    assert (deployments[2] != "tp 1").any()
    assert not recorded["source"].str.contains("LLMServingSim").any()
    assert recorded.filter(like="calibrated").notna().any(axis=None)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.id)
def test_recorded_errors_still_hold(run, recorded):
    if run.id not in recorded.index:
        pytest.fail(f"{run.id} is expressible but not in {REPORT / 'table.csv'}: regenerate the table")
    row = recorded.loc[run.id]
    now = errors_of(run, CostCoefficients(), "datasheet")
    if tables_cover(run) and "tables tpot" in row and pd.notna(row["tables tpot"]):
        now.update(errors_of(run, CostCoefficients(), "tables", step_times="tables"))
    profile = REPORT / "profiles" / f"{run.id}.yaml"
    if profile.exists():
        now.update(errors_of(run, DeviceProfile.load(profile).coefficients, "calibrated"))
    checked = [k for k in now if k in row and pd.notna(row[k])]
    assert checked
    off = {k: (now[k], row[k]) for k in checked if abs(now[k] - row[k]) > band(row[k])}
    assert not off, f"{run.id}: errors moved beyond their bands (now, recorded): {off}"
