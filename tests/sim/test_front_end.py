"""vLLM's API-server front end (sim/front_end.py, engine.front_end_s).

What the API-server process does per request, in vLLM 0.19.1 (the wheel from the package registry):
vllm/entrypoints/openai/chat_completion/serving.py `create_chat_completion` renders the chat template
and tokenizes (`render_chat_request`), then `engine_client.generate` (vllm/v1/engine/async_llm.py
`generate` -> `add_request` -> `input_processor.process_inputs`) hands the request to the engine core,
all on the process's one asyncio loop; `--api-server-count` (vllm/entrypoints/cli/serve.py
`ServeSubcommand.cmd`: 1 without data parallelism, the dp size under internal balancing) sets how
many such processes take requests (`run_multi_api_server`, SO_REUSEPORT in
vllm/entrypoints/openai/api_server.py). kvtwin prices them as a FIFO over that many servers with
one service time per request before the router.

The same loop streams the outputs (engine.front_end_token_s, engine.front_end_step_s), in vLLM
0.11.0 (the wheel from the package registry): AsyncLLM's output handler task
(vllm/v1/engine/async_llm.py `_run_output_handler`) takes each engine step's outputs off the engine
core's socket and runs `OutputProcessor.process_outputs` (vllm/v1/engine/output_processor.py: per
request its detokenizer's `update` and a RequestOutput put in the request's RequestOutputCollector),
and each request's `chat_completion_stream_generator` (vllm/entrypoints/openai/serving_chat.py), a
task of its own woken by that collector, writes one SSE chunk (`chunk.model_dump_json`) per output
it takes, on that one loop. A collector merges what is put into it before its stream runs
(`RequestOutputCollector.put`, the same in vLLM 0.19.1), and the handler drains every queued step
before it yields (`await self.outputs_queue.get()` in core_client.py `get_output_async` returns at
once while one is queued): steps due before the loop reaches them stream as one chunk per request.
"""
from __future__ import annotations

import pytest

from sim.front_end import FrontEnd, front_end_s, front_end_step_s, front_end_token_s
from sim.errors import ScenarioError
from sim.records import requests_frame
from sim.scenario import validate_scenario
from sim.simulator import Simulation, simulate

SERVICE = 0.25          # exact in binary: the recurrence's sums are exact too


def scenario(front=None, n=8, token=None, **workload):
    engine = {"num_blocks": 512, "max_model_len": 256}
    if front is not None:
        engine["front_end_s"] = front
    if token is not None:
        engine["front_end_token_s"] = token
    return validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm", "engine": engine,
                              "workload": {"num_requests": n, "prompt_len": 16, "output_len": 4,
                                           "arrival": {"process": "offline"}, **workload}})


def frame(s, chain=True, fast=True):
    old = Simulation.chain
    Simulation.chain = chain
    try:
        return requests_frame(simulate(s, fast=fast)[0]).sort_values("id").reset_index(drop=True)
    finally:
        Simulation.chain = old


