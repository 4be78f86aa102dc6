"""A generated corpus of hostile inputs, run in process: scenario files (every field
set to hostile values, plus whole-file attacks), CLI misuses, malformed traces and bad HTTP bodies.

Every case must end either in success with sane output, or in a clean error: an error class the
CLI prints as one line (exit 2), no traceback, bounded in length, naming the field or the file.
Each case runs under a wall-clock alarm (a hang detector, far above its normal time) and the
corpus as a whole under a memory bound. The generation is seeded, so the corpus is the same on
every run.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import resource
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from sim.cli import main
from sim.core.files import FileFormatError
from sim.core.memory import InsufficientMemoryError
from sim.errors import UserError
from sim.output.io import write_json
from sim.scenario import ScenarioError, expand_variants, load_scenario
from support import alarm, with_changes

# numpy's "invalid value" warnings mean NaN got through: a case that raises one fails
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

CLEAN = (ScenarioError, UserError, InsufficientMemoryError, ValueError, OSError)   # what main() prints
CASE_ALARM_S = 30
MAX_MESSAGE = 3000

BASE: dict[str, Any] = {
    "name": "fuzz", "seed": 3,
    "model": {"base": "qwen2.5-0.5b", "max_position_embeddings": 4096},
    "device": {"base": "h100-sxm", "reserved_mib": 10},
    "parallelism": {"tp": 1, "dp": 1},
    "engine": {"num_blocks": 512, "block_size": 16, "max_model_len": 256, "max_num_seqs": 8,
               "max_num_batched_tokens": 256, "gpu_memory_utilization": 0.9, "scheduling_policy": "priority",
               "kv_cache_dtype": "auto"},
    "workload": {
        "num_requests": 6, "warmup_requests": 1,
        "arrival": {"process": "gamma", "rate": 20.0, "cv": 2.0},
        "prompt_len": {"dist": "uniform", "min": 8, "max": 40},
        "output_len": {"dist": "lognormal", "mean": 6.0, "std": 2.0, "max": 16},
        "shared_prefix": {"groups": 2, "length": 16, "fraction": 0.5},
        "multi_turn": {"turns": 2, "user_len": 8, "think_time_s": 0.05},
        "tenants": [{"name": "a", "share": 1.0}, {"name": "b", "share": 2.0, "salt": False}],
        "priorities": {"values": [0, 1], "weights": [1.0, 3.0]},
    },
    "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
    "cluster": {"replicas": 2, "router": "least_outstanding_tokens"},
    "variants": {"small": {"engine": {"block_size": 8}}},
}

# YAML snippets: non-finite, negative, zero, huge, wrong types, deep, long, markup, aliases
HOSTILE_YAML = [".inf", "-.inf", ".nan", "-1", "0", "1e30", "99999999999999999999999", "''", "[]", "{}",
                "null", "true", "'" + "x" * 5000 + "'", "[[[[[[[[[[[[1]]]]]]]]]]]]", "':x: [red]boom[/red]'",
                "{a: {b: {c: [1, 2]}}}", "0.5", "-0.0", "2.5e-320", "1e-300", "'../../etc/passwd'"]


def leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in leaf_paths(v, f"{prefix}{k}.")] + ([prefix[:-1]] if prefix else [])
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in leaf_paths(v, f"{prefix}{i}.")]
    return [prefix[:-1]]


def with_placeholder(path: str) -> str:
    """BASE as YAML with the value at `path` replaced by the text @@HOSTILE@@."""
    raw = json.loads(json.dumps(BASE))
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = "@@HOSTILE@@"
    else:
        node[last] = "@@HOSTILE@@"
    text = yaml.safe_dump(raw, default_flow_style=True, sort_keys=False, width=10**6)
    assert "'@@HOSTILE@@'" in text
    return text


def scenario_cases() -> list[tuple[str, str]]:
    """(id, YAML text): each field with a seeded sample of hostile values, then whole-file attacks."""
    rng = random.Random(15)
    cases = []
    for path in sorted(set(leaf_paths(BASE))):
        text = with_placeholder(path)
        for value in rng.sample(HOSTILE_YAML, 5):
            cases.append((f"{path}={value[:20]}", text.replace("'@@HOSTILE@@'", value)))
    good = yaml.safe_dump(BASE, sort_keys=False)
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    cases += [
        ("empty", ""), ("only a comment", "# nothing\n"), ("a list", "- 1\n- 2\n"), ("a scalar", "42\n"),
        ("duplicate section", good + "engine: {block_size: 8}\n"),
        ("duplicate nested key", good.replace("block_size: 16", "block_size: 16\n    block_size: 8")),
        ("alias bomb at top", bomb + good),
        ("alias bomb in rope_scaling", good.replace("max_position_embeddings: 4096",
                                                    "max_position_embeddings: 4096\n    rope_scaling: {x: *i}")
         .replace("name: fuzz", bomb + "name: fuzz")),
        ("deep nesting", "model: " + "[" * 3000 + "]" * 3000 + "\n"),
        ("tab indentation", good.replace("  ", "\t")),
        ("unknown tag", good + "x: !!python/object:os.system [ls]\n"),
        ("binary", "\x00\x01\x02" * 100),
        ("unterminated quote", good + "name: 'abc\n"),
        ("variant escapes", good.replace("small:", "'../../../escape':")),
        ("variant absolute", good.replace("small:", "'/tmp/abs':")),
        ("variant empty", good.replace("small:", "'':")),
        ("variant dots", good.replace("small:", "'..':")),
        ("variant not a mapping", good.replace("small: {engine: {block_size: 8}}", "small: 3")
         if "small: {" in good else good.replace("small:\n    engine:\n      block_size: 8", "small: 3")),
        ("every request rejected", good.replace("max_model_len: 256", "max_model_len: 16")),
        ("huge file", "name: '" + "x" * 300_000 + "'\n" + good),
    ]
    return cases + [(case_id, text) for case_id, text in must_fail_scenarios(good).items()]


def must_fail_scenarios(good: str) -> dict[str, str]:
    """Whole-file cases that once ran (or hung): each must now be a clean error."""
    return {
        "recursive alias at top": good + "foo: &a [*a]\n",
        "recursive alias in a section": good.replace("engine:\n", "engine: &e\n  self: *e\n", 1),
        "recursive alias in a mapping": good + "x: &m {y: [1, {z: *m}]}\n",
        "recursive alias in rope_scaling": good.replace("max_position_embeddings: 4096",
                                                         "max_position_embeddings: 4096\n    rope_scaling: &r {x: *r}"),
        "5,000-digit seed": good.replace("seed: 3", "seed: " + "9" * 5000),
        "boolean block_size": good.replace("block_size: 16", "block_size: true"),
        "boolean num_requests": good.replace("num_requests: 6", "num_requests: true"),
        "escape sequence in the name": good.replace("name: fuzz", 'name: "\\x1b[31mred\\x07"'),
        "weights beyond the device with num_blocks": good.replace("base: qwen2.5-0.5b", "base: llama-3.1-70b")
                                                         .replace("base: h100-sxm", "base: l4"),
        "20,000 unknown keys": good + "".join(f"unknown_{i}: 1\n" for i in range(20_000)),
    }


MUST_FAIL_SCENARIOS = frozenset(must_fail_scenarios(""))




def assert_clean(error: BaseException, must_name: list[str]) -> None:
    message = str(error)
    assert isinstance(error, CLEAN), f"{type(error).__name__} escapes the CLI as a traceback: {message[:500]}"
    assert "Traceback" not in message and 0 < len(message) < MAX_MESSAGE, message[:500]
    assert any(n in message for n in must_name), f"names none of {must_name}: {message[:500]}"


def sane_summary(summary: dict, tmp_path: Path) -> None:
    text = write_json(tmp_path / "summary.json", summary).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert summary["requests_total"] >= 1
    counted = (summary["requests_finished"] + summary["requests_rejected"] + summary["requests_aborted"]
               + summary["warmup_requests"])
    assert counted == summary["requests_total"]


def predict_file(path: Path) -> list[dict]:
    """What `simrun FILE` computes, without drawing figures: every variant's summary."""
    from sim.predict import predict

    scenario = load_scenario(path)
    return [predict(v, name).summary for name, v in expand_variants(scenario, path.parent.resolve()).items()]


