"""Trace loaders: recorded request logs -> Requests, every excluded row counted in `notes`.

Formats (docs/scenarios.md, "Public traces", lists the public files):
  azure     CSV   TIMESTAMP ('YYYY-MM-DD HH:MM:SS.fffffff'), ContextTokens, GeneratedTokens
  mooncake  JSONL {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}; one
                  hash id per `hash_block_tokens` input tokens, chained, so equal leading ids
                  mean an equal prompt prefix: block j becomes the keyed segment
                  (stable_key("mooncake", id), 512), the last one holding the remainder.
  burstgpt  CSV   Timestamp (s), Request tokens, Response tokens (+ Session ID, Elapsed time,
                  Model, Total tokens, Log Type, unused); 0 response tokens = a failed request.
  jsonl     JSONL {"arrival_s" | "timestamp" (s), "prompt": [token ids] | "prompt_len",
                  "output_len", "tenant"?, "priority"?}; other keys are ignored.
  csv       CSV with columns arrival_s | timestamp, prompt_len, output_len, tenant?, priority?.
For jsonl and csv, `fields` maps our names (arrival, prompt, prompt_len, output_len, tenant,
priority) to the file's own keys or columns, and `time_unit` (s, ms, us, ns) says what the
arrival numbers count. Without time_unit, an arrival field whose name ends in _ms, _us, _ns or
_s counts that unit (ts_ms: ms); otherwise mooncake's default is ms, the others' s. A time_unit
that contradicts the field's name is an error. A file ending in .gz is read
through gzip. Prompts without prefix information are one unique segment per row.

Plausibility: arrival times spanning over a year, or more than 1e6 requests per second on
average, are errors that name the time_unit that would make the file plausible. For jsonl and
csv so are negative arrival times, and, in a log otherwise in time order (at least 100 rows, at
most 1% of gaps negative), a time that goes back by over a tenth of the span (two clocks mixed).
Rows merely out of order are sorted (and noted).

Time: a row's time is seconds after the earliest row of the file (rows need not be sorted).
`window_s` [start, end) selects on that clock, before scaling; a kept row arrives at
(t - start) / time_scale. Then `sample` keeps each row with that probability (one seeded
draw per file row, so a row's fate does not depend on the window), then `max_requests` keeps
the first N. Rows with 0 prompt or 0 output tokens are excluded; nothing is dropped silently:
every exclusion is counted in `LoadedTrace.notes`. Malformed input raises TraceError naming
path:line, what is wrong and what was expected. A file of more than MAX_REQUESTS (1,000,000)
rows is refused while it is read (a gzip of a few kilobytes can hold millions).
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from sim.core.files import (FILE_EXCERPT_CHARS, DuplicateKeyError, check_csv_header, check_csv_row, excerpt,
                             file_problem, open_text, unique_keys)
from sim.core.request import Request, Segment, make_request, stable_key
from sim.scenario import MAX_REQUESTS, Trace


MAX_VALUE = 2**53       # counts, times and ids: exact in a float, no int64 overflow downstream


class TraceError(ValueError):
    """A trace file that cannot be read; the message starts with path:line."""


@dataclass
class LoadedTrace:
    requests: list[Request]
    notes: list[str]


@dataclass
class _Rows:
    """Parsed rows, columnar. `prompt_of(i, seed)` gives row i's prompt segments."""

    times: np.ndarray            # seconds, on the file's own clock
    prompt_len: np.ndarray       # int64
    output_len: np.ndarray       # int64
    prompt_of: Callable[[int, int], list[Segment]]
    tenants: Optional[list[Optional[str]]] = None
    priorities: Optional[list[int]] = None
    lines: Optional[np.ndarray] = None   # the file line of each row, for error messages
    unit: Optional[str] = None           # the unit the arrival times were read in (None: the format's)


