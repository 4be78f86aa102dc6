"""kvtwin's prediction against a live OpenAI-compatible endpoint, or against a vLLM result file.

`simrun bench SCENARIO --endpoint URL` replays the scenario's workload against the endpoint:
each request is sent at its arrival time (a follow-up turn think_time after the previous
turn's last token) as a streamed /v1/completions call with the workload's prompt token ids,
max_tokens = its output length, ignore_eos and temperature 0, and every streamed chunk is
timestamped at the client, as vLLM's benchmark client does (TTFT = first chunk - send,
ITL = gaps between chunks, E2E = last chunk - send). Before the run one fixed short request
(16 tokens, max_tokens 8) must come back with 8 tokens; during it /metrics is scraped for
KV usage and queue lengths when the endpoint offers vLLM's metric names.

`simrun compare SCENARIO --vllm-result FILE` reads what `vllm bench serve --save-result`
writes (per-request ttfts, itls, input_lens, output_lens with --save-detailed; the
aggregate mean/median/p99 fields otherwise) and checks the file's workload against the
scenario's before comparing: a comparison on a different workload is meaningless.

Both write, beside `simrun validate`'s layout:
    out/measured/    summary.json, requests.csv, manifest.json (+ metrics_timeline.csv)
    out/predicted/   simrun's prediction of the same scenario
    out/comparison.csv, out/*.png, out/report.html
Measured summaries come from sim.metrics.summarise on a requests frame of records.py's
schema plus the client's ITL samples; what a black-box endpoint cannot show (steps, the
queue/host/device split) is None, and KV figures come from the scraped timeline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from sim.errors import UserError
from sim.output.console import console, err_console
from sim.scenario import scenario_args
from sim.output.io import write_csv, write_json
from sim.core.request import Request, make_request, stable_key
from sim.core.lazy import lazy_import

np = lazy_import("numpy")      # on first use: `simrun bench -h` stays light
pd = lazy_import("pandas")

# The seed's smoke step (the same request as engine/replay.py's smoke check).
SMOKE_PROMPT_TOKENS = 16
SMOKE_OUTPUT_TOKENS = 8
# A workload whose request count or mean/p90 lengths differ from the scenario's by more
# than this is flagged: its comparison with the prediction would not mean anything.
WORKLOAD_TOLERANCE = 0.10
REQUEST_COLUMNS = ("id", "replica", "tenant", "priority", "conversation", "is_warmup", "status",
                   "reject_reason", "arrival_s", "prompt_tokens", "output_tokens", "cached_tokens",
                   "preemptions", "admitted_s", "first_token_s", "finish_s", "host_s", "device_s",
                   "ttft_s", "e2e_s", "tpot_s", "queue_s")
# Figures a black-box endpoint does not show: None rather than the zeros of an empty step table.
UNSEEN = ("num_steps", "mean_batch_seqs", "mean_batch_tokens", "peak_running", "mean_step_s",
          "kv_slack_tokens_peak")


@dataclass
class Measured:
    """A run measured outside the engine: from a live endpoint or a result file."""

    summary: dict
    requests: pd.DataFrame
    manifest: dict
    kv_blocks_total: int = 0
    timeline: Optional[pd.DataFrame] = None     # scraped /metrics, when there was one

    def view(self):
        from sim.output.report import RunView

        return RunView("measured", self.summary, self.requests, pd.DataFrame(), self.kv_blocks_total)


# ----------------------------------------------------------------------------- measured summary

def complete_frame(rows: list[dict]) -> pd.DataFrame:
    """Per-request rows (arrival_s, ttft_s, e2e_s and counts) -> records.py's requests schema."""
    df = pd.DataFrame(rows)
    for name in REQUEST_COLUMNS:
        if name not in df:
            df[name] = 0 if name == "replica" else np.nan
    df["first_token_s"] = df["arrival_s"] + df["ttft_s"]
    df["finish_s"] = df["arrival_s"] + df["e2e_s"]
    decode = df["output_tokens"] - 1
    df["tpot_s"] = np.where(decode > 0, (df["e2e_s"] - df["ttft_s"]) / decode.clip(lower=1), np.nan)
    return df[list(REQUEST_COLUMNS)]


