"""Records streamed to disk: a run whose per-request and per-step records never all sit in memory
(`simrun --spill-records`; docs/performance.md "Runs of millions of requests").

In memory, a run keeps every ended request's figures and every step in compact columns
(sim/records.py), then makes a frame of all requests for the summary and the files. Spilled, each
packed chunk of those columns (RequestTable.CHUNK requests, StepRecorder.CHUNK steps of a replica)
goes to an .npz file under the run's `records/` folder as soon as it is packed, and is dropped from
memory. The outputs are then made from the chunks:

- steps.csv replica by replica (one replica's steps in memory at a time);
- requests.csv block by block of BLOCK request ids, each block a RequestTable of the chunks' rows
  with those ids, through the same `requests_frame` as in memory: a request's times come from its
  replica's step times, cumulated once per replica and read back memory-mapped;
- summary.json: `summarise` itself, given the steps' figures (_StepFigures: maxima and integer sums
  taken replica by replica, the float sums over every step from columns on disk) and no request;
  the requests' figures taken block by block as it takes them (_RequestFigures: counts and integer
  sums as they come; the measured columns it reads whole, for a distribution or a float sum in id
  order, kept on disk); the inter-token gaps gathered per replica as `itl_samples` gathers them,
  their runs' ends kept on disk per replica meanwhile. Every sum and percentile over a column on
  disk is numpy's, to the bit, read back a slice at a time (sim/exact_disk.py).

So the files and the summary are the in-memory run's, byte for byte (tests/sim/test_streamed.py),
and what the summary holds at once is a block of requests, one replica's steps and a slice of a
column. With a synthetic single-turn workload drawn a chunk at a time (sim/workload.py
`drawn_in_chunks`) and the manifest's lengths counted per length (sim/predict.py LengthCounts),
what grows with the request count is only one replica's share of the steps (its steps are loaded
whole, one replica at a time), the rejected and aborted requests' reasons, and the chunks' names
(docs/performance.md).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from sim.core.status import FINISHED
from sim.errors import UserError
from sim.output.step_buckets import DEFAULT_INTERVAL_S
from sim.records import REQUEST_FIELDS, STEP_TIMES, RequestTable, RunRecords, StepRecorder, \
    cumulated_step_times, requests_frame, select_owned

FOLDER = "records"            # the chunks' folder, under the run's --out
BLOCK = 1 << 17               # request ids per block of requests.csv (bounded memory per block)


def check_spillable(scenario) -> None:
    """Spilling covers one engine per replica behind a router; the runs whose summaries read more
    of the records are refused, naming the field."""
    c = scenario.cluster
    for field, set_ in (("cluster.disaggregation", c.disaggregation is not None),
                        ("cluster.autoscaling", c.autoscaling is not None),
                        ("parallelism.dp", scenario.parallelism.dp > 1)):
        if set_:
            raise UserError(f"--spill-records: {field} is set; its summary reads every record in memory "
                            f"(run it without --spill-records)")


class RecordSpill:
    """Where a run's records go, each file written atomically: `folder`/requests-NNNNNN.npz (a
    RequestTable's packed columns, its runs of emitting steps and steps of prefill chunks flattened
    as `run_steps` and `chunk_steps`) and `folder`/steps-RRRR-NNNNNN.npz (replica RRRR's packed
    step columns, PER_STEP as `s.NAME` and PER_ROW as `r.NAME`: StepRecorder.take_packed)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.request_chunks: list[tuple[Path, int, int]] = []      # (file, lowest id, highest id)
        self.step_chunks: dict[int, list[Path]] = {}
        self.requests_csv: Optional[Path] = None                    # made by `summarise`
        self.tokens_after_next_host = False     # the recorders' (Simulation sets it), for the steps read back
        self.loop_wakes = None                  # likewise (StepRecorder.loop_wakes)
        self.delivered: dict = {}               # likewise, by replica (StepRecorder.delivered)

    # -- while the run records ---------------------------------------------------------
    def request_table(self) -> "SpilledRequestTable":
        return SpilledRequestTable(self)

    def step_recorder(self, replica: int) -> "SpilledStepRecorder":
        self.step_chunks.setdefault(replica, [])
        return SpilledStepRecorder(replica, self)

    def _write(self, name: str, arrays: dict[str, np.ndarray]) -> Path:
        from sim.output.io import atomic_path

        path = self.folder / name
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
        return path

    def add_requests(self, arrays: dict[str, np.ndarray]) -> None:
        ids = arrays["id"]
        path = self._write(f"requests-{len(self.request_chunks):06d}.npz", arrays)
        self.request_chunks.append((path, int(ids.min()), int(ids.max())))

    def add_steps(self, replica: int, arrays: dict[str, np.ndarray]) -> None:
        chunks = self.step_chunks.setdefault(replica, [])
        chunks.append(self._write(f"steps-{replica:04d}-{len(chunks):06d}.npz", arrays))

    # -- reading back ------------------------------------------------------------------
    def recorder(self, replica: int) -> StepRecorder:
        """A replica's steps, loaded into an ordinary StepRecorder."""
        rec = StepRecorder.of_chunks(replica, map(_loaded, self.step_chunks.get(replica, [])))
        rec.tokens_after_next_host, rec.loop_wakes = self.tokens_after_next_host, self.loop_wakes
        rec.delivered = self.delivered.get(replica)
        return rec

    def summarise(self, records: RunRecords, slo) -> dict:
        """The run's summary.json from its chunks; requests.csv is made on the way (`requests_csv`).
        `summarise` itself gives the figures of the steps and the run's meta (given no request);
        the requests' figures are then taken as it takes them, from columns gathered block by block."""
        from sim.metrics import summarise

        records.requests._pack()                       # the last, partly filled chunks
        for rec in records.recorders:
            rec._flush()
        steps = _StepFigures(self.folder)
        series = [self._step_pass(rec.replica, steps) for rec in records.recorders]
        steps.close()
        figures = _RequestFigures(self.folder, slo, len(series))
        reading = _RequestPass(self, records.requests, series, figures)
        reading.run()
        view = RunRecords(RequestTable(), series, kv_blocks_total=records.kv_blocks_total,
                          block_size=records.block_size, explicit_itl=np.zeros(0), meta=records.meta)
        summary = summarise(view, slo, figures.no_requests, steps)
        steps.unlink()
        figures.fill(summary, records.meta)
        summary["itl_s"] = reading.itl()
        return summary

    def _step_pass(self, replica: int, steps: "_StepFigures") -> "_StepSeries":
        """A replica's step times, cumulated once and saved for the requests' blocks; its summary
        figures taken (steps)."""
        from sim.output.io import atomic_path

        rec = self.recorder(replica)
        for name, values in cumulated_step_times(rec).items():
            if self._stored_as(name) == name:
                with atomic_path(self._times_path(replica, name)) as tmp, open(tmp, "wb") as f:
                    np.save(f, values)
        steps.add(rec)
        return _StepSeries(rec)

    def _stored_as(self, name: str) -> str:
        """The saved column a step time is read from: token_s is end_s itself unless tokens wait
        for the next step's host work or the API server's streaming (not written twice: a
        million-request run has millions of steps)."""
        return "end_s" if name == "token_s" and not (self.tokens_after_next_host or self.delivered) else name

    def _times_path(self, replica: int, name: str) -> Path:
        return self.folder / f"times-{replica:04d}-{self._stored_as(name)}.npy"

    def step_times(self, replica: int) -> dict:
        """A replica's `cumulated_step_times` (start, end, token, running host and device sums), memory-mapped: only
        the pages a block reads are loaded, and they go when the block's maps are dropped."""
        return {name: np.load(self._times_path(replica, name), mmap_mode="r") for name in STEP_TIMES}

    def write_steps_csv(self, path: Path, steps: str, interval_s: float) -> Path:
        """steps.csv of the kind `steps` as `write_data_files` writes it, replica by replica."""
        from sim.columns import csv_chunks
        from sim.output.io import atomic_path
        from sim.output.step_buckets import replica_timeline

        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            for i, replica in enumerate(sorted(self.step_chunks)):
                rec = self.recorder(replica)
                columns = (replica_timeline(rec, interval_s) if steps == "timeline"
                           else rec.file_columns(steps == "full", typed=False))
                chunks = csv_chunks(columns)
                _write_chunks(f, chunks, header=i == 0)
        return Path(path)


