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
- summary.json: `summarise` itself for the steps' figures (given the steps' summary columns and no
  request), the requests' figures taken block by block as it takes them (_RequestFigures: counts
  and integer sums as they come; each measured column it reads whole, for a percentile or a float
  sum in id order, kept on disk and read back alone), the inter-token gaps gathered per replica
  as `itl_samples` gathers them.

So the files and the summary are the in-memory run's, byte for byte (tests/sim/test_streamed.py).
What still grows with the request count: the workload's draws (arrays made before the run, ~75
bytes a request), the manifest's lengths (16), one measured column at a time in the summary (8,
twice while a percentile sorts it), and the steps' summary series and inter-token gaps (a few
tens of bytes per engine step).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from sim.core.status import FINISHED
from sim.errors import UserError
from sim.output.step_buckets import DEFAULT_INTERVAL_S
from sim.records import REQUEST_FIELDS, RequestTable, RunRecords, StepRecorder, cumulated_step_times, \
    requests_frame, select_owned

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
        return StepRecorder.of_chunks(replica, map(_loaded, self.step_chunks.get(replica, [])))

    def summarise(self, records: RunRecords, slo) -> dict:
        """The run's summary.json from its chunks; requests.csv is made on the way (`requests_csv`).
        `summarise` itself gives the figures of the steps and the run's meta (given no request);
        the requests' figures are then taken as it takes them, from columns gathered block by block."""
        from sim.metrics import distribution, summarise

        records.requests._pack()                       # the last, partly filled chunks
        for rec in records.recorders:
            rec._flush()
        series = [self._step_pass(rec.replica) for rec in records.recorders]
        figures = _RequestFigures(self.folder, slo, len(series))
        reading = _RequestPass(self, records.requests, series, figures)
        reading.run()
        view = RunRecords(RequestTable(), series, kv_blocks_total=records.kv_blocks_total,
                          block_size=records.block_size, explicit_itl=np.zeros(0), meta=records.meta)
        summary = summarise(view, slo, figures.no_requests)
        figures.fill(summary, records.meta)
        summary["itl_s"] = distribution(*reading.itl())
        return summary

    def _step_pass(self, replica: int) -> "_StepSeries":
        """A replica's step times, cumulated once and saved for the requests' blocks; its summary columns."""
        rec = self.recorder(replica)
        for name, values in cumulated_step_times(rec).items():
            np.save(self._times_path(replica, name), values)
        return _StepSeries(rec)

    def _times_path(self, replica: int, name: str) -> Path:
        return self.folder / f"times-{replica:04d}-{name}.npy"

    def step_times(self, replica: int) -> dict:
        """A replica's `cumulated_step_times` (start, end, running host and device sums), memory-mapped: only
        the pages a block reads are loaded, and they go when the block's maps are dropped."""
        return {name: np.load(self._times_path(replica, name), mmap_mode="r") for name in _TIMES}

    def write_steps_csv(self, path: Path, steps: str, interval_s: float) -> Path:
        """steps.csv of the kind `steps` as `write_data_files` writes it, replica by replica."""
        from sim.output.columns import csv_chunks
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


_TIMES = ("start_s", "end_s", "host_s", "device_s")


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
    """A replica's steps as the summary reads them (RunRecords.step_series / row_series), and as
    requests_frame sees a recorder (its replica, its step count)."""

    def __init__(self, rec: StepRecorder):
        from sim.metrics import SUMMARY_ROW_COLUMNS, SUMMARY_STEP_COLUMNS

        self.replica = rec.replica
        self.steps = {name: rec.step_column(name) for name in SUMMARY_STEP_COLUMNS}
        self.rows = {name: rec.row_column(name) for name in (*SUMMARY_ROW_COLUMNS, "steps")}

    def __len__(self) -> int:
        return len(self.steps["end_s"])

    @property
    def num_rows(self) -> int:
        return len(self.rows["steps"])

    def step_column(self, name: str) -> np.ndarray:
        return self.steps[name]

    def row_column(self, name: str) -> np.ndarray:
        return self.rows[name]


