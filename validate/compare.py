"""Predicted vs measured: one table of the headline figures with relative errors, and the
per-step comparison (the cost model evaluated on every measured step's composition)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from sim.costmodel import CostModel

# (row label, summary path) — the rows of the predicted-vs-measured table.
METRICS: list[tuple[str, tuple[str, ...]]] = [
    ("request throughput (req/s)", ("request_throughput",)),
    ("output throughput (tok/s)", ("output_token_throughput",)),
    ("total throughput (tok/s)", ("total_token_throughput",)),
    *[(f"{name} {stat} (s)", (key, stat)) for name, key in
      (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))
      for stat in ("mean", "p50", "p90", "p99")],
    ("KV pool blocks", ("kv_blocks_total",)),
    ("KV blocks peak", ("kv_blocks_peak",)),
    ("KV blocks mean", ("kv_blocks_mean",)),
    ("prefix hit rate", ("prefix_hit_rate",)),
    ("preemptions", ("preemptions",)),
    ("peak device memory (bytes)", ("peak_device_memory_bytes",)),
]

# Relative tolerance per row: the accuracy kvtwin's predictions are held to against the engine on
# an H200 (docs/validation.md, "Running the validation on a GPU"). Rows not listed have none.
GPU_TARGETS = {
    "request throughput (req/s)": 0.05,
    "TTFT p50 (s)": 0.10, "TPOT p50 (s)": 0.10,
    "TTFT p99 (s)": 0.15, "TPOT p99 (s)": 0.15,
    "KV blocks peak": 0.02,
    "peak device memory (bytes)": 0.02,
}


def summary_value(summary: dict, path: tuple[str, ...]) -> Optional[float]:
    node = summary
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return None if node is None else float(node)


def predicted_peak_memory(summary: dict) -> Optional[float]:
    memory = summary.get("memory") or {}
    return memory.get("predicted_peak_bytes")


def comparison_table(predicted: dict, measured: dict, tolerances: Optional[dict[str, float]] = None) -> pd.DataFrame:
    """Rows = METRICS; columns predicted, measured, relative error, tolerance, within."""
    rows = []
    for label, path in METRICS:
        p = summary_value(predicted, path)
        m = summary_value(measured, path)
        if label.startswith("peak device memory"):
            p = predicted_peak_memory(predicted)
        rows.append({"metric": label, "predicted": p, "measured": m, "relative_error": relative_error(p, m)})
    table = pd.DataFrame(rows).set_index("metric")
    tolerances = tolerances or {}
    table["tolerance"] = [tolerances.get(label) for label in table.index]
    table["within"] = [None if pd.isna(t) or pd.isna(e) else bool(abs(e) <= t)
                       for t, e in zip(table["tolerance"], table["relative_error"])]
    return table


def relative_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """(predicted - measured) / measured; exact matches of zero count as 0, else None when undefined."""
    if predicted is None or measured is None or np.isnan(predicted) or np.isnan(measured):
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / abs(measured)


def step_time_comparison(cost: CostModel, measured_steps: pd.DataFrame) -> pd.DataFrame:
    """The cost model on each measured step's composition next to that step's measured time."""
    host, device = cost.step_times(measured_steps)
    out = measured_steps[["step", "num_seqs", "decode_seqs", "prefill_tokens"]].copy()
    out["measured_s"] = (measured_steps["end_s"] - measured_steps["start_s"]).to_numpy()
    out["measured_device_s"] = measured_steps["device_s"].to_numpy()
    out["predicted_s"] = host + device
    out["predicted_device_s"] = device
    out["kind"] = np.where(out["prefill_tokens"] == 0, "decode",
                           np.where(out["decode_seqs"] == 0, "prefill", "mixed"))
    return out


def step_time_errors(steps: pd.DataFrame) -> dict:
    """Median and p90 relative error of predicted step time, overall and per step kind."""
    rel = (steps["predicted_s"] - steps["measured_s"]).abs() / steps["measured_s"]
    out = {"all": _errors(rel)}
    for kind, part in rel.groupby(steps["kind"]):
        out[kind] = _errors(part)
    return out


def _errors(rel: pd.Series) -> dict:
    return {"steps": int(len(rel)), "median_rel_error": float(rel.median()),
            "p90_rel_error": float(rel.quantile(0.9))}


def check_within(table: pd.DataFrame) -> list[str]:
    """Rows outside their tolerance, as readable lines (empty when all pass)."""
    bad = table[table["within"] == False]  # noqa: E712  (None means: no tolerance)
    return [f"{metric}: predicted {row.predicted:.4g}, measured {row.measured:.4g}, error "
            f"{row.relative_error:+.1%} beyond ±{row.tolerance:.0%}" for metric, row in bad.iterrows()]