def test_one_server_is_the_fifo_recurrence():
    """A burst of N at t=0 through one API server with service c leaves at c, 2c, ..., N*c
    (start = max(arrival, previous finish)); a later arrival to an idle server waits only c."""
    front = FrontEnd(1, SERVICE)
    assert [front.admit(0.0) for _ in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert front.admit(5.0) == 5.25 and front.admit(5.1) == 5.5
    two = FrontEnd(2, SERVICE)
    assert [two.admit(0.0) for _ in range(4)] == [0.25, 0.25, 0.5, 0.5]


def test_a_burst_waits_in_the_front_end_and_ttft_counts_it():
    n = 8
    base, fronted = frame(scenario(0.0, n)), frame(scenario(SERVICE, n))
    # the last request reaches the engine at N x c; each request's TTFT counts its wait from t=0
    assert (fronted["arrival_s"] == 0).all()
    for i, row in fronted.iterrows():
        assert row["ttft_s"] >= (i + 1) * SERVICE
        assert row["ttft_s"] - (i + 1) * SERVICE < 0.01          # then one prefill of 16 tokens
        assert row["e2e_s"] >= row["ttft_s"]
    assert fronted["ttft_s"].max() == pytest.approx(n * SERVICE, abs=0.01)
    assert base["ttft_s"].max() < SERVICE                          # without it: all prefilled at once
    assert len(fronted) == n and (fronted["status"] == base["status"]).all()   # every request finished


def test_the_chained_and_the_step_by_step_paths_agree():
    s = scenario(SERVICE, 6)
    a, b = frame(s, chain=True), frame(s, chain=False)
    assert (a[["ttft_s", "e2e_s"]].to_numpy() == b[["ttft_s", "e2e_s"]].to_numpy()).all()


def test_a_closed_loop_client_sends_then_waits_in_the_front_end():
    """Concurrency 2: the third request is sent when the first finishes, and queues behind the
    second in the API server (which the client's semaphore does not see)."""
    t = frame(scenario(SERVICE, 4, max_concurrency=2))
    assert list(t["ttft_s"].round(2))[:2] == [0.25, 0.5]
    third = t.iloc[2]
    assert third["arrival_s"] > 0                                 # sent at the first one's finish
    assert third["arrival_s"] + third["ttft_s"] >= 0.75            # left the front end after the second
    assert (t["status"] == t["status"].iloc[0]).all() and len(t) == 4


def test_the_field_is_bounded_and_named():
    for bad in (-0.001, 1.5, "fast"):
        with pytest.raises(ScenarioError, match="engine.front_end_s"):
            scenario(bad)
    with pytest.raises(ValueError, match="at least one API server"):
        FrontEnd(0, SERVICE)


def test_zero_is_no_front_end_and_changes_nothing(monkeypatch):
    """0 builds no front end: the same requests, the same records as before the term existed
    (the arrival path takes no admit call)."""
    import sim.trained

    assert FrontEnd.for_scenario(scenario(0.0)) is None
    monkeypatch.setattr(sim.trained, "front_end_default", lambda engine, name="front_end_s": 0.0)
    unset, zero = frame(scenario(None, 5, arrival={"process": "poisson", "rate": 50})), \
        frame(scenario(0.0, 5, arrival={"process": "poisson", "rate": 50}))
    assert unset.equals(zero)


def test_the_default_is_the_families_value_on_a_vllm_server_whatever_the_step_time_source(monkeypatch):
    """Unset: a vLLM server (continuous, paged) takes the family's pooled fit for its engine
    generation under every step-time source, since every source's error band is measured with it
    (validate/lodo.py replays); static batching and V0 (no fitted value) get 0; a set value wins."""
    import sim.trained

    monkeypatch.setattr(sim.trained, "front_end_default",
                        lambda engine, name="front_end_s": {"v1": 0.003, "v0": 0.0}[engine] if name == "front_end_s" else 0.0)

    def made(engine=None, step_times="trained"):
        return validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm", "engine": engine or {},
                                  "step_times": step_times})

    assert front_end_s(made()) == 0.003 == front_end_s(made(step_times="datasheet")) == front_end_s(scenario())
    assert front_end_s(made(step_times="tables")) == 0.003
    assert front_end_s(made({"batching": "static"})) == 0.0
    assert front_end_s(made({"allocation": "contiguous"}, "datasheet")) == 0.0
    assert front_end_s(made({"vllm_version": "0.7.3"})) == 0.0
    assert front_end_s(made({"front_end_s": 0.001}, "datasheet")) == 0.001
    assert front_end_s(made({"front_end_s": 0.0})) == 0.0


def test_a_calibrated_profile_and_its_fit_run_without_the_pooled_front_end(monkeypatch, tmp_path):
    """A device profile carries the server's own fitted host and API-server terms, and the fit that
    wrote it replays without the pooled time (validate/vllm_fit.py without_default_front_end)."""
    import sim.trained
    from validate.vllm_fit import without_default_front_end

    monkeypatch.setattr(sim.trained, "front_end_default",
                        lambda engine, name="front_end_s": 0.003 if name == "front_end_s" else 0.0)
    profile = tmp_path / "mine.yaml"
    profile.write_text("coefficients: {}\n")
    raw = {"model": "qwen2.5-0.5b", "device": {"base": "h100-sxm", "profile": str(profile)}}
    assert front_end_s(validate_scenario(raw)) == 0.0
    assert front_end_s(validate_scenario({**raw, "engine": {"front_end_s": 0.002}})) == 0.002
    served = scenario()
    assert front_end_s(served) == 0.003 and front_end_s(without_default_front_end(served)) == 0.0
    assert without_default_front_end(scenario(0.002)).engine.front_end_s == 0.002