class _RequestPass:
    """requests.csv, block by block of ids, and what the summary needs of the requests: their
    figures (_RequestFigures), and the inter-token gaps (itl_samples, gathered per replica)."""

    def __init__(self, spill: RecordSpill, table: RequestTable, series: list[_StepSeries],
                 figures: "_RequestFigures"):
        self.spill, self.table, self.series, self.figures = spill, table, series, figures
        # per replica: +1/-1 at each emitting run's ends (a difference array over its steps), and
        # the gaps between consecutive runs of one request, in id order
        self.run_counts = {s.replica: np.zeros(len(s) + 1, dtype=np.int64) for s in series}
        self.between: dict[int, list[np.ndarray]] = {s.replica: [] for s in series}

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
            counts = self.run_counts.get(r)
            if counts is None or len(counts) == 1:
                continue
            owner, a, b = select_owned(run_owner, idx, run_a, run_b)
            np.add.at(counts, a + 1, 1)
            np.add.at(counts, b + 1, -1)
            same = owner[1:] == owner[:-1]
            if same.any():
                end = self.spill.step_times(r)["end_s"]
                self.between[r].append(end[a[1:][same]] - end[b[:-1][same]])

    def itl(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, weights) as itl_samples gives them: replica by replica, per-step gaps then
        the gaps between runs."""
        values, weights = [], []
        for s in self.series:
            counts = self.run_counts[s.replica]
            if len(counts) == 1:
                continue
            end = np.asarray(self.spill.step_times(s.replica)["end_s"])
            per_step = np.cumsum(counts)[1:len(end)]
            values.append(np.diff(end)[per_step > 0])
            weights.append(per_step[per_step > 0])
            between = _one(self.between[s.replica]) if self.between[s.replica] else np.zeros(0)
            values.append(between.astype(np.float64))
            weights.append(np.ones(len(between), dtype=np.int64))
        if not values:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        return np.concatenate(values), np.concatenate(weights)


# The measured requests' columns the summary takes whole (percentiles, float sums), kept on disk
# block by block and read back one at a time.
_KEPT = ("ttft_s", "tpot_s", "e2e_s", "queue_s", "host_s", "device_s", "replica")
_TOKENS = ("output_tokens", "prompt_tokens", "cached_tokens")


class _RequestFigures:
    """The request figures of `summarise` (sim/metrics.py), taken block by block: counts and integer
    sums as they come, the measured requests' columns to files, each read back whole (its
    distribution, its float sum in the same order) when the figures are made. Which figures and how
    mirrors `summarise` and `_replica_figures`: tests/sim/test_streamed.py holds them to its bytes."""

    def __init__(self, folder: Path, slo, replicas: int):
        self.folder, self.slo, self.replicas = folder, slo, replicas
        self.files = {name: open(self._path(name), "wb") for name in _KEPT}
        self.no_requests = None                 # an empty frame of the columns, for `summarise`
        self.total = self.measured = self.warmup = self.offered = self.rejected = self.aborted = 0
        self.met = 0
        self.prompt_all = 0                                 # over every request (the offload shares)
        self.tokens = dict.fromkeys(_TOKENS, 0)             # over the measured ones
        self.first_arrival, self.last_finish = np.inf, -np.inf
        self.rejections: list = []
        self.per_replica = {key: np.zeros(replicas, dtype=np.int64)
                            for key in ("requests", "output_tokens", "prompt_tokens", "cached_tokens")}

    def _path(self, name: str) -> Path:
        return self.folder / f"measured-{name}.bin"

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
        self.rejections.append(frame.loc[status == "rejected", ["status", "reject_reason"]])
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
        for name in _KEPT:
            self.files[name].write(measured[name].to_numpy().astype(np.int64 if name == "replica" else np.float64)
                                   .tobytes())

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def column(self, name: str) -> np.ndarray:
        return np.fromfile(self._path(name), dtype=np.int64 if name == "replica" else np.float64)

    def fill(self, summary: dict, meta: dict) -> None:
        """Replace `summarise`'s figures of no requests with this run's."""
        import pandas as pd

        from sim.metrics import distribution, offload_summary, rejection_reasons

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
            **{name: distribution(self.column(name)) for name in ("ttft_s", "tpot_s", "e2e_s")},
            "goodput": rate(float(self.met)) if has_slo else None,
            "slo_attainment": float(np.int64(self.met) / self.offered) if has_slo and self.offered else None,
            "prefix_hit_rate": float(np.int64(self.tokens["cached_tokens"]) / np.int64(n_in)) if n_in else 0.0,
            "latency_split": self._latency_split(),
        })
        if "kv_offload" in summary:
            summary["kv_offload"] = offload_summary(meta["kv_offload"], self.prompt_all)
        if "replicas" in summary:
            self._replica_figures(summary["replicas"], duration)
        for path in map(self._path, _KEPT):
            path.unlink(missing_ok=True)

    def _latency_split(self) -> dict:
        import pandas as pd

        total = pd.Series(self.column("e2e_s")).sum()
        if not total:
            return {"queue": None, "host": None, "device": None}
        return {k: float(pd.Series(self.column(f"{k}_s")).sum() / total) for k in ("queue", "host", "device")}

    def _replica_figures(self, rows: list[dict], duration: float) -> None:
        from sim.metrics import distribution

        replica = self.column("replica")
        p99 = {}
        for name in ("ttft_s", "tpot_s"):
            values = self.column(name)
            p99[name] = [distribution(values[replica == row["replica"]])["p99"] for row in rows]
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
    from sim.output.columns import csv_chunks

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
