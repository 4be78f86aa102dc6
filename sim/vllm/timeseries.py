"""vLLM's running / waiting / KV-usage curves from its server log or /metrics scrapes, set
against a prediction's.

`load_series(path)` reads any of:
  - a vLLM server log: the periodic stats lines of V1
      `... Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
       Running: N reqs, Waiting: M reqs, GPU KV cache usage: Z%, Prefix cache hit rate: H%`
    and V0 (`Running: N reqs, Swapped: S reqs, Pending: M reqs, GPU KV cache usage: Z%, ...`).
    Time comes from the line's `MM-DD HH:MM:SS` (vLLM prints no year: `year` fills it in) or an
    ISO time before it (`docker logs --timestamps`); lines of several engines (data parallel)
    at one time add up (running, waiting, throughputs) or average (KV %).
  - Prometheus text scrapes with vLLM's names: either samples carrying their own timestamp
    (`name{labels} value timestamp_ms`, as the exposition format allows) or scrapes each headed
    by `# TIME <unix seconds>`, which this loop writes:
        while sleep 1; do echo "# TIME $(date +%s.%N)"; curl -s localhost:8000/metrics; done > scrapes.prom
    Gauges: vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
    (V0: vllm:gpu_cache_usage_perc), as a fraction; counters vllm:prompt_tokens,
    vllm:generation_tokens give the throughputs between scrapes.
  - a Prometheus HTTP API answer (`/api/v1/query_range`, resultType matrix) as JSON.
  - `simrun bench`'s measured/metrics_timeline.csv.
into a frame with columns t_s (seconds since the first sample), running, waiting,
kv_usage_pct (0-100), prompt_tps, generation_tps (NaN where absent), and
attrs["t0_wall"]: the first sample's wall time (seconds since the epoch, the log's clock read
as UTC) when the file says it.

`align_offset` puts the series on a run's clock: from wall times when both are known, else
by sliding the measured curves along the predicted ones (the offset with the least mean
absolute difference of running + waiting and KV %). `compare_series` gives the predicted value
at each measured sample and the mean absolute difference per quantity.
"""
from __future__ import annotations

import datetime as dt
import io
import math
import re
from pathlib import Path
from typing import Iterator, Optional

from sim.core.files import FileFormatError, excerpt, load_json, read_text
from sim.core.lazy import lazy_import
from sim.errors import UserError

np = lazy_import("numpy")      # on first use: `simrun bench -h` (which imports this) stays light
pd = lazy_import("pandas")

SERIES_COLUMNS = ("t_s", "running", "waiting", "kv_usage_pct", "prompt_tps", "generation_tps")
QUANTITIES = ("running", "waiting", "kv_usage_pct")
MAX_BYTES = 1 << 30        # a log bigger than this is not read (bounded input)

