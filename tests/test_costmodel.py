"""The cost model: one formula for a step and for recorded steps, and the idle rule."""
from dataclasses import replace

import numpy as np
import pandas as pd

from sim.costmodel import IDLE_GAP_S, CostModel, DeviceProfile, after_idle
from sim.predict import predict
from sim.scenario import validate_scenario


def scenario(**engine):
    return validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm",
                              "engine": {"max_model_len": 4096, **engine},
                              "workload": {"num_requests": 120, "arrival": {"process": "poisson", "rate": 20}}})


def test_recorded_steps_reprice_exactly_as_the_simulator_priced_them():
    result = predict(scenario())
    host, device = result.cost_model.step_times(result.steps)
    assert np.allclose(host, result.steps["host_s"], rtol=0, atol=1e-15)
    assert np.allclose(device, result.steps["device_s"], rtol=0, atol=1e-15)


def test_after_idle_marks_the_first_step_and_steps_after_a_gap_only():
    # back to back, a short pause (under the threshold), a long one
    steps = pd.DataFrame({"start_s": [0.0, 1.0, 2.0 + IDLE_GAP_S / 2, 3.0 + 2 * IDLE_GAP_S],
                          "end_s": [1.0, 2.0, 3.0, 4.0]})
    assert after_idle(steps).tolist() == [True, False, False, True]


def test_wake_cost_is_charged_once_per_idle_period():
    s = scenario()
    base = predict(s)
    woken = CostModel.for_scenario(s, DeviceProfile(replace(base.cost_model.coefficients, wake_s=0.01)))
    host, _ = woken.step_times(base.steps)
    idle = after_idle(base.steps)
    assert 0 < idle.sum() < len(idle)
    assert np.allclose(host - base.steps["host_s"], 0.01 * idle)


def test_per_block_term_makes_small_blocks_slower():
    fine, coarse = predict(scenario(block_size=1)).summary, predict(scenario(block_size=64)).summary
    assert fine["tpot_s"]["p50"] > coarse["tpot_s"]["p50"]


def test_one_call_step_pricer_equals_the_parts_bit_for_bit():
    """CostModel._step_pricer (what step_time calls) does the sums of _host_time, _device_time and
    _exposed_host in one function: every price must be theirs to the last bit, dense or MoE
    (tp, dp, ep), synchronous or async, with the named host costs set."""
    import random

    from sim.core.catalog import get_device, get_model

    named = DeviceProfile(replace(DeviceProfile().coefficients, graph_launch_s=3e-5, sample_seq_s=2e-7,
                                  detok_token_s=4e-5, api_token_s=9e-5))   # (output shows past ~40 rows)
    models = [("qwen2.5-0.5b", {}), ("qwen3-30b-a3b", {"tp": 4}), ("qwen3-30b-a3b", {"dp": 4, "ep": 4})]
    rnd = random.Random(0)
    for name, par in models:
        for profile in (None, named):
            for overlap in (False, True):
                cost = CostModel(get_model(name), get_device("h100-sxm"), profile=profile,
                                 async_scheduling=overlap, **par)
                assert cost._price_step != cost._price_by_parts       # the one-call form is in use
                for _ in range(300):
                    decodes, prefills = rnd.randint(0, 256), rnd.randint(0, 4)
                    tokens = rnd.randint(prefills, 4096) if prefills else 0
                    shape = (decodes + prefills, decodes, tokens, rnd.randint(0, 10 ** 6),
                             rnd.randint(0, 10 ** 5), rnd.randint(0, 10 ** 7), rnd.randint(0, 10 ** 5))
                    assert cost._price_step(*shape) == cost._price_by_parts(*shape), (name, par, shape)
