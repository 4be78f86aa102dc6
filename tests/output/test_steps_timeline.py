"""The default steps.csv: a row per replica per interval of simulated time, reduced from the
recorders' columns without expanding leaps, equal to the same reductions over every step."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.cli import main as simrun
from sim.output.step_buckets import TIMELINE_COLUMNS, timeline_columns
from sim.records import request_columns
from sim.scenario import load_scenario
from sim.simulator import simulate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def records():
    """Two replicas, leaps (a busy decode phase), preemptions (a small pool)."""
    scenario = load_scenario(ROOT / "scenarios" / "bench_sim_speed.yaml", [
        "workload.num_requests=600", "workload.arrival.rate=200", "cluster.replicas=2", "engine.num_blocks=600"])
    records, _, _ = simulate(scenario)
    return records


def per_step_reference(records, interval: float) -> pd.DataFrame:
    """The same reductions with pandas over the per-step frame."""
    steps = records.steps_frame(full=True)
    steps["bucket"] = np.floor(steps["start_s"] / interval).astype(np.int64)
    steps["busy_s"] = steps["end_s"] - steps["start_s"]
    g = steps.groupby(["replica", "bucket"], sort=True)
    return pd.DataFrame({
        "replica": g["replica"].first(), "time_s": g["bucket"].first() * interval, "steps": g.size(),
        "first_step": g["step"].first(), "busy_s": g["busy_s"].sum(), "num_seqs": g["num_seqs"].mean(),
        "decode_seqs": g["decode_seqs"].mean(), "prefill_tokens": g["prefill_tokens"].sum(),
        "batch_tokens": g["batch_tokens"].sum(), "running": g["running"].max(), "waiting": g["waiting"].max(),
        "kv_blocks_used": g["kv_blocks_used"].max(), "kv_blocks_used_mean": g["kv_blocks_used"].mean(),
        "kv_blocks_cached": g["kv_blocks_cached"].max(), "preemptions": g["preemptions"].sum(),
        "host_s": g["host_s"].sum(), "device_s": g["device_s"].sum()}).reset_index(drop=True)


@pytest.mark.parametrize("interval", [0.05, 1.0, 7.0])
def test_timeline_equals_the_per_step_reductions(records, interval):
    assert any(r.num_rows < len(r) for r in records.recorders)           # leaps are rows of several steps
    assert sum(int(r.row_column("preemptions").sum()) for r in records.recorders) > 0
    got = timeline_columns(records, interval)
    want = per_step_reference(records, interval)
    assert list(got) == list(TIMELINE_COLUMNS) == list(want.columns)
    assert set(got["replica"]) == {0, 1} and len(got["time_s"]) == len(want)
    for name in TIMELINE_COLUMNS:
        expected = want[name].to_numpy()
        if name in ("busy_s", "host_s", "device_s", "num_seqs", "decode_seqs", "kv_blocks_used_mean"):
            assert np.allclose(got[name], expected, rtol=1e-12, atol=0), name     # summed in another order
        else:
            assert np.array_equal(got[name], expected), name
    assert got["steps"].sum() == sum(len(r) for r in records.recorders)


def test_the_interval_is_checked(records, tmp_path, capsys):
    with pytest.raises(ValueError, match="interval"):
        timeline_columns(records, 0.0)
    with pytest.raises(SystemExit):
        simrun([str(ROOT / "scenarios" / "quickstart.yaml"), "--steps-interval", "-1", "--out", str(tmp_path)])
    assert "--steps-interval" in capsys.readouterr().err


def test_plot_series_from_the_records_equal_those_of_the_per_step_frame(records):
    """A prediction's plots reduce its steps from the recorders' columns; a per-step frame gives
    the same series, marks and step-time histogram (the frame path serves measured runs)."""
    from sim.output.views import PLOT_SERIES, RunView, step_ms_bins

    summary = {"requests_measured": 0}
    from_records = RunView.from_records("r", records, summary, request_columns(records), step_frame=False)
    from_frame = RunView("f", summary, from_records.requests, records.steps_frame(), records.kv_blocks_total, 2)
    assert from_records.records is records and from_records.steps is None
    for agg, combine in PLOT_SERIES:
        (e1, got), (e2, want) = from_records.series(agg, combine), from_frame.series(agg, combine)
        assert np.array_equal(e1, e2) and list(got.columns) == list(want.columns)
        assert np.allclose(got.to_numpy(), want.to_numpy(), rtol=1e-12, atol=0), agg
    times, count = from_records.preemption_marks()
    want_times, want_count = from_frame.preemption_marks()
    assert count == want_count > 0 and np.array_equal(times, want_times)
    assert from_records.num_steps == from_frame.num_steps and from_records.max_cached_blocks == from_frame.max_cached_blocks
    bins = step_ms_bins({"r": from_records})
    assert np.array_equal(bins, step_ms_bins({"f": from_frame}))
    assert np.array_equal(from_records.step_ms_histogram(bins), from_frame.step_ms_histogram(bins))
    assert from_records.drawable().reduced[("step_ms_histogram", bins.tobytes())].sum() == from_frame.num_steps
