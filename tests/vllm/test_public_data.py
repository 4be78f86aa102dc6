"""The cited public vLLM data (tests/data/vllm_public): loader and schema checks.

These tests do not compare vLLM with kvtwin; they check that every entry names its source, has the
fields the calibration and memory-plan tests rely on, and that the numbers copied from each log
agree with each other and with the verbatim lines kept beside them. That is what catches a
transcription error (a dropped digit, a value pasted into the wrong field).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

DATA = Path(__file__).parents[1] / "data" / "vllm_public"
STARTUP = DATA / "startup_logs.yaml"
BENCH = DATA / "bench_runs.yaml"

STARTUP_FIELDS = (
    "id", "source", "gpu", "vllm_version", "engine", "model", "dtype", "quantization", "kv_cache_dtype",
    "tp", "pp", "dp", "gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "enforce_eager", "enable_prefix_caching", "cudagraph_mode", "cudagraph_captures", "block_size",
    "non_default_args", "printed", "lines", "per_rank_lines_differ", "hybrid_attention",
)
PRINTED_FIELDS = (
    "weights_gib", "available_kv_cache_gib", "kv_cache_tokens", "max_concurrency", "num_gpu_blocks",
    "cuda_graph_gib", "cuda_graph_estimated_gib", "total_gpu_memory_gib", "peak_activation_gib",
    "non_torch_gib", "requested_memory_gib", "padding_warning",
)
BENCH_FIELDS = (
    "id", "source", "vllm_version", "gpu", "model", "tp", "pp", "dp", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_dtype", "quantization", "server_command",
    "bench_command", "dataset", "request_rate", "max_concurrency", "metrics", "lines",
)
# vLLM prints throughputs and latencies with 2 decimals: a quotient of two printed numbers can
# differ from the printed rate by rounding only.
RATE_RTOL = 0.01
CONCURRENCY_ATOL = 0.0051


def load_entries(path: Path, key: str) -> list[dict]:
    """The list under `key` of a data file, with a clear error naming the file when it is malformed."""
    with path.open() as fh:
        doc = yaml.safe_load(fh)
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise ValueError(f"{path}: expected a mapping with a '{key}:' list")
    return doc[key]


STARTUP_ENTRIES = load_entries(STARTUP, "entries")
BENCH_RUNS = load_entries(BENCH, "runs")


def by_id(entries: list[dict]) -> list:
    return [pytest.param(e, id=str(e.get("id"))) for e in entries]


def appears(value, text: str) -> bool:
    """True when a printed number (or string) occurs in `text` as vLLM formats it."""
    if isinstance(value, str):
        return value in text
    if isinstance(value, bool):
        return True
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 100):
        forms = {f"{int(value):,}", str(int(value))}
        # not inside a longer number: "1,952" must not match "11,952" nor "1,9520"
        return any(re.search(rf"(?<![\d.])(?<!\d,){re.escape(f)}(?!\d|,\d)", text) for f in forms)
    # 1.1 is printed "1.1" or "1.10"; 0.5 as "0.50": allow trailing zeros, not further digits
    return re.search(rf"(?<![\d.]){re.escape(repr(float(value)))}0*(?!\d)", text) is not None


def is_power_of_two(n: float) -> bool:
    return n >= 1 and float(n).is_integer() and (int(n) & (int(n) - 1)) == 0


# ---------------------------------------------------------------- startup logs


def test_startup_logs_cover_enough_deployments():
    ids = [e["id"] for e in STARTUP_ENTRIES]
    assert len(ids) >= 14
    assert len(set(ids)) == len(ids), "duplicate ids in startup_logs.yaml"
    gpus = {e["gpu"]["model"] for e in STARTUP_ENTRIES if e["gpu"]["model"]}
    assert len(gpus) >= 4, gpus
    assert any(e["tp"] > 1 for e in STARTUP_ENTRIES)
    assert any(e["kv_cache_dtype"] == "fp8" for e in STARTUP_ENTRIES)
    assert any(e["quantization"] for e in STARTUP_ENTRIES)


@pytest.mark.parametrize("entry", by_id(STARTUP_ENTRIES))
def test_startup_entry_has_source_and_fields(entry):
    missing = [f for f in STARTUP_FIELDS if f not in entry]
    assert not missing, f"{entry.get('id')}: missing {missing}"
    assert [f for f in PRINTED_FIELDS if f not in entry["printed"]] == []
    assert entry["source"]["url"].startswith("https://"), entry["source"]
    assert entry["source"]["note"]
    assert entry["engine"] in ("V0", "V1")
    assert entry["vllm_version"] is None or isinstance(entry["vllm_version"], str)
    assert entry["model"] and "/" in entry["model"], "model must be a Hugging Face id"
    for f in ("tp", "pp", "dp"):
        assert isinstance(entry[f], int) and entry[f] >= 1
    assert entry["gpu"]["count"] == entry["tp"] * entry["pp"] * entry["dp"]
    assert entry["lines"], "keep the key lines verbatim"
    assert all(isinstance(l, str) for l in entry["lines"] + entry.get("quoted", [])), "a line parsed as YAML"


@pytest.mark.parametrize("entry", by_id(STARTUP_ENTRIES))
def test_startup_printed_numbers_are_in_the_verbatim_lines(entry):
    text = "\n".join(entry["lines"] + entry.get("quoted", []))
    wrong = {k: v for k, v in entry["printed"].items() if v is not None and not appears(v, text)}
    assert not wrong, f"{entry['id']}: not found in lines: {wrong}"


@pytest.mark.parametrize("entry", by_id(STARTUP_ENTRIES))
def test_startup_config_agrees_with_the_engine_config_line(entry):
    engine_lines = [l for l in entry["lines"] if l.startswith("Initializing a V1 LLM engine")]
    if not engine_lines:
        pytest.skip("no engine-config line printed")
    line = engine_lines[0]
    assert f"(v{entry['vllm_version']})" in line
    expected = [f"tensor_parallel_size={entry['tp']},", f"pipeline_parallel_size={entry['pp']},",
                f"max_seq_len={entry['max_model_len']},", f"dtype=torch.{entry['dtype']},",
                f"kv_cache_dtype={entry['kv_cache_dtype']},", f"quantization={entry['quantization']},",
                f"enforce_eager={entry['enforce_eager']},"]
    assert [s for s in expected if s not in line + ","] == []


@pytest.mark.parametrize("entry", by_id([e for e in STARTUP_ENTRIES if not e["hybrid_attention"]]))
def test_startup_tokens_blocks_and_concurrency_agree(entry):
    p, max_len = entry["printed"], entry["max_model_len"]
    tokens, blocks, conc = p["kv_cache_tokens"], p["num_gpu_blocks"], p["max_concurrency"]
    if tokens and blocks:
        if entry["block_size"]:
            assert tokens == blocks * entry["block_size"]
        else:
            assert is_power_of_two(tokens / blocks), f"tokens/blocks = {tokens / blocks}"
    if tokens and conc and max_len:
        assert math.isclose(tokens / max_len, conc, abs_tol=CONCURRENCY_ATOL)
    elif blocks and conc and max_len:
        block_size = round(conc * max_len / blocks)
        assert is_power_of_two(block_size)
        assert math.isclose(blocks * block_size / max_len, conc, abs_tol=CONCURRENCY_ATOL)


@pytest.mark.parametrize("entry", by_id(STARTUP_ENTRIES))
def test_startup_requested_memory_is_utilization_times_total(entry):
    p, util = entry["printed"], entry["gpu_memory_utilization"]
    if None in (p["total_gpu_memory_gib"], p["requested_memory_gib"], util):
        pytest.skip("total, requested or utilization not printed")
    assert math.isclose(p["total_gpu_memory_gib"] * util, p["requested_memory_gib"], abs_tol=0.011)


# ---------------------------------------------------------------- serving benchmarks


def test_bench_runs_cover_the_fidelity_table_requirements():
    ids = [r["id"] for r in BENCH_RUNS]
    assert len(ids) >= 10
    assert len(set(ids)) == len(ids), "duplicate ids in bench_runs.yaml"
    assert len({r["gpu"]["model"].split("-")[0] for r in BENCH_RUNS}) >= 3
    assert len({r["model"] for r in BENCH_RUNS}) >= 2
    assert any(r["tp"] > 1 for r in BENCH_RUNS)
    assert not any("LLMServingSim" in r["source"]["url"] for r in BENCH_RUNS), "reserved for an independent check"


@pytest.mark.parametrize("run", by_id(BENCH_RUNS))
def test_bench_run_has_source_config_and_metrics(run):
    missing = [f for f in BENCH_FIELDS if f not in run]
    assert not missing, f"{run.get('id')}: missing {missing}"
    assert run["source"]["url"].startswith("https://") and run["source"]["note"]
    assert isinstance(run["vllm_version"], str)
    assert run["gpu"]["model"] and run["gpu"]["count"] == run["tp"] * run["pp"] * run["dp"]
    assert run["model"] and "/" in run["model"]
    assert run["dataset"]["name"] in ("random", "sharegpt")
    assert run["server_command"] or run.get("startup_log_id"), "the serving configuration must be known"
    assert run["metrics"] and run["lines"]
    assert all(isinstance(l, str) for l in run["lines"]), "a line parsed as YAML"


@pytest.mark.parametrize("run", by_id(BENCH_RUNS))
def test_bench_metrics_are_in_the_verbatim_lines(run):
    text = "\n".join(run["lines"])
    wrong = {k: v for k, v in run["metrics"].items() if not appears(v, text)}
    assert not wrong, f"{run['id']}: not found in lines: {wrong}"


@pytest.mark.parametrize("run", by_id([r for r in BENCH_RUNS if r["metrics"].get("duration_s")]))
def test_bench_throughputs_are_totals_over_duration(run):
    m = run["metrics"]
    duration = m["duration_s"]
    assert math.isclose(m["total_output_tokens"] / duration, m["output_throughput"], rel_tol=RATE_RTOL)
    total = (m["total_input_tokens"] + m["total_output_tokens"]) / duration
    assert math.isclose(total, m["total_token_throughput"], rel_tol=RATE_RTOL)
    # 0.21 req/s is 10/46.96 rounded to 2 decimals: allow the rounding step as well
    assert math.isclose(m["completed"] / duration, m["request_throughput"], rel_tol=RATE_RTOL, abs_tol=0.0051)


@pytest.mark.parametrize("run", by_id(BENCH_RUNS))
def test_bench_percentiles_are_ordered(run):
    m = run["metrics"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        median = m.get(f"median_{metric}_ms")
        for tail in ("p95", "p99"):
            high = m.get(f"{tail}_{metric}_ms")
            if median is not None and high is not None:
                assert median <= high, f"{metric}: median {median} > {tail} {high}"


# A single random prompt can re-tokenize to fewer tokens than asked (gpt-oss: 857 of 1024), so
# the input total is only checked where ten or more requests average it out.
@pytest.mark.parametrize("run", by_id([r for r in BENCH_RUNS if r["dataset"]["name"] == "random"
                                       and (r["metrics"].get("completed") or 0) >= 10]))
def test_bench_random_token_totals_match_the_requested_lengths(run):
    m, ds = run["metrics"], run["dataset"]
    expected_input = m["completed"] * ds["random_input_len"]
    assert math.isclose(m["total_input_tokens"], expected_input, rel_tol=0.02)
    if ds["random_output_len"] is not None:  # one README command printed the flag without its value
        # without --ignore-eos a request may stop early, never late
        assert m["total_output_tokens"] <= m["completed"] * ds["random_output_len"]


# ---------------------------------------------------------------- open-loop runs at request rates

RATES = DATA / "rate_runs.yaml"
RATE_RUNS = load_entries(RATES, "runs")


def test_rate_runs_cover_rates_moe_and_parallelism():
    ids = [r["id"] for r in RATE_RUNS]
    assert len(set(ids)) == len(ids), "duplicate ids in rate_runs.yaml"
    by_deployment: dict = {}
    for r in RATE_RUNS:
        d = r["deployment"]
        by_deployment.setdefault((d["model"], d["gpu"], d["tp"]), set()).add(str(r["workload"]["request_rate"]))
    assert sum(len(rates) >= 3 for rates in by_deployment.values()) >= 2, "several rates per deployment"
    assert {r["deployment"]["tp"] for r in RATE_RUNS} >= {1, 2, 4, 8}
    assert any("Mixtral" in r["deployment"]["model"] for r in RATE_RUNS), "an MoE deployment"
    assert len({r["source"]["repo"] for r in RATE_RUNS}) >= 2


@pytest.mark.parametrize("run", by_id(RATE_RUNS))
def test_rate_run_cites_a_pinned_file_and_its_licence(run):
    src = run["source"]
    assert re.fullmatch(r"[0-9a-f]{40}", src["commit"])
    assert src["url"] == f"https://github.com/{src['repo']}/blob/{src['commit']}/{src['path']}"
    assert src["licence"] and src["note"]
    d = run["deployment"]
    assert d["gpu"] and d["count"] == d["tp"] * d["pp"] * d["dp"] and "/" in d["model"]
    assert "vllm_version" in d and "interconnect" in d
    assert run["workload"]["arrivals"] in ("constant", "poisson")


@pytest.mark.parametrize("run", by_id(RATE_RUNS))
def test_rate_run_metrics_are_consistent(run):
    """Means (medians where the source publishes percentiles only, AccelMark) below their p99."""
    m = run["metrics"]
    centre = "mean" if "mean" in m["ttft_s"] else "median"
    for metric in ("ttft_s", "tpot_s", "e2e_s") if "e2e_s" in m else ("ttft_s", "tpot_s"):
        assert 0 < m[metric][centre] < 1e4 and 0 < m[metric]["p99"] < 1e4
        assert centre == "mean" or m[metric][centre] <= m[metric].get("p90", m[metric]["p99"]) <= m[metric]["p99"]
    assert "e2e_s" not in m or m["ttft_s"]["mean"] < m["e2e_s"]["mean"]
    assert m["completed"] > 0 and m["failed"] >= 0
    assert 0 < m["request_throughput"] <= (run["workload"]["request_rate"] if run["workload"]["request_rate"] != "inf"
                                           else math.inf) * 1.02


@pytest.mark.parametrize("run", by_id([r for r in RATE_RUNS if r["workload"].get("per_request_file")]))
def test_rate_run_per_request_file_matches_its_summary(run):
    """The cut per-request file must still give the source's printed summary (mean TTFT, the
    request count) and the E2E recorded beside it: a truncated or mismatched file fails here."""
    import json

    path = DATA / run["workload"]["per_request_file"]
    assert path.stat().st_size < 1_000_000
    d = json.loads(path.read_text())
    assert len(d["ttfts"]) == len(d["latencies"]) == len(d["input_lens"]) == run["metrics"]["completed"]
    assert math.isclose(sum(d["ttfts"]) / len(d["ttfts"]) * 1e3, d["mean_ttft_ms"], rel_tol=1e-5)
    assert math.isclose(d["mean_ttft_ms"] / 1e3, run["metrics"]["ttft_s"]["mean"], rel_tol=1e-9)
    assert math.isclose(sum(d["latencies"]) / len(d["latencies"]), run["metrics"]["e2e_s"]["mean"], rel_tol=1e-5)
    tpot = [(l - t) / (o - 1) for l, t, o in zip(d["latencies"], d["ttfts"], d["output_lens"]) if o > 1]
    assert math.isclose(sum(tpot) / len(tpot) * 1e3, d["mean_tpot_ms"], rel_tol=1e-4)


ACCELMARK = [r for r in RATE_RUNS if r["workload"]["client"] == "accelmark"]


@pytest.mark.parametrize("run", by_id(ACCELMARK))
def test_accelmark_run_names_its_replay_inputs(run):
    """An AccelMark level replays its load generator's Poisson draws over its dataset's prompts: the
    draws before it are whole earlier levels x repeats, the prompt counts file holds its requests, the
    throughput is its requests over the median elapsed time, and the mean output stays under the cap."""
    import json

    w, m = run["workload"], run["metrics"]
    assert w["arrivals"] == "poisson" and w["seed"] == 42
    assert w["draws_before"] % (w["num_requests"] * w["repeats"]) == 0
    counts = json.loads((DATA / w["input_tokens_file"]).read_text())["input_tokens"]
    assert len(counts) >= w["num_requests"] and all(c > 0 for c in counts)
    assert ("template_tokens" in w) != ("input_scale" in w)
    assert 1 <= w["output_len_mean"] <= w["max_tokens"]
    assert math.isclose(m["request_throughput"], w["num_requests"] / m["elapsed_s_median"], rel_tol=1e-3)
    assert m["completed"] + m["failed"] == w["num_requests"] * w["repeats"]
    assert run["deployment"]["engine"] == ("V0" if run["deployment"]["vllm_version"].startswith("0.7") else "V1")


@pytest.mark.parametrize("run", by_id([r for r in RATE_RUNS if r["workload"]["client"] == "inference-perf"]))
def test_inference_perf_stage_names_its_prompt_set_and_earlier_stages(run):
    """The fixed prompt set the replay cycles through, from the configuration inference-perf ran, and
    the stages before this one (a later stage starts with every prompt in vLLM's prefix cache)."""
    w = run["workload"]
    sp = w["shared_prefix"]
    assert sp["groups"] >= 1 and sp["prompts_per_group"] >= 1
    assert sp["source"] == run["source"]["path"].split("/results/")[0] + "/results/config.yaml"
    assert len(w["stages_before"]) == w["stage"] and f"stage_{w['stage']}_" in run["source"]["path"]
    assert sp["system_prompt_len"] < w["prompt_len_mean"] < sp["system_prompt_len"] + sp["question_len"] + 64
