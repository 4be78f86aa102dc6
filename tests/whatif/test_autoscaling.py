"""Capacity over time: time-varying arrival rates, the autoscaler (KEDA + the Kubernetes HPA on a
vLLM gauge), and `simrun plan --autoscale` against a static fleet sized for the peak."""
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from sim.arrival_shape import RateShape
from sim.autoscale import (Autoscaling, desired_replicas, gpu_seconds, rate_limited, replicas_over_time,
                           stabilised)
from sim.cli import main
from sim.predict import predict
from sim.scenario import ScenarioError, validate_scenario
from sim.simulator import simulate
from sim.workload import build_requests

SCHEDULE = [{"duration_s": 300, "rate": 2}, {"duration_s": 300, "rate": 20}, {"duration_s": 300, "rate": 0},
            {"duration_s": 300, "rate": 5}]


def scenario(arrival: dict, autoscaling=None, duration_s: float = 1200, replicas: int = 1, **cluster):
    raw = {"name": "autoscaling", "seed": 3, "model": "qwen2.5-0.5b", "device": "l4",
           "engine": {"max_model_len": 2048, "num_blocks": 400, "max_num_seqs": 8},
           "cluster": {"replicas": replicas, "router": "least_outstanding_tokens", **cluster},
           "workload": {"duration_s": duration_s, "arrival": arrival,
                        "prompt_len": {"dist": "uniform", "min": 32, "max": 256},
                        "output_len": {"dist": "uniform", "min": 16, "max": 128}},
           "slo": {"ttft_s": 0.5, "tpot_s": 0.05}}
    if autoscaling is not None:
        raw["cluster"]["autoscaling"] = autoscaling
    return validate_scenario(raw)


def arrivals(s) -> np.ndarray:
    return np.array([r.arrival for r in build_requests(s)])


# ----------------------------------------------------------------------------- time-varying rates

def test_a_rate_schedule_delivers_each_steps_rate_and_repeats():
    """Each 300 s step holds Poisson(rate x 300) arrivals (within 5 sigma), the zero-rate step none,
    and the schedule starts over after its 1200 s."""
    times = arrivals(scenario({"process": "poisson", "rate_schedule": SCHEDULE}, duration_s=2400))
    assert times.min() > 0 and times.max() < 2400 and np.all(np.diff(times) >= 0)
    for cycle in (0, 1200):
        for k, step in enumerate(SCHEDULE):
            n = ((times >= cycle + 300 * k) & (times < cycle + 300 * (k + 1))).sum()
            expected = step["rate"] * 300
            assert abs(n - expected) <= 5 * math.sqrt(max(expected, 1)), (cycle, k, n)
            if step["rate"] == 0:
                assert n == 0


def test_fixed_arrivals_under_a_schedule_are_one_per_operational_unit():
    """process fixed: the k-th arrival falls where the cumulative rate reaches k, exactly."""
    times = arrivals(scenario({"process": "fixed", "rate_schedule": SCHEDULE}, duration_s=1200))
    assert len(times) == 2 * 300 + 20 * 300 + 5 * 300 - 1       # the last one would land at exactly 1200 s
    assert times[0] == pytest.approx(0.5) and times[600] == pytest.approx(300 + 1 / 20)


def test_a_diurnal_rate_follows_its_cosine():
    """Counts in each eighth of the period match the integral of the rate (within 5 sigma); the
    peak falls mid-period by default."""
    shape = {"period_s": 1600, "peak_rps": 20, "trough_rps": 1}
    times = arrivals(scenario({"process": "poisson", "diurnal": shape}, duration_s=1600))
    curve = RateShape(diurnal=scenario({"process": "poisson", "diurnal": shape}).workload.arrival.diurnal)
    edges = np.linspace(0, 1600, 9)
    counts, _ = np.histogram(times, edges)
    expected = np.diff(curve.cumulative(edges))
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected))
    assert curve.rate(np.array([800.0]))[0] == pytest.approx(20) and curve.rate(np.array([0.0]))[0] == pytest.approx(1)
    assert curve.cumulative(1600.0) == pytest.approx((20 + 1) / 2 * 1600)


