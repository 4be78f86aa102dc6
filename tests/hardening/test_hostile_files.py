"""Hostile input files (traces, length files, profiles, Hugging Face configs): errors naming the
file and field, never echoing its content; gzip bombs, row bounds and FIFOs stop while read."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.scenario import ScenarioError, validate_scenario

from support import run_cli, SMALL


def trace_scenario(tmp_path, fmt: str, trace: Path) -> Path:
    path = tmp_path / f"trace_{fmt}.yaml"
    path.write_text(f"model: qwen2.5-0.5b\ndevice: h100-sxm\nworkload:\n  trace: {{format: {fmt}, path: {trace}}}\n")
    return path


def test_a_file_named_as_a_trace_or_length_file_is_not_echoed(tmp_path, capsys):
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash:" + "S3CRET" * 2000 + "\nuser:x:1000\n")
    lengths = tmp_path / "lengths.yaml"
    lengths.write_text(SMALL.replace("prompt_len: 16", f"prompt_len: {{dist: empirical, file: {secret}}}"))
    cases = [trace_scenario(tmp_path, fmt, secret) for fmt in ("azure", "burstgpt", "jsonl", "mooncake")]
    for scenario in cases + [lengths]:
        code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
        assert code == 2 and str(secret) in err and "Traceback" not in err
        assert "/root:/bin/bash" not in err and "S3CRET" not in err, err     # at most a short excerpt


def hostile_files(tmp_path) -> dict[str, Path]:
    files = {}

    def make(name: str, data: bytes) -> None:
        files[name] = tmp_path / name
        files[name].write_bytes(data)

    import gzip

    make("binary.csv", bytes(range(256)) * 4)
    make("utf16.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n".encode("utf-16"))
    make("gzipped.csv", gzip.compress(b"TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    make("latin1.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,\xe9,3\n")
    make("bigfield.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n\"" + b"x" * 140_000 + b"\",1,1\n")
    make("bigint.jsonl", b'{"arrival_s": 0, "prompt_len": 99999999999999999999, "output_len": 3}\n')
    make("hugeint.jsonl", b'{"arrival_s": 0, "prompt_len": ' + b"9" * 5000 + b', "output_len": 3}\n')
    make("deep.jsonl", b'{"arrival_s": 0, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    make("nulbyte.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,1\x00,3\n")
    return files


@pytest.mark.parametrize("name", ["binary.csv", "utf16.csv", "gzipped.csv", "latin1.csv", "bigfield.csv",
                                  "bigint.jsonl", "hugeint.jsonl", "deep.jsonl", "nulbyte.csv"])
def test_bad_trace_files_are_errors_naming_the_file(tmp_path, capsys, name):
    trace = hostile_files(tmp_path)[name]
    fmt = "jsonl" if name.endswith(".jsonl") else "azure"
    code, err = run_cli([trace_scenario(tmp_path, fmt, trace), "--out", tmp_path / "o"], capsys)
    assert code == 2, err
    assert str(trace) in err and "Traceback" not in err and len(err) < 2000


@pytest.mark.parametrize("name", ["binary.csv", "utf16.csv", "gzipped.csv", "bigfield.csv"])
def test_bad_length_files_are_errors_naming_the_file(tmp_path, capsys, name):
    lengths = hostile_files(tmp_path)[name]
    path = tmp_path / "s.yaml"
    path.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\nworkload: {num_requests: 3, output_len: 4, "
                    f"prompt_len: {{dist: empirical, file: {lengths}, column: ContextTokens}}}}\n")
    code, err = run_cli([path, "--out", tmp_path / "o"], capsys)
    assert code == 2 and str(lengths) in err and "Traceback" not in err


def test_bad_scenario_profile_and_hf_config_files_name_the_file(tmp_path, capsys):
    cases = {}
    cases["scenario is a folder"] = (tmp_path, str(tmp_path))
    bin_scenario = tmp_path / "bin.yaml"
    bin_scenario.write_bytes(b"\x00\x01\x02model")
    cases["binary scenario"] = (bin_scenario, "binary")
    u16 = tmp_path / "u16.yaml"
    u16.write_bytes("model: qwen2.5-0.5b\n".encode("utf-16"))
    cases["utf-16 scenario"] = (u16, "UTF-16")
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 5000 + "]" * 5000 + "\ndevice: h100-sxm\n")
    cases["deep yaml"] = (deep, "nested")
    profile = tmp_path / "profile.yaml"
    profile.write_text("coefficients: {a: 1\n  b: [\n")
    with_profile = tmp_path / "with_profile.yaml"
    with_profile.write_text(SMALL.replace("device: h100-sxm", f"device: {{base: h100-sxm, profile: {profile}}}"))
    cases["bad profile yaml"] = (with_profile, str(profile))
    hf = tmp_path / "config.json"
    hf.write_text("[1, 2, 3]")
    hf_scenario = tmp_path / "hf.yaml"
    hf_scenario.write_text(f"model: {{hf_config: {hf}}}\ndevice: h100-sxm\n")
    cases["hf_config a list"] = (hf_scenario, str(hf))
    hf_big = tmp_path / "big" / "config.json"
    hf_big.parent.mkdir()
    hf_big.write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 99999999999999999999999}')
    hf_big_scenario = tmp_path / "hfbig.yaml"
    hf_big_scenario.write_text(f"model: {{hf_config: {hf_big}}}\ndevice: h100-sxm\n")
    cases["hf_config int beyond 2^63"] = (hf_big_scenario, str(hf_big))
    for what, (scenario, needle) in cases.items():
        code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
        assert code == 2 and needle in err and "Traceback" not in err, (what, err)


@pytest.mark.parametrize("fmt, row", [("csv", "0.5,12,3\n"), ("jsonl", '{"arrival_s": 0.5, "prompt_len": 12, "output_len": 3}\n')])
def test_a_gzip_bomb_trace_stops_at_the_decompressed_size_limit(tmp_path, monkeypatch, fmt, row):
    import gzip

    import sim.core.files
    from sim.core.files import FileFormatError
    from sim.scenario import Trace
    from sim.traces import load_trace

    monkeypatch.setattr(sim.core.files, "MAX_STREAM_BYTES", 1 << 20)
    header = "arrival_s,prompt_len,output_len\n" if fmt == "csv" else ""
    path = tmp_path / f"bomb.{fmt}.gz"
    path.write_bytes(gzip.compress((header + row * (8 * 2**20 // len(row))).encode(), 9))
    assert path.stat().st_size < 2**20 // 8          # small on disk, 8x the limit inside
    with pytest.raises(FileFormatError, match=r"bomb\.\w+\.gz: decompresses to more than 1 MiB"):
        load_trace(Trace(format=fmt, path=path), seed=0)
    # a gzip under the limit still reads, and so does a plain file; a plain file over it is refused
    path.write_bytes(gzip.compress((header + row * 100).encode()))
    assert len(load_trace(Trace(format=fmt, path=path), seed=0).requests) == 100
    plain = tmp_path / f"big.{fmt}"
    plain.write_text(header + row * (2 * 2**20 // len(row)))
    with pytest.raises(FileFormatError, match=r"big\.\w+: 2\.0 MiB, larger than the 1 MiB"):
        load_trace(Trace(format=fmt, path=plain), seed=0)


@pytest.mark.parametrize("fmt,header,row", [("csv", "arrival_s,prompt_len,output_len", "0.000,16,4"),
                                            ("jsonl", None, '{"arrival_s": 0, "prompt_len": 16, "output_len": 4}'),
                                            ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens",
                                             "2023-11-16 18:15:46.6805900,16,4")])
def test_a_trace_past_the_request_bound_is_refused_while_read(tmp_path, monkeypatch, fmt, header, row):
    import gzip

    import sim.traces
    from sim.scenario import Trace
    from sim.traces import TraceError, load_trace

    monkeypatch.setattr(sim.traces, "MAX_REQUESTS", 50, raising=False)   # the bound, scaled down
    path = tmp_path / f"t.{fmt}.gz"
    lines = ([header] if header else []) + [row] * 51
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(TraceError, match=r"t\.\w+\.gz:\d+: more than 50 rows, the most a trace may hold"):
        load_trace(Trace(format=fmt, path=path), seed=0)
    path.write_bytes(gzip.compress(("\n".join(lines[:-1]) + "\n").encode()))
    assert len(load_trace(Trace(format=fmt, path=path), seed=0).requests) == 50


def test_a_trace_path_that_is_a_fifo_is_not_a_regular_file(tmp_path, capsys):
    import os

    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)
    code, err = run_cli([trace_scenario(tmp_path, "csv", fifo), "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{fifo}: not a regular file" in err and "workload.trace.path" in err


HF_CORPUS = Path(__file__).parents[1] / "data" / "hf_configs"


LLAMA_8B = HF_CORPUS / "meta-llama__Meta-Llama-3.1-8B.json"


BAD_HF_CONFIGS = {
    "hidden not divisible by heads": ({"hidden_size": 4095}, "hidden_size 4095 is not divisible by num_attention_heads 32"),
    "heads not a multiple of kv heads": ({"num_key_value_heads": 5}, "num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    "intermediate_size as text": ({"intermediate_size": "512"}, "intermediate_size is '512', expected a whole number"),
    "layers as a float": ({"num_hidden_layers": 32.0}, "num_hidden_layers is 32.0, expected a whole number"),
    "layers as true": ({"num_hidden_layers": True}, "num_hidden_layers is True, expected a whole number"),
    "tie_word_embeddings yes": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes', expected true or false"),
    "rope_theta negative": ({"rope_theta": -1}, "rope_theta is -1, expected a finite number > 0"),
    "negative rope factor": ({"rope_scaling": {"rope_type": "yarn", "factor": -4.0}}, r"rope_scaling.'factor' is -4.0"),
    "5,000-key rope_scaling": ({"rope_scaling": {f"k{i}": 1 for i in range(5000)}}, "rope_scaling has 5,000 keys"),
    "rope_scaling not a mapping": ({"rope_scaling": [1, 2]}, r"rope_scaling is \[1, 2\], expected an object"),
    "experts per token without experts": ({"num_experts": 0, "num_experts_per_tok": 2}, "num_experts / num_local_experts is 0 or absent"),
    "more experts per token than experts": ({"num_local_experts": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 512},
                                            "num_experts_per_tok is 8, expected 1 to the 4 experts"),
}


@pytest.mark.parametrize("change,message", BAD_HF_CONFIGS.values(), ids=BAD_HF_CONFIGS.keys())
def test_a_broken_hf_config_is_refused_naming_the_file_and_field(tmp_path, change, message):
    config = {**json.loads(LLAMA_8B.read_text()), **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ScenarioError, match=rf"{path}: .*{message}"):
        validate_scenario({"model": {"hf_config": str(path)}, "device": "h100-sxm"})


def test_an_hf_config_with_a_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(LLAMA_8B.read_text().rstrip().rstrip("}") + ', "hidden_size": 512}')
    with pytest.raises(ScenarioError, match=rf"{path}: duplicate key 'hidden_size'"):
        validate_scenario({"model": {"hf_config": str(path)}, "device": "h100-sxm"})


def test_a_csv_row_with_more_fields_than_the_header_is_refused(tmp_path, capsys):
    """An unquoted comma shifts the fields after it: the row's columns are no longer the header's."""
    trace = tmp_path / "extra.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,12,3\n"
                     "2023-11-16 18:17:04,1,200,3\n")
    code, err = run_cli([trace_scenario(tmp_path, "azure", trace), "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{trace}:3: 4 fields, expected 3 (the header's columns)" in err, err


def length_scenario(tmp_path, lengths: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\nworkload: {num_requests: 3, output_len: 4, "
                    f"prompt_len: {{dist: empirical, file: {lengths}, column: len}}}}\n")
    return path


def test_a_length_file_row_with_more_fields_than_the_header_is_refused_as_in_a_trace(tmp_path, capsys):
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("id,len\n1,100\n2,1,200\n")      # read as 1: the comma in 1,200 shifts it
    code, err = run_cli([length_scenario(tmp_path, lengths), "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{lengths}:3: 3 fields, expected 2 (the header's columns)" in err, err


@pytest.mark.parametrize("kind", ["trace", "lengths"])
def test_a_csv_column_named_twice_is_refused_not_picked(tmp_path, capsys, kind):
    """A trace read the first of two prompt_len columns, a length file (csv.DictReader) the last."""
    if kind == "trace":
        csv_file = tmp_path / "twice.csv"
        csv_file.write_text("timestamp,prompt_len,output_len,prompt_len\n0,100,10,5\n")
        scenario, column = trace_scenario(tmp_path, "csv", csv_file), "prompt_len"
    else:
        csv_file = tmp_path / "twice_lengths.csv"
        csv_file.write_text("len,len\n100,5\n")
        scenario, column = length_scenario(tmp_path, csv_file), "len"
    code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{csv_file}:1: column '{column}' appears 2 times (columns " in err, err
    assert "Traceback" not in err


def test_trace_token_ids_outside_the_models_vocabulary_are_refused(tmp_path, capsys):
    """A jsonl trace's literal prompt ids index the model's embedding: each must be
    0 <= id < vocab_size (qwen2.5-0.5b: 151936). The error names file, line, field and entry."""
    vocab = 151936
    trace = tmp_path / "ids.jsonl"
    scenario = trace_scenario(tmp_path, "jsonl", trace)
    for bad, k in (([5, vocab], 1), ([-1, 3], 0), ([7, 8, 2**40], 2)):
        trace.write_text(json.dumps({"arrival_s": 0, "prompt_len": 1, "output_len": 2}) + "\n"
                         + json.dumps({"arrival_s": 1, "prompt": bad, "output_len": 2}) + "\n")
        code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
        assert code == 2 and "Traceback" not in err, err
        assert f"{trace}:2: prompt[{k}] is {bad[k]}, expected a token id: 0 <= id < vocab_size " \
               f"(the model's vocab_size is {vocab})" in err, err
    trace.write_text(json.dumps({"arrival_s": 0, "prompt": [0, vocab - 1], "output_len": 2}) + "\n")
    from sim.workload import build_workload
    from sim.scenario import load_scenario
    assert build_workload(load_scenario(scenario)).requests[0].segments[0] == [0, vocab - 1]
