"""`simrun` as a user runs it: files written, clear errors, exit codes."""
import json
from pathlib import Path

from sim.cli import main

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def test_run_writes_every_output(tmp_path, capsys):
    out = tmp_path / "qs"
    code = main([str(SCENARIOS / "quickstart.yaml"), "--out", str(out), "--set", "workload.num_requests=60", "--trace"])
    assert code == 0
    for name in ("summary.json", "requests.csv", "steps.csv", "manifest.json", "report.html", "trace.json",
                 "kv_blocks.png", "queue.png", "batch_tokens.png", "latency_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert summary["requests_finished"] == 60
    assert manifest["calibrated"] is False and manifest["seed"] == 0
    assert manifest["scenario"]["workload"]["num_requests"] == 60
    printed = capsys.readouterr().out
    assert "request throughput" in printed and "UNCALIBRATED" in printed


def test_variants_get_a_folder_each_and_one_comparison(tmp_path, capsys):
    out = tmp_path / "paging"
    assert main([str(SCENARIOS / "seed_paging.yaml"), "--out", str(out)]) == 0
    assert (out / "lengths_35_17_64" / "summary.json").exists() and (out / "lengths_17_33_64" / "summary.json").exists()
    assert (out / "report.html").exists()
    printed = capsys.readouterr().out
    assert "lengths_35_17_64" in printed and "lengths_17_33_64" in printed


def test_bad_scenario_is_a_clear_error_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {blok_size: 32}\n")
    assert main([str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "engine.blok_size: unknown key; did you mean 'block_size'?" in err
    assert not (tmp_path / "o").exists()


def test_bad_override_and_missing_file(tmp_path, capsys):
    assert main([str(SCENARIOS / "quickstart.yaml"), "--set", "engine.block_size=0"]) == 2
    assert "engine.block_size" in capsys.readouterr().err
    assert main([str(tmp_path / "nope.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_memory_that_cannot_hold_one_request_refuses_to_start(tmp_path, capsys):
    assert main([str(SCENARIOS / "quickstart.yaml"), "--set", "engine.num_blocks=10"]) == 2
    assert "max_model_len 4096 needs 256 blocks" in capsys.readouterr().err
