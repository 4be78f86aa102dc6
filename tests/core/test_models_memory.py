"""Quantized weights, fp8 KV, hybrid sliding-window KV groups and MoE parallelism against vLLM's
own startup-log numbers (tests/data/vllm_public/startup_logs.yaml, each entry cited there)."""
from pathlib import Path

import numpy as np
import pytest
import yaml

from sim.core.catalog import ModelSpec, get_device, get_model
from sim.core.hf_config import model_fields_from_hf_config
from sim.core.memory import (kv_cache_groups, plan_memory, sliding_window_blocks_kept, sliding_window_hit_blocks,
                             weight_bytes_per_gpu)
from sim.costmodel import STEP_SHAPE, CostModel, expected_experts_touched
from sim.records import requests_frame
from sim.scenario import ScenarioError, validate_scenario

DATA = Path(__file__).parents[1] / "data"
LOGS = {e["id"]: e for e in yaml.safe_load((DATA / "vllm_public" / "startup_logs.yaml").read_text())["entries"]}
GIB = 1024 ** 3

FP8_DYNAMIC = {"method": "fp8", "scales": "channel"}                 # compressed-tensors fp8-dynamic
W8A8_INT = {"method": "int8", "scales": "channel"}
W4A16 = {"method": "gptq", "scales": "group", "group_size": 128}     # compressed-tensors w4a16, symmetric


def gemma(layers, hidden, heads, kv_heads, head_dim, inter, window, pattern):
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return {"num_layers": layers, "hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": inter, "vocab_size": 262144, "tie_word_embeddings": True,
            "max_position_embeddings": 131072, "sliding_window": window, "layer_types": types}


def oss20b():
    return model_fields_from_hf_config(DATA / "hf_configs" / "openai__gpt-oss-20b.json")


def oss120b():
    """gpt-oss-120b's shape (its config.json: 36 layers alternating 128-token windows and full
    attention, 128 experts top-4, mxfp4 experts)."""
    fields = oss20b()
    return {**fields, "name": "gpt-oss-120b", "num_layers": 36, "num_heads": 64, "num_experts": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 18}


def gemma2_27b():
    return model_fields_from_hf_config(DATA / "hf_configs" / "lunahr__SystemGemma2-27b-it.json")


# log id -> (model fields, kv_cache_dtype, tp, check the weights?)
CASES = {
    "planner-meta-llama-llama-3-1-8b---h100-80gb--tp1pp1dp1--8192": ({"base": "llama-3.1-8b"}, "auto", 1, True),
    "planner-meta-llama---h100-80gb--tp1pp1dp1--8192-dtbf16-kvfp8": ({"base": "llama-3.1-8b"}, "fp8", 1, True),
    "planner-meta-llama-llama-3---h100-80gb--tp1pp1dp1--8192-qfp8":
        ({"base": "llama-3.1-8b", "quantization": {"method": "fp8", "scales": "tensor"}}, "auto", 1, True),
    "planner-w8a8-redhatai-llam--h100-80gb--tp1pp1dp1--8192-dtf16":
        ({"base": "llama-3.1-8b", "quantization": W8A8_INT}, "auto", 1, True),
    "planner-w4a16-redhatai-lla--h100-80gb--tp1pp1dp1--8192-dtf16":
        ({"base": "llama-3.1-8b", "quantization": W4A16}, "auto", 1, True),
    "planner-fp8dyn-llama-3-3-70b--h100-80gb--tp2pp1dp1--8192":
        ({"base": "llama-3.1-70b", "quantization": FP8_DYNAMIC}, "auto", 2, True),
    "planner-qwen-qwen2---h100-80gb--tp1pp1dp1--8192-dtbf16-kvfp8": ({"base": "qwen2.5-7b"}, "fp8", 1, True),
    "planner-fp8dyn-redhatai-qwen2-5---h100-80gb--tp1pp1dp1--8192":
        ({"base": "qwen2.5-7b", "quantization": FP8_DYNAMIC}, "auto", 1, True),
    "planner-mistralai-mixtral-8x7b-i--h100-80gb--tp2pp1dp1--8192": ({"base": "mixtral-8x7b"}, "auto", 2, True),
    "planner-qwen-qwen3-30b-a3b--h100-80gb--tp1pp1dp1--8192": ({"base": "qwen3-30b-a3b"}, "auto", 1, True),
    # hybrid sliding-window / full-attention models: vLLM's KV cache groups
    "planner-google-gemma-2-27b-it--h100-80gb--tp1pp1dp1--8192": (gemma2_27b(), "auto", 1, True),
    "planner-google-gemma-3-27b-it--h100-80gb--tp1pp1dp1--8192":
        (gemma(62, 5376, 32, 16, 128, 21504, 1024, 6), "auto", 1, False),     # vision tower not modelled
    "planner-google-gemma-3-12b-it--h100-80gb--tp1pp1dp1--8192":
        (gemma(48, 3840, 16, 8, 256, 15360, 1024, 6), "auto", 1, False),
    # mxfp4 experts; vLLM pads them for its kernels, so its weights are ~9% above the checkpoint's
    "planner-openai-gpt-oss-20b--h100-80gb--tp2pp1dp1--8192": (oss20b(), "auto", 2, False),
    # another vLLM (0.10.1.1), GPU (A100) and batch budget (2048): gpt-oss-120b at tp 4
    "dennislee-vllm-120B-4gpuA10080GB-0.8GRAM-diff-nodes": (oss120b(), "auto", 4, False),
}


