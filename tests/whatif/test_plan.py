"""Capacity searches: SLO parsing, the steady-state rule, and each search against brute force."""
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sim.cli import main
from sim.whatif.plan import (Candidate, PlanError, Traffic, dollars_per_million_output_tokens, fewest_passing, headroom,
                             highest_passing, parse_slo, plan_replicas, run_probe, search_rate, steady_state,
                             with_settings)
from sim.whatif.plan_output import answer_economics
from sim.predict import predict
from sim.scenario import load_scenario
from sim.whatif.sweep import PointTask, load_raw

# One L4 at max_num_seqs 16 serves about 5 requests/s of this traffic; a run takes ~0.05 s.
SMALL = {
    # datasheet step times: the SLOs below were sized on them (the search is under test, not the source)
    "name": "small", "seed": 0, "model": "llama-3.1-8b", "device": "l4", "step_times": "datasheet",
    "engine": {"max_model_len": 1024, "prefix_caching": False, "max_num_seqs": 16},
    "workload": {"num_requests": 120, "warmup_requests": 10, "arrival": {"process": "poisson", "rate": 2},
                 "prompt_len": {"dist": "uniform", "min": 64, "max": 256},
                 "output_len": {"dist": "uniform", "min": 16, "max": 64}},
}
SLOS = (parse_slo("ttft_p99=1.0"), parse_slo("tpot_p99=0.1"))


