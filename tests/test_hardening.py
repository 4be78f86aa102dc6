"""Untrusted input: names, YAML, bounds, output folders, error text, zero-finished runs."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from sim.cli import main
from sim.names import folder_name, name_problem
from sim.scenario import ScenarioError, validate_scenario
from support import alarm as within, with_changes

BASE = {"model": "qwen2.5-0.5b", "device": "h100-sxm"}
SMALL = ("model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {num_blocks: 256, max_model_len: 256}\n"
         "workload: {num_requests: 4, prompt_len: 16, output_len: 4}\n")


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


# ----------------------------------------------------------------------------- 1. names

HOSTILE_NAMES = ["../../../x", "/abs/x", "", "/", "..", ".", "a/b", "a\\b", ".hidden", "report.html",
                 "x" * 101, "a\x00b", "-rf", "a\nb"]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_hostile_variant_names_are_refused(name):
    assert name_problem(name)
    with pytest.raises(ScenarioError, match="variants: variant name"):
        validate_scenario({**BASE, "variants": {name: {}, "ok": {}}})


def test_hostile_variant_names_write_nothing_anywhere(tmp_path, capsys, monkeypatch):
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    names = {n: {} for n in HOSTILE_NAMES if "\x00" not in n}
    scenario = work / "s.yaml"
    scenario.write_text(SMALL + "variants: " + json.dumps(names) + "\n")
    before = files_under(tmp_path)
    assert main([str(scenario), "--out", str(work / "out")]) == 2
    assert files_under(tmp_path) == before
    assert "variant name" in capsys.readouterr().err


def test_plain_names_pass_and_folder_name_makes_any_text_safe():
    for name in ("static", "bs16", "lengths_35_17_64", "v1.5", "rate=2,tp=1"):
        assert name_problem(name) is None, name
    for text in HOSTILE_NAMES + ["meta-llama/Llama-3.1-8B"]:
        assert name_problem(folder_name(text)) is None, text


# ----------------------------------------------------------------------------- 2. YAML and bounds

ALIAS_BOMB = """model:
  base: qwen2.5-0.5b
  rope_scaling:
    a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
