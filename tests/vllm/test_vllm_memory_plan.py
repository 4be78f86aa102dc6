"""vLLM's memory plan against public startup logs (tests/data/vllm_public/startup_logs.yaml, each
entry cites its source): kvtwin's memory plan (`plan_memory` on a scenario built
like the deployment, which runs `vllm_memory_plan`) must give vLLM's num_gpu_blocks (or "GPU KV
cache size: N tokens" / 16) within 3%. Entries kvtwin cannot express yet are skipped with their
reason counted; the per-entry table prints with `pytest -s`."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from sim.core.catalog import ModelSpec, get_device, get_model
from sim.core.hf_config import model_fields_from_hf_config
from sim.core.memory import GIB, plan_memory, vllm_memory_plan
from sim.scenario import validate_scenario

DATA = Path(__file__).parents[1] / "data"
TOLERANCE = 0.03
# Hugging Face id -> a catalog model or a cited config.json of the same shape (tests/data/hf_configs)
MODELS = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Meta-Llama-3-8B": "llama-3.1-8b",
          "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b", "Qwen/Qwen2-7B-Instruct": "qwen2.5-7b",
          "meta-llama/Llama-2-7b-hf": "llama-2-7b", "meta-llama/Llama-2-70b-hf": "llama-2-70b",
          "Qwen/Qwen3-0.6B": "qwen3-0.6b", "Qwen/Qwen3-8B": "hf:Qwen__Qwen3-8B",
          "Qwen/Qwen2.5-72B-Instruct": "hf:Qwen__Qwen2-72B-Instruct",
          "moonshotai/Kimi-Dev-72B": "hf:Qwen__Qwen2-72B-Instruct",     # a Qwen2.5-72B fine-tune
          "codellama/CodeLlama-7b-hf": ("llama-2-7b", {"vocab_size": 32016}),
          "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b"}
DEVICES = {"H100-80GB": "h100-sxm", "A100-80GB": "a100-80g", "A100-40GB": "a100-40g", "RTX-4090": "rtx-4090"}


def load_entries() -> list[dict]:
    return yaml.safe_load((DATA / "vllm_public" / "startup_logs.yaml").read_text())["entries"]


def model_for(entry: dict) -> ModelSpec:
    spec = MODELS[entry["model"]]
    name, overrides = spec if isinstance(spec, tuple) else (spec, {})
    if name.startswith("hf:"):
        fields = model_fields_from_hf_config(DATA / "hf_configs" / f"{name[3:]}.json")
    else:
        fields = get_model(name).model_dump()
    return ModelSpec(**{**fields, **overrides, "dtype": entry.get("dtype") or fields.get("dtype", "bfloat16")})


def skip_reason(entry: dict) -> str | None:
    """Why kvtwin cannot compare this entry yet (None when it can)."""
    printed = entry["printed"]
    if entry["model"] not in MODELS:
        return "model shape not in the catalog or tests/data/hf_configs"
    if entry.get("quantization"):
        return "quantized weights"
    if entry.get("pp", 1) != 1:
        return "pipeline parallel"
    if entry.get("hybrid_attention"):
        return "hybrid (sliding-window) attention"
    if entry.get("engine") != "V1" or not entry.get("vllm_version"):
        return "V0 engine or version not printed (V0 profiles differently)"
    if (entry.get("gpu") or {}).get("model") not in DEVICES:
        return "GPU not stated or not in the catalog"
    if entry.get("gpu_memory_utilization") is None:
        return "gpu_memory_utilization not printed"
    if printed.get("num_gpu_blocks") is None and printed.get("kv_cache_tokens") is None:
        return "no block count printed"
    return None


def scenario_for(entry: dict):
    """A kvtwin scenario built like the logged deployment; the engine limits left unset take
    kvtwin's defaults, which are vLLM's API-server defaults."""
    engine = {"gpu_memory_utilization": entry["gpu_memory_utilization"], "vllm_version": entry["vllm_version"],
              "max_model_len": entry.get("max_model_len") or 2048,
              "block_size": entry.get("block_size") or 16, "kv_cache_dtype": entry.get("kv_cache_dtype") or "auto"}
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        if entry.get(key):
            engine[key] = entry[key]
    model = model_for(entry).model_dump()
    # a stand-in shape may have a shorter context than the logged model (CodeLlama on Llama-2's shape)
    model["max_position_embeddings"] = max(model["max_position_embeddings"], engine["max_model_len"])
    return validate_scenario({"model": model, "device": DEVICES[entry["gpu"]["model"]],
                              "parallelism": {"tp": entry["tp"]}, "engine": engine})


def predicted(entry: dict):
    """What a scenario gets by default: plan_memory, on vLLM's plan."""
    return plan_memory(scenario_for(entry))


