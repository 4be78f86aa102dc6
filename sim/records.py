"""Run records, one schema for the simulator and the engine (ARCHITECTURE.md "Records").

Steps carry times; requests carry step indices (admission, first token, finish, the runs
of consecutive steps in which they emitted a token, the steps of prefill chunks that
emitted nothing). A token is emitted at the end of its step, so every request time is a
step time: the simulator and the engine share this code, differing only in where step
times come from (a cost model, or clocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pandas as pd

from sim.core.request import Request, Status

STEP_COLUMNS = ("step", "start_s", "end_s", "running", "waiting", "num_seqs", "decode_seqs",
                "prefill_tokens", "batch_tokens", "decode_ctx", "prefill_ctx", "prefill_attn", "blocks_read",
                "kv_blocks_used", "kv_blocks_cached", "slack_tokens", "preemptions", "host_s", "device_s")


_COLUMN_INDEX = {name: i for i, name in enumerate(STEP_COLUMNS)}


class StepRecorder:
    """Collects one row per engine step.

    Rows are appended as tuples (cheap per step) and packed into float64 chunks every
    CHUNK steps, so a 100k-request run holds 120 bytes per step, not a Python object per value.
    """

    CHUNK = 32_768

    def __init__(self, replica: int = 0):
        self.replica = replica
        self.rows: list[tuple] = []
        self._chunks: list[np.ndarray] = []
        self._small: list[np.ndarray] = []     # recent short blocks (leaps), merged every CHUNK rows
        self._small_rows = 0
        self._packed = 0
        self._columns: Optional[dict[str, np.ndarray]] = None

    def record(self, batch, scheduler, start_s: float, end_s: float, host_s: float, device_s: float,
               kv_used: int, kv_cached: int, slack: int) -> None:
        """Append a step. KV figures are taken right after scheduling (the step's peak)."""
        decodes = batch.num_decode
        prefill = batch.num_prefill_tokens
        self.rows.append((batch.step, start_s, end_s, len(scheduler.running), scheduler.num_waiting,
                          decodes + len(batch.prefills), decodes, prefill, prefill + decodes,
                          batch.decode_ctx, batch.prefill_ctx, batch.prefill_attn, batch.blocks_read,
                          kv_used, kv_cached, slack, len(batch.preempted), host_s, device_s))
        if len(self.rows) == self.CHUNK:
            self._pack()

    def record_leap(self, first_step: int, start_s: float, ends, rows: int, decode_ctx, blocks_read,
                    running: int, waiting: int, kv_used, kv_cached, slack, host, device,
                    waiting_last: Optional[int] = None) -> None:
        """Append the k decode-only steps of a leap (sim/core/leap.py): step i starts where
        step i-1 ended, the first at `start_s`. Short leaps go in as rows, long ones as a block.
        `waiting` is read at each step's end, as `record` does: the same for every step but the
        last, in flight when a request arrived (`waiting_last`, default `waiting`)."""
        k = len(ends)
        if waiting_last is None:
            waiting_last = waiting
        if k <= 16:
            starts = [start_s, *ends[:-1]]
            step = first_step
            for i in range(k):
                self.rows.append((step + i, starts[i], ends[i], running, waiting, rows, rows, 0, rows,
                                  decode_ctx[i], 0, 0, blocks_read[i], kv_used[i], kv_cached[i], slack[i], 0,
                                  host[i], device[i]))
            if waiting_last != waiting:
                last = list(self.rows[-1])
                last[_COLUMN_INDEX["waiting"]] = waiting_last
                self.rows[-1] = tuple(last)
            if len(self.rows) >= self.CHUNK:
                self._pack()
            return
        block = np.zeros((k, len(STEP_COLUMNS)))
        col = _COLUMN_INDEX
        ends = np.asarray(ends)
        block[:, col["step"]] = np.arange(first_step, first_step + k)
        block[0, col["start_s"]] = start_s
        block[1:, col["start_s"]] = ends[:-1]
        block[:, col["end_s"]] = ends
        block[:, col["running"]] = running
        block[:, col["waiting"]] = waiting
        block[-1, col["waiting"]] = waiting_last
        for name in ("num_seqs", "decode_seqs", "batch_tokens"):
            block[:, col[name]] = rows
        for name, values in (("decode_ctx", decode_ctx), ("blocks_read", blocks_read), ("kv_blocks_used", kv_used),
                             ("kv_blocks_cached", kv_cached), ("slack_tokens", slack), ("host_s", host),
                             ("device_s", device)):
            block[:, col[name]] = values
        if self.rows:
            self._small.append(np.array(self.rows, dtype=np.float64))
            self._small_rows += len(self.rows)
            self.rows = []
        self._small.append(block)
        self._small_rows += k
        if self._small_rows >= self.CHUNK:
            self._pack()

    def _pack(self) -> None:
        if self.rows:
            self._small.append(np.array(self.rows, dtype=np.float64))
            self._small_rows += len(self.rows)
            self.rows = []
        if self._small:
            self._chunks.append(self._small[0] if len(self._small) == 1 else np.concatenate(self._small))
            self._packed += self._small_rows
            self._small, self._small_rows = [], 0
        self._columns = None

    def __len__(self) -> int:
        return self._packed + self._small_rows + len(self.rows)

    @property
    def table(self) -> np.ndarray:
        self._pack()
        if not self._chunks:
            return np.zeros((0, len(STEP_COLUMNS)))
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0]

    @property
    def columns(self) -> dict[str, np.ndarray]:
        if self._columns is None or self.rows or self._small:
            table = self.table
            self._columns = {name: table[:, i] for i, name in enumerate(STEP_COLUMNS)}
        return self._columns

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame(self.table, columns=list(STEP_COLUMNS))
        for name in _INT_COLUMNS:
            df[name] = df[name].astype(np.int64)
        df.insert(0, "replica", self.replica)
        return df