def _write_chunks(f, chunks: Iterator[bytes], header: bool) -> None:
    first = next(chunks)
    if header:
        f.write(first)
    for chunk in chunks:
        f.write(chunk)


class SpilledRequestTable(RequestTable):
    """A RequestTable whose packed chunks go to disk (the buffer of one chunk stays in memory)."""

    def __init__(self, spill: RecordSpill):
        super().__init__()
        self.spill = spill

    def _pack(self) -> None:
        super()._pack()
        if self.spill is not None:
            spill, self.spill = self.spill, None          # (take_packed packs again: no second spill)
            packed = self.take_packed()
            self.spill = spill
            if packed is not None:
                spill.add_requests(packed)


class SpilledStepRecorder(StepRecorder):
    """A StepRecorder whose packed chunks go to disk: smaller chunks than in memory, as every replica
    holds one in its buffers (a 64-replica fleet's buffers of 32k steps each came to ~300 MB)."""

    CHUNK = 4096

    def __init__(self, replica: int, spill: RecordSpill):
        super().__init__(replica)
        self.spill = spill

    def _flush(self) -> None:
        super()._flush()
        if self.spill is not None:
            spill, self.spill = self.spill, None
            packed = self.take_packed()
            self.spill = spill
            if packed is not None:
                spill.add_steps(self.replica, packed)


def _loaded(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {name: z[name] for name in z.files}


def _one(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=np.int32)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class _StepSeries:
    """A replica as requests_frame and the summary's view see a recorder: its replica, its step count."""

    def __init__(self, rec: StepRecorder):
        self.replica, self.count = rec.replica, len(rec)

    def __len__(self) -> int:
        return self.count


class _StepFigures:
    """The steps' figures of `summarise` (metrics._Steps' methods), taken replica by replica: maxima
    and integer sums as they come; the two float sums over every step in replica order (busy time,
    and KV blocks times duration) from columns on disk, summed as numpy sums the joined series
    (sim/exact_disk.py)."""

    def __init__(self, folder: Path):
        from sim.exact_disk import DiskColumn

        self.durations = DiskColumn(folder / "steps-duration.bin", np.float64)
        self.used_time = DiskColumn(folder / "steps-used-time.bin", np.float64)
        self.count = 0
        self.nan_durations = 0
        self.used_total = 0
        self.per_replica: dict[int, dict] = {}       # replica -> steps, kv peak, preemptions
        self.totals = {"num_seqs": 0, "batch_tokens": 0}
        self.slack, self.running = None, None

    def add(self, rec: StepRecorder) -> None:
        from sim.metrics import SUMMARY_ROW_COLUMNS, SUMMARY_STEP_COLUMNS

        step = {name: rec.step_column(name) for name in SUMMARY_STEP_COLUMNS}
        row = {name: rec.row_column(name) for name in (*SUMMARY_ROW_COLUMNS, "steps")}
        n = len(step["end_s"])
        if not n:
            self.per_replica[rec.replica] = {"steps": 0, "kv_peak": 0, "preemptions": 0}
            return
        # the joined series' elementwise figures, as metrics._Steps makes them
        dur = step["end_s"].astype(np.float64, copy=False) - step["start_s"].astype(np.float64, copy=False)
        used = step["kv_blocks_used"]
        self.durations.append(dur)
        self.used_time.append(np.multiply(used, dur, dtype=np.float64))
        self.nan_durations += int(np.isnan(dur).sum())
        self.count += n
        self.used_total += int(used.sum(dtype=np.int64))
        per_step = (lambda c: int(np.multiply(row[c], row["steps"], dtype=np.int64).sum()))   # noqa: E731
        for name in self.totals:
            self.totals[name] += per_step(name)
        self.per_replica[rec.replica] = {"steps": n, "kv_peak": int(used.max()),
                                         "preemptions": per_step("preemptions")}
        slack, running = int(step["slack_tokens"].max()), int(row["running"].max())
        self.slack = slack if self.slack is None else max(self.slack, slack)
        self.running = running if self.running is None else max(self.running, running)

    def close(self) -> None:
        self.durations.close()
        self.used_time.close()

    def unlink(self) -> None:
        self.durations.unlink()
        self.used_time.unlink()

    # -- metrics._Steps' methods ----------------------------------------------------------------
    def kv_used_mean(self) -> float:
        from sim.exact_disk import column_sum

        busy = column_sum(self.durations)
        if busy > 0:        # np.average: the weighted sum over the weights' sum
            return float(column_sum(self.used_time) / busy)
        return float(np.float64(self.used_total) / self.count)    # (an integer sum: exact in float64)

    def replica_steps(self, replica: int) -> int:
        return self.per_replica.get(replica, {"steps": 0})["steps"]

    def kv_peak(self, replica: Optional[int] = None) -> int:
        peaks = [r["kv_peak"] for i, r in self.per_replica.items() if replica is None or i == replica]
        return max(peaks, default=0)

    def slack_peak(self) -> int:
        return self.slack

    def peak_running(self) -> int:
        return self.running

    def mean_step_s(self) -> float:
        from sim.exact_disk import column_sum

        count = np.float64(self.count - self.nan_durations)
        total = column_sum(self.durations, nan_as_zero=True)
        return float(total / count if count > 0 else np.nan)

    def preemptions(self, replica: Optional[int] = None) -> int:
        return sum(r["preemptions"] for i, r in self.per_replica.items() if replica is None or i == replica)

    def mean_per_step(self, column: str) -> float:
        return float(np.float64(self.totals[column]) / np.float64(self.count))


class _RequestPass:
    """requests.csv, block by block of ids, and what the summary needs of the requests: their
    figures (_RequestFigures), and the inter-token gaps (itl_samples, gathered per replica)."""

    def __init__(self, spill: RecordSpill, table: RequestTable, series: list[_StepSeries],
                 figures: "_RequestFigures"):
        from sim.exact_disk import DiskColumn

        self.spill, self.table, self.series, self.figures = spill, table, series, figures
        # per replica, on disk: the steps where each emitting run starts and after it ends (a
        # difference array's +1 and -1, counted per replica at the end), and the gaps between
        # consecutive runs of one request, in id order
        folder = spill.folder
        self.steps = {s.replica: len(s) for s in series}
        self.run_ends = {r: (DiskColumn(folder / f"runs-{r:04d}-start.bin", np.int64),
                             DiskColumn(folder / f"runs-{r:04d}-stop.bin", np.int64))
                         for r, n in self.steps.items() if n}
        self.between = {r: DiskColumn(folder / f"runs-{r:04d}-between.bin", np.float64) for r in self.run_ends}

    def run(self) -> None:
        from sim.output.io import atomic_path

        path = self.spill.folder / "requests.csv"
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            for i, block in enumerate(self._blocks()):
                frame = requests_frame(RunRecords(block, self.series, 0, 0), self.spill.step_times)
                _write_frame(f, frame, header=i == 0)
                self.figures.add(frame)
                self._gaps(block)
                del frame
        self.figures.close()
        self.spill.requests_csv = path

    def _blocks(self) -> Iterator[RequestTable]:
        """RequestTables of the requests with ids [lo, lo + BLOCK), lo from the lowest id up. A
        chunk is read by the blocks its ids span (requests end nearly in arrival order: two or three)."""
        chunks = self.spill.request_chunks
        if not chunks:
            yield self._table([])
            return
        lowest, highest = min(c[1] for c in chunks), max(c[2] for c in chunks)
        for lo in range(lowest, highest + 1, BLOCK):
            hi = lo + BLOCK
            yield self._table([_rows_in(path, lo, hi) for path, a, b in chunks if a < hi and b >= lo])

    def _table(self, parts: list[dict]) -> RequestTable:
        names = (*REQUEST_FIELDS, "run_steps", "chunk_steps")
        return self.table.with_columns({name: _one([p[name] for p in parts]) for name in names})

    def _gaps(self, block: RequestTable) -> None:
        """itl_samples' per-replica pieces for this block's measured requests."""
        if not len(block):
            return
        ids_status = block.sorted_column("status")
        measured = (ids_status == int(FINISHED)) & ~block.sorted_column("is_warmup").astype(bool)
        replica = block.sorted_column("replica")
        run_owner, run_a, run_b = block.emit_runs()
        for r in np.unique(replica[measured]).tolist():
            idx = np.flatnonzero((replica == r) & measured)
            if r not in self.run_ends:
                continue
            owner, a, b = select_owned(run_owner, idx, run_a, run_b)
            starts, stops = self.run_ends[r]
            starts.append(a + 1)
            stops.append(b + 1)
            same = owner[1:] == owner[:-1]
            if same.any():
                end = self.spill.step_times(r)["token_s"]
                self.between[r].append(end[a[1:][same]] - end[b[:-1][same]])

    def itl(self) -> dict:
        """The summary's itl_s: metrics.distribution of the sample itl_samples gives (replica by
        replica, the per-step gaps weighted by the requests emitting, then the gaps between runs),
        made on disk one replica at a time."""
        from sim.exact_disk import Sample
        from sim.metrics import PERCENTILES

        sample = Sample(self.spill.folder, "itl", weighted=True)
        for s in self.series:
            if s.replica not in self.run_ends:
                continue
            starts, stops = self.run_ends[s.replica]
            end = np.asarray(self.spill.step_times(s.replica)["token_s"])
            counts = (np.bincount(starts.read(0, len(starts)), minlength=len(end) + 1)
                      - np.bincount(stops.read(0, len(stops)), minlength=len(end) + 1))
            per_step = np.cumsum(counts)[1:len(end)]
            sample.add(np.diff(end)[per_step > 0], per_step[per_step > 0])
            between = self.between[s.replica]
            sample.add(between.read(0, len(between)), np.ones(len(between), dtype=np.int64))
            for column in (starts, stops, between):
                column.unlink()
        figures = sample.distribution(PERCENTILES)
        sample.unlink()
        return figures


# The measured requests' columns the summary takes whole, kept on disk block by block: samples for
# a distribution (NaN left out), and columns for a float sum in id order (the latency split).
_SAMPLES = ("ttft_s", "tpot_s", "e2e_s")
_REPLICA_SAMPLES = ("ttft_s", "tpot_s")             # (each replica's p99)
_SUMMED = ("e2e_s", "queue_s", "host_s", "device_s")
_TOKENS = ("output_tokens", "prompt_tokens", "cached_tokens")


class _RequestFigures:
    """The request figures of `summarise` (sim/metrics.py), taken block by block: counts and integer
    sums as they come, the measured requests' columns to files, read back a slice at a time when the
    figures are made (their distributions and float sums, bit for bit: sim/exact_disk.py). Which figures and how
    mirrors `summarise` and `_replica_figures`: tests/sim/test_streamed.py holds them to its bytes."""

    def __init__(self, folder: Path, slo, replicas: int):
        from sim.exact_disk import DiskColumn, Sample

        self.folder, self.slo, self.replicas = folder, slo, replicas
        self.samples = {name: Sample(folder, f"measured-{name}") for name in _SAMPLES}
        self.replica_samples: dict[tuple[str, int], Sample] = {}
        self.summed = {name: DiskColumn(folder / f"measured-sum-{name}.bin", np.float64) for name in _SUMMED}
        self.no_requests = None                 # an empty frame of the columns, for `summarise`
        self.total = self.measured = self.warmup = self.offered = self.rejected = self.aborted = 0
        self.met = 0
        self.prompt_all = 0                                 # over every request (the offload shares)
        self.tokens = dict.fromkeys(_TOKENS, 0)             # over the measured ones
        self.first_arrival, self.last_finish = np.inf, -np.inf
        self.rejections: list = []
        self.per_replica = {key: np.zeros(replicas, dtype=np.int64)
                            for key in ("requests", "output_tokens", "prompt_tokens", "cached_tokens")}

    def add(self, frame) -> None:
        from sim.metrics import MEASURED_COLUMNS, meets_slo

        if self.no_requests is None:
            self.no_requests = frame.iloc[:0]
        warm = frame["is_warmup"].to_numpy().astype(bool)
        status = frame["status"].to_numpy()
        measured = frame.loc[(status == "finished") & ~warm, [c for c in MEASURED_COLUMNS if c in frame]]
        self.total += len(frame)
        self.measured += len(measured)
        self.warmup += int(warm.sum())
        self.offered += int((~warm).sum())
        self.rejected += int((status[~warm] == "rejected").sum())
        self.aborted += int((status[~warm] == "aborted").sum())
        self.rejections.append(frame.loc[(status == "rejected") & ~warm, ["status", "reject_reason"]])
        self.prompt_all += int(frame["prompt_tokens"].sum())
        if not len(measured):
            return
        self.met += int(meets_slo(measured, self.slo).sum()) if self.slo is not None else 0
        self.first_arrival = min(self.first_arrival, float(measured["arrival_s"].min()))
        self.last_finish = max(self.last_finish, float(measured["finish_s"].max()))
        replica = measured["replica"].to_numpy()
        for key in _TOKENS:
            values = measured[key].to_numpy().astype(np.int64)
            self.tokens[key] += int(values.sum())
            np.add.at(self.per_replica[key], replica, values)
        np.add.at(self.per_replica["requests"], replica, 1)
        column = {name: measured[name].to_numpy().astype(np.float64) for name in {*_SAMPLES, *_SUMMED}}
        for name in _SAMPLES:
            self.samples[name].add(column[name])
        for name in _SUMMED:
            self.summed[name].append(column[name])
        if self.replicas > 1:
            for r in np.unique(replica).tolist():
                mine = replica == r
                for name in _REPLICA_SAMPLES:
                    self._replica_sample(name, r).add(column[name][mine])

    def _replica_sample(self, name: str, replica: int):
        from sim.exact_disk import Sample

        key = (name, replica)
        if key not in self.replica_samples:
            self.replica_samples[key] = Sample(self.folder, f"measured-{name}-{replica:04d}")
        return self.replica_samples[key]

    def close(self) -> None:
        for column in self.summed.values():
            column.close()

    def _distribution(self, sample) -> dict:
        from sim.metrics import PERCENTILES, distribution

        return distribution(np.zeros(0)) if sample is None else sample.distribution(PERCENTILES)

    def fill(self, summary: dict, meta: dict) -> None:
        """Replace `summarise`'s figures of no requests with this run's."""
        import pandas as pd

        from sim.metrics import offload_summary, rejection_reasons

        slo = self.slo
        has_slo = slo is not None and any(v is not None for v in (slo.ttft_s, slo.tpot_s, slo.e2e_s))
        duration = float(self.last_finish - self.first_arrival) if self.measured else 0.0
        rate = (lambda x: x / duration if duration > 0 else None)   # noqa: E731
        n_in, n_out = self.tokens["prompt_tokens"], self.tokens["output_tokens"]
        summary.update({
            "requests_total": self.total, "requests_finished": self.measured,
            "requests_rejected": self.rejected, "requests_aborted": self.aborted,
            "rejection_reasons": rejection_reasons(pd.concat(self.rejections) if self.rejections
                                                   else self.no_requests),
            "requests_measured": self.measured, "warmup_requests": self.warmup, "duration_s": duration,
            "request_throughput": rate(self.measured), "output_token_throughput": rate(float(n_out)),
            "total_token_throughput": rate(float(n_in + n_out)),
            **{name: self._distribution(self.samples[name]) for name in _SAMPLES},
            "goodput": rate(float(self.met)) if has_slo else None,
            "slo_attainment": float(np.int64(self.met) / self.offered) if has_slo and self.offered else None,
            "prefix_hit_rate": float(np.int64(self.tokens["cached_tokens"]) / np.int64(n_in)) if n_in else 0.0,
            "latency_split": self._latency_split(),
        })
        if "kv_offload" in summary:
            summary["kv_offload"] = offload_summary(meta["kv_offload"], self.prompt_all)
        if "replicas" in summary:
            self._replica_figures(summary["replicas"], duration)
        for column in (*self.samples.values(), *self.replica_samples.values(), *self.summed.values()):
            column.unlink()

    def _latency_split(self) -> dict:
        from sim.exact_disk import column_sum

        # pandas' Series.sum of each column (NaN as 0: sim/exact.py), in id order
        total = column_sum(self.summed["e2e_s"], nan_as_zero=True)
        if not total:
            return {"queue": None, "host": None, "device": None}
        return {k: float(column_sum(self.summed[f"{k}_s"], nan_as_zero=True) / total)
                for k in ("queue", "host", "device")}

    def _replica_figures(self, rows: list[dict], duration: float) -> None:
        p99 = {name: [self._distribution(self.replica_samples.get((name, row["replica"])))["p99"] for row in rows]
               for name in _REPLICA_SAMPLES}
        for i, row in enumerate(rows):
            index = row["replica"]
            n_in = self.per_replica["prompt_tokens"][index]
            n = int(self.per_replica["requests"][index])
            row.update({
                "requests": n,
                "request_throughput": n / duration if duration > 0 else None,
                "output_token_throughput": (float(self.per_replica["output_tokens"][index]) / duration
                                            if duration > 0 else None),
                "ttft_s_p99": p99["ttft_s"][i], "tpot_s_p99": p99["tpot_s"][i],
                "prefix_hit_rate": float(self.per_replica["cached_tokens"][index] / n_in) if n_in else 0.0,
            })


def _rows_in(path: Path, lo: int, hi: int) -> dict[str, np.ndarray]:
    """A chunk's requests with ids in [lo, hi), in recording order, with their runs and chunk steps."""
    chunk = _loaded(path)
    keep = (chunk["id"] >= lo) & (chunk["id"] < hi)
    out = {name: chunk[name][keep] for name in REQUEST_FIELDS}
    out["run_steps"] = _entries(chunk["run_steps"], 2, chunk, keep, "runs")
    out["chunk_steps"] = _entries(chunk["chunk_steps"], 1, chunk, keep, "chunks")
    return out


def _entries(flat: np.ndarray, width: int, chunk: dict, keep: np.ndarray, count_name: str) -> np.ndarray:
    """The flat entries (`width` values each) of the kept rows, in row order."""
    owner_kept = np.repeat(keep, chunk[count_name].astype(np.int64))
    return flat.reshape(-1, width)[owner_kept].reshape(-1)


def _write_frame(f, frame, header: bool) -> None:
    """A block of requests.csv: the columnar writer's bytes where it formats every column, else pandas'."""
    from sim.columns import csv_chunks

    chunks = csv_chunks({name: frame[name].to_numpy() for name in frame.columns})
    if chunks is not None:
        _write_chunks(f, chunks, header)
    else:
        f.write(frame.to_csv(index=False, header=header).encode())


def write_spilled_files(result, spill: RecordSpill, out_dir: Path, steps: str = "timeline",
                        interval_s: float = DEFAULT_INTERVAL_S) -> dict[str, Path]:
    """summary.json, requests.csv (made with the summary), steps.csv, manifest.json of a spilled run:
    the files `write_data_files` writes for one kept in memory."""
    from sim.output.io import write_json
    from sim.output.run_files import STEP_FILE_KINDS

    if steps not in STEP_FILE_KINDS:
        raise ValueError(f"steps={steps!r}: expected one of {', '.join(STEP_FILE_KINDS)}")
    out_dir = Path(out_dir)
    files = {"summary": write_json(out_dir / "summary.json", result.summary)}
    files["requests"] = out_dir / "requests.csv"
    os.replace(spill.requests_csv, files["requests"])        # (same folder tree: an atomic rename)
    if not interval_s > 0:
        raise ValueError(f"steps interval {interval_s!r}: expected a positive number of seconds")
    files["steps"] = spill.write_steps_csv(out_dir / "steps.csv", steps, interval_s)
    files["manifest"] = write_json(out_dir / "manifest.json", result.manifest)
    result.files.update(files)
    return files
