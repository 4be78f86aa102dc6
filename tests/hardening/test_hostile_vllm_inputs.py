"""vLLM's commands and result files as untrusted input: `simrun from-vllm` escapes control
characters and bounds long commands; nonsense in a result file is an error naming the file,
request and field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.cli import main

from support import run_cli, SMOKE, with_changes


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


@pytest.mark.parametrize("words, message", [
    ("--max-model-len abc", "--max-model-len abc: 'abc': expected a whole number, e.g. 4096, 32k (32,000) or 32K"),
    ("--max-num-seqs x4", "--max-num-seqs x4: 'x4': expected an integer"),
    ("--gpu-memory-utilization high", "--gpu-memory-utilization high: 'high': expected a number, e.g. 0.9")])
def test_a_value_that_is_no_number_says_what_the_flag_expects(tmp_path, capsys, words, message):
    code, err, _ = from_vllm(tmp_path, capsys, "vllm serve tiny " + words)
    assert code == 2 and message in err
    assert "could not convert" not in err and "invalid literal" not in err     # not Python's own wording


@pytest.mark.parametrize("as_words", [False, True])
def test_secrets_in_the_command_are_neither_shown_nor_written(tmp_path, capsys, as_words):
    """The command is echoed on screen and into a scenario file meant to be shared: --api-key,
    --hf-token and HF_TOKEN-like environment values are replaced, the rest stays as given."""
    command = "HF_TOKEN=hf_s1 vllm serve tiny --api-key sk-s2 --hf-token=hf_s3 --max-num-seqs 4"
    code, shown, out = from_vllm(tmp_path, capsys, *(command.split() if as_words else [command]))
    assert code == 0 and "engine.max_num_seqs = 4" in shown
    text = out.read_text()
    for secret in ("hf_s1", "sk-s2", "hf_s3"):
        assert secret not in shown and secret not in text
    assert text.splitlines()[0].endswith("from: HF_TOKEN=REDACTED vllm serve tiny --api-key REDACTED "
                                         "--hf-token=REDACTED --max-num-seqs 4")


def test_a_5000_flag_command_lists_the_first_flags_and_counts_the_rest(tmp_path, capsys):
    command = "vllm serve tiny " + " ".join(f"--unknown-flag-{i} {i}" for i in range(5000))
    code, err, out = from_vllm(tmp_path, capsys, command)
    assert code == 0
    assert "... and 4,950 more unknown flags" in err and "... and 4,950 more unknown flags" in out.read_text()
    assert len(err) < 10_000 and out.stat().st_size < 10_000


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
    "duration 0": (mutated(duration=0), r"field 'duration' = 0 with 4 completed requests; expected the "
                                        r"benchmark's length in seconds, > 0"),
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


def test_a_spec_metrics_scrape_with_a_non_ascii_position_is_not_a_crash():
    """'²'.isdigit() holds and int('²') fails: such a position label is no position, and an
    infinite counter is no count (both are left out of the fit)."""
    from sim.vllm.spec_metrics import spec_counters

    scrape = ('vllm:spec_decode_num_drafts_total 100\nvllm:spec_decode_num_accepted_tokens_total 150\n'
              'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="\u00b2"} 80\n'
              'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 70\n')
    assert spec_counters(scrape) == (100.0, 150.0, {0: 70.0})
