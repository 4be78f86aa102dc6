"""What produced the numbers, in words: the setup header every screen and HTML page opens with,
vLLM's own start-up lines for the same pool, and the rejected requests with their reasons.

Everything here reads a run's manifest and summary (plain dicts), so a prediction, an engine
measurement and a variant are described by the same code.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Optional

from sim.output import units


def setup_manifest(scenario) -> dict:
    """What setup_fields reads, for pages that have a scenario but no run (sweeps, plans)."""
    from sim.costmodel import CostModel

    return {"kind": "prediction", "scenario": scenario.model_dump(mode="json"),
            "engine_generation": scenario.engine_generation,
            "cost_model": CostModel.for_scenario(scenario).describe()}


def setup_fields(manifest: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, value) pairs: model, device, tp, engine, workload, SLOs, step-time source."""
    s = manifest.get("scenario") or {}
    if not s:
        return []
    model, device, engine = s.get("model") or {}, s.get("device") or {}, s.get("engine") or {}
    tp = (s.get("parallelism") or {}).get("tp", 1)
    replicas = (s.get("cluster") or {}).get("replicas", 1)
    fields = [("model", f"{model.get('name', '?')} ({model.get('dtype', '?')})"),
              ("device", f"{device.get('name', '?')}" + (f", tp={tp}" if tp else "")
               + (f", {replicas} replicas ({(s.get('cluster') or {}).get('router')})" if replicas > 1 else "")),
              ("engine", engine_words(engine, (manifest.get("cost_model") or {}).get("async_scheduling"),
                                      manifest.get("engine_generation"))),
              ("workload", workload_words(s.get("workload") or {}, manifest)),
              ("SLOs", slo_words(s.get("slo") or {})),
              ("step times", step_time_source(manifest))]
    return fields


def engine_words(engine: Mapping[str, Any], async_scheduling: Optional[bool] = None,
                 generation: Optional[str] = None) -> str:
    """The engine settings that shape the schedule; `async_scheduling` is the resolved switch (the
    scenario may say `auto`), named because it moves the figures (finished requests free late);
    `generation` the resolved vLLM engine generation, named when it is V0 (V1 is the default)."""
    parts = ["vLLM V0 (prefill-first steps)" if engine.get("step_composition") == "prefill_first" else "vLLM V0"] \
        if generation == "v0" else []
    parts += [f"{engine.get('batching', '?')} batching", f"{engine.get('allocation', '?')} KV",
             f"block {engine.get('block_size', '?')}",
             "prefix caching " + ("on" if engine.get("prefix_caching") else "off")]
    if engine.get("kv_cache_dtype", "auto") != "auto":         # halves the KV pool's bytes per token
        parts.append(f"KV cache {engine['kv_cache_dtype']}")
    if engine.get("max_num_seqs"):
        parts.append(f"max_num_seqs {engine['max_num_seqs']:,}")
    if engine.get("max_model_len"):
        parts.append(f"max_model_len {engine['max_model_len']:,}")
    if async_scheduling is not None:
        parts.append("async scheduling " + ("on" if async_scheduling else "off"))
    return ", ".join(parts)


def workload_words(workload: Mapping[str, Any], manifest: Mapping[str, Any]) -> str:
    n = (manifest.get("workload") or {}).get("requests") or workload.get("num_requests")
    head = f"{n:,} requests" if isinstance(n, int) else "requests"
    if workload.get("trace"):
        return f"{head} from a {workload['trace'].get('format', '')} trace"
    if workload.get("requests"):
        return f"{head}, listed in the scenario"
    arrival = workload.get("arrival") or {}
    process = arrival.get("process", "?")
    if process == "offline":
        return f"{head}, all at t=0"
    burst = f" (cv {units.format_value(arrival.get('cv'))})" if process == "gamma" else ""
    return f"{head}, {process} arrivals at {units.format_value(arrival.get('rate'))} req/s{burst}"


def slo_words(slo: Mapping[str, Any]) -> str:
    names = {"ttft_s": "TTFT", "tpot_s": "TPOT", "e2e_s": "E2E"}
    set_ = [f"{names[k]} ≤ {units.ms_unit(v)}" for k, v in slo.items() if k in names and v is not None]
    return ", ".join(set_) + " per request" if set_ else "none set"


