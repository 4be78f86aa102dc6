"""The endpoint seen from outside, as vLLM's benchmark client sees it: streamed OpenAI
completions timestamped per chunk, /v1/models, /version, /metrics and /reset_prefix_cache."""
from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from sim.core.files import excerpt, printable
from sim.core.lazy import lazy_import
from sim.core.request import Request

np = lazy_import("numpy")


REQUEST_DEADLINE_S = 6 * 3600      # one request, start to [DONE]: vLLM bench's aiohttp total timeout


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
        try:
            httpx.URL(self.base).copy_with(path="/v1/models")      # a bad port shows only when joined
            self.http = httpx.AsyncClient(
                base_url=self.base, timeout=httpx.Timeout(request_timeout, connect=10.0), headers=headers or {},
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        except httpx.InvalidURL as e:
            raise BenchError(f"--endpoint {excerpt(endpoint)}: not a URL ({e})") from None
        self.model: Optional[str] = None
        self.t0 = time.perf_counter()
        self.metrics_problem: Optional[str] = None     # why /metrics was not read (once it happened)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def describe(self, model: Optional[str]) -> dict:
        """The served model and version; a clear error when nothing answers at the URL."""
        import httpx

        try:
            status, content = await self.fetch("/v1/models", MAX_PAGE_BYTES)
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach {self.base} ({type(e).__name__}: {e or 'no answer'}); "
                             f"is the server running?") from None
        except TooLarge as e:
            raise BenchError(str(e)) from None
        cards = model_cards(content) if status == 200 else []
        if not cards and model is None:
            raise BenchError(f"{self.base}/v1/models answered HTTP {status} without a model; "
                             f"pass --model NAME")
        card = next((c for c in cards if c["id"] == model), cards[0] if cards else {})
        self.model = model or card["id"]
        info = {"model": self.model, "root": card.get("root"), "max_model_len": card.get("max_model_len")}
        info["version"] = await self._version()
        return info

    async def _version(self) -> Optional[str]:
        import httpx

        try:
            status, content = await self.fetch("/version", MAX_PAGE_BYTES)
            version = json.loads(content).get("version") if status == 200 else None
        except (httpx.HTTPError, TooLarge, ValueError, RecursionError, AttributeError):   # none, or no object
            return None
        return printable(version, 100) if isinstance(version, str) else None

    async def reset_prefix_cache(self) -> str:
        """POST /reset_prefix_cache (ours; vLLM's when started with VLLM_SERVER_DEV_MODE=1): 'reset',
        or why not."""
        import httpx

        try:
            status, content = await self.fetch("/reset_prefix_cache", MAX_ERROR_BYTES, timeout=30.0,
                                               method="POST", cut=True)
        except (httpx.HTTPError, TooLarge) as e:
            return f"failed ({type(e).__name__})"
        if status == 200:
            return "reset"
        if status in (404, 405):
            return f"not offered (HTTP {status})"
        return f"refused (HTTP {status}: {error_message(content)})"

    async def metrics(self) -> Optional[str]:
        """The /metrics page, or None (none offered, or one too large: `metrics_problem` says so)."""
        import httpx

        try:
            status, content = await self.fetch("/metrics", MAX_METRICS_BYTES, timeout=5.0)
        except httpx.HTTPError:
            return None
        except TooLarge as e:
            self.metrics_problem = str(e)
            return None
        return content.decode(errors="replace") if status == 200 else None

    async def fetch(self, path: str, limit: int, timeout: float = REQUEST_DEADLINE_S, method: str = "GET",
                  cut: bool = False) -> tuple[int, bytes]:
        """(status, body) of `path`; TooLarge past `limit` bytes (or, with `cut`, the first `limit`
        bytes) or past `timeout` seconds in all: an endless page would otherwise be read forever
        (httpx's timeout is per read)."""
        async def read() -> tuple[int, bytes]:
            async with self.http.stream(method, path) as reply:
                body = await read_capped(reply, limit if cut else limit + 1)
                return reply.status_code, body
        try:
            status, body = await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise TooLarge(f"{path} answered for more than {timeout} s") from None
        if len(body) > limit:
            raise TooLarge(f"{path} answered more than {limit} bytes")
        return status, body

    async def send(self, trip: Trip, prompt: list[int]) -> None:
        """One streamed completion; the trip records its chunk times or why it failed."""
        import httpx

        payload = {"model": self.model, "prompt": prompt, "max_tokens": trip.request.output_len,
                   "ignore_eos": True, "temperature": 0.0, "stream": True,
                   "stream_options": {"include_usage": True}}
        trip.status, trip.sent = "sent", self.now()
        try:
            await asyncio.wait_for(self._exchange(trip, payload), REQUEST_DEADLINE_S)
        except asyncio.TimeoutError:     # wait_for's; httpx's own timeouts are HTTPErrors
            trip.fail(f"no [DONE] within {REQUEST_DEADLINE_S} s (a request's time limit, as vLLM bench's)")
        except MalformedStream as e:
            trip.fail(f"malformed stream: {e}")
        except httpx.HTTPError as e:
            trip.fail(f"{type(e).__name__}: {e or 'connection lost'}")
        except asyncio.CancelledError:
            trip.fail("interrupted while in flight", status="aborted")
            raise
        except Exception as e:           # noqa: BLE001 (an answer no check foresaw: this request fails, not the run)
            trip.fail(client_error(e))

    async def _exchange(self, trip: Trip, payload: dict) -> None:
        async with self.http.stream("POST", "/v1/completions", json=payload) as reply:
            if reply.status_code != 200:
                body = await read_capped(reply, MAX_ERROR_BYTES)
                trip.fail(f"HTTP {reply.status_code}: {error_message(body)}")
                return
            await self._read_stream(reply, trip)

    async def _read_stream(self, reply, trip: Trip) -> None:
        usage = None
        max_lines = 4 * trip.request.output_len + 1024      # a token is 2 lines; room for keep-alive comments
        lines = 0
        async for line in bounded_lines(reply):
            lines += 1
            if lines > max_lines:
                raise MalformedStream(f"more than {max_lines} lines for {trip.request.output_len} tokens asked")
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
            if usage.get("completion_tokens") is not None:
                trip.tokens = usage["completion_tokens"]
            trip.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        expected = trip.request.output_len
        if not trip.chunks:
            trip.fail("the stream carried no token")
        elif trip.tokens != expected:
            trip.fail(f"{trip.tokens} tokens returned, {expected} asked with ignore_eos")
        elif trip.cached is not None and trip.cached > trip.request.prompt_len:
            trip.fail(f"malformed stream: usage.prompt_tokens_details.cached_tokens is {trip.cached}, more "
                      f"than the prompt's {trip.request.prompt_len} tokens")
        else:
            trip.status = "finished"


