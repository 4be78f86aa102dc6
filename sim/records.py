"""Run records, one schema for the simulator and the engine (docs/architecture.md "Records").

Steps carry times; requests carry step indices (admission, first token, finish, the runs
of consecutive steps in which they emitted a token, the steps of prefill chunks that
emitted nothing). A token is emitted at the end of its step, so every request time is a
step time: the simulator and the engine share this code, differing only in where step
times come from (a cost model, or clocks).

Both are kept in columns, not objects (so a million requests fit in well under 2 GB):
- `RequestTable`: a request's figures are taken when it ends (finished or rejected) and the
  Request object can go; its emitting steps stay run-length encoded (first, last) pairs.
- `StepRecorder`: a *row* is one engine step, or one leap (sim/core/fast/leap.py: K pure-decode
  steps with the same batch). What changes inside a leap (end time, host/device time,
  decode context, blocks read, KV figures) is kept per step, compactly, so every per-step
  series (ITL, KV over time, step times) stays exact; the batch composition, constant over a
  leap, is kept once per row. `frame()` gives one row per step (`simrun --steps full`),
  `frame(full=False)` one row per record, with its step count (the default steps.csv).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from struct import Struct
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np

from sim.core.lazy import lazy_import
from sim.core.request import Request
from sim.core.status import FINISHED, Status

# Frames are made only when asked for (files, the summary): `simulate` itself never needs
# pandas, so a process that only simulates does not pay its import (~0.3 s).
pd = lazy_import("pandas")

# (a module constant: an enum member read off its class is a descriptor call in 3.11, once a request here)

STEP_COLUMNS = ("step", "start_s", "end_s", "running", "waiting", "num_seqs", "decode_seqs",
                "prefill_tokens", "batch_tokens", "decode_ctx", "prefill_ctx", "prefill_attn", "blocks_read",
                "kv_blocks_used", "kv_blocks_cached", "slack_tokens", "preemptions", "host_s", "device_s")
# What may change from one step of a leap to the next: kept per step.
PER_STEP = ("end_s", "host_s", "device_s", "decode_ctx", "blocks_read", "kv_blocks_used", "kv_blocks_cached",
            "slack_tokens")
# What a leap's steps share (its batch): kept once per row, with the row's first step, its
# number of steps and its start time.
PER_ROW = ("step", "steps", "start_s", "running", "waiting", "num_seqs", "decode_seqs", "prefill_tokens",
           "batch_tokens", "prefill_ctx", "prefill_attn", "preemptions")
# The aggregated steps.csv: a row's composition, its first step's KV figures and context,
# its last step's KV figures, its summed host/device time and its last step's end.
AGGREGATED_COLUMNS = ("step", "steps", "start_s", "end_s", "running", "waiting", "num_seqs", "decode_seqs",
                      "prefill_tokens", "batch_tokens", "decode_ctx", "prefill_ctx", "prefill_attn",
                      "blocks_read", "kv_blocks_used", "kv_blocks_used_last", "kv_blocks_cached",
                      "kv_blocks_cached_last", "slack_tokens", "preemptions", "host_s", "device_s")
_FLOAT = ("start_s", "end_s", "host_s", "device_s")
_INT32 = np.iinfo(np.int32)


def _compact(values: np.ndarray) -> np.ndarray:
    """Integers as int32 when they fit (they nearly always do), else int64; floats as they are."""
    if values.dtype.kind == "f" or values.size == 0:
        return values
    if values.min() >= _INT32.min and values.max() <= _INT32.max:
        return values.astype(np.int32)
    return values.astype(np.int64)


class _Columns:
    """Append-only named columns: small parts gathered, then packed into compact chunks."""

    def __init__(self, names: Iterable[str], floats: Iterable[str] = _FLOAT):
        self.names = tuple(names)
        self.floats = set(floats)
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in self.names}
        self.chunks: dict[str, list[np.ndarray]] = {n: [] for n in self.names}
        self.pending = 0
        self.count = 0

    def add(self, values: dict[str, Any], n: int) -> None:
        for name in self.names:
            self.parts[name].append(values[name])
        self.pending += n
        self.count += n

    def pack(self) -> None:
        if not self.pending:
            return
        for name in self.names:
            parts = self.parts[name]
            joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
            joined = joined.astype(np.float64) if name in self.floats else _compact(joined.astype(np.int64))
            self.chunks[name].append(joined)
            self.parts[name] = []
        self.pending = 0

    def column(self, name: str) -> np.ndarray:
        self.pack()
        chunks = self.chunks[name]
        if not chunks:
            return np.zeros(0, dtype=np.float64 if name in self.floats else np.int64)
        if len(chunks) > 1:
            self.chunks[name] = chunks = [np.concatenate(chunks)]
        return chunks[0]


class _Buffer:
    """Values not yet packed into `_Columns`: entry after entry, packed into one byte buffer, each
    value as its column's type (`_FLOAT`'s as doubles, the rest as 64-bit integers: every recorded
    integer is one). An entry is one `struct` pack, a leap's entries one more: where a list of tuples of
    Python numbers cost ~10% of a decode-heavy run to convert, and typed arrays a C-level
    conversion per value several times slower than `struct`'s. (Integers packed as doubles went
    through a temporary float object each: ~15% of what recording cost at 150 req/s.) A leap's
    entries are packed column after column (`pack_block`: its sequences unpacked at C speed, no
    tuple per entry); `take` puts them back in entry order."""

    __slots__ = ("names", "data", "pack", "blocks", "_format", "_packs")

    def __init__(self, names: tuple):
        self.names = names
        self._format = "".join("d" if name in _FLOAT else "q" for name in names)
        self.data = bytearray()
        # One entry, a value per column in `names` order: `buffer.data += buffer.pack(*values)`
        # (written out by the recorder, a step at a time: a method of two lines cost a call per step).
        self.pack = Struct("<" + self._format).pack
        self.blocks: list[int] = []      # (its byte offset, k) of each block `pack_block` packed, flat
        self._packs: dict[int, Callable] = {}     # k -> the pack of a block of k entries

    def __len__(self) -> int:
        return len(self.data) // (8 * len(self.names))

    def pack_block(self, k: int) -> Callable:
        """The pack of k entries column after column (k values of the first column, then the
        second's, ...): `buffer.blocks += (len(buffer.data), k)`, then `buffer.data += pack(*column, ...)`."""
        pack = self._packs.get(k)
        if pack is None:
            pack = self._packs[k] = self._block_pack(k)
        return pack

    def _block_pack(self, k: int) -> Callable:
        # (its own method: a generator reading `k` in pack_block made `k` a cell at every call, a leap)
        return Struct("<" + "".join(f"{k}{kind}" for kind in self._format)).pack

    def take(self) -> dict[str, np.ndarray]:
        """The columns as arrays, in entry order."""
        width, n = len(self.names), len(self)
        doubles, integers = np.frombuffer(self.data, dtype="<f8"), np.frombuffer(self.data, dtype="<i8")
        if not self.blocks:         # entries side by side: each column a strided view (`_Columns` copies it)
            return {name: (doubles if kind == "d" else integers).reshape(n, width)[:, c]
                    for c, (name, kind) in enumerate(zip(self.names, self._format))}
        # entry i's value of column c is value first[i] + c * stride[i] of the buffer: an entry packed
        # alone holds its columns side by side; in a block of k entries from entry s, entry s + j's
        # value of column c is at s * width + c * k + j
        first = np.arange(0, n * width, width, dtype=np.int64)
        stride = np.ones(n, dtype=np.int64)
        if self.blocks:
            offset, k = np.asarray(self.blocks, dtype=np.int64).reshape(-1, 2).T
            start = offset // (8 * width)
            within = np.arange(int(k.sum()), dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
            entries = np.repeat(start, k) + within
            first[entries] = np.repeat(start * width, k) + within
            stride[entries] = np.repeat(k, k)
        return {name: (doubles if kind == "d" else integers)[first + c * stride]
                for c, (name, kind) in enumerate(zip(self.names, self._format))}


def _leap_rows(first_step: int, k: int, start_s: float, ends, rows: int, running: int, waiting: int,
               waiting_last: Optional[int]) -> list[tuple]:
    """The PER_ROW rows of a leap of `k` decode-only steps of `rows` sequences (StepRecorder.record_leap):
    one, or, where the waiting count read at the last step's end (`waiting_last`) differs, the
    first k - 1 steps and then the last step as a row of its own, starting where step k - 1 ended."""
    if waiting_last is None or waiting_last == waiting:
        return [(first_step, k, start_s, running, waiting, rows, rows, 0, rows, 0, 0, 0)]
    last = (first_step + k - 1, 1, start_s if k == 1 else ends[k - 2], running, waiting_last, rows, rows, 0, rows,
            0, 0, 0)
    if k == 1:
        return [last]
    return [(first_step, k - 1, start_s, running, waiting, rows, rows, 0, rows, 0, 0, 0), last]


class StepRecorder:
    """Collects the steps of one replica: a row per step, or per leap (see the module docstring).

    Each record appends two tuples (cheap per step): its row (PER_ROW) and its per-step values
    (PER_STEP, one tuple per step); they are packed into compact columns every CHUNK steps.
    A long leap goes in as arrays."""

    CHUNK = 32_768
    LONG_LEAP = 64

    def __init__(self, replica: int = 0):
        self.replica = replica
        # vLLM V0's async output processing (Scenario.tokens_after_next_host): a step's tokens reach
        # the client when the next step has done its host work (`token_times`); with a client on the
        # engine's own asyncio loop (Scenario.tokens_at_loop_wake), when that loop next wakes: the
        # next step's end or an earlier one of `loop_wakes` (the run's sends, sorted)
        self.tokens_after_next_host = False
        self.loop_wakes: Optional[np.ndarray] = None
        # per step, when the API server has streamed its tokens (sim/front_end.py FrontEnd.outputs)
        self.delivered: Optional[np.ndarray] = None
        self.rows = _Buffer(PER_ROW)            # rows and steps not yet packed
        self.step_values = _Buffer(PER_STEP)
        self._steps = _Columns(PER_STEP)
        self._rows = _Columns(PER_ROW)
        self._cache: dict[str, np.ndarray] = {}
        self._chunk_bytes = self.CHUNK * 8 * len(PER_STEP)     # buffered steps packed past this

    def record(self, batch, scheduler, start_s: float, end_s: float, host_s: float, device_s: float,
               kv_used: int, kv_cached: int, slack: int) -> None:
        """Append a step. KV figures are taken right after scheduling (the step's peak)."""
        decodes = batch.num_decode
        prefill = batch.num_prefill_tokens
        rows = self.rows
        rows.data += rows.pack(batch.step, 1, start_s, len(scheduler.running), len(scheduler.waiting),
                               decodes + len(batch.prefills), decodes, prefill, prefill + decodes,
                               batch.prefill_ctx, batch.prefill_attn, len(batch.preempted))
        steps = self.step_values
        steps.data += steps.pack(end_s, host_s, device_s, batch.decode_ctx, batch.blocks_read, kv_used, kv_cached,
                                 slack)
        if len(steps.data) >= self._chunk_bytes:
            self._flush()

    def record_leap(self, first_step: int, start_s: float, ends, rows: int, decode_ctx, blocks_read,
                    running: int, waiting: int, kv_used, kv_cached, slack, host, device,
                    waiting_last: Optional[int] = None) -> None:
        """Append the k decode-only steps of a leap (sim/core/fast/leap.py) as one row: step i starts
        where step i-1 ended, the first at `start_s`; the per-step sequences have k entries each.
        `waiting` is read at each step's end, as `record` does: the same for every step but the
        last, in flight when a request arrived (`waiting_last`, default `waiting`); when they
        differ, the last step is a row of its own. (Positional arguments: the simulator calls
        this once a leap, and 14 keywords cost their matching at every call.)"""
        k = len(ends)
        if k <= self.LONG_LEAP and type(ends) is list:
            buffer = self.rows
            if waiting_last is None or waiting_last == waiting:
                # (the usual leap, packed straight from the values: a tuple or list of rows a leap
                # counted ~1% more instructions at 150 req/s, bench/instructions.py bench-150)
                buffer.data += buffer.pack(first_step, k, start_s, running, waiting, rows, rows, 0, rows, 0, 0, 0)
            else:
                for values in _leap_rows(first_step, k, start_s, ends, rows, running, waiting, waiting_last):
                    buffer.data += buffer.pack(*values)
            steps = self.step_values
            steps.blocks += (len(steps.data), k)       # (the byte offset: len(steps) is a call)
            steps.data += steps.pack_block(k)(*ends, *host, *device, *decode_ctx, *blocks_read, *kv_used, *kv_cached,
                                              *slack)
            if len(steps.data) >= self._chunk_bytes:
                self._flush()
            return
        self._record_long_leap(first_step, start_s, ends, rows, decode_ctx, blocks_read, running, waiting, kv_used,
                               kv_cached, slack, host, device, waiting_last)

    def _record_long_leap(self, first_step: int, start_s: float, ends, rows: int, decode_ctx, blocks_read,
                          running: int, waiting: int, kv_used, kv_cached, slack, host, device,
                          waiting_last: Optional[int]) -> None:
        """`record_leap` of a long leap (or one priced with numpy): its columns as arrays. (A method
        of its own: the comprehension below made `table` a cell at every call of record_leap.)"""
        k = len(ends)
        self._flush_buffers()
        self._steps.add({"end_s": np.asarray(ends, dtype=np.float64), "host_s": np.asarray(host, dtype=np.float64),
                         "device_s": np.asarray(device, dtype=np.float64), "decode_ctx": np.asarray(decode_ctx),
                         "blocks_read": np.asarray(blocks_read), "kv_blocks_used": np.asarray(kv_used),
                         "kv_blocks_cached": np.asarray(kv_cached), "slack_tokens": np.asarray(slack)}, k)
        new_rows = _leap_rows(first_step, k, start_s, ends, rows, running, waiting, waiting_last)
        table = np.array(new_rows, dtype=np.float64)
        self._rows.add({name: table[:, i] for i, name in enumerate(PER_ROW)}, len(new_rows))
        if self._steps.pending >= self.CHUNK:
            self._flush()

    def _flush_buffers(self) -> None:
        """Buffered tuples -> column parts (exact: every integer here is far below 2**53)."""
        self._cache = {}
        if not self.rows:
            return
        self._rows.add(self.rows.take(), len(self.rows))
        self._steps.add(self.step_values.take(), len(self.step_values))
        self.rows, self.step_values = _Buffer(PER_ROW), _Buffer(PER_STEP)

    def _flush(self) -> None:
        self._flush_buffers()
        self._steps.pack()
        self._rows.pack()

    @classmethod
    def of_chunks(cls, replica: int, chunks: Iterable[dict[str, np.ndarray]]) -> "StepRecorder":
        """A recorder of packed chunks as `take_packed` gave them (a spilled run read back: sim/output/streamed.py)."""
        rec = cls(replica)
        for chunk in chunks:
            for prefix, columns, names in (("s.", rec._steps, PER_STEP), ("r.", rec._rows, PER_ROW)):
                for name in names:
                    columns.chunks[name].append(chunk[prefix + name])
                columns.count += len(chunk[prefix + names[0]])
        return rec

    def take_packed(self) -> Optional[dict[str, np.ndarray]]:
        """Pack what is buffered and hand over every packed column (PER_STEP as 's.NAME', PER_ROW as
        'r.NAME'), keeping none of it: None when there was nothing. The step count stays."""
        self._flush()
        steps, rows = self._steps, self._rows
        if not steps.chunks["end_s"] and not rows.chunks["step"]:
            return None
        packed = {**{"s." + n: _joined(steps.chunks[n]) for n in PER_STEP},
                  **{"r." + n: _joined(rows.chunks[n]) for n in PER_ROW}}
        for columns in (steps, rows):
            columns.chunks = {name: [] for name in columns.names}
        self._cache = {}
        return packed

    def __len__(self) -> int:
        """Steps recorded."""
        return self._steps.count + len(self.step_values)

    @property
    def num_rows(self) -> int:
        """Rows recorded (a leap is one, or two when a request arrived during its last step)."""
        return self._rows.count + len(self.rows)

    # -- reading ------------------------------------------------------------------------
    def row_column(self, name: str) -> np.ndarray:
        """A PER_ROW column, one entry per row."""
        self._flush()
        return self._rows.column(name)

    def step_column(self, name: str) -> np.ndarray:
        """Any STEP_COLUMNS column, one entry per step (row values repeated over a leap's steps)."""
        if self.rows:
            self._flush()
        if name in self._cache and not self._steps.pending:
            return self._cache[name]
        if name in PER_STEP:
            out = self._steps.column(name)
        elif name == "start_s":
            out = self._starts()
        elif name == "step":
            out = self._expand("step") + self._offsets()
        else:
            out = self._expand(name)
        if name in ("start_s", "end_s", "host_s", "device_s"):
            self._cache[name] = out
        return out

    def token_times(self) -> np.ndarray:
        """When each step's tokens reach the client: its end, or under `tokens_after_next_host` its
        end plus the host time of the step that starts at that end (a step followed by none, the
        engine idle after it, delivers at its end: V0 drains its outputs when nothing is left).
        With `loop_wakes` (the client on the engine's asyncio loop), from then on the first of those
        wakes before the next step's end, else that end. With `delivered` (the API server's streaming
        of each step's outputs), those times."""
        if self.delivered is not None:
            return self.delivered
        end = self.step_column("end_s")
        if not self.tokens_after_next_host or len(end) < 2:
            return end
        start, host = self.step_column("start_s"), self.step_column("host_s")
        follows = start[1:] <= end[:-1]
        out = end.copy()
        if self.loop_wakes is None:
            out[:-1] += np.where(follows, host[1:], 0.0)
            return out
        ready, wakes = start[1:] + host[1:], self.loop_wakes
        at = np.searchsorted(wakes, ready)
        wake = wakes[np.minimum(at, len(wakes) - 1)] if len(wakes) else np.full(len(ready), np.inf)
        woken = np.where(at < len(wakes), wake, np.inf)
        out[:-1] = np.where(follows, np.minimum(woken, end[1:]), end[:-1])
        return out

    def _expand(self, name: str) -> np.ndarray:
        counts = self._rows.column("steps")
        values = self._rows.column(name)
        return values if len(counts) == len(self) else np.repeat(values, counts)

    def _offsets(self) -> np.ndarray:
        """Per step: its position within its row (0 for a single step)."""
        counts = self._rows.column("steps").astype(np.int64)
        if len(counts) == len(self):
            return np.zeros(len(counts), dtype=np.int64)
        firsts = np.cumsum(counts) - counts
        return np.arange(len(self)) - np.repeat(firsts, counts)

    def _starts(self) -> np.ndarray:
        """A row's first step starts at the recorded start, every other one where its previous step ended."""
        end = self._steps.column("end_s")
        counts = self._rows.column("steps").astype(np.int64)
        start = np.empty_like(end)
        if len(end):
            start[1:] = end[:-1]
            start[np.cumsum(counts) - counts] = self._rows.column("start_s")
        return start

    @property
    def columns(self) -> dict[str, np.ndarray]:
        """Every STEP_COLUMNS column per step."""
        return {name: self.step_column(name) for name in STEP_COLUMNS}

    def frame(self, full: bool = True) -> pd.DataFrame:
        """One row per step (`full`, the STEP_COLUMNS), or one per row with its step count."""
        return pd.DataFrame(self.file_columns(full))

    def file_columns(self, full: bool = True, typed: bool = True) -> dict[str, np.ndarray]:
        """The columns of `frame`, 'replica' first, as arrays: integers as int64 (`typed`), else as
        compact as recorded (the files are written from these: the same text, half the memory)."""
        names = STEP_COLUMNS if full else AGGREGATED_COLUMNS
        values = self.step_column if full else self._aggregated
        columns = {name: self._typed(name, values(name)) if typed else values(name) for name in names}
        n = len(columns["step"])
        return {"replica": np.full(n, self.replica, dtype=np.int64 if typed else np.int32), **columns}

    @staticmethod
    def _typed(name: str, values: np.ndarray) -> np.ndarray:
        return values.astype(np.float64 if name in _FLOAT else np.int64)

    def _aggregated(self, name: str) -> np.ndarray:
        if name in PER_ROW:
            return self.row_column(name)
        counts = self.row_column("steps").astype(np.int64)
        last = np.cumsum(counts) - 1
        first = last - counts + 1
        if name in ("host_s", "device_s"):
            values = self._steps.column(name)
            return np.add.reduceat(values, first) if len(values) else values
        if name.endswith("_last"):
            return self._steps.column(name[:-len("_last")])[last]
        return self._steps.column(name)[last if name == "end_s" else first]


# ----------------------------------------------------------------------------- requests

# A request's scalar figures, in the order `RequestTable.add` takes them.
_REQUEST_FIELDS = ("id", "replica", "priority", "conversation", "is_warmup", "status", "arrival_s",
                   "prompt_tokens", "output_tokens", "cached_tokens", "preemptions", "admit_step",
                   "first_token_step", "finish_step", "tenant", "runs", "chunks")
_REQUEST_FLOATS = ("arrival_s",)
_NO_CONVERSATION = -(2 ** 62)
# a request's figures packed as `RequestTable.add` takes them, and the same as a numpy record
_REQUEST_ROW = Struct("<" + "".join("d" if name in _REQUEST_FLOATS else "q" for name in _REQUEST_FIELDS))
_REQUEST_DTYPE = np.dtype([(name, "<f8" if name in _REQUEST_FLOATS else "<i8") for name in _REQUEST_FIELDS])


class RequestTable:
    """Ended requests in columns (see the module docstring); `rows()` in id order."""

    CHUNK = 65_536

    def __init__(self) -> None:
        # Requests not yet packed into columns, each as its figures packed (_REQUEST_ROW) and its
        # runs' and chunks' steps as int64: converted while the request's objects are at hand (a
        # list of tuples and ints converted at pack time read them scattered over the heap).
        self._buffer: list[bytes] = []
        self._pack_row = _REQUEST_ROW.pack
        self._cols = _Columns(_REQUEST_FIELDS, _REQUEST_FLOATS)
        self._runs: list[np.ndarray] = []       # flattened (first, last) step pairs, request by request
        self._run_buffer = array("q")
        self._chunk_steps: list[np.ndarray] = []
        self._chunk_buffer = array("q")
        self._tenants: dict[Optional[str], int] = {None: -1}
        self._reasons: dict[int, str] = {}      # request id -> reason (rejected and aborted ones)
        self._order: Optional[np.ndarray] = None
        self._emit_runs: Optional[tuple] = None     # (emit_runs, made once for its two readers)
        self.count = 0

    def add(self, req: Request) -> None:
        """Take an ended request's figures (the object itself may then go). An ended request is in
        no decode cohort, so its progress fields are its figures."""
        runs, chunks = req.emit_runs, req.chunk_steps
        finished = req.status is FINISHED
        if not finished:
            chunks = ()                 # only a finished request's chunk steps count (host/device split)
        tenant = self._tenants.setdefault(req.tenant, len(self._tenants) - 1)
        self._buffer.append(self._pack_row(
            req.id, req.replica, req.priority, _NO_CONVERSATION if req.conversation is None else req.conversation,
            req.is_warmup, req.status, np.nan if req.arrival is None else req.arrival, req.prompt_len,
            req.num_output, req.num_cached_tokens, req.num_preemptions, req.admit_step, req.first_token_step,
            req.finish_step, tenant, len(runs) // 2, len(chunks)))
        if runs:
            self._run_buffer.extend(runs)
        if chunks:
            self._chunk_buffer.extend(chunks)
        if req.reject_reason is not None:
            self._reasons[req.id] = req.reject_reason
        self.count += 1
        if len(self._buffer) >= self.CHUNK:
            self._pack()

    def extend(self, requests: Iterable[Request]) -> "RequestTable":
        for req in requests:
            self.add(req)
        return self

    def _pack(self) -> None:
        if self._buffer:
            table = np.frombuffer(b"".join(self._buffer), dtype=_REQUEST_DTYPE)
            self._buffer = []
            self._cols.add({name: table[name] for name in _REQUEST_FIELDS}, len(table))
            self._cols.pack()       # (copies: nothing keeps the joined bytes)
            self._order = None          # (ids were added: made again when asked; else kept, not
                                        # sorted again for each of a summary's ~20 columns)
            self._emit_runs = None
        if self._run_buffer:
            self._runs.append(_compact(np.frombuffer(self._run_buffer, dtype=np.int64)))    # (a copy)
            self._run_buffer = array("q")
        if self._chunk_buffer:
            self._chunk_steps.append(_compact(np.frombuffer(self._chunk_buffer, dtype=np.int64)))
            self._chunk_buffer = array("q")

    def __len__(self) -> int:
        return self.count

    def take_packed(self) -> Optional[dict[str, np.ndarray]]:
        """Pack what is buffered and hand over the packed columns (REQUEST_FIELDS, and the flattened
        runs and chunk steps as 'run_steps' and 'chunk_steps'), keeping none of them: None when there
        was nothing. Names (tenants, reasons) and the count stay."""
        self._pack()
        cols = self._cols
        if not cols.chunks["id"]:
            return None
        packed = {name: _joined(cols.chunks[name]) for name in cols.names}
        packed["run_steps"] = _joined(self._runs)
        packed["chunk_steps"] = _joined(self._chunk_steps)
        cols.chunks = {name: [] for name in cols.names}
        self._runs, self._chunk_steps = [], []
        self._order = self._emit_runs = None
        return packed

    def with_columns(self, columns: dict[str, np.ndarray]) -> "RequestTable":
        """A table of the given columns (as `take_packed` gives them), with this table's tenant names
        and reasons (a block of a spilled run's requests: sim/output/streamed.py)."""
        table = RequestTable()
        for name in table._cols.names:
            table._cols.chunks[name] = [columns[name]]
        table.count = table._cols.count = len(columns["id"])
        table._runs, table._chunk_steps = [columns["run_steps"]], [columns["chunk_steps"]]
        table._tenants, table._reasons = self._tenants, self._reasons
        return table

    def column(self, name: str) -> np.ndarray:
        """A column in recording order."""
        self._pack()
        return self._cols.column(name)

    @property
    def order(self) -> np.ndarray:
        """Positions in recording order that list the requests by id (stable)."""
        if self._order is None:
            self._order = np.argsort(self.column("id"), kind="stable")
        return self._order

    def sorted_column(self, name: str) -> np.ndarray:
        return self.column(name)[self.order]

    def emit_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(owner position in id order, first step, last step) of every run of emitting steps; kept
        until requests are added (the request columns and the ITL sample both read them)."""
        self._pack()
        if self._emit_runs is None:
            self._emit_runs = self._flat(self._runs, "runs", 2)
        return self._emit_runs

    def chunk_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """(owner position in id order, step) of every prefill chunk that emitted nothing."""
        owner, steps = self._flat(self._chunk_steps, "chunks", 1)
        return owner, steps

    def _flat(self, parts: list, count_name: str, width: int):
        self._pack()
        flat = _joined(parts)
        counts = self.column(count_name).astype(np.int64)
        in_id_order = counts[self.order]
        # every owner's entries together, owners in id order (the order the rows list them): each
        # owner's block moved from its recording place to its place in id order (a stable sort of
        # the owners, without sorting); the owners then read 0, 0, ..., 1, ... by their counts.
        # (1.5M runs at 100k requests: as few arrays of them as it takes)
        by_owner = _block_positions((np.cumsum(counts) - counts)[self.order], in_id_order)
        owner = np.repeat(np.arange(len(counts)), in_id_order)
        values = flat.reshape(-1, width)[by_owner]       # (as recorded: int32 where every step fits)
        if width == 1:
            return owner, values[:, 0]
        return owner, values[:, 0], values[:, 1]

    def tenants(self) -> np.ndarray:
        """Tenant names (None where a request has none), in id order."""
        names = np.array([None] + [t for t in self._tenants if t is not None], dtype=object)
        return names[self.sorted_column("tenant") + 1]

    def reasons(self) -> np.ndarray:
        """Each request's rejection or abort reason (None for the rest), in id order, as objects:
        looked up by id in numpy (a lookup a request was ~0.17 s of a million-request run)."""
        out = np.full(len(self), None, dtype=object)
        if not self._reasons or not len(out):
            return out
        keys = np.fromiter(self._reasons, np.int64, len(self._reasons))
        order = np.argsort(keys)
        keys, texts = keys[order], np.array(list(self._reasons.values()), dtype=object)[order]
        ids = self.sorted_column("id").astype(np.int64)
        at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
        hit = keys[at] == ids            # (a block of a spilled run holds some of the ids only)
        out[hit] = texts[at[hit]]
        return out


RequestsLike = Union[RequestTable, list]


@dataclass
class RunRecords:
    """Everything a run leaves behind: its requests (columns) and, per replica, its steps.
    A list of ended Request objects is taken into a RequestTable."""

    requests: RequestsLike
    recorders: list[StepRecorder]
    kv_blocks_total: int                 # usable blocks per replica
    block_size: int
    explicit_itl: Optional[np.ndarray] = None     # client-measured gaps (live endpoints)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.requests, RequestTable):
            self.requests = RequestTable().extend(self.requests)

    def steps_frame(self, full: bool = True) -> pd.DataFrame:
        """Every replica's steps: one row per step (`full`), or per record (a leap is one row)."""
        frames = [r.frame(full) for r in self.recorders]
        if frames:
            return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        return pd.DataFrame(columns=STEP_COLUMNS if full else ["replica", *AGGREGATED_COLUMNS])

    def steps_columns(self, full: bool = True) -> Optional[dict[str, np.ndarray]]:
        """The columns of `steps_frame` as compact arrays, without a frame (a million-request run's
        steps file is written from these); None without a recorder (the frame's empty columns then)."""
        if not self.recorders:
            return None
        parts = [r.file_columns(full, typed=False) for r in self.recorders]
        return {name: _joined([p[name] for p in parts]) for name in parts[0]}

    def step_series(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Per-step columns over every replica (replica by replica), plus 'replica'; for the summary,
        without building a frame."""
        names = list(names)
        recs = self.recorders
        out = {n: _joined([r.step_column(n) for r in recs]) for n in names}
        out["replica"] = (_joined([np.broadcast_to(np.int32(r.replica), len(r)) for r in recs])
                          if recs else np.zeros(0, dtype=np.int64))     # (one replica's: a read-only view)
        return out

    def row_series(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """PER_ROW columns over every replica, plus 'replica' and each row's step count 'steps'."""
        recs = self.recorders
        out = {n: _joined([r.row_column(n) for r in recs]) for n in (*names, "steps")}
        out["replica"] = (_joined([np.broadcast_to(np.int64(r.replica), r.num_rows) for r in recs])
                          if recs else np.zeros(0, dtype=np.int64))
        return out


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """One array of the parts (no copy of a single one)."""
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _block_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """starts[0], starts[0] + 1, ... (lengths[0] of them), then starts[1], ...: each block's
    positions one after another, as one running sum of steps of 1 that jumps at each block's first
    entry: one array of that length, where a repeat of the starts plus an arange made three."""
    total = int(lengths.sum())
    steps = np.ones(total, dtype=np.int64)
    if not total:
        return steps
    nonempty = lengths > 0
    starts, lengths = starts[nonempty], lengths[nonempty]
    first = np.cumsum(lengths) - lengths                  # each block's first entry
    steps[first[0]] = starts[0]
    steps[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(steps, out=steps)


def _prefix_sums(values: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Index k: the sum of values[:k] (np.cumsum's own additions, written after a leading 0), into
    `out` where it is given and of that length."""
    if out is None or len(out) != len(values) + 1:
        out = np.empty(len(values) + 1)
    out[0] = 0.0
    np.cumsum(values, out=out[1:])
    return out


_STATUS_NAMES = np.array([s.name.lower() for s in sorted(Status, key=int)], dtype=object)


def requests_frame(records: RunRecords, step_times: Optional[Callable[[int], dict]] = None) -> pd.DataFrame:
    """One row per request (in id order) with times, token counts and the queue/host/device split."""
    return pd.DataFrame(request_columns(records, step_times), copy=False)   # (no second copy of a million rows)


def request_columns(records: RunRecords, step_times: Optional[Callable[[int], dict]] = None) -> dict[str, np.ndarray]:
    """The columns of `requests_frame` as numpy arrays, each as the frame would hold it (a column
    of ints and missing values as float64 with NaN; text as objects): the summary and requests.csv
    are made from these, without a frame. `step_times(replica)`, where given, gives a replica's
    `cumulated_step_times` made once beforehand (a spilled run's requests come block by block:
    sim/output/streamed.py)."""
    table: RequestTable = records.requests
    col = table.sorted_column
    n = len(table)
    conversation = col("conversation")
    none = conversation == _NO_CONVERSATION
    out = {
        "id": col("id").astype(np.int64), "replica": col("replica").astype(np.int64),
        "tenant": table.tenants(), "priority": col("priority").astype(np.int64),
        "conversation": (conversation.astype(np.int64) if not none.any()
                         else np.full(n, None, dtype=object) if none.all()
                         else np.where(none, np.nan, conversation)),
        "is_warmup": col("is_warmup").astype(bool),
        "status": _STATUS_NAMES[col("status")], "reject_reason": table.reasons(),
        "arrival_s": col("arrival_s").astype(float),
        "prompt_tokens": col("prompt_tokens").astype(np.int64), "output_tokens": col("output_tokens").astype(np.int64),
        "cached_tokens": col("cached_tokens").astype(np.int64), "preemptions": col("preemptions").astype(np.int64),
    }
    for name in ("admitted_s", "first_token_s", "finish_s", "host_s", "device_s"):
        out[name] = np.full(n, np.nan)
    if n:
        replica = out["replica"]
        run_owner, run_a, run_b = table.emit_runs()
        chunk_owner, chunk_step = table.chunk_steps()
        for rec in records.recorders:
            idx = np.flatnonzero(replica == rec.replica)
            if len(idx) and len(rec):
                times = _RecorderTimes(rec) if step_times is None else step_times(rec.replica)
                _fill_times(out, idx, table, times, (run_owner, run_a, run_b), (chunk_owner, chunk_step))
    out["ttft_s"] = out["first_token_s"] - out["arrival_s"]
    out["e2e_s"] = out["finish_s"] - out["arrival_s"]
    decode_tokens = out["output_tokens"] - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        out["tpot_s"] = np.where(decode_tokens > 0, (out["e2e_s"] - out["ttft_s"]) / np.maximum(decode_tokens, 1),
                                 np.nan)
    out["queue_s"] = out["e2e_s"] - out["host_s"] - out["device_s"]
    return out


class _RecorderTimes:
    """A recorder's step times as `cumulated_step_times` gives them, each made when first asked for
    and not kept (one column at a time: a million-request run has millions of steps). The running
    sums are written into one array, each over the one before (read each before asking for the
    next): a million-request run's second sum then faults in no fresh ~70 MB."""

    def __init__(self, rec: StepRecorder):
        self.rec = rec
        self._running: Optional[np.ndarray] = None

    def __getitem__(self, name: str) -> np.ndarray:
        if name == "token_s":
            return self.rec.token_times()
        values = self.rec.step_column(name)
        if name in ("start_s", "end_s"):
            return values
        self._running = _prefix_sums(values, self._running)
        return self._running


STEP_TIMES = ("start_s", "end_s", "token_s", "host_s", "device_s")


def cumulated_step_times(rec: StepRecorder) -> dict[str, np.ndarray]:
    """A replica's step start_s and end_s, when each step's tokens reach the client (token_s:
    StepRecorder.token_times), and its running sums of host_s and device_s (index k = the sum over
    steps < k): what a request's times are read from."""
    return {name: _RecorderTimes(rec)[name] for name in STEP_TIMES}     # (one each: none overwritten)


def _select(owner: np.ndarray, idx: np.ndarray, *values: np.ndarray):
    """Entries whose owner is among `idx` (sorted positions), owners renumbered 0..len(idx)-1.
    Owners (positions, never negative) renumbered by a table lookup, not a binary search in `idx`
    (millions of runs: ~0.1 s of a 100k-request summary)."""
    size = int(idx[-1]) + 1 if len(idx) else 0
    if len(idx) == size and (not len(owner) or int(owner.max()) < size):
        return (owner, *values)         # idx is every position up to size, owning every entry: as they are
    number = np.full(size + 1, -1, dtype=np.int64)       # (the last entry: owners past idx[-1])
    number[idx] = np.arange(len(idx))
    pos = number[np.minimum(owner, size)]
    keep = pos >= 0
    return (pos[keep], *(v[keep] for v in values))


def _fill_times(out: dict, idx: np.ndarray, table: RequestTable, times, runs, chunks) -> None:
    """`times[name]`: the replica's step column (start_s, token_s) or running sum (host_s, device_s)."""
    def at(steps: np.ndarray, times: np.ndarray) -> np.ndarray:
        valid = steps >= 0
        res = np.full(len(steps), np.nan)
        res[valid] = times[steps[valid]]
        return res

    col = table.sorted_column
    end = times["token_s"]
    out["admitted_s"][idx] = at(col("admit_step")[idx].astype(np.int64), times["start_s"])
    out["first_token_s"][idx] = at(col("first_token_step")[idx].astype(np.int64), end)
    out["finish_s"][idx] = at(col("finish_step")[idx].astype(np.int64), end)
    owner, a, b = _select(runs[0], idx, runs[1], runs[2])
    chunk_owner, chunk_step = _select(chunks[0], idx, chunks[1])
    done = col("status")[idx] == int(Status.FINISHED)
    # a request's host (device) time: its runs of steps and its chunk steps, from the run's running
    # sum (one column at a time: a million-request run has millions of steps), read into the same
    # two arrays for both columns
    after, until, since = b + 1, np.empty(len(a)), np.empty(len(a))
    for name in ("host_s", "device_s"):
        running = times[name]
        np.take(running, after, out=until, mode="clip")      # (valid steps: "clip" takes no copy of `out`)
        np.take(running, a, out=since, mode="clip")
        total = np.bincount(owner, weights=np.subtract(until, since, out=until), minlength=len(idx))
        total += np.bincount(chunk_owner, weights=running[chunk_step + 1] - running[chunk_step], minlength=len(idx))
        out[name][idx] = np.where(done, total, np.nan)


def itl_samples(records: RunRecords, measured: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pooled inter-token latencies as (values, integer weights), over `measured` request ids.

    Within a run of consecutive emitting steps every gap is one step (end[k] - end[k-1], each step's
    token time: StepRecorder.token_times);
    those are counted per step with a difference array instead of listed per token.
    Gaps between runs (after a preemption or a skipped step) are listed individually.
    """
    if records.explicit_itl is not None:
        return records.explicit_itl, np.ones(len(records.explicit_itl), dtype=np.int64)
    table: RequestTable = records.requests
    ids = table.sorted_column("id")
    keep = np.isin(ids, np.asarray(measured, dtype=np.int64))
    replica = table.sorted_column("replica")
    run_owner, run_a, run_b = table.emit_runs()
    values, weights = [], []
    for rec in records.recorders:
        idx = np.flatnonzero((replica == rec.replica) & keep)
        if not len(idx) or not len(rec):
            continue
        end = rec.token_times()
        owner, a, b = _select(run_owner, idx, run_a, run_b)
        same = owner[1:] == owner[:-1]                       # consecutive runs of one request
        between = end[a[1:][same]] - end[b[:-1][same]]
        steps, tail = len(end) - 1, len(between)
        # requests emitting in each step: +1 where a run starts, -1 after it ends, summed (one
        # float64 array, exact for counts; then reused for the gaps: millions of steps). Its tail
        # holds the gaps between runs (weight 1), so one mask reads the replica's sample out of it
        # (a value per step: ~70 MB at a million requests, not copied again by a concatenate)
        ones = np.ones(len(a))
        work = np.bincount(np.concatenate([a + 1, b + 1]), weights=np.concatenate([ones, -ones]),
                           minlength=len(end) + max(tail, 1))
        np.cumsum(work, out=work)
        work[len(end):len(end) + tail] = 1.0
        kept = np.empty(steps + tail, dtype=bool)
        np.greater(work[1:len(end)], 0, out=kept[:steps])
        kept[steps:] = True
        weight = work[1:len(end) + tail][kept].astype(np.int32)
        np.subtract(end[1:], end[:-1], out=work[:steps])
        work[steps:steps + tail] = between
        value = work[:steps + tail][kept]
        values.append(value)
        weights.append(weight)
    if not values:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    return _joined(values), _joined(weights)


# Public names for a spilled run's records, read back block by block (sim/output/streamed.py).
REQUEST_FIELDS = _REQUEST_FIELDS
select_owned = _select
