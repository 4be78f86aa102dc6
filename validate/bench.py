"""`simrun bench`'s load generator: a scenario's workload replayed against a live endpoint.

Each request is sent at its arrival time (a follow-up turn think_time after the previous
turn's last token) as a streamed /v1/completions call with the workload's prompt token ids,
max_tokens = its output length, ignore_eos and temperature 0; every chunk is timestamped at
the client (validate/endpoint_client.py). Before the run a smoke request must come back whole
and a fixed probe prompt shows whether the server's prefix cache is warm; during it /metrics
is scraped for KV usage and queue lengths."""
from __future__ import annotations

import asyncio
import math
import time
from typing import Callable, Optional

from sim.core.lazy import lazy_import
from sim.core.request import Request, make_request, stable_key
from sim.vllm.timeseries import (parse_prometheus, pool_blocks, sample_problem, series_on_run_clock,
                                 timeline_row)
from validate.endpoint_client import CLIENT_ERROR, BenchError, Client, Trip, client_error
from validate.measured import Measured, apply_timeline, complete_frame, measured_summary

np = lazy_import("numpy")      # on first use: `simrun bench -h` stays light
pd = lazy_import("pandas")

# The smoke request sent before measuring, to check the endpoint answers with the lengths asked
# for (the same request as engine/replay.py's smoke check).
SMOKE_PROMPT_TOKENS = 16
SMOKE_OUTPUT_TOKENS = 8

# The warm-cache probe: long enough for whole blocks at any usual block size (16..128).
PROBE_TOKENS = 257


def _prefix_hits(text: Optional[str]) -> Optional[float]:
    if not text:
        return None
    row = timeline_row(parse_prometheus(text)[0])
    return None if row is None or math.isnan(row["prefix_hits"]) else row["prefix_hits"]


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
        self.refused_scrapes = 0               # /metrics samples no server state can have
        self.first_refused: Optional[str] = None
        self.lost = 0                          # requests the run's accounting found never ended

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
        self._check_every_request_ended()
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
        """Send now, or, with a concurrency cap, once a slot is free (TTFT counts from the send).
        An unexpected error fails this request with its reason; the run goes on."""
        try:
            if self._gate is None:
                await self.client.send(trip, self._prompt(trip.request))
                return
            async with self._gate:
                await self.client.send(trip, self._prompt(trip.request))
        except Exception as e:       # noqa: BLE001 (Client.send catches its own; this is the rest)
            trip.fail(client_error(e))

    def _check_every_request_ended(self) -> None:
        """The run's accounting: every request ends finished or failed with a reason. One still
        unsent or in flight after every conversation returned was lost by the load generator."""
        for trip in self.trips.values():
            if trip.status not in ("finished", "failed", "aborted"):
                trip.fail("never ended: the load generator lost it (a kvtwin bug: please report it)")
                self.lost += 1
        if self.lost:
            self.say(f"WARNING: {self.lost} request(s) never ended (a kvtwin bug: please report it); "
                     f"they count as failed")

    def client_errors(self) -> list[Trip]:
        return [t for t in self.trips.values() if t.status == "failed" and (t.error or "").startswith(CLIENT_ERROR)]

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
        problem = sample_problem(row)
        if problem is not None:        # kept out of the timeline, counted in the manifest's notes
            self.refused_scrapes += 1
            self.first_refused = self.first_refused or problem
            return True
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
    if bench.client.metrics_problem:
        notes.append(f"the endpoint's /metrics was not read: {bench.client.metrics_problem}")
    if bench.refused_scrapes:
        notes.append(f"the endpoint's /metrics gave {bench.refused_scrapes} sample(s) no server state can have "
                     f"(the first: {bench.first_refused}); they are not in the timeline")
    if not bench.scraped:
        notes.append("the endpoint offers no vLLM /metrics: no KV or queue timeline was measured")
    errors = bench.client_errors()
    if errors:
        notes.append(f"{len(errors)} request(s) failed on a client error (an answer the client's checks do not "
                     f"foresee, or a kvtwin bug); the first: request {errors[0].request.id}, {errors[0].error}")
    if bench.lost:
        notes.append(f"{bench.lost} request(s) never ended: the load generator lost them (a kvtwin bug: please "
                     f"report it); they count as failed")
    cache = bench.cache
    if cache.get("warm_before") and cache.get("reset") != "reset":
        notes.append(f"the server's prefix cache was warm from an earlier run (the probe hit "
                     f"{cache['probe_hit_tokens']} tokens) and could not be reset ({cache['reset']}): "
                     f"measured prefix hits and TTFTs are better than a cold start's")
    elif cache.get("warm_before") is None and cache.get("reset") != "reset":
        notes.append(f"whether the server's prefix cache was warm is unknown (no cached-token count, no "
                     f"prefix-cache counters) and it could not be reset ({cache.get('reset')})")
    return notes
