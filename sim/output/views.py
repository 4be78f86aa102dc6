"""One run as the output code sees it (a prediction, an engine measurement or a variant), and the
reductions plots and tables share: step series on time buckets, thinned CDFs. No matplotlib."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np

from sim.core.lazy import lazy_import
from sim.output.step_buckets import TimelineCuts
from sim.records import STEP_COLUMNS, RunRecords, requests_frame

pd = lazy_import("pandas")     # frames only where a view was given them: a drawing process imports none

TIMELINE_BUCKETS = 1500        # about a plot's width in pixels: finer buckets show nothing more
CDF_POINTS = 2000

# The step series the plots draw, as (column -> reduction per bucket, combination over replicas):
# RunView.series computes each once, and `drawable` ahead of the drawing processes.
KV_SERIES = ({"kv_blocks_used": "max", "kv_blocks_cached": "max"}, "sum")
QUEUE_SERIES = ({"running": "max", "waiting": "max"}, "sum")
SPLIT_SERIES = ({"decode_seqs": "mean", "prefill_tokens": "mean"}, "mean")
TOKENS_SERIES = ({"batch_tokens": "mean"}, "mean")
STEP_MS_MEAN = ({"step_ms": "mean"}, "mean")
STEP_MS_MAX = ({"step_ms": "max"}, "max")
PLOT_SERIES = (KV_SERIES, QUEUE_SERIES, SPLIT_SERIES, TOKENS_SERIES, STEP_MS_MEAN, STEP_MS_MAX)
LATENCY_COLUMNS = ("ttft_s", "tpot_s", "e2e_s")
PREEMPTION_MARKS = 400       # at most this many marks per run (steps close in time share one)


@dataclass(eq=False)           # frames do not compare with ==
class RunView:
    """One run as the report sees it: a prediction, an engine measurement or a variant."""

    label: str
    summary: dict
    requests: Any                  # a frame, or the request columns (sim.records.request_columns)
    steps: Optional[pd.DataFrame]  # None where the step series come from `records` (or are reduced already)
    kv_blocks_total: int           # usable blocks per replica
    replicas: int = 1
    scenario: Any = None           # the validated scenario when known: SLO lines, titles

    @property
    def slo(self) -> dict[str, float]:
        """{'ttft_s': limit, ...} for the SLOs the scenario sets."""
        slo = getattr(self.scenario, "slo", None)
        return {k: getattr(slo, k) for k in ("ttft_s", "tpot_s", "e2e_s") if getattr(slo, k, None) is not None}

    # reductions already made ({key: value}): `drawable` fills them so a drawing process gets
    # a few thousand numbers per series, not the run's every step and request
    reduced: dict = field(default_factory=dict, repr=False)
    # a prediction's records: its step series are reduced from the recorders' columns (no
    # per-step frame: a million-request run has millions of steps); `steps` is then empty
    records: Optional[RunRecords] = field(default=None, repr=False)
    _measured: Optional[np.ndarray] = field(default=None, init=False, repr=False)   # (_measured_mask)
    _cuts: Optional[TimelineCuts] = field(default=None, init=False, repr=False)     # (series)

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps.empty:   # a run without steps: keep numeric columns
            self.steps = pd.DataFrame({c: np.zeros(0) for c in ("replica", *STEP_COLUMNS)})

    def _reduce(self, key, make):
        if key not in self.reduced:
            self.reduced[key] = make()
        return self.reduced[key]

    @property
    def _recorders(self) -> list:
        """The recorders holding steps, when the steps are read from the records."""
        return [r for r in self.records.recorders if len(r)] if self.records is not None else []

    @property
    def num_steps(self) -> int:
        if self.records is not None:
            return self._reduce("num_steps", lambda: sum(len(r) for r in self.records.recorders))
        return self._reduce("num_steps", lambda: len(self.steps))

    @property
    def max_cached_blocks(self) -> float:
        if self.records is not None:
            return self._reduce("max_cached_blocks", lambda: max(
                (float(r.step_column("kv_blocks_cached").max()) for r in self._recorders), default=0.0))
        return self._reduce("max_cached_blocks",
                            lambda: float(self.steps["kv_blocks_cached"].max()) if len(self.steps) else 0.0)

    def step_ms(self) -> np.ndarray:
        """Every step's duration in ms."""
        if self.records is not None:
            return np.concatenate([np.zeros(0)] + [(r.step_column("end_s") - r.step_column("start_s")) * 1e3
                                                   for r in self._recorders])
        return (self.steps["end_s"] - self.steps["start_s"]).to_numpy() * 1e3

    def step_ms_range(self) -> Optional[tuple[float, float]]:
        """(shortest, longest) step in ms; None without steps."""
        def make():
            ms = self.step_ms()
            return (float(ms.min()), float(ms.max())) if len(ms) else None
        return self._reduce("step_ms_range", make)

    def step_ms_histogram(self, bins: np.ndarray) -> np.ndarray:
        """Steps per duration bin (ms)."""
        return self._reduce(("step_ms_histogram", bins.tobytes()), lambda: histogram(self.step_ms(), bins))

    def series(self, agg: Mapping[str, str], combine: str = "sum") -> tuple[np.ndarray, "Buckets"]:
        """timeline() of the steps (a 'step_ms' column is the step durations)."""
        def make():
            if self._recorders:
                if self._cuts is None:
                    self._cuts = TimelineCuts(self.records, TIMELINE_BUCKETS)
                edges, per_replica = self._cuts.edges, self._cuts.reduce(agg)
                return edges, Buckets({c: _combine(per_replica[c], combine) for c in agg}, TIMELINE_BUCKETS)
            if self.records is not None:
                return timeline({c: np.zeros(0) for c in ("replica", "start_s", "end_s", *agg)}, agg)
            if "step_ms" not in agg:
                return timeline(self.steps, agg, combine=combine)
            steps = {"replica": self.steps["replica"], "start_s": self.steps["start_s"],
                     "end_s": self.steps["end_s"], "step_ms": self.step_ms()}
            return timeline(steps, agg, combine=combine)
        return self._reduce(("series", tuple(agg.items()), combine), make)

    def latency_cdf(self, column: str) -> tuple[np.ndarray, np.ndarray, int]:
        """(thinned sorted values in ms, cumulative fraction, number of samples) over `measured`."""
        def make():
            values = np.asarray(self.requests[column], dtype=float)[self._measured_mask()]
            ms = values[~np.isnan(values)] * 1e3
            return (*cdf_points(ms), len(ms)) if len(ms) else (np.zeros(0), np.zeros(0), 0)
        return self._reduce(("cdf", column), make)

    def preemption_marks(self, marks: int = PREEMPTION_MARKS) -> tuple[np.ndarray, int]:
        """(start times of at most `marks` time buckets holding a preempting step, preemptions in
        all): where the overview marks when preemptions happen."""
        def make():
            if self.records is not None:
                return self._preemption_marks_from_rows(marks)
            steps = self.steps
            if "preemptions" not in steps or not len(steps):
                return np.zeros(0), 0
            count = steps["preemptions"].to_numpy()
            hit = count > 0
            if not hit.any():
                return np.zeros(0), 0
            start = steps["start_s"].to_numpy()
            t0, t1 = float(start.min()), float(steps["end_s"].max())
            width = (t1 - t0) / marks or 1.0
            times = t0 + width * sorted_unique(((start[hit] - t0) / width).astype(np.int64))
            return times, int(count[hit].sum())
        return self._reduce(("preemption_marks", marks), make)

    def _preemption_marks_from_rows(self, marks: int) -> tuple[np.ndarray, int]:
        """preemption_marks from the recorders: a preempting record is one step (a leap never preempts)."""
        recs = self._recorders
        if not recs:
            return np.zeros(0), 0
        counts = [r.row_column("preemptions").astype(np.int64) * r.row_column("steps") for r in recs]
        if not any(c.any() for c in counts):
            return np.zeros(0), 0
        starts = np.concatenate([r.row_column("start_s")[c > 0] for r, c in zip(recs, counts)])
        t0 = min(float(r.step_column("start_s")[0]) for r in recs)
        t1 = max(float(r.step_column("end_s")[-1]) for r in recs)
        width = (t1 - t0) / marks or 1.0
        times = t0 + width * sorted_unique(((starts - t0) / width).astype(np.int64))
        return times, int(sum(int(c.sum()) for c in counts))

    def drawable(self) -> "RunView":
        """This view with every reduction the plots draw made and no frames: what is sent to a
        drawing process (a million-request run's frames would take seconds to copy there)."""
        for agg, combine in PLOT_SERIES:
            self.series(agg, combine)
        for column in LATENCY_COLUMNS:
            self.latency_cdf(column)
        self.num_steps, self.max_cached_blocks, self.step_ms_range()  # noqa: B018 (made and kept)
        self.preemption_marks()
        requests = (self.requests.iloc[:0] if hasattr(self.requests, "iloc")
                    else {c: v[:0] for c, v in self.requests.items()})
        return RunView(self.label, self.summary, requests, None,
                       self.kv_blocks_total, self.replicas, self.scenario, dict(self.reduced))

    @classmethod
    def from_records(cls, label: str, records: RunRecords, summary: dict,
                     requests=None, steps: Optional[pd.DataFrame] = None,
                     step_frame: bool = True) -> "RunView":
        """`requests`: a frame or the request columns. Without `steps` and `step_frame`, the step
        series are reduced from the records' columns and `steps` stays empty."""
        view = cls(label, summary, requests if requests is not None else requests_frame(records),
                   steps if steps is not None else records.steps_frame() if step_frame else None,
                   records.kv_blocks_total, max(1, len(records.recorders)))
        if steps is None and not step_frame:
            view.records = records
        return view

    @property
    def measured(self):
        """Finished, non-warm-up requests: what every latency figure is over (as in metrics); a
        frame, or a mapping of columns where the view holds the request columns."""
        r, keep = self.requests, self._measured_mask()
        if hasattr(r, "iloc"):
            return r[keep]
        return {c: v[keep] for c, v in r.items()}

    def _measured_mask(self) -> np.ndarray:
        """Which requests `measured` keeps (made once: each latency CDF reads one column of them)."""
        if self._measured is None:
            r = self.requests
            self._measured = (np.asarray(r["status"]) == "finished") & ~np.asarray(r["is_warmup"]).astype(bool)
        return self._measured