def load_trace(trace: Trace, seed: int, salted_tenants: frozenset[str] = frozenset(),
               decode_step_s: Optional[float] = None, serving: str = "the engine",
               vocab_size: Optional[int] = None) -> LoadedTrace:
    """Requests (ids 0..N-1 in arrival order) and notes on what was excluded and why.

    A jsonl row's literal prompt ids must lie in 0 <= id < `vocab_size` (the model's; None, for a
    caller with no model, checks only id >= 0): a real engine would index its embedding with them.

    A jsonl row's tenant gets a cache salt when it is in `salted_tenants`. With `decode_step_s`
    (a lone decode step of the `serving` model and device) a trace that would leave the engine
    all but idle gets a note naming the likely unit mistake (see sparse_trace_note).
    """
    path = Path(trace.path)
    problem = file_problem(path)
    if problem:
        raise TraceError(f"{path}: {problem} (workload.trace.path)")
    reader = {"azure": _read_azure, "mooncake": _read_mooncake, "burstgpt": _read_burstgpt,
              "jsonl": lambda p, t: _read_jsonl(p, t, vocab_size), "csv": _read_generic_csv}[trace.format]
    rows = reader(path, trace)
    check_plausible(path, rows.times, trace, rows.lines, rows.unit)
    kept, arrivals, notes = _select(rows, trace, seed)
    if len(kept) == 0:
        raise TraceError(f"{path}: no rows left to replay ({'; '.join(notes)})")
    notes.insert(0, f"{path}: {len(kept)} of {len(rows.times)} rows replayed ({trace.format} trace)")
    if decode_step_s is not None:
        notes += sparse_trace_note(path, arrivals, rows.output_len[kept], rows.unit or time_unit(trace),
                                   decode_step_s, serving)
    requests = []
    for new_id, (i, arrival) in enumerate(zip(kept.tolist(), arrivals.tolist())):
        tenant = rows.tenants[i] if rows.tenants else None
        requests.append(make_request(
            new_id, arrival, rows.prompt_of(i, seed), int(rows.output_len[i]), seed=seed,
            tenant=tenant, salted=tenant in salted_tenants,
            priority=rows.priorities[i] if rows.priorities else 0))
    return LoadedTrace(requests, notes)


# ----------------------------------------------------------------------------- units and plausibility

SECONDS_PER = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
DEFAULT_UNIT = {"mooncake": "ms", "jsonl": "s", "csv": "s", "burstgpt": "s"}
YEAR_S = 365.25 * 86400
MAX_RATE = 1e6


def unit_in_name(name: Optional[str]) -> Optional[str]:
    """The unit a field's name states by its suffix (ts_ms -> ms, arrival_s -> s), else None."""
    lower = (name or "").lower()
    return next((u for u in ("ms", "us", "ns", "s") if lower.endswith("_" + u)), None)


def time_unit(trace: Trace, field: Optional[str] = None) -> str:
    """The unit of the arrival field `field`: time_unit when given, else the one its name states
    (ts_ms), else the format's default. A name stating another unit than time_unit is an error:
    one of the two is a mistake, and guessing which would run a trace 1000x too slow or fast."""
    named = unit_in_name(field)
    if trace.time_unit is not None and named is not None and named != trace.time_unit:
        raise TraceError(f"workload.trace.time_unit is {trace.time_unit} but the arrival field '{field}' says "
                         f"{named} by its name: set time_unit: {named}, or drop time_unit if the name is right")
    return trace.time_unit or named or DEFAULT_UNIT.get(trace.format, "s")