def test_kvtwins_own_engine_replays_have_no_front_end():
    """validate/run.py predicts the Triton engine's replays: requests handed over in-process."""
    from validate.run import synchronous

    assert synchronous(scenario(0.004)).engine.front_end_s == 0.0
    assert synchronous(scenario(None)).engine.front_end_s == 0.0


def test_from_vllm_api_server_count_sets_the_front_ends_servers():
    """`simrun from-vllm`: --api-server-count / -asc lands in parallelism.api_servers (vLLM 0.19.1
    vllm/entrypoints/cli/serve.py), the front end's capacity; unset, one server without dp."""
    from sim.vllm.serve_flags import translate

    raw = translate("vllm serve qwen2.5-0.5b --api-server-count 3", "h100-sxm").raw
    assert raw["parallelism"]["api_servers"] == 3
    raw.setdefault("engine", {})["front_end_s"] = SERVICE
    three = FrontEnd.for_scenario(validate_scenario({**raw, "model": "qwen2.5-0.5b", "device": "h100-sxm"}))
    assert [three.admit(0.0) for _ in range(4)] == [0.25, 0.25, 0.25, 0.5]
    one = FrontEnd.for_scenario(scenario(SERVICE))
    assert [one.admit(0.0) for _ in range(2)] == [0.25, 0.5]


def test_a_cluster_pools_its_replicas_api_servers():
    s = validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm", "engine": {"front_end_s": SERVICE},
                           "cluster": {"replicas": 2}})
    front = FrontEnd.for_scenario(s)
    assert [front.admit(0.0) for _ in range(3)] == [0.25, 0.25, 0.5]


def test_the_public_vllm_replays_go_through_the_api_server_and_a_fold_never_fits_on_its_own_runs(monkeypatch):
    """validate/lodo.py: every public V1 run was sent over HTTP to `vllm serve` (vllm bench serve,
    benchmark_serving, inference-perf), so its replay takes the fold's front end; AccelMark's V0 runs
    call engine.generate in the benchmark's process and take none. The pooled value of a fold is
    fitted on the other deployments' runs only."""
    import numpy as np

    from sim.costmodel import CostCoefficients
    from validate import lodo

    runs, _ = lodo.all_runs()
    by_id = {r.id: r for r in runs}
    chat = by_id["gpustack-gpt-oss-20b-h100-07"]          # 1000 x 128/4, all at once
    assert chat.api_server and chat.scenario.engine.front_end_s == 0.0
    assert not any(r.api_server for r in runs if r.engine == "v0")
    plain, fronted = lodo.predict(chat, CostCoefficients()), lodo.predict(chat, CostCoefficients(), front_end_s=0.004)
    assert fronted["ttft_mean"] > plain["ttft_mean"]
    assert 1000 / fronted["throughput"] >= 1000 * 0.004       # the intake alone takes N x c
    v0 = next(r for r in runs if r.engine == "v0")
    assert lodo.predict(v0, CostCoefficients(), front_end_s=0.004) == lodo.predict(v0, CostCoefficients())

    seen = []
    intake = np.array(lodo.FRONT_END_GRID)

    def profile(run, best=0.0042):
        seen.append(run.deployment)
        return (intake - best) ** 2         # every run's loss lowest at `best` per request

    monkeypatch.setattr(lodo, "front_end_profile", profile)
    monkeypatch.setattr(lodo, "_FRONT_ENDS", {})
    held = chat.deployment
    assert lodo.pooled_front_end(runs, held) == pytest.approx(0.0042, abs=1e-7)
    assert seen and held not in seen and all(lodo.deployment_engine(d) == "v1" for d in seen)
    # between grid points: the parabola's vertex; past the grid's end: its bound
    monkeypatch.setattr(lodo, "front_end_profile", lambda run: profile(run, 0.0017))
    monkeypatch.setattr(lodo, "_FRONT_ENDS", {})
    assert lodo.pooled_front_end(runs) == pytest.approx(0.0017, abs=1e-9)
    monkeypatch.setattr(lodo, "front_end_profile", lambda run: -intake)
    monkeypatch.setattr(lodo, "_FRONT_ENDS", {})
    assert lodo.pooled_front_end(runs) == lodo.FRONT_END_BOUNDS[1]


