"""The HTTP side of `simrun serve` (FastAPI, imported on first use): the routes, the body and
waiting limits, streamed (server-sent events) and whole answers, the shutdown report."""

import asyncio
import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from engine.serve.engine_loop import EngineLoop, Stream
from engine.serve.protocol import ApiError, Completion, parse_body, parse_chat, parse_completion

log = logging.getLogger("kvtwin.serve")


def build_app(engine: EngineLoop, version: str, limits: Optional["ServeLimits"] = None):
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.requests import ClientDisconnect

    served = engine.served
    limits = limits or ServeLimits()
    waiting = WaitingLimit(engine, limits.max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start(asyncio.get_running_loop())
        yield
        counts = await asyncio.to_thread(engine.stop)
        print(shutdown_report(engine.drain, counts), file=sys.stderr, flush=True)

    app = FastAPI(title="kvtwin", version=version, lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        # 408 and 413 leave the body unread: close the connection rather than read on to the next request
        closing = {"connection": "close"} if exc.status in (408, 413) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=closing)

    @app.get("/health")
    async def health():
        if engine.alive:
            return Response(status_code=200)
        return JSONResponse(ApiError(f"engine is down: {engine.error!r}", 503).body(), status_code=503)

    @app.get("/version")
    async def version_info():
        return {"version": version, "server": "kvtwin"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": int(time.time()), "owned_by": "kvtwin",
            "root": served.root, "max_model_len": served.max_model_len}]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if not await engine.reset_prefix_cache():
            raise ApiError("requests are in flight: the prefix cache can be reset only when the server is idle",
                           409)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await _serve(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await _serve(request, parse_chat)

    async def _serve(request: HttpRequest, parse):
        if engine.drain is not None or not engine.alive:
            raise ApiError("the server is shutting down" if engine.drain else "the engine is down", 503)
        waiting.check()
        try:
            body = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
        except ClientDisconnect:           # the client left mid-body: nothing to answer, nothing to log
            log.debug("client disconnected while sending its request body")
            return Response(status_code=499)
        params = await asyncio.to_thread(parse_body, body, served, parse)     # off the event loop
        # again: others were read and parsed meanwhile; no await from here to track(), so the
        # bound holds however many requests arrive together
        waiting.check()
        stream = engine.submit(params)
        waiting.track(stream)
        reply = Completion(served.name, len(params.prompt), chat=params.chat, tokenizer=served.tokenizer)
        try:
            first = await stream.next()
        except asyncio.CancelledError:
            stream.abort()
            raise
        if first.kind != "accepted":
            raise ApiError(first.message, 400 if first.kind == "rejected" else 503)
        if params.stream:
            return StreamingResponse(_sse(stream, reply, params.include_usage), media_type="text/event-stream")
        return await _whole(stream, reply, request)

    return app


@dataclass(frozen=True)
class ServeLimits:
    """What one client may hold: the body (size, time to send it: the app) and connections
    (how many, how long idle after an answer: uvicorn's; how long a request's headers may take:
    see uvicorn_config)."""

    max_body_bytes: int = 4 * 2**20       # a 128k-token prompt of 6-digit ids is about 1 MiB
    max_waiting: Optional[int] = None     # None: unbounded, as vLLM
    body_timeout_s: float = 60.0          # a 4 MiB body at 1 Mbit/s takes ~34 s
    limit_concurrency: int = 1024         # uvicorn: 503 once this many connections or requests are open
    keep_alive_s: float = 5.0             # uvicorn's default: an idle connection closes after this
    header_timeout_s: float = 20.0        # a request's line and headers (engine/serve/http_limits.py)


async def read_body(request, limit: int, timeout_s: float = ServeLimits.body_timeout_s) -> bytes:
    """The body, or ApiError 413 once it is known to exceed `limit` bytes (without reading the rest),
    or ApiError 408 when it has not all arrived within `timeout_s` (a slow or endless body)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.strip().isascii() and declared.strip().isdigit()):
            raise ApiError("Content-Length is not a number")
        if int(declared) > limit:
            raise ApiError(f"the request body is {int(declared)} bytes, more than the {limit} allowed", 413)
    chunks: list[bytes] = []

    async def read_all() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(f"the request body is more than the {limit} bytes allowed", 413)
            chunks.append(chunk)

    try:      # (asyncio.wait_for, not asyncio.timeout: Python 3.10 is supported)
        await asyncio.wait_for(read_all(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(f"the request body did not arrive within {timeout_s:g} s (--body-timeout); "
                       f"{sum(map(len, chunks))} bytes came", 408) from None
    return b"".join(chunks)


class WaitingLimit:
    """--max-waiting: requests submitted and not yet ended, less those the engine runs."""

    def __init__(self, engine: "EngineLoop", limit: Optional[int]):
        self.engine, self.limit = engine, limit
        self.open: list[Stream] = []

    def check(self) -> None:
        if self.limit is None:
            return
        self.open = [s for s in self.open if not s.ended]
        waiting = len(self.open) - self.engine.metrics.gauges["running"]
        if waiting >= self.limit:
            raise ApiError(f"{waiting} requests are already waiting (--max-waiting {self.limit}); "
                           f"retry later", 429)

    def track(self, stream: "Stream") -> None:
        if self.limit is not None:
            self.open.append(stream)


async def _sse(stream: Stream, reply: Completion, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, then usage (when asked) and [DONE]. An
    aborted request ends with an error event and no [DONE], so clients see it is incomplete."""
    try:
        while True:
            event = await stream.next()
            if event.kind != "token":
                yield _sse_data(ApiError(event.message, 503).body())
                return
            text = reply.add(event)
            yield _sse_data({**reply.head(), "choices": [reply.choice(text, [event.token])], "usage": None})
            if event.finish_reason:
                break
        if include_usage:
            yield _sse_data({**reply.head(), "choices": [], "usage": reply.usage()})
        yield "data: [DONE]\n\n"
    finally:                 # cancelled when the client disconnects: free its blocks
        stream.abort()


def _sse_data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _whole(stream: Stream, reply: Completion, request):
    """Collect a non-streamed completion, aborting it if the client leaves meanwhile."""
    from fastapi.responses import JSONResponse, Response

    collect = asyncio.ensure_future(_collect(stream, reply))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
            stream.abort()
    if collect not in done:
        return Response(status_code=499)       # nginx's "client closed request": nobody reads it
    error = collect.result()
    if error:
        raise ApiError(error, 503)
    return JSONResponse(reply.whole())


async def _collect(stream: Stream, reply: Completion) -> Optional[str]:
    while True:
        event = await stream.next()
        if event.kind != "token":
            return event.message
        reply.add(event)
        if event.finish_reason:
            return None


async def _disconnected(request) -> None:
    """Returns when the client disconnects (the body is read, so only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def shutdown_report(drain: Optional[dict], counts: dict) -> str:
    served = f"{counts['finished']} finished, {counts['aborted']} aborted, {counts['rejected']} rejected"
    served += f", {counts['failed']} failed in total" if counts.get("failed") else " in total"
    ended = sum(counts.get(k, 0) for k in ("finished", "aborted", "rejected", "failed"))
    if counts.get("submitted", ended) != ended:      # the accounting every run checks
        served += (f"; {counts['submitted'] - ended} of {counts['submitted']} request(s) submitted did not end "
                   f"(a kvtwin bug: please report it)")
    if drain is None:
        return f"kvtwin serve: stopped; {served}"
    done = counts["finished"] - drain["finished"]
    aborted = counts["aborted"] - drain["aborted"]
    return (f"kvtwin serve: shut down on {drain['signal']}: {drain['in_flight']} request(s) in flight, "
            f"{done} finished during the grace period, {aborted} aborted; {served}")
