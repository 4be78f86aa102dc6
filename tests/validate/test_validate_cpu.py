"""End to end on the CPU engine: calibrate, then predict-and-measure two small scenarios.

Nothing here depends on how fast the CPU is: the machine this runs on is shared and
its speed moves by 2x within seconds; under load the online smoke run queued so much that its
measured TTFT p50 was 7.6x the prediction (and an earlier run measured 0.36 of the predicted
throughput). So the tests assert
  - policy figures exactly: KV pool size, preemptions, requests finished, prefix hit rate,
    and, with every request at t=0 (a timing-free schedule), the KV peak and the step count,
    and from the step counts that continuous batching needs far fewer steps than static;
  - that the cost model prices every one of the run's measured steps (the step-time comparison
    of the report), without judging the times: even a rank check of the same run's steps
    failed here once, because the calibrated contrast between step kinds is itself a timing.
Timing accuracy belongs in bench/ and in the GPU check (tolerances recorded per report).
"""
from pathlib import Path

import pytest

from sim.scenario import expand_variants, load_scenario
from validate.calibrate import calibrate, write_profile
from validate.run import validate, write_validation

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def row(table, metric, column="relative_error"):
    return float(table.loc[metric, column])


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    scenario = load_scenario(SCENARIOS / "cpu_smoke.yaml")
    cal = calibrate(scenario, "cpu")
    assert cal.profile.calibrated and cal.test_quality["points"] >= 5
    return write_profile(tmp_path_factory.mktemp("profile") / "cpu_tiny.yaml", cal)


def test_cpu_smoke_predicted_vs_measured(profile, tmp_path):
    v = validate(load_scenario(SCENARIOS / "cpu_smoke.yaml"), "cpu", profile)
    files = write_validation(v, tmp_path)
    t = v.table
    assert row(t, "KV pool blocks") == 0 and row(t, "preemptions") == 0
    assert abs(row(t, "prefix hit rate", "predicted") - row(t, "prefix hit rate", "measured")) < 0.02
    steps = v.steps                                  # this run's steps, priced by the cost model
    assert len(steps) == len(v.measured.steps) and (steps["measured_s"] > 0).all()
    assert steps["predicted_s"].notna().all() and (steps["predicted_s"] > 0).all()
    # 80 requests, the first 8 warm-up (excluded from requests_finished)
    assert v.measured.summary["requests_finished"] == 72 and v.predicted.summary["requests_finished"] == 72
    assert files["report"].stat().st_size > 10_000 and (tmp_path / "step_scatter.png").exists()


def test_static_vs_continuous_on_the_engine(profile):
    """Every request at t=0: the schedule is timing-free, so predicted and measured runs take the
    same steps, and continuous batching needs far fewer than the static batches."""
    path = SCENARIOS / "cpu_static_vs_continuous.yaml"
    variants = expand_variants(load_scenario(path), path.parent)
    runs = {name: validate(s, "cpu", profile, online=False) for name, s in variants.items()}
    for name, v in runs.items():
        assert row(v.table, "KV blocks peak") == 0, name
        assert len(v.predicted.steps) == len(v.measured.steps), name
        assert v.measured.summary["requests_finished"] == 40, name
    steps = {name: len(v.measured.steps) for name, v in runs.items()}
    assert steps["static"] > 1.5 * steps["continuous"], steps
    predicted = {name: row(v.table, "request throughput (req/s)", "predicted") for name, v in runs.items()}
    assert predicted["continuous"] > 1.2 * predicted["static"], predicted