def test_the_inverse_cumulative_rate_round_trips():
    for curve in (RateShape(diurnal=scenario({"process": "poisson", "diurnal": {
            "period_s": 100, "peak_rps": 3, "trough_rps": 0, "peak_at_s": 10}}).workload.arrival.diurnal),
            RateShape(scenario({"process": "poisson", "rate_schedule": SCHEDULE}).workload.arrival.rate_schedule)):
        u = np.linspace(0.01, 5 * curve.total, 997)
        assert np.allclose(curve.cumulative(curve.inverse(u)), u, rtol=1e-9, atol=1e-9)


def test_rescale_puts_the_last_of_n_arrivals_where_the_cumulative_rate_reaches_n():
    """As vLLM's benchmark rescales a constant rate's gaps so the last of N lands at N / rate."""
    s = validate_scenario({"model": "qwen2.5-0.5b", "device": "l4", "workload": {
        "num_requests": 5000, "arrival": {"process": "poisson", "rate_schedule": SCHEDULE}}})
    times = arrivals(s)
    assert len(times) == 5000
    assert RateShape(schedule_steps()).cumulative(times[-1]) == pytest.approx(5000)


def schedule_steps():
    return scenario({"process": "poisson", "rate_schedule": SCHEDULE}).workload.arrival.rate_schedule


def test_shaped_arrivals_are_deterministic_with_the_seed():
    s = scenario({"process": "gamma", "cv": 2, "rate_schedule": SCHEDULE})
    assert np.array_equal(arrivals(s), arrivals(s))
    other = s.model_copy(update={"seed": 4})
    assert not np.array_equal(arrivals(s)[:50], arrivals(other)[:50])


@pytest.mark.parametrize("arrival, message", [
    ({"process": "poisson", "rate": 2, "rate_schedule": SCHEDULE}, "give one of rate, ramp_up, rate_schedule"),
    ({"process": "offline", "rate_schedule": SCHEDULE}, "needs process poisson, gamma or fixed"),
    ({"process": "poisson", "rate_schedule": [{"duration_s": 10, "rate": 0}]}, "every step has rate 0"),
    ({"process": "poisson", "rate_schedule": [{"duration_s": -1, "rate": 1}]}, "duration_s"),
    ({"process": "poisson", "rate_schedule": [{"duration_s": 1, "rate": math.inf}]}, "rate"),
    ({"process": "poisson", "diurnal": {"peak_rps": 1, "trough_rps": 2}}, "trough_rps (2) is above peak_rps"),
    ({"process": "poisson", "diurnal": {"period_s": 10, "peak_rps": 2, "trough_rps": 1, "peak_at_s": 11}},
     "past the end of period_s"),
])
def test_bad_rate_shapes_name_the_field(arrival, message):
    with pytest.raises(ScenarioError, match="workload.arrival") as err:
        scenario(arrival)
    assert message in str(err.value)


# ----------------------------------------------------------------------------- the HPA's arithmetic

def test_desired_replicas_is_ceil_of_metric_over_target_outside_the_tolerance():
    """GetExternalPerPodMetricReplicas (kubernetes pkg/controller/podautoscaler/replica_calculator.go):
    usageRatio = metric / (target x current); within |1 - ratio| <= tolerance (0.1) the replica count
    stays, else it becomes ceil(metric / target)."""
    assert desired_replicas(metric=42, target=10, current=4, tolerance=0.1) == 4      # ratio 1.05
    assert desired_replicas(metric=44.1, target=10, current=4, tolerance=0.1) == 5    # ratio 1.1025
    assert desired_replicas(metric=37, target=10, current=4, tolerance=0.1) == 4      # ratio 0.925
    assert desired_replicas(metric=29, target=10, current=4, tolerance=0.1) == 3      # ratio 0.725
    assert desired_replicas(metric=0, target=10, current=4, tolerance=0.1) == 0
    assert desired_replicas(metric=101, target=10, current=1, tolerance=0.1) == 11


def test_stabilisation_keeps_the_highest_recommendation_of_the_scale_down_window():
    """stabilizeRecommendationWithBehaviors (kubernetes pkg/controller/podautoscaler/horizontal.go):
    the result is at most the highest recommendation of the last scaleDown window (default 300 s)
    and at least the lowest of the scaleUp window (default 0 s)."""
    history = [(0.0, 6), (100.0, 3), (250.0, 2)]
    assert stabilised(1, current=6, history=history, now=290.0, up_window_s=0, down_window_s=300) == 6
    assert stabilised(1, current=6, history=history, now=301.0, up_window_s=0, down_window_s=300) == 3
    assert stabilised(9, current=6, history=history, now=301.0, up_window_s=0, down_window_s=300) == 9
    # a scale-up window: up to the lowest recommendation within it (3 at t=100), not to 9
    assert stabilised(9, current=2, history=history[:2], now=240.0, up_window_s=200, down_window_s=300) == 3