CLIENT_ERROR = "client error"


def client_error(e: Exception) -> str:
    """The reason a request failed on an exception the client does not expect (its bug, or an
    answer none of its checks foresaw), escaped and cut like server text."""
    return f"{CLIENT_ERROR}: {type(e).__name__}: {printable(str(e) or repr(e), 200)}"


def model_cards(content: bytes) -> list[dict]:
    """The model objects of a /v1/models answer (OpenAI's `{"data": [{"id": ...}, ...]}`), each
    with a string id; BenchError naming what is wrong otherwise."""
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        raise BenchError(f"/v1/models answered {excerpt(content, 80)}, which is not JSON") from None
    if not isinstance(body, dict):
        raise BenchError(f"/v1/models answered {excerpt(body)}, expected an object with a `data` list of models")
    cards = body.get("data", [])
    if not isinstance(cards, list):
        raise BenchError(f"/v1/models: data is {excerpt(cards)}, expected a list of models")
    for i, card in enumerate(cards):
        if not (isinstance(card, dict) and isinstance(card.get("id"), str)):
            raise BenchError(f"/v1/models: data[{i}] is {excerpt(card)}, expected an object with a string `id`")
        if card.get("root") is not None and not isinstance(card["root"], str):
            raise BenchError(f"/v1/models: data[{i}].root is {excerpt(card['root'])}, expected a string")
        length = card.get("max_model_len")
        if length is not None and not (type(length) is int and 1 <= length <= MAX_COUNT):
            raise BenchError(f"/v1/models: data[{i}].max_model_len is {excerpt(length)}, expected a whole number")
    return cards


class TooLarge(Exception):
    """A page of the endpoint passed its size or time bound."""


class MalformedStream(Exception):
    """The endpoint answered 200 but its event stream is not OpenAI's."""