_INT_COLUMNS = ("step", "running", "waiting", "num_seqs", "decode_seqs", "prefill_tokens", "batch_tokens",
                "decode_ctx", "prefill_ctx", "prefill_attn", "blocks_read", "kv_blocks_used",
                "kv_blocks_cached", "slack_tokens", "preemptions")


@dataclass
class RunRecords:
    """Everything a run leaves behind: its requests and, per replica, its steps."""

    requests: list[Request]
    recorders: list[StepRecorder]
    kv_blocks_total: int                 # usable blocks per replica
    block_size: int
    explicit_itl: Optional[np.ndarray] = None     # client-measured gaps (live endpoints)
    meta: dict[str, Any] = field(default_factory=dict)

    def steps_frame(self) -> pd.DataFrame:
        frames = [r.frame() for r in self.recorders]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=STEP_COLUMNS)


def _step_times(rec: StepRecorder) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """start, end, and cumulative host / device time (index k = sum of steps < k)."""
    cols = rec.columns
    host = np.concatenate([[0.0], np.cumsum(cols["host_s"])])
    device = np.concatenate([[0.0], np.cumsum(cols["device_s"])])
    return cols["start_s"], cols["end_s"], host, device


def requests_frame(records: RunRecords) -> pd.DataFrame:
    """One row per request with times, token counts and the queue/host/device split."""
    reqs = records.requests
    n = len(reqs)
    out = {
        "id": [r.id for r in reqs], "replica": [r.replica for r in reqs],
        "tenant": [r.tenant for r in reqs], "priority": [r.priority for r in reqs],
        "conversation": [r.conversation for r in reqs], "is_warmup": [r.is_warmup for r in reqs],
        "status": [r.status.name.lower() for r in reqs], "reject_reason": [r.reject_reason for r in reqs],
        "arrival_s": np.array([np.nan if r.arrival is None else r.arrival for r in reqs], dtype=float),
        "prompt_tokens": [r.prompt_len for r in reqs], "output_tokens": [r.num_output for r in reqs],
        "cached_tokens": [r.num_cached_tokens for r in reqs], "preemptions": [r.num_preemptions for r in reqs],
    }
    for name in ("admitted_s", "first_token_s", "finish_s", "host_s", "device_s"):
        out[name] = np.full(n, np.nan)
    for rec in records.recorders:
        idx = [i for i, r in enumerate(reqs) if r.replica == rec.replica]
        if idx and len(rec):
            _fill_times(out, idx, reqs, rec)
    df = pd.DataFrame(out)
    df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    df["e2e_s"] = df["finish_s"] - df["arrival_s"]
    decode_tokens = df["output_tokens"] - 1
    df["tpot_s"] = np.where(decode_tokens > 0, (df["e2e_s"] - df["ttft_s"]) / decode_tokens.clip(lower=1), np.nan)
    df["queue_s"] = df["e2e_s"] - df["host_s"] - df["device_s"]
    return df