def test_the_default_rate_limits_allow_max_of_four_pods_or_double_per_period():
    """The HPA's default behavior (kubernetes docs, 'Default Behavior'): scale up by
    max(4 pods, 100%) per 15 s, down by up to 100% per 15 s; then min/max replicas."""
    config = Autoscaling(policy="running", target=1, max_replicas=100)
    assert rate_limited(50, current=1, events=[], now=0, config=config) == 5
    assert rate_limited(50, current=10, events=[], now=0, config=config) == 20
    assert rate_limited(50, current=5, events=[(10.0, 4)], now=20, config=config) == 5    # period began at 1: 1 + 4
    assert rate_limited(50, current=5, events=[(1.0, 4)], now=20, config=config) == 10    # (period over: from 5)
    assert rate_limited(0, current=10, events=[], now=0, config=config) == 1              # min_replicas
    assert rate_limited(500, current=90, events=[], now=0, config=config) == 100          # max_replicas


@pytest.mark.parametrize("autoscaling, replicas, message", [
    ({"policy": "running", "target": 4, "min_replicas": 3, "max_replicas": 2}, 2, "min_replicas (3) is above"),
    ({"policy": "kv_usage", "target": 1.5}, 1, "kv_usage is a fraction"),
    ({"policy": "running", "target": 4, "max_replicas": 2}, 3, "must lie within"),
    ({"policy": "queue", "target": 4}, 1, "policy"),
    ({"policy": "running", "target": 4, "startup_s": -1}, 1, "startup_s"),
])
def test_bad_autoscaling_names_the_field(autoscaling, replicas, message):
    with pytest.raises(ScenarioError, match="cluster") as err:
        scenario({"process": "poisson", "rate": 1}, autoscaling, replicas=replicas)
    assert message in str(err.value)


# ----------------------------------------------------------------------------- a run

FAST_SCALER = {"policy": "queue_depth", "target": 4, "max_replicas": 6, "interval_s": 5,
               "scale_down_stabilization_s": 30, "startup_s": 20}


@pytest.fixture(scope="module")
def scaled():
    s = scenario({"process": "poisson", "rate_schedule": SCHEDULE}, FAST_SCALER)
    result = predict(s, manifest=False)
    return s, result, result.records.meta["autoscaling"]


def test_the_fleet_grows_with_the_load_and_shrinks_after_it(scaled):
    _, _, timeline = scaled
    decisions = pd.DataFrame(timeline["decisions"])
    during = decisions[(decisions["time_s"] > 350) & (decisions["time_s"] < 600)]
    after = decisions[(decisions["time_s"] > 700) & (decisions["time_s"] < 900)]
    assert during["ready"].max() >= 3 and after["ready"].max() == 1
    assert decisions["replicas"].max() <= FAST_SCALER["max_replicas"]


def test_no_request_reaches_a_replica_before_it_started_or_after_it_began_draining(scaled):
    _, result, timeline = scaled
    frame = result.requests
    for life in timeline["replicas"]:
        mine = frame[frame["replica"] == life["replica"]]
        if life["ready_s"] is None:              # scaled away while starting: never served
            assert mine.empty and life["stopped_s"] is not None
            continue
        assert life["ready_s"] - life["requested_s"] == pytest.approx(FAST_SCALER["startup_s"]) or life["replica"] == 0
        if len(mine):
            assert mine["arrival_s"].min() >= life["ready_s"]
        if life["draining_s"] is not None:
            assert (mine["arrival_s"] <= life["draining_s"]).all()
            # it stops once its last request is done, not before
            assert life["stopped_s"] == pytest.approx(max(mine["finish_s"].max(), life["draining_s"])) \
                if len(mine) else life["stopped_s"] == life["draining_s"]


def test_every_request_ends_finished_or_rejected_with_a_reason(scaled):
    s, result, _ = scaled
    frame = result.requests
    assert len(frame) == len(build_requests(s))
    assert set(frame["status"]) <= {"finished", "rejected"}
    rejected = frame[frame["status"] == "rejected"]
    assert rejected["reject_reason"].fillna("").str.len().gt(0).all()