device: h100-sxm
"""


def load_text(tmp_path, text: str, name: str = "s.yaml", overrides=None):
    from sim.scenario import load_scenario

    path = tmp_path / name
    path.write_text(text)
    return load_scenario(path, overrides)


def test_alias_bomb_fails_fast_with_a_clean_error(tmp_path):
    import time

    t0 = time.process_time()
    with pytest.raises(ScenarioError, match=r"s\.yaml:\d+: expands to more than"):
        load_text(tmp_path, ALIAS_BOMB)
    assert time.process_time() - t0 < 2.0


def test_rope_scaling_given_as_python_data_is_bounded_too():
    shared = ["x"] * 10
    for _ in range(6):
        shared = [shared] * 10      # a billion leaves by reference, a few kB in memory
    with pytest.raises(ScenarioError, match="rope_scaling"):
        validate_scenario({**BASE, "model": {"base": "qwen2.5-0.5b", "rope_scaling": {"a": shared}}})


def test_duplicate_keys_are_errors_with_both_lines(tmp_path):
    text = "model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {max_model_len: 1024}\nworkload: {num_requests: 3}\nengine:\n  block_size: 8\n"
    with pytest.raises(ScenarioError, match=r"s\.yaml: line 5, column 1: not valid YAML \(duplicate key 'engine' \(first at line 3\)"):
        load_text(tmp_path, text)
    nested = "model: qwen2.5-0.5b\ndevice: h100-sxm\nengine:\n  block_size: 8\n  block_size: 16\n"
    with pytest.raises(ScenarioError, match=r"line 5.*duplicate key 'block_size' \(first at line 4\)"):
        load_text(tmp_path, nested)


def test_yaml_merge_keys_still_override():
    from sim.core.files import load_yaml

    assert load_yaml("base: &b {x: 1, y: 2}\nnew:\n  <<: *b\n  y: 3\n")["new"] == {"x": 1, "y": 3}


INFINITE = ["workload.arrival.rate=.inf", "workload.duration_s=.inf", "engine.gpu_memory_utilization=.nan",
            "slo.ttft_s=.inf", "device.memory_mib=.inf", "model.rope_theta=.inf", "cluster.load_bound=.inf",
            "workload.prompt_len={dist: normal, mean: .inf, std: 1}", "workload.arrival.cv=.nan",
            "engine.activation_mib=-.inf", "device.hbm_gbps=.inf"]


@pytest.mark.parametrize("override", INFINITE)
def test_every_float_field_is_finite(tmp_path, override):
    with pytest.raises(ScenarioError, match="finite number"):
        load_text(tmp_path, SMALL, overrides=[override])


TOO_BIG = {"cluster.replicas=1000000": "cluster.replicas", "cluster.replicas=1000": "blocks, more than the",
           "workload.num_requests=1e12": "workload.num_requests",
           "workload.num_requests=1000000000000": "workload.num_requests",
           "engine.num_blocks=1000000000000": "engine.num_blocks", "engine.num_blocks=10000000": "GiB of KV cache",
           "device.memory_mib=1e30": "device.memory_mib", "workload.duration_s=1e9": "workload.duration_s",
           "engine.max_model_len=1000000000": "engine.max_model_len",
           "workload.output_len=1000000000": "workload.output_len"}


@pytest.mark.parametrize("override", list(TOO_BIG), ids=list(TOO_BIG))
def test_sizes_have_upper_bounds(tmp_path, override):
    with pytest.raises(ScenarioError, match=TOO_BIG[override].replace(".", r"\.")):
        # pool sizes derived from the device's memory (an H100: ~375k blocks per replica)
        load_text(tmp_path, SMALL.replace("engine: {num_blocks: 256, max_model_len: 256}\n", ""),
                  overrides=[override])


def test_rate_times_duration_is_bounded(tmp_path):
    with pytest.raises(ScenarioError, match="rate x duration_s"):
        load_text(tmp_path, "model: qwen2.5-0.5b\ndevice: h100-sxm\n"
                  "workload: {duration_s: 100000, arrival: {process: poisson, rate: 100}}\n")


def test_set_mapping_merges_into_the_section(tmp_path):
    text = "model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {max_model_len: 1024, block_size: 32}\n"
    s = load_text(tmp_path, text, overrides=["engine={block_size: 8}"])
    assert s.engine.block_size == 8 and s.engine.max_model_len == 1024
    s = load_text(tmp_path, text, overrides=["model={max_position_embeddings: 8192}"])
    assert s.model.max_position_embeddings == 8192 and s.model.num_layers == 24
    assert load_text(tmp_path, text + "variants: {a: {}}\n", overrides=["variants={}"]).variants == {}


# ----------------------------------------------------------------------------- 3. output folders

def small_scenario(tmp_path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


def test_rerun_removes_stale_files_of_the_earlier_run(tmp_path):
    from sim.output.run_dir import INCOMPLETE, MARKER

    out = tmp_path / "out"
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--trace", "--quiet"]) == 0
    assert (out / "trace.json").exists() and (out / MARKER).exists() and not (out / INCOMPLETE).exists()
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 0
    assert not (out / "trace.json").exists()          # stale: this run did not ask for a trace
    assert (out / "summary.json").exists()
    assert not [p for p in out.rglob("*.tmp")]


def test_folder_with_foreign_files_is_refused_before_simulating(tmp_path, capsys, monkeypatch):
    import sim.predict

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(sim.predict, "predict", lambda *a, **k: pytest.fail("simulated before checking --out"))
    assert main([str(small_scenario(tmp_path)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and "--force" in err
    monkeypatch.undo()
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--force", "--quiet"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "summary.json").exists()
    # a second forced run still leaves the foreign file alone
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--force", "--quiet"]) == 0
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("bad", ["", "  "])
def test_empty_out_is_refused(tmp_path, capsys, bad, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([str(small_scenario(tmp_path)), "--out", bad])
    assert exc.value.code == 2 and "empty path" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.yaml"]


def test_out_that_is_a_file_is_refused_before_simulating(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("x")
    assert main([str(small_scenario(tmp_path)), "--out", str(target)]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main([str(small_scenario(tmp_path)), "--out", str(target / "sub")]) == 2


def test_interrupted_run_leaves_incomplete_and_the_next_run_cleans_up(tmp_path, monkeypatch):
    import sim.output.run_files as run_files
    from sim.output.run_dir import INCOMPLETE

    out = tmp_path / "out"
    real = run_files.write_csv

    def dies_midway(path, frame):
        if Path(path).name == "steps.csv":
            (Path(path).parent / ".steps.csv.abc.tmp").write_text("half")    # what kill -9 leaves
            raise KeyboardInterrupt
        return real(path, frame)

    monkeypatch.setattr(run_files, "write_csv", dies_midway)
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 130
    assert (out / INCOMPLETE).exists() and (out / "summary.json").exists()
    monkeypatch.undo()
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 0
    assert not (out / INCOMPLETE).exists() and not list(out.glob(".*.tmp"))


def test_summary_json_is_valid_json_without_nan(tmp_path):
    from sim.output.io import write_json

    path = write_json(tmp_path / "s.json", {"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


# ----------------------------------------------------------------------------- 4. nothing finished

def test_run_where_every_request_is_rejected_exits_non_zero_with_reasons(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {max_model_len: 64}\n"
                    "workload: {num_requests: 5, prompt_len: 100, output_len: 4}\n")
    assert main([str(path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "no request finished" in err
    assert "5 x prompt of N tokens leaves no room for output within max_model_len N" in err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["requests_rejected"] == 5 and summary["requests_finished"] == 0


def test_warmup_requests_are_not_counted_as_finished(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("num_requests: 4", "num_requests: 6, warmup_requests: 2"))
    assert main([str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["requests_total"] == 6 and summary["warmup_requests"] == 2
    assert summary["requests_finished"] == 4 == summary["requests_measured"]


# ----------------------------------------------------------------------------- 5. error text

def run_cli(argv, capsys) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def trace_scenario(tmp_path, fmt: str, trace: Path) -> Path:
    path = tmp_path / f"trace_{fmt}.yaml"
    path.write_text(f"model: qwen2.5-0.5b\ndevice: h100-sxm\nworkload:\n  trace: {{format: {fmt}, path: {trace}}}\n")
    return path


def test_errors_print_literally_without_markup_or_emoji(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(SMALL + 'variants: {":x: [bold]b[/bold]": {}}\n')
    code, err = run_cli([path, "--out", tmp_path / "o"], capsys)
    assert code == 2 and ":x: [bold]b[/bold]" in err and "\u274c" not in err


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


def test_a_sweep_folder_inside_a_run_folder_is_left_alone(tmp_path):
    out = tmp_path / "runs" / "small"
    scenario = small_scenario(tmp_path)
    assert main([str(scenario), "--out", str(out), "--quiet"]) == 0
    assert main([str(scenario), "--out", str(out / "sweep"), "--quiet", "--set", "engine.block_size=8,16"]) == 0
    assert (out / "sweep" / "sweep.csv").exists()
    assert main([str(scenario), "--out", str(out), "--quiet"]) == 0       # the sweep is not foreign
    assert (out / "sweep" / "sweep.csv").exists()                          # nor stale


def test_sigterm_mid_run_leaves_incomplete_and_no_temp_files(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from sim.output.run_dir import INCOMPLETE

    out = tmp_path / "out"
    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("num_requests: 4", "num_requests: 200000").replace("output_len: 4", "output_len: 64"))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "sim.cli", str(path), "--out", str(out), "--quiet"], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120          # a bound for a stuck start, not a timing assumption
    while not (out / INCOMPLETE).exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None and (out / INCOMPLETE).exists()     # our handler is in place from here on
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    # communicate() returning means every process holding stderr (the figure workers) has ended
    assert proc.returncode == 130, err[-500:]
    assert (out / INCOMPLETE).exists() and not list(out.rglob("*.tmp"))
    assert "Traceback" not in err and "Exception ignored" not in err, err[-500:]


@pytest.mark.parametrize("arrival, message", [
    ("{process: poisson, rate: 2.5e-320}", "30 days"),
    ("{process: gamma, rate: 10, cv: 99}", "all at t=0"),
])
def test_arrival_processes_that_would_give_nan_times_are_errors(tmp_path, arrival, message):
    from sim.workload import build_workload

    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("num_requests: 4", f"num_requests: 4, arrival: {arrival}"))
    with pytest.raises(ValueError, match=message):
        from sim.scenario import load_scenario

        build_workload(load_scenario(path))


def test_a_duration_bounded_gamma_process_that_cannot_advance_is_an_error_not_a_hang(tmp_path):
    from sim.scenario import load_scenario
    from sim.workload import build_workload

    path = tmp_path / "s.yaml"
    path.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\n"
                    "workload: {duration_s: 10, arrival: {process: gamma, rate: 1, cv: 99}}\n")
    with pytest.raises(ValueError, match="all at t=0"):
        build_workload(load_scenario(path))


def test_a_crafted_marker_cannot_make_kvtwin_delete_outside_its_folder(tmp_path):
    from sim.output.run_dir import MARKER

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"kvtwin": "run folder", "files": ["../victim.txt", str(victim)]}))
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 0
    assert victim.read_text() == "keep me"


def test_hidden_temp_files_in_a_foreign_folder_are_not_ours(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".mine.tmp").write_text("user's")
    assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet"]) == 2
    for _ in range(2):          # and a second forced run still knows it is the user's
        assert main([str(small_scenario(tmp_path)), "--out", str(out), "--quiet", "--force"]) == 0
        assert (out / ".mine.tmp").read_text() == "user's"


def test_validate_refuses_a_foreign_folder_before_measuring(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    import validate.run

    monkeypatch.setattr(validate.run, "validate", lambda *a, **k: pytest.fail("measured before checking --out"))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["validate", str(small_scenario(tmp_path)), "--device", "cpu", "--out", str(out)]) == 2
    assert "notes.txt" in capsys.readouterr().err


# ----------------------------------------------------------------------------- gzip bombs

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


# ----------------------------------------------------------------------------- bench and compare folders

SMOKE = Path(__file__).resolve().parents[1] / "scenarios" / "serve_smoke.yaml"
NO_PREFIX = ["--set", "workload.shared_prefix=null", "--set", "workload.warmup_requests=0"]


def vllm_result_file(tmp_path: Path, rates: tuple[float, ...] = (20.0,)) -> Path:
    """A (JSON Lines when several rates) vLLM result file made from kvtwin's own prediction."""
    from sim.predict import predict
    from sim.scenario import load_scenario
    from sim.vllm.results import vllm_result_dict

    lines = []
    for rate in rates:
        run = predict(load_scenario(SMOKE, [f"workload.arrival.rate={rate}", "workload.shared_prefix=null",
                                            "workload.warmup_requests=0"]), "measured")
        lines.append(json.dumps(vllm_result_dict(run.requests, {"model_id": "tiny", "request_rate": rate})))
    path = tmp_path / f"vllm{len(rates)}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_compare_owns_its_output_folder(tmp_path, capsys, monkeypatch):
    from sim.output.run_dir import INCOMPLETE, MARKER

    single, sweep = vllm_result_file(tmp_path), vllm_result_file(tmp_path, (5.0, 20.0))
    out = tmp_path / "cmp"
    args = ["compare", str(SMOKE), *NO_PREFIX, "--out", str(out), "--allow-mismatch", "--vllm-result"]
    assert main([*args, str(sweep)]) == 0
    assert (out / "sweep_comparison.csv").exists() and (out / MARKER).exists() and not (out / INCOMPLETE).exists()
    assert main([*args, str(single)]) == 0
    assert (out / "comparison.csv").exists() and (out / "predicted" / "summary.json").exists()
    assert not (out / "sweep_comparison.csv").exists()          # the earlier run's files are gone
    assert not (out / INCOMPLETE).exists()
    # a folder of someone else's is refused before anything is predicted; --force writes beside it
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    import sim.predict

    real_predict = sim.predict.predict
    monkeypatch.setattr(sim.predict, "predict", lambda *a, **k: pytest.fail("predicted before checking --out"))
    capsys.readouterr()
    for result in (single, sweep):
        assert main(["compare", str(SMOKE), *NO_PREFIX, "--out", str(mine), "--vllm-result", str(result)]) == 2
        err = capsys.readouterr().err
        assert "notes.txt" in err and "--force" in err
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(SMOKE), "--out", "", "--vllm-result", str(single)])
    assert exit_.value.code == 2 and "an empty path" in capsys.readouterr().err
    monkeypatch.setattr(sim.predict, "predict", real_predict)
    assert main(["compare", str(SMOKE), *NO_PREFIX, "--out", str(mine), "--force", "--allow-mismatch",
                 "--vllm-result", str(single)]) == 0
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "comparison.csv").exists()


