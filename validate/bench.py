"""kvtwin's prediction against a live OpenAI-compatible endpoint, or against a vLLM result file.

`simrun bench SCENARIO --endpoint URL` replays the scenario's workload against the endpoint:
each request is sent at its arrival time (a follow-up turn think_time after the previous
turn's last token) as a streamed /v1/completions call with the workload's prompt token ids,
max_tokens = its output length, ignore_eos and temperature 0, and every streamed chunk is
timestamped at the client, as vLLM's benchmark client does (TTFT = first chunk - send,
ITL = gaps between chunks, E2E = last chunk - send). Before the run one fixed short request
(16 tokens, max_tokens 8) must come back with 8 tokens; during it /metrics is scraped for
KV usage and queue lengths when the endpoint offers vLLM's metric names.

Before the run a fixed probe prompt shows whether the server's prefix cache is warm from an
earlier run, and /reset_prefix_cache is tried; `workload.max_concurrency` makes the client
closed-loop (a semaphore, as vLLM's --max-concurrency); --header / --api-key reach endpoints
behind authentication.

`simrun compare SCENARIO --vllm-result FILE` reads what `vllm bench serve --save-result`
writes (sim.vllm.results: per-request ttfts, itls, input_lens, output_lens with --save-detailed;
the aggregate mean/median/p99 fields otherwise) and checks the file's workload against the
scenario's before comparing: a comparison on a different workload is meaningless, so differences
are a banner before the table and exit status 1 (unless --allow-mismatch).
--use-file-workload replays the file's own requests instead; a file of several runs
(--append-result) is compared rate by rate (validate/compare_sweep.py).

Both take --server-log (a vLLM log or /metrics scrapes; sim.vllm.timeseries) and compare its
running / waiting / KV % over time with the prediction's; bench uses its own scrapes otherwise.

Both write, beside `simrun validate`'s layout:
    out/measured/    summary.json, requests.csv, manifest.json (+ metrics_timeline.csv)
    out/predicted/   simrun's prediction of the same scenario
    out/comparison.csv, out/*.png, out/report.html (+ series_comparison.csv with a time series)
Measured summaries come from sim.metrics.summarise on a requests frame of records.py's
schema plus the client's ITL samples; what a black-box endpoint cannot show (steps, the
queue/host/device split) is None, and KV figures come from the scraped timeline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from sim.errors import UserError
from sim.extras import require
from sim.output.console import console, err_console
from sim.scenario import scenario_args
from sim.output.io import write_csv, write_json
from sim.output.run_dir import check_out_folder, out_folder_arg, owned_run_folder
from sim.core.request import Request, make_request, stable_key
from sim.core.lazy import lazy_import
from sim.vllm.timeseries import load_series, parse_prometheus, pool_blocks, series_on_run_clock, timeline_row

np = lazy_import("numpy")      # on first use: `simrun bench -h` stays light
pd = lazy_import("pandas")

# The smoke request sent before measuring, to check the endpoint answers with the lengths asked
# for (the same request as engine/replay.py's smoke check).
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
    # running / waiting / KV % over time (sim.vllm.timeseries): the scrapes, or a server log
    series: Optional[pd.DataFrame] = None
    series_offset: Optional[float] = None       # run time = series t_s + offset, when known
    run_t0_wall: Optional[float] = None         # the run's start, seconds since the epoch (log clock)

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


# ----------------------------------------------------------------------------- the load generator

# The warm-cache probe: long enough for whole blocks at any usual block size (16..128).
PROBE_TOKENS = 257


def _prefix_hits(text: Optional[str]) -> Optional[float]:
    if not text:
        return None
    row = timeline_row(parse_prometheus(text)[0])
    return None if row is None or math.isnan(row["prefix_hits"]) else row["prefix_hits"]


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

    def __init__(self, endpoint: str, request_timeout: float, headers: Optional[dict[str, str]] = None):
        import httpx

        self.base = normalise_endpoint(endpoint)
        self.http = httpx.AsyncClient(
            base_url=self.base, timeout=httpx.Timeout(request_timeout, connect=10.0), headers=headers or {},
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

    async def reset_prefix_cache(self) -> str:
        """POST /reset_prefix_cache (ours; vLLM's when started with VLLM_SERVER_DEV_MODE=1): 'reset',
        or why not."""
        import httpx

        try:
            reply = await self.http.post("/reset_prefix_cache", timeout=30.0)
        except httpx.HTTPError as e:
            return f"failed ({type(e).__name__})"
        if reply.status_code == 200:
            return "reset"
        if reply.status_code in (404, 405):
            return f"not offered (HTTP {reply.status_code})"
        return f"refused (HTTP {reply.status_code}: {error_message(reply.content)})"

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
        self.t0_wall: Optional[float] = None
        self.max_concurrency: Optional[int] = None
        self._gate: Optional[asyncio.Semaphore] = None
        self.probe_tokens = PROBE_TOKENS
        self.cache: dict = {}

    async def run(self) -> None:
        await self.smoke_check()
        await self.prepare_cache()
        self.client.t0 = time.perf_counter()
        self.t0_wall = local_wall_clock()
        metrics = await self.client.metrics()      # the baseline: counters count from here
        scraper = asyncio.ensure_future(self._scrape()) if metrics and self._scrape_once(metrics) else None
        last = max((t.request.arrival for t in self.trips.values() if t.request.arrival is not None), default=0)
        self.say(f"smoke request passed (TTFT {self.smoke['ttft_s'] * 1e3:.1f} ms); sending {len(self.trips)} "
                 f"requests, the last first turn at {last:.1f} s; /metrics "
                 f"{'scraped' if scraper else 'not offered'}")
        if self.max_concurrency is not None:     # closed loop, as vLLM bench's --max-concurrency
            self._gate = asyncio.Semaphore(self.max_concurrency)
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

    async def prepare_cache(self) -> None:
        """Start from a cold prefix cache, or say that it is warm. A fixed probe prompt (the same
        on every run of this client) shows whether the server still caches an earlier run's blocks:
        its hits (usage cached_tokens, else the /metrics hit counter) mean it does. Then
        /reset_prefix_cache is tried (ours; vLLM's with VLLM_SERVER_DEV_MODE=1)."""
        probe = make_request(-2, 0.0, [(stable_key("kvtwin-warm-probe"), self.probe_tokens)], 1)
        trip = Trip(probe)
        before = _prefix_hits(await self.client.metrics())
        await self.client.send(trip, self._prompt(probe))
        after = _prefix_hits(await self.client.metrics())
        counted = None if before is None or after is None else int(after - before)
        hit = trip.cached if trip.cached is not None else counted
        reset = await self.client.reset_prefix_cache()
        self.cache = {"probe_prompt_tokens": self.probe_tokens, "probe_hit_tokens": hit,
                      "warm_before": None if hit is None else hit > 0, "reset": reset,
                      "probe": trip.status if trip.status == "finished" else f"{trip.status}: {trip.error}"}
        if self.cache["warm_before"] and reset != "reset":
            self.say(f"WARNING: the server's prefix cache is warm (the probe prompt of an earlier run hit {hit} "
                     f"tokens) and /reset_prefix_cache {reset}: hit rates and TTFTs will beat a cold start's; "
                     f"restart the server, or start vLLM with VLLM_SERVER_DEV_MODE=1 so it can be reset")

    def _prompt(self, req: Request) -> list[int]:
        # Materialised at send time: cheap, and a long trace never holds every prompt at once.
        return req.token_ids(0, req.prompt_len, self.vocab_size).tolist()

    async def _conversation(self, trip: Trip) -> None:
        """Send a conversation's turns: the first at its arrival, each next one think_time
        after the previous turn's last token. A failed turn ends the conversation."""
        await asyncio.sleep(max(0.0, trip.request.arrival - self.client.now()))
        while True:
            await self._send(trip)
            req = trip.request
            if req.next_turn is None:
                return
            if trip.status != "finished":
                self._skip_rest(req)
                return
            await asyncio.sleep(req.think_time)
            trip = self.trips[req.next_turn.id]

    async def _send(self, trip: Trip) -> None:
        """Send now, or, with a concurrency cap, once a slot is free (TTFT counts from the send)."""
        if self._gate is None:
            await self.client.send(trip, self._prompt(trip.request))
            return
        async with self._gate:
            await self.client.send(trip, self._prompt(trip.request))

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
              scrape_s: float, say: Callable[[str], None] = lambda _: None,
              headers: Optional[dict[str, str]] = None) -> Measured:
    """Smoke-check the endpoint, replay the workload, summarise what the client saw. Ctrl-C
    keeps what was measured: unfinished requests are marked aborted and the run partial."""
    from sim.workload import build_workload

    workload = build_workload(scenario)
    client = Client(endpoint, request_timeout, headers)
    bench = Bench(client, workload.requests, scenario.model.vocab_size, scrape_s, say)
    bench.max_concurrency = scenario.workload.max_concurrency
    bench.probe_tokens = min(PROBE_TOKENS, scenario.max_model_len - 2)
    header_names = sorted(headers or {})
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
    manifest["headers"] = header_names             # names only: values may be secrets
    series = series_on_run_clock(bench.scraped) if bench.scraped else None
    return Measured(summary, frame, manifest, bench.pool_blocks, timeline, series=series,
                    run_t0_wall=bench.t0_wall)


def local_wall_clock() -> float:
    """Now, on the clock vLLM's log lines use (local time, read as UTC by sim.vllm.timeseries)."""
    import datetime as dt

    return dt.datetime.now().replace(tzinfo=dt.timezone.utc).timestamp()


def bench_manifest(scenario, endpoint: str, server: dict, bench: Bench, workload, summary: dict) -> dict:
    import httpx

    from sim.predict import git_commit, kvtwin_version, length_stats, workload_digest

    requests = workload.requests
    return {
        "kind": "endpoint measurement",
        "endpoint": endpoint,
        "server": server,
        "client": {"kvtwin_version": kvtwin_version(), "git_commit": git_commit(), "httpx": httpx.__version__},
        "load": {"max_concurrency": bench.max_concurrency},
        "prefix_cache": bench.cache,
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
    cache = bench.cache
    if cache.get("warm_before") and cache.get("reset") != "reset":
        notes.append(f"the server's prefix cache was warm from an earlier run (the probe hit "
                     f"{cache['probe_hit_tokens']} tokens) and could not be reset ({cache['reset']}): "
                     f"measured prefix hits and TTFTs are better than a cold start's")
    elif cache.get("warm_before") is None and cache.get("reset") != "reset":
        notes.append(f"whether the server's prefix cache was warm is unknown (no cached-token count, no "
                     f"prefix-cache counters) and it could not be reset ({cache.get('reset')})")
    return notes


# ----------------------------------------------------------------------------- vLLM result files

def read_vllm_result(path: Path, scenario, run=None, file_workload: bool = False) -> Measured:
    """A `vllm bench serve --save-result` run (the file's only one, or `run`) as a measured run
    of `scenario`. With `file_workload` the scenario replays the file's own requests, so the
    workload is not checked against it."""
    if run is None:
        runs = load_vllm_runs(path)
        if len(runs) > 1:
            raise UserError(f"--vllm-result {path}: {len(runs)} runs (--append-result); compare them "
                            f"as a sweep with `simrun compare` (it does so for such files)")
        run = runs[0]
    data = {**run.config, **run.metrics, **run.per_request}
    if "duration" not in data:
        raise UserError(f"--vllm-result {run.source}: not a `vllm bench serve` result (no 'duration')")
    detailed = all(k in data for k in ("ttfts", "itls", "input_lens", "output_lens"))
    summary, frame = (_detailed_summary(data, scenario) if detailed else (_aggregate_summary(data), None))
    notes = [] if file_workload else workload_mismatches(data, scenario, detailed)
    if notes:
        notes.append("the file's workload is not the scenario's: until they match, this comparison means "
                     "nothing (--use-file-workload replays the file's own requests)")
    meta_keys = ("date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                 "burstiness", "max_concurrency", "duration", "completed", "failed")
    manifest = {"kind": "vLLM benchmark result", "file": run.source, "per_request": detailed,
                "vllm": {k: data[k] for k in meta_keys if k in data}, "notes": notes,
                "workload_from_file": file_workload, "scenario": scenario.model_dump(mode="json")}
    return Measured(summary, frame if frame is not None else complete_frame([]), manifest,
                    run_t0_wall=_result_start_wall(data))


def load_vllm_runs(path: Path) -> list:
    """Every run of a result file (JSON, a JSON array, or --append-result JSON Lines)."""
    from sim.vllm.results import VllmResultError, load_results

    try:
        return load_results(path)
    except VllmResultError as e:
        raise UserError(f"--vllm-result {e}") from None


def file_workload_scenario(scenario, run) -> tuple[Any, list[str]]:
    """`scenario` with the run's own requests as its workload: each request's send time (start_times,
    else vLLM's arrival process drawn again), prompt and output length; failed requests left out."""
    from sim.scenario import ExplicitRequest, Workload
    from sim.vllm.results import arrival_times

    if not run.detailed:
        raise UserError(f"--use-file-workload: {run.source} has no per-request lengths; run `vllm bench "
                        f"serve` with --save-detailed")
    from pydantic import ValidationError

    from sim.scenario import describe_validation_error

    rows = run.requests()
    if not rows:
        raise UserError(f"--use-file-workload: {run.source} holds no finished request to replay")
    times, notes = arrival_times(run, len(rows), scenario.seed)
    t0 = float(times.min())
    starts_known = rows[0][0] is not None
    # Without send times the arrivals are redrawn, and the client's cap has to be simulated.
    cap = None if starts_known else run.max_concurrency
    try:          # the file's values as a workload: a bad one is a line naming the file and field
        requests = [ExplicitRequest(arrival_s=float(t - t0), prompt_len=max(inp, 1), output_len=max(out, 1))
                    for t, (_, inp, out) in zip(times.tolist(), rows)]
        workload = Workload(requests=requests, tenants=scenario.workload.tenants, max_concurrency=cap)
    except ValidationError as e:
        raise UserError(f"--use-file-workload {run.source}: {describe_validation_error(e, Workload)[0]} "
                        f"(the file's requests as workload.requests)") from None
    notes += run.excluded_notes()
    notes.append(f"workload: the {len(requests)} requests of {run.source} (their send times and lengths); "
                 f"each prompt is unique (vLLM's file records no prefix sharing)")
    return scenario.model_copy(update={"workload": workload}), notes


def _result_start_wall(data: dict) -> Optional[float]:
    """When the benchmark started, from its `date` (local time, written at the end) less its
    duration; on the log's clock (local time read as UTC). None when the file has no date."""
    import datetime as dt

    try:
        end = dt.datetime.strptime(str(data.get("date")), "%Y%m%d-%H%M%S").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return None
    return end.timestamp() - float(data["duration"])


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
    theirs, ours = data.get("max_concurrency"), scenario.workload.max_concurrency
    if theirs not in (None, "None", "") and int(theirs) != ours:
        notes.append(f"the file's client kept at most {theirs} requests in flight (--max-concurrency), the "
                     f"scenario {ours or 'no limit'} (workload.max_concurrency)")
    elif theirs in (None, "None", "") and ours is not None and "max_concurrency" in data:
        notes.append(f"the scenario's client keeps at most {ours} requests in flight, the file's had no limit")
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
    table = comparison_table(predicted.summary, measured.summary)
    files["comparison"] = write_csv(out / "comparison.csv", table.reset_index())
    views = {"predicted": view_of(predicted, "predicted"), "measured": measured.view()}
    from sim.output.run_files import setup_title

    figures = plot_run_figures(views, out, setup_title(predicted))
    figures["errors"] = plot_relative_errors(table, out / "errors.png")
    extra = [("Predicted vs measured", table)]
    if measured.series is not None:
        series_table, aligned = series_comparison(views["predicted"], measured)
        measured.manifest["series_table"] = series_table.to_dict("records")
        files["series"] = write_csv(out / "series_comparison.csv", aligned)
        figures[TIMELINE_FIGURE] = plot_series(views["predicted"], aligned, measured.manifest["series"],
                                               out / f"{TIMELINE_FIGURE}.png")
        extra.append(("Running, waiting, KV %: mean absolute difference over time", series_table))
    files.update(write_measured(measured, out / "measured"))
    files.update(figures)
    notes = measured.manifest.get("notes") or []
    if notes:
        extra.insert(0, ("Warnings", pd.DataFrame({"warning": notes})))
    files["report"] = write_html_report(out / "report.html", title, views, figures,
                                        {"predicted": predicted.manifest, "measured": measured.manifest},
                                        extra_tables=extra, setup=predicted.manifest)
    return table, files


def series_comparison(predicted, measured: Measured) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The measured series on the run's clock beside the prediction, and the difference table;
    the alignment used is recorded in the manifest."""
    from sim.vllm.timeseries import align_offset, compare_series

    series = measured.series
    steps = predicted.steps
    if measured.series_offset is not None:
        offset, how = measured.series_offset, "given"
    elif series.attrs.get("on_run_clock"):
        offset, how = 0.0, "none needed (scraped by this run's client)"
    else:
        offset, how = align_offset(series, steps, predicted.kv_blocks_total, measured.run_t0_wall,
                                   predicted.requests["arrival_s"].dropna().to_numpy())
    aligned, table = compare_series(series, steps, predicted.kv_blocks_total, offset)
    measured.manifest["series"] = {"source": series.attrs.get("source", "/metrics scrapes"),
                                   "kind": series.attrs.get("kind"), "samples": len(series),
                                   "offset_s": offset, "alignment": how}
    return table, aligned


def write_measured(measured: Measured, folder: Path) -> dict[str, Path]:
    files = {"measured_summary": write_json(folder / "summary.json", measured.summary),
             "measured_requests": write_csv(folder / "requests.csv", measured.requests),
             "measured_manifest": write_json(folder / "manifest.json", measured.manifest)}
    if measured.timeline is not None:
        files["measured_timeline"] = write_csv(folder / "metrics_timeline.csv", measured.timeline)
    return files


def plot_series(predicted, aligned: pd.DataFrame, info: dict, path: Path) -> Path:
    """Running, waiting and KV usage (%): the predicted step curves against the measured samples."""
    from sim.output.report import finish_axes, new_figure, save_figure
    from sim.vllm.timeseries import predicted_at

    fig, axes = new_figure(nrows=3, sharex=True)
    end = max(float(predicted.steps["end_s"].max()) if not predicted.steps.empty else 0.0,
              float(aligned["t_s"].max()) if len(aligned) else 0.0)
    grid = np.linspace(min(0.0, float(aligned["t_s"].min()) if len(aligned) else 0.0), end, 2000)
    curve = predicted_at(predicted.steps, predicted.kv_blocks_total, grid)
    titles = {"running": "Running requests", "waiting": "Waiting requests", "kv_usage_pct": "KV cache usage (%)"}
    for ax, (q, title) in zip(axes, titles.items()):
        ax.plot(grid, curve[q], drawstyle="steps-post", color="C0", label="predicted")
        ax.plot(aligned["t_s"], aligned[f"measured_{q}"], ls="none", marker=".", color="C1",
                label=f"measured ({info.get('kind') or 'series'})")
        finish_axes(ax, title, "%" if q == "kv_usage_pct" else "requests", counts=q != "kv_usage_pct",
                    xlabel="time since the first arrival (s)" if q == "kv_usage_pct" else "")
    axes[0].set_title(f"Running requests (measured shifted by {info['offset_s']:+.1f} s: {info['alignment']})")
    return save_figure(fig, path)


def print_comparison(table: pd.DataFrame, measured: Measured, out: Path) -> None:
    from rich.table import Table

    print_banner(measured.manifest.get("notes") or [], measured.manifest.get("kind") == "vLLM benchmark result")
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
    print_series_table(measured)
    s = measured.summary
    if s.get("partial"):
        err_console.print(f"[yellow]partial[/]: {s.get('requests_finished')} of {s.get('requests_total')} "
                          f"requests finished; failures: {s.get('failures') or s.get('requests_failed')}")
    console.print(f"wrote {out}/ (report.html, comparison.csv, measured/, predicted/)")


def print_banner(notes: list[str], workload: bool) -> None:
    """Differences that make the comparison doubtful, shown before any number."""
    if not notes:
        return
    from rich.panel import Panel

    title = "WORKLOAD MISMATCH" if workload else "warning"
    err_console.print(Panel("\n".join(f"- {n}" for n in notes), title=title, border_style="yellow"))


def print_series_table(measured: Measured) -> None:
    rows = measured.manifest.get("series_table")
    if not rows:
        return
    from rich.table import Table

    info = measured.manifest["series"]
    view = Table(title=f"over time: {info['samples']} samples of {info['source']}, offset {info['offset_s']:+.2f} s "
                       f"({info['alignment']})", header_style="bold")
    for col in ("quantity", "mean |predicted - measured|", "measured mean", "predicted mean", "samples"):
        view.add_column(col, justify="left" if col == "quantity" else "right")
    for row in rows:
        view.add_row(row["quantity"], _fmt(row["mean_abs_diff"]), _fmt(row["measured_mean"]),
                     _fmt(row["predicted_mean"]), str(row["samples"]))
    console.print(view)


def _fmt(value) -> str:
    from sim.output.units import format_value

    return "n/a" if pd.isna(value) else format_value(value)


# ----------------------------------------------------------------------------- CLI

def _single_scenario(args):
    from sim.scenario import expand_variants, load_scenario

    scenario = load_scenario(args.scenario, args.overrides, args.seed)
    variants = expand_variants(scenario, base_dir=args.scenario.parent.resolve())
    if len(variants) > 1:
        raise UserError(f"{args.scenario} has variants ({', '.join(variants)}); a measurement is of one "
                        f"configuration: write the variant as its own scenario")
    return scenario


def request_headers(lines: list[str], api_key: Optional[str]) -> dict[str, str]:
    """--header 'Name: value' lines and --api-key (else $OPENAI_API_KEY, as vLLM's bench) as headers."""
    import os

    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name.strip() or any(c in line for c in "\r\n"):
            raise UserError(f"--header {line!r}: expected 'Name: value' on one line")
        headers[name.strip()] = value.strip()
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if key and "Authorization" not in headers:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def finite_float(text: str) -> float:
    """An argparse type: a number that is not NaN or infinite (float() takes 'nan' and 'inf')."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: expected a finite number of seconds")
    return value


def series_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server-log", type=Path, metavar="FILE",
                   help="the vLLM server's log, /metrics scrapes (each headed by '# TIME <unix s>') or a "
                        "Prometheus query_range JSON, covering the run: its running / waiting / KV %% "
                        "curves are compared with the prediction's")
    p.add_argument("--series-offset", type=finite_float, metavar="S",
                   help="run time = series time + S (default: from the wall clocks when both are known, "
                        "else the offset that fits the curves best)")
    p.add_argument("--log-year", type=int, help="the year of the log's MM-DD times (default: this year)")


def check_series_args(args, offset_needs_log: bool) -> None:
    """A series flag without the file it applies to is a mistake worth naming, not a no-op.
    `offset_needs_log`: the command has no series but the log's (compare; a bench scrapes /metrics)."""
    if args.server_log is not None:
        return
    if args.log_year is not None:
        raise UserError(f"--log-year {args.log_year}: applies to the MM-DD times of a --server-log file; "
                        f"give --server-log FILE, or drop --log-year")
    if offset_needs_log and args.series_offset is not None:
        raise UserError(f"--series-offset {args.series_offset:g}: applies to a --server-log file's time series; "
                        f"give --server-log FILE, or drop --series-offset")


def attach_series(measured: Measured, args) -> None:
    if args.server_log is not None:
        measured.series = load_series(args.server_log, year=args.log_year)
    if args.series_offset is not None:
        measured.series_offset = args.series_offset


def bench_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="simrun bench",
                                description="Replay a scenario's workload against an OpenAI-compatible "
                                            "endpoint and compare the measurement with the prediction.")
    scenario_args(p)
    p.add_argument("--endpoint", required=True, help="server root URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first of the endpoint's /v1/models)")
    p.add_argument("--out", type=out_folder_arg, help="output folder (default runs/bench/<scenario name>)")
    p.add_argument("--force", action="store_true", help="write into --out even if it holds files kvtwin did not write")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may wait for its next streamed chunk")
    p.add_argument("--scrape-interval", type=float, default=0.5, help="seconds between /metrics samples")
    p.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="an HTTP header sent with every request (repeatable)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY when set)")
    series_args(p)
    args = p.parse_args(argv)
    require("simrun bench", "httpx")
    check_series_args(args, offset_needs_log=False)
    from sim.predict import predict

    scenario = _single_scenario(args)
    out = args.out or Path("runs") / "bench" / args.scenario.stem
    check_out_folder(out, force=args.force)      # before measuring; a bench that measured nothing leaves no folder
    try:
        measured = run_bench(scenario, args.endpoint, args.model, args.request_timeout, args.scrape_interval,
                             say=lambda msg: err_console.print(f"bench: {msg}", markup=False),
                             headers=request_headers(args.header, args.api_key))
    except BenchError as e:
        raise UserError(str(e)) from None
    attach_series(measured, args)
    with owned_run_folder(out, force=args.force):
        table, _ = write_comparison(predict(scenario, "predicted"), measured, out,
                                    f"kvtwin bench: {scenario.name} against {normalise_endpoint(args.endpoint)}")
    print_comparison(table, measured, out)
    return 1 if measured.summary["partial"] else 0


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="simrun compare",
                                description="Compare a `vllm bench serve --save-result` file with the "
                                            "prediction of the same workload. A file of several runs "
                                            "(--append-result, a rate sweep) is compared run by run "
                                            "against the scenario at each run's rate.")
    scenario_args(p)
    p.add_argument("--vllm-result", type=Path, required=True,
                   help="the JSON (or --append-result JSON Lines) file vLLM's benchmark saved")
    p.add_argument("--use-file-workload", action="store_true",
                   help="replay the file's own requests (send times, prompt and output lengths; needs "
                        "--save-detailed) instead of the scenario's workload")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="exit 0 even when the file's workload differs from the scenario's")
    p.add_argument("--out", type=out_folder_arg, help="output folder (default runs/compare/<scenario name>)")
    p.add_argument("--force", action="store_true", help="write into --out even if it holds files kvtwin did not write")
    series_args(p)
    args = p.parse_args(argv)
    check_series_args(args, offset_needs_log=True)
    from sim.predict import predict

    scenario = _single_scenario(args)
    runs = load_vllm_runs(args.vllm_result)
    out = args.out or Path("runs") / "compare" / args.scenario.stem
    if len(runs) > 1:
        from validate.compare_sweep import compare_sweep

        if args.server_log is not None or args.series_offset is not None:
            raise UserError(f"--server-log compares one run's time series; {args.vllm_result} holds {len(runs)} "
                            f"runs: cut the file to the run the log covers")

        with owned_run_folder(out, force=args.force):      # checked before predicting
            return compare_sweep(scenario, runs, out, args.use_file_workload, args.allow_mismatch)
    with owned_run_folder(out, force=args.force):          # checked before predicting
        notes: list[str] = []
        if args.use_file_workload:
            scenario, notes = file_workload_scenario(scenario, runs[0])
        measured = read_vllm_result(args.vllm_result, scenario, runs[0], args.use_file_workload)
        measured.manifest["workload_notes"] = notes
        attach_series(measured, args)
        table, _ = write_comparison(predict(scenario, "predicted"), measured, out,
                                    f"kvtwin vs vLLM benchmark: {scenario.name} ({args.vllm_result.name})")
    print_comparison(table, measured, out)
    mismatch = bool(measured.manifest["notes"])
    if mismatch and not args.allow_mismatch:
        err_console.print("[bold red]workload mismatch[/]: exit status 1 (--allow-mismatch to accept it, "
                          "--use-file-workload to replay the file's own requests)")
        return 1
    return 0
