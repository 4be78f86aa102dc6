"""vLLM server logs and /metrics scrapes as running / waiting / KV % series, aligned to a prediction."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.errors import UserError
from sim.vllm.timeseries import align_offset, compare_series, load_series, predicted_at

V1_LOG = """\
(APIServer pid=7151) INFO 07-24 14:09:58 [api_server.py:1] Starting vLLM API server
(APIServer pid=7151) INFO 07-24 14:10:08 [loggers.py:273] Engine 000: Avg prompt throughput: 3539.1 tokens/s, Avg generation throughput: 3562.1 tokens/s, Running: 126 reqs, Waiting: 0 reqs, GPU KV cache usage: 36.4%, Prefix cache hit rate: 0.0%
(APIServer pid=7151) INFO 07-24 14:10:08 [loggers.py:273] Engine 001: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 4 reqs, Waiting: 2 reqs, GPU KV cache usage: 13.6%, Prefix cache hit rate: 0.0%
(APIServer pid=7151) INFO 07-24 14:10:18 [loggers.py:273] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 12.5 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.5%, Prefix cache hit rate: 50.0%
(APIServer pid=7151) INFO 07-24 14:10:18 [loggers.py:273] Engine 001: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%
"""
V0_LOG = """\
INFO 08-20 12:34:56 metrics.py:406] Avg prompt throughput: 123.4 tokens/s, Avg generation throughput: 45.6 tokens/s, Running: 5 reqs, Swapped: 0 reqs, Pending: 2 reqs, GPU KV cache usage: 12.3%, CPU KV cache usage: 0.0%.
INFO 08-20 12:35:01 metrics.py:406] Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 80.0 tokens/s, Running: 7 reqs, Swapped: 0 reqs, Pending: 0 reqs, GPU KV cache usage: 20.0%, CPU KV cache usage: 0.0%.
"""


def test_v1_log_with_two_engines(tmp_path):
    path = tmp_path / "server.log"
    path.write_text(V1_LOG)
    s = load_series(path, year=2025)
    assert list(s["t_s"]) == [0.0, 10.0]
    assert list(s["running"]) == [130, 1] and list(s["waiting"]) == [2, 0]
    assert s["kv_usage_pct"].tolist() == pytest.approx([25.0, 0.25])       # averaged over engines
    assert s["generation_tps"].tolist() == pytest.approx([3572.1, 12.5])    # added up
    assert s.attrs["t0_wall"] == pd.Timestamp("2025-07-24 14:10:08", tz="UTC").timestamp()


def test_v0_log_pending_is_waiting(tmp_path):
    path = tmp_path / "v0.log"
    path.write_text(V0_LOG)
    s = load_series(path, year=2024)
    assert list(s["t_s"]) == [0.0, 5.0] and list(s["waiting"]) == [2, 0] and list(s["running"]) == [5, 7]
    assert s["kv_usage_pct"].tolist() == pytest.approx([12.3, 20.0])


def test_scrapes_with_time_headers_and_counters(tmp_path):
    scrape = ("# HELP vllm:num_requests_running x\nvllm:num_requests_running{{engine=\"0\"}} {r}\n"
              "vllm:num_requests_waiting{{engine=\"0\"}} {w}\nvllm:kv_cache_usage_perc{{engine=\"0\"}} {kv}\n"
              "vllm:generation_tokens_total{{engine=\"0\"}} {gen}\n")
    text = "".join(f"# TIME {1700000000 + 2 * i}.5\n" + scrape.format(r=i, w=3 - i, kv=0.1 * i, gen=100 * i * i)
                   for i in range(4))
    path = tmp_path / "scrapes.prom"
    path.write_text(text)
    s = load_series(path)
    assert list(s["t_s"]) == [0, 2, 4, 6] and list(s["running"]) == [0, 1, 2, 3]
    assert s["kv_usage_pct"].tolist() == pytest.approx([0, 10, 20, 30])
    assert math.isnan(s["generation_tps"][0]) and s["generation_tps"][1:].tolist() == pytest.approx([50, 150, 250])
    assert s.attrs["t0_wall"] == 1700000000.5


def test_sample_timestamps_and_query_range(tmp_path):
    text = "".join(f"vllm:num_requests_running {i} {1000 * (50 + i)}\nvllm:gpu_cache_usage_perc 0.5 {1000 * (50 + i)}\n"
                   for i in range(3))
    path = tmp_path / "m.txt"
    path.write_text(text)
    s = load_series(path)
    assert list(s["running"]) == [0, 1, 2] and s["kv_usage_pct"].tolist() == [50, 50, 50]
    answer = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "vllm:num_requests_waiting"}, "values": [[10, "4"], [11, "5"]]},
        {"metric": {"__name__": "vllm:num_requests_running"}, "values": [[10, "1"], [11, "2"]]}]}}
    path = tmp_path / "q.json"
    path.write_text(json.dumps(answer))
    s = load_series(path)
    assert list(s["waiting"]) == [4, 5] and list(s["running"]) == [1, 2] and s["kv_usage_pct"].isna().all()


def test_unreadable_inputs_are_named(tmp_path):
    path = tmp_path / "empty.log"
    path.write_text("INFO hello\n")
    with pytest.raises(UserError, match="no vLLM stats line"):
        load_series(path)
    path.write_text("vllm:num_requests_running 3\n")
    with pytest.raises(UserError, match="without a time"):
        load_series(path)
    with pytest.raises(UserError, match="no such file"):
        load_series(tmp_path / "nope.log")


def _steps() -> pd.DataFrame:
    """A made-up prediction: load rises to 8 running + 4 waiting at 5 s, then drains by 12 s."""
    t = np.arange(0, 12, 0.05)
    running = np.clip(np.minimum(t, 12 - t) * 2, 0, 8).round()
    waiting = np.where((t > 4) & (t < 7), 4, 0)
    return pd.DataFrame({"replica": 0, "start_s": t, "end_s": t + 0.05, "running": running, "waiting": waiting,
                         "kv_blocks_used": running * 10})


def test_alignment_recovers_a_shift_and_the_table_is_zero_when_equal():
    steps = _steps()
    true_offset = 3.2            # the series began 3.2 s after the run's t=0
    times = np.arange(0, 8, 0.5)
    truth = predicted_at(steps, 100, times + true_offset)
    measured = truth.assign(t_s=times)
    measured.attrs["t0_wall"] = None
    offset, how = align_offset(measured, steps, 100)
    assert offset == pytest.approx(true_offset, abs=0.25) and how.startswith("fitted")   # a 0.5 s sampler
    _, table = compare_series(measured, steps, 100, offset)
    assert table["mean_abs_diff"].max() < 0.5
    _, off_table = compare_series(measured, steps, 100, 0.0)
    assert off_table.set_index("quantity").loc["running", "mean_abs_diff"] > 1.0
    measured.attrs["t0_wall"] = 5000.0 + true_offset
    offset, how = align_offset(measured, steps, 100, run_t0_wall=5000.0)
    assert offset == pytest.approx(true_offset) and how.startswith("wall clock")


def test_compare_with_a_server_log_writes_the_series_figure_and_table(tmp_path, capsys):
    from sim.cli import main
    from sim.scenario import load_scenario
    from sim.workload import build_workload

    scenario_path = Path(__file__).resolve().parents[2] / "scenarios" / "serve_smoke.yaml"
    steady = [r for r in build_workload(load_scenario(scenario_path)).requests if not r.is_warmup]
    n = len(steady)
    result = {"date": "20250724-141030", "duration": 2.0, "completed": n, "failed": 0, "num_prompts": n,
              "request_rate": 20.0, "input_lens": [r.prompt_len for r in steady],
              "output_lens": [r.output_len for r in steady], "ttfts": [0.01] * n,
              "itls": [[0.002] * (r.output_len - 1) for r in steady], "errors": [""] * n}
    (tmp_path / "r.json").write_text(json.dumps(result))
    (tmp_path / "server.log").write_text(V1_LOG)
    out = tmp_path / "cmp"
    rc = main(["compare", str(scenario_path), "--vllm-result", str(tmp_path / "r.json"), "--server-log",
               str(tmp_path / "server.log"), "--series-offset", "-0.5", "--out", str(out)])
    assert rc == 0
    aligned = pd.read_csv(out / "series_comparison.csv")
    assert aligned["t_s"].tolist() == [-0.5, 9.5]
    assert aligned["measured_running"].tolist() == [130, 1]
    assert (out / "endpoint_timeline.png").stat().st_size > 0
    manifest = json.loads((out / "measured" / "manifest.json").read_text())
    assert manifest["series"]["offset_s"] == -0.5 and manifest["series"]["alignment"] == "given"
    running = next(r for r in manifest["series_table"] if r["quantity"] == "running")
    assert running["mean_abs_diff"] == pytest.approx((130 + 1) / 2)      # the prediction is idle then
    assert "measured mean" in capsys.readouterr().out


def test_request_lines_give_the_offset(tmp_path):
    """The client's test prompt logs a request line first; the run's own lines are the last N."""
    lines = ["INFO 07-24 14:10:01 [logger.py:41] Received request cmpl-test: prompt: 'test'"]
    lines += [f"INFO 07-24 14:10:{5 + i:02d} [logger.py:41] Received request cmpl-{i}: prompt: 'hi'" for i in range(3)]
    path = tmp_path / "server.log"
    path.write_text("\n".join(lines) + "\n" + V1_LOG)
    s = load_series(path, year=2025)
    assert len(s.attrs["request_walls"]) == 4
    # arrivals at 0.25, 1.25, 2.25 s: the run began at 14:10:04.75, 3.25 s before the first stats line
    offset, how = align_offset(s, _steps(), 100, run_t0_wall=0.0, arrivals_s=np.array([0.25, 1.25, 2.25]))
    assert offset == pytest.approx(3.25) and how.startswith("request time stamps (the last 3 of the log's 4")


@pytest.mark.parametrize("argv, flag", [
    (["compare", "s.yaml", "--vllm-result", "r.json", "--log-year", "2025"], "--log-year 2025"),
    (["bench", "s.yaml", "--endpoint", "http://127.0.0.1:9", "--log-year", "2025"], "--log-year 2025"),
    (["compare", "s.yaml", "--vllm-result", "r.json", "--series-offset", "-0.5"], "--series-offset -0.5"),
])
def test_a_series_flag_without_the_server_log_is_an_error_naming_both(argv, flag, capsys):
    from sim.cli import main

    assert main(argv) == 2                       # before reading any file or sending any request
    err = capsys.readouterr().err
    assert flag in err and "--server-log" in err
