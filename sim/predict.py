"""One prediction end to end: simulate a scenario, summarise it, write its files.

Used by `simrun` (each variant), by sweeps and searches, and by the validation harness
(the predicted side of predicted-vs-measured).
"""
from __future__ import annotations

import hashlib
from array import array
import os
import platform
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from itertools import chain, islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from sim import stop
from sim.costmodel import CostModel
from sim.core.memory import MemoryPlan
from sim.metrics import summarise
from sim.core.lazy import lazy_import
from sim.records import RunRecords, request_columns
from sim.core.request import Request
from sim.disagg import pool_figures, simulate_disaggregated
from sim.simulator import simulate
from sim.workload import DrawnRequests, build_workload, stream_requests, unread_settings, warmup_notes
from sim.trained import error_band

pd = lazy_import("pandas")      # a frame of the requests or steps only where one is read


@dataclass
class RunResult:
    name: str
    scenario: Any
    records: RunRecords
    plan: MemoryPlan
    cost_model: Optional[CostModel]        # None for a measured run
    summary: dict
    _requests: Any                         # the request columns (sim.records.request_columns) or a frame
    _steps: Optional[pd.DataFrame]         # None: made from the records on first use
    manifest: dict = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def requests(self) -> pd.DataFrame:
        """One row per request, made from the columns when first read (the summary and
        requests.csv are made from the columns: a million-request frame is ~0.5 GB)."""
        if isinstance(self._requests, dict):
            self._requests = pd.DataFrame(self._requests, copy=False)
        return self._requests

    @property
    def request_columns(self) -> dict:
        """The requests as numpy columns (a frame's, where the run was given one)."""
        if isinstance(self._requests, dict):
            return self._requests
        return {c: self._requests[c].to_numpy() for c in self._requests.columns}

    @property
    def steps(self) -> pd.DataFrame:
        """One row per step, made when first read: a sweep or plan point keeps only its summary
        (at a low rate, many short steps, this frame was up to 2% of a 10k-request point)."""
        if self._steps is None:
            self._steps = self.records.steps_frame()
        return self._steps

    @property
    def has_steps_frame(self) -> bool:
        """Is the steps frame made already (reading `steps` would cost nothing)?"""
        return self._steps is not None


def predict(scenario, name: Optional[str] = None,
            progress: Optional[Callable[[int], None]] = None, manifest: bool = True, spill=None) -> RunResult:
    """Simulate and summarise; nothing is written. Stops with stop.StopRequested at its checks
    (here, and every 256 finished requests through the progress callback) once a signal asked.
    Without `manifest` (a sweep point whose files are not written) the manifest is left empty:
    hashing the workload costs a few % of a point. With `spill` (sim/output/streamed.py) the records go to
    disk as they are made and the summary is taken from them there: `requests` is then None."""
    stop.check()
    records, plan, cost_model, described = _simulate(scenario, stop.polling(progress), manifest, spill)
    stop.check()
    if spill is None:
        req_cols = request_columns(records)
        summary = summarise(records, scenario.slo, req_cols)
    else:
        req_cols, summary = None, spill.summarise(records, scenario.slo)
    summary["calibrated"] = cost_model.calibrated
    summary["step_time_source"] = cost_model.step_time_source
    summary["error_band"] = error_band(cost_model.step_time_source, cost_model.profile,
                                       scenario.engine_generation)
    summary["memory"] = memory_summary(plan, scenario.max_model_len)
    if scenario.cluster.disaggregation is not None:
        summary["pools"] = pool_figures(records, pd.DataFrame(req_cols, copy=False))
    if "autoscaling" in records.meta:          # cluster.autoscaling: GPU-hours, replicas over the run
        from sim.autoscale import autoscaling_summary, run_end
        frame = pd.DataFrame(req_cols, copy=False)
        summary["autoscaling"] = autoscaling_summary(records.meta["autoscaling"], run_end(frame),
                                                     scenario.parallelism.gpus)
    info = {}
    if described is not None:
        info = simulation_manifest(scenario, cost_model, plan, described)
        info["simulation_wall_s"] = records.meta.get("wall_s")
    return RunResult(name or scenario.name, scenario, records, plan, cost_model, summary, req_cols, None, info)


