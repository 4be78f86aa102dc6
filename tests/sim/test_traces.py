"""Trace loaders: small hand-written files in each format, then the real public traces."""
import json
import os
import time
from pathlib import Path

import pytest

from sim.core.request import stable_key
from sim.scenario import Trace, validate_scenario
from sim.traces import TraceError, load_trace
from sim.workload import build_workload

# The public traces are not part of the repository (docs/scenarios.md, "Public traces"): the tests
# that read them run when KVTWIN_TRACES names the folder holding azure_llm_2023/ and mooncake/.
TRACES = Path(os.environ.get("KVTWIN_TRACES", "/nonexistent-kvtwin-traces"))


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def load(path, fmt, seed=0, **options):
    return load_trace(Trace(format=fmt, path=path, **options), seed)


def arrivals(loaded):
    return [r.arrival for r in loaded.requests]


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


@pytest.fixture
def azure(tmp_path):
    return write(tmp_path / "azure.csv", [
        AZURE_HEADER,
        "2023-11-16 18:15:46.6805900,374,44",
        "2023-11-16 18:15:50.9951690,396,109",
        "2023-11-16 18:15:47.0000001,100,10",      # out of order: replayed in time order
        "2023-11-16 18:16:46.6805900,50,5",
    ])


# ----------------------------------------------------------------------------- azure

def test_azure_keeps_all_seven_fractional_digits_and_sorts_rows(azure):
    loaded = load(azure, "azure")
    assert arrivals(loaded) == pytest.approx([0.0, 0.3194101, 4.314579, 60.0], abs=1e-9)
    assert [(r.prompt_len, r.output_len) for r in loaded.requests] == [(374, 44), (100, 10), (396, 109), (50, 5)]
    assert [r.id for r in loaded.requests] == [0, 1, 2, 3]
    assert "rows were not in time order; replayed in time order" in loaded.notes


def test_azure_prompts_are_unique_segments(azure):
    loaded = load(azure, "azure")
    assert len({r.segments[0] for r in loaded.requests}) == 4
    assert all(len(r.segments) == 2 for r in loaded.requests)    # prompt + scripted output


@pytest.mark.parametrize("row, message", [
    ("2023-11-16 18:15:4x,1,1", r"azure.csv:3: TIMESTAMP is '2023-11-16 18:15:4x', expected a time"),
    (",1,1", r"azure.csv:3: TIMESTAMP is '', expected a time"),
    ("2023-11-16 18:15:47,ten,1", r"azure.csv:3: ContextTokens is 'ten', expected a finite number"),
    ("2023-11-16 18:15:47,nan,1", r"azure.csv:3: ContextTokens is 'nan', expected a finite number"),
    ("2023-11-16 18:15:47,5,-2", r"azure.csv:3: GeneratedTokens is '-2', expected a whole number"),
    ("2023-11-16 18:15:47,5.5,2", r"azure.csv:3: ContextTokens is '5.5', expected a whole number"),
    ("2023-11-16 18:15:47,5", r"azure.csv:3: 2 fields, expected 3"),
])
def test_malformed_azure_rows_name_file_and_line(tmp_path, row, message):
    path = write(tmp_path / "azure.csv", [AZURE_HEADER, "2023-11-16 18:15:46.6805900,374,44", row])
    with pytest.raises(TraceError, match=message):
        load(path, "azure")


def test_missing_column_names_the_header_line(tmp_path):
    path = write(tmp_path / "azure.csv", ["TIMESTAMP,ContextTokens", "2023-11-16 18:15:46,1"])
    with pytest.raises(TraceError, match=r"azure.csv:1: missing column 'GeneratedTokens'"):
        load(path, "azure")


# ----------------------------------------------------------------------------- selection