def measured_summary(frame: pd.DataFrame, itl: np.ndarray, slo, kv_blocks_total: int,
                     block_size: int) -> dict:
    """sim.metrics.summarise over a measured frame and the client's ITL samples."""
    from sim.metrics import summarise
    from sim.records import RunRecords

    records = RunRecords([], [], kv_blocks_total, block_size, explicit_itl=np.asarray(itl, dtype=float))
    summary = summarise(records, slo, frame, pd.DataFrame())
    summary.update({key: None for key in UNSEEN})
    summary["latency_split"] = {"queue": None, "host": None, "device": None}
    summary["requests_failed"] = int((frame["status"] == "failed").sum())
    summary["partial"] = bool((frame["status"] != "finished").any())
    reasons = Counter(frame.loc[frame["status"] != "finished", "reject_reason"].dropna())
    summary["failures"] = dict(reasons.most_common(5))
    if frame["cached_tokens"].isna().all():
        summary["prefix_hit_rate"] = None
    return summary


def apply_timeline(summary: dict, scraped: Optional[pd.DataFrame], kv_blocks_total: int) -> None:
    """KV, preemption and prefix-cache figures from the scraped /metrics (None without it)."""
    summary.update(kv_blocks_total=kv_blocks_total or None, kv_usage_peak=None, kv_usage_mean=None,
                   kv_blocks_peak=None, kv_blocks_mean=None, preemptions=None)
    if scraped is None or scraped.empty:
        return
    busy = scraped[(scraped["running"] + scraped["waiting"]) > 0]
    usage = busy["kv_usage"] if len(busy) else scraped["kv_usage"]
    summary.update(kv_usage_peak=float(scraped["kv_usage"].max()), kv_usage_mean=float(usage.mean()),
                   peak_running=int(scraped["running"].max()))
    if kv_blocks_total:
        summary.update(kv_blocks_peak=round(summary["kv_usage_peak"] * kv_blocks_total),
                       kv_blocks_mean=summary["kv_usage_mean"] * kv_blocks_total)
    first, last = scraped.iloc[0], scraped.iloc[-1]
    if not math.isnan(last["preemptions"]):
        summary["preemptions"] = int(last["preemptions"] - first["preemptions"])
    queries = last["prefix_queries"] - first["prefix_queries"]
    if summary["prefix_hit_rate"] is None and queries > 0:   # per-request cached counts win when present
        summary["prefix_hit_rate"] = float((last["prefix_hits"] - first["prefix_hits"]) / queries)


# ----------------------------------------------------------------------------- Prometheus text