def scenario_for(log_id, num_blocks=None):
    fields, kv_dtype, tp, _ = CASES[log_id]
    log = LOGS[log_id]
    engine = {"kv_cache_dtype": kv_dtype, "max_model_len": log["max_model_len"],
              "max_num_batched_tokens": log["max_num_batched_tokens"], "num_blocks": num_blocks}
    return validate_scenario({"model": fields, "device": "h100-sxm", "parallelism": {"tp": tp},
                              "engine": {k: v for k, v in engine.items() if v is not None}})


@pytest.mark.parametrize("log_id", sorted(CASES))
def test_pool_blocks_from_vllms_kv_memory(log_id):
    """vLLM's "Available KV cache memory" (printed to 0.01 GiB) over our block bytes is its block count."""
    printed = LOGS[log_id]["printed"]
    plan = scenario_and_plan(log_id, printed["num_gpu_blocks"])
    slack = 0.005 * GIB / plan.block_bytes + 1
    assert abs(printed["available_kv_cache_gib"] * GIB / plan.block_bytes - printed["num_gpu_blocks"]) <= slack


@pytest.mark.parametrize("log_id", sorted(CASES))
def test_max_concurrency_and_pool_tokens_as_vllm_prints_them(log_id):
    printed = LOGS[log_id]["printed"]
    plan = scenario_and_plan(log_id, printed["num_gpu_blocks"])
    assert plan.max_concurrency(LOGS[log_id]["max_model_len"]) == pytest.approx(printed["max_concurrency"], abs=0.006)
    if plan.kv_groups.is_hybrid:
        assert plan.max_tokens == printed["kv_cache_tokens"]


@pytest.mark.parametrize("log_id", sorted(k for k, case in CASES.items() if case[3]))
def test_weights_per_gpu_match_vllms_model_loading(log_id):
    """"Model loading took X GiB": within 2% (vLLM adds kernel workspaces, e.g. Marlin's for w4a16)."""
    plan = scenario_and_plan(log_id, LOGS[log_id]["printed"]["num_gpu_blocks"])
    assert plan.weight_bytes / GIB == pytest.approx(LOGS[log_id]["printed"]["weights_gib"], rel=0.02)


def scenario_and_plan(log_id, num_blocks):
    return plan_memory(scenario_for(log_id, num_blocks))


def test_fp8_kv_halves_the_page_and_doubles_the_pool():
    base = {"model": "llama-3.1-8b", "device": "l4", "engine": {"max_model_len": 4096}}
    bf16 = plan_memory(validate_scenario(base))
    fp8 = plan_memory(validate_scenario({**base, "engine": {"max_model_len": 4096, "kv_cache_dtype": "fp8"}}))
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token == 131072
    assert fp8.num_blocks == pytest.approx(2 * bf16.num_blocks, abs=1)


