"""Reading `vllm bench serve` result files: the shapes vLLM's versions write, and clean errors.

The synthetic files follow vLLM's own writer (vllm/benchmarks/serve.py, and
benchmarks/benchmark_serving.py of 0.6-0.9): the same keys, order and value types."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sim.vllm.results import VllmResultError, arrival_times, load_results, to_requests


def current_file(n=4, detailed=True, rate="inf", max_concurrency=None, failed=()):
    """A result as vLLM >= 0.10 writes it with --save-result (and --save-detailed)."""
    t0 = 81234.5            # perf_counter at the first send: an arbitrary clock
    ttfts = [0.05 + 0.01 * i for i in range(n)]
    itls = [[0.02] * (7 + i) for i in range(n)]
    data = {"date": "20260410-101500", "endpoint_type": "vllm", "backend": "vllm", "label": None,
            "model_id": "Qwen/Qwen3-0.6B", "tokenizer_id": "Qwen/Qwen3-0.6B", "num_prompts": n,
            "request_rate": rate, "burstiness": 1.0, "max_concurrency": max_concurrency,
            "duration": 1.5, "completed": n - len(failed), "failed": len(failed),
            "total_input_tokens": 100 * n, "total_output_tokens": sum(8 + i for i in range(n)),
            "request_throughput": n / 1.5, "request_goodput": None, "output_throughput": 30.0,
            "total_token_throughput": 300.0,
            "input_lens": [100 + i for i in range(n)],
            "output_lens": [0 if i in failed else 8 + i for i in range(n)],
            "ttfts": [0.0 if i in failed else t for i, t in enumerate(ttfts)],
            "itls": [[] if i in failed else x for i, x in enumerate(itls)],
            "latencies": [0.0 if i in failed else ttfts[i] + sum(itls[i]) for i in range(n)],
            "start_times": [t0 + 0.25 * i for i in range(n)],
            "queue_times": [0.0] * n, "generated_texts": ["" if i in failed else "abc" for i in range(n)],
            "errors": ["Traceback: boom" if i in failed else "" for i in range(n)],
            "max_output_tokens_per_s": 50.0, "max_concurrent_requests": 3, "rtfx": 0.0,
            "mean_ttft_ms": 65.0, "median_ttft_ms": 65.0, "std_ttft_ms": 11.2, "p99_ttft_ms": 79.7,
            "mean_tpot_ms": 20.0, "median_tpot_ms": 20.0, "std_tpot_ms": 0.0, "p99_tpot_ms": 20.0,
            "mean_itl_ms": 20.0, "median_itl_ms": 20.0, "std_itl_ms": 0.0, "p99_itl_ms": 20.0}
    if not detailed:   # serve.py deletes these without --save-detailed (latencies/queue_times stay)
        for key in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"):
            del data[key]
    return data


def old_file(n=3):
    """benchmarks/benchmark_serving.py (vLLM 0.6): per-request arrays always, no start_times."""
    return {"date": "20241001-120000", "backend": "vllm", "model_id": "meta-llama/Llama-3.1-8B-Instruct",
            "tokenizer_id": "meta-llama/Llama-3.1-8B-Instruct", "best_of": 1, "use_beam_search": False,
            "num_prompts": n, "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None,
            "duration": 2.0, "completed": n, "total_input_tokens": 300, "total_output_tokens": 30,
            "request_throughput": 1.5, "output_throughput": 15.0, "total_token_throughput": 165.0,
            "input_lens": [100] * n, "output_lens": [10] * n, "ttfts": [0.1] * n,
            "itls": [[0.03] * 9 for _ in range(n)], "generated_texts": ["x"] * n, "errors": [""] * n,
            "mean_ttft_ms": 100.0, "median_ttft_ms": 100.0, "std_ttft_ms": 0.0, "p99_ttft_ms": 100.0,
            "mean_tpot_ms": 30.0, "median_tpot_ms": 30.0, "std_tpot_ms": 0.0, "p99_tpot_ms": 30.0,
            "mean_itl_ms": 30.0, "median_itl_ms": 30.0, "std_itl_ms": 0.0, "p99_itl_ms": 30.0}


def write(tmp_path, data, name="run.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))       # vLLM writes json.dump(result_json, f): one line
    return path


def test_detailed_file_gives_config_metrics_and_its_own_workload(tmp_path):
    [run] = load_results(write(tmp_path, current_file()))
    assert run.model == "Qwen/Qwen3-0.6B" and math.isinf(run.rate) and run.max_concurrency is None
    assert run.metrics["mean_ttft_ms"] == 65.0 and run.metrics["completed"] == 4
    assert "input_lens" not in run.config and "mean_ttft_ms" not in run.config
    rows = run.requests()
    assert [r[1:] for r in rows] == [(100, 8), (101, 9), (102, 10), (103, 11)]
    assert [r[0] for r in rows] == pytest.approx([0.0, 0.25, 0.5, 0.75])   # relative to the first send
    lat = run.latencies()
    assert lat["ttft_s"] == pytest.approx([0.05, 0.06, 0.07, 0.08])
    assert lat["tpot_s"] == pytest.approx([0.02] * 4)      # (e2e - ttft) / (out - 1), vLLM's TPOT


def test_failed_requests_are_left_out_and_counted(tmp_path):
    [run] = load_results(write(tmp_path, current_file(n=5, failed=(2,))))
    assert [r[1] for r in run.requests()] == [100, 101, 103, 104]
    assert len(run.latencies()["ttft_s"]) == 4
    requests, notes = to_requests(run)
    assert len(requests) == 4 and any("1 failed requests" in n for n in notes)


def test_summary_only_file_loads_but_replay_asks_for_detail(tmp_path):
    [run] = load_results(write(tmp_path, current_file(detailed=False)))
    assert not run.detailed and run.metrics["mean_tpot_ms"] == 20.0
    with pytest.raises(VllmResultError, match="--save-detailed"):
        run.requests()


def test_old_benchmark_serving_file_replays_with_redrawn_arrivals(tmp_path):
    [run] = load_results(write(tmp_path, old_file()))
    assert run.rate == 4.0 and run.requests()[0][0] is None
    lat = run.latencies()
    assert lat["e2e_s"] == pytest.approx([0.1 + 9 * 0.03] * 3)     # ttft + sum(itls) without latencies
    requests, notes = to_requests(run, seed=3)
    assert [r.arrival for r in requests][-1] == pytest.approx(3 / 4.0)   # last arrival at n / rate
    assert any("redrawn" in n for n in notes)


def test_append_result_jsonl_is_one_run_per_line(tmp_path):
    path = tmp_path / "runs.jsonl"
    # --append-result: json.dump, then "\n" before each further run
    path.write_text(json.dumps(current_file(rate=2.0)) + "\n" + json.dumps(current_file(rate=8.0)))
    runs = load_results(path)
    assert [r.rate for r in runs] == [2.0, 8.0]
    assert runs[1].source.endswith("runs.jsonl:2")


def test_client_args_rate_of_newer_files(tmp_path):
    data = current_file()
    del data["request_rate"]
    data["client_args"] = {"request_rate": "3.5", "num_prompts": 4}
    [run] = load_results(write(tmp_path, data))
    assert run.rate == 3.5


def test_start_times_order_the_replay(tmp_path):
    data = current_file(n=3)
    data["start_times"] = [10.0, 10.5, 10.2]      # a concurrency semaphore released out of list order
    [run] = load_results(write(tmp_path, data))
    assert [r[1] for r in run.requests()] == [100, 102, 101]
    assert run.latencies()["ttft_s"] == pytest.approx([0.05, 0.07, 0.06])
    times, notes = arrival_times(run, 3)
    assert times == pytest.approx([0.0, 0.2, 0.5]) and notes == []


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(output_lens=[1, 2]), "per-request arrays differ in length"),
    (lambda d: d.update(input_lens=[1, -2, 3, 4]), r"input_lens\[1\] = -2"),
    (lambda d: d.update(ttfts=[0.1, "x", 0.1, 0.1]), r"ttfts\[1\] = 'x'"),
    (lambda d: d.update(itls=[[0.1], 5, [], []]), r"itls\[1\]"),
    (lambda d: d.update(request_rate="fast"), "request_rate = 'fast'"),
    (lambda d: d.update(mean_ttft_ms="65"), "mean_ttft_ms"),
    (lambda d: d.update(input_lens={"a": 1}), "'input_lens' should be a list"),
])
def test_bad_fields_name_the_file_and_field(tmp_path, mutate, message):
    data = current_file()
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(VllmResultError, match=message) as e:
        load_results(path)
    assert str(path) in str(e.value)


def test_not_json_names_the_line(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(current_file()) + "\n{broken\n")
    with pytest.raises(VllmResultError, match=r"runs.jsonl:2: not JSON"):
        load_results(path)


def test_not_a_result_and_missing_file(tmp_path):
    with pytest.raises(VllmResultError, match="not a `vllm bench serve` result"):
        load_results(write(tmp_path, {"hello": 1}))
    with pytest.raises(VllmResultError, match="no such file"):
        load_results(tmp_path / "absent.json")
    with pytest.raises(VllmResultError, match="expected a JSON object"):
        load_results(write(tmp_path, [1, 2]))


def test_a_prediction_written_as_a_vllm_file_reads_back(tmp_path, tiny_scenario_factory=None):
    from sim.predict import predict
    from sim.scenario import validate_scenario
    from sim.vllm.results import vllm_result_dict

    scenario = validate_scenario({"model": "tiny", "device": "cpu",
                                  "engine": {"num_blocks": 256, "max_model_len": 512},
                                  "workload": {"num_requests": 6, "arrival": {"process": "poisson", "rate": 20},
                                               "prompt_len": 40, "output_len": 6}})
    result = predict(scenario)
    path = write(tmp_path, vllm_result_dict(result.requests, {"model_id": "tiny", "request_rate": 20}))
    [run] = load_results(path)
    measured = run.latencies()
    frame = result.requests.sort_values("arrival_s")
    assert measured["ttft_s"] == pytest.approx(frame["ttft_s"].to_numpy())
    assert measured["tpot_s"] == pytest.approx(frame["tpot_s"].to_numpy())
    requests, notes = to_requests(run)
    assert [r.arrival for r in requests] == pytest.approx(frame["arrival_s"] - frame["arrival_s"].min())
    assert notes == [] and np.all([r.prompt_len == 40 for r in requests])


PRINTOUT = """INFO 08-20 10:00:01 Traffic request rate: inf
Burstiness factor: 1.0 (Poisson process)
Maximum request concurrency: None
============ Serving Benchmark Result ============
Successful requests:                     10
Benchmark duration (s):                  14.31
Total input tokens:                      10239
Total generated tokens:                  10240
Request throughput (req/s):              0.70
Output token throughput (tok/s):         715.43
Total Token throughput (tok/s):          1430.80
---------------Time to First Token----------------
Mean TTFT (ms):                          503.72
Median TTFT (ms):                        553.62
P99 TTFT (ms):                           699.66
-----Time per Output Token (excl. 1st token)------
Mean TPOT (ms):                          13.46
Median TPOT (ms):                        13.41
P99 TPOT (ms):                           13.76
==================================================
Request rate configured (RPS):           2.00
============ Serving Benchmark Result ============
Successful requests:                     20
Benchmark duration (s):                  15.22
Total input tokens:                      20460
Total generated tokens:                  20377
Mean TTFT (ms):                          463.10
Mean TPOT (ms):                          14.36
==================================================
"""


def test_a_console_printout_gives_summary_runs(tmp_path):
    path = tmp_path / "bench.txt"
    path.write_text(PRINTOUT)
    first, second = load_results(path)
    assert math.isinf(first.rate) and second.rate == 2.0 and not first.detailed
    assert first.metrics["completed"] == 10 and first.metrics["p99_ttft_ms"] == 699.66
    assert first.metrics["duration"] == 14.31 and second.metrics["mean_tpot_ms"] == 14.36
    assert first.source.endswith("bench.txt:5") and first.config["max_concurrency"] is None


def test_a_broken_printout_names_the_line(tmp_path):
    path = tmp_path / "bench.txt"
    path.write_text(PRINTOUT.replace("14.31", "fourteen"))
    with pytest.raises(VllmResultError, match=r"bench.txt:6: 'Benchmark duration \(s\)' = 'fourteen'"):
        load_results(path)
    path.write_text("hello\n")
    with pytest.raises(VllmResultError, match="not JSON"):
        load_results(path)