def test_gpu_hours_are_the_integral_of_the_replicas_holding_gpus(scaled):
    s, result, timeline = scaled
    end = float(result.requests["finish_s"].max())
    series = replicas_over_time(timeline["replicas"], end)
    area = sum(a["replicas"] * (b["time_s"] - a["time_s"]) for a, b in zip(series, series[1:]))
    assert gpu_seconds(timeline["replicas"], end, 1) == pytest.approx(area)
    assert gpu_seconds(timeline["replicas"], end, 2) == pytest.approx(2 * area)
    assert area < FAST_SCALER["max_replicas"] * end and area > end       # more than one, fewer than max
    # the HPA's count stays within max_replicas; draining replicas hold GPUs on top of it
    assert max(row["counted"] for row in series) <= FAST_SCALER["max_replicas"]
    assert all(row["serving"] <= row["counted"] <= row["replicas"] for row in series)


def test_the_summary_reports_gpu_hours_and_the_peak_fleet(scaled):
    _, result, timeline = scaled
    entry = result.summary["autoscaling"]
    end = float(result.requests["finish_s"].max())
    assert entry["gpu_hours"] == pytest.approx(gpu_seconds(timeline["replicas"], end, 1) / 3600)
    assert 3 <= entry["peak_replicas"] <= FAST_SCALER["max_replicas"] and entry["replicas_started"] >= 3


def test_an_autoscaled_run_is_deterministic_and_the_fast_path_agrees(scaled):
    """Same seed, same run; the one-by-one reference path (fast=False) routes and scales alike
    (the queue-depth gauge is read at a leap horizon, so leaps cannot blur it)."""
    s, result, timeline = scaled
    again = predict(s, manifest=False)
    pd.testing.assert_frame_equal(result.requests, again.requests)
    assert again.records.meta["autoscaling"] == timeline
    records, _, _ = simulate(s, fast=False)
    assert records.meta["autoscaling"]["decisions"] == timeline["decisions"]


def test_without_autoscaling_the_fleet_is_fixed():
    s = scenario({"process": "poisson", "rate_schedule": SCHEDULE}, replicas=2)
    result = predict(s, manifest=False)
    assert "autoscaling" not in result.records.meta
    assert set(result.requests["replica"].dropna()) == {0, 1}


# ----------------------------------------------------------------------------- simrun plan --autoscale

@pytest.fixture
def scenario_file(tmp_path):
    raw = scenario({"process": "poisson", "rate_schedule": SCHEDULE}, FAST_SCALER).model_dump(
        mode="json", exclude_unset=True)
    path = tmp_path / "autoscale.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_plan_autoscale_compares_with_a_static_fleet_sized_for_the_peak(scenario_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["plan", str(scenario_file), "--autoscale", "--cost", "l4=2", "--bucket-s", "300",
                 "--out", str(out)]) == 0
    assert "fewer GPU-hours" in " ".join(capsys.readouterr().out.split())     # (wrapped to the terminal)
    table = pd.read_csv(out / "autoscale.csv")
    auto, static = table.iloc[0], table.iloc[1]
    assert list(table["fleet"]) == ["autoscaled", "static"]
    assert static["peak replicas"] == auto["peak replicas"] >= 3
    # the static fleet holds its GPUs for the whole run
    assert static["GPU-hours"] == pytest.approx(static["peak replicas"] * static["run length (s)"] / 3600)
    assert auto["GPU-hours"] < static["GPU-hours"]
    assert auto["cost ($)"] == pytest.approx(2 * auto["GPU-hours"])
    windows = pd.read_csv(out / "autoscale_slo.csv")
    assert set(windows["fleet"]) == {"autoscaled", "static"}
    assert windows.groupby("fleet")["requests"].sum().nunique() == 1
    idle = windows["window_start_s"].between(600, 899)          # the zero-rate step: no one to serve
    assert (windows.loc[idle, "requests"] == 0).all() and windows.loc[idle, "slo_attainment"].isna().all()
    assert windows.loc[~idle, "slo_attainment"].between(0, 1).all()
    series = pd.read_csv(out / "autoscale_replicas.csv")
    assert (series[series["fleet"] == "static"]["replicas"] == static["peak replicas"]).all()
    assert (out / "autoscale.png").stat().st_size > 10_000 and (out / "autoscale.html").exists()
    assert not list(out.glob(".*.tmp"))


