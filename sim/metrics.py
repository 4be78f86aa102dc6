"""Records -> summary, with vLLM's benchmark definitions (docs/vllm_semantics.md section 6).

TTFT = first token - arrival; E2E = last token - arrival; TPOT = (E2E - TTFT) / (output - 1),
over requests with more than one output token; ITL = gaps between successive tokens of a
request, pooled over all requests; goodput = requests meeting every SLO per second.
Warm-up requests are excluded from every figure; throughput is over the span from the
first measured arrival to the last measured finish.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from sim import exact, exact_disk
from sim.exact_disk import linear_percentiles
from sim.core.lazy import lazy_import
from sim.records import RunRecords, itl_samples, request_columns

# pandas only for frames given in (and the rejection reasons' counting): the summary of a
# prediction is made from numpy columns
pd = lazy_import("pandas")

PERCENTILES = (50, 90, 99)


def percentiles(values: np.ndarray, qs) -> np.ndarray:
    """np.percentile(values, qs) of NaN-free float values, bit for bit: the same partition (numpy
    partitions a copy at the ranks it reads plus the first and the last) and numpy's own
    interpolation (exact_disk.linear_percentiles). np.percentile finds those ranks with np.unique,
    whose first call imports numpy.ma (~15 ms of every run, for nothing masked)."""
    n = len(values)

    def kth(ranks: list[int]) -> dict:
        part = np.partition(values, sorted({0, n - 1, *ranks}))
        return {r: part[r] for r in ranks}
    return linear_percentiles(n, qs, kth)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """np.percentile(np.repeat(values, weights), q) without building the repeated array."""
    return weighted_percentiles(values, weights, (q,))[0]


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs) -> list[float]:
    """weighted_percentile at each q: the value at each weighted rank read (weighted_ranks), then
    interpolated as exact_disk.weighted_percentiles does for a spilled run's sample."""
    total = int(np.sum(weights, dtype=np.int64))
    return exact_disk.weighted_percentiles(total, qs, lambda ranks: weighted_ranks(values, weights, ranks))


# A sample this short is sorted whole; a longer one (the ITL sample: a value per step, millions)
# is sorted only between bounds that a strided subsample of about SUBSAMPLE values brackets.
SORTED_WHOLE, SUBSAMPLE = 1 << 16, 1 << 14


def weighted_ranks(values: np.ndarray, weights: np.ndarray, ranks) -> dict[int, np.float64]:
    """{k: the least value whose weight at or below it exceeds k} for each k in `ranks` (the value
    at running weight k of the sample sorted). Any sort gives these values, whatever order ties
    take (the running weight is an exact integer sum), so numpy's unstable sort serves; -0.0 and
    0.0 tie, as in exact_disk.py, and no gap is -0.0. A long sample is not sorted whole (that was
    ~0.2 s of a 100k-request summary, ~2 s at 1M): the value at rank k lies between bounds lo and hi
    when the weight below lo is at most k and the weight up to hi exceeds k, and only the values
    between them are sorted; bounds from a strided subsample, widened until they hold (at worst
    to the whole sample)."""
    values, weights = np.asarray(values), np.asarray(weights)
    if len(values) <= SORTED_WHOLE:
        return _ranks_between(values, weights, ranks, -np.inf, np.inf)
    step = len(values) // SUBSAMPLE
    sub = values[::step]
    order = np.argsort(sub, kind="quicksort")
    sub = sub[order]
    running = np.cumsum(weights[::step][order], dtype=np.int64)
    scale = int(np.sum(weights, dtype=np.int64)) / max(int(running[-1]), 1)
    out: dict[int, np.float64] = {}
    for k in sorted(set(ranks)):
        if k in out:
            continue
        at = int(np.searchsorted(running * scale, k, side="right"))
        margin = 64
        while True:
            lo = sub[at - margin] if at - margin >= 0 else -np.inf
            hi = sub[at + margin] if at + margin < len(sub) else np.inf
            found = _ranks_between(values, weights, [r for r in ranks if r >= k], lo, hi)
            if k in found:
                out.update(found)
                break
            if lo == -np.inf and hi == np.inf:     # the whole sample: k is past its total weight
                raise ValueError(f"weighted rank {k} is outside the sample's total weight")
            margin *= 4
    return out