def check_plausible(path: Path, times: np.ndarray, trace: Trace, lines: Optional[np.ndarray] = None,
                    unit: Optional[str] = None) -> None:
    """Times (s) that cannot be a request log's: a TraceError naming the likely unit mistake."""
    if len(times) < 2:
        return
    unit = unit or time_unit(trace)
    span = float(times.max() - times.min())
    where = "workload.trace.time_unit"
    if span > YEAR_S:
        better = [u for u in ("ms", "us", "ns") if SECONDS_PER[u] < SECONDS_PER[unit]
                  and span * SECONDS_PER[u] / SECONDS_PER[unit] <= YEAR_S]
        hint = f"; if they count {' or '.join(better)}, set {where}" if better else ""
        raise TraceError(f"{path}: the arrival times span {span / YEAR_S:,.0f} years read as {unit}{hint}")
    if span > 0 and len(times) / span > MAX_RATE:
        better = [u for u in ("us", "ms", "s") if SECONDS_PER[u] > SECONDS_PER[unit]
                  and len(times) / (span * SECONDS_PER[u] / SECONDS_PER[unit]) <= MAX_RATE]
        hint = f"; if they count {' or '.join(better)}, set {where}" if better else ""
        raise TraceError(f"{path}: {len(times):,} requests within {span:.3g} s read as {unit} "
                         f"({len(times) / span:.3g}/s, over {MAX_RATE:.0e}/s){hint}")
    if trace.format not in ("jsonl", "csv"):
        return
    if times.min() < 0:
        i = int(np.argmin(times))
        line = f":{lines[i]}" if lines is not None else ""
        raise TraceError(f"{path}{line}: arrival time {times[i]:.6g} s is negative: an arrival time counts "
                         f"from some start (an integer that overflowed, or a gap rather than a time?)")
    back = np.diff(times)
    if span > 0 and len(times) >= 100 and (back < 0).mean() <= 0.01:
        # a sorted log whose clock jumps back: another clock (per session, a restart) mixed in
        worst = int(np.argmin(back))
        if back[worst] < -0.1 * span:
            line = f":{lines[worst + 1]}" if lines is not None else ""
            raise TraceError(f"{path}{line}: the arrival time goes back by {-back[worst]:.6g} s "
                             f"({times[worst]:.6g} -> {times[worst + 1]:.6g} s, over a tenth of the file's span): "
                             f"is the arrival field ({_keys(trace)['arrival'] or 'arrival_s/timestamp'}) a time "
                             f"of arrival, not a duration or a per-session offset? (rows merely out of order "
                             f"by less are sorted)")


SPARSE_BUSY = 0.01       # a trace keeping the engine busy under 1% of an hour or more: a unit mistake?
SPARSE_SPAN_S = 3600.0


def sparse_trace_note(path: Path, arrivals: np.ndarray, outputs: np.ndarray, unit: str, decode_step_s: float,
                      serving: str) -> list[str]:
    """A note when the implied rate is implausibly low for the model and device: one request
    alone takes about output_len decode steps, so rate x that is the most of the time the engine
    could be busy; under SPARSE_BUSY over an hour or more, the times likely count a smaller unit."""
    span = float(arrivals.max() - arrivals.min()) if len(arrivals) > 1 else 0.0
    if span < SPARSE_SPAN_S:
        return []
    rate = len(arrivals) / span
    busy = rate * float(outputs.mean()) * decode_step_s
    smaller = [u for u in ("ms", "us") if SECONDS_PER[u] < SECONDS_PER[unit]]
    if busy >= SPARSE_BUSY or not smaller:
        return []
    return [f"WARNING {path}: {len(arrivals):,} requests over {span / 3600:,.1f} h read as {unit} "
            f"({rate:.3g} req/s) would keep {serving} busy at most {busy:.2%} of the time: if the arrival "
            f"times count {' or '.join(smaller)}, set workload.trace.time_unit"]


# ----------------------------------------------------------------------------- selection

