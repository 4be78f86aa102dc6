"""vLLM V0's async output processing: a step's tokens reach the client after the next step's host work.

vLLM 0.7.3 (V0 engine): vllm/engine/llm_engine.py `LLMEngine.step` hands the processing of the
step's outputs to the next step as `async_callback` (`async_callbacks`, `output_queue`), which
vllm/worker/model_runner.py `ModelRunner.execute_model` calls right after it launches the next
step's forward; vllm/engine/async_llm_engine.py puts the outputs on the request streams from that
processing (`process_request_outputs_callback`), and when no request is left unfinished the engine
drains the queue at once. vllm/platforms/cuda.py `is_async_output_supported` turns it off under
--enforce-eager. AccelMark's TTFT (runners/nvidia_vllm_47f5d58e/runner.py) is the first output of
`engine.generate` carrying a token, so it ends there.

AccelMark awaits `engine.generate` on the engine's own asyncio loop (engine.client_in_process), and
there the outputs wait longer (vLLM 0.7.3): vllm/executor/executor_base.py `execute_model_async`
runs each step in an executor thread (`make_async`: `run_in_executor`), whose async callback puts
them on the streams from that thread (vllm/engine/async_llm_engine.py `AsyncStream.put`:
`asyncio.Queue.put_nowait`, whose waiter is scheduled with `call_soon`, which wakes no loop blocked in
`select`); the loop wakes when the step's future completes (`call_soon_threadsafe`) or at a timer,
AccelMark's load generator sleeping until each send (loadgen/loadgen.py `_run_online_async`).
`vllm serve` sends them from the callback (vllm/engine/multiprocessing/engine.py
`_async_socket_engine_callback`): the next step's host work, as above.
"""
from __future__ import annotations

import numpy as np
import pytest

from sim.core.memory import plan_memory
from sim.core.request import make_request
from sim.core.vllm_versions import has
from sim.costmodel import CostModel
from sim.records import StepRecorder, requests_frame
from sim.scenario import validate_scenario
from sim.simulator import Simulation, simulate


def scenario(version="0.7.3", n=1, step_times="trained", **engine):
    return validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm", "step_times": step_times,
                              "engine": {"num_blocks": 512, "max_model_len": 256, "vllm_version": version,
                                         "front_end_s": 0, **engine},
                              "workload": {"num_requests": n, "prompt_len": 64, "output_len": 4,
                                           "arrival": {"process": "offline"}}})


def run(s):
    records = simulate(s)[0]
    return requests_frame(records).sort_values("id").reset_index(drop=True), records.steps_frame()


def test_the_releases_with_async_output_processing():
    assert has("0.6.0", "v0_async_output_processing") and has("0.7.3", "v0_async_output_processing")
    assert not has("0.5.5", "v0_async_output_processing")
    assert has("0.8.3", "v0_async_output_processing")               # the V0 engine of 0.8-0.10 has it
    assert scenario().tokens_after_next_host
    assert not scenario(enforce_eager=True).tokens_after_next_host
    assert not scenario("0.11.0").tokens_after_next_host
    assert not scenario("0.9.2").tokens_after_next_host                  # V1 by default there
    assert scenario("0.9.2", vllm_engine="v0").tokens_after_next_host    # VLLM_USE_V1=0: V0's engine
    assert not scenario("0.7.3", vllm_engine="v1").tokens_after_next_host


def test_pipeline_parallel_turns_it_off():
    """vllm/config.py ModelConfig.verify_async_output_proc (0.7.3): pipeline_parallel_size > 1
    sets use_async_output_proc False, before the platform check."""
    assert not scenario(pipeline_parallel_size=2).tokens_after_next_host


def test_token_times_add_the_next_steps_host_time_where_one_follows_at_once():
    rec = three_steps()
    # step 0 is followed at once by step 1 (its host 0.5); step 1 by nothing until 3.0; the last by none
    assert rec.token_times().tolist() == [1.5, 2.0, 4.0]
    rec.tokens_after_next_host = False
    assert rec.token_times().tolist() == [1.0, 2.0, 4.0]


