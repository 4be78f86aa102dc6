"""`simrun compare`: the file's own workload, --append-result sweeps, mismatches before the table."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from sim.cli import main
from sim.predict import predict
from sim.scenario import load_scenario
from sim.vllm.results import vllm_result_dict

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "serve_smoke.yaml"
NO_PREFIX = ["--set", "workload.shared_prefix=null", "--set", "workload.warmup_requests=0"]


def _result(rate: float, **changes) -> dict:
    """A vLLM result file made from kvtwin's own prediction at `rate` (sim.vllm.results' writer)."""
    raw = [f"workload.arrival.rate={rate}", "workload.shared_prefix=null", "workload.warmup_requests=0",
           *[f"{k}={v}" for k, v in changes.items()]]
    run = predict(load_scenario(SCENARIO, raw), "measured")
    return vllm_result_dict(run.requests, {"model_id": "tiny", "request_rate": rate})


def test_file_workload_replays_the_files_requests(tmp_path, capsys):
    data = _result(20.0, **{"workload.prompt_len": 200})         # not the scenario's lengths
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "cmp"
    assert main(["compare", str(SCENARIO), *NO_PREFIX, "--vllm-result", str(path), "--out", str(out)]) == 1
    assert "WORKLOAD MISMATCH" in capsys.readouterr().err
    assert main(["compare", str(SCENARIO), *NO_PREFIX, "--vllm-result", str(path), "--out", str(out),
                 "--use-file-workload"]) == 0
    manifest = json.loads((out / "predicted" / "manifest.json").read_text())
    assert manifest["workload"]["requests"] == len(data["input_lens"])
    assert manifest["workload"]["lengths"]["prompt_tokens"]["mean"] == pytest.approx(200)
    table = pd.read_csv(out / "comparison.csv").set_index("metric")
    # the same simulator produced the file: replaying its own requests reproduces its latencies
    assert table.loc["TTFT mean (s)", "relative_error"] == pytest.approx(0, abs=0.02)
    assert table.loc["E2E mean (s)", "relative_error"] == pytest.approx(0, abs=0.02)
    assert json.loads((out / "measured" / "manifest.json").read_text())["notes"] == []


def test_a_file_of_another_catalog_model_is_a_mismatch(tmp_path, capsys):
    """The file's model_id names the model it measured: a catalog model other than the scenario's
    is a mismatch even when the file's own requests are replayed (it was compared without a word;
    found by h/audit2). An id the catalog does not know (a fine-tune, a local path) is no evidence."""
    data = _result(20.0)
    for model_id, code in (("meta-llama/Llama-3.1-8B-Instruct", 1), ("meta-llama/Llama-3.1-8B", 1),
                           ("my-org/tiny-finetune", 0)):
        path = tmp_path / "r.json"
        path.write_text(json.dumps({**data, "model_id": model_id}))
        assert main(["compare", str(SCENARIO), *NO_PREFIX, "--vllm-result", str(path), "--out",
                     str(tmp_path / "o"), "--force", "--use-file-workload"]) == code, model_id
        err = capsys.readouterr().err
        flat = " ".join(re.sub("[│╭╮╰╯─]", " ", err).split())      # (the panel wraps at the terminal's width)
        assert (f"the file measured '{model_id}' (catalog llama-3.1-8b), the scenario models tiny" in flat) == bool(code), err


def test_a_catalog_checkpoint_under_the_scenarios_own_model_name_is_no_mismatch():
    from sim.scenario import validate_scenario
    from validate.vllm_result import model_mismatches

    renamed = validate_scenario({"model": {"base": "llama-3.1-8b", "name": "my-8b"}, "device": "h100-sxm"})
    assert model_mismatches({"model_id": "meta-llama/Llama-3.1-8B-Instruct"}, renamed) == []
    assert model_mismatches({"model_id": "Qwen/Qwen2.5-7B-Instruct"}, renamed)


def test_allow_mismatch_exits_zero(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result(20.0, **{"workload.prompt_len": 200})))
    assert main(["compare", str(SCENARIO), *NO_PREFIX, "--vllm-result", str(path), "--out", str(tmp_path / "o"),
                 "--allow-mismatch"]) == 0


def test_append_result_sweep_is_compared_rate_by_rate(tmp_path, capsys):
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(_result(rate)) + "\n" for rate in (40.0, 5.0, 20.0)))
    out = tmp_path / "sweep"
    rc = main(["compare", str(SCENARIO), *NO_PREFIX, "--vllm-result", str(path), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    table = pd.read_csv(out / "sweep_comparison.csv")
    assert sorted(table["request_rate"].unique()) == [5.0, 20.0, 40.0]
    ttft = table[table["metric"] == "TTFT mean"].set_index("request_rate")
    assert ttft["relative_error"].abs().max() < 0.05        # each rate predicted from the same process
    assert (out / "latency_vs_rate.png").stat().st_size > 0 and (out / "report.html").exists()
    assert "predicted / measured per request rate" in captured.out
