"""The first hour as a user (issue 28): the light install runs every command or says what to
install, nothing silently wrong, and tables answer the question asked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def simrun_without(blocked: list[str], args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`simrun ARGS` in a fresh interpreter where importing any of `blocked` fails as on an
    install without that package (None in sys.modules halts the import)."""
    shim = (f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"
            f"from sim.cli import main\nsys.exit(main({args!r}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", shim], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


# ----------------------------------------------------------------------------- 1: calibrate on numpy alone

def test_nelder_mead_finds_a_minimum_on_numpy_alone(monkeypatch):
    from validate.vllm_fit import nelder_mead

    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    target = np.array([0.3, -1.2, 2.0])

    def cost(x):
        return float(((x - target) ** 2 * [1, 4, 9]).sum())

    start = np.zeros(3)
    simplex = np.vstack([start] + [start + 0.5 * np.eye(3)[k] for k in range(3)])
    best, value, evaluations = nelder_mead(cost, simplex, max_evaluations=400, xatol=1e-6, fatol=1e-12)
    assert np.allclose(best, target, atol=1e-4) and value < 1e-8
    assert evaluations <= 400
    _, _, capped = nelder_mead(cost, simplex, max_evaluations=20)
    assert capped <= 20 + 3            # a shrink may finish its pass


def test_the_fit_polish_runs_without_scipy(monkeypatch):
    from validate.vllm_fit import _polish

    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    lower, upper = np.full(2, -5.0), np.full(2, 5.0)
    x = _polish(lambda x: x - np.array([0.5, 0.25]), np.zeros(2), lower, upper, None, max_evaluations=200)
    assert np.allclose(x, [0.5, 0.25], atol=0.02)


