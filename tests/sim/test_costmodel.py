"""The cost model: one formula for a step and for recorded steps, and the idle rule."""
from dataclasses import replace

import numpy as np
import pandas as pd

from sim.costmodel import IDLE_GAP_S, STEP_SHAPE, CostModel, DeviceProfile, after_idle
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


def test_every_form_of_the_pricer_prices_alike_bit_for_bit():
    """The roofline is written once (CostModel._stages); the simulator calls it three ways: one
    step (`price`, what step_time calls: the one-call form generated from it), a leap's decode
    steps with the batch's sizes worked out once (`decode_pricer`: its two stages, generated for
    Python numbers), and numpy columns of recorded or leaped steps (`step_times`: the source
    itself). Every price must be the same to the last bit: dense, sliding-window, quantized or
    MoE (tp, dp, ep), NVLink or PCIe, synchronous or async, with the named host costs set."""
    import random

    from sim.core.catalog import get_device, get_model

    named = DeviceProfile(replace(DeviceProfile().coefficients, graph_launch_s=3e-5, sample_seq_s=2e-7,
                                  detok_token_s=4e-5, api_token_s=9e-5))   # (output shows past ~40 rows)
    gpt_oss = validate_scenario({"model": {"hf_config": "tests/data/hf_configs/openai__gpt-oss-20b.json"},
                                 "device": "h100-sxm"}).model
    awq = validate_scenario({"model": {"base": "llama-3.1-8b", "quantization": {"method": "awq"}},
                             "device": "l4"}).model
    models = [(get_model("qwen2.5-0.5b"), {}), (get_model("qwen3-30b-a3b"), {"tp": 4}),
              (get_model("qwen3-30b-a3b"), {"dp": 4, "ep": 4}), (gpt_oss, {}),
              (awq, {"tp": 2, "device": "l4"}), (get_model("llama-3.1-8b"), {"tp": 4, "device": "l40s"}),
              (get_model("qwen3-30b-a3b"), {"dp": 2, "ep": 2, "device": "rtx-pro-6000-server"})]
    rnd = random.Random(0)
    for model, par in models:
        for profile in (None, named):
            for overlap in (False, True):
                on = {k: v for k, v in par.items() if k != "device"}
                cost = CostModel(model, get_device(par.get("device", "h100-sxm")), profile=profile,
                                 async_scheduling=overlap, **on)
                shapes = []
                for _ in range(300):
                    decodes, prefills = rnd.randint(0, 256), rnd.randint(0, 4)
                    tokens = rnd.randint(prefills, 4096) if prefills else 0
                    shapes.append((decodes + prefills, decodes, tokens, rnd.randint(0, 10 ** 6),
                                   rnd.randint(0, 10 ** 5), rnd.randint(0, 10 ** 7), rnd.randint(0, 10 ** 5)))
                    rows, ctx, blocks = rnd.randint(1, 256), rnd.randint(0, 10 ** 6), rnd.randint(0, 10 ** 5)
                    assert cost.decode_pricer(rows)(ctx, blocks) == cost.price(rows, rows, 0, ctx, 0, 0, blocks)
                one_by_one = np.array([cost.price(*shape) for shape in shapes])
                columns = dict(zip(STEP_SHAPE, np.array(shapes).T))
                host, device = cost.step_times(columns)
                if cost._moe:      # numpy's power may round the experts touched apart from Python's (1 ulp)
                    assert np.allclose(device, one_by_one[:, 1], rtol=1e-14, atol=0), (model.name, par)
                    continue
                assert host.tolist() == one_by_one[:, 0].tolist(), (model.name, par)
                assert device.tolist() == one_by_one[:, 1].tolist(), (model.name, par)


def test_the_generated_forms_are_parsed_from_the_lines_inspect_finds():
    """The scalar forms are parsed from each method's lines, found from its code's positions
    (sim.costmodel._method_source), not by tokenizing as `inspect.getsource` does: the same text,
    placed at the method's own line numbers. Fails if a method's last statement leaves no
    position (the text would end early) or the lines move."""
    import inspect
    import textwrap

    from sim.costmodel import _GENERATED, _method_source

    for name in sorted(_GENERATED):
        method = getattr(CostModel, name)
        text, filename = _method_source(method)
        first = method.__code__.co_firstlineno
        assert text[:first - 1] == "\n" * (first - 1) and filename == inspect.getsourcefile(method), name
        assert text[first - 1:] == textwrap.dedent(inspect.getsource(method)), name


def test_the_expert_kernel_term_slows_only_the_experts_and_more_as_tp_narrows_their_slices():
    """expert_n_half: the fused-MoE kernel on an expert slice of n columns per GPU reaches
    n / (n + expert_n_half) of the dense GEMMs' compute efficiency (0, the default:
    the dense one, exactly); the slice is moe_intermediate_size over the GPUs the experts are sliced
    over, a whole expert under expert parallelism. Dense layers and dense models are untouched."""
    import pytest

    from sim.core.catalog import get_device, get_model
    from sim.costmodel import CostCoefficients, expert_kernel_share

    h100, moe, dense = get_device("h100-sxm"), get_model("qwen3-30b-a3b"), get_model("llama-3.1-8b")
    assert CostCoefficients().expert_n_half == 0 and expert_kernel_share(192.0, 0.0) == 1.0
    slow = DeviceProfile(CostCoefficients(expert_n_half=256.0))
    decodes = (64, 64, 0, 64 * 1024, 0, 0, 64 * 64)
    prefill = (1, 0, 4096, 0, 4096, 4096 * 4097 // 2, 256)     # compute-bound experts
    shares = []
    for par in ({"tp": 1}, {"tp": 2}, {"tp": 4}, {"dp": 4, "ep": 4}):
        base, kernel = CostModel(moe, h100, **par), CostModel(moe, h100, profile=slow, **par)
        columns = moe.moe_intermediate_size / (1 if par.get("ep") else par.get("tp", 1) * par.get("dp", 1))
        share = expert_kernel_share(columns, 256.0)
        assert share == columns / (columns + 256.0)
        assert kernel._expert_pair_flop_s == pytest.approx(base._expert_pair_flop_s / share, rel=1e-12)
        assert kernel._expert_read_s == base._expert_read_s          # streaming: bound by the bytes
        assert kernel._linear_weight_s == base._linear_weight_s and kernel._linear_flop_s == base._linear_flop_s
        assert kernel.price(*prefill)[1] > base.price(*prefill)[1]
        shares.append(share)
    assert shares[0] > shares[1] > shares[2] and shares[3] == shares[0]     # whole experts under ep
    for tp in (1, 2):
        assert CostModel(dense, h100, tp=tp, profile=slow).price(*decodes) == CostModel(dense, h100, tp=tp).price(*decodes)