def warm_up(scenario) -> None:
    """What a process's first `predict` of `scenario` does once and keeps, done ahead: the trained
    family read, the cost model's generated price forms (sim.costmodel.scalar_form) and numpy's
    random module imported (numpy imports it on first use). A sweep calls this before its worker
    processes fork, so each inherits them instead of making them again (~0.1 s a worker)."""
    if scenario.cluster.disaggregation is None:      # (its pools make their own cost models)
        CostModel.for_scenario(scenario)
    import numpy.random  # noqa: F401


def _simulate(scenario, progress, manifest: bool, spill=None):
    """Run the scenario's workload, made as the run reaches it when synthetic (else built whole):
    the run lets each request go once its figures are recorded. With `manifest`, the workload's
    manifest entry too."""
    watcher = WorkloadDescription() if manifest else None
    stream = stream_requests(scenario, describe=watcher.add_drawn if watcher is not None else None)
    if stream is None:
        workload = build_workload(scenario)
        stop.check()
        described = workload_manifest(workload.requests, workload.notes) if manifest else None
        return (*_run(scenario, workload.requests, progress, release=True, spill=spill), described)
    notes = warmup_notes(scenario.workload.warmup_requests, stream.count) + unread_settings(scenario)
    if watcher is not None and not stream.described:     # (else described chunk by chunk as made)
        stream.requests = watcher.watch(stream.requests)
    records, plan, cost_model = _run(scenario, stream, progress, spill=spill)
    return records, plan, cost_model, watcher.manifest(notes) if watcher is not None else None


def _run(scenario, requests, progress, release: bool = False, spill=None):
    """One engine or a cluster of replicas (sim.simulator), or prefill and decode pools (sim.disagg)."""
    if scenario.cluster.disaggregation is not None:
        return simulate_disaggregated(scenario, requests, progress, release)
    return simulate(scenario, requests, progress=progress, release=release, spill=spill)


def memory_summary(plan: MemoryPlan, max_model_len: Optional[int] = None) -> dict:
    """Where the memory goes; vLLM's "Maximum concurrency" is the pool over max_model_len requests.
    Under vLLM's plan reserved_bytes = non_torch_bytes + cudagraph_bytes, off a budget of
    utilization x visible_bytes (the simple plan: visible = the datasheet memory, both terms 0)."""
    return {"memory_plan": plan.memory_plan, "vllm_version": plan.vllm_version,
            "visible_bytes": plan.visible_bytes, "budget_bytes": plan.budget_bytes,
            "non_torch_bytes": plan.non_torch_bytes, "cudagraph_bytes": plan.cudagraph_bytes,
            "kv_bytes_per_token": plan.kv_bytes_per_token, "block_bytes": plan.block_bytes,
            "num_blocks": plan.num_blocks, "usable_blocks": plan.usable_blocks,
            "kv_pool_bytes": plan.kv_pool_bytes, "weight_bytes": plan.weight_bytes,
            "activation_bytes": plan.activation_bytes, "reserved_bytes": plan.reserved_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes, "max_tokens": plan.max_tokens,
            "max_concurrency_at_max_model_len": plan.max_concurrency(max_model_len) if max_model_len else None,
            # vLLM's LoRA buffers (part of weight_bytes), only in runs that serve adapters
            **({"lora_bytes": plan.lora_bytes} if plan.lora_bytes else {})}


# ----------------------------------------------------------------------------- manifest