def _select(rows: _Rows, trace: Trace, seed: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Row indices to replay, in arrival order, with their arrival times and the notes."""
    notes = []
    n = len(rows.times)
    if n == 0:
        raise TraceError(f"{trace.path}: no rows (expected one JSON object per line)")
    rel = rows.times - rows.times.min()
    keep = np.ones(n, dtype=bool)
    for column, what in ((rows.prompt_len, "prompt"), (rows.output_len, "output")):
        empty = keep & (column == 0)
        if empty.any():
            why = " (failed requests)" if trace.format == "burstgpt" and what == "output" else ""
            notes.append(f"excluded {int(empty.sum())} rows with 0 {what} tokens{why}")
            keep &= ~empty
    start = 0.0
    if trace.window_s is not None:
        start, end = trace.window_s
        outside = keep & ((rel < start) | (rel >= end))
        notes.append(f"window_s [{start:g}, {end:g}): excluded {int(outside.sum())} rows outside it")
        keep &= ~outside
    if trace.sample is not None:
        rng = np.random.Generator(np.random.PCG64(stable_key("trace-sample", seed)))
        dropped = keep & (rng.random(n) >= trace.sample)
        notes.append(f"sample {trace.sample:g}: excluded {int(dropped.sum())} of {int(keep.sum())} rows")
        keep &= ~dropped
    idx = np.flatnonzero(keep)
    kept = idx[np.argsort(rel[idx], kind="stable")]   # ties keep file order
    if trace.max_requests is not None and len(kept) > trace.max_requests:
        notes.append(f"max_requests {trace.max_requests}: excluded the last "
                     f"{len(kept) - trace.max_requests} rows")
        kept = kept[: trace.max_requests]
    if np.any(np.diff(rows.times) < 0):
        notes.append("rows were not in time order; replayed in time order")
    return kept, (rel[kept] - start) / trace.time_scale, notes


# ----------------------------------------------------------------------------- CSV formats

def _check_row_count(path: Path, rows: int, line: int) -> None:
    """Past MAX_REQUESTS rows, stop reading: every row may become a request, and the request
    bound is what keeps a run's time and memory in check (a 30 KB gzip can hold millions of
    rows). Counted while reading, so the refusal comes before the rows are held."""
    if rows > MAX_REQUESTS:
        raise TraceError(f"{path}:{line}: more than {MAX_REQUESTS:,} rows, the most a trace may hold "
                         f"(kvtwin's bound on requests per run, which cannot be raised); cut the file "
                         f"to the rows you want to replay first (workload.trace.window_s, sample and "
                         f"max_requests select from the rows read, so they cannot lift this)")

def _read_azure(path: Path, trace: Trace) -> _Rows:
    table, lines = _read_csv(path, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
    stamps = table["TIMESTAMP"]
    try:   # numpy keeps all 7 fractional digits (datetime.strptime's %f takes at most 6)
        parsed = np.array(stamps, dtype="datetime64[ns]")
    except ValueError:
        parsed = None
    if parsed is None or np.isnat(parsed).any():
        _raise_first_bad(path, lines, stamps, "TIMESTAMP", "a time like 2023-11-16 18:17:03.9799600",
                         lambda s: not np.isnat(np.datetime64(s, "ns")))
    seconds = (parsed - parsed.min()).astype(np.int64) / 1e9
    prompt = _counts(path, lines, table, "ContextTokens")
    return _Rows(seconds, prompt, _counts(path, lines, table, "GeneratedTokens"),
                 _unique_prompt(lines, prompt))


def _read_burstgpt(path: Path, trace: Trace) -> _Rows:
    table, lines = _read_csv(path, ["Timestamp", "Request tokens", "Response tokens"])
    prompt = _counts(path, lines, table, "Request tokens")
    return _Rows(_numbers(path, lines, table, "Timestamp") * SECONDS_PER[time_unit(trace)], prompt,
                 _counts(path, lines, table, "Response tokens"), _unique_prompt(lines, prompt), lines=lines)


def _read_csv(path: Path, needed: list[str]) -> tuple[dict[str, list[str]], np.ndarray]:
    """The needed columns as lists of strings, and the file line of each data row."""
    with open_text(path, "CSV trace", gzip_ok=True) as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader, [])]
            missing = [c for c in needed if c not in header]
            if missing:
                raise TraceError(f"{path}:1: missing column {', '.join(map(repr, missing))} "
                                 f"(found {len(header)} columns: {_names(header)}; expected {needed})")
            check_csv_header(path, header, needed, TraceError)
            cols = [header.index(c) for c in needed]
            values: list[list[str]] = [[] for _ in needed]
            lines = []
            for row in reader:
                if not row:
                    continue
                check_csv_row(path, reader.line_num, row, header, TraceError)
                for out, c in zip(values, cols):
                    out.append(row[c])
                lines.append(reader.line_num)
                _check_row_count(path, len(lines), reader.line_num)
        except csv.Error as e:     # a field over csv's 128 KiB limit, a NUL byte, a bad quote
            raise TraceError(f"{path}:{reader.line_num}: not a valid CSV row ({e})") from None
    if not lines:
        raise TraceError(f"{path}: no rows after the header")
    return dict(zip(needed, values)), np.array(lines, dtype=np.int64)


def _names(header: list[str]) -> str:
    """A file's column names, each and all cut short (the header may be any file's first line)."""
    return excerpt(", ".join(h[:FILE_EXCERPT_CHARS] for h in header[:6]), 3 * FILE_EXCERPT_CHARS)


def _numbers(path: Path, lines: np.ndarray, table: dict[str, list[str]], column: str) -> np.ndarray:
    strings = table[column]
    try:
        values = np.array(strings, dtype=np.float64)
    except ValueError:
        values = None
    if values is None or not np.isfinite(values).all():
        _raise_first_bad(path, lines, strings, column, "a finite number",
                         lambda s: math.isfinite(float(s)))
    return values


def _counts(path: Path, lines: np.ndarray, table: dict[str, list[str]], column: str) -> np.ndarray:
    """A token-count column: finite, whole and >= 0."""
    values = _numbers(path, lines, table, column)
    bad = np.flatnonzero((values < 0) | (values != np.floor(values)) | (values >= MAX_VALUE))
    if len(bad):
        i = bad[0]
        raise TraceError(f"{path}:{lines[i]}: {column} is {excerpt(table[column][i], FILE_EXCERPT_CHARS)}, "
                         f"expected a whole number of tokens >= 0 (below 2^53)")
    return values.astype(np.int64)


def _raise_first_bad(path: Path, lines: np.ndarray, strings: list[str], column: str,
                     expected: str, ok: Callable[[str], bool]) -> None:
    for line, s in zip(lines.tolist(), strings):
        try:
            good = ok(s)
        except (ValueError, OverflowError):
            good = False
        if not good:
            raise TraceError(f"{path}:{line}: {column} is {excerpt(s, FILE_EXCERPT_CHARS)}, expected {expected}")
    raise AssertionError("a column failed to parse but no value is bad")


def _unique_prompt(lines: np.ndarray, prompt_len: np.ndarray) -> Callable[[int, int], list[Segment]]:
    """Rows without prefix information: one segment per row, keyed by its file line."""
    return lambda i, seed: [(stable_key("trace", seed, int(lines[i])), int(prompt_len[i]))]


# ----------------------------------------------------------------------------- JSON lines

def _json_rows(path: Path):
    """(line number, object) per non-blank line; a key given twice in an object is an error (json
    would keep the last silently: which of two output lengths was meant is not known)."""
    rows = 0
    with open_text(path, "JSON-lines trace", gzip_ok=True) as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            rows += 1
            _check_row_count(path, rows, line_no)
            try:
                obj = json.loads(text, object_pairs_hook=unique_keys)    # ~2.7 us more a line, measured
            except DuplicateKeyError as e:
                raise TraceError(f"{path}:{line_no}: {e}") from None
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{line_no}: not valid JSON ({e.msg}), expected one object per line") from None
            except RecursionError:
                raise TraceError(f"{path}:{line_no}: nested too deeply, expected one flat object per line") from None
            except ValueError as e:    # e.g. an integer over Python's 4300-digit limit
                raise TraceError(f"{path}:{line_no}: not a usable JSON value ({excerpt(e, 80)})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{line_no}: a JSON {type(obj).__name__}, expected an object")
            yield line_no, obj


def _field(obj: dict, key: str, where: str, expected: str, check: Callable[[Any], bool]) -> Any:
    if key not in obj:
        raise TraceError(f"{where}: missing {key!r}, expected {expected}")
    value = obj[key]
    try:     # an integer too big for a float (10**400) overflows here: a bad value, not a crash
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and check(value)
    except (OverflowError, ValueError):
        ok = False
    if not ok:
        raise TraceError(f"{where}: {key} is {excerpt(value, FILE_EXCERPT_CHARS)}, expected {expected}")
    return value


def _count(obj: dict, key: str, where: str) -> int:
    return int(_field(obj, key, where, "a whole number of tokens >= 0 (below 2^53)",
                      lambda v: math.isfinite(v) and 0 <= v < MAX_VALUE and v == int(v)))


def _time(obj: dict, key: str, where: str, expected: str) -> float:
    return float(_field(obj, key, where, expected, math.isfinite))


def _read_mooncake(path: Path, trace: Trace) -> _Rows:
    block = trace.hash_block_tokens
    scale = SECONDS_PER[time_unit(trace)]
    times, prompts, outputs, hash_ids = [], [], [], []
    for line_no, obj in _json_rows(path):
        where = f"{path}:{line_no}"
        times.append(_time(obj, "timestamp", where, f"a finite time in {time_unit(trace)}") * scale)
        n_in = _count(obj, "input_length", where)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(type(h) is int and 0 <= h < MAX_VALUE for h in ids):
            raise TraceError(f"{where}: hash_ids is not a list of integers, expected one id per "
                             f"{block}-token block")
        if len(ids) != -(-n_in // block):
            raise TraceError(f"{where}: hash_ids has {len(ids)} ids, expected ceil({n_in}/{block}) = "
                             f"{-(-n_in // block)} (one id per {block}-token block)")
        prompts.append(n_in)
        outputs.append(_count(obj, "output_length", where))
        hash_ids.append(ids)
    keys: dict[int, int] = {}   # ids repeat across rows; hash each once

    def key(h: int) -> int:
        k = keys.get(h)
        if k is None:
            k = keys[h] = stable_key("mooncake", h)
        return k

    def prompt_of(i: int, seed: int) -> list[Segment]:
        ids = hash_ids[i]
        segs = [(key(h), block) for h in ids]
        if segs:   # the last block holds the remainder
            segs[-1] = (segs[-1][0], prompts[i] - block * (len(ids) - 1))
        return segs

    return _Rows(np.array(times, dtype=np.float64), np.array(prompts, dtype=np.int64),
                 np.array(outputs, dtype=np.int64), prompt_of)


def _keys(trace: Trace) -> dict[str, Optional[str]]:
    """Our field -> the file's key (arrival None: 'arrival_s', else 'timestamp')."""
    keys: dict[str, Optional[str]] = {"arrival": None, "prompt": "prompt", "prompt_len": "prompt_len",
                                      "output_len": "output_len", "tenant": "tenant", "priority": "priority"}
    keys.update(trace.fields or {})
    return keys


