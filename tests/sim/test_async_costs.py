"""Async scheduling and the named per-step host terms of a CUDA-graph engine in the cost model."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sim.core.kv import KVCacheManager
from sim.costmodel import CostCoefficients, CostModel, DeviceProfile
from sim.scenario import validate_scenario
from validate.calibrate import probe_batch

BASE = {"model": "qwen2.5-0.5b", "device": "l4", "engine": {"max_model_len": 2048}}


def decode_batch(seqs: int = 8, context: int = 256):
    kv = KVCacheManager(4096, 16, enable_caching=False)
    return probe_batch(kv, [(context, 1, True)] * seqs, tag=seqs)


def model(async_scheduling: bool, **coefficients) -> CostModel:
    scenario = validate_scenario({**BASE, "engine": {**BASE["engine"], "async_scheduling": async_scheduling}})
    profile = DeviceProfile(replace(CostCoefficients(), **coefficients))
    return CostModel.for_scenario(scenario, profile)


def test_async_hides_host_work_behind_the_device():
    batch = decode_batch()
    sync_host, device = model(False).step_time(batch)
    async_host, async_device = model(True).step_time(batch)
    assert async_device == device
    assert sync_host > 0 and async_host == pytest.approx(max(sync_host - device, 0.0))
    # host work longer than the device shows only by its excess
    slow_host, dev = model(True, step_host_s=0.05).step_time(batch)
    assert slow_host + dev == pytest.approx(model(False, step_host_s=0.05).step_time(batch)[0])


def test_graph_launch_is_serial_and_sampling_is_device_time():
    batch = decode_batch(seqs=4)
    host0, device0 = model(True).step_time(batch)
    host, device = model(True, graph_launch_s=30e-6, sample_seq_s=2e-6).step_time(batch)
    assert device == pytest.approx(device0 + 4 * 2e-6)
    assert host == pytest.approx(30e-6 + max(model(False).step_time(batch)[0] - device, 0.0))


def test_output_processing_shows_only_beyond_the_engine_step():
    batch = decode_batch(seqs=8)
    host, device = model(True, api_token_s=1e-6).step_time(batch)
    assert host == model(True).step_time(batch)[0]          # 8 us of streaming hides in the step
    host, device = model(True, api_token_s=5e-3, detok_token_s=1e-3).step_time(batch)
    assert host + device == pytest.approx(8 * 6e-3)          # the API server is the bottleneck


def test_recorded_steps_are_priced_like_live_ones():
    from sim.predict import predict

    scenario = validate_scenario({**BASE, "workload": {"num_requests": 12, "prompt_len": 100, "output_len": 8}})
    result = predict(scenario)
    host, device = result.cost_model.step_times(result.steps)
    assert np.allclose(host, result.steps["host_s"]) and np.allclose(device, result.steps["device_s"])
    assert result.manifest["cost_model"]["async_scheduling"] is True
    assert result.summary["step_time_source"] == scenario.step_times == "trained"     # the default


def test_a_cpu_device_never_overlaps():
    scenario = validate_scenario({"model": "tiny", "device": "cpu", "engine": {"num_blocks": 64}})
    scenario.engine.async_scheduling = True                  # asked for explicitly: still no overlap
    assert scenario.async_scheduling and not CostModel.for_scenario(scenario).async_scheduling


def test_kvtwin_engine_validation_predicts_synchronously():
    from validate.run import synchronous

    scenario = validate_scenario(BASE)
    assert scenario.async_scheduling and not synchronous(scenario).async_scheduling
