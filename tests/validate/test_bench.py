"""`simrun bench` against misbehaving endpoints, and `simrun compare` on vLLM result files."""
import json
import math
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from sim.cli import main
from sim.scenario import load_scenario, validate_scenario
from sim.workload import build_workload
from sim.vllm.timeseries import parse_prometheus, pool_blocks, timeline_row
from validate.bench import run_bench
from validate.endpoint_client import MalformedStream, normalise_endpoint, sse_event
from validate.vllm_result import read_vllm_result

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "scenarios" / "serve_smoke.yaml"


# ----------------------------------------------------------------------------- vLLM result files

def vllm_detailed_result(scenario) -> dict:
    """What `vllm bench serve --save-result --save-detailed` writes for this workload (one failure)."""
    steady = [r for r in build_workload(scenario).requests if not r.is_warmup]
    n = len(steady)
    ttfts = [0.05 + 0.01 * i for i in range(n)]
    itls = [[0.002 + 0.0001 * j for j in range(r.output_len - 1)] for r in steady]
    errors = [""] * n
    ttfts[3], itls[3], errors[3] = 0.0, [], "Bad Request"
    return {"date": "20250101-000000", "backend": "vllm", "model_id": "tiny", "num_prompts": n,
            "request_rate": scenario.workload.arrival.rate, "burstiness": 1.0, "max_concurrency": None,
            "duration": 2.0, "completed": n - 1, "failed": 1,
            "input_lens": [r.prompt_len for r in steady],
            "output_lens": [0 if errors[i] else r.output_len for i, r in enumerate(steady)],
            "ttfts": ttfts, "itls": itls, "errors": errors, "start_times": [100 + 0.05 * i for i in range(n)]}


def test_vllm_result_is_read_back_with_vllm_definitions(tmp_path, capsys):
    scenario = load_scenario(SCENARIO)
    data = vllm_detailed_result(scenario)
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "cmp"
    assert main(["compare", str(SCENARIO), "--vllm-result", str(path), "--out", str(out)]) == 0
    summary = json.loads((out / "measured" / "summary.json").read_text())
    ok = [i for i, e in enumerate(data["errors"]) if not e]
    ttft = np.array([data["ttfts"][i] for i in ok])
    e2e = np.array([data["ttfts"][i] + sum(data["itls"][i]) for i in ok])
    out_lens = np.array([data["output_lens"][i] for i in ok])
    tpot = (e2e - ttft) / (out_lens - 1)
    itl = np.concatenate([data["itls"][i] for i in ok])
    assert summary["requests_finished"] == 17 and summary["requests_failed"] == 1 and summary["partial"]
    assert summary["request_throughput"] == pytest.approx(17 / 2.0)
    assert summary["output_token_throughput"] == pytest.approx(out_lens.sum() / 2.0)
    total_in = sum(data["input_lens"][i] for i in ok)
    assert summary["total_token_throughput"] == pytest.approx((total_in + out_lens.sum()) / 2.0)
    for key, values in (("ttft_s", ttft), ("e2e_s", e2e), ("tpot_s", tpot), ("itl_s", itl)):
        assert summary[key]["mean"] == pytest.approx(values.mean()), key
        assert summary[key]["p50"] == pytest.approx(np.percentile(values, 50)), key
        assert summary[key]["p99"] == pytest.approx(np.percentile(values, 99)), key
    assert summary["kv_blocks_peak"] is None and summary["prefix_hit_rate"] is None   # not in the file
    manifest = json.loads((out / "measured" / "manifest.json").read_text())
    assert manifest["notes"] == [] and manifest["vllm"]["model_id"] == "tiny"
    assert (out / "comparison.csv").exists() and (out / "report.html").exists()
    assert (out / "predicted" / "summary.json").exists()
    assert "TTFT p99" in capsys.readouterr().out


def test_vllm_result_for_another_workload_is_flagged(tmp_path):
    scenario = load_scenario(SCENARIO)
    data = vllm_detailed_result(scenario)
    data["input_lens"] = [2 * n for n in data["input_lens"]] + [64]
    for key in ("ttfts", "itls", "output_lens", "errors", "start_times"):
        data[key].append(data[key][0])
    data["completed"] += not data["errors"][0]       # a consistent file: the copied request counts
    data["request_rate"] = "inf"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(data))
    notes = read_vllm_result(path, scenario).manifest["notes"]
    assert any("the file holds 19 requests, the scenario 20" in n for n in notes)
    assert any(n.startswith("prompt lengths: mean") for n in notes)
    assert any("request_rate inf" in n for n in notes)
    assert not any(n.startswith("output lengths") for n in notes)


def test_vllm_aggregate_only_result(tmp_path):
    """Without --save-detailed vLLM drops the per-request lists and keeps the aggregates."""
    scenario = load_scenario(SCENARIO)
    steady = [r for r in build_workload(scenario).requests if not r.is_warmup]
    data = {"duration": 4.0, "completed": len(steady), "failed": 0, "num_prompts": len(steady),
            "request_rate": scenario.workload.arrival.rate,
            "total_input_tokens": sum(r.prompt_len for r in steady),
            "total_output_tokens": sum(r.output_len for r in steady),
            "request_throughput": 4.5, "output_throughput": 50.0, "total_token_throughput": 320.0,
            "mean_ttft_ms": 20.0, "median_ttft_ms": 18.0, "p99_ttft_ms": 40.0,
            "mean_tpot_ms": 3.0, "median_tpot_ms": 2.9, "p99_tpot_ms": 6.0,
            "mean_itl_ms": 3.1, "median_itl_ms": 2.8, "p99_itl_ms": 7.0, "mean_e2el_ms": 60.0}
    path = tmp_path / "agg.json"
    path.write_text(json.dumps(data))
    measured = read_vllm_result(path, scenario)
    s = measured.summary
    assert s["ttft_s"] == pytest.approx({"mean": 0.02, "p50": 0.018, "p90": None, "p99": 0.04, "max": None})
    assert s["itl_s"]["p99"] == pytest.approx(0.007) and s["e2e_s"]["mean"] == pytest.approx(0.06)
    assert s["request_throughput"] == 4.5 and s["output_token_throughput"] == 50.0
    assert measured.manifest["notes"] == [] and measured.manifest["per_request"] is False


