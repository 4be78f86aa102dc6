"""`vllm bench serve` result files -> runs with their config, summary metrics and own workload.

Formats read (vLLM's `vllm/benchmarks/serve.py`, and `benchmarks/benchmark_serving.py` before
it moved into the package):
  --save-result            one JSON object: the run's setup (date, backend, label, model_id,
                           tokenizer_id, num_prompts, request_rate ("inf" or a number), burstiness,
                           max_concurrency, --metadata KEY=VALUE pairs, ramp-up settings, newer
                           files also server_args / client_args / dataset_name), merged with the
                           result: duration, completed, failed, total_input_tokens,
                           total_output_tokens, *_throughput, mean/median/std/pNN_{ttft,tpot,itl,
                           e2el}_ms, and from ~0.10 on `latencies` and `queue_times` per request.
  --save-detailed          adds per-request arrays, one entry per request sent, in send order:
                           input_lens, output_lens, ttfts (s), itls (list of s per request),
                           start_times (perf_counter s at send, newer versions only),
                           generated_texts, errors ("" when the request succeeded).
                           Files before the detailed flag existed always carried these arrays.
  --append-result          one such object per line (JSON Lines), appended run after run.
A JSON array of such objects is accepted too. So is the console printout (what people paste in
issues): one or more `============ Serving Benchmark Result ============` blocks of
`Label (unit):   value` lines, with the `Traffic request rate:` / `Request rate configured (RPS):`
and `Maximum request concurrency:` lines where printed; a printout gives summary metrics only.
Everything is checked on load: a wrong shape raises VllmResultError naming the file (and line),
the field and what was expected.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from sim.core.files import FileFormatError, JsonSyntaxError, excerpt, load_json, read_text
from sim.scenario import MAX_REQUESTS, MAX_TOKENS

MAX_FILE_BYTES = 512 * 1024 * 1024      # a result file of 1M requests is ~200 MB with texts

# Per-request arrays of --save-detailed; all describe the same requests, in send order.
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                    "queue_times", "errors", "generated_texts")
# Summary values (scalars) that are results, not setup.
SUMMARY_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "max_output_tokens_per_s", "max_concurrent_requests", "rtfx")
_STAT_KEY = re.compile(r"^(mean|median|std|p\d+(\.\d+)?)_[a-z0-9_]+_ms$")
# Summary values that count things: whole numbers (and never NaN)
COUNT_KEYS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "max_concurrent_requests")


class VllmResultError(ValueError):
    """A result file that cannot be read; the message starts with the file (and line)."""


@dataclass
class VllmResult:
    """One `vllm bench serve` run."""

    source: str                              # "path" or "path:line" for JSONL
    config: dict[str, Any]                   # setup: model_id, request_rate, max_concurrency, ...
    metrics: dict[str, Any]                  # vLLM's summary keys (ms for latencies, as vLLM writes)
    per_request: dict[str, list] = field(default_factory=dict)

    # ------------------------------------------------------------------ setup, normalised
    @property
    def model(self) -> Optional[str]:
        return self.config.get("model_id") or self.config.get("model")

    @property
    def rate(self) -> float:
        """Requests per second the client aimed at; inf = all sent at once."""
        raw = self.config.get("request_rate", "inf")
        return _rate(raw, f"{self.source}: request_rate")

    @property
    def burstiness(self) -> float:
        value = self.config.get("burstiness")
        return 1.0 if value is None else _positive(value, f"{self.source}: burstiness", "a gamma shape > 0")

    @property
    def max_concurrency(self) -> Optional[int]:
        value = self.config.get("max_concurrency")
        if value in (None, "None", ""):
            return None
        limit = _positive(value, f"{self.source}: max_concurrency", "a whole number of requests >= 1 (or null)")
        if limit != int(limit) or limit < 1:
            raise VllmResultError(f"{self.source}: max_concurrency = {excerpt(value)}; expected a whole number "
                                  f"of requests >= 1 (or null)")
        return int(limit)

    @property
    def detailed(self) -> bool:
        return "input_lens" in self.per_request and "output_lens" in self.per_request

    # ------------------------------------------------------------------ per request
    def succeeded(self) -> np.ndarray:
        """Mask of requests that finished (errors empty); all True when errors are absent."""
        n = self._count()
        errors = self.per_request.get("errors")
        if errors is None:
            return np.ones(n, dtype=bool)
        return np.array([not e for e in errors], dtype=bool)

    def requests(self, include_failed: bool = False) -> list[tuple[Optional[float], int, int]]:
        """(start_s | None, input_len, output_len) per request, start_s relative to the first send.

        Failed requests are left out unless asked for (their output_len is 0 in vLLM's file);
        `excluded_notes()` counts them."""
        self._need_detail("requests()")
        starts = self.per_request.get("start_times")
        t0 = min(starts) if starts else 0.0
        return [(None if starts is None else float(starts[i] - t0),
                 int(self.per_request["input_lens"][i]), int(self.per_request["output_lens"][i]))
                for i in self.order(include_failed)]

    def order(self, include_failed: bool = False) -> np.ndarray:
        """Indices of the (succeeded) requests in the order they were sent: by start time when
        the file has them (a --max-concurrency semaphore may release out of list order)."""
        keep = np.ones(self._count(), dtype=bool) if include_failed else self.succeeded()
        idx = np.flatnonzero(keep)
        starts = self.per_request.get("start_times")
        if starts is not None:
            idx = idx[np.argsort(np.asarray(starts, dtype=float)[idx], kind="stable")]
        return idx

    def excluded_notes(self) -> list[str]:
        failed = int((~self.succeeded()).sum()) if self.detailed else 0
        return [f"{self.source}: {failed} failed requests left out of the replay"] if failed else []

    def latencies(self) -> dict[str, np.ndarray]:
        """Measured per-request ttft_s, tpot_s, e2e_s of the succeeded requests, in `order()` (the
        order of `requests()`), NaN where unknown.

        TPOT is vLLM's: (e2e - ttft) / (output - 1), for outputs longer than one token."""
        self._need_detail("per-request latencies")
        ok = self.order()
        ttft = _floats(self.per_request.get("ttfts"), self._count())[ok]
        out = np.asarray(self.per_request["output_lens"], dtype=float)[ok]
        if "latencies" in self.per_request:
            e2e = _floats(self.per_request["latencies"], self._count())[ok]
        elif "itls" in self.per_request:
            e2e = ttft + np.array([sum(self.per_request["itls"][i]) for i in ok])
        else:
            e2e = np.full(len(ttft), np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(out > 1, (e2e - ttft) / (out - 1), np.nan)
        return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "output_len": out}

    def _count(self) -> int:
        return len(self.per_request["input_lens"]) if self.detailed else 0

    def _need_detail(self, what: str) -> None:
        if not self.detailed:
            raise VllmResultError(f"{self.source}: {what} needs the per-request arrays (input_lens, "
                                  f"output_lens) that `vllm bench serve --save-detailed` writes")


# ----------------------------------------------------------------------------- loading

def load_results(path: str | Path) -> list[VllmResult]:
    """Every run in a result file: one for --save-result JSON, one per line for JSONL."""
    path = Path(path)
    try:
        text = read_text(path, "`vllm bench serve` result file", MAX_FILE_BYTES)
    except FileFormatError as e:
        raise VllmResultError(str(e)) from None
    if not text.strip():
        raise VllmResultError(f"{path}: empty file (expected `vllm bench serve --save-result` JSON)")
    if PRINTOUT_HEADER in text or (text.lstrip()[:1] not in "[{" and "Successful requests:" in text):
        return parse_printout(text, str(path))
    try:
        data = load_json(text, path, allow_nan=True)
    except JsonSyntaxError as whole_error:
        return [_parse_run(obj, f"{path}:{line}") for line, obj in _json_lines(text, path, whole_error)]
    except FileFormatError as e:            # too deep, too many values, an integer beyond 64 bits
        raise VllmResultError(str(e)) from None
    if isinstance(data, list):
        if not data:
            raise VllmResultError(f"{path}: an empty JSON array (expected result objects)")
        return [_parse_run(obj, f"{path}[{i}]") for i, obj in enumerate(data)]
    return [_parse_run(data, str(path))]


PRINTOUT_HEADER = "Serving Benchmark Result"
# printed label -> (result key, factor to vLLM's JSON unit)
PRINTED = {"Successful requests": ("completed", 1), "Failed requests": ("failed", 1),
           "Benchmark duration (s)": ("duration", 1), "Total input tokens": ("total_input_tokens", 1),
           "Total generated tokens": ("total_output_tokens", 1),
           "Request throughput (req/s)": ("request_throughput", 1),
           "Request goodput (req/s)": ("request_goodput", 1),
           "Output token throughput (tok/s)": ("output_throughput", 1),
           "Peak output token throughput (tok/s)": ("max_output_tokens_per_s", 1),
           "Peak concurrent requests": ("max_concurrent_requests", 1),
           "Total Token throughput (tok/s)": ("total_token_throughput", 1)}
_STAT_LINE = re.compile(r"^(Mean|Median|P(\d+(?:\.\d+)?)|Std) (TTFT|TPOT|ITL|E2EL) \(ms\)$")
_SETUP = {"Traffic request rate": "request_rate", "Request rate configured (RPS)": "request_rate",
          "Maximum request concurrency": "max_concurrency", "Burstiness factor": "burstiness"}


def parse_printout(text: str, source: str) -> list[VllmResult]:
    """Every `Serving Benchmark Result` block of a console printout, as summary-only runs. Setup
    lines (request rate, concurrency) belong to the block that follows them."""
    runs: list[VllmResult] = []
    state = {"config": {}, "metrics": {}, "start": 0}

    def close():
        metrics, config = state["metrics"], state["config"]
        if metrics:
            where = f"{source}:{state['start']}"
            if "completed" not in metrics:
                raise VllmResultError(f"{where}: a result block without 'Successful requests:'")
            runs.append(_parse_run({"request_rate": "inf", **config, **metrics}, where))
            state["config"], state["metrics"] = {}, {}

    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip().lstrip("#").strip()
        if PRINTOUT_HEADER in line:
            close()
            continue
        label, sep, value = line.rpartition(":")
        label, value = label.strip(), value.strip().split(" ")[0] if value.strip() else ""
        if not sep or not value:
            continue
        if label in _SETUP:
            close()
            state["config"][_SETUP[label]] = (None if value == "None" else value if value == "inf"
                                              else _number(value, source, number, label))
            continue
        stat = _STAT_LINE.match(label)
        key = PRINTED[label][0] if label in PRINTED else None
        if stat:
            kind = stat.group(1).lower() if stat.group(2) is None else f"p{stat.group(2)}"
            key = f"{kind}_{stat.group(3).lower()}_ms"
        if key is None:
            continue
        if key in state["metrics"]:          # the same label again: the next run's block
            close()
        if not state["metrics"]:
            state["start"] = number
        state["metrics"][key] = _number(value, source, number, label)
    close()
    if not runs:
        raise VllmResultError(f"{source}: no `Serving Benchmark Result` lines found (expected vLLM's "
                              f"printout, or --save-result JSON)")
    return runs


def _number(value: str, source: str, line: int, label: str) -> float:
    try:
        number = float(value.replace(",", ""))
    except ValueError:
        raise VllmResultError(f"{source}:{line}: '{label}' = {value!r}; expected a number") from None
    if not math.isfinite(number):
        raise VllmResultError(f"{source}:{line}: '{label}' = {value!r}; expected a finite number")
    return int(number) if number == int(number) and label in ("Successful requests", "Failed requests",
                                                            "Total input tokens", "Total generated tokens",
                                                            "Maximum request concurrency") else number


def _json_lines(text: str, path: Path, whole_error: JsonSyntaxError) -> list[tuple[int, Any]]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, load_json(line, f"{path}:{number}", allow_nan=True)))
        except FileFormatError as e:
            if not isinstance(e, JsonSyntaxError):
                raise VllmResultError(str(e)) from None
            if len(rows) == 0 and number == 1 and whole_error.lineno > 1:
                number = whole_error.lineno       # a broken single JSON document: report that
                e = whole_error
            raise VllmResultError(f"{path}:{number}: not JSON ({e.msg} at column {e.colno}); expected "
                                  f"a `vllm bench serve` result object, one per line for --append-result") from None
    return rows


def _parse_run(obj: Any, source: str) -> VllmResult:
    if not isinstance(obj, dict):
        raise VllmResultError(f"{source}: expected a JSON object (a `vllm bench serve` result), "
                              f"got {type(obj).__name__}")
    per_request = {k: obj[k] for k in PER_REQUEST_KEYS if k in obj and obj[k] is not None}
    metrics = {k: obj[k] for k in obj if k in SUMMARY_KEYS or _STAT_KEY.match(k)}
    config = {k: v for k, v in obj.items() if k not in per_request and k not in metrics}
    if "request_rate" not in config and isinstance(config.get("client_args"), dict):
        config["request_rate"] = config["client_args"].get("request_rate", "inf")
    _check_metrics(metrics, source)
    _check_per_request(per_request, source)
    result = VllmResult(source, config, metrics, per_request)
    result.rate     # noqa: B018 -- validates request_rate, burstiness, max_concurrency now, with the file named
    result.burstiness     # noqa: B018
    result.max_concurrency     # noqa: B018
    _check_consistent(result)
    if not metrics and not result.detailed:
        raise VllmResultError(f"{source}: neither summary metrics (duration, completed, mean_ttft_ms, ...) "
                              f"nor per-request arrays: not a `vllm bench serve` result")
    return result


def _check_metrics(metrics: dict, source: str) -> None:
    """Every summary value is a number >= 0 (a duration, a count, a rate or a latency cannot be
    negative); counts are whole and known; NaN only for a statistic vLLM could not compute."""
    for key, value in metrics.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise VllmResultError(f"{source}: field '{key}' should be a number, got {excerpt(value)}")
        if math.isnan(value) and _STAT_KEY.match(key):
            continue
        if not math.isfinite(value) or value < 0:
            raise VllmResultError(f"{source}: field '{key}' = {excerpt(value)}; expected a finite number >= 0")
        if key in COUNT_KEYS and value != int(value):
            raise VllmResultError(f"{source}: field '{key}' = {excerpt(value)}; expected a whole number")
    if metrics.get("completed") and metrics.get("duration") == 0:     # (the throughputs divide by it)
        raise VllmResultError(f"{source}: field 'duration' = 0 with {int(metrics['completed'])} completed requests; "
                              f"expected the benchmark's length in seconds, > 0")


