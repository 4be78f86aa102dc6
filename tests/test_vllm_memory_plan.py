"""vLLM's memory plan against public startup logs (tests/data/vllm_public/startup_logs.yaml, each
entry cites its source): kvtwin's `vllm_memory_plan` must give vLLM's num_gpu_blocks (or "GPU KV
cache size: N tokens" / 16) within 3%. Entries kvtwin cannot express yet are skipped with their
reason counted; the per-entry table prints with `pytest -s`."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from sim.core.catalog import ModelSpec, get_device, get_model, model_fields_from_hf_config
from sim.core.memory import GIB, vllm_memory_plan

DATA = Path(__file__).parent / "data"
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
        return "quantized weights (issue 12)"
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


def predicted(entry: dict):
    device = get_device(DEVICES[entry["gpu"]["model"]])
    big = device.memory_mib >= 70 * 1024 and not device.name.startswith("a100")   # vLLM's API-server defaults
    return vllm_memory_plan(model_for(entry), device, entry["tp"], entry["gpu_memory_utilization"],
                            entry.get("max_num_batched_tokens") or (8192 if big else 2048),
                            entry.get("max_num_seqs") or (1024 if big else 256),
                            entry.get("block_size") or 16, entry["vllm_version"],
                            entry.get("kv_cache_dtype") or "auto")


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