@pytest.fixture
def ten_rows(tmp_path):
    """burstgpt rows at t = 0, 10, ..., 90 s."""
    rows = [f"{10 * i},{i},ChatGPT,{100 + i},{10 + i},{110 + 2 * i},Conversation log" for i in range(10)]
    return write(tmp_path / "burst.csv", ["Timestamp,Session ID,Model,Request tokens,Response tokens,"
                                          "Total tokens,Log Type"] + rows)


def test_time_scale_divides_arrivals(ten_rows):
    assert arrivals(load(ten_rows, "burstgpt", time_scale=2)) == [5.0 * i for i in range(10)]


def test_window_selects_on_the_original_clock_before_scaling(ten_rows):
    loaded = load(ten_rows, "burstgpt", window_s=(20, 50), time_scale=2)
    assert arrivals(loaded) == [0.0, 5.0, 10.0]               # rows at 20, 30, 40 s, shifted and halved
    assert [r.prompt_len for r in loaded.requests] == [102, 103, 104]
    assert "window_s [20, 50): excluded 7 rows outside it" in loaded.notes


def test_sample_is_seeded_and_counted(ten_rows):
    one = load(ten_rows, "burstgpt", sample=0.5, seed=3)
    again = load(ten_rows, "burstgpt", sample=0.5, seed=3)
    assert arrivals(one) == arrivals(again)
    dropped = 10 - len(one.requests)
    assert f"sample 0.5: excluded {dropped} of 10 rows" in one.notes
    samples = [len(load(ten_rows, "burstgpt", sample=0.5, seed=s).requests) for s in range(20)]
    assert len(set(samples)) > 1


def test_max_requests_keeps_the_first_after_the_window(ten_rows):
    loaded = load(ten_rows, "burstgpt", window_s=(25, 100), max_requests=2)
    assert arrivals(loaded) == [5.0, 15.0]
    assert "max_requests 2: excluded the last 5 rows" in loaded.notes


def test_an_empty_selection_is_an_error(ten_rows):
    with pytest.raises(TraceError, match="no rows left to replay"):
        load(ten_rows, "burstgpt", window_s=(1000, 2000))


# ----------------------------------------------------------------------------- burstgpt

def test_burstgpt_failed_rows_are_excluded_and_reported(tmp_path):
    path = write(tmp_path / "burst.csv", [
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type",
        "5,1,0.5,ChatGPT,472,18,490,Conversation log",
        "6,2,0.0,GPT-4,1000,0,1000,API log",
        "7.5,3,1.2,ChatGPT,30,12,42,Conversation log",
        "9,4,0.0,ChatGPT,55,0,55,Conversation log",
    ])
    loaded = load(path, "burstgpt")
    assert [(r.arrival, r.prompt_len, r.output_len) for r in loaded.requests] == [(0.0, 472, 18), (2.5, 30, 12)]
    assert "excluded 2 rows with 0 output tokens (failed requests)" in loaded.notes
    assert "2 of 4 rows replayed" in loaded.notes[0]


def test_burstgpt_nan_timestamp_is_an_error(tmp_path):
    path = write(tmp_path / "burst.csv", ["Timestamp,Request tokens,Response tokens", "1,2,3", "NaN,2,3"])
    with pytest.raises(TraceError, match=r"burst.csv:3: Timestamp is 'NaN', expected a finite number"):
        load(path, "burstgpt")


# ----------------------------------------------------------------------------- mooncake

def mooncake_row(ts, n_in, n_out, ids):
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def test_mooncake_hash_ids_become_shared_512_token_segments(tmp_path):
    path = write(tmp_path / "mc.jsonl", [
        mooncake_row(0, 1100, 20, [0, 1, 2]),
        mooncake_row(1500, 700, 30, [0, 3]),
        "",
        mooncake_row(2500, 512, 40, [4]),
    ])
    a, b, c = load(path, "mooncake").requests
    assert (a.arrival, b.arrival, c.arrival) == (0.0, 1.5, 2.5)   # ms -> s
    k = lambda h: stable_key("mooncake", h)
    assert a.segments[:-1] == [(k(0), 512), (k(1), 512), (k(2), 76)]
    assert b.segments[:-1] == [(k(0), 512), (k(3), 188)]
    assert c.segments[:-1] == [(k(4), 512)]
    assert (a.prompt_len, b.prompt_len, a.output_len) == (1100, 700, 20)
    # Equal leading hash ids -> equal leading KV blocks.
    for r in (a, b):
        r.extend_block_hashes(33, 16)
    assert a.block_hashes[:32] == b.block_hashes[:32] and a.block_hashes[32] != b.block_hashes[32]


