"""vLLM V0 launches a step with a prefill eagerly: `eager_layer_host_s` per layer, beyond the device time.

vLLM 0.7.3 vllm/worker/model_runner.py `ModelInputForGPUBuilder._use_captured_graph`: a batch runs its
captured CUDA graph only when it is decode-only (and not --enforce-eager, within the captured sizes), so
a V0 prefill step (V0's steps are all prefills or all decodes) launches every layer's kernels from
Python one by one. The GPU runs each kernel as it is launched: the launches show only where they take
longer than the kernels (a small model's prefill), not under a large model's GEMMs. The coefficient is
0 unless fitted (validate/lodo.py V0_HOST: the V0 family only), so no other step changes.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sim.core.memory import plan_memory
from sim.core.request import make_request
from sim.costmodel import CostCoefficients, CostModel, DeviceProfile
from sim.records import requests_frame
from sim.scenario import validate_scenario
from sim.simulator import Simulation

EAGER = 200e-6


def scenario(model="qwen2.5-0.5b"):
    return validate_scenario({"model": model, "device": "h100-sxm",
                              "engine": {"num_blocks": 512, "max_model_len": 2048, "vllm_version": "0.7.3",
                                         "front_end_s": 0},
                              "workload": {"num_requests": 1, "prompt_len": 64, "output_len": 4,
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
