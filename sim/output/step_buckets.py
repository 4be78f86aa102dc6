"""A replica's steps reduced per time bucket straight from its recorder's columns: the default
steps.csv (a row per replica per second of simulated time) and the plots' step series.

A recorder keeps what changes inside a leap per step and a leap's batch once per row
(sim/records.py), and a million-request run has millions of steps. Every reduction here reads
the per-step columns as stored and the per-row ones per row, never expanded to a value per step:
a bucket's sum of a row value is taken from the rows' running sum at the bucket's two ends, its
maximum from the rows the bucket overlaps. Steps are in time order, so a replica's buckets
(by start time) are runs of consecutive steps.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from sim.records import PER_ROW, PER_STEP, RunRecords, StepRecorder

DEFAULT_INTERVAL_S = 1.0
# The timeline steps.csv: per replica and interval in which it started a step.
TIMELINE_COLUMNS = ("replica", "time_s", "steps", "first_step", "busy_s", "num_seqs", "decode_seqs",
                    "prefill_tokens", "batch_tokens", "running", "waiting", "kv_blocks_used", "kv_blocks_used_mean",
                    "kv_blocks_cached", "preemptions", "host_s", "device_s")
# column -> (recorded column, reduction over the interval's steps)
_TIMELINE = {"num_seqs": ("num_seqs", "mean"), "decode_seqs": ("decode_seqs", "mean"),
             "prefill_tokens": ("prefill_tokens", "sum"), "batch_tokens": ("batch_tokens", "sum"),
             "running": ("running", "max"), "waiting": ("waiting", "max"),
             "kv_blocks_used": ("kv_blocks_used", "max"), "kv_blocks_used_mean": ("kv_blocks_used", "mean"),
             "kv_blocks_cached": ("kv_blocks_cached", "max"), "preemptions": ("preemptions", "sum"),
             "host_s": ("host_s", "sum"), "device_s": ("device_s", "sum")}


class StepBuckets:
    """One replica's steps cut into buckets: `bucket` gives each step's bucket (non-decreasing).
    `ids` are the buckets that hold a step, `firsts` their first steps, `counts` their sizes."""

    def __init__(self, rec: StepRecorder, bucket: np.ndarray):
        self.rec = rec
        n = len(bucket)
        self.firsts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]]) if n else np.zeros(0, np.int64)
        self.ids = bucket[self.firsts]
        self.counts = np.diff(np.r_[self.firsts, n])
        lasts = self.firsts + self.counts - 1
        row_steps = rec.row_column("steps").astype(np.int64)
        self.row_ends = np.cumsum(row_steps)                  # a row's steps are [end - steps, end)
        self.row_steps = row_steps
        self.first_rows = np.searchsorted(self.row_ends, self.firsts, side="right")
        self.last_rows = np.searchsorted(self.row_ends, lasts, side="right")
        self._rows: dict[bool, tuple] = {}       # (_rows_at)

    def reduce(self, column, how: str) -> np.ndarray:
        """Per bucket: 'sum', 'mean' or 'max' over the bucket's steps of a recorded column, or of
        an array with a value per step."""
        if not isinstance(column, str) or column in PER_STEP:
            values = self.rec.step_column(column) if isinstance(column, str) else column
            if not len(values):
                return np.zeros(0)
            if how == "max":
                return np.maximum.reduceat(values, self.firsts)
            total = np.add.reduceat(values.astype(np.float64 if values.dtype.kind == "f" else np.int64),
                                    self.firsts)
        elif column in PER_ROW:
            values = self.rec.row_column(column).astype(np.int64)
            if how == "max":                                    # the rows each bucket overlaps
                return np.maximum(np.maximum.reduceat(values, self.first_rows), values[self.last_rows])
            before = self._whole_rows_sums(values)
            total = self._running_row_sum(values, before, *self._rows_at(ends=True)) - \
                self._running_row_sum(values, before, *self._rows_at(ends=False))
        else:
            raise ValueError(f"step column {column!r}: not recorded")
        return self._finish(total, how)

    def _finish(self, total: np.ndarray, how: str) -> np.ndarray:
        if how == "sum":
            return total
        if how == "mean":
            return total / self.counts
        raise ValueError(f"bucket reduction {how!r}: expected 'sum', 'mean' or 'max'")

    def _whole_rows_sums(self, values: np.ndarray) -> np.ndarray:
        """Index r: the sum of a per-row value over the steps of the rows before row r (integers:
        exact; made once a column for both ends of the buckets)."""
        before = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(values * self.row_steps, out=before[1:])
        return before

    def _rows_at(self, ends: bool) -> tuple[np.ndarray, np.ndarray]:
        """(the row holding step `at`, that row's steps before `at`) where `at` is each bucket's
        end (its first step): found once, the same for each column summed (the search was ~40 % of
        the timeline steps.csv's reductions)."""
        found = self._rows.get(ends)
        if found is None:
            at = self.firsts + self.counts if ends else self.firsts
            row = np.minimum(np.searchsorted(self.row_ends, at, side="right"), len(self.row_steps) - 1)
            row_start = self.row_ends[row] - self.row_steps[row]
            found = self._rows[ends] = (row, np.clip(at - row_start, 0, self.row_steps[row]))
        return found

    @staticmethod
    def _running_row_sum(values: np.ndarray, before: np.ndarray, row: np.ndarray, inside: np.ndarray) -> np.ndarray:
        """Sum of a per-row value over steps [0, at) (`before`: _whole_rows_sums of `values`; `row`
        and `inside`: `_rows_at`'s of `at`)."""
        return before[row] + values[row] * inside

    def first_step(self) -> np.ndarray:
        """The engine step number of each bucket's first step."""
        row_start = self.row_ends[self.first_rows] - self.row_steps[self.first_rows]
        return self.rec.row_column("step").astype(np.int64)[self.first_rows] + (self.firsts - row_start)

    def busy_s(self) -> np.ndarray:
        """Per bucket: the summed duration of its steps."""
        duration = self.rec.step_column("end_s") - self.rec.step_column("start_s")
        return np.add.reduceat(duration, self.firsts) if len(duration) else np.zeros(0)


def held(ids: np.ndarray, values: np.ndarray, buckets: int) -> np.ndarray:
    """Values of the buckets `ids` (ascending) on all `buckets`: an empty bucket holds the previous
    one's value, 0 before the first (a replica's state holds until its next step)."""
    out = np.zeros(buckets)
    index = np.full(buckets, -1, dtype=np.int64)
    index[ids] = np.arange(len(ids))
    index = np.maximum.accumulate(index)
    out[index >= 0] = values[index[index >= 0]]
    return out


class TimelineCuts:
    """A run's steps cut into `buckets` equal time buckets, once per run: each of the plots' step
    series is then reduced over the same cuts (they were made again for each series)."""

    def __init__(self, records: RunRecords, buckets: int):
        recs = [r for r in records.recorders if len(r)]
        t0 = min(float(r.step_column("start_s")[0]) for r in recs)      # (steps are in time order)
        t1 = max(float(r.step_column("end_s")[-1]) for r in recs)
        width = (t1 - t0) / buckets if t1 > t0 else 1.0
        self.buckets, self.edges = buckets, t0 + width * np.arange(buckets + 1)
        self.cuts = [StepBuckets(rec, np.minimum(((rec.step_column("start_s") - t0) / width).astype(np.int64),
                                                 buckets - 1))
                     for rec in sorted(recs, key=lambda r: r.replica)]

    def reduce(self, agg) -> dict[str, np.ndarray]:
        """{column: (replicas, buckets) values}; a 'step_ms' column is the steps' durations in ms."""
        per_replica: dict[str, list[np.ndarray]] = {c: [] for c in agg}
        for cut in self.cuts:
            rec = cut.rec
            for column, how in agg.items():
                values = (rec.step_column("end_s") - rec.step_column("start_s")) * 1e3 if column == "step_ms" \
                    else column
                per_replica[column].append(held(cut.ids, cut.reduce(values, how).astype(np.float64), self.buckets))
        return {c: np.vstack(v) for c, v in per_replica.items()}


def timeline_columns(records: RunRecords, interval_s: float = DEFAULT_INTERVAL_S) -> Optional[dict[str, np.ndarray]]:
    """The timeline steps.csv: a row per replica and `interval_s` of simulated time in which it
    started a step (none for idle intervals); None without a recorder."""
    if not interval_s > 0:
        raise ValueError(f"steps interval {interval_s!r}: expected a positive number of seconds")
    if not records.recorders:
        return None
    parts = [replica_timeline(rec, interval_s) for rec in records.recorders]
    return {name: np.concatenate([p[name] for p in parts]) for name in TIMELINE_COLUMNS}


def replica_timeline(rec: StepRecorder, interval_s: float) -> dict[str, np.ndarray]:
    """One replica's rows of the timeline steps.csv (a spilled run writes them replica by replica)."""
    start = rec.step_column("start_s")
    buckets = StepBuckets(rec, np.floor(start / interval_s).astype(np.int64))
    out = {"replica": np.full(len(buckets.ids), rec.replica, dtype=np.int64),
           "time_s": buckets.ids * interval_s, "steps": buckets.counts.astype(np.int64),
           "first_step": buckets.first_step(), "busy_s": buckets.busy_s()}
    for name, (column, how) in _TIMELINE.items():
        out[name] = buckets.reduce(column, how)
    return out