@pytest.mark.parametrize("row, message", [
    (mooncake_row(1, 1100, 5, [0, 1]), r"mc.jsonl:2: hash_ids has 2 ids, expected ceil\(1100/512\) = 3"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 5}', r"mc.jsonl:2: hash_ids is not a list"),
    ('{"timestamp": 1, "input_length": 10', r"mc.jsonl:2: not valid JSON"),
    ('{"input_length": 10, "output_length": 5, "hash_ids": [0]}', r"mc.jsonl:2: missing 'timestamp'"),
    (mooncake_row(1, -3, 5, []), r"mc.jsonl:2: input_length is -3, expected a whole number"),
    (mooncake_row(1, 10, "5", [0]), r"mc.jsonl:2: output_length is '5', expected a whole number"),
    # json keeps the last of two equal keys: which output length was meant is not known
    ('{"timestamp": 1, "input_length": 10, "output_length": 5, "output_length": 7, "hash_ids": [0]}',
     r"mc.jsonl:2: duplicate key 'output_length' in one object"),
])
def test_malformed_mooncake_rows_name_file_and_line(tmp_path, row, message):
    path = write(tmp_path / "mc.jsonl", [mooncake_row(0, 10, 5, [0]), row])
    with pytest.raises(TraceError, match=message):
        load(path, "mooncake")


def test_mooncake_block_size_option(tmp_path):
    path = write(tmp_path / "mc.jsonl", [mooncake_row(0, 40, 5, [7, 8, 9])])
    (r,) = load(path, "mooncake", hash_block_tokens=16).requests
    assert [n for _, n in r.segments[:-1]] == [16, 16, 8]


# ----------------------------------------------------------------------------- generic jsonl

def test_jsonl_request_log(tmp_path):
    path = write(tmp_path / "log.jsonl", [
        json.dumps({"arrival_s": 3.0, "prompt": [5, 6, 7], "output_len": 4, "tenant": "a", "priority": 2}),
        json.dumps({"timestamp": 1.0, "prompt_len": 50, "output_len": 8, "tenant": "b", "model": "x"}),
        json.dumps({"arrival_s": 2.0, "prompt": [], "output_len": 8}),
    ])
    loaded = load_trace(Trace(format="jsonl", path=path), 0, salted_tenants=frozenset({"a"}))
    b, a = loaded.requests
    assert (b.arrival, b.prompt_len, b.tenant, b.salt, b.priority) == (0.0, 50, "b", 0, 0)
    assert (a.arrival, a.segments[0], a.tenant, a.priority) == (2.0, [5, 6, 7], "a", 2)
    assert a.salt == stable_key("tenant", "a")
    assert "excluded 1 rows with 0 prompt tokens" in loaded.notes