def _read_jsonl(path: Path, trace: Trace, vocab_size: Optional[int] = None) -> _Rows:
    keys = _keys(trace)
    units: dict[str, str] = {}                 # per arrival key met (a row has arrival_s or timestamp)
    times, prompts, outputs, lines, literal, tenants, priorities = [], [], [], [], [], [], []
    for line_no, obj in _json_rows(path):
        where = f"{path}:{line_no}"
        arrival = keys["arrival"] or ("arrival_s" if "arrival_s" in obj else "timestamp")
        named = f"{keys['arrival']!r}, fields.arrival" if keys["arrival"] else "'arrival_s' or 'timestamp'"
        unit = units.get(arrival) or units.setdefault(arrival, time_unit(trace, arrival))
        times.append(_time(obj, arrival, where, f"the arrival as a finite number of {unit} ({named})")
                     * SECONDS_PER[unit])
        tokens = _literal_prompt(obj, where, keys, vocab_size)
        literal.append(tokens)
        prompts.append(len(tokens) if tokens is not None else _count(obj, keys["prompt_len"], where))
        outputs.append(_count(obj, keys["output_len"], where))
        tenants.append(_tenant(obj, where, keys["tenant"]))
        priorities.append(int(_field(obj, keys["priority"], where, "an integer below 2^31 in size",
                                     lambda v: abs(v) < 2**31 and v == int(v)))
                          if keys["priority"] in obj else 0)
        lines.append(line_no)

    def prompt_of(i: int, seed: int) -> list[Segment]:
        if literal[i] is not None:
            return [literal[i]]
        return [(stable_key("trace", seed, lines[i]), prompts[i])]

    return _Rows(np.array(times, dtype=np.float64), np.array(prompts, dtype=np.int64),
                 np.array(outputs, dtype=np.int64), prompt_of, tenants=tenants, priorities=priorities,
                 lines=np.array(lines, dtype=np.int64), unit=next(iter(units.values()), None))