@pytest.fixture
def scenario_file(tmp_path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


def base_task(path: Path) -> PointTask:
    return PointTask(load_raw(path), str(path.parent), str(path), ())


def probe(path: Path, settings: dict, slos=SLOS) -> dict:
    return run_probe((with_settings(base_task(path), settings), tuple(slos)))


# ----------------------------------------------------------------------------- parsing

def test_slo_flags_name_a_summary_percentile_in_seconds():
    slo = parse_slo("tpot_p90=0.05")
    assert (slo.column, slo.limit_s) == ("tpot_s.p90", 0.05)
    assert slo.check({"tpot_s.p90": 0.04}) is None
    assert slo.check({"tpot_s.p90": 0.06}) == "tpot_p90 60 ms > 50 ms"


@pytest.mark.parametrize("text, message", [
    ("ttft_p95=0.5", "METRIC one of ttft_p50"), ("ttft_p99", "METRIC=SECONDS"), ("ttft_p99=-1", "positive"),
])
def test_bad_slo_flags_say_what_is_allowed(text, message):
    with pytest.raises(PlanError, match=message):
        parse_slo(text)


# ----------------------------------------------------------------------------- search algorithms

@pytest.mark.parametrize("threshold, start", [(37.3, 10.0), (37.3, 200.0), (0.9, 1.0)])
def test_highest_passing_brackets_then_bisects_to_the_tolerance(threshold, start):
    tried = []
    answer = highest_passing(lambda x: tried.append(x) or x <= threshold, start, 0.01, 1000, 0.01)
    assert threshold * 0.99 <= answer <= threshold
    assert len(tried) < 20


def test_highest_passing_reports_none_and_the_ceiling():
    assert highest_passing(lambda x: False, 4, 1, 64, 0.05) is None
    assert highest_passing(lambda x: True, 4, 1, 64, 0.05) == 64


@pytest.mark.parametrize("needed", [1, 2, 3, 7, 8, 13])
def test_fewest_passing_finds_the_smallest_count(needed):
    assert fewest_passing(lambda n: n >= needed, 64) == needed
    if needed > 1:
        assert fewest_passing(lambda n: n >= needed, needed - 1) is None


# ----------------------------------------------------------------------------- steady state

def test_steady_state_accepts_an_easy_rate_and_rejects_an_overload(scenario_file):
    def state(rate):
        return steady_state(predict(load_scenario(scenario_file, [f"workload.arrival.rate={rate}"])).requests)

    fine, overloaded = state(1), state(20)         # a fifth of capacity; four times it
    assert fine.sustainable and abs(fine.ttft_growth) < 0.01 and fine.ttft_ratio < 1.5
    assert not overloaded.sustainable and overloaded.ttft_growth > 0.5 and overloaded.ttft_ratio > 2
    assert fine.late_finish_rate == pytest.approx(1, rel=0.15) and overloaded.late_finish_rate < 8


def test_the_late_finish_rate_counts_a_draining_backlog_and_can_exceed_the_offered_rate():
    """steady_state's rate is finishes per second while the second half of the arrivals came in, not a
    served rate: 61 requests offered at 1/s over 60 s, the first 30 stalled until the second half, finish
    there with the second half's: 60 finishes between 30 s and 60 s, twice the offered rate."""
    arrival = [float(i) for i in range(61)]
    finish = [30.5 + i * 0.5 if i < 30 else a + 0.4 for i, a in enumerate(arrival)]
    frame = pd.DataFrame({"status": "finished", "is_warmup": False, "arrival_s": arrival,
                          "finish_s": finish, "ttft_s": [f - a for f, a in zip(finish, arrival)]})
    state = steady_state(frame)
    assert state.late_finish_rate == pytest.approx(60 / 30)
    assert not hasattr(state, "served_rate")


def test_traffic_keeps_the_arrival_window_at_every_rate():
    t = Traffic(rate=2, num_requests=120, warmup_requests=10)
    assert t.at(8) == {"workload.arrival.rate": 8, "workload.num_requests": 480, "workload.warmup_requests": 40}
    long = Traffic(rate=2, num_requests=1000, warmup_requests=100)
    assert long.at(1) == {"workload.arrival.rate": 1, "workload.num_requests": 500, "workload.warmup_requests": 50}
    # never fewer than MIN_PROBE_REQUESTS (100 here), so steady state can still be judged
    assert t.at(0.5)["workload.num_requests"] == 100 and t.at(0.5)["workload.warmup_requests"] == 2


def test_answer_economics_price_per_million_tokens_and_headroom():
    row = {"cost_per_hour": 3.6, "output_token_throughput": 1000.0, "gpus": 1,
           "ttft_s.p99": 0.05, "tpot_s.p99": 0.03}
    assert dollars_per_million_output_tokens(row) == pytest.approx(1.0)       # 3.6 $/h over 3.6M tok/h
    ttft, tpot = parse_slo("ttft_p99=0.2"), parse_slo("tpot_p99=0.02")
    assert headroom(ttft, row) == pytest.approx(0.75) and headroom(tpot, row) == pytest.approx(-0.5)
    text = answer_economics(row, [ttft])
    assert text.startswith("$1.00 per 1M output tokens (1 GPU at $3.60/hour") and "ttft_p99 50 ms of 200 ms (75.0% left)" in text


# ----------------------------------------------------------------------------- searches vs brute force

def test_rate_search_agrees_with_a_brute_force_grid(scenario_file):
    step = 0.5
    grid = [step * k for k in range(1, 17)]                      # 0.5 .. 8 req/s
    traffic = Traffic(2, 120, 10)
    passing = [r for r in grid if probe(scenario_file, traffic.at(r))["ok"]]
    brute = max(passing)
    assert passing == [r for r in grid if r <= brute]            # monotone on this case, so one answer
    curve = search_rate(base_task(scenario_file), traffic, SLOS, 0.01, 64, tolerance=0.02)
    assert abs(curve.knee - brute) <= step
    assert curve.at(curve.knee)["ok"] and not curve.limit()["ok"] and curve.limit()["rate"] > curve.knee


def test_replica_search_agrees_with_a_brute_force_sweep(scenario_file):
    target = 14.0
    traffic = Traffic(2, 120, 10)
    base = base_task(scenario_file)
    at_target = with_settings(base, {"device": "l4", "parallelism.tp": 1, **traffic.at(target)})
    brute = next(n for n in range(1, 9)
                 if run_probe((with_settings(at_target, {"cluster.replicas": n}), SLOS))["ok"])
    assert brute > 1
    plan = plan_replicas(base, traffic, SLOS, target, [Candidate("l4", 1, 0.8), Candidate("h100-sxm", 1, 2.9)],
                         most=16, jobs=1, ray=None, quiet=True)
    assert plan.answer(0)["replicas"] == brute
    table = plan.table
    assert list(table["device"]) == sorted(table["device"], key=lambda d: table.set_index("device")
                                           .loc[d, "$/hour"])          # cheapest first
    assert table.set_index("device").loc["l4", "$/hour"] == pytest.approx(brute * 0.8)


def test_a_candidate_that_cannot_exist_is_reported_not_run(scenario_file):
    plan = plan_replicas(base_task(scenario_file), Traffic(2, 120, 10), SLOS, 2.0,
                         [Candidate("l4", 3, 0.8)], most=4, jobs=1, ray=None, quiet=True)
    assert plan.table["why none"][0].startswith("invalid: parallelism.tp: 3 does not divide")


# ----------------------------------------------------------------------------- CLI

def test_plan_rate_cli_writes_the_curve_and_marks_the_knee(scenario_file, tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", str(scenario_file), "--slo", "ttft_p99=1", "--slo", "tpot_p99=0.1", "--out", str(out),
                 "--curve", "3", "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "Highest sustainable rate within ttft_p99 <= 1 s, tpot_p99 <= 100 ms:" in printed
    assert "per 1M output tokens" in printed and "headroom: ttft_p99" in printed
    assert "model" in (out / "plan.html").read_text() and 'class="setup"' in (out / "plan.html").read_text()
    curve = pd.read_csv(out / "plan.csv")
    assert list(curve.columns[:4]) == ["rate", "ok", "failed", "sustainable"]
    assert curve["rate"].is_monotonic_increasing and curve["ok"].any() and not curve["ok"].all()
    assert (out / "plan.png").stat().st_size > 10_000 and (out / "plan.html").exists()


def test_plan_rate_cli_prices_the_gpu_hour_with_cost(scenario_file, tmp_path, capsys):
    """--cost used to be ignored by the rate search: the answer kept the catalog's $0.80 for an L4."""
    out = tmp_path / "plan"
    assert main(["plan", str(scenario_file), "--cost", "l4=2", "--tolerance", "0.3", "--out", str(out),
                 "--jobs", "1"]) == 0
    assert "1 GPU at $2.00/hour" in capsys.readouterr().out
    curve = pd.read_csv(out / "plan.csv")
    assert (curve["cost_per_hour"] == 2.0).all()


def test_plan_replicas_cli_ranks_by_cost_with_prices_from_the_command_line(scenario_file, tmp_path):
    out = tmp_path / "plan"
    assert main(["plan", str(scenario_file), "--target-rate", "6", "--devices", "l4,h100-sxm",
                 "--cost", "h100-sxm=0.1", "--out", str(out), "--quiet", "--jobs", "2"]) == 0
    table = pd.read_csv(out / "plan.csv")
    assert table["device"][0] == "h100-sxm" and table["$/hour"][0] == pytest.approx(0.1)
    assert (out / "plan_probes.csv").exists() and (out / "plan.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--set", "workload.arrival.rate=1,2"], "plan searches one scenario"),
    (["--set", "workload.arrival={process: offline}"], "needs synthetic arrivals with a rate"),
    (["--target-rate", "5", "--devices", "l5"], "unknown device 'l5'"),
    (["--target-rate", "5", "--devices", "h100"], "--devices: unknown device 'h100'; did you mean 'h100-nvl'"),
    (["--target-rate", "5", "--cost", "l44=1"], "--cost: unknown device 'l44'; did you mean 'l4'"),
    (["--target-rate", "5", "--cost", "l4=nan"], "--cost 'l4=nan': expected DEVICE=PRICE"),
    (["--cost", "h100-sxm=1"], "--cost h100-sxm: the rate search runs on the scenario's device (l4)"),
    (["--target-rate", "5", "--tp", "0"], "--tp '0'"),
    (["--target-rate", "5", "--cost", "l4"], "DEVICE=PRICE"),
    (["--devices", "h100-sxm"], "--devices applies to the replica search: give --target-rate"),
    (["--tp", "2"], "--tp applies to the replica search"),
    (["--max-replicas", "4"], "--max-replicas applies to the replica search"),
    (["--target-rate", "5", "--curve", "3"], "--curve applies to the rate search"),
    (["--target-rate", "5", "--tolerance", "0.1"], "--tolerance applies to the rate search"),
    (["--target-rate", "5", "--max-rate", "9"], "--max-rate applies to the rate search"),
])
def test_plan_errors_name_the_flag(scenario_file, tmp_path, capsys, argv, message):
    assert main(["plan", str(scenario_file), "--out", str(tmp_path), "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err