def sse_event(line: str) -> Any:
    """A `data:` line's JSON object, or "[DONE]"; MalformedStream otherwise, naming what is wrong:
    the fields the client reads (choices, their token_ids, usage's token counts) are typed, so a
    hostile or broken server fails its request with a reason, never the whole bench."""
    if not line.startswith("data:"):
        raise MalformedStream(f"not a server-sent `data:` line: {excerpt(line, 80)}")
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        event = json.loads(data)
    except RecursionError:
        raise MalformedStream("event is not JSON (it nests too deeply)") from None
    except ValueError as e:      # JSONDecodeError, an integer over 4300 digits
        reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise MalformedStream(f"event is not JSON ({excerpt(reason, 60)[1:-1]}): {excerpt(data, 80)}") from None
    if not isinstance(event, dict) or not ({"choices", "usage", "error"} & set(event)):
        raise MalformedStream(f"event has neither choices, usage nor error: {excerpt(data, 80)}")
    _check_choices(event.get("choices"))
    _check_usage(event.get("usage"))
    return event


def _check_choices(choices: Any) -> None:
    if choices is None:
        return
    if not isinstance(choices, list):
        raise MalformedStream(f"choices is {excerpt(choices)}, expected a list of choice objects")
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise MalformedStream(f"choices[{i}] is {excerpt(choice)}, expected an object")
        ids = choice.get("token_ids")
        if ids is not None and not (isinstance(ids, list) and all(type(t) is int for t in ids)):
            raise MalformedStream(f"choices[{i}].token_ids is {excerpt(ids)}, expected a list of token ids")


def _check_usage(usage: Any) -> None:
    if usage is None:
        return
    if not isinstance(usage, dict):
        raise MalformedStream(f"usage is {excerpt(usage)}, expected an object")
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        raise MalformedStream(f"usage.prompt_tokens_details is {excerpt(details)}, expected an object")
    for name, value in (("usage.completion_tokens", usage.get("completion_tokens")),
                        ("usage.prompt_tokens_details.cached_tokens", (details or {}).get("cached_tokens"))):
        if value is not None and not (type(value) is int and 0 <= value <= MAX_COUNT):
            raise MalformedStream(f"{name} is {excerpt(value)}, expected a whole number >= 0")


MAX_COUNT = 2**53          # token counts beyond this are no count a server could have made
MAX_LINE_CHARS = 2**20     # an event line (a chunk of one token is ~300 characters)
MAX_ERROR_BYTES = 2**16    # what is read of an error answer's body
MAX_PAGE_BYTES = 2**24     # /v1/models, /version
MAX_METRICS_BYTES = 2**25  # /metrics (vLLM's is ~100 KiB; many LoRA adapters or engines add to it)


def error_message(body: Any) -> str:
    """The message of an OpenAI/vLLM error body, else the body itself: shortened, with control
    characters escaped (a server's text must not drive the terminal it is printed on)."""
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except (ValueError, RecursionError):
            return printable(body.decode(errors="replace"), 300)
    if isinstance(body, dict):
        err = body.get("error", body)
        body = err.get("message", err) if isinstance(err, dict) else err
    return printable(body if isinstance(body, str) else excerpt(body, 300), 300)


async def read_capped(reply, limit: int) -> bytes:
    """At most `limit` bytes of a streamed reply's body (an error page can be endless)."""
    chunks, size = [], 0
    async for chunk in reply.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


_LINE_BREAK = re.compile("\r\n|\r|\n")


async def bounded_lines(reply) -> AsyncIterator[str]:
    """The reply's lines (SSE's \\r\\n, \\r or \\n endings), MalformedStream once a line passes
    MAX_LINE_CHARS: httpx's own aiter_lines holds an endless line in memory."""
    buffer = ""
    async for text in reply.aiter_text():
        buffer += text
        *lines, buffer = _LINE_BREAK.split(buffer)
        if len(buffer) > MAX_LINE_CHARS or any(len(line) > MAX_LINE_CHARS for line in lines):
            raise MalformedStream(f"a line of more than {MAX_LINE_CHARS} characters")
        for line in lines:
            yield line
    if buffer:
        yield buffer


def normalise_endpoint(url: str) -> str:
    """'host:port', 'http://host:port/' and an OpenAI base URL '.../v1' all mean the server root."""
    url = url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url.removesuffix("/v1")