TOKEN = 2 ** -7          # per streamed token, exact in binary


def test_a_steps_outputs_hold_the_loop_first_come_first_served_with_the_intake():
    """One API server: a step's outputs are one job of (requests given a token) x token_s on the
    loop, served in time order with the intake (the output handler and the request handlers share
    vLLM's asyncio loop: vllm 0.11.0 vllm/v1/engine/async_llm.py `_run_output_handler`,
    vllm/v1/engine/output_processor.py `process_outputs`, vllm/entrypoints/openai/serving_chat.py
    `chat_completion_stream_generator`). Outputs due before a handover delay its intake; outputs
    due after it wait for it; the tokens reach the client when their job is done. Steps of a replica
    due by the time the loop reaches them stream as one job, one chunk per request (vllm 0.11.0
    output_processor.py `RequestOutputCollector.put` merges the outputs its stream has not taken)."""
    front = FrontEnd(1, SERVICE, TOKEN)
    front.outputs(0, (1.0,), 32)                      # 32 tokens x 1/128 s from t=1
    assert front.admit(1.0) == 1.5                    # due at the handover: served first, 1.0-1.25
    front.outputs(0, [2.0, 2.125], 16)                # a leap's two steps
    front.outputs(1, (2.0,), 8)                       # another replica's step, same end: after replica 0's
    assert front.admit(1.875) == 2.125                # handed over before them: not delayed
    # the loop reaches replica 0's outputs at 2.125, when both its steps are due: one job of 16
    # chunks, then replica 1's, then the intake
    assert front.admit(2.2) == 2.125 + 0.125 + 0.0625 + SERVICE
    assert front.delivered(0) == [1.25, 2.25, 2.25] and front.delivered(1) == [2.3125]
    assert FrontEnd(1, SERVICE).token_s == 0.0 and not FrontEnd(1, SERVICE).streams
    for bad in (-1e-6, 0.02, float("nan")):
        with pytest.raises(ValueError, match="time per token"):
            FrontEnd(1, SERVICE, bad)
        with pytest.raises(ValueError, match="time per step"):
            FrontEnd(1, SERVICE, 0.0, bad)


def test_the_handlers_pass_over_each_step_is_priced_per_step_and_never_merged():
    """engine.front_end_step_s: the output handler's pass over one step's message (vllm 0.11.0
    vllm/v1/engine/async_llm.py `output_handler`: `get_output_async`, `process_outputs` over the
    step's outputs, its IterationStats and `logger_manager.record`, once per EngineCoreOutputs)
    is paid per step, merged or not; alone (no time per token) it streams too."""
    step = 2 ** -7
    front = FrontEnd(1, SERVICE, TOKEN, step)
    front.outputs(0, [1.0, 1.125, 1.25], 8)           # three steps of 8 requests
    assert front.admit(1.0) == 1.0 + step + 8 * TOKEN + SERVICE     # the first step alone: the others not due yet
    assert front.admit(2.0) == 2.0 + SERVICE                        # the other two merged, done by then
    # the intake ended at 1.3125 + step; the two steps' job then: two passes, 8 chunks
    assert front.delivered(0) == [1.0 + step + 0.0625] + [1.3125 + step + 2 * step + 0.0625] * 2
    alone = FrontEnd(1, SERVICE, 0.0, step)
    assert alone.streams
    alone.outputs(0, (1.0,), 100)
    assert alone.admit(1.0) == 1.0 + step + SERVICE