def test_calibrate_from_vllm_runs_on_the_light_install(tmp_path):
    """The public printouts' fit (tests/vllm/test_vllm_calibrate.py) in a process without scipy or torch."""
    from validate.fidelity import RUNS_FILE

    entries = {e["id"]: e for e in yaml.safe_load(RUNS_FILE.read_text())["runs"]}
    paths = []
    for run_id in ("dennislee-test4-37", "dennislee-test4-38"):
        paths.append(tmp_path / f"{run_id}.txt")
        paths[-1].write_text("Traffic request rate: inf\n============ Serving Benchmark Result ============\n"
                             + "\n".join(entries[run_id]["lines"]) + "\n")
    done = simrun_without(["scipy", "torch"], [
        "calibrate", "--from-vllm", *map(str, paths), "--model", "qwen2.5-7b", "--catalog-device", "a100-80g",
        "--set", "engine.num_blocks=5867", "--set", "engine.async_scheduling=false",
        "--set", "engine.max_model_len=4096", "--out", str(tmp_path / "a100.yaml")], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert (tmp_path / "a100.yaml").exists()


# ----------------------------------------------------------------------------- 2: missing extras

EXTRAS_BLOCKED = ["torch", "scipy", "fastapi", "uvicorn", "httpx", "safetensors", "triton"]


@pytest.mark.parametrize("args, extra, package", [
    (["serve", "--model", "tiny", "--device", "cpu"], "engine,serve", "torch"),
    (["validate", str(ROOT / "scenarios/cpu_smoke.yaml"), "--device", "cpu"], "engine", "torch"),
    (["calibrate", "--model", "tiny", "--device", "cpu"], "engine", "torch"),
    (["bench", str(ROOT / "scenarios/serve_smoke.yaml"), "--endpoint", "http://127.0.0.1:9"], "serve", "httpx"),
])
def test_a_command_needing_an_extra_names_it_in_one_line(tmp_path, args, extra, package):
    done = simrun_without(EXTRAS_BLOCKED, args, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and package in lines[0], lines
    assert f"pip install 'kvtwin[{extra}]'" in lines[0]
    assert not any(tmp_path.iterdir())            # checked before any work: nothing written


def test_help_needs_no_extra(tmp_path):
    done = simrun_without(EXTRAS_BLOCKED, ["serve", "-h"], tmp_path)
    assert done.returncode == 0 and "--model" in done.stdout


# ----------------------------------------------------------------------------- 3, 7: plan

LLAMA_70B_TP4 = {
    "name": "llama70", "seed": 0, "model": "llama-3.1-70b", "device": "h100-sxm", "parallelism": {"tp": 4},
    "engine": {"max_model_len": 4096},
    "workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 2},
                 "prompt_len": {"dist": "sharegpt"}, "output_len": {"dist": "sharegpt"}},
    "slo": {"ttft_s": 2.0, "tpot_s": 0.1}}


def write_scenario(tmp_path: Path, raw: dict, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_plan_replicas_searches_the_scenarios_tp_by_default(tmp_path, monkeypatch):
    import pandas as pd
    from sim.cli import main

    monkeypatch.chdir(tmp_path)
    path = write_scenario(tmp_path, LLAMA_70B_TP4)
    assert main(["plan", str(path), "--target-rate", "6", "--quiet"]) == 0
    table = pd.read_csv(tmp_path / "runs/s/plan_replicas/plan.csv")
    assert list(table["tp"]) == [4] and table["replicas"][0] >= 1
    # files keep seconds and fractions; the screen and HTML show ms and percent
    assert 0 < table["TTFT p99 (s)"][0] < 2 and 0 < table["ttft_p99 headroom"][0] < 1


def test_why_not_counts_the_real_shortfall_per_gpu_and_suggests_more_gpus():
    import re

    from sim.core.memory import InsufficientMemoryError, plan_memory
    from sim.scenario import validate_scenario

    scenario = validate_scenario({**LLAMA_70B_TP4, "parallelism": {"tp": 1}})
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(scenario)
    text = str(err.value)
    mib = lambda pattern: float(re.search(pattern, text).group(1).replace(",", ""))  # noqa: E731
    budget, weights, short = mib(r"([\d,.]+) MiB budget"), mib(r"- ([\d,.]+) MiB weights"), mib(r"short by ([\d,.]+) MiB")
    assert weights > 130_000 and short > weights - budget        # ~60 GiB over, not one request's 1.3 GiB
    assert "per GPU" in text
    advice = text.split("short by")[1]
    first, _, _ = advice.partition("raise parallelism.tp")
    assert first != advice and "max_model_len" not in first      # the suggestion that can work comes first
    assert "weights alone exceed the per-GPU budget" in advice


def test_the_two_plan_searches_write_separate_folders(tmp_path, monkeypatch):
    from sim.cli import main

    monkeypatch.chdir(tmp_path)
    small = {"name": "small", "seed": 0, "model": "llama-3.1-8b", "device": "l4",
             "engine": {"max_model_len": 1024, "prefix_caching": False, "max_num_seqs": 16},
             "workload": {"num_requests": 120, "warmup_requests": 10, "arrival": {"process": "poisson", "rate": 2},
                          "prompt_len": {"dist": "uniform", "min": 64, "max": 256},
                          "output_len": {"dist": "uniform", "min": 16, "max": 64}},
             "slo": {"ttft_s": 1.0, "tpot_s": 0.1}}
    path = write_scenario(tmp_path, small)
    assert main(["plan", str(path), "--quiet", "--max-rate", "4", "--tolerance", "0.3"]) == 0
    rate_csv = (tmp_path / "runs/s/plan/plan.csv").read_text()
    assert main(["plan", str(path), "--target-rate", "3", "--quiet"]) == 0
    assert (tmp_path / "runs/s/plan/plan.csv").read_text() == rate_csv
    assert "replicas" in (tmp_path / "runs/s/plan_replicas/plan.csv").read_text()
    # titled by the scenario's name (as its run figures are), not the file's stem
    assert "highest sustainable rate for small (" in (tmp_path / "runs/s/plan/plan.html").read_text()
    assert "req/s of small (" in (tmp_path / "runs/s/plan_replicas/plan.html").read_text()


# ----------------------------------------------------------------------------- 5: distribution parameters

@pytest.mark.parametrize("length, unused", [
    ({"dist": "sharegpt", "mean": 1500}, "mean"),
    ({"dist": "uniform", "min": 1, "max": 9, "std": 3}, "std"),
    ({"dist": "fixed", "value": 5, "mean": 7}, "mean"),
    ({"dist": "normal", "mean": 50, "std": 5, "value": 9}, "value"),
])
def test_a_parameter_the_distribution_does_not_use_is_an_error(length, unused):
    from sim.scenario import ScenarioError, validate_scenario

    with pytest.raises(ScenarioError) as err:
        validate_scenario({"model": "tiny", "device": "cpu", "workload": {"prompt_len": length}})
    text = str(err.value)
    assert "workload.prompt_len" in text and f"dist '{length['dist']}' does not use {unused}" in text
    assert "its parameters:" in text


@pytest.mark.parametrize("override, message", [
    ("workload.arrival.cv=5", "workload.arrival: cv is read only with process gamma, not poisson; remove it"),
    ("workload.arrival.seed=7", "workload.arrival: seed is read only with process vidur_poisson, not poisson"),
    ("workload.shared_prefix.zipf_s=3",
     "workload.shared_prefix: zipf_s is read only with popularity zipf, not uniform"),
    ("cluster.load_bound=3", "cluster: load_bound is read only with router prefix_aware, not round_robin"),
])
def test_a_parameter_of_a_mode_not_chosen_is_an_error(tmp_path, capsys, override, message):
    """Each ran exactly as without it (cv on a poisson process, a zipf exponent on uniform popularity)."""
    from sim.cli import main

    code = main([str(ROOT / "scenarios/quickstart.yaml"), "--set", "cluster.replicas=2", "--set", override,
                 "--no-plots", "--quiet", "--out", str(tmp_path / "q")])
    assert code == 2 and message in capsys.readouterr().err


def test_a_lora_zipf_exponent_with_uniform_adapters_is_an_error():
    from sim.scenario import ScenarioError, validate_scenario

    with pytest.raises(ScenarioError, match="workload.lora: zipf_s is read only with distribution zipf, not uniform"):
        validate_scenario({"model": "tiny", "device": "cpu", "engine": {"lora": {"max_loras": 2}},
                           "workload": {"lora": {"num_adapters": 4, "zipf_s": 2.0}}})


def test_set_mean_on_the_default_sharegpt_is_refused(tmp_path, capsys):
    from sim.cli import main

    code = main([str(ROOT / "scenarios/quickstart.yaml"), "--set", "workload.prompt_len.mean=1500",
                 "--no-plots", "--quiet", "--out", str(tmp_path / "q")])
    assert code == 2 and "dist 'sharegpt' does not use mean" in capsys.readouterr().err


def test_the_clip_bounds_stay_allowed_where_they_apply():
    from sim.scenario import validate_scenario

    s = validate_scenario({"model": "tiny", "device": "cpu", "workload": {
        "prompt_len": {"dist": "sharegpt", "max": 900}, "output_len": {"dist": "lognormal", "mean": 40, "std": 9,
                                                                       "min": 4}}})
    assert s.workload.prompt_len.max == 900 and s.workload.output_len.min == 4


# ----------------------------------------------------------------------------- 4: trace units

def csv_log(path: Path, column: str, step: float, rows: int = 200) -> Path:
    path.write_text(f"{column},in,out\n" + "".join(f"{i * step:g},{100 + i},{50 + i % 7}\n" for i in range(rows)))
    return path


def trace_scenario(path: Path, column: str, **trace) -> dict:
    return {"name": "tr", "model": "llama-3.1-8b", "device": "h100-sxm", "workload": {"trace": {
        "format": "csv", "path": str(path), "fields": {"arrival": column, "prompt_len": "in", "output_len": "out"},
        **trace}}}


def test_a_field_named_in_ms_is_read_as_ms(tmp_path):
    from sim.scenario import validate_scenario
    from sim.workload import build_workload

    path = csv_log(tmp_path / "log.csv", "ts_ms", 162)
    requests = build_workload(validate_scenario(trace_scenario(path, "ts_ms"))).requests
    assert requests[-1].arrival == pytest.approx(199 * 0.162)


@pytest.mark.parametrize("column, unit", [("ts_ms", "s"), ("arrival_us", "ms"), ("t_s", "ns")])
def test_a_time_unit_contradicting_the_fields_name_is_an_error(tmp_path, column, unit):
    from sim.scenario import validate_scenario
    from sim.traces import TraceError
    from sim.workload import build_workload

    path = csv_log(tmp_path / "log.csv", column, 1)
    with pytest.raises(TraceError, match=f"time_unit is {unit} but the arrival field '{column}' says"):
        build_workload(validate_scenario(trace_scenario(path, column, time_unit=unit)))


def test_an_implausibly_sparse_trace_for_the_model_and_device_is_warned_of(tmp_path):
    from sim.scenario import validate_scenario
    from sim.workload import build_workload

    path = csv_log(tmp_path / "log.csv", "t", 162)          # ms, but nothing says so: read as s (9 h)
    notes = build_workload(validate_scenario(trace_scenario(path, "t"))).notes
    [warning] = [n for n in notes if n.startswith("WARNING")]
    assert "9.0 h read as s" in warning and "llama-3.1-8b on h100-sxm" in warning and "time_unit" in warning
    fine = build_workload(validate_scenario(trace_scenario(path, "t", time_unit="ms"))).notes
    assert not any(n.startswith("WARNING") for n in fine)


# ----------------------------------------------------------------------------- 6: from-vllm --out

def from_vllm(out: Path, flags: str, *extra: str) -> int:
    from sim.cli import main

    return main(["from-vllm", f"vllm serve Qwen/Qwen2.5-7B-Instruct {flags}", "--device", "h100-sxm",
                 "--out", str(out), *extra])


def test_from_vllm_rerun_keeps_the_sections_a_user_added(tmp_path):
    out = tmp_path / "qwen.yaml"
    assert from_vllm(out, "--max-num-seqs 64") == 0
    with out.open("a") as f:
        f.write("workload:\n  num_requests: 50\nslo:\n  ttft_s: 1.0\n")
    assert from_vllm(out, "--max-num-seqs 32") == 0
    data = yaml.safe_load(out.read_text())
    assert data["engine"]["max_num_seqs"] == 32
    assert data["workload"] == {"num_requests": 50} and data["slo"] == {"ttft_s": 1.0}
    assert "Kept from the file this one replaced: workload, slo" in out.read_text()


def test_from_vllm_refuses_to_replace_hand_edits_without_force(tmp_path, capsys):
    out = tmp_path / "qwen.yaml"
    assert from_vllm(out, "--max-num-seqs 64") == 0
    out.write_text(out.read_text().replace("max_num_seqs: 64", "max_num_seqs: 48")
                   + "slo:\n  ttft_s: 1.0\n")
    before = out.read_text()
    assert from_vllm(out, "--max-num-seqs 32") == 2
    assert "engine differs from what from-vllm wrote there" in capsys.readouterr().err
    assert out.read_text() == before
    assert from_vllm(out, "--max-num-seqs 32", "--force") == 0
    data = yaml.safe_load(out.read_text())
    assert data["engine"]["max_num_seqs"] == 32 and data["slo"] == {"ttft_s": 1.0}


def test_from_vllm_matches_a_base_model_to_its_instruct_shape_and_never_suggests_another_size(capsys):
    from sim.cli import main

    assert main(["from-vllm", "vllm serve meta-llama/Llama-3.1-8B", "--device", "h100-sxm"]) == 0
    assert "model: llama-3.1-8b" in capsys.readouterr().out
    assert main(["from-vllm", "vllm serve Qwen/Qwen2.5-72B-Instruct", "--device", "h100-sxm"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "--model-name" in err


def test_from_vllm_suggests_the_device_a_short_name_means(capsys):
    from sim.cli import main

    assert main(["from-vllm", "vllm serve Qwen/Qwen2.5-7B-Instruct", "--device", "h100"]) == 2
    assert "did you mean h100-nvl or h100-pcie or h100-sxm?" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 8: tables answer the question

def simrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`simrun ARGS` with stdout a pipe (not a terminal), COLUMNS unset."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "sim.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(ROOT)}, timeout=600)


def test_a_kv_dtype_sweep_shows_pool_concurrency_and_goodput_uncut(tmp_path):
    done = simrun([str(ROOT / "scenarios/quickstart.yaml"), "--set", "engine.kv_cache_dtype=auto,fp8",
                   "--set", "workload.num_requests=60", "--no-plots", "--jobs", "1", "--out", str(tmp_path / "sw")],
                  tmp_path)
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "kv_cache_dtype" in line)
    for column in ("KV pool (tokens)", "max concurrency (x)", "goodput (req/s)", "TPOT p99 (ms)"):
        assert column in header, header
    assert "…" not in done.stdout                     # a pipe gets the full width, nothing cut
    pools = [line.split("│")[-3].strip() for line in done.stdout.splitlines() if line.startswith(("│ auto", "│ fp8"))]
    assert pools == ["33,936", "67,872"]              # fp8 halves the bytes per token: twice the tokens


def test_a_prompt_layout_sweep_shows_the_prefix_hit_rate(tmp_path):
    done = simrun([str(ROOT / "scenarios/seed_prefix_timestamp.yaml"), "--set", "variants={}",
                   "--set", "workload.dynamic_segment.position=first,last", "--no-plots", "--jobs", "1",
                   "--out", str(tmp_path / "sw")], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "prefix hit rate" in done.stdout and "KV pool" not in done.stdout
    first = next(line for line in done.stdout.splitlines() if line.startswith("│ first"))
    assert first.split("│")[-2].strip() == "0%"


def test_moved_metrics_follow_the_swept_field():
    from sim.whatif.sweep import Axis
    from sim.whatif.sweep_output import moved_metrics

    names = lambda path: [m.name for m in moved_metrics([Axis(path, ("1", "2"), (1, 2))])]  # noqa: E731
    assert names("engine.gpu_memory_utilization") == ["kv_pool_tokens", "max_concurrency"]
    assert names("workload.shared_prefix.length") == ["prefix_hit_rate"]
    assert names("workload.arrival.rate") == []


def test_the_kv_header_says_per_gpu_and_the_total_over_tp_and_the_engine_line_names_fp8():
    from sim.output.setup import engine_words, vllm_startup_lines

    summary = {"memory": {"max_tokens": 469_552, "kv_pool_bytes": int(35.8 * 2**30),
                          "weight_bytes": int(32.9 * 2**30)}}
    manifest = {"scenario": {"parallelism": {"tp": 4}, "engine": {"max_model_len": 8192}}}
    [line] = vllm_startup_lines(summary, manifest)
    assert line == ("GPU KV cache size: 469,552 tokens (35.8 GiB per GPU; weights 32.9 GiB per GPU; "
                    "143 GiB KV and 132 GiB weights over tp=4)")
    assert "KV cache fp8" in engine_words({"kv_cache_dtype": "fp8", "prefix_caching": True})
    assert "KV cache" not in engine_words({"kv_cache_dtype": "auto"})


# ----------------------------------------------------------------------------- 9: the comparison report

@pytest.fixture(scope="module")
def compared_views():
    """A prediction and a `vllm bench serve` style measurement: no steps, no pool size."""
    import pandas as pd
    from sim.output.run_files import view_of
    from sim.output.views import RunView
    from sim.predict import predict
    from sim.scenario import load_scenario

    run = predict(load_scenario(ROOT / "scenarios/serve_smoke.yaml", ["workload.num_requests=20"]), "predicted")
    predicted = view_of(run, "predicted")
    measured_summary = {**run.summary, "ttft_s": {**run.summary["ttft_s"], "mean": run.summary["ttft_s"]["mean"] * 2}}
    measured = RunView("measured", measured_summary, predicted.requests, pd.DataFrame(), 0)
    return {"predicted": predicted, "measured": measured}


def legend_labels(fig) -> list[str]:
    return [text.get_text() for ax in fig.axes if ax.get_legend() for text in ax.get_legend().get_texts()]


def test_kv_and_step_plots_draw_nothing_for_a_measurement_without_them(compared_views):
    from sim.output.report import plot_kv_blocks, plot_step_time

    kv = legend_labels(plot_kv_blocks(compared_views))
    assert any(label.startswith("predicted: total") for label in kv)
    assert not any(label.startswith("measured: total") for label in kv), kv
    assert "measured" not in legend_labels(plot_step_time(compared_views))


def test_the_summary_uses_the_comparison_tables_error_convention(compared_views):
    from sim.output.pages import summary_table

    table = summary_table(compared_views, ratios=True)
    assert "measured / predicted" not in table.columns
    assert table.loc["TTFT mean (ms)", "error"] == "-50.0%"      # (predicted - measured) / measured


def test_the_error_chart_title_promises_only_what_it_draws():
    import pandas as pd
    from validate.plots import error_chart_title

    bare = pd.DataFrame({"relative_error": [0.1], "tolerance": [None], "within": [None]})
    assert error_chart_title(bare) == "Prediction error by metric (no tolerances set)"
    judged = pd.DataFrame({"relative_error": [0.1], "tolerance": [0.2], "within": [True]})
    assert "green within tolerance" in error_chart_title(judged) and "| = tolerance" in error_chart_title(judged)


# ----------------------------------------------------------------------------- smaller items

@pytest.mark.parametrize("key, suggestion", [("rate", "'workload.arrival.rate'"), ("block_size", "'engine.block_size'"),
                                             ("nme", "'name'")])
def test_a_key_at_the_wrong_level_suggests_where_it_lives(tmp_path, capsys, key, suggestion):
    from sim.cli import main

    assert main([str(ROOT / "scenarios/quickstart.yaml"), "--set", f"{key}=6", "--no-plots", "--quiet",
                 "--out", str(tmp_path / "q")]) == 2
    assert f"{key}: unknown key; did you mean {suggestion}?" in capsys.readouterr().err


def test_money_reads_the_same_everywhere():
    from sim.output.units import money

    assert [money(v) for v in (2, 0.504, 0.8, 1.8, 0.031, 1234.5)] == \
        ["$2.00", "$0.50", "$0.80", "$1.80", "$0.031", "$1,234.50"]


def test_the_queue_marks_when_preemptions_happen():
    from sim.output.report import plot_queue
    from sim.output.run_files import view_of
    from sim.predict import predict
    from sim.scenario import load_scenario

    run = predict(load_scenario(ROOT / "scenarios/quickstart.yaml", ["workload.num_requests=300"]), "q")
    assert run.summary["preemptions"] > 0
    # the drawing process gets the view without its frames (RunView.drawable): the marks must survive that
    fig = plot_queue({"q": view_of(run, "q").drawable()})       # (a panel of the overview)
    marks = [line for ax in fig.axes for line in ax.get_lines() if "preemptions" in str(line.get_label())]
    assert len(marks) == 1 and f"({run.summary['preemptions']:,})" in marks[0].get_label()
    steps = run.steps[run.steps["preemptions"] > 0]["start_s"]
    x = marks[0].get_xdata()
    assert steps.min() - 1 <= x.min() and x.max() <= steps.max() + 1


def test_trace_says_how_to_open_it(tmp_path, capsys):
    from sim.cli import main

    assert main([str(ROOT / "scenarios/quickstart.yaml"), "--set", "workload.num_requests=20", "--no-plots",
                 "--trace", "--out", str(tmp_path / "q")]) == 0
    assert "ui.perfetto.dev" in capsys.readouterr().out and (tmp_path / "q/trace.json").exists()


def test_plan_sweep_and_compare_run_on_the_light_install(tmp_path):
    """The issue's 'done when': without any extra, these commands run to the end, no traceback."""
    from sim.predict import predict
    from sim.scenario import load_scenario
    from sim.vllm.results import vllm_result_dict

    scenario = ROOT / "scenarios/serve_smoke.yaml"
    plain = ["workload.shared_prefix=null", "workload.warmup_requests=0"]
    run = predict(load_scenario(scenario, [*plain, "workload.arrival.rate=20"]), "measured")
    result = tmp_path / "result.json"
    result.write_text(json.dumps(vllm_result_dict(run.requests, {"model_id": "tiny", "request_rate": 20.0})))
    sets = [a for p in plain for a in ("--set", p)]
    commands = [
        ["compare", str(scenario), *sets, "--vllm-result", str(result), "--out", str(tmp_path / "cmp"),
         "--allow-mismatch"],
        [str(ROOT / "scenarios/quickstart.yaml"), "--set", "engine.kv_cache_dtype=auto,fp8", "--set",
         "workload.num_requests=40", "--jobs", "1", "--out", str(tmp_path / "sw")],
        ["plan", str(write_scenario(tmp_path, LLAMA_70B_TP4)), "--target-rate", "4", "--quiet", "--jobs", "1",
         "--out", str(tmp_path / "plan")],
    ]
    for args in commands:
        done = simrun_without(EXTRAS_BLOCKED, args, tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args[0], done.stderr[-2000:])
    assert (tmp_path / "cmp/report.html").exists() and (tmp_path / "sw/sweep.html").exists()