METRIC_ALIASES = {     # our column -> vLLM names, newest first (V0 used the gpu_ prefixes)
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "preemptions": ("vllm:num_preemptions",),
    "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+(-?\d+))?\s*$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# ----------------------------------------------------------------------------- Prometheus text

def prometheus_samples(text: str) -> Iterator[tuple[str, dict[str, str], float, Optional[float]]]:
    """(name without `_total`, labels, value, timestamp in s or None) per sample line."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        stamp = float(match.group(4)) / 1e3 if match.group(4) else None
        yield match.group(1).removesuffix("_total"), dict(_LABEL.findall(match.group(2) or "")), value, stamp


def parse_prometheus(text: str) -> tuple[dict[str, list[float]], dict[str, dict[str, str]]]:
    """Samples per metric name (counters without `_total`, one value per label set), and the
    labels of each name's last sample (vllm:cache_config_info carries the pool size there)."""
    values: dict[str, list[float]] = {}
    labels: dict[str, dict[str, str]] = {}
    for name, lab, value, _ in prometheus_samples(text):
        values.setdefault(name, []).append(value)
        labels[name] = lab
    return values, labels


def timeline_row(values: dict[str, list[float]]) -> Optional[dict[str, float]]:
    """One scrape as a row; None when the text has none of vLLM's gauges. Gauges add up over
    engines (data parallel), except KV usage, a fraction, which is averaged."""
    row = {}
    for column, names in METRIC_ALIASES.items():
        found = next((values[n] for n in names if n in values), None)
        row[column] = math.nan if found is None else (float(np.mean(found)) if column == "kv_usage"
                                                      else float(sum(found)))
    return None if math.isnan(row["running"]) and math.isnan(row["kv_usage"]) else row


def pool_blocks(labels: dict[str, dict[str, str]]) -> int:
    """Usable KV blocks from vllm:cache_config_info (num_gpu_blocks includes the null block)."""
    blocks = labels.get("vllm:cache_config_info", {}).get("num_gpu_blocks")
    # ASCII digits only: '²'.isdigit() holds, and int('²') fails
    if not (blocks and blocks.isascii() and blocks.isdigit() and len(blocks) <= 12):
        return 0
    return max(int(blocks) - 1, 0)


def sample_problem(row: dict[str, float]) -> Optional[str]:
    """Why a scrape row (timeline_row's columns) is no state a server can be in: a value that is
    infinite or negative, or KV usage above 1 ("running = inf"); None when it is one (NaN: the
    metric is absent)."""
    for column, value in row.items():
        if math.isnan(value):
            continue
        if not math.isfinite(value) or value < 0 or (column == "kv_usage" and value > 1):
            return f"{column} = {value}"
    return None


def scrapes_frame(rows: list[dict]) -> pd.DataFrame:
    """Scrape rows (t_s + timeline_row's columns) -> the series columns; throughputs from the
    token counters' growth between scrapes."""
    df = pd.DataFrame(rows).sort_values("t_s", kind="stable").reset_index(drop=True)
    out = pd.DataFrame({"t_s": df["t_s"], "running": df["running"], "waiting": df["waiting"],
                        "kv_usage_pct": df["kv_usage"] * 100})
    gap = df["t_s"].diff()
    for counter, column in (("prompt_tokens", "prompt_tps"), ("generation_tokens", "generation_tps")):
        grown = df[counter].diff() if counter in df else pd.Series(np.nan, index=df.index)
        out[column] = (grown / gap).where(gap > 0)
    return out


# ----------------------------------------------------------------------------- loading

def load_series(path: str | Path, year: Optional[int] = None) -> pd.DataFrame:
    """A vLLM log, Prometheus scrapes or query_range JSON, or bench's metrics_timeline.csv, as
    the series frame (module docstring). UserError naming the file when nothing is found."""
    path = Path(path)
    try:          # bounded, UTF-8, named in every error (a log bigger than MAX_BYTES: cut it to the run)
        text = read_text(path, "vLLM server log or /metrics scrapes", MAX_BYTES)
    except FileFormatError as e:
        raise UserError(str(e)) from None
    if path.suffix == ".csv":
        frame = _bench_timeline(path, text)
    else:
        stripped = text.lstrip()
        if stripped.startswith("{"):
            frame = _query_range(path, stripped)
        elif "vllm:num_requests_running" in text or "vllm:kv_cache_usage_perc" in text \
                or "vllm:gpu_cache_usage_perc" in text:
            frame = _scrapes(path, text)
        else:
            frame = _log(path, text, year)
    _check_series(path, frame)
    frame.attrs["source"] = str(path)
    return frame


MAX_SPAN_S = 30 * 86400      # as every duration of a scenario


def _check_series(path: Path, frame: pd.DataFrame) -> None:
    """UserError naming the file when a sample is no state a server can be in: a time that is
    not finite or a span past 30 days (milliseconds read as seconds), a count or throughput that
    is infinite or negative, KV usage outside 0..100 %. NaN is a metric the file lacks."""
    t = frame["t_s"].to_numpy()
    if not np.isfinite(t).all():
        raise UserError(f"{path}: a sample's time is not a finite number of seconds")
    if len(t) and t[-1] > MAX_SPAN_S:
        raise UserError(f"{path}: the samples span {t[-1]:.6g} s, more than 30 days (times in milliseconds "
                        f"read as seconds?)")
    for column in SERIES_COLUMNS[1:]:
        values = frame[column].to_numpy()
        top = 100.0 if column == "kv_usage_pct" else math.inf
        bad = ~np.isnan(values) & ~(np.isfinite(values) & (values >= 0) & (values <= top))
        if column.endswith("_tps"):         # from counter growth: a counter reset (a restart) makes it < 0
            bad = ~np.isnan(values) & ~np.isfinite(values)
        if bad.any():
            i = int(np.argmax(bad))
            expected = "a finite number from 0 to 100" if column == "kv_usage_pct" else "a finite number >= 0"
            raise UserError(f"{path}: the sample at t = {t[i]:.6g} s has {column} = {values[i]:.6g}, "
                            f"expected {expected}")


def _finish(frame: pd.DataFrame, t0_wall: Optional[float], kind: str) -> pd.DataFrame:
    """Columns in order, time from the first sample, attrs."""
    frame = frame.sort_values("t_s", kind="stable").reset_index(drop=True)
    start = float(frame["t_s"].iloc[0])
    frame["t_s"] = frame["t_s"] - start
    for col in SERIES_COLUMNS:
        if col not in frame:
            frame[col] = np.nan
    frame = frame[list(SERIES_COLUMNS)].astype(float)
    frame.attrs["t0_wall"] = None if t0_wall is None else t0_wall + start
    frame.attrs["kind"] = kind
    return frame


# --- server logs

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_STATS = {
    "prompt_tps": re.compile(r"Avg prompt throughput: " + _NUM),
    "generation_tps": re.compile(r"Avg generation throughput: " + _NUM),
    "running": re.compile(r"Running: (\d+) reqs"),
    "waiting": re.compile(r"(?:Waiting|Pending): (\d+) reqs"),
    "kv_usage_pct": re.compile(r"GPU KV cache usage: " + _NUM + "%"),
}
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d(?:\.\d+)?)")
_VLLM_STAMP = re.compile(r"\b(?:INFO|WARNING|DEBUG|ERROR)\s+(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?")
_ENGINE = re.compile(r"Engine (\d+):")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


_REQUEST_LINE = re.compile(r"\b(Received request|Added request)\b")


def _log(path: Path, text: str, year: Optional[int]) -> pd.DataFrame:
    rows = []
    requests: dict[str, list[float]] = {}          # per kind of request line, its times
    year = year or dt.datetime.now(dt.timezone.utc).year
    for line_no, line in enumerate(text.splitlines(), start=1):
        kind = _REQUEST_LINE.search(line)          # with vLLM's --enable-log-requests
        if kind:
            stamp = _checked_time(path, line_no, _ANSI.sub("", line), year)
            if stamp is not None:
                requests.setdefault(kind.group(1), []).append(stamp)
        if "Running:" not in line or "reqs" not in line:
            continue
        line = _ANSI.sub("", line)
        stamp = _checked_time(path, line_no, line, year)
        if stamp is None:
            raise UserError(f"{path}:{line_no}: a stats line without a time (expected vLLM's "
                            f"'INFO MM-DD HH:MM:SS' or an ISO time)")
        row = {"wall": stamp, "engine": int(m.group(1)) if (m := _ENGINE.search(line)) else 0}
        for column, pattern in _STATS.items():
            match = pattern.search(line)
            row[column] = float(match.group(1)) if match else np.nan
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no vLLM stats line ('Running: N reqs, Waiting: M reqs, GPU KV cache usage: "
                        f"X%') and no /metrics sample; was the server started with --disable-log-stats?")
    df = pd.DataFrame(rows)
    # Data-parallel engines log one line each per interval: add them up per time stamp.
    per_time = df.groupby("wall", sort=True).agg(
        running=("running", "sum"), waiting=("waiting", "sum"), kv_usage_pct=("kv_usage_pct", "mean"),
        prompt_tps=("prompt_tps", "sum"), generation_tps=("generation_tps", "sum")).reset_index()
    t0 = float(per_time["wall"].iloc[0])
    per_time["t_s"] = per_time["wall"] - t0
    frame = _finish(per_time.drop(columns="wall"), t0, "log")
    # one line per request: "Added request" (the engine's) when the log has it, else "Received request"
    frame.attrs["request_walls"] = sorted(requests.get("Added request") or requests.get("Received request") or [])
    return frame