def _read_generic_csv(path: Path, trace: Trace) -> _Rows:
    """A CSV request log: arrival, prompt_len, output_len (+ tenant, priority) columns."""
    keys = _keys(trace)
    with open_text(path, "CSV trace", gzip_ok=True) as f:
        try:
            header = [h.strip() for h in next(csv.reader(f), [])]
        except csv.Error as e:
            raise TraceError(f"{path}:1: not a valid CSV header ({e})") from None
    arrival = keys["arrival"] or ("arrival_s" if "arrival_s" in header else "timestamp")
    optional = [keys[k] for k in ("tenant", "priority") if keys[k] in header]
    table, lines = _read_csv(path, [arrival, keys["prompt_len"], keys["output_len"], *optional])
    prompt = _counts(path, lines, table, keys["prompt_len"])
    tenants = [t or None for t in table[keys["tenant"]]] if keys["tenant"] in table else None
    priorities = None
    if keys["priority"] in table:
        priorities = _numbers(path, lines, table, keys["priority"])
        bad = np.flatnonzero((priorities != np.floor(priorities)) | (np.abs(priorities) >= 2**31))
        if len(bad):
            raise TraceError(f"{path}:{lines[bad[0]]}: {keys['priority']} is "
                             f"{excerpt(table[keys['priority']][bad[0]], FILE_EXCERPT_CHARS)}, expected an integer below 2^31 in size")
        priorities = priorities.astype(np.int64).tolist()
    unit = time_unit(trace, arrival)
    return _Rows(_numbers(path, lines, table, arrival) * SECONDS_PER[unit], prompt,
                 _counts(path, lines, table, keys["output_len"]), _unique_prompt(lines, prompt),
                 tenants=tenants, priorities=priorities, lines=lines, unit=unit)


