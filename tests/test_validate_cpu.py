"""End to end on the CPU engine: calibrate, then predict-and-measure two small scenarios.

Tolerances come from the spread of the CPU engine on the 2-core machine this project runs
on (README, "Validation"). Over repeated calibrate + validate cycles, predicted / measured:
  TTFT p50 (online cpu_smoke)                       0.70 - 1.11
  TPOT and E2E p50 (online cpu_smoke)               0.51 - 1.10  (decodes between idle gaps run
                                                    slower than the back-to-back calibration probes)
  request throughput (offline, median of 3 runs)    0.88 - 1.47
  continuous / static speedup (median of 3 pairs)   0.86 - 1.25
  request throughput (online, arrival-limited)      within 1.7%
The machine's own speed moves by up to 2x within seconds. So absolute times are held to a
factor of 2.5 (wide, but a unit slip or a missing cost term lands far outside it), the
speedup to 35% as the median of three alternating pairs of runs, and tails (p90/p99, whose
run-to-run spread reached 3x) are not checked on CPU. KV pool size, prefix hit rate,
preemptions and, with every request at t=0, the KV peak are the same policy code on both
sides and must match exactly.
"""
from pathlib import Path

import pytest

from sim.scenario import expand_variants, load_scenario
from validate.calibrate import calibrate, write_profile
from validate.run import validate, write_validation

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def row(table, metric, column="relative_error"):
    return float(table.loc[metric, column])


def within_factor(table, metric, factor=2.5):
    ratio = row(table, metric, "predicted") / row(table, metric, "measured")
    return 1 / factor < ratio < factor


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    scenario = load_scenario(SCENARIOS / "cpu_smoke.yaml")
    cal = calibrate(scenario, "cpu")
    assert cal.profile.calibrated and cal.test_quality["points"] >= 5
    assert cal.test_quality["median_rel_error"] < 0.5, cal.test_quality   # observed 0.12 - 0.32
    return write_profile(tmp_path_factory.mktemp("profile") / "cpu_tiny.yaml", cal)


def test_cpu_smoke_predicted_vs_measured(profile, tmp_path):
    v = validate(load_scenario(SCENARIOS / "cpu_smoke.yaml"), "cpu", profile)
    files = write_validation(v, tmp_path)
    t = v.table
    assert row(t, "KV pool blocks") == 0 and row(t, "preemptions") == 0
    assert abs(row(t, "prefix hit rate", "predicted") - row(t, "prefix hit rate", "measured")) < 0.02
    assert abs(row(t, "request throughput (req/s)")) < 0.10
    for metric in ("TTFT p50 (s)", "TPOT p50 (s)", "E2E p50 (s)"):
        assert within_factor(t, metric), (metric, t.loc[metric].to_dict())
    # 80 requests, the first 8 warm-up (excluded from requests_finished)
    assert v.measured.summary["requests_finished"] == 72 and v.predicted.summary["requests_finished"] == 72
    assert files["report"].stat().st_size > 10_000 and (tmp_path / "step_scatter.png").exists()


def test_static_vs_continuous_on_the_engine(profile):
    """Paired measurements: the two variants alternate three times and the medians are compared,
    so a swing of the machine's speed hits both sides of a pair."""
    from statistics import median

    from engine.replay import replay

    path = SCENARIOS / "cpu_static_vs_continuous.yaml"
    variants = expand_variants(load_scenario(path), path.parent)
    runs = {name: validate(s, "cpu", profile, online=False) for name, s in variants.items()}
    for name, v in runs.items():
        assert row(v.table, "KV blocks peak") == 0, name       # all at t=0: the schedule is timing-free
    measured = {name: [row(v.table, "request throughput (req/s)", "measured")] for name, v in runs.items()}
    for _ in range(2):
        for name, s in variants.items():
            measured[name].append(replay(s, device="cpu", online=False).summary["request_throughput"])
    predicted = {name: row(v.table, "request throughput (req/s)", "predicted") for name, v in runs.items()}
    for name in variants:
        assert 0.4 < predicted[name] / median(measured[name]) < 2.5, (name, predicted[name], measured[name])
    measured_speedup = median(c / s for c, s in zip(measured["continuous"], measured["static"]))
    predicted_speedup = predicted["continuous"] / predicted["static"]
    assert measured_speedup > 1.2 and predicted_speedup > 1.2
    assert abs(predicted_speedup / measured_speedup - 1) < 0.35, (predicted_speedup, measured)