def _ranks_between(values: np.ndarray, weights: np.ndarray, ranks, lo, hi) -> dict[int, np.float64]:
    """weighted_ranks' values for the ranks that the values from lo to hi hold (those ranks only)."""
    below = int(np.sum(weights, where=values < lo, dtype=np.int64))
    inside = (values >= lo) & (values <= hi)
    between, their_weights = values[inside], weights[inside]
    order = np.argsort(between, kind="quicksort")
    running = np.cumsum(their_weights[order], dtype=np.int64)
    running += below
    held = [k for k in ranks if below <= k < (int(running[-1]) if len(running) else below)]
    at = np.searchsorted(running, held, side="right")
    return {k: between[order[i]] for k, i in zip(held, at.tolist())}


def distribution(values: np.ndarray, weights: Optional[np.ndarray] = None) -> dict[str, Optional[float]]:
    """mean, p50, p90, p99 (and max) of a sample; None entries when it is empty."""
    # contiguous, as a copy would be: numpy sums a strided array in buffered chunks, other figures
    values = np.ascontiguousarray(values, dtype=float)
    weights = None if weights is None else np.ascontiguousarray(weights)
    missing = np.isnan(values)
    if missing.any():                 # (no copy of a sample without NaN: the ITL's is a value per step)
        values = values[~missing]
        if weights is not None:
            weights = weights[~missing]
    if values.size == 0 or (weights is not None and weights.sum() == 0):
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    if weights is None:
        # one call for every q: the same figures as one call per q (each q is interpolated alone)
        mean, cuts = values.mean(), percentiles(values, PERCENTILES)
    else:
        mean, cuts = np.average(values, weights=weights), weighted_percentiles(values, weights, PERCENTILES)
    out = {"mean": float(mean), **{f"p{p}": float(c) for p, c in zip(PERCENTILES, cuts)}}
    out["max"] = float(values.max())
    return out


def meets_slo(requests, slo) -> np.ndarray:
    """Per request: every SLO that is set is met (a 1-token answer has TPOT 0, as in vLLM).
    `requests`: a frame or a mapping of columns."""
    ok = np.ones(len(requests["ttft_s"]), dtype=bool)
    if slo.ttft_s is not None:
        ok &= np.asarray(requests["ttft_s"], dtype=float) <= slo.ttft_s
    if slo.tpot_s is not None:
        tpot = np.asarray(requests["tpot_s"], dtype=float)
        ok &= np.where(np.isnan(tpot), 0.0, tpot) <= slo.tpot_s
    if slo.e2e_s is not None:
        ok &= np.asarray(requests["e2e_s"], dtype=float) <= slo.e2e_s
    return ok


Columns = Mapping[str, np.ndarray]


