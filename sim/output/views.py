"""One run as the output code sees it (a prediction, an engine measurement or a variant), and the
reductions plots and tables share: step series on time buckets, thinned CDFs. No matplotlib."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import pandas as pd

from sim.records import STEP_COLUMNS, RunRecords, requests_frame

TIMELINE_BUCKETS = 1500        # about a plot's width in pixels: finer buckets show nothing more
CDF_POINTS = 2000


@dataclass(eq=False)           # frames do not compare with ==
class RunView:
    """One run as the report sees it: a prediction, an engine measurement or a variant."""

    label: str
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    kv_blocks_total: int           # usable blocks per replica
    replicas: int = 1
    scenario: Any = None           # the validated scenario when known: SLO lines, titles

    @property
    def slo(self) -> dict[str, float]:
        """{'ttft_s': limit, ...} for the SLOs the scenario sets."""
        slo = getattr(self.scenario, "slo", None)
        return {k: getattr(slo, k) for k in ("ttft_s", "tpot_s", "e2e_s") if getattr(slo, k, None) is not None}

    def __post_init__(self) -> None:
        if self.steps.empty:       # a run without steps yields object columns; keep them numeric
            self.steps = pd.DataFrame({c: np.zeros(0) for c in ("replica", *STEP_COLUMNS)})

    @classmethod
    def from_records(cls, label: str, records: RunRecords, summary: dict,
                     requests: Optional[pd.DataFrame] = None,
                     steps: Optional[pd.DataFrame] = None) -> "RunView":
        return cls(label, summary,
                   requests if requests is not None else requests_frame(records),
                   steps if steps is not None else records.steps_frame(),
                   records.kv_blocks_total, max(1, len(records.recorders)))

    @property
    def measured(self) -> pd.DataFrame:
        """Finished, non-warm-up requests: what every latency figure is over (as in metrics)."""
        r = self.requests
        return r[(r["status"] == "finished") & ~r["is_warmup"].astype(bool)]


# ----------------------------------------------------------------------------- downsampling

def timeline(steps: pd.DataFrame, agg: Mapping[str, str], buckets: int = TIMELINE_BUCKETS,
             combine: str = "sum") -> tuple[np.ndarray, pd.DataFrame]:
    """Step series on equal time buckets: (bucket edges in s, one row per bucket).

    Each column is reduced per replica and bucket with its `agg` ('max' keeps peaks such as
    KV blocks used; 'mean' for per-step sizes). A bucket in which a replica starts no step
    holds that replica's previous value, as the records' step function does. Replicas are
    then combined with `combine` ('sum' for cluster-wide states such as blocks used).
    """
    cols = list(agg)
    if steps.empty:
        return np.zeros(0), pd.DataFrame(columns=cols, dtype=float)
    t0, t1 = float(steps["start_s"].min()), float(steps["end_s"].max())
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    bucket = np.minimum(((steps["start_s"].to_numpy() - t0) / width).astype(np.int64), buckets - 1)
    per = steps.groupby([steps["replica"].to_numpy(), bucket])[cols].agg(dict(agg))
    wide = per.unstack(0).reindex(range(buckets)).ffill().fillna(0.0)
    combined = wide.T.groupby(level=0).agg(combine).T
    return t0 + width * np.arange(buckets + 1), combined[cols]


def cdf_points(values: np.ndarray, points: int = CDF_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, cumulative fraction), thinned to `points` evenly spaced ranks (min and max kept)."""
    v = np.sort(np.asarray(values, dtype=float))
    rank = np.unique(np.linspace(0, len(v) - 1, min(points, len(v))).round().astype(np.int64))
    return v[rank], (rank + 1) / len(v)