def test_awq_weights_leave_the_l4_a_pool_three_times_larger():
    """AWQ weights are ~4x smaller than bf16: Llama-3.1-8B-AWQ on an L4 must not be planned with
    16 GB of weights."""
    base = {"device": "l4", "engine": {"max_model_len": 4096}}
    bf16 = plan_memory(validate_scenario({**base, "model": "llama-3.1-8b"}))
    awq = plan_memory(validate_scenario({**base, "model": {"base": "llama-3.1-8b", "quantization": {
        "method": "awq", "group_size": 128, "zero_point": True}}}))
    assert awq.weight_bytes / 1e9 == pytest.approx(5.73, abs=0.05)
    assert awq.kv_pool_bytes > 2.5 * bf16.kv_pool_bytes


def test_hybrid_groups_follow_vllms_layer_split():
    gemma3 = ModelSpec(**gemma(62, 5376, 32, 16, 128, 21504, 1024, 6))
    assert kv_cache_groups(gemma3) == type(kv_cache_groups(gemma3))(10, 1, 6, 1024, sliding_first=True)   # 52 local = 6 groups of 10
    oss = ModelSpec(**oss20b())
    g = kv_cache_groups(oss)
    assert (g.group_size, g.full_groups, g.sliding_groups) == (12, 1, 1)
    mistral = get_model("mistral-7b-v0.1")
    g = kv_cache_groups(mistral)
    assert (g.group_size, g.full_groups, g.sliding_groups) == (32, 0, 1)
    # a Mistral v0.1 request never holds more than its window's blocks, whatever its length
    assert g.blocks_per_request(32768, 16, 2048) == (4095 + 2048 + 15) // 16 + 1


def test_sliding_window_frees_blocks_behind_the_window():
    # window 8, blocks of 4: at 20 computed tokens the next query sees tokens 13.., so blocks 0-2 go
    assert sliding_window_blocks_kept(20, 4, 8) == 5 - 3
    assert sliding_window_blocks_kept(5, 4, 8) == 2        # nothing behind the window yet


def test_sliding_window_prefix_hit_needs_a_window_of_cached_blocks():
    # window 9 needs cdiv(8, 4) = 2 consecutive cached blocks, found scanning from the end
    assert sliding_window_hit_blocks([True] * 6, 4, 9) == 6
    assert sliding_window_hit_blocks([False, False, True, True, False, True], 4, 9) == 4
    assert sliding_window_hit_blocks([True, False, False, False], 4, 9) == 1    # a run from block 0


def test_experts_touched_grow_with_the_batch():
    touched = expected_experts_touched(128, 8, np.array([1, 8, 64, 1024]))
    assert touched[0] == pytest.approx(8)
    assert touched[1] == pytest.approx(128 * (1 - (1 - 8 / 128) ** 8))
    assert 8 < touched[1] < touched[2] < touched[3] <= 128 and touched[3] > 127.9


def test_moe_decode_stays_bandwidth_bound_on_experts():
    """A Qwen3-30B-A3B decode step: reading the touched experts dominates; past the batch where
    all 128 are hit, the expert read stops growing (a dense model's weight read never does)."""
    cost = CostModel(get_model("qwen3-30b-a3b"), get_device("h100-sxm"))
    t = [cost.moe_layer_time(n) for n in (1, 16, 256, 512)]
    assert t[0] < t[1] < t[2]
    assert t[3] - t[2] < 0.2 * (t[2] - t[0])


def test_experts_split_over_tp_times_dp_and_dp_gathers_the_tokens():
    m = get_model("qwen3-30b-a3b")
    experts = m.part_bytes("experts")
    assert weight_bytes_per_gpu(m, tp=1, dp=4) == pytest.approx((m.weight_bytes() - experts) + experts / 4, abs=4)
    h100 = get_device("h100-sxm")
    tp4 = CostModel(m, h100, tp=4)
    dp4 = CostModel(m, h100, tp=1, dp=4)
    ep4 = CostModel(m, h100, tp=1, dp=4, ep=4)
    # vLLM 0.19's default all2all backend (allgather_reducescatter, vllm/config/parallel.py) all-gathers
    # the dp ranks' tokens (dp - 1 copies) and reduce-scatters the outputs, expert parallel or not
    assert ep4._moe_comm_token_s == dp4._moe_comm_token_s == 2 * 3 * m.hidden_size * 2 / (h100.link_gbps * 1e9)
    assert tp4._moe_comm_token_s == 0.0           # tp only: the MLP's all-reduce, with attention's
    # tp=4 on one dp rank sees a quarter of the tokens dp=4 gathers: its MoE layer is cheaper per step
    assert tp4.moe_layer_time(64) < dp4.moe_layer_time(64)


def test_fp8_gemms_run_at_the_fp8_peak_where_the_device_has_one():
    m = {"base": "llama-3.1-8b", "quantization": {"method": "fp8", "scales": "channel"}}
    model = validate_scenario({"model": m, "device": "h100-sxm"}).model
    fast = CostModel(model, get_device("h100-sxm"))
    slow = CostModel(model, get_device("a100-80g"))      # no fp8 tensor cores: weight-only path
    bf16 = CostModel(get_model("llama-3.1-8b"), get_device("h100-sxm"))
    assert fast._linear_flop_s == pytest.approx(bf16._linear_flop_s / 2, rel=0.01)
    assert fast._linear_weight_s < 0.55 * bf16._linear_weight_s
    assert slow._linear_flop_s > fast._linear_flop_s


def device_s(cost, seqs, decodes, decode_ctx, blocks_read=0):
    """Device seconds of a decode-only step."""
    return cost.price(seqs, decodes, 0, decode_ctx, 0, 0, blocks_read)[1]


def attention_s(cost, seqs, decode_ctx):
    """One layer's attention in a decode step of `seqs` rows: what the context adds per layer."""
    return (device_s(cost, seqs, seqs, decode_ctx) - device_s(cost, seqs, seqs, 0)) / cost.model.num_layers


def blocks_walked(cost, seqs, blocks_read):
    """KV blocks one layer walks on average, from what the per-block term adds to a step."""
    added = device_s(cost, seqs, seqs, 0, blocks_read) - device_s(cost, seqs, seqs, 0)
    return added / (cost.model.num_layers * cost.coefficients.block_overhead_s)


def test_sliding_layers_read_at_most_the_window():
    oss = ModelSpec(**oss20b())
    cost = CostModel(oss, get_device("h100-sxm"))
    full = CostModel(oss.model_copy(update={"sliding_window": None, "layer_types": None}), get_device("h100-sxm"))
    # 8 decodes at 20k context
    assert attention_s(cost, 8, 8 * 20000) == pytest.approx(attention_s(full, 8, 8 * 20000)
                                                            * (12 + 12 * 128 / 20000) / 24, rel=1e-6)


def test_sliding_layers_walk_at_most_the_window_blocks():
    """gpt-oss-20b: 12 of 24 layers slide over 128 tokens, so they walk at most
    cdiv(127, 16) + 1 = 9 blocks per sequence, where a full layer walks every block."""
    oss = ModelSpec(**oss20b())
    cost = CostModel(oss, get_device("h100-sxm"), block_size=16)
    full = CostModel(oss.model_copy(update={"sliding_window": None, "layer_types": None}), get_device("h100-sxm"))
    assert blocks_walked(cost, 8, 8 * 1250) == pytest.approx((12 * 8 * 1250 + 12 * 8 * 9) / 24, rel=1e-9)
    assert blocks_walked(cost, 8, 8 * 5) == pytest.approx(8 * 5, rel=1e-9)       # short contexts: inside the window
    assert blocks_walked(full, 8, 8 * 1250) == pytest.approx(8 * 1250, rel=1e-9)
    assert blocks_walked(CostModel(oss, get_device("h100-sxm"), block_size=32), 8, 8 * 625) == pytest.approx(
        (12 * 8 * 625 + 12 * 8 * 5) / 24, rel=1e-9)                               # cdiv(127, 32) + 1 = 5
    # recorded steps price each row with its own pool's block size (calibration probes mix 8/16/32)
    shape = dict(seqs=8, decodes=8, prefill_tokens=0, decode_ctx=8 * 20000, prefill_ctx=0, prefill_attn=0)
    steps = {**{name: [v, v] for name, v in zip(STEP_SHAPE, shape.values())},
             "blocks_read": [8 * 1250, 8 * 625], "block_size": [16, 32]}
    device = cost.step_times(steps)[1]
    one = [device_s(CostModel(oss, get_device("h100-sxm"), block_size=bs), 8, 8, 8 * 20000, b)
           for bs, b in ((16, 8 * 1250), (32, 8 * 625))]
    assert device.tolist() == pytest.approx(one, rel=1e-12)


