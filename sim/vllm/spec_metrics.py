"""Speculative decoding's acceptance fitted from vLLM's Prometheus counters (a /metrics scrape):
vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens
and vllm:spec_decode_num_accepted_tokens_per_pos{position=...} (vllm/v1/spec_decode/metrics.py,
SpecDecodingProm; per-position rate = accepted at the position / drafts, its docstring's PromQL).
"""
from __future__ import annotations

import math
from pathlib import Path

from sim.core.files import read_text
from sim.errors import UserError
from sim.vllm.timeseries import prometheus_samples

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
MAX_POSITIONS = 64


def spec_counters(text: str) -> tuple[float, float, dict[int, float]]:
    """(drafts, accepted tokens, accepted per position) summed over the scrape's engines."""
    drafts = accepted = 0.0
    per_pos: dict[int, float] = {}
    for name, labels, value, _ in prometheus_samples(text):
        if not math.isfinite(value) or value < 0:
            continue
        if name == DRAFTS:
            drafts += value
        elif name == ACCEPTED:
            accepted += value
        elif name == PER_POS and _is_position(labels.get("position", "")):
            pos = int(labels["position"])
            if pos < MAX_POSITIONS:
                per_pos[pos] = per_pos.get(pos, 0.0) + value
    return drafts, accepted, per_pos


def _is_position(label: str) -> bool:
    # ASCII digits: '²'.isdigit() holds, and int('²') fails
    return label.isascii() and label.isdigit() and len(label) <= 4


def fitted_rates(drafts: float, accepted: float, per_pos: dict[int, float], k: int) -> list[float]:
    """Per-position acceptance for k draft tokens: measured where the scrape has every position,
    else the geometric a^(i+1) whose expected accepted drafts per draft match the totals."""
    if drafts <= 0:
        raise UserError(f"the scrape counts no drafts ({DRAFTS}): speculative decoding never ran")
    if set(range(k)) <= set(per_pos):
        rates, floor = [], 1.0
        for i in range(k):               # (cumulative by construction; a running minimum guards rounding)
            floor = min(floor, per_pos[i] / drafts, 1.0)
            rates.append(floor)
        return rates
    mean = accepted / drafts
    if not 0 <= mean <= k:
        raise UserError(f"{accepted:g} accepted tokens over {drafts:g} drafts is not between 0 and k={k} per draft")
    lo, hi = 0.0, 1.0
    for _ in range(60):                  # bisection: sum a^(i+1) grows with a
        mid = (lo + hi) / 2
        if sum(mid ** (i + 1) for i in range(k)) < mean:
            lo = mid
        else:
            hi = mid
    a = min(max((lo + hi) / 2, 0.0), 1.0)
    return [a ** (i + 1) for i in range(k)]


def acceptance_from_scrape(path: str | Path, k: int) -> list[float]:
    """The per-position acceptance rates a /metrics scrape file measured, for k draft tokens."""
    drafts, accepted, per_pos = spec_counters(read_text(path, "a vLLM /metrics scrape"))
    return fitted_rates(drafts, accepted, per_pos, k)
