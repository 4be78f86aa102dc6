"""`simrun` as a user runs it: files written, clear errors, exit codes."""
import json
from pathlib import Path

from sim.cli import main

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def test_run_writes_every_output(tmp_path, capsys):
    out = tmp_path / "qs"
    code = main([str(SCENARIOS / "quickstart.yaml"), "--out", str(out), "--set", "workload.num_requests=60", "--trace"])
    assert code == 0
    for name in ("summary.json", "requests.csv", "steps.csv", "manifest.json", "report.html", "trace.json",
                 "overview.png", "kv_blocks.png", "queue.png", "batch_tokens.png", "latency_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert summary["requests_finished"] == 60
    assert manifest["calibrated"] is False and manifest["seed"] == 0
    assert manifest["scenario"]["workload"]["num_requests"] == 60
    printed = capsys.readouterr().out
    assert "request throughput" in printed and "trained profile" in printed     # the default step times


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


def test_the_answer_prints_before_any_figure_is_drawn(tmp_path, capsys, monkeypatch):
    import sim.output.run_files as run_files

    seen = {}
    real = run_files.write_reports

    def spy(results, out, **kw):
        seen["printed"] = capsys.readouterr().out         # what was on screen when drawing began
        return real(results, out, **kw)

    monkeypatch.setattr(run_files, "write_reports", spy)
    assert main([str(SCENARIOS / "quickstart.yaml"), "--out", str(tmp_path / "q"),
                 "--set", "workload.num_requests=40"]) == 0
    before = seen["printed"]
    for text in ("model       llama-3.1-8b (bfloat16)", "device      l4, tp=1", "SLOs        TTFT ≤ 1 s, TPOT ≤ 100 ms",
                 "GPU KV cache size: 33,936 tokens", "Maximum concurrency for 4,096 tokens per request: 8.29x",
                 "request throughput (req/s)", "KV usage peak", "quickstart: "):
        assert text in before, text
    assert "wrote" in capsys.readouterr().out and (tmp_path / "q" / "overview.png").exists()


def test_no_plots_writes_the_data_only(tmp_path, capsys):
    out = tmp_path / "np"
    assert main([str(SCENARIOS / "seed_static_vs_continuous.yaml"), "--out", str(out), "--no-plots"]) == 0
    assert (out / "static" / "summary.json").exists() and (out / "continuous" / "steps.csv").exists()
    assert not list(out.glob("**/*.png")) and not (out / "report.html").exists()
    printed = capsys.readouterr().out
    assert "continuous / static" in printed                      # the ratio column of variants
    assert "no plots: --no-plots" in printed


def test_start_up_pauses_the_collector_and_the_run_finds_it_on(tmp_path, monkeypatch):
    """run_main reads the scenario with the cyclic collector paused (start-up makes long-lived
    objects, no garbage), and leaves it enabled for the run and after: after `-h` and an error too.
    Fails if the pause is dropped, or if it outlives start-up (a sweep, a serve would grow)."""
    import gc

    import pytest

    import sim.predict
    import sim.scenario

    seen = {}
    load, predict = sim.scenario.load_scenario, sim.predict.predict

    def loading(*args, **kw):
        seen["loading"] = gc.isenabled()
        return load(*args, **kw)

    def predicting(*args, **kw):
        seen["predicting"] = gc.isenabled()
        return predict(*args, **kw)

    monkeypatch.setattr(sim.scenario, "load_scenario", loading)
    monkeypatch.setattr(sim.predict, "predict", predicting)
    assert gc.isenabled()
    assert main([str(SCENARIOS / "quickstart.yaml"), "--out", str(tmp_path / "q"),
                 "--set", "workload.num_requests=5", "--no-plots", "--quiet"]) == 0
    assert seen == {"loading": False, "predicting": True} and gc.isenabled()
    with pytest.raises(SystemExit):
        main(["run", "-h"])
    assert gc.isenabled()
    assert main([str(SCENARIOS / "quickstart.yaml"), "--set", "engine.block_size=0"]) == 2
    assert gc.isenabled()


def test_rejected_requests_are_called_out_and_miss_the_slo(tmp_path, capsys):
    scenario = tmp_path / "rej.yaml"
    scenario.write_text("model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {max_model_len: 1024}\n"
                        "slo: {ttft_s: 1}\nworkload:\n  requests:\n"
                        "    - {prompt_len: 2000, output_len: 4}\n    - {prompt_len: 16, output_len: 4}\n")
    assert main([str(scenario), "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "1 request not served (each counted as an SLO miss)" in printed and "max_model_len 1024" in printed
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["requests_rejected"] == 1 and summary["slo_attainment"] == 0.5


def test_the_header_names_the_resolved_async_switch(tmp_path, capsys):
    # quickstart says nothing (auto): on an L4 under vLLM 0.19 that resolves to on; forcing it off
    # must show in the same line, since it moves the figures.
    for setting, words in ((None, "async scheduling on"), ("false", "async scheduling off")):
        extra = ["--set", f"engine.async_scheduling={setting}"] if setting else []
        assert main([str(SCENARIOS / "quickstart.yaml"), "--out", str(tmp_path / (setting or "auto")),
                     "--set", "workload.num_requests=20", "--no-plots", *extra]) == 0
        engine_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("engine"))
        assert engine_line.endswith(words), engine_line


def test_a_reader_that_went_away_stops_simrun_quietly():
    """`simrun --help | head -1`: the pipe's reader is gone before simrun writes; simrun stops
    with status 1 and no error or traceback (the read end is closed before it starts)."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        for argv in (["--help"], ["from-vllm", "--help"]):
            done = subprocess.run([sys.executable, "-m", "sim.cli", *argv], stdout=write_end,
                                  stderr=subprocess.PIPE, text=True, timeout=60)
            assert done.returncode == 1 and done.stderr == "", (argv, done.stderr)
    finally:
        os.close(write_end)


def test_progress_bar_is_drawn_on_a_clock_and_erased(monkeypatch):
    """The bar redraws at most every PROGRESS_EVERY_S, however often the run reports, and leaves no line."""
    import io

    from sim import cli

    clock = iter([0.0] + [0.0, 0.5, 1.2, 1.3, 1.4, 1.8, 1.9] + [9.0] * 5)
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    bar = cli.ProgressBar("simulating x", 1000, stream=out)
    for done in (10, 20, 300, 400, 500, 600, 700):
        bar.update(done)
    bar.stop()
    frames = out.getvalue().split("\r")[1:]
    assert [f.split("] ")[1].split(" ")[0] for f in frames[:-1]] == ["300/1,000", "600/1,000"]
    assert frames[-1] == "\x1b[K"