def _check_per_request(per_request: dict, source: str) -> None:
    lengths = {}
    for key, values in per_request.items():
        if not isinstance(values, list):
            raise VllmResultError(f"{source}: field '{key}' should be a list (one entry per request), "
                                  f"got {type(values).__name__}")
        lengths[key] = len(values)
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{k}={n}" for k, n in lengths.items())
        raise VllmResultError(f"{source}: per-request arrays differ in length ({shown}); "
                              f"each should have one entry per request")
    if lengths and max(lengths.values()) > MAX_REQUESTS:
        raise VllmResultError(f"{source}: {max(lengths.values()):,} requests, more than the {MAX_REQUESTS:,} "
                              f"kvtwin replays or compares")
    for key in ("input_lens", "output_lens"):
        for i, v in enumerate(per_request.get(key, ())):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_TOKENS or v != int(v):
                raise VllmResultError(f"{source}: {key}[{i}] = {excerpt(v)}; expected a whole number of tokens "
                                      f">= 0 and <= {MAX_TOKENS:,} (2^27)")
    for key in ("ttfts", "latencies", "queue_times"):
        for i, v in enumerate(per_request.get(key, ())):
            if v is not None and not _seconds(v):
                raise VllmResultError(f"{source}: {key}[{i}] = {excerpt(v)}; expected a finite number of seconds >= 0")
    for i, v in enumerate(per_request.get("start_times", ())):    # a perf_counter reading: any finite value
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise VllmResultError(f"{source}: start_times[{i}] = {excerpt(v)}; expected a finite number of seconds")
    for i, v in enumerate(per_request.get("itls", ())):
        if not isinstance(v, list):
            raise VllmResultError(f"{source}: itls[{i}] should be a list of seconds between tokens")
        bad = next((j for j, x in enumerate(v) if not _seconds(x)), None)
        if bad is not None:
            raise VllmResultError(f"{source}: itls[{i}][{bad}] = {excerpt(v[bad])}; expected a finite number "
                                  f"of seconds >= 0 between tokens")