@pytest.mark.parametrize("obj, message", [
    ({"prompt_len": 5, "output_len": 2}, r"log.jsonl:1: missing 'timestamp'"),
    ({"arrival_s": 1, "prompt_len": 5}, r"log.jsonl:1: missing 'output_len'"),
    ({"arrival_s": 1, "output_len": 2}, r"log.jsonl:1: expected 'prompt' \(token ids\) or 'prompt_len'"),
    ({"arrival_s": 1, "prompt_len": 5, "prompt": [1], "output_len": 2}, r"log.jsonl:1: prompt holds 1 token ids but prompt_len is 5"),
    ({"arrival_s": 1, "prompt": [1, -1], "output_len": 2}, r"log.jsonl:1: prompt\[1\] is -1, expected a token id: integers >= 0"),
    ({"arrival_s": 1, "prompt": "1 2", "output_len": 2}, r"log.jsonl:1: prompt is '1 2', expected a list of token ids"),
    ({"arrival_s": None, "prompt_len": 5, "output_len": 2}, r"log.jsonl:1: arrival_s is None"),
    ({"arrival_s": 1, "prompt_len": 5, "output_len": 2, "tenant": 3}, r"log.jsonl:1: tenant is 3"),
])
def test_malformed_jsonl_rows_name_file_and_line(tmp_path, obj, message):
    path = write(tmp_path / "log.jsonl", [json.dumps(obj)])
    with pytest.raises(TraceError, match=message):
        load(path, "jsonl")


def test_missing_file_names_the_field(tmp_path):
    with pytest.raises(TraceError, match="no such file.*workload.trace.path"):
        load(tmp_path / "nope.csv", "azure")


# ----------------------------------------------------------------------------- through the scenario

def test_build_workload_surfaces_trace_notes_and_warmup(tmp_path, ten_rows):
    s = validate_scenario({"model": "tiny", "device": "cpu", "workload": {
        "trace": {"format": "burstgpt", "path": str(ten_rows), "max_requests": 4},
        "warmup_requests": 1}})
    built = build_workload(s)
    assert [r.is_warmup for r in built.requests] == [True, False, False, False]
    assert "max_requests 4: excluded the last 6 rows" in built.notes


def test_jsonl_trace_tenants_take_their_salt_from_the_tenant_list(tmp_path):
    path = write(tmp_path / "log.jsonl", [
        json.dumps({"arrival_s": i, "prompt_len": 5, "output_len": 2, "tenant": t})
        for i, t in enumerate(["a", "b", "c"])])
    s = validate_scenario({"model": "tiny", "device": "cpu", "workload": {
        "trace": {"format": "jsonl", "path": str(path)},
        "tenants": [{"name": "a"}, {"name": "b", "salt": False}]}})
    assert [r.salt for r in build_workload(s).requests] == [stable_key("tenant", "a"), 0, 0]


# ----------------------------------------------------------------------------- the real traces

REAL = [  # (format, file, rows: docs/scenarios.md "Public traces")
    ("azure", "azure_llm_2023/AzureLLMInferenceTrace_conv.csv", 19_366),
    ("azure", "azure_llm_2023/AzureLLMInferenceTrace_code.csv", 8_819),
    ("mooncake", "mooncake/conversation_trace.jsonl", 12_031),
    ("mooncake", "mooncake/synthetic_trace.jsonl", 3_993),
]


@pytest.mark.parametrize("fmt, name, rows", REAL)
def test_real_trace_loads_every_row_quickly(fmt, name, rows):
    path = TRACES / name
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    start = time.process_time()
    built = build_workload(validate_scenario({"model": "tiny", "device": "cpu", "workload": {
        "trace": {"format": fmt, "path": str(path)}}}))
    assert time.process_time() - start < 3.0
    assert len(built.requests) == rows
    assert built.notes == [f"{path}: {rows} of {rows} rows replayed ({fmt} trace)"]


def test_real_mooncake_prefix_reuse_matches_the_readme():
    """docs/scenarios.md: 36.64 % of conversation-trace blocks repeat an earlier hash id."""
    path = TRACES / "mooncake/conversation_trace.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    seen, repeats, total = set(), 0, 0
    for r in load(path, "mooncake").requests:
        for key, _ in r.segments[:-1]:
            repeats += key in seen
            seen.add(key)
            total += 1
    assert total == 288_500 and repeats / total == pytest.approx(0.3664, abs=5e-4)


# ----------------------------------------------------------------------------- fields, units, gzip, plausibility