def summarise(records: RunRecords, slo=None, requests=None, steps=None) -> dict[str, Any]:
    """The summary.json figures of one run. `requests`: the request columns
    (sim.records.request_columns) or a requests frame; made from the records when not given.
    `steps`: a per-step frame, or figures with _Steps' methods taken elsewhere (a spilled run's,
    sim/output/streamed.py); read from the records when not given.
    Every figure is computed on numpy arrays as pandas computed it on the frame (sim/exact.py)."""
    cols = _request_columns(records, requests)
    warm = cols["is_warmup"].astype(bool)
    status = cols["status"]
    keep = (status == "finished") & ~warm
    measured = {c: cols[c][keep] for c in _MEASURED_COLUMNS if c in cols}
    n_measured = int(keep.sum())
    if steps is None or isinstance(steps, pd.DataFrame):
        steps = _Steps(records, steps)
    offered = int((~warm).sum())
    duration = _duration(measured, n_measured)
    n_out = exact.nansum(measured["output_tokens"])
    n_in = exact.nansum(measured["prompt_tokens"])
    # the ITL sample (a value per step) let go once its figures are taken
    itl = distribution(*itl_samples(records, measured["id"]))
    has_slo = slo is not None and any(v is not None for v in (slo.ttft_s, slo.tpot_s, slo.e2e_s))
    rate = (lambda x: x / duration if duration > 0 else None)   # noqa: E731
    steady = status[~warm]
    met = int(meets_slo(measured, slo).sum()) if has_slo else 0
    summary = {
        # requests_total counts warm-up requests; finished / rejected / aborted count the rest
        "requests_total": int(len(status)),
        "requests_finished": n_measured,
        "requests_rejected": int((steady == "rejected").sum()),
        "requests_aborted": int((steady == "aborted").sum()),
        "rejection_reasons": rejection_reasons(cols),
        "requests_measured": n_measured,
        "warmup_requests": int(exact.nansum(cols["is_warmup"])),
        "duration_s": duration,
        "request_throughput": rate(n_measured),
        "output_token_throughput": rate(float(n_out)),
        "total_token_throughput": rate(float(n_in + n_out)),
        "ttft_s": distribution(measured["ttft_s"]),
        "tpot_s": distribution(measured["tpot_s"]),
        "itl_s": itl,
        "e2e_s": distribution(measured["e2e_s"]),
        "goodput": rate(float(met)) if has_slo else None,
        # over every non-warm-up request: a rejected or aborted request missed its SLOs
        "slo_attainment": (float(np.int64(met) / offered) if has_slo and offered else None),
        "prefix_hit_rate": float(exact.nansum(measured["cached_tokens"]) / n_in) if n_in else 0.0,
        "preemptions": steps.preemptions() if steps.count else 0,
        "kv_evictions": records.meta.get("kv_evictions"),    # cached blocks reused for other tokens
        # speculative decoding's acceptance (sim/core/speculative.py), only in runs that use it
        **({"speculative": records.meta["speculative"]} if "speculative" in records.meta else {}),
        # LoRA adapters' loads and the max_loras limit (sim/core/lora.py), only in runs that serve them
        **({"lora": records.meta["lora"]} if "lora" in records.meta else {}),
        "latency_split": _latency_split(measured),
        **_kv_figures(records, steps),
        **_step_figures(steps),
    }
    if "data_parallel" in records.meta:       # (sim/dp.py: only data-parallel runs carry it)
        summary["data_parallel"] = records.meta["data_parallel"]
    if "routing_regret" in records.meta:      # (sim/routers/regret.py)
        summary["routing_regret"] = records.meta["routing_regret"]
    if "kv_offload" in records.meta:        # (only where engine.kv_offload is set: old summaries unchanged)
        summary["kv_offload"] = offload_summary(records.meta["kv_offload"], int(exact.nansum(cols["prompt_tokens"])))
    if len(records.recorders) > 1:
        summary["replicas"] = _replica_figures(measured, steps, duration, len(records.recorders))
    return summary


def _request_columns(records: RunRecords, requests) -> dict[str, np.ndarray]:
    """The requests as numpy columns: as given, from a frame, or from the records."""
    if requests is None:
        return request_columns(records)
    if isinstance(requests, dict):
        return requests
    return {c: requests[c].to_numpy() for c in requests.columns}      # a frame


def offload_summary(tier: dict, prompt_tokens: int) -> dict:
    """The CPU tier's totals (sim/core/offload.py) and the share of prompt tokens each tier served
    (every request, warm-up included: the tiers' counters do not tell them apart)."""
    share = (lambda n: n / prompt_tokens if prompt_tokens else 0.0)   # noqa: E731
    return {**tier, "gpu_hit_rate": share(tier["gpu_hit_tokens"]), "cpu_hit_rate": share(tier["cpu_hit_tokens"]),
            "gib_loaded": tier["bytes_loaded"] / 2**30, "gib_stored": tier["bytes_stored"] / 2**30}


# What the summary reads of the measured requests.
_MEASURED_COLUMNS = ("id", "replica", "arrival_s", "finish_s", "prompt_tokens", "output_tokens", "cached_tokens",
                     "ttft_s", "tpot_s", "e2e_s", "queue_s", "host_s", "device_s")