def _fill_times(out: dict, idx: list[int], reqs: list[Request], rec: StepRecorder) -> None:
    start, end, host_c, dev_c = _step_times(rec)

    def at(steps: np.ndarray, times: np.ndarray) -> np.ndarray:
        valid = steps >= 0
        res = np.full(len(steps), np.nan)
        res[valid] = times[steps[valid]]
        return res

    sel = np.asarray(idx)
    out["admitted_s"][sel] = at(np.array([reqs[i].admit_step for i in idx]), start)
    out["first_token_s"][sel] = at(np.array([reqs[i].first_token_step for i in idx]), end)
    out["finish_s"][sel] = at(np.array([reqs[i].finish_step for i in idx]), end)
    owner, a, b = _emit_runs(reqs, idx)
    host = np.bincount(owner, weights=host_c[b + 1] - host_c[a], minlength=len(idx))
    dev = np.bincount(owner, weights=dev_c[b + 1] - dev_c[a], minlength=len(idx))
    step_host = np.diff(host_c)
    step_dev = np.diff(dev_c)
    chunk_owner, chunk_step = _chunk_steps(reqs, idx)
    host += np.bincount(chunk_owner, weights=step_host[chunk_step], minlength=len(idx))
    dev += np.bincount(chunk_owner, weights=step_dev[chunk_step], minlength=len(idx))
    done = np.array([reqs[i].status is Status.FINISHED for i in idx])
    out["host_s"][sel] = np.where(done, host, np.nan)
    out["device_s"][sel] = np.where(done, dev, np.nan)


def _emit_runs(reqs: list[Request], idx: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flatten every request's runs of emitting steps into (owner position, first, last)."""
    owner, flat = [], []
    for pos, i in enumerate(idx):
        runs = reqs[i].emit_runs
        if runs:
            flat += runs
            owner += [pos] * (len(runs) // 2)
    pairs = np.asarray(flat, dtype=np.int64).reshape(-1, 2)
    return np.asarray(owner, dtype=np.int64), pairs[:, 0], pairs[:, 1]


def _chunk_steps(reqs: list[Request], idx: list[int]) -> tuple[np.ndarray, np.ndarray]:
    owner, steps = [], []
    for pos, i in enumerate(idx):
        if reqs[i].chunk_steps and reqs[i].status is Status.FINISHED:
            steps += reqs[i].chunk_steps
            owner += [pos] * len(reqs[i].chunk_steps)
    return np.asarray(owner, dtype=np.int64), np.asarray(steps, dtype=np.int64)


def itl_samples(records: RunRecords, measured: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pooled inter-token latencies as (values, integer weights), over `measured` request ids.

    Within a run of consecutive emitting steps every gap is one step (end[k] - end[k-1]);
    those are counted per step with a difference array instead of listed per token.
    Gaps between runs (after a preemption or a skipped step) are listed individually.
    """
    if records.explicit_itl is not None:
        return records.explicit_itl, np.ones(len(records.explicit_itl), dtype=np.int64)
    keep = set(int(i) for i in measured)
    values, weights = [], []
    for rec in records.recorders:
        idx = [i for i, r in enumerate(records.requests) if r.replica == rec.replica and r.id in keep]
        if not idx or not len(rec):
            continue
        _, end, _, _ = _step_times(rec)
        owner, a, b = _emit_runs(records.requests, idx)
        counts = np.zeros(len(end) + 1, dtype=np.int64)
        np.add.at(counts, a + 1, 1)
        np.add.at(counts, b + 1, -1)
        per_step = np.cumsum(counts)[1:len(end)]
        gaps = np.diff(end)
        values.append(gaps[per_step > 0])
        weights.append(per_step[per_step > 0])
        same = owner[1:] == owner[:-1]                       # consecutive runs of one request
        between = end[a[1:][same]] - end[b[:-1][same]]
        values.append(between)
        weights.append(np.ones(len(between), dtype=np.int64))
    if not values:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    return np.concatenate(values), np.concatenate(weights)
