"""vLLM V0 launches a step eagerly: `eager_layer_host_s` per layer, beyond the device time.

vLLM 0.7.3 vllm/worker/model_runner.py `ModelInputForGPUBuilder._use_captured_graph`: a batch runs its
captured CUDA graph only when it is decode-only, not under --enforce-eager, no larger than
max_batchsize_to_capture (vllm/config.py VllmConfig._set_cudagraph_sizes) and with no context past
max_seq_len_to_capture, so a V0 prefill step (V0's
steps are all prefills or all decodes), and any such step, launches every layer's kernels from Python
one by one. The GPU runs each kernel as it is launched: the launches show only where they take
longer than the kernels (a small model's prefill), not under a large model's GEMMs. The coefficient is
0 unless fitted (validate/lodo.py V0_HOST: the V0 family only), so no other step changes.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sim.core.memory import plan_memory
from sim.core.request import make_request
from sim.core.fast.leap import StepShape
from sim.costmodel import CostCoefficients, CostModel, DeviceProfile, v0_graph_max_batch
from sim.records import requests_frame
from sim.scenario import validate_scenario
from sim.simulator import Simulation
from sim.workload import build_requests

EAGER = 200e-6


def scenario(model="qwen2.5-0.5b", requests=1, **engine):
    return validate_scenario({"model": model, "device": "h100-sxm",
                              "engine": {"num_blocks": 512, "max_model_len": 2048, "vllm_version": "0.7.3",
                                         "front_end_s": 0, **engine},
                              "workload": {"num_requests": requests, "prompt_len": 64, "output_len": 4,
                                           "arrival": {"process": "offline"}}})


def cost(s, eager: float) -> CostModel:
    return CostModel.for_scenario(s, DeviceProfile(replace(CostCoefficients(), eager_layer_host_s=eager)))


def steps(s, eager: float, prompt=64):
    requests = [make_request(0, 0.0, [("prompt", prompt)], 4)]
    records = Simulation(s, requests, plan_memory(s), cost(s, eager)).run()
    return records.steps_frame(), requests_frame(records)


def test_a_prefill_step_adds_the_launches_its_device_time_does_not_cover():
    s = scenario()
    eager, plain = cost(s, EAGER), cost(s, 0.0)
    launches = EAGER * s.model.num_layers
    # a prefill of 64 tokens, then a decode step of 8 sequences (recorded steps re-priced as columns)
    frame = {name: np.array(values) for name, values in zip(
        ("num_seqs", "decode_seqs", "prefill_tokens", "decode_ctx", "prefill_ctx", "prefill_attn", "blocks_read"),
        ([1, 8], [0, 8], [64, 0], [0, 800], [0, 0], [64 * 65 // 2, 0], [4, 56]))}
    host, device = eager.step_times(frame)
    base_host, base_device = plain.step_times(frame)
    assert device[0] == base_device[0] < launches                    # the 0.5B model's prefill: launch-bound
    assert host[0] == pytest.approx(base_host[0] + launches - device[0])
    assert (host[1], device[1]) == (base_host[1], base_device[1])    # a decode step runs its graph


def test_only_the_prefill_steps_pay_and_a_large_models_prefill_hides_them():
    small = scenario()
    with_launches, frame = steps(small, EAGER)
    without, frame0 = steps(small, 0.0)
    prefill = with_launches["prefill_tokens"] > 0
    extra = with_launches["host_s"] - without["host_s"]
    assert prefill.iloc[0] and not prefill.iloc[1:].any()
    assert extra.iloc[0] == pytest.approx(EAGER * small.model.num_layers - with_launches["device_s"].iloc[0])
    assert np.allclose(extra.iloc[1:], 0.0)                          # decode steps: the captured graph
    assert frame["ttft_s"].iloc[0] > frame0["ttft_s"].iloc[0]
    large = scenario("llama-3.1-8b")
    big, _ = steps(large, 20e-6, prompt=1500)
    big0, _ = steps(large, 0.0, prompt=1500)
    assert big["device_s"].iloc[0] > 20e-6 * large.model.num_layers
    assert big["host_s"].iloc[0] == big0["host_s"].iloc[0]           # its GEMMs outlast the launches


def test_enforce_eager_runs_every_v0_step_eagerly_and_v1_never_pays():
    """--enforce-eager: `_use_captured_graph` is False for every batch (vllm/worker/model_runner.py,
    0.7.3), so a V0 decode step pays the launches too. A V1 engine (its own graph rules) never pays
    the V0 term, even from a profile that carries it."""
    eager_v0 = scenario(enforce_eager=True)
    with_launches, _ = steps(eager_v0, EAGER)
    without, _ = steps(eager_v0, 0.0)
    extra = with_launches["host_s"] - without["host_s"]
    expected = EAGER * eager_v0.model.num_layers - with_launches["device_s"]
    assert (with_launches["prefill_tokens"] == 0).sum() >= 3
    assert np.allclose(extra, expected) and (expected > 0).all()       # decode steps too
    for v1 in (scenario(vllm_engine="v1"), scenario(vllm_engine="v1", enforce_eager=True)):
        assert v1.engine_generation == "v1"
        pays, _ = steps(v1, EAGER)
        free, _ = steps(v1, 0.0)
        assert pays["host_s"].equals(free["host_s"])


def test_a_v0_decode_batch_above_the_largest_captured_size_runs_eagerly():
    """V0 captures [1, 2, 4, 8, 16, ..., 8192] up to the first size >= max_num_seqs (vllm/config.py
    VllmConfig._set_cudagraph_sizes, 0.7.3: max_batchsize_to_capture), none under enforce_eager;
    `_use_captured_graph` (vllm/worker/model_runner.py) runs a larger decode batch eagerly."""
    assert [v0_graph_max_batch(n, False) for n in (1, 3, 5, 100, 256, 8192, 9000)] == [1, 4, 8, 104, 256, 8192, 8192]
    assert v0_graph_max_batch(256, True) == 0
    s = scenario(max_num_seqs=9000, max_num_batched_tokens=9000)
    eager, plain = cost(s, 0.01), cost(s, 0.0)        # (launches longer than 8192 rows' device time)
    assert eager.v0_graph_max_batch == 8192
    for rows, pays in ((8192, False), (8193, True)):
        shape = StepShape(rows, 100 * rows, 7 * rows)
        host, device = eager.step_time(shape)
        base_host, base_device = plain.step_time(shape)
        launches = max(0.01 * s.model.num_layers - device, 0.0)
        assert launches > 0 and device == base_device
        assert host == (base_host + launches if pays else base_host)
        # the leaps' pricers agree, bit for bit
        assert eager.decode_pricer(rows)(shape.decode_ctx, shape.blocks_read) == (host, device)
        columns = {"num_seqs": [rows], "decode_seqs": [rows], "prefill_tokens": [0], "decode_ctx": [shape.decode_ctx],
                   "prefill_ctx": [0], "prefill_attn": [0], "blocks_read": [shape.blocks_read]}
        assert tuple(float(x[0]) for x in eager.step_times(columns)) == (host, device)


def test_leaps_and_the_one_by_one_path_agree_with_eager_decode_steps():
    """The leaps price a V0 enforce_eager run's decode steps with the launches (decode_pricer,
    step_times), as the one-by-one path does (step_time): the same steps, bit for bit."""
    s = validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm",
                           "engine": {"num_blocks": 400, "max_model_len": 2048, "vllm_version": "0.7.3",
                                      "front_end_s": 0, "enforce_eager": True},
                           "workload": {"num_requests": 120, "arrival": {"process": "poisson", "rate": 40},
                                        "prompt_len": {"dist": "uniform", "min": 16, "max": 400},
                                        "output_len": {"dist": "uniform", "min": 4, "max": 300}}})
    frames = [Simulation(s, build_requests(s), plan_memory(s), cost(s, EAGER), fast=fast).run().steps_frame(full=True)
              for fast in (True, False)]
    assert frames[0].equals(frames[1])
    frame = frames[0]
    host, _ = cost(s, EAGER).step_times(frame)
    plain_host, _ = cost(s, 0.0).step_times(frame)
    decode = (frame["prefill_tokens"] == 0).to_numpy()
    assert decode.sum() > 1000
    assert (host == frame["host_s"].to_numpy()).all() and (host[decode] > plain_host[decode]).all()


def long_context(requests, prompt_len, output_len, rate=None):
    arrival = {"process": "poisson", "rate": rate} if rate else {"process": "offline"}
    return validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm",
                              "engine": {"num_blocks": 8000, "max_model_len": 16384, "vllm_version": "0.7.3",
                                         "front_end_s": 0},
                              "workload": {"num_requests": requests, "arrival": arrival, "prompt_len": prompt_len,
                                           "output_len": output_len}})


def test_a_v0_decode_step_past_max_seq_len_to_capture_runs_eagerly():
    """`_use_captured_graph` (vllm/worker/model_runner.py, 0.7.3) also wants the longest decode
    sequence (seq_data.get_len(): the context this step attends) within max_seq_len_to_capture,
    8192 by default (vllm/engine/arg_utils.py EngineArgs) and at most max_model_len
    (vllm/config.py ModelConfig._verify_cuda_graph): past it a V0 decode step runs eagerly."""
    s = long_context(1, 8180, 30)
    assert cost(s, EAGER).v0_graph_max_context == 8192
    assert cost(scenario(), EAGER).v0_graph_max_context is None        # max_model_len 2048: never past it
    # an all-sliding model: its decode lengths are cut to the block-aligned window plus the last
    # block's tokens first (vllm/worker/model_runner.py _compute_for_sliding_window, 0.7.3)
    mistral = validate_scenario({"model": "mistral-7b-v0.1", "device": "h100-sxm",
                                 "engine": {"max_model_len": 16384, "vllm_version": "0.7.3", "front_end_s": 0}})
    assert mistral.engine_generation == "v0" and cost(mistral, EAGER).v0_graph_max_context is None
    wide = mistral.model_copy(update={"model": mistral.model.model_copy(update={"sliding_window": 8180})})
    assert cost(wide, EAGER).v0_graph_max_context == 8192             # 8192 + 15 can pass it
    with_launches, _ = steps_of(s, EAGER)
    without, _ = steps_of(s, 0.0)
    decode = (with_launches["prefill_tokens"] == 0).to_numpy()
    paid = (with_launches["host_s"] > without["host_s"]).to_numpy()
    assert (paid[decode] == (with_launches["decode_ctx"].to_numpy()[decode] > 8192)).all()
    assert paid[decode].sum() == 30 - 1 - (8192 - 8180)          # decode i attends 8180 + i


def steps_of(s, eager, fast=True):
    records = Simulation(s, build_requests(s), plan_memory(s), cost(s, eager), fast=fast).run()
    return records.steps_frame(full=True), requests_frame(records)


def test_leaps_stop_before_a_context_passes_max_seq_len_to_capture():
    """The leaps end before the longest context passes max_seq_len_to_capture and leave the steps
    past it to step_time: the same steps as the one-by-one path, bit for bit."""
    s = long_context(40, {"dist": "uniform", "min": 7000, "max": 8150}, {"dist": "uniform", "min": 20, "max": 400},
                     rate=20)
    fast, _ = steps_of(s, EAGER)
    reference, _ = steps_of(s, EAGER, fast=False)
    assert fast.equals(reference)
    plain, _ = steps_of(s, 0.0, fast=False)
    assert len(plain) != len(fast) or not plain["host_s"].equals(fast["host_s"])