METRIC_ALIASES = {     # our column -> vLLM names, newest first (V0 used the gpu_ prefixes)
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "preemptions": ("vllm:num_preemptions",),
    "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> tuple[dict[str, list[float]], dict[str, dict[str, str]]]:
    """Samples per metric name (counters without `_total`, one value per label set), and the
    labels of each name's last sample (vllm:cache_config_info carries the pool size there)."""
    values: dict[str, list[float]] = {}
    labels: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        name = match.group(1).removesuffix("_total")
        try:
            values.setdefault(name, []).append(float(match.group(3)))
        except ValueError:
            continue
        labels[name] = dict(_LABEL.findall(match.group(2) or ""))
    return values, labels


def timeline_row(values: dict[str, list[float]]) -> Optional[dict[str, float]]:
    """One scrape as a timeline row; None when the text has none of vLLM's gauges. Gauges
    add up over engines (data parallel), except KV usage, a fraction, which is averaged."""
    row = {}
    for column, names in METRIC_ALIASES.items():
        found = next((values[n] for n in names if n in values), None)
        row[column] = math.nan if found is None else (np.mean(found) if column == "kv_usage" else sum(found))
    return None if math.isnan(row["running"]) and math.isnan(row["kv_usage"]) else row


def pool_blocks(labels: dict[str, dict[str, str]]) -> int:
    """Usable KV blocks from vllm:cache_config_info (num_gpu_blocks includes the null block)."""
    blocks = labels.get("vllm:cache_config_info", {}).get("num_gpu_blocks")
    return int(blocks) - 1 if blocks and blocks.isdigit() else 0


# ----------------------------------------------------------------------------- the load generator

class BenchError(Exception):
    """The endpoint cannot be benchmarked (down, failing its smoke request)."""


@dataclass
class Trip:
    """One request's journey, in seconds since the run started."""

    request: Request
    status: str = "not_sent"           # not_sent -> sent -> finished | failed | aborted (interrupted)
    error: Optional[str] = None
    sent: float = math.nan
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0                    # usage.completion_tokens, else tokens counted in chunks
    cached: Optional[int] = None       # usage.prompt_tokens_details.cached_tokens, when reported

    def fail(self, reason: str, status: str = "failed") -> None:
        self.status, self.error = status, reason

    def row(self) -> dict:
        r = self.request
        done = self.status == "finished"
        status, reason = self.status, self.error
        if status in ("not_sent", "sent"):           # the run stopped before this request ended
            status, reason = "aborted", f"{status.replace('_', ' ')} when the run was interrupted"
        return {"id": r.id, "tenant": r.tenant, "priority": r.priority, "conversation": r.conversation,
                "is_warmup": r.is_warmup, "status": status, "reject_reason": reason, "arrival_s": self.sent,
                "prompt_tokens": r.prompt_len, "output_tokens": self.tokens if done else 0,
                "cached_tokens": self.cached, "ttft_s": self.chunks[0] - self.sent if done else math.nan,
                "e2e_s": self.chunks[-1] - self.sent if done else math.nan}

    def gaps(self) -> np.ndarray:
        return np.diff(self.chunks) if self.status == "finished" else np.zeros(0)


class Client:
    """The endpoint seen from outside: OpenAI completions, /v1/models, /version, /metrics."""

    def __init__(self, endpoint: str, request_timeout: float):
        import httpx

        self.base = normalise_endpoint(endpoint)
        self.http = httpx.AsyncClient(
            base_url=self.base, timeout=httpx.Timeout(request_timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.model: Optional[str] = None
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def describe(self, model: Optional[str]) -> dict:
        """The served model and version; a clear error when nothing answers at the URL."""
        import httpx

        try:
            reply = await self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach {self.base} ({type(e).__name__}: {e or 'no answer'}); "
                             f"is the server running?") from None
        try:
            cards = reply.json().get("data", []) if reply.status_code == 200 else []
        except ValueError:
            cards = []
        if not cards and model is None:
            raise BenchError(f"{self.base}/v1/models answered HTTP {reply.status_code} without a model; "
                             f"pass --model NAME")
        card = next((c for c in cards if c.get("id") == model), cards[0] if cards else {})
        self.model = model or card["id"]
        info = {"model": self.model, "root": card.get("root"), "max_model_len": card.get("max_model_len")}
        info["version"] = await self._version()
        return info

    async def _version(self) -> Optional[str]:
        import httpx

        try:
            reply = await self.http.get("/version")
            return reply.json().get("version") if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def metrics(self) -> Optional[str]:
        import httpx

        try:
            reply = await self.http.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        return reply.text if reply.status_code == 200 else None

    async def send(self, trip: Trip, prompt: list[int]) -> None:
        """One streamed completion; the trip records its chunk times or why it failed."""
        import httpx

        payload = {"model": self.model, "prompt": prompt, "max_tokens": trip.request.output_len,
                   "ignore_eos": True, "temperature": 0.0, "stream": True,
                   "stream_options": {"include_usage": True}}
        trip.status, trip.sent = "sent", self.now()
        try:
            async with self.http.stream("POST", "/v1/completions", json=payload) as reply:
                if reply.status_code != 200:
                    trip.fail(f"HTTP {reply.status_code}: {error_message(await reply.aread())}")
                    return
                await self._read_stream(reply, trip)
        except MalformedStream as e:
            trip.fail(f"malformed stream: {e}")
        except httpx.HTTPError as e:
            trip.fail(f"{type(e).__name__}: {e or 'connection lost'}")
        except asyncio.CancelledError:
            trip.fail("interrupted while in flight", status="aborted")
            raise

    async def _read_stream(self, reply, trip: Trip) -> None:
        usage = None
        async for line in reply.aiter_lines():
            if not line or line.startswith(":"):          # blank separators, SSE comments
                continue
            event = sse_event(line)
            if event == "[DONE]":
                self._settle(trip, usage)
                return
            if "error" in event:
                trip.fail(f"server error: {error_message(event)}")
                return
            if event.get("choices"):
                trip.chunks.append(self.now())
                trip.tokens += len(event["choices"][0].get("token_ids") or [0])
            usage = event.get("usage") or usage
        trip.fail(f"the stream ended before [DONE], after {len(trip.chunks)} chunk(s)")

    @staticmethod
    def _settle(trip: Trip, usage: Optional[dict]) -> None:
        if usage:
            trip.tokens = usage.get("completion_tokens", trip.tokens)
            trip.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        expected = trip.request.output_len
        if not trip.chunks:
            trip.fail("the stream carried no token")
        elif trip.tokens != expected:
            trip.fail(f"{trip.tokens} tokens returned, {expected} asked with ignore_eos")
        else:
            trip.status = "finished"


class MalformedStream(Exception):
    """The endpoint answered 200 but its event stream is not OpenAI's."""


def sse_event(line: str) -> Any:
    """A `data:` line's JSON object, or "[DONE]"; MalformedStream otherwise."""
    if not line.startswith("data:"):
        raise MalformedStream(f"not a server-sent `data:` line: {line[:80]!r}")
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        raise MalformedStream(f"event is not JSON: {data[:80]!r}") from None
    if not isinstance(event, dict) or not ({"choices", "usage", "error"} & set(event)):
        raise MalformedStream(f"event has neither choices, usage nor error: {data[:80]!r}")
    return event


def error_message(body: Any) -> str:
    """The message of an OpenAI/vLLM error body, else the body itself (shortened)."""
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            return body.decode(errors="replace")[:300]
    if isinstance(body, dict):
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    return str(body)[:300]


def normalise_endpoint(url: str) -> str:
    """'host:port', 'http://host:port/' and an OpenAI base URL '.../v1' all mean the server root."""
    url = url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url.removesuffix("/v1")


class Bench:
    """Replays a workload against the endpoint while scraping its /metrics."""

    def __init__(self, client: Client, requests: list[Request], vocab_size: int, scrape_s: float,
                 say: Callable[[str], None]):
        self.client, self.vocab_size, self.scrape_s, self.say = client, vocab_size, scrape_s, say
        self.trips = {r.id: Trip(r) for r in requests}
        self.scraped: list[dict] = []
        self.pool_blocks = 0
        self.smoke: dict = {}

    async def run(self) -> None:
        await self.smoke_check()
        self.client.t0 = time.perf_counter()
        metrics = await self.client.metrics()      # the baseline: counters count from here
        scraper = asyncio.ensure_future(self._scrape()) if metrics and self._scrape_once(metrics) else None
        last = max((t.request.arrival for t in self.trips.values() if t.request.arrival is not None), default=0)
        self.say(f"smoke request passed (TTFT {self.smoke['ttft_s'] * 1e3:.1f} ms); sending {len(self.trips)} "
                 f"requests, the last first turn at {last:.1f} s; /metrics "
                 f"{'scraped' if scraper else 'not offered'}")
        try:
            firsts = [t for t in self.trips.values() if t.request.arrival is not None]
            await asyncio.gather(*(self._conversation(t) for t in firsts))
        finally:
            if scraper is not None:
                scraper.cancel()
        if scraper is not None:                # one last sample: the counters' final values
            self._scrape_once(await self.client.metrics() or "")

    async def smoke_check(self) -> None:
        req = make_request(-1, 0.0, [(stable_key("smoke"), SMOKE_PROMPT_TOKENS)], SMOKE_OUTPUT_TOKENS)
        trip = Trip(req)
        t0 = self.client.now()
        await self.client.send(trip, self._prompt(req))
        if trip.status != "finished":
            raise BenchError(f"the smoke request ({SMOKE_PROMPT_TOKENS} prompt tokens, max_tokens "
                             f"{SMOKE_OUTPUT_TOKENS}) failed: {trip.error}")
        self.smoke = {"prompt_tokens": SMOKE_PROMPT_TOKENS, "max_tokens": SMOKE_OUTPUT_TOKENS,
                      "tokens": trip.tokens, "ttft_s": trip.chunks[0] - trip.sent,
                      "e2e_s": self.client.now() - t0}

    def _prompt(self, req: Request) -> list[int]:
        # Materialised at send time: cheap, and a long trace never holds every prompt at once.
        return req.token_ids(0, req.prompt_len, self.vocab_size).tolist()

    async def _conversation(self, trip: Trip) -> None:
        """Send a conversation's turns: the first at its arrival, each next one think_time
        after the previous turn's last token. A failed turn ends the conversation."""
        await asyncio.sleep(max(0.0, trip.request.arrival - self.client.now()))
        while True:
            await self.client.send(trip, self._prompt(trip.request))
            req = trip.request
            if req.next_turn is None:
                return
            if trip.status != "finished":
                self._skip_rest(req)
                return
            await asyncio.sleep(req.think_time)
            trip = self.trips[req.next_turn.id]

    def _skip_rest(self, req: Request) -> None:
        turn = req.next_turn
        while turn is not None:
            self.trips[turn.id].fail(f"not sent: an earlier turn (request {req.id}) failed")
            turn = turn.next_turn

    async def _scrape(self) -> None:
        while True:
            await asyncio.sleep(self.scrape_s)
            text = await self.client.metrics()
            if text:
                self._scrape_once(text)

    def _scrape_once(self, text: str) -> bool:
        values, labels = parse_prometheus(text)
        row = timeline_row(values)
        if row is None:
            return False
        self.pool_blocks = pool_blocks(labels) or self.pool_blocks
        self.scraped.append({"t_s": self.client.now(), **row})
        return True

    def timeline(self) -> Optional[pd.DataFrame]:
        return pd.DataFrame(self.scraped) if self.scraped else None

    def frame_and_itl(self) -> tuple[pd.DataFrame, np.ndarray]:
        trips = list(self.trips.values())
        measured = [t for t in trips if not t.request.is_warmup]
        itl = np.concatenate([t.gaps() for t in measured]) if measured else np.zeros(0)
        return complete_frame([t.row() for t in trips]), itl


def run_bench(scenario, endpoint: str, model: Optional[str], request_timeout: float,
              scrape_s: float, say: Callable[[str], None] = lambda _: None) -> Measured:
    """Smoke-check the endpoint, replay the workload, summarise what the client saw. Ctrl-C
    keeps what was measured: unfinished requests are marked aborted and the run partial."""
    from sim.workload import build_workload

    workload = build_workload(scenario)
    client = Client(endpoint, request_timeout)
    bench = Bench(client, workload.requests, scenario.model.vocab_size, scrape_s, say)
    server: dict = {}
    interrupted = False

    async def main() -> None:
        try:
            server.update(await client.describe(model))
            await bench.run()
        finally:
            await client.http.aclose()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        if not bench.smoke:
            raise
        interrupted = True
    frame, itl = bench.frame_and_itl()
    summary = measured_summary(frame, itl, scenario.slo, bench.pool_blocks, scenario.engine.block_size)
    timeline = bench.timeline()
    apply_timeline(summary, timeline, bench.pool_blocks)
    summary["interrupted"] = interrupted
    manifest = bench_manifest(scenario, client.base, server, bench, workload, summary)
    return Measured(summary, frame, manifest, bench.pool_blocks, timeline)


def bench_manifest(scenario, endpoint: str, server: dict, bench: Bench, workload, summary: dict) -> dict:
    import httpx

    from sim.predict import git_commit, kvtwin_version, length_stats, workload_digest

    requests = workload.requests
    return {
        "kind": "endpoint measurement",
        "endpoint": endpoint,
        "server": server,
        "client": {"kvtwin_version": kvtwin_version(), "git_commit": git_commit(), "httpx": httpx.__version__},
        "sampling": {"temperature": 0.0, "ignore_eos": True, "stream": True, "n": 1,
                     "max_tokens": "each request's output length from the workload",
                     "max_generation_len": max((r.output_len for r in requests), default=0)},
        "prompts": f"token ids materialised from the workload's segments with the scenario model's "
                   f"vocabulary ({scenario.model.vocab_size}); the endpoint's model must accept them",
        "smoke": bench.smoke,
        "metrics": {"scraped": bool(bench.scraped), "interval_s": bench.scrape_s, "samples": len(bench.scraped),
                    "kv_pool_blocks": bench.pool_blocks or None},
        "workload": {"requests": len(requests), "digest": workload_digest(requests),
                     "lengths": length_stats(requests), "notes": workload.notes},
        "partial": summary["partial"],
        "notes": endpoint_notes(scenario, server, bench),
        "scenario": scenario.model_dump(mode="json"),
    }


def endpoint_notes(scenario, server: dict, bench: Bench) -> list[str]:
    """Where the endpoint's configuration visibly differs from the scenario's."""
    from sim.core.memory import plan_memory

    notes = []
    if server.get("max_model_len") not in (None, scenario.max_model_len):
        notes.append(f"the endpoint's max_model_len is {server['max_model_len']}, the scenario's "
                     f"{scenario.max_model_len}")
    planned = plan_memory(scenario).usable_blocks
    if bench.pool_blocks and bench.pool_blocks != planned:
        notes.append(f"the endpoint's KV pool holds {bench.pool_blocks} usable blocks, the prediction "
                     f"planned {planned}: compare KV usage (%), not block counts")
    if not bench.scraped:
        notes.append("the endpoint offers no vLLM /metrics: no KV or queue timeline was measured")
    return notes


# ----------------------------------------------------------------------------- vLLM result files

def read_vllm_result(path: Path, scenario) -> Measured:
    """A `vllm bench serve --save-result` JSON file as a measured run of `scenario`."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--vllm-result: no such file {path}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--vllm-result {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or "duration" not in data:
        raise UserError(f"--vllm-result {path}: not a `vllm bench serve` result (no 'duration')")
    detailed = all(k in data for k in ("ttfts", "itls", "input_lens", "output_lens"))
    summary, frame = (_detailed_summary(data, scenario) if detailed else (_aggregate_summary(data), None))
    notes = workload_mismatches(data, scenario, detailed)
    if notes:
        notes.append("the file's workload is not the scenario's: until they match, this comparison means nothing")
    meta_keys = ("date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                 "burstiness", "max_concurrency", "duration", "completed", "failed")
    manifest = {"kind": "vLLM benchmark result", "file": str(path), "per_request": detailed,
                "vllm": {k: data[k] for k in meta_keys if k in data}, "notes": notes,
                "scenario": scenario.model_dump(mode="json")}
    return Measured(summary, frame if frame is not None else complete_frame([]), manifest)


def _detailed_summary(data: dict, scenario) -> tuple[dict, pd.DataFrame]:
    n = len(data["ttfts"])
    errors = data.get("errors") or [""] * n
    starts = data.get("start_times")
    latencies = data.get("latencies")
    rows = []
    for i in range(n):
        ok = not errors[i]
        itl = data["itls"][i] or []
        e2e = latencies[i] if latencies and latencies[i] else data["ttfts"][i] + sum(itl)
        rows.append({"id": i, "is_warmup": False, "status": "finished" if ok else "failed",
                     "reject_reason": errors[i] or None,
                     "arrival_s": starts[i] - min(starts) if starts else 0.0,
                     "prompt_tokens": data["input_lens"][i], "output_tokens": data["output_lens"][i],
                     "ttft_s": data["ttfts"][i] if ok else math.nan, "e2e_s": e2e if ok else math.nan})
    frame = complete_frame(rows)
    itl = [g for i in range(n) if not errors[i] for g in (data["itls"][i] or [])]
    summary = measured_summary(frame, np.asarray(itl), scenario.slo, 0, scenario.engine.block_size)
    _over_duration(summary, float(data["duration"]))
    apply_timeline(summary, None, 0)
    return summary, frame


def _over_duration(summary: dict, duration: float) -> None:
    """vLLM's throughputs divide by the whole send/receive phase, its `duration`."""
    old = summary["duration_s"]
    for key in ("request_throughput", "output_token_throughput", "total_token_throughput", "goodput"):
        if summary.get(key) is not None and old:
            summary[key] *= old / duration
    summary["duration_s"] = duration


def _aggregate_summary(data: dict) -> dict:
    """Without --save-detailed vLLM keeps only aggregates: mean, median and the percentiles asked."""
    def dist(metric: str) -> dict:
        out = {"mean": data.get(f"mean_{metric}_ms"), "p50": data.get(f"median_{metric}_ms"),
               "p90": data.get(f"p90_{metric}_ms"), "p99": data.get(f"p99_{metric}_ms"), "max": None}
        return {k: None if v is None else v / 1e3 for k, v in out.items()}

    completed = data.get("completed")
    failed = data.get("failed") or 0
    return {"requests_total": (completed or 0) + failed, "requests_finished": completed,
            "requests_failed": failed, "requests_measured": completed, "duration_s": data["duration"],
            "request_throughput": data.get("request_throughput"),
            "output_token_throughput": data.get("output_throughput"),
            "total_token_throughput": data.get("total_token_throughput"),
            "goodput": data.get("request_goodput"),
            "ttft_s": dist("ttft"), "tpot_s": dist("tpot"), "itl_s": dist("itl"), "e2e_s": dist("e2el"),
            "partial": bool(failed), "per_request": False}


def workload_mismatches(data: dict, scenario, detailed: bool) -> list[str]:
    """Ways the file's workload differs from the scenario's (empty when they agree)."""
    from sim.workload import build_workload

    requests = build_workload(scenario).requests
    steady = [r for r in requests if not r.is_warmup]
    notes = []
    count = len(data["input_lens"]) if detailed else data.get("num_prompts") or data.get("completed") or 0
    if count not in (len(requests), len(steady)):
        notes.append(f"the file holds {count} requests, the scenario {len(requests)}")
    if detailed:
        ok = [i for i, e in enumerate(data.get("errors") or [""] * count) if not e]
        pairs = (("prompt", data["input_lens"], [r.prompt_len for r in steady]),
                 ("output", [data["output_lens"][i] for i in ok], [r.output_len for r in steady]))
    else:
        done = data.get("completed") or 1
        pairs = (("prompt", [data.get("total_input_tokens", 0) / done], [r.prompt_len for r in steady]),
                 ("output", [data.get("total_output_tokens", 0) / done], [r.output_len for r in steady]))
    for what, theirs, ours in pairs:
        notes += _length_mismatch(what, np.asarray(theirs, dtype=float), np.asarray(ours, dtype=float), detailed)
    notes += _arrival_mismatch(data, scenario.workload.arrival)
    return notes


def _length_mismatch(what: str, theirs: np.ndarray, ours: np.ndarray, detailed: bool) -> list[str]:
    if not len(theirs) or not len(ours):
        return []
    stats = (("mean", np.mean), ("p90", lambda a: np.percentile(a, 90))) if detailed else (("mean", np.mean),)
    return [f"{what} lengths: {name} {fn(theirs):.1f} in the file vs {fn(ours):.1f} in the scenario"
            for name, fn in stats if abs(fn(theirs) - fn(ours)) > WORKLOAD_TOLERANCE * fn(ours)]


def _arrival_mismatch(data: dict, arrival) -> list[str]:
    rate = data.get("request_rate")
    if rate is None:
        return []
    if rate == "inf" or (isinstance(rate, (int, float)) and math.isinf(rate)):
        return [] if arrival.process == "offline" else [
            f"the file sent every request at t=0 (request_rate inf), the scenario arrives {arrival.process} "
            f"at {arrival.rate}/s"]
    if arrival.rate is None or abs(float(rate) - arrival.rate) > WORKLOAD_TOLERANCE * arrival.rate:
        return [f"request rate {rate}/s in the file vs {arrival.rate or 'offline'} in the scenario"]
    return []


# ----------------------------------------------------------------------------- outputs

TIMELINE_FIGURE = "endpoint_timeline"


def write_comparison(predicted, measured: Measured, out: Path, title: str) -> tuple[pd.DataFrame, dict]:
    """measured/, predicted/, comparison.csv, plots and report.html (validate's tables and plots)."""
    from sim.output.run_files import view_of, write_run
    from sim.output.report import plot_run_figures, write_html_report
    from validate.compare import comparison_table
    from validate.plots import plot_relative_errors

    out = Path(out)
    files = {f"predicted_{k}": p for k, p in write_run(predicted, out / "predicted", report=False).items()}
    files.update(write_measured(measured, out / "measured"))
    table = comparison_table(predicted.summary, measured.summary)
    files["comparison"] = write_csv(out / "comparison.csv", table.reset_index())
    views = {"predicted": view_of(predicted, "predicted"), "measured": measured.view()}
    from sim.output.run_files import setup_title

    figures = plot_run_figures(views, out, setup_title(predicted))
    figures["errors"] = plot_relative_errors(table, out / "errors.png")
    if measured.timeline is not None:
        figures[TIMELINE_FIGURE] = plot_endpoint_timeline(views["predicted"], measured.timeline,
                                                          out / f"{TIMELINE_FIGURE}.png")
    files.update(figures)
    notes = measured.manifest.get("notes") or []
    extra = [("Predicted vs measured", table)]
    if notes:
        extra.insert(0, ("Warnings", pd.DataFrame({"warning": notes})))
    files["report"] = write_html_report(out / "report.html", title, views, figures,
                                        {"predicted": predicted.manifest, "measured": measured.manifest},
                                        extra_tables=extra, setup=predicted.manifest)
    return table, files


def write_measured(measured: Measured, folder: Path) -> dict[str, Path]:
    files = {"measured_summary": write_json(folder / "summary.json", measured.summary),
             "measured_requests": write_csv(folder / "requests.csv", measured.requests),
             "measured_manifest": write_json(folder / "manifest.json", measured.manifest)}
    if measured.timeline is not None:
        files["measured_timeline"] = write_csv(folder / "metrics_timeline.csv", measured.timeline)
    return files


def plot_endpoint_timeline(predicted, scraped: pd.DataFrame, path: Path) -> Path:
    """KV usage (%) and running/waiting: the predicted steps against the scraped /metrics."""
    from sim.output.report import finish_axes, new_figure, save_figure, timeline

    fig, (kv_ax, queue_ax) = new_figure(nrows=2, sharex=True)
    edges, tl = timeline(predicted.steps, {"kv_blocks_used": "max", "running": "max", "waiting": "max"})
    if len(tl):
        usage = tl["kv_blocks_used"] / max(predicted.kv_blocks_total, 1) * 100
        kv_ax.plot(edges[:-1], usage, drawstyle="steps-post", color="C0", label="predicted")
        queue_ax.plot(edges[:-1], tl["running"], drawstyle="steps-post", color="C0", label="predicted: running")
        queue_ax.plot(edges[:-1], tl["waiting"], drawstyle="steps-post", color="C0", ls="--",
                      label="predicted: waiting")
    kv_ax.plot(scraped["t_s"], scraped["kv_usage"] * 100, drawstyle="steps-post", color="C1", marker=".",
               label="measured (/metrics)")
    queue_ax.plot(scraped["t_s"], scraped["running"], drawstyle="steps-post", color="C1", marker=".",
                  label="measured: running")
    queue_ax.plot(scraped["t_s"], scraped["waiting"], drawstyle="steps-post", color="C1", ls="--",
                  label="measured: waiting")
    finish_axes(kv_ax, "KV cache usage: predicted steps vs the endpoint's /metrics samples", "usage (%)", xlabel="")
    finish_axes(queue_ax, "Running and waiting requests", "requests", counts=True)
    return save_figure(fig, path)


def print_comparison(table: pd.DataFrame, measured: Measured, out: Path) -> None:
    from rich.table import Table

    view = Table(title="predicted vs measured", header_style="bold")
    for col in ("metric", "predicted", "measured", "error"):
        view.add_column(col, justify="left" if col == "metric" else "right")
    from sim.output.pages import display_comparison

    shown = display_comparison(table)
    for (metric, row), (_, raw) in zip(shown.iterrows(), table.iterrows()):
        if pd.isna(raw.predicted) and pd.isna(raw.measured):
            continue
        view.add_row(metric, row.predicted, row.measured, row.error)
    console.print(view)
    for note in measured.manifest.get("notes") or []:
        err_console.print(f"[yellow]warning[/] {note}")
    s = measured.summary
    if s.get("partial"):
        err_console.print(f"[yellow]partial[/]: {s.get('requests_finished')} of {s.get('requests_total')} "
                          f"requests finished; failures: {s.get('failures') or s.get('requests_failed')}")
    console.print(f"wrote {out}/ (report.html, comparison.csv, measured/, predicted/)")


# ----------------------------------------------------------------------------- CLI

def _single_scenario(args):
    from sim.scenario import expand_variants, load_scenario

    scenario = load_scenario(args.scenario, args.overrides, args.seed)
    variants = expand_variants(scenario, base_dir=args.scenario.parent.resolve())
    if len(variants) > 1:
        raise UserError(f"{args.scenario} has variants ({', '.join(variants)}); a measurement is of one "
                        f"configuration: write the variant as its own scenario")
    return scenario


def bench_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="simrun bench",
                                description="Replay a scenario's workload against an OpenAI-compatible "
                                            "endpoint and compare the measurement with the prediction.")
    scenario_args(p)
    p.add_argument("--endpoint", required=True, help="server root URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first of the endpoint's /v1/models)")
    p.add_argument("--out", type=Path, help="output folder (default runs/bench/<scenario name>)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may wait for its next streamed chunk")
    p.add_argument("--scrape-interval", type=float, default=0.5, help="seconds between /metrics samples")
    args = p.parse_args(argv)
    from sim.predict import predict

    scenario = _single_scenario(args)
    out = args.out or Path("runs") / "bench" / args.scenario.stem
    try:
        measured = run_bench(scenario, args.endpoint, args.model, args.request_timeout, args.scrape_interval,
                             say=lambda msg: err_console.print(f"bench: {msg}"))
    except BenchError as e:
        raise UserError(str(e)) from None
    table, _ = write_comparison(predict(scenario, "predicted"), measured, out,
                                f"kvtwin bench: {scenario.name} against {normalise_endpoint(args.endpoint)}")
    print_comparison(table, measured, out)
    return 1 if measured.summary["partial"] else 0


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="simrun compare",
                                description="Compare a `vllm bench serve --save-result` file with the "
                                            "prediction of the same workload.")
    scenario_args(p)
    p.add_argument("--vllm-result", type=Path, required=True, help="the JSON file vLLM's benchmark saved")
    p.add_argument("--out", type=Path, help="output folder (default runs/compare/<scenario name>)")
    args = p.parse_args(argv)
    from sim.predict import predict

    scenario = _single_scenario(args)
    measured = read_vllm_result(args.vllm_result, scenario)
    out = args.out or Path("runs") / "compare" / args.scenario.stem
    table, _ = write_comparison(predict(scenario, "predicted"), measured, out,
                                f"kvtwin vs vLLM benchmark: {scenario.name} ({args.vllm_result.name})")
    print_comparison(table, measured, out)
    return 0