def test_scenario_block_size_reaches_the_cost_model():
    s = validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm", "engine": {"block_size": 32}})
    assert CostModel.for_scenario(s).block_size == 32


def test_scenario_parallelism_fields_are_checked():
    ok = validate_scenario({"model": "qwen3-30b-a3b", "device": "h100-sxm", "parallelism": {"tp": 2, "dp": 4, "ep": 8}})
    assert ok.parallelism.gpus == 8
    with pytest.raises(ScenarioError, match="parallelism.ep"):
        validate_scenario({"model": "qwen3-30b-a3b", "device": "h100-sxm", "parallelism": {"tp": 2, "dp": 2, "ep": 2}})
    with pytest.raises(ScenarioError, match="parallelism.ep.*experts"):
        validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm", "parallelism": {"ep": 1, "dp": 1, "tp": 1},
                           "engine": {"kv_cache_dtype": "fp8"}} | {"parallelism": {"ep": 2, "dp": 2}})
    with pytest.raises(ScenarioError, match="kv_cache_dtype"):
        validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm", "engine": {"kv_cache_dtype": "int4"}})


def test_every_device_cites_a_source_and_sane_peaks():
    from sim.core.catalog import device_names
    for name in device_names():
        d = get_device(name)
        if name != "cpu":
            assert d.source and d.source.startswith("https://"), name
        for low in (d.fp8_tflops, d.int8_tops):
            assert low is None or low >= d.bf16_tflops, name


# ----------------------------------------------------------------------------- shipped what-ifs

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def whatif(name, *overrides):
    from sim.scenario import load_scenario
    return load_scenario(SCENARIOS / name, list(overrides))


# Key figures under vLLM's plan (the default) and under engine.memory_plan=simple (the figures before
# vLLM's plan was the default: datasheet memory, kvtwin's activation estimate, device.reserved_mib).
QUANT_FIGURES = {"vllm": (2.57, 8.29, 42.55), "simple": (2.47, 8.83, 43.65)}
MOE_FIGURES = {"vllm": (279.8, 278.6), "simple": (296.3, 283.1)}


@pytest.mark.parametrize("memory_plan", sorted(QUANT_FIGURES))
def test_whatif_quantization_key_figures(memory_plan):
    """One L4, Llama-3.1-8B: fp8 weights leave ~2.5x the pool; fp8 KV doubles the concurrency.
    vLLM's plan leaves ~0.3 GiB less KV than the simple one (0.9 x 22.03 GiB torch-visible, less
    0.25 GiB non-torch, against 0.9 x 22.49 GiB datasheet less a 0.39 GiB reserve; both activation
    terms ~0.48 GiB), so its fp8-weights ratio is larger and its concurrencies lower."""
    ratio, conc_bf16, conc_fp8 = QUANT_FIGURES[memory_plan]
    plans = {(m, kv): plan_memory(whatif("whatif_quantization.yaml", f"model={m}", f"engine.kv_cache_dtype={kv}",
                                         f"engine.memory_plan={memory_plan}"))
             for m in ("llama-3.1-8b", "llama-3.1-8b-fp8") for kv in ("auto", "fp8")}
    conc = {k: p.max_concurrency(4096) for k, p in plans.items()}
    assert plans["llama-3.1-8b", "auto"].weight_bytes / 1e9 == pytest.approx(16.06, abs=0.01)
    assert plans["llama-3.1-8b-fp8", "auto"].weight_bytes / 1e9 == pytest.approx(9.09, abs=0.01)
    assert plans["llama-3.1-8b-fp8", "auto"].kv_pool_bytes / plans["llama-3.1-8b", "auto"].kv_pool_bytes == \
        pytest.approx(ratio, abs=0.02)
    assert conc["llama-3.1-8b", "fp8"] == pytest.approx(2 * conc["llama-3.1-8b", "auto"], rel=0.01)
    assert conc["llama-3.1-8b", "auto"] == pytest.approx(conc_bf16, abs=0.01)
    assert conc["llama-3.1-8b-fp8", "fp8"] == pytest.approx(conc_fp8, abs=0.01)