def test_fields_and_time_unit_read_a_public_style_log(tmp_path):
    rows = [{"arrival_time_ns": 1_700_000_000_000_000_000 + i * 250_000_000, "input_toks": 10 + i,
             "output_toks": 3, "input_tok_ids": list(range(10 + i)) if i == 0 else None} for i in range(4)]
    for r in rows[1:]:
        del r["input_tok_ids"]
    path = write(tmp_path / "log.jsonl", [json.dumps(r) for r in rows])
    trace = Trace(format="jsonl", path=path, time_unit="ns",
                  fields={"arrival": "arrival_time_ns", "prompt": "input_tok_ids", "prompt_len": "input_toks",
                          "output_len": "output_toks"})
    requests = load_trace(trace, 0).requests
    assert [r.arrival for r in requests] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert [r.prompt_len for r in requests] == [10, 11, 12, 13] and requests[0].segments[0] == list(range(10))


def test_nanoseconds_read_as_seconds_name_the_unit(tmp_path):
    path = write(tmp_path / "log.jsonl", [json.dumps({"timestamp": 1_700_000_000_000_000_000 + i * 10**9,
                                                      "prompt_len": 5, "output_len": 2}) for i in range(3)])
    with pytest.raises(TraceError, match=r"span .* years read as s; if they count .*ns.*time_unit"):
        load(path, "jsonl")
    fast = write(tmp_path / "fast.jsonl", [json.dumps({"timestamp": i, "prompt_len": 5, "output_len": 2})
                                           for i in range(100)])
    with pytest.raises(TraceError, match=r"read as ns .* if they count .*ms"):
        load_trace(Trace(format="jsonl", path=fast, time_unit="ns"), 0)


def test_negative_times_and_clock_jumps_are_errors(tmp_path):
    path = write(tmp_path / "neg.jsonl", [json.dumps({"timestamp": t, "prompt_len": 5, "output_len": 2})
                                          for t in (1.0, -2.0)])
    with pytest.raises(TraceError, match=r"neg.jsonl:2: arrival time -2 s is negative"):
        load(path, "jsonl")
    times = list(range(100)) + [5]                  # a sorted log whose clock restarts
    path = write(tmp_path / "jump.jsonl", [json.dumps({"timestamp": t, "prompt_len": 5, "output_len": 2})
                                           for t in times])
    with pytest.raises(TraceError, match=r"jump.jsonl:101: the arrival time goes back by 94 s"):
        load(path, "jsonl")


def test_generic_csv_with_fields_gzipped(tmp_path):
    import gzip

    path = tmp_path / "log.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("t_ms,in,out,who\n2000,10,4,a\n1000,20,5,b\n1500,0,5,b\n")
    trace = Trace(format="csv", path=path, time_unit="ms",
                  fields={"arrival": "t_ms", "prompt_len": "in", "output_len": "out", "tenant": "who"})
    loaded = load_trace(trace, 0)
    assert [(r.arrival, r.prompt_len, r.output_len, r.tenant) for r in loaded.requests] == \
        [(0.0, 20, 5, "b"), (1.0, 10, 4, "a")]
    assert "excluded 1 rows with 0 prompt tokens" in loaded.notes
    with pytest.raises(TraceError, match=r"log.csv.gz:1: missing column 'in2'"):
        load_trace(Trace(format="csv", path=path, fields={"arrival": "t_ms", "prompt_len": "in2"}), 0)


def test_gzipped_jsonl_and_schema_checks(tmp_path):
    import gzip

    path = tmp_path / "log.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"arrival_s": 0.5, "prompt_len": 3, "output_len": 2}) + "\n")
    assert load(path, "jsonl").requests[0].prompt_len == 3
    with pytest.raises(ValueError, match="unknown field"):
        Trace(format="jsonl", path=path, fields={"arival": "t"})
    with pytest.raises(ValueError, match="jsonl and csv"):
        Trace(format="azure", path=path, fields={"arrival": "t"})