def test_a_loop_slower_than_the_engine_streams_fewer_larger_chunks_and_its_intake_waits_boundedly():
    """A step of 100 requests every 10 ms whose streaming takes 100 ms (1 ms a chunk): first come,
    first served with a job per step, the loop would fall 90 ms further behind every step and the
    intake behind it with no bound. vLLM's loop does not: while it is busy the steps' outputs
    accumulate in each request's RequestOutputCollector (vllm 0.11.0 and 0.19.1
    vllm/v1/engine/output_processor.py `put`: merged when the producer gets ahead of the consumer)
    and its stream then writes them as one chunk (vllm/entrypoints/openai/serving_chat.py
    `chat_completion_stream_generator` takes one merged RequestOutput), so every request handed
    over waits for at most the job in progress and one more."""
    front = FrontEnd(1, 0.001, 0.001)
    waits, due = [], []
    for i in range(400):                               # a handover every 50 ms for 20 s
        t = i * 0.05
        steps = [t - 0.05 + k * 0.01 for k in range(1, 6)] if i else []
        front.outputs(0, steps, 100)
        due += steps
        waits.append(front.admit(t) - t)
    # at most the round in progress and the next one (100 ms each) and a few intakes; no growth
    assert max(waits) <= 2 * 0.1 + 0.005
    assert max(waits[200:]) <= max(waits[:200]) + 1e-9
    done = front.delivered(0)
    assert len(done) == len(due) and max(d - t for d, t in zip(done, due)) <= 0.3


def test_the_token_and_step_fields_are_bounded_and_named():
    for bad in (-0.001, 0.02, float("inf"), "fast"):
        with pytest.raises(ScenarioError, match="engine.front_end_token_s"):
            scenario(SERVICE, token=bad)
        with pytest.raises(ScenarioError, match="engine.front_end_step_s"):
            validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm",
                               "engine": {"front_end_s": SERVICE, "front_end_step_s": bad}})
    assert scenario(SERVICE, token=0.01).engine.front_end_token_s == 0.01


def test_a_burst_takes_its_intake_first_and_its_tokens_wait_behind_it():
    """All at once through one server: every handover (t=0) precedes every step's outputs, so the
    intake is N x c as without streaming, and the first tokens reach the client only after the
    last intake, each step's job after the previous one's."""
    n = 4
    plain, streamed = frame(scenario(SERVICE, n)), frame(scenario(SERVICE, n, token=TOKEN))
    assert (plain["ttft_s"].iloc[:n - 1] < n * SERVICE).all()      # each first token right after its intake
    assert (streamed["ttft_s"] > n * SERVICE).all()
    # the first request's first token: its prefill step's job (one token) after the 4 intakes
    assert streamed["ttft_s"].min() == n * SERVICE + TOKEN
    assert (streamed["e2e_s"] > plain["e2e_s"]).all() and (streamed["status"] == plain["status"]).all()


def test_outputs_before_a_handover_delay_its_intake():
    """Two requests 0.26 s apart: the first one's outputs (its prefill step's, 1/128 s from its
    end just after 0.25 s, then its three decode steps', shorter than that and so all due when the
    loop is free again: one merged chunk, 1/128 s) still hold the loop at its handover, so the
    second's intake starts when they are done."""
    gaps = {"arrival": {"process": "fixed", "rate": 1 / 0.26}}
    plain, streamed = frame(scenario(SERVICE, 2, **gaps)), frame(scenario(SERVICE, 2, token=TOKEN, **gaps))
    assert streamed["arrival_s"].equals(plain["arrival_s"])
    first, second = plain["arrival_s"]
    prefilled = first + plain["ttft_s"].iloc[0]            # the first one's prefill step's end
    assert first + SERVICE < prefilled < second < prefilled + 2 * TOKEN
    assert plain["ttft_s"].iloc[1] < SERVICE + 0.01        # without streaming: the loop is free at once
    assert second + streamed["ttft_s"].iloc[1] >= prefilled + 2 * TOKEN + SERVICE