@pytest.fixture(scope="module", autouse=True)
def no_git_calls():
    """The manifest's git lookup is two subprocesses per prediction: skip it for the corpus."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVTWIN_GIT_COMMIT", "fuzz")
    yield
    mp.undo()


def run_corpus(cases, run_one: Callable[[str, Any], None]) -> None:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    failures = []
    for case_id, payload in cases:
        try:
            with alarm(CASE_ALARM_S):
                run_one(case_id, payload)
        except AssertionError as e:
            failures.append(f"{case_id}: {str(e)[:400]}")
        except TimeoutError as e:
            failures.append(f"{case_id}: {e}")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:30])
    assert grown_mib < 1024, f"the corpus raised peak memory by {grown_mib:.0f} MiB"


# ----------------------------------------------------------------------------- scenario files

def test_hostile_scenario_files(tmp_path):
    cases = scenario_cases()
    assert len(cases) > 250
    outcomes = {"ok": 0, "error": 0}

    def one(case_id: str, text: str) -> None:
        path = tmp_path / "case.yaml"
        path.write_text(text)
        try:
            summaries = predict_file(path)
        except Exception as e:                       # noqa: BLE001 - judged by assert_clean
            field, _, value = case_id.partition("=")
            keys = [k for k in field.split(".") if not k.isdigit()]
            # a field case must name its field (or the section it sits in); a whole-file case, the file
            names = keys[-2:] if value else [str(path), "variant"]
            assert_clean(e, names)
            outcomes["error"] += 1
            return
        assert case_id not in MUST_FAIL_SCENARIOS, "accepted, but must be refused"
        for summary in summaries:
            sane_summary(summary, tmp_path)
        outcomes["ok"] += 1

    run_corpus(cases, one)
    assert outcomes["ok"] > 10 and outcomes["error"] > 100, outcomes   # the corpus exercises both ends


# ----------------------------------------------------------------------------- CLI misuses

def cli_cases(tmp_path: Path) -> list[tuple[str, list[str]]]:
    good = tmp_path / "good.yaml"
    good.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {num_blocks: 256, max_model_len: 256}\n"
                    "workload: {num_requests: 3, prompt_len: 8, output_len: 2}\n")
    afile = tmp_path / "afile"
    afile.write_text("x")
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    fifo_trace = tmp_path / "fifo_trace.yaml"
    fifo_trace.write_text(f"model: qwen2.5-0.5b\ndevice: h100-sxm\nworkload: {{trace: {{format: csv, path: {fifo}}}}}\n")
    rate = tmp_path / "rate.yaml"
    rate.write_text(good.read_text().replace("num_requests: 3", "num_requests: 3, arrival: {process: poisson, rate: 5}")
                    + "slo: {ttft_s: 1}\n")
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"duration": 1.0, "completed": 1, "request_rate": "inf"}))
    g, o = str(good), str(tmp_path / "out")
    return [
        ("no args", []), ("missing file", ["missing.yaml"]), ("a folder", [str(tmp_path)]),
        ("/dev/null", ["/dev/null"]), ("--set without =", [g, "--set", "engine.block_size"]),
        ("--set empty path part", [g, "--set", "engine..block_size=8"]),
        ("--set unknown field", [g, "--set", "engine.blok_size=8"]),
        ("--set a non-mapping parent", [g, "--set", "seed.x=1"]),
        ("--set bad type", [g, "--set", "engine.block_size=abc"]),
        ("--set inf", [g, "--set", "workload.arrival={process: poisson, rate: .inf}"]),
        ("--set alias bomb", [g, "--set", "name=[&a [1,1,1,1,1,1,1,1,1,1], [*a,*a,*a]]"]),
        ("--set duplicate keys", [g, "--set", "engine={block_size: 8, block_size: 16}"]),
        ("--set unknown model", [g, "--set", "model=gpt-17"]),
        ("--seed text", [g, "--seed", "x"]), ("--seed negative", [g, "--seed", "-1"]),
        ("--seed huge", [g, "--seed", str(2**70)]), ("--out empty", [g, "--out", ""]),
        ("--out a file", [g, "--out", str(afile)]), ("--out under a file", [g, "--out", str(afile / "x")]),
        ("unknown flag", [g, "--frobnicate"]), ("sweep with a bad value", [g, "--set", "engine.block_size=8,abc"]),
        ("sweep of nothing", [g, "--set", "engine.block_size=,"]),
        ("serve bad port", ["serve", "--model", "tiny", "--port", "99999"]),
        ("serve no model", ["serve"]),
        ("plan without slo", ["plan", g]),
        ("markup in a path", [str(tmp_path / "[red]:x:.yaml")]),
        ("runs fine", [g, "--out", o, "--quiet", "--set", "workload.num_requests=2"]),
        # round 2: each once hung, crashed or answered nonsense; each must exit 2
        ("--set recursive alias", [g, "--set", "engine.block_size=&a [*a]"]),
        ("--set 5,000 digits", [g, "--set", "seed=" + "9" * 5000]),
        ("--set boolean", [g, "--set", "engine.block_size=true"]),
        ("a FIFO trace", [str(fifo_trace), "--out", o]),
        ("plan --max-replicas 0", ["plan", str(rate), "--target-rate", "5", "--max-replicas", "0", "--out", o]),
        ("plan --curve -1", ["plan", str(rate), "--curve", "-1", "--out", o]),
        ("plan --tolerance nan", ["plan", str(rate), "--tolerance", "nan", "--out", o]),
        ("compare --series-offset nan", ["compare", g, "--vllm-result", str(result), "--series-offset", "nan"]),
        ("from-vllm rm -rf", ["from-vllm", "--device", "h100-sxm", "rm -rf /x"]),
        ("from-vllm 1e400", ["from-vllm", "--device", "h100-sxm", "vllm serve tiny --max-model-len 1e400"]),
    ]


MUST_EXIT_2 = ("--set recursive alias", "--set 5,000 digits", "--set boolean", "a FIFO trace", "plan --max-replicas 0",
               "plan --curve -1", "plan --tolerance nan", "compare --series-offset nan", "from-vllm rm -rf",
               "from-vllm 1e400")


def test_cli_misuses(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outcomes = {}

    def one(case_id: str, argv: list[str]) -> None:
        try:
            code = main(argv)
        except SystemExit as e:                      # argparse: usage + message, exit 2
            code = e.code
        captured = capsys.readouterr()
        text = captured.err + captured.out
        assert code in (0, 1, 2), f"exit {code}"
        assert "Traceback" not in text, text[-800:]
        if code == 2:
            first = captured.err.strip().splitlines()[-1] if captured.err.strip() else ""
            assert first.startswith(("error:", "simrun")) or "error:" in captured.err, captured.err[-500:]
            assert len(captured.err) < MAX_MESSAGE * 2
            assert "\u274c" not in captured.err          # ':x:' printed literally
        outcomes[case_id] = code

    run_corpus(cli_cases(tmp_path), one)
    assert outcomes["runs fine"] == 0 and outcomes["missing file"] == 2
    assert {case: outcomes[case] for case in MUST_EXIT_2} == dict.fromkeys(MUST_EXIT_2, 2)


# ----------------------------------------------------------------------------- traces

GOOD_TRACES = {
    "azure": ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
              "2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:51.1200000,879,31\n"),
    "burstgpt": ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,472,18,490,Conversation log\n45,ChatGPT,1087,0,1087,Conversation log\n"
                 "118,GPT-4,417,276,693,Conversation log\n"),
    "mooncake": ('{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 27, "input_length": 600, "output_length": 4, "hash_ids": [1, 3]}\n'),
    "jsonl": ('{"arrival_s": 0.0, "prompt_len": 12, "output_len": 3, "tenant": "a", "priority": 1}\n'
              '{"arrival_s": 0.5, "prompt": [1, 2, 3], "output_len": 2}\n'),
    "csv": "arrival_s,prompt_len,output_len,tenant,priority\n0.0,12,3,a,1\n0.5,20,4,b,0\n1.5,7,2,,2\n",
}
CSV_FORMATS = ("azure", "burstgpt", "csv")
CELL_VALUES = ["", "x", "-1", "1e400", "9" * 30, "NaN", "1.5", '"', "[]", "{}", "true", "null", "-0",
               "9" * 5000, "\u202e", "2023-13-45 99:99:99"]
JSON_VALUES = ["-1", "1e400", "9" * 30, "NaN", "Infinity", "1.5", '"x"', "[]", "{}", "true", "null",
               "9" * 5000, "[" * 5000 + "]" * 5000, '"' + "y" * 200_000 + '"', "[1e400]", "[-1]", "[1.5]"]


def trace_cases() -> list[tuple[str, tuple[str, bytes]]]:
    rng = random.Random(15)
    cases: list[tuple[str, tuple[str, bytes]]] = []
    for fmt, text in GOOD_TRACES.items():
        lines = text.splitlines()
        if fmt in CSV_FORMATS:
            header = lines[0].split(",")
            for col in range(len(header)):
                for value in rng.sample(CELL_VALUES, 6):
                    row = lines[1].split(",")
                    row[col] = value
                    cases.append((f"{fmt}:{header[col]}={value[:12]}",
                                  (fmt, "\n".join([lines[0], ",".join(row), *lines[2:]]).encode())))
            cases.append((f"{fmt}: no header", (fmt, "\n".join(lines[1:]).encode())))
            cases.append((f"{fmt}: short row", (fmt, (text + "1,2\n").encode())))
            cases.append((f"{fmt}: 200 KiB field", (fmt, (text + '"' + "z" * 200_000 + '",1,1\n').encode())))
        else:
            keys = list(json.loads(lines[0]))
            for key in keys:
                for value in rng.sample(JSON_VALUES, 6):
                    obj = lines[0].replace(f'"{key}": ', f'"{key}": @@', 1)
                    start = obj.index("@@")
                    end = start + 2
                    depth = 0
                    while end < len(obj) and (depth or obj[end] not in ",}"):
                        depth += obj[end] == "["
                        depth -= obj[end] == "]"
                        end += 1
                    cases.append((f"{fmt}:{key}={value[:12]}", (fmt, (obj[:start] + value + obj[end:] + "\n"
                                                                      + "\n".join(lines[1:])).encode())))
            cases += [(f"{fmt}: not json", (fmt, b"{not json}\n")), (f"{fmt}: a list", (fmt, b"[1, 2]\n")),
                      (f"{fmt}: truncated", (fmt, text.encode()[:-20]))]
        raw = text.encode()
        cases += [(f"{fmt}: empty", (fmt, b"")), (f"{fmt}: gzip", (fmt, gzip.compress(raw))),
                  (f"{fmt}: utf-16", (fmt, text.encode("utf-16"))), (f"{fmt}: bom", (fmt, b"\xef\xbb\xbf" + raw)),
                  (f"{fmt}: crlf", (fmt, raw.replace(b"\n", b"\r\n"))), (f"{fmt}: binary", (fmt, bytes(range(256)))),
                  (f"{fmt}: latin-1 byte", (fmt, raw + b"\xe9\n")), (f"{fmt}: nul", (fmt, raw[:30] + b"\x00" + raw[30:]))]
    # past the 1,000,000-request bound: a 28 KB gzip of 1.3M rows once replayed every one of them
    many = b"arrival_s,prompt_len,output_len\n" + b"0.000,16,4\n" * 1_300_000
    cases.append((TRACE_PAST_THE_BOUND, ("csv", gzip.compress(many))))
    return cases


TRACE_PAST_THE_BOUND = "csv: 1.3M rows in a gzip"


def test_malformed_traces(tmp_path):
    from sim.scenario import Trace
    from sim.traces import TraceError, load_trace

    cases = trace_cases()
    assert len(cases) > 150
    outcomes = {"ok": 0, "error": 0}

    def one(case_id: str, payload: tuple[str, bytes]) -> None:
        fmt, data = payload
        path = tmp_path / f"trace.{'csv' if fmt in CSV_FORMATS else 'jsonl'}"
        path.write_bytes(data)
        try:
            loaded = load_trace(Trace(format=fmt, path=path), seed=0)
        except Exception as e:                       # noqa: BLE001 - judged below
            assert isinstance(e, (TraceError, FileFormatError)), f"{type(e).__name__}: {str(e)[:300]}"
            assert_clean(e, [str(path)])
            outcomes["error"] += 1
            return
        assert case_id != TRACE_PAST_THE_BOUND, f"{len(loaded.requests):,} rows replayed, past the request bound"
        assert loaded.requests
        for r in loaded.requests:
            assert r.prompt_len >= 1 and r.output_len >= 1 and r.arrival >= 0
        outcomes["ok"] += 1

    run_corpus(cases, one)
    assert outcomes["ok"] > 5 and outcomes["error"] > 50, outcomes


# ----------------------------------------------------------------------------- HTTP bodies

def body_cases() -> list[tuple[str, bytes]]:
    pytest.importorskip("fastapi")
    from engine.serve.protocol import NEUTRAL_VALUES, SUPPORTED_FIELDS

    good = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": False, "ignore_eos": True,
            "temperature": 0.0, "n": 1}
    cases = []
    for key in [*SUPPORTED_FIELDS, *NEUTRAL_VALUES, "prompt.0", "unknown_field"]:
        for value in JSON_VALUES + ['"tiny"', "0", "1", "[1, 2]", '{"include_usage": true}']:
            body = json.dumps({**good, key.split(".")[0]: "@@"})
            if key == "prompt.0":
                body = json.dumps({**good, "prompt": ["@@", 2]})
            cases.append((f"{key}={value[:12]}", body.replace('"@@"', value).encode()))
    cases += [(f"stream_options {options}", json.dumps({**good, "stream": True, "stream_options": options}).encode())
              for options in BAD_STREAM_OPTIONS]
    cases += [("empty", b""), ("not json", b"{"), ("a list", b"[1]"), ("nul", b"\x00"), ("utf-16", json.dumps(good).encode("utf-16")),
              ("bad utf-8", b'{"prompt": [1], "user": "\xff"}'), ("deep", b"[" * 100_000 + b"]" * 100_000),
              ("long prompt", json.dumps({**good, "prompt": [1] * 100_000}).encode())]
    return cases


BAD_STREAM_OPTIONS = ({"include_usage": "x"}, {"include_usage": 1}, {"include_usage": [True]},
                      {"continuous_usage_stats": "no"})


def test_bad_http_bodies():
    pytest.importorskip("fastapi")
    from engine.serve.protocol import ApiError, ServedModel, parse_body

    served = ServedModel("tiny", "tiny", 1024, 512, 0.0, None)
    cases = body_cases()
    assert len(cases) > 500
    outcomes = {"ok": 0, "error": 0}

    def one(case_id: str, data: bytes) -> None:
        try:
            params = parse_body(data, served)
        except ApiError as e:
            assert 400 <= e.status < 500 and 0 < len(str(e)) < MAX_MESSAGE, (e.status, str(e)[:300])
            outcomes["error"] += 1
            return
        except Exception as e:                       # noqa: BLE001
            pytest.fail(f"{type(e).__name__} would be HTTP 500: {str(e)[:300]}")
        assert not case_id.startswith("stream_options {"), "a non-boolean stream option was accepted"
        assert all(type(t) is int and 0 <= t < 1024 for t in params.prompt)
        assert params.max_tokens >= 1 and len(params.prompt) + params.max_tokens <= 512
        outcomes["ok"] += 1

    run_corpus(cases, one)
    assert outcomes["ok"] > 20 and outcomes["error"] > 300, outcomes


# ----------------------------------------------------------------------------- vLLM files, data sets, tokenizers

CANARY = "CANARY-" + "q" * 60        # put in hostile files: no error may quote it whole
GOOD_VLLM_RESULT = json.dumps({"date": "20250101-000000", "backend": "vllm", "model_id": "tiny",
                               "request_rate": "inf", "duration": 2.0, "completed": 2, "failed": 0,
                               "mean_ttft_ms": 10.0, "note": CANARY}) + "\n"
GOOD_QUERY_RANGE = json.dumps({"status": "success", "data": {"result": [
    {"metric": {"__name__": "vllm:num_requests_running"}, "values": [[1700000000, "3"], [1700000002, "4"]]}]}})
GOOD_LOG = ("INFO 08-20 12:34:56 metrics.py:406] Avg prompt throughput: 123.4 tokens/s, Avg generation throughput: "
            "45.6 tokens/s, Running: 5 reqs, Swapped: 0 reqs, Pending: 2 reqs, GPU KV cache usage: 12.3%, CPU KV "
            "cache usage: 0.0%.\n")
GOOD_TIMELINE = "t_s,running,waiting,kv_usage\n0.0,1,0,0.1\n0.5,2,1,0.2\n"
GOOD_CONFIG = "max-model-len: 2048\nenable-prefix-caching: true\n"
GOOD_DETAILED = {"date": "20250101-000000", "backend": "vllm", "model_id": "tiny", "request_rate": 4.0,
                 "duration": 2.0, "completed": 3, "failed": 0, "note": CANARY, "input_lens": [30, 40, 50],
                 "output_lens": [4, 5, 6], "ttfts": [0.05, 0.06, 0.07], "itls": [[0.02] * 3, [0.02] * 4, [0.02] * 5],
                 "latencies": [0.11, 0.14, 0.17], "start_times": [10.0, 10.25, 10.5], "errors": ["", "", ""]}
HF_CONFIG = (Path(__file__).parents[1] / "data" / "hf_configs" / "meta-llama__Meta-Llama-3.1-8B.json").read_text()


def bad_detailed_results() -> dict[str, dict]:
    """Nonsense a measured file can hold, each of which was once accepted."""
    def with_(**changes):
        return with_changes(GOOD_DETAILED, **changes)

    return {"negative ttft": with_(ttfts__0=-0.1), "latencies -1": with_(latencies=[-1, -1, -1]),
            "negative itl": with_(itls__1=[0.02, -0.02]), "latency under ttft": with_(latencies__2=0.01),
            "output_lens 0": with_(output_lens=[0, 0, 0], itls=[[], [], []]), "completed -1": with_(completed=-1),
            "duration -10": with_(duration=-10), "completed disagrees": with_(completed=1),
            "input_lens 10^12": with_(input_lens__0=10**12), "max_concurrency abc": with_(max_concurrency="abc"),
            "more itls than tokens": with_(itls__0=[0.01] * 40), "itl NaN": with_(itls__0=[float("nan")]),
            "ttft Infinity": with_(ttfts__1=float("inf")), "burstiness -1": with_(burstiness=-1)}


def bad_hf_configs() -> dict[str, str]:
    base = json.loads(HF_CONFIG)

    def with_(**changes):
        return json.dumps({**base, **changes})

    return {"hidden not divisible": with_(hidden_size=4095), "intermediate '512'": with_(intermediate_size="512"),
            "tie 'yes'": with_(tie_word_embeddings="yes"), "layers 32.0": with_(num_hidden_layers=32.0),
            "negative rope factor": with_(rope_scaling={"rope_type": "linear", "factor": -2}),
            "5,000-key rope_scaling": with_(rope_scaling={f"k{i}": 1 for i in range(5000)}),
            "experts 0 with 2 per token": with_(num_experts=0, num_experts_per_tok=2),
            "kv heads 0": with_(num_key_value_heads=0), "rope_theta NaN": with_(rope_theta=float("nan")),
            "duplicate key": HF_CONFIG.rstrip().rstrip("}") + ', "hidden_size": 512}'}
GOOD_SHAREGPT = json.dumps([{"conversations": [{"from": "human", "value": "hello there " + CANARY},
                                               {"from": "gpt", "value": "general kenobi"}]}])
BOMB_YAML = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def whole_file_attacks(good: str, json_kind: bool) -> list[tuple[str, bytes, bool]]:
    """(name, bytes, must fail) for one reader: encodings, compression, binary, and for JSON readers
    depth and integers beyond 64 bits. A BOM or CRLF file must still read."""
    raw = good.encode()
    cases = [("gzip", gzip.compress(raw), True), ("utf-16", good.encode("utf-16"), True),
             ("binary", bytes(range(256)) + CANARY.encode(), True), ("latin-1 byte", raw + b"\xe9" + CANARY.encode(), True),
             ("nul", raw[:10] + b"\x00" + raw[10:], True), ("empty", b"", True),
             ("bom", b"\xef\xbb\xbf" + raw, False), ("crlf", raw.replace(b"\n", b"\r\n"), False)]
    if json_kind:
        cases += [("deep", b"[" * 5000 + b"]" * 5000, True), ("truncated", raw[: len(raw) // 2], True)]
    return cases


def vllm_file_cases() -> list[tuple[str, tuple[str, str, bytes, bool]]]:
    """(case id, (reader, file name, bytes, must fail))."""
    huge_duration = GOOD_VLLM_RESULT.replace('"duration": 2.0', '"duration": ' + "9" * 400)
    readers = [("results", "r.json", GOOD_VLLM_RESULT, True),
               ("series", "q.json", GOOD_QUERY_RANGE, True), ("series", "server.log", GOOD_LOG, False),
               ("series", "metrics_timeline.csv", GOOD_TIMELINE, False), ("config", "c.yaml", GOOD_CONFIG, False),
               ("sharegpt", "sg.json", GOOD_SHAREGPT, True), ("text", "p.txt", "one prompt\nanother " + CANARY + "\n", False),
               ("tokenizer", "tokenizer.json", (Path(__file__).parents[1] / "data" / "datasets" / "tokenizer.json")
                .read_text(encoding="utf-8"), False)]
    cases = []
    for reader, name, good, json_kind in readers:
        for attack, data, must_fail in whole_file_attacks(good, json_kind):
            if reader in ("text", "tokenizer") and attack in ("bom", "crlf"):
                continue           # these succeed only with a real tokenization: covered by test_datasets
            if reader == "series" and name.endswith(".log") and attack == "empty":
                must_fail = True
            cases.append((f"{reader}/{name}: {attack}", (reader, name, data, must_fail)))
    cases += [("results/r.json: integer duration beyond 64 bits", ("results", "r.json", huge_duration.encode(), True)),
              ("results/r.jsonl: deep second line", ("results", "r.jsonl", (GOOD_VLLM_RESULT + "[" * 5000 + "]" * 5000
                                                                           + "\n").encode(), True)),
              ("config/c.yaml: alias bomb", ("config", "c.yaml", BOMB_YAML.encode(), True)),
              ("config/c.yaml: duplicate key", ("config", "c.yaml", (GOOD_CONFIG + "max-model-len: 4096\n").encode(), True)),
              ("config/c.yaml: deep", ("config", "c.yaml", b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", True)),
              ("sharegpt/sg.json: huge int", ("sharegpt", "sg.json", GOOD_SHAREGPT.replace('{"conversations"', '{"id": '
                                                                      + "9" * 400 + ', "conversations"').encode(), True)),
              ("sharegpt/sg.json: NaN", ("sharegpt", "sg.json", b'[{"conversations": NaN}]', True)),
              ("series/q.json: huge int", ("series", "q.json", GOOD_QUERY_RANGE.replace("1700000000", "9" * 400).encode(), True))]
    cases.append(("results/r.json: consistent per-request arrays", ("results", "r.json", json.dumps(GOOD_DETAILED).encode(), False)))
    cases += [(f"results/r.json: {name}", ("results", "r.json", json.dumps(data).encode(), True))
              for name, data in bad_detailed_results().items()]
    cases.append(("results/r.json: duplicate key", ("results", "r.json", json.dumps(GOOD_DETAILED)[:-1].encode()
                                                   + b', "completed": 5}', True)))
    cases.append(("hf/config.json: a real one", ("hf_config", "config.json", HF_CONFIG.encode(), False)))
    cases += [(f"hf/config.json: {name}", ("hf_config", "config.json", text.encode(), True))
              for name, text in bad_hf_configs().items()]
    cases += [(f"hf/config.json: {attack}", ("hf_config", "config.json", data, must_fail))
              for attack, data, must_fail in whole_file_attacks(HF_CONFIG, json_kind=True)
              if attack not in ("bom", "crlf")]
    return cases


def read_vllm_file(reader: str, path: Path) -> Any:
    from sim.datasets import load_prompts, text_tokenizer
    from sim.scenario import Dataset
    from sim.vllm.results import load_results
    from sim.vllm.serve_flags import config_file_flags
    from sim.vllm.timeseries import load_series

    tokenizer = Path(__file__).parents[1] / "data" / "datasets" / "tokenizer.json"
    if reader == "results":
        return load_results(path)
    if reader == "series":
        return load_series(path, year=2025)
    if reader == "config":
        return config_file_flags(path)
    if reader == "tokenizer":
        return text_tokenizer(path).encode("hello")
    if reader == "hf_config":
        from sim.scenario import validate_scenario

        return validate_scenario({"model": {"hf_config": str(path)}, "device": "h100-sxm"})
    return load_prompts(Dataset(format=reader, path=path, tokenizer=tokenizer))


def test_malformed_vllm_files_data_sets_and_tokenizers(tmp_path):
    pytest.importorskip("tokenizers")
    cases = vllm_file_cases()
    assert len(cases) > 60
    outcomes = {"ok": 0, "error": 0}
    numbers = iter(range(len(cases)))

    def one(case_id: str, payload: tuple[str, str, bytes, bool]) -> None:
        reader, name, data, must_fail = payload
        folder = tmp_path / f"case{next(numbers)}"      # a fresh folder: no token cache of another case
        folder.mkdir()
        path = folder / name
        path.write_bytes(data)
        try:
            read_vllm_file(reader, path)
        except Exception as e:                       # noqa: BLE001 - judged below
            assert_clean(e, [str(path)])
            assert CANARY not in str(e), f"the error quotes the file: {str(e)[:300]}"
            outcomes["error"] += 1
            return
        assert not must_fail, "a malformed file was accepted"
        outcomes["ok"] += 1

    run_corpus(cases, one)
    assert outcomes["ok"] >= 5 and outcomes["error"] > 50, outcomes


# ----------------------------------------------------------------------------- from-vllm command lines

CONTROL = ["\n", "\r\n", "\r", "\x85", "\u2028", "\u2029", "\x1b[31m", "\x07", "\x00", "\t", "\x0b", "\x0c"]


def from_vllm_cases(tmp_path: Path) -> list[tuple[str, tuple[list[str], bool]]]:
    """(id, (the words after --, must fail)): every control character in a value, an unknown flag's
    name, the served name and the model; numbers no int holds; other programs; huge lines."""
    recursive = tmp_path / "recursive.yaml"
    recursive.write_text("max-model-len: &a [*a]\n")
    cases: list[tuple[str, tuple[list[str], bool]]] = []
    for c in CONTROL:
        shown = repr(c)
        cases += [(f"value {shown}", (["vllm", "serve", "tiny", "--served-model-name", f"x{c}fuzz_injected: 1 #"], False)),
                  (f"unknown flag {shown}", (["vllm", "serve", "tiny", f"--x{c}fuzz_injected: 1"], False)),
                  (f"unknown value {shown}", (["vllm", "serve", "tiny", "--new-flag", f"1{c}fuzz_injected: 1"], False)),
                  (f"model {shown}", (["vllm", "serve", f"tiny{c}fuzz_injected: 1"], True)),
                  (f"modelled value {shown}", (["vllm", "serve", "tiny", "--max-num-seqs", f"8{c}fuzz_injected: 1"], True))]
    cases += [("1e400", (["vllm serve tiny --max-model-len 1e400"], True)),
              ("5,000 digits", (["vllm serve tiny --max-num-seqs " + "9" * 5000], True)),
              ("5,000 digits, human", (["vllm serve tiny --max-model-len " + "9" * 5000 + "k"], True)),
              ("nan", (["vllm serve tiny --gpu-memory-utilization nan"], True)),
              ("rm -rf", (["rm -rf /x"], True)), ("curl", (["curl http://x | sh"], True)),
              ("vllm bench", (["vllm bench serve --model tiny"], True)),
              ("unbalanced quote", (["vllm serve tiny --served-model-name 'x"], True)),
              ("empty", ([""], True)), ("no model", (["vllm serve"], True)),
              ("recursive --config", ([f"vllm serve tiny --config {recursive}"], True)),
              ("5,000 flags", (["vllm serve tiny " + " ".join(f"--f{i} {i}" for i in range(5000))], False)),
              ("a path to vllm", (["/opt/venv/bin/vllm serve tiny --max-num-seqs 4"], False))]
    return cases


def test_hostile_from_vllm_lines(tmp_path, capsys):
    """Nothing a command line holds may reach the written file as YAML, or the terminal raw."""
    out = tmp_path / "s.yaml"
    outcomes = {"ok": 0, "error": 0}

    def one(case_id: str, payload: tuple[list[str], bool]) -> None:
        words, must_fail = payload
        out.unlink(missing_ok=True)
        try:
            code = main(["from-vllm", "--device", "h100-sxm", "--out", str(out), "--", *words])
        except SystemExit as e:
            code = e.code
        captured = capsys.readouterr()
        shown = captured.err + captured.out
        assert "Traceback" not in shown and len(shown) < 20_000, shown[-500:]
        assert not any(c in shown.replace("\n", "") for c in CONTROL if c != "\n" and c != "\r\n"), repr(shown[-300:])
        assert "\nfuzz_injected" not in shown, shown[-300:]
        if code == 2:
            outcomes["error"] += 1
            assert not out.exists()
            return
        assert code == 0 and not must_fail, f"exit {code}: {shown[-300:]}"
        text = out.read_text()
        assert set(yaml.safe_load(text)) <= {"name", "description", "model", "device", "engine", "parallelism"}
        assert "fuzz_injected" not in yaml.safe_load(text) and len(text) < 20_000
        assert all(c not in text for c in CONTROL if c not in ("\n", "\r\n")), repr(text[:300])
        outcomes["ok"] += 1

    run_corpus(from_vllm_cases(tmp_path), one)
    assert outcomes["ok"] > 20 and outcomes["error"] > 20, outcomes