def three_steps() -> StepRecorder:
    rec = StepRecorder()
    rec.tokens_after_next_host = True

    class Batch:
        def __init__(self, step):
            self.step, self.num_decode, self.num_prefill_tokens = step, 1, 0
            self.prefills, self.preempted, self.prefill_ctx, self.prefill_attn = [], [], 0, 0
            self.decode_ctx, self.blocks_read = 1, 1

    class Sched:
        running, waiting = [1], []

    for step, (start, end, host) in enumerate([(0.0, 1.0, 0.25), (1.0, 2.0, 0.5), (3.0, 4.0, 0.125)]):
        rec.record(Batch(step), Sched(), start, end, host, (end - start) - host, 0, 0, 0)
    return rec


@pytest.mark.parametrize("wakes,expected", [
    ([], [2.0, 2.0, 4.0]),              # the loop wakes at the next step's end only
    ([0.2, 1.2, 2.5], [2.0, 2.0, 4.0]),  # before the outputs were put (1.5), or after the next step's end
    ([1.5], [1.5, 2.0, 4.0]),           # a send just as they are put
    ([1.7, 1.9], [1.7, 2.0, 4.0]),      # the first send after they are put
])
def test_an_in_process_client_sees_the_tokens_when_its_loop_wakes(wakes, expected):
    rec = three_steps()
    rec.loop_wakes = np.array(wakes, dtype=float)
    assert rec.token_times().tolist() == expected


def test_only_v0_with_async_output_processing_waits_for_the_clients_loop():
    assert scenario(client_in_process=True).tokens_at_loop_wake
    assert not scenario().tokens_at_loop_wake                                   # vllm serve
    assert not scenario(client_in_process=True, enforce_eager=True).tokens_at_loop_wake
    assert not scenario("0.11.0", client_in_process=True).tokens_at_loop_wake    # V1


def in_process_run(sends: list[float]):
    s = scenario(client_in_process=True)
    requests = [make_request(i, t, [(f"p{i}", 64)], 4) for i, t in enumerate(sends)]
    records = Simulation(s, requests, plan_memory(s), CostModel.for_scenario(s)).run()
    return requests_frame(records).sort_values("id").reset_index(drop=True), records.steps_frame()


def test_an_in_process_clients_first_token_waits_for_the_next_steps_end_or_a_send():
    """One request: its first token (the prefill step's) reaches the client at the end of the
    decode step that follows (vllm serve's: once that step's host work is done). A second request
    sent during that step's forward wakes the loop then, and the first token arrives with it."""
    alone, steps = in_process_run([0.0])
    served, _ = run(scenario())
    assert steps["start_s"].iloc[1] == steps["end_s"].iloc[0]
    assert alone["first_token_s"][0] == steps["end_s"].iloc[1]
    assert served["first_token_s"][0] == steps["end_s"].iloc[0] + steps["host_s"].iloc[1]
    assert alone["first_token_s"][0] > served["first_token_s"][0]
    put = steps["start_s"].iloc[1] + steps["host_s"].iloc[1]
    send = (put + steps["end_s"].iloc[1]) / 2
    woken, woken_steps = in_process_run([0.0, send])
    assert np.allclose(woken_steps["end_s"].iloc[:2], steps["end_s"].iloc[:2])   # steps 0 and 1 the same
    assert woken["first_token_s"][0] == send


def test_v0_first_token_waits_for_the_next_steps_host_work():
    """One request on vLLM 0.7.3: its first token (prefill step) reaches the client when the
    following decode step's host work is done; under --enforce-eager at the prefill's end. The
    steps themselves are the same at the datasheet's prices (the trained V0 entries' eager launch
    term prices every --enforce-eager step higher: tests/sim/test_v0_eager_prefill.py)."""
    on, on_steps = run(scenario(step_times="datasheet"))
    off, off_steps = run(scenario(step_times="datasheet", enforce_eager=True))
    assert np.allclose(on_steps["end_s"], off_steps["end_s"])
    assert on_steps["start_s"].iloc[1] == on_steps["end_s"].iloc[0]
    assert on["ttft_s"][0] == off["ttft_s"][0] + on_steps["host_s"].iloc[1]
    # the last token: no request left unfinished, so it is drained at its step's end
    assert on["e2e_s"][0] == off["e2e_s"][0]


def test_v1_releases_deliver_at_the_steps_end():
    frame, steps = run(scenario("0.11.0"))
    first = steps["end_s"].iloc[0]
    assert frame["first_token_s"][0] == first