def _checked_time(path: Path, line_no: int, line: str, year: int) -> Optional[float]:
    """_line_time, with a time that is no date (month 13, 30 February) an error naming the line."""
    try:
        return _line_time(line, year)
    except (ValueError, OverflowError) as e:
        raise UserError(f"{path}:{line_no}: the time of this line is no date ({e})") from None


def _line_time(line: str, year: int) -> Optional[float]:
    """Seconds since the epoch of the line's time, its clock read as UTC (vLLM logs local time)."""
    iso = _ISO.search(line)
    vllm = _VLLM_STAMP.search(line)
    if iso and (vllm is None or iso.start() < vllm.start()):
        y, mo, d, h, mi = (int(iso.group(i)) for i in range(1, 6))
        sec = float(iso.group(6))
        base = dt.datetime(y, mo, d, h, mi, tzinfo=dt.timezone.utc).timestamp()
        return base + sec
    if vllm:
        mo, d, h, mi, s = (int(vllm.group(i)) for i in range(1, 6))
        frac = float("0." + vllm.group(6)) if vllm.group(6) else 0.0
        return dt.datetime(year, mo, d, h, mi, s, tzinfo=dt.timezone.utc).timestamp() + frac
    return None


# --- Prometheus scrapes

_TIME_HEADER = re.compile(r"^#\s*TIME\s+([0-9]+(?:\.[0-9]+)?)\s*$")


def _scrapes(path: Path, text: str) -> pd.DataFrame:
    """Scrapes headed by `# TIME <s>`, or samples with their own timestamps."""
    blocks: list[tuple[float, list[str]]] = []
    for line in text.splitlines():
        header = _TIME_HEADER.match(line)
        if header:
            blocks.append((float(header.group(1)), []))
        elif blocks:
            blocks[-1][1].append(line)
    rows = []
    if blocks:
        for stamp, lines in blocks:
            values, _ = parse_prometheus("\n".join(lines))
            row = timeline_row(values)
            if row is not None:
                rows.append({"t_s": stamp, **row})
    else:
        by_time: dict[float, dict[str, list[float]]] = {}
        for name, _, value, stamp in prometheus_samples(text):
            if stamp is None:
                raise UserError(f"{path}: /metrics samples without a time: head each scrape with "
                                f"'# TIME <unix seconds>' (see `simrun compare -h`) or keep the samples' "
                                f"timestamps")
            by_time.setdefault(stamp, {}).setdefault(name, []).append(value)
        for stamp, values in by_time.items():
            row = timeline_row(values)
            if row is not None:
                rows.append({"t_s": stamp, **row})
    if not rows:
        raise UserError(f"{path}: no scrape holds vllm:num_requests_running or vllm:kv_cache_usage_perc")
    return _finish(scrapes_frame(rows), 0.0, "metrics")      # t_s is already seconds since the epoch


def _query_range(path: Path, text: str) -> pd.DataFrame:
    """Prometheus /api/v1/query_range answers (one, or a list of them) for vLLM's metrics."""
    try:
        data = load_json(text, path)
    except FileFormatError as e:
        raise UserError(str(e)) from None
    answers = data if isinstance(data, list) else [data]
    series: dict[float, dict[str, list[float]]] = {}
    for answer in answers:
        data = answer.get("data") if isinstance(answer, dict) else None
        results = data.get("result") if isinstance(data, dict) else None
        if not isinstance(results, list):
            raise UserError(f"{path}: expected Prometheus query_range JSON ({{'data': {{'result': [...]}}}})")
        for i, result in enumerate(results):
            for name, stamp, value in _range_samples(path, f"data.result[{i}]", result):
                series.setdefault(stamp, {}).setdefault(name, []).append(value)
    rows = [{"t_s": t, **row} for t, values in series.items() if (row := timeline_row(values)) is not None]
    if not rows:
        raise UserError(f"{path}: the query_range answer holds none of vLLM's gauges (query "
                        f"vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc)")
    return _finish(scrapes_frame(rows), 0.0, "metrics")      # t_s is already seconds since the epoch


def _range_samples(path: Path, where: str, result) -> Iterator[tuple[str, float, float]]:
    """(metric name without `_total`, time, value) of one query_range result; UserError naming
    the entry when it is not {metric: {__name__}, values: [[time, value], ...]}."""
    if not isinstance(result, dict) or not isinstance(result.get("metric") or {}, dict):
        raise UserError(f"{path}: {where} is {excerpt(result)}, expected an object with metric and values")
    name = str((result.get("metric") or {}).get("__name__", "")).removesuffix("_total")
    values = result.get("values") or []
    if not isinstance(values, list):
        raise UserError(f"{path}: {where}.values is {excerpt(values)}, expected a list of [time, value] pairs")
    for j, pair in enumerate(values):
        try:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError
            stamp, value = float(pair[0]), float(pair[1])
        except (TypeError, ValueError):
            raise UserError(f"{path}: {where}.values[{j}] is {excerpt(pair)}, expected [time, value] "
                            f"(numbers)") from None
        yield name, stamp, value


def _bench_timeline(path: Path, text: str) -> pd.DataFrame:
    try:
        df = pd.read_csv(io.StringIO(text))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
        raise UserError(f"{path}: not a CSV table ({excerpt(str(e), 80)})") from None
    missing = [c for c in ("t_s", "running", "waiting", "kv_usage") if c not in df]
    if missing:
        raise UserError(f"{path}:1: missing column(s) {', '.join(missing)} (expected simrun bench's "
                        f"metrics_timeline.csv)")
    return series_on_run_clock(df.to_dict("records"))


def series_on_run_clock(rows: list[dict]) -> pd.DataFrame:
    """Scrape rows whose t_s is already the run's clock (simrun bench's own scrapes)."""
    frame = scrapes_frame(rows)
    start = float(frame["t_s"].min())
    out = _finish(frame, None, "bench")
    out["t_s"] += start
    out.attrs["on_run_clock"] = True
    return out


# ----------------------------------------------------------------------------- predicted side

def predicted_at(steps: pd.DataFrame, kv_blocks_total: int, times: np.ndarray) -> pd.DataFrame:
    """The predicted running, waiting and KV % at each time: the state of the last step started
    at or before it (0 before the first step and after the last), added up over replicas (KV %
    averaged)."""
    times = np.asarray(times, dtype=float)
    return pd.DataFrame({"t_s": times, **_StepStates(steps, kv_blocks_total).at(times)})


class _StepStates:
    """The step records as sorted arrays per replica, for repeated look-ups (the alignment search)."""

    def __init__(self, steps: pd.DataFrame, kv_blocks_total: int):
        groups = list(steps.groupby("replica")) if "replica" in steps and not steps.empty else [(0, steps)]
        self.replicas = []
        for _, s in groups:
            if s.empty:
                continue
            s = s.sort_values("start_s", kind="stable")
            self.replicas.append((s["start_s"].to_numpy(float), float(s["end_s"].iloc[-1]),
                                  s["running"].to_numpy(float), s["waiting"].to_numpy(float),
                                  s["kv_blocks_used"].to_numpy(float) / max(kv_blocks_total, 1) * 100))

    def at(self, times: np.ndarray) -> dict[str, np.ndarray]:
        out = {q: np.zeros(times.shape) for q in QUANTITIES}
        for start, end, running, waiting, usage in self.replicas:
            at = np.searchsorted(start, times, side="right") - 1
            live = (at >= 0) & (times <= end)
            pick = np.clip(at, 0, len(start) - 1)
            out["running"] += np.where(live, running[pick], 0.0)
            out["waiting"] += np.where(live, waiting[pick], 0.0)
            out["kv_usage_pct"] += np.where(live, usage[pick], 0.0) / len(self.replicas)
        return out