@pytest.mark.parametrize("memory_plan", sorted(MOE_FIGURES))
def test_whatif_moe_key_figures(memory_plan):
    """Four H100s, Qwen3-30B-A3B: dp replicates attention (17.6 vs 15.3 GB per GPU) but gives each
    rank a whole KV cache; per GPU the concurrency is alike, the engine count differs. (Under vLLM's
    plan tp 4 pays ~2.2 GiB of NCCL / custom all-reduce buffers per GPU, which the dp ranks do not.)"""
    one_engine, four_ranks = MOE_FIGURES[memory_plan]
    variants = {"tp4": ("parallelism.tp=4", "parallelism.dp=1", "parallelism.ep=1"),
                "dp4": ("parallelism.tp=1", "parallelism.dp=4", "parallelism.ep=1"),
                "dp4ep4": ("parallelism.tp=1", "parallelism.dp=4", "parallelism.ep=4")}
    scen = {k: whatif("whatif_moe.yaml", *v, f"engine.memory_plan={memory_plan}") for k, v in variants.items()}
    plans = {k: plan_memory(s) for k, s in scen.items()}
    assert all(s.parallelism.gpus == 4 for s in scen.values())
    assert plans["tp4"].weight_bytes / 1e9 == pytest.approx(15.27, abs=0.01)
    assert plans["dp4"].weight_bytes == plans["dp4ep4"].weight_bytes
    assert plans["dp4"].weight_bytes / 1e9 == pytest.approx(17.58, abs=0.01)
    assert plans["tp4"].max_concurrency(8192) == pytest.approx(one_engine, abs=0.1)       # one engine
    assert 4 * plans["dp4"].max_concurrency(8192) == pytest.approx(four_ranks, abs=0.1)   # four ranks
    costs = {k: CostModel.for_scenario(s) for k, s in scen.items()}
    # the same exchange (vLLM 0.19's default all-gather + reduce-scatter); whole experts per GPU wait
    # for the busiest one (tests/sim/test_cost_physics.py)
    assert costs["dp4ep4"].moe_layer_time(32) > costs["dp4"].moe_layer_time(32)


@pytest.mark.parametrize("typed, meant", [
    ("rtx-pro-6000", ["rtx-pro-6000-server", "rtx-pro-6000-workstation"]),
    ("H100", ["h100-nvl", "h100-pcie", "h100-sxm"]),
    ("MI300", ["mi300x"]),
    ("gb-200", ["gb200"]),
])
def test_unknown_device_names_suggest_the_closest(typed, meant):
    from sim.core.catalog import device_names, get_device as device
    from sim.core.catalog import closest_names
    assert closest_names(typed, device_names()) == meant
    with pytest.raises(KeyError, match=meant[0]):
        device(typed)


def test_data_parallel_ranks_are_engines_sharing_the_router():
    """dp=2 runs two ranks (each its own KV pool and scheduler) behind vLLM's DP load balancer."""
    from sim.simulator import simulate
    base = {"model": "qwen3-30b-a3b", "device": "h100-sxm", "engine": {"max_model_len": 2048},
            "workload": {"num_requests": 16, "arrival": {"process": "poisson", "rate": 50},
                         "prompt_len": 64, "output_len": 8}}
    one = simulate(validate_scenario({**base, "parallelism": {"tp": 2}}))[0]
    two = simulate(validate_scenario({**base, "parallelism": {"tp": 1, "dp": 2, "ep": 2}}))[0]
    assert len(one.recorders) == 1 and len(two.recorders) == 2
    assert all(len(r.frame()) > 0 for r in two.recorders)      # the balancer gave both ranks work
    assert (requests_frame(two)["status"] == "finished").all()     # the records keep requests in columns
