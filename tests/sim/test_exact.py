"""The summary is made from numpy columns, without a frame: its reductions must be pandas' own,
bit for bit (sim/exact.py), and its figures those pandas gives on the requests frame."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim import exact
from sim.metrics import summarise
from sim.output.io import write_csv
from sim.records import request_columns, requests_frame
from sim.scenario import load_scenario
from sim.simulator import simulate

ROOT = Path(__file__).resolve().parents[2]


def random_columns(seed: int) -> list[np.ndarray]:
    """Float columns of awkward sums (magnitudes over 12 decades, long enough for numpy's pairwise
    blocks), with and without NaN, all-NaN, empty; integer and boolean columns; object columns."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20_000))
    floats = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)
    with_nan = floats.copy()
    with_nan[rng.random(n) < 0.1] = np.nan
    # a measured run's field an endpoint did not report: objects, None where missing
    reported = np.array([None if m else int(v) for m, v in zip(rng.random(n) < 0.2, rng.integers(0, 100, n))],
                        dtype=object)
    return [floats, with_nan, np.full(5, np.nan), np.zeros(0), floats[::3],
            rng.integers(-10**9, 10**9, n), rng.random(n) < 0.3, rng.integers(0, 100, n).astype(np.int32),
            reported, np.array([None, None], dtype=object)]


@pytest.mark.parametrize("seed", range(8))
def test_reductions_are_pandas_bit_for_bit(seed):
    for values in random_columns(seed):
        series = pd.Series(values)
        for ours, theirs in ((exact.nansum, series.sum), (exact.nanmean, series.mean),
                             (exact.nanmax, series.max), (exact.nanmin, series.min)):
            got, want = ours(values), theirs()
            assert (np.isnan(got) and np.isnan(want)) if np.isnan(float(want)) else \
                float(got).hex() == float(want).hex(), (ours.__name__, values.dtype, len(values))


@pytest.fixture(scope="module")
def varied_run():
    """Two replicas, multi-turn conversations, rejections (prompts over max_model_len), SLOs."""
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml", [
        "workload.num_requests=300", "workload.arrival.rate=6", "cluster.replicas=2",
        "workload.multi_turn={turns: 2, user_len: 30, think_time_s: 0.5}",
        "workload.prompt_len={dist: uniform, min: 50, max: 9000}", "engine.max_model_len=8192",
        "slo={ttft_s: 0.5, tpot_s: 0.05}"])
    records, _, _ = simulate(scenario)
    return scenario, records


def pandas_figures(frame: pd.DataFrame, slo, steps: pd.DataFrame) -> dict:
    """The summary's figures as pandas computed them on the requests frame (before sim/exact.py)."""
    warm = frame["is_warmup"].astype(bool)
    m = frame[(frame["status"] == "finished") & ~warm]
    duration = float(m["finish_s"].max() - m["arrival_s"].min())
    ok = (m["ttft_s"] <= slo.ttft_s) & (m["tpot_s"].fillna(0.0) <= slo.tpot_s)
    total = m["e2e_s"].sum()
    return {"duration_s": duration, "request_throughput": len(m) / duration,
            "output_token_throughput": float(m["output_tokens"].sum()) / duration,
            "total_token_throughput": float(m["prompt_tokens"].sum() + m["output_tokens"].sum()) / duration,
            "goodput": float(ok.sum()) / duration, "slo_attainment": float(ok.sum() / int((~warm).sum())),
            "prefix_hit_rate": float(m["cached_tokens"].sum() / m["prompt_tokens"].sum()),
            "latency_split": {k: float(m[f"{k}_s"].sum() / total) for k in ("queue", "host", "device")},
            "mean_step_s": float((steps["end_s"] - steps["start_s"]).mean()),
            "warmup_requests": int(frame["is_warmup"].sum()),
            "replica_output_throughput": [float(m[m["replica"] == i]["output_tokens"].sum()) / duration
                                          for i in range(2)]}


def test_the_summary_from_columns_has_pandas_figures(varied_run):
    scenario, records = varied_run
    frame = requests_frame(records)
    assert frame["conversation"].notna().any() and (frame["status"] == "rejected").any()
    summary = summarise(records, scenario.slo, request_columns(records))
    want = pandas_figures(frame, scenario.slo, records.steps_frame())
    assert summary["replicas"][1]["requests"] > 0
    got = {k: summary[k] for k in want if k in summary}
    got["replica_output_throughput"] = [r["output_token_throughput"] for r in summary["replicas"]]
    assert got == want
    assert summary == summarise(records, scenario.slo, frame)          # a frame given in: the same
    assert summary["rejection_reasons"] and summary["rejection_reasons"][0]["count"] > 0


def test_requests_csv_from_columns_is_pandas_to_csv(varied_run, tmp_path):
    _, records = varied_run
    columns = request_columns(records)
    frame = requests_frame(records)
    assert list(frame.columns) == list(columns)
    write_csv(tmp_path / "a.csv", columns)
    frame.to_csv(tmp_path / "b.csv", index=False)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()


def test_the_itl_sample_is_every_gap_between_a_requests_tokens(varied_run):
    """itl_samples counts the gaps inside runs of emitting steps per step (weights); listed one by
    one from the runs, token by token, they are the same multiset."""
    from sim.records import itl_samples

    _, records = varied_run
    table = records.requests
    ids, replica = table.sorted_column("id"), table.sorted_column("replica")
    finished = request_columns(records)["status"] == "finished"
    owner, first, last = table.emit_runs()
    want = []
    for rec in records.recorders:
        end = rec.step_column("end_s")
        for who in np.flatnonzero(finished & (replica == rec.replica)):
            runs = [(a, b) for o, a, b in zip(owner, first, last) if o == who]
            times = [end[k] for a, b in runs for k in range(a, b + 1)]
            want += list(np.diff(times))
    values, weights = itl_samples(records, ids[finished])
    got = np.repeat(values, weights)
    assert len(got) == len(want) > 1000
    assert np.array_equal(np.sort(got), np.sort(np.array(want)))