def measured_blocks(entry: dict) -> int:
    printed = entry["printed"]
    return printed.get("num_gpu_blocks") or printed["kv_cache_tokens"] // 16


def comparable() -> list[dict]:
    return [e for e in load_entries() if skip_reason(e) is None]


# Known misses, kept visible (strict xfail: they fail the 3% today; fixing them turns the test red
# so the mark comes off).
KNOWN_MISSES = {
    "planner-moonshotai-kimi-dev-72b--h100-80gb--tp2pp1dp1--8192":
        "a 72B at tp 2 leaves 3 GiB of 79 for KV: vLLM's weights come out 0.1 GiB above the "
        "parameter count here, and 0.1 GiB is 3% of that pool",
    "planner-qwen-qwen2-5-72b-instruc--h100-80gb--tp2pp1dp1--8192": "the same deployment as Kimi-Dev-72B tp 2",
    "dennislee-vllm-7B-2gpuA10040GB-0.5GRAM-diff-nodes":
        "tp 2 across two nodes: ~0.9 GiB more non-torch memory than on one node (network NCCL buffers)",
}


def marked(entries: list[dict]) -> list:
    return [pytest.param(e, id=e["id"], marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[e["id"]]))
            if e["id"] in KNOWN_MISSES else pytest.param(e, id=e["id"]) for e in entries]


def test_the_table_has_enough_comparable_entries_and_skips_are_counted():
    entries = load_entries()
    skipped = Counter(r for r in map(skip_reason, entries) if r)
    compared = len(entries) - sum(skipped.values())
    print(f"\nvLLM memory plan: {compared} of {len(entries)} public startup logs compared; skipped:")
    for reason, count in skipped.most_common():
        print(f"  {count:3d}  {reason}")
    assert compared >= 12
    assert {e["gpu"]["model"] for e in comparable()} >= {"H100-80GB", "A100-80GB"}
    assert {e["tp"] for e in comparable()} >= {1, 2, 4}


@pytest.mark.parametrize("entry", marked(comparable()))
def test_num_gpu_blocks_within_3_percent(entry):
    plan = predicted(entry)
    blocks = measured_blocks(entry)
    error = plan.num_blocks / blocks - 1
    printed = entry["printed"]
    print(f"\n{entry['id']}: predicted {plan.num_blocks} blocks, vLLM {blocks} ({error:+.2%}); "
          f"KV budget {plan.kv_budget_bytes / GIB:.2f} GiB vs printed {printed.get('available_kv_cache_gib')}; "
          f"activation {plan.activation_bytes / GIB:.2f} vs {printed.get('peak_activation_gib')}; "
          f"non-torch {plan.non_torch_bytes / GIB:.2f} vs {printed.get('non_torch_gib')}")
    assert abs(error) <= TOLERANCE, f"{entry['id']}: {plan.num_blocks} vs {blocks} ({error:+.2%})"


# ----------------------------------------------------------------------------- plan_memory's default

def llama_on(device: str, **engine):
    return validate_scenario({"model": "llama-3.1-8b", "device": device,
                              "engine": {"max_model_len": 4096, **engine}})


# The held-out case of issue 25: vLLM 0.19, Llama-3.1-8B (bf16), one RTX 4090, --gpu-memory-utilization
# 0.9 --max-model-len 32768 --max-num-seqs 256 --max-num-batched-tokens 2048 allocated 2,588 blocks.
HELD_OUT_4090 = {"model": "llama-3.1-8b", "device": "rtx-4090",
                 "engine": {"vllm_version": "0.19", "gpu_memory_utilization": 0.9, "max_model_len": 32768,
                            "max_num_seqs": 256, "max_num_batched_tokens": 2048}}
HELD_OUT_4090_BLOCKS = 2588