def test_compare_refuses_a_file_that_is_not_a_vllm_result(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    assert main(["compare", str(SCENARIO), "--vllm-result", str(path)]) == 2
    assert "not a `vllm bench serve` result" in capsys.readouterr().err


# ----------------------------------------------------------------------------- wire formats

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2049",prefix_caching="True"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 12.0
"""


def test_vllm_metrics_become_a_timeline_row():
    values, labels = parse_prometheus(VLLM_METRICS)
    row = timeline_row(values)
    assert {k: row[k] for k in ("running", "waiting", "kv_usage", "preemptions", "prefix_queries", "prefix_hits")} \
        == {"running": 5.0, "waiting": 1.0, "kv_usage": 0.375, "preemptions": 7.0, "prefix_queries": 100.0,
            "prefix_hits": 40.0}
    assert math.isnan(row["generation_tokens"])                 # not in this scrape
    assert pool_blocks(labels) == 2048                          # the null block is not usable
    assert timeline_row(parse_prometheus("# nothing\nprocess_cpu_seconds_total 3.0\n")[0]) is None


def test_sse_events_and_endpoint_urls():
    assert sse_event("data: [DONE]") == "[DONE]"
    assert sse_event('data: {"choices": []}') == {"choices": []}
    for bad in ("event: ping", "data: {not json", 'data: {"id": 1}', "data: [1, 2]"):
        with pytest.raises(MalformedStream):
            sse_event(bad)
    assert normalise_endpoint("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"


# ----------------------------------------------------------------------------- misbehaving endpoints

def fake_endpoint(app) -> tuple[str, callable]:
    """Serve a Starlette app on a free loopback port in a thread; returns (url, stop)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop():
        server.should_exit = True
        thread.join(5)
    return f"http://127.0.0.1:{port}", stop


def misbehaving_app(short_smoke: bool = False):
    """Answers by max_tokens: 8 (the smoke request) and 4 well, 5 with HTTP 500, 6 with a
    non-JSON event, 7 cut before [DONE], 3 with fewer tokens than asked."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def chunk(token, usage=None):
        body = {"choices": [{"index": 0, "text": str(token), "finish_reason": None}]} if usage is None else \
            {"choices": [], "usage": usage}
        return f"data: {json.dumps(body)}\n\n"

    async def models(_request):
        return JSONResponse({"data": [{"id": "fake", "root": "fake"}]})

    async def completions(request):
        n = (await request.json())["max_tokens"]
        if n == 5:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        sent = n - 1 if n == 3 or (n == 8 and short_smoke) else n

        async def events():
            for t in range(sent):
                yield chunk(t)
            if n == 6:
                yield "data: {oops\n\n"
            if n != 7:
                yield chunk(0, {"completion_tokens": sent})
                yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


def small_raw(outputs: list[int]) -> dict:
    return {"model": "tiny", "device": "cpu", "engine": {"num_blocks": 64, "max_model_len": 256},
            "workload": {"requests": [{"prompt_len": 16, "output_len": n, "arrival_s": 0.01 * i}
                                      for i, n in enumerate(outputs)]}}


def test_failed_and_malformed_requests_are_kept_and_marked():
    url, stop = fake_endpoint(misbehaving_app())
    try:
        measured = run_bench(validate_scenario(small_raw([4, 5, 6, 7, 3, 4])), url, None, 10.0, 0.5)
    finally:
        stop()
    frame = measured.requests.set_index("id")
    reasons = frame["reject_reason"]
    assert list(frame["status"]) == ["finished", "failed", "failed", "failed", "failed", "finished"]
    assert reasons[1] == "HTTP 500: boom"
    assert reasons[2].startswith("malformed stream: event is not JSON")
    assert reasons[3] == "the stream ended before [DONE], after 7 chunk(s)"
    assert reasons[4] == "2 tokens returned, 3 asked with ignore_eos"
    s = measured.summary
    assert s["partial"] and s["requests_failed"] == 4 and s["requests_finished"] == 2
    assert s["ttft_s"]["p50"] > 0 and s["kv_blocks_peak"] is None          # no /metrics here
    assert measured.manifest["server"]["model"] == "fake"
    assert any("no vLLM /metrics" in n for n in measured.manifest["notes"])
    assert measured.manifest["prefix_cache"]["reset"] == "not offered (HTTP 404)"


def test_failing_smoke_request_stops_the_bench(tmp_path, capsys):
    url, stop = fake_endpoint(misbehaving_app(short_smoke=True))
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(small_raw([4])))
    try:
        code = main(["bench", str(scenario), "--endpoint", url, "--out", str(tmp_path / "o")])
    finally:
        stop()
    assert code == 2
    assert "the smoke request (16 prompt tokens, max_tokens 8) failed: 7 tokens returned, 8 asked" in \
        capsys.readouterr().err
