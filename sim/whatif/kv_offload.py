"""One cached prompt, alone on the engine: its TTFT recomputed vs loaded from the CPU tier.

The single-request case vLLM's offloading blog measures ("2-22x faster TTFT for cached prompts",
https://blog.vllm.ai/2026/01/08/kv-offloading-connector.html, H100): the load's copy
(sim/core/offload.py: latency + bytes over the host link) plus the one-token step that follows a
full hit (vLLM recomputes the last prompt token), against the whole prompt's prefill.
"""
from __future__ import annotations

from sim.core.batch import Batch
from sim.core.memory import kv_bytes_per_token
from sim.core.offload import DEFAULT_LATENCY_US, host_link_gbps
from sim.core.request import make_request
from sim.costmodel import CostModel


def cached_prompt_ttft(scenario, prompt_tokens: int) -> tuple[float, float]:
    """(TTFT recomputing the prompt, TTFT loading it from CPU), seconds, for one request alone."""
    cost = CostModel.for_scenario(scenario)
    cfg = scenario.engine.kv_offload
    bs = scenario.engine.block_size
    link = (cfg.bandwidth_gbps if cfg and cfg.bandwidth_gbps else host_link_gbps(scenario.device)) * 1e9
    latency = (cfg.latency_us if cfg else DEFAULT_LATENCY_US) * 1e-6

    def step(computed: int) -> float:
        req = make_request(0, 0.0, [(0, prompt_tokens)], 1)
        req.num_computed = computed
        batch = Batch(0)
        batch.add(req, prompt_tokens - computed, bs)
        host, device = cost.step_time(batch, True)
        return host + device

    tp = scenario.parallelism.tp
    loaded_tokens = (prompt_tokens - 1) // bs * bs          # full blocks below the last token
    copy = latency + loaded_tokens * kv_bytes_per_token(scenario.model, tp, scenario.engine.kv_cache_dtype) * tp / link
    computed = loaded_tokens
    return step(0), copy + step(computed)