def test_the_rtx_4090_plan_term_by_term():
    """vLLM 0.19's plan for the held-out RTX 4090 case, each term as 0.19's code makes it
    (v1/worker/gpu_worker.py determine_available_memory, utils/mem_utils.py memory_profiling,
    v1/worker/utils.py request_memory): requested = ceil(0.9 x the torch-visible total, 23.64 GiB on
    an RTX 4090 (device catalog, cited)); weights; the torch peak of profile_run (a 2,048-token
    forward, then _dummy_sampler_run over 256 fp32 rows of 128,256 logits, top-k/top-p through the
    in-place Triton kernel of v1/sample/ops/topk_topp_triton.py); non-torch growth; no CUDA-graph
    estimate (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 0 in 0.19's envs.py).
    memory_plan=simple (datasheet memory) gives more."""
    plan = plan_memory(validate_scenario(HELD_OUT_4090))
    simple = plan_memory(validate_scenario({**HELD_OUT_4090, "engine": {**HELD_OUT_4090["engine"],
                                                                        "memory_plan": "simple"}}))
    assert plan.visible_bytes / GIB == pytest.approx(23.64, abs=0.005)
    assert plan.budget_bytes == int(plan.visible_bytes * 0.9)
    assert plan.weight_bytes / GIB == pytest.approx(14.96, abs=0.01)
    assert plan.activation_bytes / GIB == pytest.approx(0.48, abs=0.01)
    assert plan.non_torch_bytes / GIB == pytest.approx(0.25) and plan.cudagraph_bytes == 0
    assert plan.num_blocks == 2861 and simple.num_blocks == 2950
    same = vllm_memory_plan(get_model("llama-3.1-8b"), get_device("rtx-4090"), 1, 0.9, 2048, 256)
    assert (plan.num_blocks, plan.visible_bytes, plan.non_torch_bytes, plan.activation_bytes,
            plan.kv_budget_bytes) == (same.num_blocks, same.visible_bytes, same.non_torch_bytes,
                                      same.activation_bytes, same.kv_budget_bytes)
    terms = plan.budget_bytes - plan.weight_bytes - plan.activation_bytes - plan.non_torch_bytes
    assert plan.kv_budget_bytes == terms - plan.cudagraph_bytes
    assert plan.reserved_bytes == plan.non_torch_bytes + plan.cudagraph_bytes


@pytest.mark.xfail(strict=True, reason="not met: vLLM 0.19's code, term by term, gives 2,861 blocks (+10.6 %); "
                   "the run kept 0.52 GiB less for KV than that code accounts for (docs/vllm_semantics.md, "
                   "'Known gap: a consumer GPU's pool'), and no cited reason closes it")
def test_the_held_out_rtx_4090_case_within_3_percent():
    plan = plan_memory(validate_scenario(HELD_OUT_4090))
    assert abs(plan.num_blocks / HELD_OUT_4090_BLOCKS - 1) <= TOLERANCE


def test_version_dependent_terms_follow_engine_vllm_version():
    """From 0.20 vLLM subtracts its CUDA-graph estimate (vllm 0.20.0 envs.py:
    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to "1", "0" in 0.19.0; v1/worker/gpu_worker.py
    determine_available_memory subtracts cudagraph_memory_estimate_applied), and its
    gpu_memory_utilization default is 0.92 (0.20.0 config/cache.py, 0.9 in 0.19.0); before 0.11,
    tp's non-torch memory is small."""
    old = plan_memory(llama_on("h100-sxm"))
    same_util = plan_memory(llama_on("h100-sxm", vllm_version="0.20.0", gpu_memory_utilization=0.9))
    assert old.cudagraph_bytes == 0 < same_util.cudagraph_bytes
    assert same_util.kv_budget_bytes == old.kv_budget_bytes - same_util.cudagraph_bytes
    assert same_util.num_blocks < old.num_blocks
    new = plan_memory(llama_on("h100-sxm", vllm_version="0.21.0"))
    assert new.utilization == 0.92 and old.utilization == 0.9
    assert plan_memory(llama_on("h100-sxm", vllm_version="0.19.1")).cudagraph_bytes == 0
    tp2 = {v: plan_memory(validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm",
                                             "parallelism": {"tp": 2}, "engine": {"vllm_version": v}}))
           for v in ("0.10.1", "0.19.0")}
    assert tp2["0.10.1"].non_torch_bytes < tp2["0.19.0"].non_torch_bytes
    with pytest.raises(ValueError, match="vllm_version"):
        llama_on("h100-sxm", vllm_version="latest")


def test_the_cpu_device_and_num_blocks_keep_their_plans():
    cpu = plan_memory(validate_scenario({"model": "qwen3-0.6b", "device": "cpu", "engine": {"max_model_len": 1024}}))
    assert cpu.memory_plan == "simple" and cpu.non_torch_bytes == 0 and cpu.visible_bytes == cpu.device_bytes
    given = plan_memory(llama_on("h100-sxm", num_blocks=500))
    assert given.num_blocks == 500 and given.from_override and given.non_torch_bytes > 0