def kvtwin_version() -> str:
    try:
        return metadata.version("kvtwin")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_commit() -> Optional[str]:
    """HEAD (with -dirty), or KVTWIN_GIT_COMMIT where the tree travelled without .git (a GPU box)."""
    if os.environ.get("KVTWIN_GIT_COMMIT"):
        return os.environ["KVTWIN_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


class WorkloadDescription:
    """The manifest's workload entry, taken request by request: over a list, or over a stream
    as the run reads it (each request is seen as made, before the run changes it). Each
    request's text is hashed in batches (one sha256 update per BATCH requests, the same digest)."""

    BATCH = 4096
    # Requests described before the text is made from columns: that loads pyarrow (~0.12 G
    # instructions, where simrun's CSV writer has not yet), which ~6.6k instructions saved a
    # request repay after ~18k requests (the same text either way).
    COLUMNAR_AFTER = 16_384

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.lengths = LengthCounts()         # (counted: a list of ten million lengths would grow)
        # each request's FIGURES, a list per figure, made text BATCH requests at a time
        self._figures: list[list] = [[] for _ in FIGURES]
        self._segments: list[list] = []       # and its segments but the output (copied)

    def add(self, r: Request) -> None:
        self._describe((r,))
        if len(self._segments) >= self.BATCH:
            self._hash_described()

    def watch(self, requests: Iterable[Request]) -> Iterator[Request]:
        """Each request, described before it is passed on. The stream is read BATCH requests at a
        time (made that far ahead of the run, which has not seen them yet: the same figures) and
        described a batch at a time, a list per figure (no tuple a request, nothing to transpose)."""
        requests = iter(requests)
        while True:
            batch = list(islice(requests, self.BATCH))
            if not batch:
                return
            self._describe(batch)
            self._hash_described()
            yield from batch

    def add_drawn(self, drawn: DrawnRequests) -> None:
        """A chunk of a synthetic stream's requests, described from the arrays they are made from
        (sim.workload.DrawnRequests, handed over before the requests are made): the text `watch`
        makes from the Request objects, without a Python value read per request figure. The text
        is made BATCH requests at a time (a chunk's whole text and its blocks were ~20 MB at once)."""
        self._hash_described()                 # (in order after anything described before)
        n = len(drawn)
        columnar = self.lengths.count + n >= self.COLUMNAR_AFTER
        for start in range(0, n, self.BATCH):
            self.hash.update(_drawn_text(drawn.rows(start, start + self.BATCH), columnar))
        self.lengths.extend(drawn.prompt_len, drawn.output_len)

    def _describe(self, requests) -> None:
        """Keep each request's figures the run does not change (FIGURES, in columns) and its
        segments but the output, copied (a literal segment by its length and hash)."""
        # (a comprehension a figure: Python 3.11's specialised read of a slot is cheaper than
        # operator.attrgetter's generic lookup mapped over the batch, which counted more in total)
        ids, arrivals, prompts, outputs, tenants, priorities = self._figures
        ids += [r.id for r in requests]
        arrivals += [r.arrival for r in requests]
        prompts += [r.prompt_len for r in requests]
        outputs += [r.output_len for r in requests]
        tenants += [r.tenant for r in requests]
        priorities += [r.priority for r in requests]
        segments = [r.segments[:-1] for r in requests]
        if set(map(type, chain.from_iterable(segments))) - {tuple}:
            segments = list(map(_literals_hashed, segments))
        self._segments += segments

    def _hash_described(self) -> None:
        """The batch's text (each request's tuple's repr, as one string) into the hash, and its
        prompt and output lengths into the counts."""
        figures = self._figures
        self.hash.update(_batch_text(figures, self._segments, columnar=self.lengths.count >= self.COLUMNAR_AFTER))
        self.lengths.prompts.extend(figures[2])
        self.lengths.outputs.extend(figures[3])
        for column in (*figures, self._segments):
            column.clear()
        self.lengths.fold_if_full()

    def hexdigest(self) -> str:
        self._hash_described()
        return self.hash.hexdigest()[:16]

    def manifest(self, notes: list[str]) -> dict:
        self._hash_described()
        return {"requests": self.lengths.count, "digest": self.hexdigest(),
                "lengths": self.lengths.stats(), "notes": notes}


# What the manifest's text holds of a request: the figures the run does not change (as
# `_describe` reads them), then its segments but the output.
FIGURES = ("id", "arrival", "prompt_len", "output_len", "tenant", "priority")


def _drawn_text(drawn: DrawnRequests, columnar: bool) -> bytes:
    """`_batch_text` of requests described by the arrays they are made from."""
    import numpy as np

    text = None
    prompt_len = drawn.prompt_len
    if columnar and {prompt_len.dtype.kind, drawn.output_len.dtype.kind, drawn.priority.dtype.kind} == {"i"}:
        ids = np.arange(drawn.first_id, drawn.first_id + len(drawn), dtype=np.int64)
        columns = np.stack([ids, prompt_len, drawn.output_len, drawn.priority]).astype(np.int64)
        text = _text_of_columns(columns, drawn.arrival.astype(np.float64), drawn.tenant_names, drawn.tenant,
                                *drawn.segment_slots())
    if text is None:
        text = _batch_text(*drawn.figures(), columnar=False)
    return text


def _literals_hashed(segments: list) -> list:
    """A request's segments with each literal one (a list of token ids) described by its hash."""
    return [s if isinstance(s, tuple) else ("lit", len(s), hash(tuple(s))) for s in segments]


def _batch_text(figures: list[list], segments: list[list], columnar: bool) -> bytes:
    """The text of the requests described by `figures` (a list per figure) and `segments`: each
    request's tuple (*figures, segments) as repr writes it (described_text's)."""
    text = _columnar_text(figures, segments) if columnar else None
    if text is None:
        text = "".join(map(repr, zip(*figures, segments))).encode()
    return text


def figure_columns(described: list[tuple]) -> tuple[list[list], list[list]]:
    """Tuples (*FIGURES, segments) as `_batch_text`'s columns: (a list per figure, the segments)."""
    columns = [list(column) for column in zip(*described)] or [[] for _ in range(len(FIGURES) + 1)]
    return columns[:-1], columns[-1]


def described_text(described: list[tuple], columnar: bool = True) -> bytes:
    """`"".join(map(repr, described)).encode()`, the text hashed for a batch of requests. With
    `columnar` it is made column by column where every request has the plain form a synthetic
    workload gives (ints, a finite float arrival, the same number of keyed segments): repr spends
    ~19k instructions a request (7k on the arrival's float alone, ~6% of the simulation the text
    describes), the columns ~12.7k (fewer where a column holds one value: `_int_part`). Their text
    is the CSV writer's (sim/columns.py), which is repr's; anything else is made tuple by tuple."""
    return _batch_text(*figure_columns(described), columnar)


def _columnar_text(figures: list[list], segs: list[list]) -> Optional[bytes]:
    """The text of `described_text` from columns, or None where a request is not of the plain form.
    Requests may carry different numbers of keyed segments (a workload whose shared prefix only
    some conversations carry: ~1.5x simulate()'s instructions spent in repr where the batch fell
    back for that): each segment slot is a block of cells whose rows without that segment are all
    NUL, which `joined_rows` drops."""
    import numpy as np

    if not segs:
        return b""
    ids, arrivals, prompts, outputs, tenants, priorities = figures
    if set(map(type, chain(ids, prompts, outputs, priorities))) != {int} \
            or set(map(type, arrivals)) != {float} or set(map(type, segs)) != {list}:
        return None
    pairs = list(chain.from_iterable(segs))
    if pairs and (set(map(type, pairs)) != {tuple} or set(map(len, pairs)) != {2}):
        return None
    numbers = list(chain.from_iterable(pairs))
    if numbers and set(map(type, numbers)) != {int}:
        return None
    n = len(segs)
    widths = np.fromiter(map(len, segs), np.int64, n)
    k = int(widths.max())                          # keyed segment slots: (key, length) pairs
    present = np.arange(k) < widths[:, None]       # (row, slot): does the row have that segment?
    try:
        # (fromiter: ~0.75x np.array's instructions on a list of ints, which it first walks for a shape)
        columns = np.fromiter(chain(ids, prompts, outputs, priorities), np.int64, 4 * n).reshape(4, n)
        pair_columns = np.zeros((n, k, 2), dtype=np.int64)
        pair_columns[present] = np.fromiter(numbers, np.int64, len(numbers)).reshape(-1, 2)
        distinct = {t: i for i, t in enumerate(dict.fromkeys(tenants))}
    except (OverflowError, TypeError):             # an int past int64, an unhashable tenant
        return None
    arrival = np.fromiter(arrivals, np.float64, n)
    codes = np.fromiter(map(distinct.__getitem__, tenants), np.int64, n) if len(distinct) > 1 else None
    return _text_of_columns(columns, arrival, list(distinct), codes, pair_columns, present)


def _text_of_columns(columns: "np.ndarray", arrival: "np.ndarray", tenants: list, tenant_codes,
                     pair_columns: "np.ndarray", present: "np.ndarray") -> Optional[bytes]:
    """The text of `described_text` from arrays: `columns` (4, rows) int64 of ids, prompt and output
    lengths and priorities, the arrivals, each row's tenant (`tenants[tenant_codes]`; codes None:
    every row's is tenants[0]), the (rows, slots, 2) segment pairs and which slots a row has. None
    where an arrival is not finite (repr's text is then made tuple by tuple)."""
    import numpy as np

    from sim.columns import bytes_block, float_cells, joined_rows

    n = len(arrival)
    if not np.isfinite(arrival).all():
        return None
    if tenant_codes is None or (tenant_codes == tenant_codes[0]).all():   # (its text, which every row carries)
        tenant = repr(tenants[0 if tenant_codes is None else int(tenant_codes[0])]).encode()
    else:
        table = np.array([repr(t).encode() for t in tenants], dtype="S")
        tenant = bytes_block(table[tenant_codes])
    k = pair_columns.shape[1]
    id_, prompt, output, priority = map(_int_part, columns)
    parts = [b"(", id_, b", ", float_cells(arrival), b", ", prompt, b", ", output, b", ", tenant, b", ",
             priority, b", ["]
    for j in range(k):
        kept = present[:, j]
        whole = kept.all()
        slot = [b"(" if j == 0 else b", (", _int_part(pair_columns[:, j, 0], None if whole else kept), b", ",
                _int_part(pair_columns[:, j, 1], None if whole else kept), b")"]
        if whole:
            parts += slot
        else:
            parts.append(_masked_block(slot, kept))
    parts.append(b"])")
    return joined_rows(_bytes_joined(parts), n)


def _int_part(values: "np.ndarray", rows_read=None):
    """A column's cells (`int_cells`), or the one text of its value where every row (of `rows_read`,
    where given) holds the same: a part that every row carries (a workload's fixed lengths, its one
    priority), not formatted row by row."""
    from sim.columns import int_cells

    read = values if rows_read is None else values[rows_read]
    if len(read) and (read == read[0]).all():
        return str(int(read[0])).encode()
    return int_cells(values)


def _bytes_joined(parts: list) -> list:
    """`parts` with each run of bytes parts made one (fewer blocks to lay side by side)."""
    out = []
    for p in parts:
        if isinstance(p, bytes) and out and isinstance(out[-1], bytes):
            out[-1] += p
        else:
            out.append(p)
    return out


def _masked_block(parts: list, rows_kept) -> "np.ndarray":
    """`parts` (joined_rows' parts) as one (rows, width) block, all NUL in the rows not kept."""
    import numpy as np

    n = len(rows_kept)
    block = np.hstack([np.broadcast_to(np.frombuffer(p, np.uint8), (n, len(p))) if isinstance(p, bytes) else p
                       for p in parts])
    block[~rows_kept] = 0
    return block


class LengthCounts:
    """The prompt and output lengths of the requests as counts of each length (bounded memory
    however many requests), giving _length_stats' figures to the bit: the mean of integers is their
    exact sum over the count (float64 sums integers exactly below 2**53), the percentiles numpy's
    interpolation of the order statistics read from the counts (sim/exact_disk.py). Lengths are
    appended to `prompts` and `outputs` and folded into the counts BATCH at a time."""

    BATCH = 65_536

    def __init__(self) -> None:
        import numpy as np

        self._folded = 0
        self.prompts, self.outputs = array("q"), array("q")
        self._counts = [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))] * 2   # (values, counts)

    @property
    def count(self) -> int:
        return self._folded + len(self.prompts)

    def add(self, prompt_len: int, output_len: int) -> None:
        self.prompts.append(prompt_len)
        self.outputs.append(output_len)
        self.fold_if_full()

    def extend(self, prompt_lens: "np.ndarray", output_lens: "np.ndarray") -> None:
        """The lengths of a chunk of requests, as arrays."""
        import numpy as np

        self.prompts.frombytes(np.ascontiguousarray(prompt_lens, dtype=np.int64).tobytes())
        self.outputs.frombytes(np.ascontiguousarray(output_lens, dtype=np.int64).tobytes())
        self.fold_if_full()

    def fold_if_full(self) -> None:
        if len(self.prompts) >= self.BATCH:
            self._fold()

    def _fold(self) -> None:
        import numpy as np

        for i, pending in enumerate((self.prompts, self.outputs)):
            if not len(pending):
                continue
            values, counts = self._counts[i]
            merged, where = np.unique(np.concatenate([values, np.frombuffer(pending, dtype=np.int64)]),
                                      return_inverse=True)
            weights = np.concatenate([counts, np.ones(len(pending), dtype=np.int64)])
            self._counts[i] = (merged, np.bincount(where, weights=weights, minlength=len(merged)).astype(np.int64))
        self._folded += len(self.prompts)
        del self.prompts[:], self.outputs[:]        # (emptied in place, as the arrays stay the same objects)

    def stats(self) -> dict:
        import numpy as np

        from sim.exact_disk import linear_percentiles, median

        self._fold()
        out = {}
        for key, (values, counts) in zip(("prompt_tokens", "output_tokens"), self._counts):
            n = int(counts.sum())
            if not n:
                out[key] = {}
                continue
            cum = np.cumsum(counts)
            kth = (lambda ranks, v=values, c=cum: {k: np.float64(v[np.searchsorted(c, k, side="right")])   # noqa: E731
                                                  for k in ranks})
            total = int(np.dot(values, counts))
            out[key] = {"mean": float(np.float64(total) / n), "p50": float(median(n, kth)),
                        "p90": float(linear_percentiles(n, 90, kth)), "p99": float(linear_percentiles(n, 99, kth)),
                        "min": int(values[0]), "max": int(values[-1])}
        return out