def test_bench_checks_its_output_folder_before_measuring_and_marks_a_failed_run(tmp_path, capsys, monkeypatch):
    import validate.bench
    from sim.output.run_dir import INCOMPLETE

    monkeypatch.setattr(validate.bench, "run_bench", lambda *a, **k: pytest.fail("measured before checking --out"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    bench = ["bench", str(SMOKE), "--endpoint", "http://127.0.0.1:9"]
    assert main([*bench, "--out", str(mine)]) == 2
    assert "notes.txt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main([*bench, "--out", " "])
    assert exit_.value.code == 2 and "an empty path" in capsys.readouterr().err

    # measured, then killed while writing: the folder says so, and the next bench cleans it up
    monkeypatch.setattr(validate.bench, "run_bench", lambda *a, **k: object())

    def write_then_fail(predicted, measured, out, title):
        (out / "comparison.csv").write_text("partial")
        raise OSError("disk full")

    monkeypatch.setattr(validate.bench, "write_comparison", write_then_fail)
    out = tmp_path / "b"
    assert main([*bench, "--out", str(out)]) == 2
    assert (out / INCOMPLETE).exists() and (out / "comparison.csv").exists()
    monkeypatch.setattr(validate.bench, "write_comparison", lambda *a: (_ for _ in ()).throw(OSError("again")))
    assert main([*bench, "--out", str(out)]) == 2
    assert (out / INCOMPLETE).exists() and not (out / "comparison.csv").exists()


def test_an_interrupt_surfacing_wrapped_in_another_error_is_still_an_interrupt(monkeypatch, capsys):
    # An error after a signal asked to stop (a worker process that ended, say) is part of the
    # interruption: the run ends as interrupted (130), not as a crash.
    import sim.cli
    from sim import stop

    def interrupted_inside_an_import(*_):
        stop._asked = "SIGTERM"
        raise RuntimeError("Error calling __set_name__ on 'Field' instance 'fields' in 'Task'")

    monkeypatch.setattr(stop, "_asked", None)
    monkeypatch.setattr(sim.cli, "run_command", interrupted_inside_an_import)
    assert sim.cli.main(["whatever.yaml"]) == 130
    assert "interrupted" in capsys.readouterr().err


# ----------------------------------------------------------------------------- round 2: cycles and row bounds

RECURSIVE_ALIASES = {
    "a list holding itself": "foo: &a [*a]\n",
    "a section holding itself": "engine: &e\n  block_size: 16\n  self: *e\n",
    "two levels down": "x: &a {b: [1, {c: *a}]}\n",
    "through a merge key": "x: &a {<<: *a}\n",
}




@pytest.mark.parametrize("text", RECURSIVE_ALIASES.values(), ids=RECURSIVE_ALIASES.keys())
def test_a_recursive_yaml_alias_is_refused_at_load_time(text, tmp_path):
    from sim.core.files import FileFormatError, load_yaml, read_yaml

    with within(10), pytest.raises(FileFormatError, match=r"s\.yaml:\d+: a recursive alias"):
        load_yaml(text, "s.yaml")
    (tmp_path / "p.yaml").write_text(text)
    with within(10), pytest.raises(FileFormatError, match=r"p\.yaml:\d+: a recursive alias"):
        read_yaml(tmp_path / "p.yaml")        # profiles, --config files


def test_shared_aliases_that_do_not_recurse_still_load():
    from sim.core.files import load_yaml

    assert load_yaml("a: &x [1, 2]\nb: [*x, {c: *x}]\n") == {"a": [1, 2], "b": [[1, 2], {"c": [1, 2]}]}


def test_recursive_aliases_in_a_scenario_and_in_set_are_clean_errors(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SMALL + "foo: &a [*a]\n")
    with within(20):
        code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{scenario}:5: a recursive alias" in err and "Traceback" not in err
    scenario.write_text(SMALL)
    with within(20):
        code, err = run_cli([scenario, "--out", tmp_path / "o", "--set", "engine.block_size=&a [*a]"], capsys)
    assert code == 2 and "--set engine.block_size:1: a recursive alias" in err


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


# ----------------------------------------------------------------------------- round 2: from-vllm and printed names

def from_vllm(tmp_path, capsys, *command: str) -> tuple[int, str, Path]:
    out = tmp_path / "s.yaml"
    out.unlink(missing_ok=True)
    code = main(["from-vllm", "--device", "h100-sxm", "--out", str(out), "--", *command])
    captured = capsys.readouterr()
    return code, captured.err + captured.out, out


@pytest.mark.parametrize("words", [
    ["--served-model-name", "x\nfuzz_injected: 1 #"],            # a value
    ["--x\nfuzz_injected: 1 #"],                                  # an unknown flag's name
    ["--new-flag", "1\r\nfuzz_injected: 1"], ["--y\x85fuzz_injected: 1"], ["--z\u2028fuzz_injected: 1"],
    ["--served-model-name", "\x1b[31mred\x07"]])
def test_from_vllm_writes_control_characters_escaped_never_as_yaml(tmp_path, capsys, words):
    import yaml

    code, shown, out = from_vllm(tmp_path, capsys, "vllm", "serve", "tiny", *words)
    assert code == 0
    text = out.read_text()
    assert yaml.safe_load(text) == {"name": "tiny", "model": "tiny", "device": "h100-sxm"}
    for raw in ("\n" + "fuzz", "\r", "\x85", "\u2028", "\x1b", "\x07"):
        assert raw not in text and raw not in shown
    assert all(line.startswith("#") for line in text.splitlines()[:3])


def test_from_vllm_values_that_used_to_crash_or_mislead(tmp_path, capsys):
    code, err, _ = from_vllm(tmp_path, capsys, "vllm serve tiny --max-model-len 1e400")
    assert code == 2 and "--max-model-len 1e400: '1e400' is not a finite number" in err and "Traceback" not in err
    code, err, _ = from_vllm(tmp_path, capsys, "vllm serve tiny --max-num-seqs " + "9" * 5000)
    assert code == 2 and "--max-num-seqs" in err and "4300" not in err and len(err) < 400
    code, err, _ = from_vllm(tmp_path, capsys, "rm -rf /x")
    assert code == 2 and "'rm -rf /x' is not a `vllm serve` command" in err
    code, err, out = from_vllm(tmp_path, capsys, "/opt/venv/bin/vllm serve tiny --max-num-seqs 4")
    assert code == 0 and "engine.max_num_seqs = 4" in err
    code, err, out = from_vllm(tmp_path, capsys, "--max-num-seqs 4")   # the words after `vllm serve`
    assert code == 2 and "names no model" in err


def test_a_5000_flag_command_lists_the_first_flags_and_counts_the_rest(tmp_path, capsys):
    command = "vllm serve tiny " + " ".join(f"--unknown-flag-{i} {i}" for i in range(5000))
    code, err, out = from_vllm(tmp_path, capsys, command)
    assert code == 0
    assert "... and 4,950 more unknown flags" in err and "... and 4,950 more unknown flags" in out.read_text()
    assert len(err) < 10_000 and out.stat().st_size < 10_000


def test_a_scenario_name_with_control_characters_is_refused(tmp_path, capsys):
    for name in ("a\x07b", "\x1b[31mred", "two\nlines"):
        with pytest.raises(ScenarioError, match="name: .* holds the control character"):
            validate_scenario({**BASE, "name": name})
    validate_scenario({**BASE, "name": "plain name é", "description": "two\nlines\tand a tab"})
    with pytest.raises(ScenarioError, match="description: .* control character"):
        validate_scenario({**BASE, "description": "\x1b[2J"})


def test_twenty_thousand_unknown_keys_print_a_short_error(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(SMALL + "".join(f"unknown_{i}: 1\n" for i in range(20_000)))
    code, err = run_cli([path, "--out", tmp_path / "o"], capsys)
    assert code == 2 and "20000 problems" in err and "... and 19,988 more" in err and len(err) < 3000


# ----------------------------------------------------------------------------- round 2: vLLM result files

def detailed_result(n: int = 4) -> dict:
    """A consistent `vllm bench serve --save-result --save-detailed` run (vLLM >= 0.10 keys)."""
    ttfts = [0.05 + 0.01 * i for i in range(n)]
    itls = [[0.02] * (7 + i) for i in range(n)]
    return {"date": "20260410-101500", "backend": "vllm", "model_id": "tiny", "num_prompts": n,
            "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None, "duration": 1.5,
            "completed": n, "failed": 0, "total_input_tokens": 40 * n, "total_output_tokens": 8 * n,
            "request_throughput": n / 1.5, "output_throughput": 30.0, "mean_ttft_ms": 65.0, "p99_ttft_ms": 79.7,
            "input_lens": [40] * n, "output_lens": [8 + i for i in range(n)], "ttfts": ttfts, "itls": itls,
            "latencies": [t + sum(x) for t, x in zip(ttfts, itls)], "start_times": [100.0 + 0.25 * i for i in range(n)],
            "errors": [""] * n}


def mutated(**changes) -> dict:
    return with_changes(detailed_result(), **changes)


BAD_RESULTS = {
    "negative ttft": (mutated(ttfts__1=-0.5), r"ttfts\[1\] = -0.5; expected a finite number of seconds >= 0"),
    "all latencies -1": (mutated(latencies=[-1] * 4), r"latencies\[0\] = -1; expected a finite"),
    "negative itl": (mutated(itls__2=[0.02, -0.01]), r"itls\[2\]\[1\] = -0.01; expected"),
    "latency shorter than ttft": (mutated(latencies__3=0.01), r"latencies\[3\] = 0.01 s is shorter than ttfts\[3\]"),
    "output_lens all 0": (mutated(output_lens=[0] * 4, itls=[[]] * 4), r"output_lens\[0\] = 0 for a request that succeeded"),
    "more gaps than tokens": (mutated(itls__0=[0.01] * 30), r"itls\[0\] holds 30 gaps but output_lens\[0\] is 8"),
    "completed -1": (mutated(completed=-1), r"field 'completed' = -1; expected a finite number >= 0"),
    "duration -10": (mutated(duration=-10), r"field 'duration' = -10; expected a finite number >= 0"),
    "completed disagrees": (mutated(completed=3), r"completed = 3 but 4 of the 4 requests"),
    "input_lens 10^12": (mutated(input_lens__0=10**12), r"input_lens\[0\] = 1000000000000; expected a whole number of tokens"),
    "max_concurrency abc": (mutated(max_concurrency="abc"), r"max_concurrency = 'abc'; expected a whole number"),
    "burstiness 0": (mutated(burstiness=0), r"burstiness = 0; expected a gamma shape > 0"),
}


@pytest.mark.parametrize("data,message", BAD_RESULTS.values(), ids=BAD_RESULTS.keys())
def test_nonsense_in_a_vllm_result_is_an_error_naming_file_request_and_field(tmp_path, data, message):
    from sim.vllm.results import VllmResultError, load_results

    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(VllmResultError, match=rf"^{tmp_path}/r\.json: {message}") as error:
        load_results(path)
    assert "\n" not in str(error.value) and "pydantic" not in str(error.value)


def test_a_consistent_result_loads_and_fewer_itls_than_tokens_is_allowed(tmp_path):
    """vLLM's serve.py times chunks, and a chunk may carry several tokens (speculative decoding,
    --stream-interval): fewer ITL gaps than output - 1 is a real file."""
    from sim.vllm.results import load_results

    path = tmp_path / "r.json"
    path.write_text(json.dumps(mutated(itls__0=[0.08, 0.06])))
    run, = load_results(path)
    assert run.detailed and len(run.requests()) == 4


def test_duplicate_json_keys_are_refused_in_a_result_file(tmp_path):
    from sim.vllm.results import VllmResultError, load_results

    path = tmp_path / "r.json"
    path.write_text(json.dumps(detailed_result())[:-1] + ', "completed": 5}')
    with pytest.raises(VllmResultError, match=r"r\.json: duplicate key 'completed'"):
        load_results(path)


def test_use_file_workload_on_a_run_with_no_finished_request_is_a_clean_error(tmp_path, capsys):
    # a rate, not "inf": the arrivals are redrawn from it for the (no) requests left
    all_failed = mutated(completed=0, failed=4, errors=["boom"] * 4, output_lens=[0] * 4, itls=[[]] * 4,
                         request_rate=4.0)
    empty = {**detailed_result(0), "completed": 0, "request_rate": 4.0}
    for name, data in (("failed.json", all_failed), ("empty.json", empty)):
        path = tmp_path / name
        path.write_text(json.dumps(data))
        code, err = run_cli(["compare", SMOKE, "--out", tmp_path / "o", "--force", "--use-file-workload",
                             "--vllm-result", path], capsys)
        assert code == 2 and f"{path} holds no finished request to replay" in err and "Traceback" not in err


def test_series_offset_must_be_finite(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(detailed_result()))
    for bad in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit) as exit_:
            main(["compare", str(SMOKE), "--vllm-result", str(path), "--series-offset", bad])
        assert exit_.value.code == 2 and "--series-offset" in capsys.readouterr().err


# ----------------------------------------------------------------------------- round 2: HF configs, booleans, memory

HF_CORPUS = Path(__file__).parent / "data" / "hf_configs"
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


@pytest.mark.parametrize("field", ["engine.block_size", "workload.num_requests", "seed", "engine.num_blocks",
                                   "engine.gpu_memory_utilization", "model.hidden_size", "cluster.replicas"])
def test_a_boolean_is_not_a_number_in_a_scenario(tmp_path, field):
    section, _, key = field.rpartition(".")
    with pytest.raises(ScenarioError, match=rf"{section or 'top level'}: {key}: true is a boolean, expected a number"):
        load_text(tmp_path, SMALL.replace("model: qwen2.5-0.5b", "model: {base: qwen2.5-0.5b}"), overrides=[f"{field}=true"])


def test_a_fixed_pool_beside_weights_that_cannot_fit_is_refused_as_without_it(tmp_path, capsys):
    from sim.core.memory import InsufficientMemoryError, plan_memory

    with pytest.raises(InsufficientMemoryError):         # without num_blocks: the plan refuses it
        plan_memory(validate_scenario({"model": "llama-3.1-70b", "device": "l4"}))
    with pytest.raises(ScenarioError, match=r"engine.num_blocks: 256 blocks .* with 131.4 GiB of weights per GPU "
                                            r"is more than the device's 22.49 GiB; the weights alone do not fit"):
        validate_scenario({"model": "llama-3.1-70b", "device": "l4", "engine": {"num_blocks": 256}})
    validate_scenario({"model": "llama-3.1-8b", "device": "l4", "engine": {"num_blocks": 256}})   # 15 GiB fits


# ----------------------------------------------------------------------------- round 2: HTTP and big integers

@pytest.mark.parametrize("options", [{"include_usage": "x"}, {"include_usage": 1}, {"continuous_usage_stats": "no"}])
def test_stream_options_values_must_be_booleans(options):
    """vLLM's StreamOptions (vllm/entrypoints/openai/protocol.py) types include_usage and
    continuous_usage_stats `bool | None`; kvtwin takes JSON true/false only, as for its other
    flags (stricter than pydantic's lax mode, which would read 1 or "yes"): anything else is a
    400 in OpenAI's error shape naming the field."""
    pytest.importorskip("fastapi")
    from engine.serve.protocol import ApiError, ServedModel, parse_body

    served = ServedModel("tiny", "tiny", 1024, 512, 0.0, None)
    body = json.dumps({"prompt": [1, 2], "stream": True, "stream_options": options}).encode()
    with pytest.raises(ApiError) as error:
        parse_body(body, served)
    key = next(iter(options))
    assert error.value.status == 400 and error.value.body()["error"]["param"] == f"stream_options.{key}"
    assert f"stream_options.{key} must be true or false" in error.value.body()["error"]["message"]
    assert parse_body(json.dumps({"prompt": [1], "stream": True, "stream_options": {"include_usage": True}}).encode(),
                      served).include_usage


def test_a_5000_digit_integer_names_the_file_line_or_set_path(tmp_path, capsys):
    huge = "9" * 5000
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"seed: {huge}\n" + SMALL)
    code, err = run_cli([scenario, "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{scenario}:1: an integer of 5,000 digits" in err and "set_int_max_str_digits" not in err
    scenario.write_text(SMALL)
    code, err = run_cli([scenario, "--out", tmp_path / "o", "--set", f"seed={huge}"], capsys)
    assert code == 2 and "--set seed:1: an integer of 5,000 digits" in err and len(err) < 300
    with pytest.raises(SystemExit) as exit_:
        main([str(scenario), "--seed", huge])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --seed: '9999" in err and len(err) < 1000