def step_time_source(manifest: Mapping[str, Any]) -> str:
    """Where a run's step times came from, in words: datasheet (UNCALIBRATED), operator tables, a
    calibrated profile (a poor fit flagged), from the manifest's cost_model (CostModel.describe())."""
    cost = manifest.get("cost_model") or {}
    if manifest.get("kind") not in (None, "prediction") and not cost:
        return "measured"
    source = cost.get("step_time_source") or ("calibrated" if cost.get("calibrated") else "datasheet")
    if source == "datasheet":
        return ("datasheet (UNCALIBRATED: datasheet peaks x default efficiencies; `simrun calibrate "
                "--from-vllm` fits them to your runs, `step_times: tables` uses measured operators)")
    profile = cost.get("source", "fitted")
    words = {"tables": cost.get("tables") or "operator tables",
             "calibrated": f"calibrated profile ({profile})", "trained": f"trained profile ({profile})",
             "calibrated tables": f"operator tables tuned by a calibrated profile ({profile})"}
    poor = " [POOR FIT: see the profile's fit.warnings]" if cost.get("quality") == "poor" else ""
    return f"{words.get(source, source)}{poor}"


def setup_text(manifest: Mapping[str, Any]) -> list[str]:
    fields = setup_fields(manifest)
    width = max((len(k) for k, _ in fields), default=0)
    return [f"{k:<{width}}  {v}" for k, v in fields]


def vllm_startup_lines(summary: Mapping[str, Any], manifest: Mapping[str, Any]) -> list[str]:
    """The two lines vLLM logs at start-up for the same pool, so the figures can be matched."""
    memory = summary.get("memory") or {}
    tokens = memory.get("max_tokens")
    if tokens is None:
        return []
    lines = [f"GPU KV cache size: {tokens:,} tokens" + _pool_bytes_words(memory, manifest)]
    concurrency = memory.get("max_concurrency_at_max_model_len")
    max_len = ((manifest.get("scenario") or {}).get("engine") or {}).get("max_model_len")
    if concurrency is not None and max_len:
        lines.append(f"Maximum concurrency for {max_len:,} tokens per request: {concurrency:.2f}x")
    return lines


def _pool_bytes_words(memory: Mapping[str, Any], manifest: Mapping[str, Any]) -> str:
    """' (35.8 GiB per GPU; weights 32.9 GiB per GPU; 143 GiB KV and 132 GiB weights over tp=4)':
    vLLM's token count holds for every GPU of a tp group, its bytes are each GPU's share."""
    kv, weights = memory.get("kv_pool_bytes"), memory.get("weight_bytes")
    if kv is None or weights is None:
        return ""
    tp = ((manifest.get("scenario") or {}).get("parallelism") or {}).get("tp") or 1
    total = f"; {units.gib(kv * tp)} KV and {units.gib(weights * tp)} weights over tp={tp}" if tp > 1 else ""
    lora = memory.get("lora_bytes")
    adapters = f", of which LoRA buffers {units.gib(lora)}" if lora else ""
    return f" ({units.gib(kv)} per GPU; weights {units.gib(weights)} per GPU{adapters}{total})"


def rejection_reasons(requests) -> Counter:
    """reason -> count over rejected (and aborted) requests of a requests frame or columns, warm-up
    requests left out (as from the summary's counts and SLO attainment)."""
    import numpy as np

    status = np.asarray(requests["status"], dtype=object)
    ended = (status == "rejected") | (status == "aborted")
    if "is_warmup" in requests:
        ended &= ~np.asarray(requests["is_warmup"]).astype(bool)
    gone = np.flatnonzero(ended)
    if not len(gone):
        return Counter()
    reasons = (np.asarray(requests["reject_reason"], dtype=object)[gone] if "reject_reason" in requests
               else status[gone])
    return Counter(str(r if isinstance(r, str) else s) for r, s in zip(reasons, status[gone]))


def rejection_line(requests, summary: Mapping[str, Any]) -> Optional[str]:
    """'3 requests rejected (counted as SLO misses): prompt + output over max_model_len: 3' or None."""
    reasons = rejection_reasons(requests)
    n = sum(reasons.values())
    if not n:
        return None
    shown = "; ".join(f"{reason}: {c:,}" for reason, c in reasons.most_common(5))
    more = f"; {len(reasons) - 5} more reasons in requests.csv" if len(reasons) > 5 else ""
    slo = " (each counted as an SLO miss)" if summary.get("slo_attainment") is not None else ""
    return f"{n:,} request{'s' if n > 1 else ''} not served{slo}: {shown}{more}"