# What the summary reads of the steps: per step (they change inside a leap), and per row (a
# leap's batch, with its step count).
_PER_STEP = ("start_s", "end_s", "kv_blocks_used", "slack_tokens")
_PER_ROW = ("num_seqs", "batch_tokens", "running", "preemptions")


class _Steps:
    """The summary's step series: from a given per-step frame (a row per step), or straight from
    the records' columns (no frame built, rows not expanded: a million requests' steps)."""

    def __init__(self, records: RunRecords, frame: Optional[pd.DataFrame]):
        if frame is not None:
            get = (lambda c: frame[c].to_numpy() if c in frame else np.zeros(0))      # noqa: E731
            per_step = {c: get(c) for c in ("replica", *_PER_STEP)}
            rows = {c: get(c) for c in ("replica", *_PER_ROW)}
            rows["steps"] = np.ones(len(rows["replica"]), dtype=np.int64)
        else:
            per_step, rows = records.step_series(_PER_STEP), records.row_series(_PER_ROW)
        # integers stay as stored (int32 mostly): their max, sum and float average are the same
        # (products are taken in int64)
        self.step = {c: v.astype(np.float64, copy=False) if c in ("start_s", "end_s") else v
                     for c, v in per_step.items()}
        self.row = rows
        self.count = len(self.step["end_s"])
        self._dur = None

    def durations(self) -> np.ndarray:
        if self._dur is None:
            self._dur = self.step["end_s"] - self.step["start_s"]
        return self._dur

    def kv_used_mean(self) -> float:
        """The KV blocks in use, time-weighted over busy time: a step's KV state holds for its duration."""
        dur, used = self.durations(), self.step["kv_blocks_used"]
        return float(np.average(used, weights=dur)) if dur.sum() > 0 else float(used.mean())

    def replica_steps(self, replica: int) -> int:
        return int(np.count_nonzero(self.step["replica"] == replica))

    def kv_peak(self, replica: Optional[int] = None) -> int:
        used = self.step["kv_blocks_used"]
        if replica is not None:
            used = used[self.step["replica"] == replica]
        return int(used.max()) if len(used) else 0

    def slack_peak(self) -> int:
        return int(self.step["slack_tokens"].max())

    def peak_running(self) -> int:
        return int(self.row["running"].max())

    def mean_step_s(self) -> float:
        return float(exact.nanmean(self.durations()))

    def _per_step_total(self, column: str, keep=slice(None)) -> int:
        """Sum over steps of a per-row integer column (each row's value times its step count)."""
        return int(np.multiply(self.row[column][keep], self.row["steps"][keep], dtype=np.int64).sum())

    def preemptions(self, replica: Optional[int] = None) -> int:
        keep = slice(None) if replica is None else self.row["replica"] == replica
        return self._per_step_total("preemptions", keep)

    def mean_per_step(self, column: str) -> float:
        """pandas' mean over a per-step column of integers (float64 sum / count), from the rows:
        the integer sum is exact, and so is its float64 sum below 2**53, so the figure is the same."""
        return float(np.float64(self._per_step_total(column)) / np.float64(self.count))


def rejection_reasons(requests) -> list[dict[str, Any]]:
    """[{reason (its numbers as N), count}] over rejected requests, most first; warm-up requests
    are left out, as from requests_rejected. A list, so a sweep's flattened table keeps fixed
    columns. (pandas' counting, for its order of ties, made only when something was rejected.)"""
    rejected = np.asarray(requests["status"]) == "rejected"
    if "is_warmup" in requests:
        rejected &= ~np.asarray(requests["is_warmup"]).astype(bool)
    if not rejected.any():
        return []
    reasons = pd.Series(np.asarray(requests["reject_reason"], dtype=object)[rejected]).fillna("unknown")
    kinds = reasons.astype(str).str.replace(r"\d+", "N", regex=True).value_counts()
    return [{"reason": str(k), "count": int(v)} for k, v in kinds.items()]


