"""A run measured outside the engine (a live endpoint, a vLLM result file) in records.py's
schema: its requests frame and sim.metrics' summary, with what a black-box endpoint cannot show
set to None and the KV figures taken from scraped /metrics."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from sim.core.lazy import lazy_import

np = lazy_import("numpy")      # on first use: `simrun bench -h` stays light
pd = lazy_import("pandas")

REQUEST_COLUMNS = ("id", "replica", "tenant", "priority", "conversation", "is_warmup", "status",
                   "reject_reason", "arrival_s", "prompt_tokens", "output_tokens", "cached_tokens",
                   "preemptions", "admitted_s", "first_token_s", "finish_s", "host_s", "device_s",
                   "ttft_s", "e2e_s", "tpot_s", "queue_s")
# Figures a black-box endpoint does not show: None rather than the zeros of an empty step table.
UNSEEN = ("num_steps", "mean_batch_seqs", "mean_batch_tokens", "peak_running", "mean_step_s",
          "kv_slack_tokens_peak")


@dataclass
class Measured:
    """A run measured outside the engine: from a live endpoint or a result file."""

    summary: dict
    requests: pd.DataFrame
    manifest: dict
    kv_blocks_total: int = 0
    timeline: Optional[pd.DataFrame] = None     # scraped /metrics, when there was one
    # running / waiting / KV % over time (sim.vllm.timeseries): the scrapes, or a server log
    series: Optional[pd.DataFrame] = None
    series_offset: Optional[float] = None       # run time = series t_s + offset, when known
    run_t0_wall: Optional[float] = None         # the run's start, seconds since the epoch (log clock)

    def view(self):
        from sim.output.report import RunView

        return RunView("measured", self.summary, self.requests, pd.DataFrame(), self.kv_blocks_total)


def complete_frame(rows: list[dict]) -> pd.DataFrame:
    """Per-request rows (arrival_s, ttft_s, e2e_s and counts) -> records.py's requests schema."""
    df = pd.DataFrame(rows)
    for name in REQUEST_COLUMNS:
        if name not in df:
            df[name] = 0 if name == "replica" else np.nan
    df["first_token_s"] = df["arrival_s"] + df["ttft_s"]
    df["finish_s"] = df["arrival_s"] + df["e2e_s"]
    decode = df["output_tokens"] - 1
    df["tpot_s"] = np.where(decode > 0, (df["e2e_s"] - df["ttft_s"]) / decode.clip(lower=1), np.nan)
    return df[list(REQUEST_COLUMNS)]


def measured_summary(frame: pd.DataFrame, itl: np.ndarray, slo, kv_blocks_total: int,
                     block_size: int) -> dict:
    """sim.metrics.summarise over a measured frame and the client's ITL samples."""
    from sim.metrics import summarise
    from sim.records import RunRecords

    records = RunRecords([], [], kv_blocks_total, block_size, explicit_itl=np.asarray(itl, dtype=float))
    summary = summarise(records, slo, frame, pd.DataFrame())
    summary.update({key: None for key in UNSEEN})
    summary["latency_split"] = {"queue": None, "host": None, "device": None}
    summary["requests_failed"] = int((frame["status"] == "failed").sum())
    summary["partial"] = bool((frame["status"] != "finished").any())
    reasons = Counter(frame.loc[frame["status"] != "finished", "reject_reason"].dropna())
    summary["failures"] = dict(reasons.most_common(5))
    if frame["cached_tokens"].isna().all():
        summary["prefix_hit_rate"] = None
    return summary


def apply_timeline(summary: dict, scraped: Optional[pd.DataFrame], kv_blocks_total: int) -> None:
    """KV, preemption and prefix-cache figures from the scraped /metrics (None without it)."""
    summary.update(kv_blocks_total=kv_blocks_total or None, kv_usage_peak=None, kv_usage_mean=None,
                   kv_blocks_peak=None, kv_blocks_mean=None, preemptions=None)
    if scraped is None or scraped.empty:
        return
    busy = scraped[(scraped["running"] + scraped["waiting"]) > 0]
    usage = busy["kv_usage"] if len(busy) else scraped["kv_usage"]
    summary.update(kv_usage_peak=float(scraped["kv_usage"].max()), kv_usage_mean=float(usage.mean()),
                   peak_running=int(scraped["running"].max()))
    if kv_blocks_total:
        summary.update(kv_blocks_peak=round(summary["kv_usage_peak"] * kv_blocks_total),
                       kv_blocks_mean=summary["kv_usage_mean"] * kv_blocks_total)
    first, last = scraped.iloc[0], scraped.iloc[-1]
    if not math.isnan(last["preemptions"]):
        summary["preemptions"] = int(last["preemptions"] - first["preemptions"])
    queries = last["prefix_queries"] - first["prefix_queries"]
    if summary["prefix_hit_rate"] is None and queries > 0:   # per-request cached counts win when present
        summary["prefix_hit_rate"] = float((last["prefix_hits"] - first["prefix_hits"]) / queries)