@pytest.mark.parametrize("workload", [
    {"arrival": {"process": "poisson", "rate": 40}},
    {"arrival": {"process": "offline"}},
    {"arrival": {"process": "offline"}, "max_concurrency": 8},
])
@pytest.mark.parametrize("token", [2e-4, 3e-3])
def test_leaps_chains_and_single_steps_stream_alike(workload, token):
    """The simulator reports each step's outputs as it plans it and a leap's steps at once; the
    loop serves a round only once every step due before the next handover is known (a step due by
    a round's start and reported after it joins that round), so the chained, the step-by-step
    (SimPy-clocked) and the reference (no leaps) paths give the same figures, the loop keeping up
    (2e-4 s a chunk) or not (3e-3 s: a step's chunks outlast it, rounds merge several steps)."""
    raw = {"model": "qwen2.5-0.5b", "device": "h100-sxm", "seed": 3,
           "engine": {"num_blocks": 2048, "max_model_len": 1024, "front_end_s": 0.002, "front_end_token_s": token,
                      "front_end_step_s": 1e-4},
           "workload": {"num_requests": 120, "prompt_len": 64, "output_len": 120, **workload}}
    s = validate_scenario(raw)
    a, b, c = frame(s), frame(s, chain=False), frame(s, fast=False)
    cols = ["arrival_s", "ttft_s", "e2e_s", "tpot_s"]
    assert a[cols].equals(b[cols]) and a[cols].equals(c[cols])
    off = frame(validate_scenario({**raw, "engine": {**raw["engine"], "front_end_token_s": 0.0,
                                                     "front_end_step_s": 0.0}}))
    assert (a["e2e_s"] > off["e2e_s"]).all()


def test_a_poisson_run_whose_loop_cannot_stream_every_step_keeps_a_bounded_ttft():
    """40 requests/s of 120 tokens each on a 0.5B model (steps well under a millisecond) with 3 ms a
    chunk: a job per step, first come, first served, would put every handover behind a growing
    backlog (tens of running requests x 3 ms per sub-millisecond step); with the chunks a stream
    has not written merged (vllm 0.11.0 vllm/v1/engine/output_processor.py
    `RequestOutputCollector.put`) the last requests wait no longer than the first ones."""
    raw = {"model": "qwen2.5-0.5b", "device": "h100-sxm", "seed": 3,
           "engine": {"num_blocks": 2048, "max_model_len": 1024, "front_end_s": 0.002, "front_end_token_s": 3e-3},
           "workload": {"num_requests": 120, "prompt_len": 64, "output_len": 120,
                        "arrival": {"process": "poisson", "rate": 40}}}
    ttft = frame(validate_scenario(raw))["ttft_s"]
    assert ttft.max() < 0.25 and ttft.iloc[-30:].median() < 1.5 * ttft.iloc[:30].median()


def test_a_token_time_of_zero_changes_nothing(monkeypatch):
    """0 (or unset with no fitted value) reports no outputs: the records of the intake-only front end."""
    import sim.trained

    monkeypatch.setattr(sim.trained, "front_end_default", lambda engine, name="front_end_s": 0.0)
    poisson = {"arrival": {"process": "poisson", "rate": 50}}
    assert frame(scenario(SERVICE, 5, **poisson)).equals(frame(scenario(SERVICE, 5, token=0.0, **poisson)))
    assert FrontEnd.for_scenario(scenario(SERVICE, token=0.0)).token_s == 0.0


def test_the_token_and_step_defaults_follow_the_front_ends_rule(monkeypatch, tmp_path):
    """Unset: the family's fitted value on a vLLM server (continuous, paged) without a device
    profile, else 0; a set value wins."""
    import sim.trained

    monkeypatch.setattr(sim.trained, "front_end_default",
                        lambda engine, name: {"front_end_token_s": {"v1": 4e-5, "v0": 0.0},
                                              "front_end_step_s": {"v1": 3e-4, "v0": 0.0}}.get(name, {}).get(engine, 0.0))

    def made(engine=None, **raw):
        return validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm", "engine": engine or {}, **raw})

    assert front_end_token_s(made()) == 4e-5 == front_end_token_s(made(step_times="datasheet"))
    assert front_end_token_s(made({"batching": "static"})) == 0.0
    assert front_end_token_s(made({"vllm_version": "0.7.3"})) == 0.0
    assert front_end_token_s(made({"front_end_token_s": 1e-5})) == 1e-5
    profile = tmp_path / "mine.yaml"
    profile.write_text("coefficients: {}\n")
    assert front_end_token_s(made(device={"base": "h100-sxm", "profile": str(profile)})) == 0.0
    # the handler's time per step: the same rule (one resolver, sim/front_end.py `_resolved`)
    assert front_end_step_s(made()) == 3e-4 and front_end_step_s(made({"vllm_version": "0.7.3"})) == 0.0
    assert front_end_step_s(made({"front_end_step_s": 1e-4})) == 1e-4
    assert front_end_step_s(made(device={"base": "h100-sxm", "profile": str(profile)})) == 0.0
