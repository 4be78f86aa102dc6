"""Load shapes as vLLM's benchmark client makes them: a closed loop (--max-concurrency) and ramp-up."""
from __future__ import annotations

import numpy as np
import pytest

from sim.predict import predict
from sim.scenario import validate_scenario
from sim.workload import build_workload


def _scenario(**workload):
    base = {"num_requests": 24, "arrival": {"process": "offline"}, "prompt_len": 64, "output_len": 16}
    return validate_scenario({"model": "tiny", "device": "cpu", "seed": 3,
                              "engine": {"num_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256},
                              "workload": {**base, **workload}})


def test_closed_loop_keeps_at_most_n_in_flight_and_sends_on_finishes():
    run = predict(_scenario(max_concurrency=3))
    df = run.requests.sort_values("arrival_s")
    # the first three go at t=0; each later one is sent when an earlier one finishes
    assert (df["arrival_s"].iloc[:3] == 0).all()
    finishes = set(np.round(df["finish_s"], 12))
    assert all(round(t, 12) in finishes for t in df["arrival_s"].iloc[3:])
    events = sorted([(t, 1) for t in df["arrival_s"]] + [(t, -1) for t in df["finish_s"]], key=lambda e: (e[0], e[1]))
    in_flight = np.cumsum([d for _, d in events])
    assert in_flight.max() == 3
    assert (run.steps["running"] + run.steps["waiting"]).max() <= 3         # the server never sees more
    open_loop = predict(_scenario())
    assert open_loop.steps["running"].max() == 8
    # TTFT counts from the send, so the closed loop's is lower even though its run is longer
    assert run.summary["ttft_s"]["mean"] < open_loop.summary["ttft_s"]["mean"]
    assert run.summary["duration_s"] > open_loop.summary["duration_s"]


def test_closed_loop_frees_the_slot_of_a_rejected_request():
    s = _scenario(max_concurrency=1, prompt_len={"dist": "uniform", "min": 32, "max": 900})
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"max_model_len": 512})})
    run = predict(s)
    assert (run.requests["status"] == "rejected").any() and (run.requests["status"] == "finished").any()


def test_linear_and_exponential_ramp_up_follow_vllm():
    fixed = _scenario(arrival={"process": "fixed", "ramp_up": {"strategy": "linear", "start_rps": 1,
                                                                  "end_rps": 24}})
    times = [r.arrival for r in build_workload(fixed).requests]
    rates = 1 + 23 * np.arange(24) / 23
    assert times == pytest.approx(np.cumsum(1 / rates).tolist())
    exp = _scenario(num_requests=400, arrival={"process": "poisson", "ramp_up": {"strategy": "exponential",
                                                                                  "start_rps": 2, "end_rps": 200}})
    gaps = np.diff([0.0] + [r.arrival for r in build_workload(exp).requests])
    assert gaps[:100].mean() > 5 * gaps[-100:].mean()          # the rate rises a hundredfold


@pytest.mark.parametrize("process", ["offline", "vidur_poisson"])
def test_ramp_up_needs_a_process_that_draws_its_gaps(process):
    # vidur_poisson is Vidur's constant-rate stream from its own seed: with a ramp it silently drew
    # numpy's exponential gaps instead (found by h/audit)
    with pytest.raises(ValueError, match=f"ramp_up needs an arrival process \\(poisson, gamma or fixed\\), not {process}"):
        _scenario(arrival={"process": process, "ramp_up": {"strategy": "linear", "start_rps": 1, "end_rps": 2}})


def test_ramp_up_needs_a_request_count():
    with pytest.raises(ValueError, match="ramp_up needs num_requests"):
        validate_scenario({"model": "tiny", "device": "cpu", "workload": {
            "duration_s": 10, "num_requests": None,
            "arrival": {"process": "poisson", "ramp_up": {"strategy": "linear", "start_rps": 1, "end_rps": 2}}}})