def _literal_prompt(obj: dict, where: str, keys: dict[str, Optional[str]],
                    vocab_size: Optional[int]) -> Optional[list[int]]:
    ids, length = keys["prompt"], keys["prompt_len"]
    if ids not in obj and length not in obj:
        raise TraceError(f"{where}: expected {ids!r} (token ids) or {length!r}")
    tokens = obj.get(ids)
    if tokens is None:
        return None
    if not isinstance(tokens, list):
        raise TraceError(f"{where}: {ids} is {excerpt(tokens, FILE_EXCERPT_CHARS)}, expected a list of token ids")
    limit = MAX_VALUE if vocab_size is None else vocab_size
    if not all(type(t) is int and 0 <= t < limit for t in tokens):
        k, bad = next((k, t) for k, t in enumerate(tokens) if not (type(t) is int and 0 <= t < limit))
        expected = ("integers >= 0" if vocab_size is None
                    else f"0 <= id < vocab_size (the model's vocab_size is {vocab_size})")
        raise TraceError(f"{where}: {ids}[{k}] is {excerpt(bad, FILE_EXCERPT_CHARS)}, expected a token id: {expected}")
    if length in obj and _count(obj, length, where) != len(tokens):     # logs often carry both
        raise TraceError(f"{where}: {ids} holds {len(tokens)} token ids but {length} is {excerpt(obj[length], FILE_EXCERPT_CHARS)}")
    return tokens


def _tenant(obj: dict, where: str, key: str) -> Optional[str]:
    tenant = obj.get(key)
    if tenant is not None and not isinstance(tenant, str):
        raise TraceError(f"{where}: {key} is {excerpt(tenant, FILE_EXCERPT_CHARS)}, expected a name (string)")
    return tenant