def _replica_figures(measured: Columns, steps: _Steps, duration: float,
                     replicas: int) -> list[dict[str, Any]]:
    """Per replica: its share of the measured requests and their figures. Throughputs are
    over the cluster's duration, so the replicas' throughputs add up to the cluster's."""
    out = []
    for index in range(replicas):
        mask = measured["replica"] == index
        mine = {c: v[mask] for c, v in measured.items()}
        count = int(mask.sum())
        own_steps = steps.replica_steps(index)
        n_in = exact.nansum(mine["prompt_tokens"])
        out.append({
            "replica": index,
            "requests": count,
            "request_throughput": count / duration if duration > 0 else None,
            "output_token_throughput": float(exact.nansum(mine["output_tokens"])) / duration if duration > 0 else None,
            "ttft_s_p99": distribution(mine["ttft_s"])["p99"],
            "tpot_s_p99": distribution(mine["tpot_s"])["p99"],
            "kv_blocks_peak": steps.kv_peak(index),
            "prefix_hit_rate": float(exact.nansum(mine["cached_tokens"]) / n_in) if n_in else 0.0,
            "preemptions": steps.preemptions(index) if own_steps else 0,
        })
    return out


def replica_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """The per-replica figures as a table in display units (ms, %)."""
    frame = pd.DataFrame(summary.get("replicas") or [])
    if frame.empty:
        return frame
    for column in ("ttft_s_p99", "tpot_s_p99"):
        frame[column] = pd.to_numeric(frame[column]) * 1e3
    frame["prefix_hit_rate"] = frame["prefix_hit_rate"] * 100
    return frame.rename(columns={"request_throughput": "req/s", "output_token_throughput": "output tok/s",
                                 "ttft_s_p99": "TTFT p99 (ms)", "tpot_s_p99": "TPOT p99 (ms)",
                                 "kv_blocks_peak": "KV blocks peak", "prefix_hit_rate": "prefix hit (%)"})


def _duration(measured: Columns, count: int) -> float:
    if not count:
        return 0.0
    return float(exact.nanmax(measured["finish_s"]) - exact.nanmin(measured["arrival_s"]))


def _latency_split(measured: Columns) -> dict[str, Optional[float]]:
    total = exact.nansum(measured["e2e_s"])
    if not total:
        return {"queue": None, "host": None, "device": None}
    return {k: float(exact.nansum(measured[f"{k}_s"]) / total) for k in ("queue", "host", "device")}


def _kv_figures(records: RunRecords, steps: _Steps) -> dict[str, Any]:
    total = records.kv_blocks_total
    if not steps.count:
        return {"kv_blocks_total": total, "kv_blocks_peak": 0, "kv_blocks_mean": 0.0,
                "kv_usage_mean": 0.0, "kv_usage_peak": 0.0, "kv_slack_tokens_peak": 0}
    mean_used, peak = steps.kv_used_mean(), steps.kv_peak()
    return {"kv_blocks_total": total, "kv_blocks_peak": peak, "kv_blocks_mean": mean_used,
            "kv_usage_mean": mean_used / total if total else 0.0,
            "kv_usage_peak": peak / total if total else 0.0,
            "kv_slack_tokens_peak": steps.slack_peak()}


def _step_figures(steps: _Steps) -> dict[str, Any]:
    if not steps.count:
        return {"num_steps": 0, "mean_batch_seqs": 0.0, "mean_batch_tokens": 0.0, "peak_running": 0}
    # the same figures, to the last bit, as pandas' means over a per-step frame's columns
    return {"num_steps": steps.count, "mean_batch_seqs": steps.mean_per_step("num_seqs"),
            "mean_batch_tokens": steps.mean_per_step("batch_tokens"),
            "peak_running": steps.peak_running(), "mean_step_s": steps.mean_step_s()}


# Public names for a spilled run's summary, taken block by block (sim/output/streamed.py).
MEASURED_COLUMNS, SUMMARY_STEP_COLUMNS, SUMMARY_ROW_COLUMNS = _MEASURED_COLUMNS, _PER_STEP, _PER_ROW