def _seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _check_consistent(result: VllmResult) -> None:
    """What a real run cannot produce: a request that succeeded with no output token, ended
    before its first token, or streamed more gaps than tokens after the first; a count of
    completed requests that is not the file's. ITLs may be fewer than output - 1: a chunk can
    carry several tokens (speculative decoding, --stream-interval), vLLM's serve.py times chunks."""
    source, data = result.source, result.per_request
    if not result.detailed:
        return
    ok = result.succeeded()
    no_errors = "" if "errors" in data else " (the file has no errors array, so every request counts as succeeded)"
    outputs, ttfts, latencies, itls = data["output_lens"], data.get("ttfts"), data.get("latencies"), data.get("itls")
    for i in np.flatnonzero(ok).tolist():
        if outputs[i] < 1:
            raise VllmResultError(f"{source}: output_lens[{i}] = {outputs[i]} for a request that succeeded"
                                  f"{no_errors}; expected >= 1 token")
        if ttfts and latencies and ttfts[i] is not None and latencies[i] is not None and latencies[i] < ttfts[i]:
            raise VllmResultError(f"{source}: latencies[{i}] = {latencies[i]:.6g} s is shorter than ttfts[{i}] = "
                                  f"{ttfts[i]:.6g} s; a request ends after its first token")
        if itls and len(itls[i]) > outputs[i] - 1:
            raise VllmResultError(f"{source}: itls[{i}] holds {len(itls[i])} gaps but output_lens[{i}] is "
                                  f"{outputs[i]}; expected at most output - 1 (one gap per later chunk)")
    completed = result.metrics.get("completed")
    if "errors" in data and completed is not None and completed != int(ok.sum()):
        raise VllmResultError(f"{source}: completed = {excerpt(completed)} but {int(ok.sum())} of the "
                              f"{len(ok)} requests have an empty errors entry; expected them to agree")