def step_ms_bins(views: Mapping[str, RunView], bins: int = 60) -> Optional[np.ndarray]:
    """The step-time histogram's bin edges, shared by every run drawn (np.histogram_bin_edges of
    the pooled durations, which depend on their extremes only); None without steps."""
    ranges = [r for v in views.values() if (r := v.step_ms_range()) is not None]
    if not ranges:
        return None
    return np.histogram_bin_edges(np.array([min(lo for lo, _ in ranges), max(hi for _, hi in ranges)]), bins=bins)


def histogram(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """np.histogram(values, edges)'s counts. Edges evenly spaced as np.histogram makes them (step_ms_bins'
    are) are given as their number and range: numpy then bins in one pass instead of sorting every
    value (a 100k-request run's 600k steps: ~40 ms), with the same counts (numpy corrects each
    value's computed bin against the edges)."""
    if len(edges) > 1:
        counts, even = np.histogram(values, len(edges) - 1, range=(edges[0], edges[-1]))
        if np.array_equal(even, edges):
            return counts
    return np.histogram(values, edges)[0]


def drawable_views(views: Mapping[str, RunView]) -> dict[str, RunView]:
    """Each view's `drawable()`, with the step-time histogram on the bins the figure will use."""
    bins = step_ms_bins(views)
    if bins is not None:
        for view in views.values():
            view.step_ms_histogram(bins)
    return {label: view.drawable() for label, view in views.items()}


# ----------------------------------------------------------------------------- downsampling

def timeline(steps, agg: Mapping[str, str], buckets: int = TIMELINE_BUCKETS,
             combine: str = "sum") -> tuple[np.ndarray, "Buckets"]:
    """Step series on equal time buckets: (bucket edges in s, one row per bucket).

    Each column is reduced per replica and bucket with its `agg` ('max' keeps peaks such as
    KV blocks used; 'mean' for per-step sizes). A bucket in which a replica starts no step
    holds that replica's previous value, as the records' step function does. Replicas are
    then combined with `combine` ('sum' for cluster-wide states such as blocks used).
    `steps`: a frame, or a mapping of columns (replica, start_s, end_s and those in `agg`).
    """
    cols = list(agg)
    start = np.asarray(steps["start_s"], dtype=float)
    if len(start) == 0:
        return np.zeros(0), Buckets({c: np.zeros(0) for c in cols}, 0)
    t0, t1 = float(start.min()), float(np.asarray(steps["end_s"], dtype=float).max())
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    bucket = np.minimum(((start - t0) / width).astype(np.int64), buckets - 1)
    replica = np.asarray(steps["replica"])
    order = np.lexsort((bucket, replica))                # (a no-op order for a run's own records)
    bucket, replica = bucket[order], replica[order]
    replicas = sorted_unique(replica)
    combined = {}
    for col in cols:
        values = np.asarray(steps[col], dtype=float)[order]
        per_replica = [_bucketed(values[replica == r], bucket[replica == r], buckets, agg[col]) for r in replicas]
        combined[col] = _combine(np.vstack(per_replica), combine)
    return t0 + width * np.arange(buckets + 1), Buckets({c: combined[c] for c in cols}, buckets)


class Buckets:
    """Step series per time bucket: named columns of one length (what `timeline` gives; numpy
    only, so a drawing process imports no pandas). `len()` is the number of buckets."""

    def __init__(self, columns: Mapping[str, np.ndarray], rows: int):
        self.columns, self.rows = dict(columns), rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def to_numpy(self) -> np.ndarray:
        """(buckets, columns), as a frame's to_numpy()."""
        return np.column_stack(list(self.columns.values())) if self.columns else np.zeros((self.rows, 0))


def _bucketed(values: np.ndarray, bucket: np.ndarray, buckets: int, how: str) -> np.ndarray:
    """One replica's values (bucket indices sorted) reduced per bucket; an empty bucket holds the
    previous one's value, 0 before the first."""
    firsts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    if how == "max":
        reduced = np.maximum.reduceat(values, firsts)
    elif how == "mean":
        reduced = np.add.reduceat(values, firsts) / np.diff(np.r_[firsts, len(values)])
    else:
        raise ValueError(f"timeline reduction {how!r}: expected 'max' or 'mean'")
    out = np.zeros(buckets)
    held = np.full(buckets, -1, dtype=np.int64)
    held[bucket[firsts]] = np.arange(len(firsts))
    held = np.maximum.accumulate(held)
    out[held >= 0] = reduced[held[held >= 0]]
    return out


def _combine(per_replica: np.ndarray, how: str) -> np.ndarray:
    if how == "sum":
        return per_replica.sum(axis=0)
    if how == "mean":
        return per_replica.mean(axis=0)
    if how == "max":
        return per_replica.max(axis=0)
    raise ValueError(f"timeline combination {how!r}: expected 'sum', 'mean' or 'max'")


def cdf_points(values: np.ndarray, points: int = CDF_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, cumulative fraction), thinned to `points` evenly spaced ranks (min and max kept)."""
    v = np.sort(np.asarray(values, dtype=float))
    rank = sorted_unique(np.linspace(0, len(v) - 1, min(points, len(v))).round().astype(np.int64))
    return v[rank], (rank + 1) / len(v)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted, as np.unique gives them. np.unique's first call imports
    numpy.ma (to ask whether the array is masked): ~15 ms that the main process, which draws
    nothing, would otherwise spend on every run with plots."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered
