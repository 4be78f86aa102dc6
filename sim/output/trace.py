"""The Chrome/Perfetto trace of one or more runs (`simrun --trace`)."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from sim.core.lazy import lazy_import
from sim.output.io import write_bytes, write_text
from sim.output.views import RunView

pd = lazy_import("pandas")      # imported where a frame is made (not by a drawing process)

TRACE_MAX_REQUESTS = 5000      # request slices per run in the trace; steps are never capped

# ----------------------------------------------------------------------------- trace

def _us(seconds: pd.Series | np.ndarray) -> list[float]:
    return np.round(np.asarray(seconds, dtype=float) * 1e6, 3).tolist()


def _metadata_events(pid: int, label: str, replicas: int) -> list[dict]:
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    return events + [{"name": "thread_name", "ph": "M", "pid": pid, "tid": r + 1,
                      "args": {"name": f"replica {r} steps"}} for r in range(replicas)]


def _step_events(pid: int, steps: pd.DataFrame) -> list[dict]:
    ints = [steps[c].to_numpy().astype(np.int64).tolist()
            for c in ("step", "replica", "decode_seqs", "prefill_tokens", "kv_blocks_used", "preemptions")]
    ts, dur = _us(steps["start_s"]), _us(steps["end_s"] - steps["start_s"])
    return [{"name": f"step {k}", "ph": "X", "pid": pid, "tid": r + 1, "ts": t, "dur": d,
             "args": {"decode_seqs": a, "prefill_tokens": b, "kv_blocks_used": c, "preemptions": e}}
            for k, r, a, b, c, e, t, d in zip(*ints, ts, dur)]


def _counter_events(pid: int, steps: pd.DataFrame, replicas: int) -> list[dict]:
    """kv_blocks_used, running, waiting per replica, emitted only when the value changes."""
    events = []
    for replica, g in steps.groupby("replica"):
        ts = _us(g["start_s"])
        for column in ("kv_blocks_used", "running", "waiting"):
            values = g[column].to_numpy().astype(np.int64)
            name = column if replicas == 1 else f"{column} r{int(replica)}"
            changed = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
            events += [{"name": name, "ph": "C", "pid": pid, "ts": ts[i],
                        "args": {"value": int(values[i])}} for i in changed]
    return events


def _async(ph: str, name: str, pid: int, rid: str, t_s: float, args: Optional[dict] = None) -> dict:
    event = {"name": name, "cat": "request", "ph": ph, "id": rid, "pid": pid, "ts": round(t_s * 1e6, 3)}
    if args:
        event["args"] = args
    return event


def _request_events(pid: int, requests: pd.DataFrame) -> list[dict]:
    """Per request one async track: 'request N' enclosing queue, prefill and decode.

    Events sharing cat and id nest, so the phases sit under their request; the id carries
    the run's pid because trace ids are global across processes.
    """
    events = []
    for r in requests.itertuples(index=False):
        rid = f"{pid}:{r.id}"
        times = (r.arrival_s, r.admitted_s, r.first_token_s, r.finish_s)
        if all(math.isfinite(t) for t in times):
            args = {"prompt_tokens": int(r.prompt_tokens), "output_tokens": int(r.output_tokens),
                    "cached_tokens": int(r.cached_tokens), "preemptions": int(r.preemptions)}
            events.append(_async("b", f"request {r.id}", pid, rid, r.arrival_s, args))
            for phase, start, end in zip(("queue", "prefill", "decode"), times, times[1:]):
                events += [_async("b", phase, pid, rid, start), _async("e", phase, pid, rid, end)]
            events.append(_async("e", f"request {r.id}", pid, rid, r.finish_s))
        elif math.isfinite(r.arrival_s):      # rejected or aborted: an instant at arrival
            events.append(_async("n", str(r.status), pid, rid, r.arrival_s,
                                 {"reason": r.reject_reason} if isinstance(r.reject_reason, str) else None))
    return events


def write_perfetto_trace(path: str | Path, views: Mapping[str, RunView],
                         max_requests: int = TRACE_MAX_REQUESTS) -> Path:
    """Chrome trace-event JSON for ui.perfetto.dev or chrome://tracing (gzipped if path ends .gz).

    One process per run; per replica a thread of step slices; counters for KV blocks used
    and running/waiting requests; async request slices for the first `max_requests`
    requests by arrival (the rest would bloat the file; otherData says how many are shown).
    """
    events: list[dict] = []
    shown: dict[str, str] = {}
    for pid, (label, v) in enumerate(views.items(), start=1):
        requests = v.requests.sort_values(["arrival_s", "id"], kind="stable").head(max_requests)
        events += _metadata_events(pid, label, v.replicas)
        events += _step_events(pid, v.steps)
        events += _counter_events(pid, v.steps, v.replicas)
        events += _request_events(pid, requests)
        shown[label] = f"first {len(requests):,} of {len(v.requests):,} requests by arrival"
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"generator": "kvtwin sim/output/report.py", "request_slices": shown}}
    text = json.dumps(trace, separators=(",", ":"))      # json.dump would use the slow Python encoder
    if Path(path).suffix == ".gz":                       # both viewers open gzipped traces
        return write_bytes(path, gzip.compress(text.encode(), compresslevel=6))
    return write_text(path, text)