def align_offset(measured: pd.DataFrame, steps: pd.DataFrame, kv_blocks_total: int,
                 run_t0_wall: Optional[float] = None, arrivals_s: Optional[np.ndarray] = None) -> tuple[float, str]:
    """(offset, how): run time = measured t_s + offset. In order of preference:
    - request time stamps: the log's request lines (vLLM's --enable-log-requests), the last N of
      them matched with the run's N arrivals (earlier lines are the benchmark client's test
      prompt and warm-ups); the run's start is the median of (line time - arrival);
    - the wall clocks of the series and of the run's start, when both are known and the run then
      overlaps the series;
    - else the offset whose predicted curves differ least from the measured ones (running +
      waiting and KV %, each scaled by its measured peak; of equally good offsets, the middle one)."""
    t0_wall = measured.attrs.get("t0_wall")
    span = float(steps["end_s"].max()) if not steps.empty else 0.0
    lines = np.asarray(measured.attrs.get("request_walls") or [], dtype=float)
    arrivals = np.sort(np.asarray(arrivals_s if arrivals_s is not None else [], dtype=float))
    if t0_wall is not None and len(arrivals) and len(lines) >= len(arrivals):
        start = float(np.median(lines[-len(arrivals):] - arrivals))
        return float(t0_wall - start), (f"request time stamps (the last {len(arrivals)} of the log's "
                                        f"{len(lines)} request lines matched with the arrivals)")
    if t0_wall is not None and run_t0_wall is not None:
        offset = float(t0_wall - run_t0_wall)
        t = measured["t_s"].to_numpy() + offset
        if np.any((t >= 0) & (t <= span)):
            return offset, "wall clock (the run's start time and the series' time stamps)"
    if steps.empty or len(measured) < 2:
        return 0.0, "none (nothing to align on: offset 0)"
    t = measured["t_s"].to_numpy(float)
    interval = float(np.median(np.diff(t)))
    step = max(min(interval / 10, span / 500), 1e-3)
    candidates = np.arange(-t[-1], span + step, step)
    if len(candidates) > 5000:                  # bounded work on long logs
        candidates = np.linspace(-t[-1], span, 5000)
    costs = _misfits(measured, _StepStates(steps, kv_blocks_total), candidates)
    best = int(np.argmin(costs))
    lo = hi = best
    while lo > 0 and costs[lo - 1] <= costs[best] + 1e-12:
        lo -= 1
    while hi < len(costs) - 1 and costs[hi + 1] <= costs[best] + 1e-12:
        hi += 1
    return float(candidates[(lo + hi) // 2]), "fitted (the offset with the least difference between the curves)"


def _misfits(measured: pd.DataFrame, states: _StepStates, offsets: np.ndarray) -> np.ndarray:
    """Per offset: mean |predicted - measured| of running + waiting and of KV %, each over its peak."""
    t = measured["t_s"].to_numpy(float)
    load = (measured["running"] + measured["waiting"]).to_numpy(float)
    kv = measured["kv_usage_pct"].to_numpy(float)
    costs = np.zeros(len(offsets))
    for first in range(0, len(offsets), 256):            # a block of offsets at a time: bounded memory
        block = offsets[first:first + 256]
        pred = states.at(t[None, :] + block[:, None])
        for ours, theirs in ((pred["running"] + pred["waiting"], load), (pred["kv_usage_pct"], kv)):
            ok = ~np.isnan(theirs)
            if ok.any():
                scale = max(float(np.max(theirs[ok])), 1e-9)
                costs[first:first + 256] += np.mean(np.abs(ours[:, ok] - theirs[ok]), axis=1) / scale
    return costs


def compare_series(measured: pd.DataFrame, steps: pd.DataFrame, kv_blocks_total: int,
                   offset: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(aligned, table): the measured samples on the run's clock beside the predicted values,
    and per quantity the mean absolute difference, both means and the number of samples."""
    t = measured["t_s"].to_numpy() + offset
    pred = predicted_at(steps, kv_blocks_total, t)
    aligned = pd.DataFrame({"t_s": t})
    rows = []
    for q in QUANTITIES:
        aligned[f"measured_{q}"] = measured[q].to_numpy()
        aligned[f"predicted_{q}"] = pred[q].to_numpy()
        ok = measured[q].notna().to_numpy()
        diff = np.abs(pred[q].to_numpy()[ok] - measured[q].to_numpy()[ok])
        rows.append({"quantity": q, "mean_abs_diff": float(diff.mean()) if ok.any() else math.nan,
                     "measured_mean": float(measured[q][ok].mean()) if ok.any() else math.nan,
                     "predicted_mean": float(pred[q][ok].mean()) if ok.any() else math.nan,
                     "samples": int(ok.sum())})
    return aligned, pd.DataFrame(rows)