def workload_digest(requests: list[Request]) -> str:
    """A fingerprint of the workload: arrivals, lengths and prompt segments of every request."""
    described = WorkloadDescription()
    for r in requests:
        described.add(r)
    return described.hexdigest()


def length_stats(requests: list[Request]) -> dict:
    return _length_stats([r.prompt_len for r in requests], [r.output_len for r in requests])


def _length_stats(prompt_lens, output_lens) -> dict:
    import numpy as np

    out = {}
    for key, values in (("prompt_tokens", prompt_lens), ("output_tokens", output_lens)):
        a = np.asarray(values, dtype=float)
        out[key] = ({"mean": float(a.mean()), "p50": float(np.median(a)), "p90": float(np.percentile(a, 90)),
                     "p99": float(np.percentile(a, 99)), "min": int(a.min()), "max": int(a.max())}
                    if a.size else {})
    return out


def workload_manifest(requests: list[Request], notes: list[str]) -> dict:
    """The manifest's workload entry (taken before a run that releases the requests)."""
    described = WorkloadDescription()
    for r in requests:
        described.add(r)
    return described.manifest(notes)


def simulation_manifest(scenario, cost_model: CostModel, plan: MemoryPlan, workload: dict) -> dict:
    return {
        "kind": "prediction",
        "kvtwin_version": kvtwin_version(),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "seed": scenario.seed,
        "calibrated": cost_model.calibrated,
        "cost_model": cost_model.describe(),
        "memory_plan": plan.to_dict(),
        "workload": workload,
        "engine_generation": scenario.engine_generation,
        "scenario": scenario.model_dump(mode="json"),
    }