def test_plan_autoscale_static_replicas_sets_the_static_fleet(scenario_file, tmp_path):
    out = tmp_path / "out"
    assert main(["plan", str(scenario_file), "--autoscale", "--static-replicas", "2", "--out", str(out),
                 "--quiet"]) == 0
    assert pd.read_csv(out / "autoscale.csv")["peak replicas"][1] == 2


@pytest.mark.parametrize("argv, message", [
    (["--autoscale", "--target-rate", "3"], "--target-rate does not apply to --autoscale"),
    (["--autoscale", "--slo", "ttft_p99=1"], "by the scenario's slo section"),
    (["--autoscale", "--cost", "h100-sxm=1"], "runs on the scenario's device (l4)"),
    (["--autoscale", "--static-replicas", "0"], "--static-replicas 0"),
    (["--autoscale", "--bucket-s", "0"], "--bucket-s 0"),
    (["--bucket-s", "60"], "--bucket-s applies to --autoscale"),
    ([], "a time-varying rate (plan it with --autoscale)"),
])
def test_plan_autoscale_errors_name_the_flag(scenario_file, tmp_path, capsys, argv, message):
    assert main(["plan", str(scenario_file), "--out", str(tmp_path / "o"), "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_autoscale_needs_an_autoscaling_section(tmp_path, capsys):
    raw = scenario({"process": "poisson", "rate_schedule": SCHEDULE}).model_dump(mode="json", exclude_unset=True)
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(path), "--autoscale", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "--autoscale needs cluster.autoscaling" in capsys.readouterr().err


def test_plan_autoscale_replays_a_time_scaled_trace(tmp_path):
    """A recorded trace replayed at 4x (workload.trace.time_scale) drives the autoscaler too:
    its burst in the middle brings replicas up, and the plan compares the fleets on it."""
    rng = np.random.default_rng(0)
    gaps = np.concatenate([rng.exponential(1 / 0.5, 100), rng.exponential(1 / 12, 3000), rng.exponential(1 / 0.5, 100)])
    rows = ["t,inp,out"] + [f"{t:.6f},{int(p)},{int(o)}" for t, p, o in zip(
        np.cumsum(gaps), rng.integers(32, 256, len(gaps)), rng.integers(16, 128, len(gaps)))]
    (tmp_path / "trace.csv").write_text("\n".join(rows) + "\n")
    raw = scenario({"process": "poisson", "rate": 1}, FAST_SCALER).model_dump(mode="json", exclude_unset=True)
    raw["workload"] = {"trace": {"format": "csv", "path": "trace.csv", "time_scale": 4,
                                 "fields": {"arrival": "t", "prompt_len": "inp", "output_len": "out"}}}
    path = tmp_path / "trace.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert main(["plan", str(path), "--autoscale", "--bucket-s", "60", "--out", str(out), "--quiet"]) == 0
    table = pd.read_csv(out / "autoscale.csv")
    assert table["requests"].tolist() == [3200, 3200]
    assert table["peak replicas"][0] >= 2 and table["GPU-hours"][0] < table["GPU-hours"][1]
    assert table["run length (s)"][0] < np.cumsum(gaps)[-1] / 4 + 60       # replayed at 4x


@pytest.mark.parametrize("policy, target", [("running", 6), ("kv_usage", 0.2)])
def test_each_policy_reads_its_gauge_and_scales_with_the_burst(policy, target):
    """running sums vllm:num_requests_running (at most max_num_seqs = 8 per replica), kv_usage sums
    vllm:kv_cache_usage_perc (a fraction per replica) over the ready replicas."""
    s = scenario({"process": "poisson", "rate_schedule": SCHEDULE}, {**FAST_SCALER, "policy": policy, "target": target})
    result = predict(s, manifest=False)
    decisions = pd.DataFrame(result.records.meta["autoscaling"]["decisions"])
    per_replica = decisions["metric"] / decisions["ready"]
    assert per_replica.max() <= (8 if policy == "running" else 1) and per_replica.max() > target
    assert decisions["ready"].max() >= 2 and set(result.requests["status"]) == {"finished"}