def _positive(raw: Any, where: str, expected: str) -> float:
    """A number > 0 (a JSON number, or one written as text, as vLLM's --metadata values are)."""
    value = raw
    if isinstance(raw, str):
        try:
            value = float(raw)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise VllmResultError(f"{where} = {excerpt(raw)}; expected {expected}")
    return float(value)


def _rate(raw: Any, where: str) -> float:
    if isinstance(raw, str):
        try:
            raw = float(raw)
        except ValueError:
            raise VllmResultError(f"{where} = {excerpt(raw)}; expected a number of requests/s or \"inf\"") from None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not (raw > 0):
        raise VllmResultError(f"{where} = {excerpt(raw)}; expected a number of requests/s > 0 or \"inf\"")
    return float(raw)


def _floats(values: Optional[list], n: int) -> np.ndarray:
    if values is None:
        return np.full(n, np.nan)
    return np.array([np.nan if v is None else float(v) for v in values])


# ----------------------------------------------------------------------------- kvtwin requests

def arrival_times(result: VllmResult, n: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """When each of n requests reached the server: the file's own start_times when present,
    else vLLM's arrival process drawn again (the draws differ from the run's; noted)."""
    starts = [s for s, _, _ in result.requests()] if result.detailed else []
    if starts and starts[0] is not None:
        return np.asarray(starts, dtype=float), []
    rate = result.rate
    if math.isinf(rate) or n == 0:        # n = 0: no request finished (the caller says so)
        return np.zeros(n), []
    rng = np.random.default_rng(seed)
    shape = result.burstiness
    gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    times = np.cumsum(gaps)
    times *= n / rate / times[-1]      # vLLM bench: the last arrival lands at exactly n/rate
    return times, [f"{result.source}: no start_times in the file; arrivals redrawn from request_rate "
                   f"{rate:g}/s, burstiness {shape:g} (same process, different draws)"]


def to_requests(result: VllmResult, seed: int = 0):
    """kvtwin Requests for a run's own workload, and notes on anything approximated.

    Each prompt is its own unique segment: vLLM's random dataset shares no prefix between
    requests (a run with --random-prefix-len or a prefix dataset replays without its hits)."""
    from sim.core.request import make_request, stable_key

    rows = result.requests()
    times, notes = arrival_times(result, len(rows), seed)
    if result.max_concurrency is not None and rows and rows[0][0] is None:
        notes.append(f"{result.source}: max_concurrency {result.max_concurrency} was a client cap; "
                     f"without start_times the replay sends at the arrival times instead")
    notes += result.excluded_notes()
    key = stable_key("vllm-result", result.source)
    requests = [make_request(i, float(times[i]), [(stable_key(key, i), max(int(inp), 1))], max(int(out), 1), seed)
                for i, (_, inp, out) in enumerate(rows)]
    zero = sum(1 for _, inp, out in rows if inp == 0 or out == 0)
    if zero:
        notes.append(f"{result.source}: {zero} requests with 0 input or output tokens replayed with 1")
    return requests, notes





# ----------------------------------------------------------------------------- the inverse

def vllm_result_dict(requests, config: dict[str, Any], percentiles: tuple[float, ...] = (99,)) -> dict:
    """A kvtwin requests frame written the way `vllm bench serve --save-result --save-detailed`
    writes a run (the same keys; ITLs spread evenly over each request's decode time): for
    synthetic round trips and for handing a prediction to tools that read vLLM's files."""
    done = requests[requests["status"] == "finished"].sort_values("arrival_s")
    ttft, e2e = done["ttft_s"].to_numpy(float), done["e2e_s"].to_numpy(float)
    out = done["output_tokens"].to_numpy(int)
    tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), np.nan)
    itls = [[float(t)] * int(o - 1) if o > 1 else [] for t, o in zip(tpot, out)]
    start = done["arrival_s"].to_numpy(float)
    duration = float((start + e2e).max() - start.min()) if len(done) else 0.0
    result = {"date": config.get("date", "19700101-000000"), "endpoint_type": "vllm", "backend": "vllm",
              "label": None, "model_id": config.get("model_id"), "tokenizer_id": config.get("model_id"),
              "num_prompts": int(len(requests)), "request_rate": config.get("request_rate", "inf"),
              "burstiness": config.get("burstiness", 1.0), "max_concurrency": config.get("max_concurrency"),
              "duration": duration, "completed": int(len(done)), "failed": int(len(requests) - len(done)),
              "total_input_tokens": int(done["prompt_tokens"].sum()), "total_output_tokens": int(out.sum()),
              "request_throughput": len(done) / duration if duration else 0.0, "request_goodput": None,
              "output_throughput": out.sum() / duration if duration else 0.0,
              "total_token_throughput": (out.sum() + done["prompt_tokens"].sum()) / duration if duration else 0.0,
              "input_lens": done["prompt_tokens"].astype(int).tolist(), "output_lens": out.tolist(),
              "ttfts": ttft.tolist(), "itls": itls, "latencies": e2e.tolist(), "start_times": start.tolist(),
              "queue_times": [0.0] * len(done), "generated_texts": [""] * len(done), "errors": [""] * len(done),
              "max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0, "rtfx": 0.0}
    flat_itl = [x for row in itls for x in row]
    for name, values in (("ttft", ttft), ("tpot", tpot[~np.isnan(tpot)]), ("itl", np.asarray(flat_itl)),
                         ("e2el", e2e)):
        values = values if len(values) else np.zeros(1)
        result[f"mean_{name}_ms"] = float(np.mean(values) * 1000)
        result[f"median_{name}_ms"] = float(np.median(values) * 1000)
        result[f"std_{name}_ms"] = float(np.std(values) * 1000)
        for p in percentiles:
            result[f"p{int(p) if int(p) == p else p}_{name}_ms"] = float(np.percentile(values, p) * 1000)
    return result

__all__ = ["VllmResult", "VllmResultError", "load_results", "to_requests", "arrival_times", "vllm_result_dict"]