def test_a_refusal_names_vllms_terms():
    with pytest.raises(ValueError, match="torch-visible.*profiling-run activation peak.*non-torch.*CUDA graphs"):
        plan_memory(validate_scenario({"model": "llama-3.1-8b", "device": "rtx-4090",
                                       "engine": {"max_model_len": 131072}}))


def test_a_measured_activation_peak_replaces_vllms_estimate():
    """kvtwin's engine on a GPU measures its profiling peak (engine.activation_mib, or a profile's
    activation_scale on kvtwin's estimate): the rest of vLLM's plan stands, so the simulator sizes
    the pool the engine sizes."""
    from sim.core.memory import kvtwin_activation_bytes
    base = plan_memory(llama_on("h100-sxm"))
    measured = plan_memory(llama_on("h100-sxm", activation_mib=3072))
    assert measured.activation_bytes == 3 * GIB
    assert measured.kv_budget_bytes == base.kv_budget_bytes + base.activation_bytes - 3 * GIB
    scaled = plan_memory(llama_on("h100-sxm"), activation_scale=1.5)
    assert scaled.memory_plan == "vllm"
    assert scaled.activation_bytes == kvtwin_activation_bytes(llama_on("h100-sxm"), 1.5) != base.activation_bytes
    assert scaled.non_torch_bytes == base.non_torch_bytes


def test_memory_plan_simple_reproduces_the_quickstarts_earlier_pool():
    """The quickstart (Llama-3.1-8B, one L4) before vLLM's plan was the default: 36,176 tokens, 8.83x."""
    from sim.scenario import load_scenario
    quickstart = Path(__file__).resolve().parents[2] / "scenarios" / "quickstart.yaml"
    simple = plan_memory(load_scenario(quickstart, ["engine.memory_plan=simple"]))
    # (tokens as vLLM prints them: the null block counted, one block above the usable slots)
    assert simple.max_tokens == 36_176 and simple.max_concurrency(4096) == pytest.approx(8.83, abs=0.01)
    assert plan_memory(load_scenario(quickstart)).max_tokens == 33_936


def test_enforce_eager_and_kv_cache_memory_bytes():
    """--enforce-eager: no graphs are captured (0.20.0 gpu_worker.py: the estimate is taken only when
    cudagraph_mode != NONE), so nothing comes off the 0.20 budget. --kv-cache-memory-bytes replaces
    the plan (0.19.0 / 0.20.0 gpu_worker.py determine_available_memory returns the given bytes,
    ignoring gpu_memory_utilization): 20 GiB of Llama-3.1-8B's 2 MiB blocks (128 KiB per token x 16)
    on an H100 is 10,240 blocks, where the profiled plan gives 29,000-odd."""
    graphs = plan_memory(llama_on("h100-sxm", vllm_version="0.20"))
    eager = plan_memory(llama_on("h100-sxm", vllm_version="0.20", enforce_eager=True))
    assert graphs.cudagraph_bytes > 0 == eager.cudagraph_bytes
    assert eager.num_blocks > graphs.num_blocks
    given = plan_memory(llama_on("h100-sxm", kv_cache_memory_bytes=20 * GIB))
    assert given.block_bytes == 2 * 1024 ** 2 and given.num_blocks == 10_240
    assert given.max_tokens == 10_240 * 16
    assert plan_memory(llama_on("h100-sxm")).num_blocks > 27_000


def test_consumer_and_workstation_cards_carry_their_cited_visible_total():
    """vLLM's budget is gpu_memory_utilization x torch.cuda.mem_get_info's total (v1/worker/utils.py
    request_memory, 0.19.0), which a GeForce or workstation card reports below nvidia-smi's figure by
    its own amount: an RTX 4090 23.64 of 23.99 GiB, an RTX PRO 6000 94.97 of 95.59, an L40 44.40 of
    44.99. Each figure cites where it was printed; the plan uses it, not the H100's 0.46 GiB rule."""
    for name, gib in (("rtx-4090", 23.64), ("rtx-pro-6000-server", 94.97), ("rtx-pro-6000-workstation", 94.97),
                      ("l40", 44.40)):
        device = get_device(name)
        assert device.visible_source.startswith("https://github.com/"), name
        assert device.visible_mib / 1024 == pytest.approx(gib, abs=0.005) and device.visible_mib < device.memory_mib
        plan = plan_memory(validate_scenario({"model": "qwen3-0.6b", "device": name,
                                              "engine": {"max_model_len": 4096}}))
        assert plan.visible_bytes == int(device.visible_mib * 1024 ** 2)
