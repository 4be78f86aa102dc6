"""`simrun serve`: the paged engine behind an OpenAI-compatible HTTP API.

    POST /v1/completions   prompt as token ids (or text, with --tokenizer); max_tokens, ignore_eos,
                           stream (server-sent events)
    POST /v1/chat/completions  messages (with --tokenizer): the tokenizer's chat template, else
                           'role: content' lines then 'assistant:'
    GET  /v1/models, /version, /health
    GET  /metrics          Prometheus text with vLLM's metric names

One thread runs the engine loop (the shared Scheduler + ModelRunner, as in engine/replay.py);
the asyncio event loop only parses, validates and streams. They meet at two queues: the
event loop hands the engine thread commands (add, abort, stop) through a thread-safe queue,
and the engine thread hands each step's tokens back with one call_soon_threadsafe into
per-request asyncio queues. A slow client therefore never stalls a step, and a step never
blocks the event loop. The engine thread sleeps on its command queue when it has no work.

Untrusted bodies: a body over `--max-body-bytes` is HTTP 413 (refused from its Content-Length,
or as soon as the stream passes the limit); JSON parsing and validation run on a worker thread,
so a large or deeply nested body never stalls the event loop (/health, streams); any malformed
body is HTTP 400, never 500. With `--max-waiting N`, a request arriving while N already wait
for the engine gets HTTP 429. The port is bound before the model is built, so a taken port
fails at once.

Requests are checked before they reach the scheduler (token ids within the vocabulary,
prompt + max_tokens within max_model_len, max_tokens >= 1, n == 1, no sampling option the
engine cannot honour); a bad one gets HTTP 400 with the reason. A client that goes away
aborts its request, which frees its blocks. SIGINT/SIGTERM stop accepting requests, let
in-flight ones finish within a grace period, abort the rest and print one report line.
"""

import argparse
import asyncio
import bisect
import concurrent.futures
import contextlib
import errno
import itertools
import json
import logging
import math
import queue
import signal
import sys
import threading
import traceback
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from sim.core.files import excerpt, read_json
from sim.core.request import Request

log = logging.getLogger("kvtwin.serve")

# Fields a completion request may carry. Sampling is the runner's (one temperature for the
# whole server), so per-request sampling options are accepted only at the value that
# changes nothing: standard clients (vllm bench serve, the openai package) send them so.
SUPPORTED_FIELDS = ("model", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos",
                    "temperature", "n", "user", "return_token_ids")
NEUTRAL_VALUES: dict[str, tuple] = {
    "best_of": (None, 1), "echo": (None, False), "logprobs": (None,), "top_p": (None, 1),
    "top_k": (None, 0, -1), "min_p": (None, 0), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "stop": (None, "", []),
    "stop_token_ids": (None, []), "min_tokens": (None, 0), "seed": (None,), "suffix": (None,),
    "logit_bias": (None, {}),
}


# ----------------------------------------------------------------------------- requests

class ApiError(Exception):
    """An error answered to the client (OpenAI's error object); the engine is unaffected."""

    KINDS = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 413: "RequestEntityTooLargeError",
             429: "RateLimitError", 503: "ServiceUnavailableError", 500: "InternalServerError"}

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.KINDS.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ServedModel:
    name: str                        # what clients pass as `model`
    root: str                        # catalog name or folder
    vocab_size: int
    max_model_len: int
    temperature: float
    eos_token_id: Optional[int]
    tokenizer: Any = None            # sim.datasets.TextTokenizer: text prompts, chat, decoded answers


@dataclass(frozen=True)
class CompletionParams:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    chat: bool = False


def parse_completion(body: Any, served: ServedModel) -> CompletionParams:
    """Validate a /v1/completions body; raises ApiError naming the offending field."""
    _check_body(body, served, SUPPORTED_FIELDS)
    prompt = _encode_text(body.get("prompt"), served)
    if isinstance(prompt, list) and len(prompt) >= served.max_model_len:   # before checking each id
        raise ApiError(f"the prompt has {len(prompt)} tokens; this model's maximum context length is "
                       f"{served.max_model_len} tokens", param="prompt")
    prompt = _prompt(prompt, served.vocab_size)
    max_tokens = _max_tokens(body.get("max_tokens"), len(prompt), served.max_model_len)
    _check_choice(body, served.temperature)
    return CompletionParams(prompt, max_tokens, _flag(body, "ignore_eos"), _flag(body, "stream"),
                            _include_usage(body.get("stream_options")))


CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
               "ignore_eos", "temperature", "n", "user")


def parse_chat(body: Any, served: ServedModel) -> CompletionParams:
    """Validate a /v1/chat/completions body (needs a tokenizer): the messages become the prompt
    through the tokenizer's chat template, or, without one, kvtwin's plain template
    ('role: content' lines, then 'assistant:')."""
    if served.tokenizer is None:
        raise ApiError("/v1/chat/completions needs a tokenizer: start simrun serve with --tokenizer", 404)
    _check_body(body, served, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    tok = served.tokenizer
    ids = tok.apply_chat_template(messages) if tok.apply_chat_template else \
        tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")
    prompt = _prompt(ids, served.vocab_size)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _max_tokens(limit, len(prompt), served.max_model_len)
    _check_choice(body, served.temperature)
    return CompletionParams(prompt, max_tokens, _flag(body, "ignore_eos"), _flag(body, "stream"),
                            _include_usage(body.get("stream_options")), chat=True)


def _check_body(body: Any, served: ServedModel, fields: tuple[str, ...]) -> None:
    """A JSON object of known fields, sampling options at neutral values, the served model."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(fields) - set(NEUTRAL_VALUES))
    if unknown:
        raise ApiError(f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    for name, allowed in NEUTRAL_VALUES.items():
        if name in body and body[name] not in allowed:
            raise ApiError(f"{name}={excerpt(body[name])} is not supported (allowed: "
                           f"{', '.join(repr(a) for a in allowed)})", param=name)
    model = body.get("model")
    if model is not None and model != served.name:
        shown = model if isinstance(model, str) and len(model) <= 100 else excerpt(model)
        raise ApiError(f"The model `{shown}` does not exist.", 404, "model")      # vLLM's words


def _messages(messages: Any) -> list[dict]:
    """[{role, content}] with content a string or a list of {type: text, text} parts (vLLM bench)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(f"messages[{i}] needs a role (system, user, assistant)", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be text", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _encode_text(prompt: Any, served: ServedModel) -> Any:
    """A text prompt as token ids when the server has a tokenizer; anything else unchanged."""
    if isinstance(prompt, str) and served.tokenizer is not None:
        if not prompt:
            raise ApiError("prompt is empty", param="prompt")
        return served.tokenizer.encode(prompt)
    return prompt


def _prompt(prompt: Any, vocab_size: int) -> list[int]:
    if prompt is None:
        raise ApiError("prompt is required: a list of token ids", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise ApiError("prompt as text needs a tokenizer (simrun serve --tokenizer); "
                       "send the prompt as a list of token ids", param="prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("prompt must be a non-empty list of token ids", param="prompt")
    if isinstance(prompt[0], list):
        raise ApiError("batched prompts (a list of token-id lists) are not supported; "
                       "send one prompt per request", param="prompt")
    for i, token in enumerate(prompt):
        if type(token) is not int:
            raise ApiError(f"prompt[{i}] is {excerpt(token)}: token ids must be integers", param="prompt")
        if not 0 <= token < vocab_size:
            raise ApiError(f"prompt[{i}] = {token} is outside the vocabulary (token ids 0..{vocab_size - 1})",
                           param="prompt")
    return prompt


def _max_tokens(value: Any, prompt_len: int, max_model_len: int) -> int:
    if value is None:                    # vLLM: the room left in the context
        value = max(max_model_len - prompt_len, 1)
    if type(value) is not int:
        raise ApiError(f"max_tokens must be an integer, got {excerpt(value)}", param="max_tokens")
    if value < 1:
        raise ApiError(f"max_tokens must be at least 1, got {value}", param="max_tokens")
    if prompt_len + value > max_model_len:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {prompt_len + value} tokens ({prompt_len} in the prompt, {value} in the "
                       f"completion). Please reduce the length of the prompt or completion.",
                       param="max_tokens")
    return value


def _check_choice(body: dict, temperature: float) -> None:
    n = body.get("n", 1)
    if n != 1 or type(n) is not int:
        raise ApiError(f"n={excerpt(n)} is not supported: one completion per request", param="n")
    t = body.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t != temperature):
        raise ApiError(f"temperature={excerpt(t)} is not supported: this server samples every request at "
                       f"temperature {temperature} (simrun serve --temperature)", param="temperature")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false, got {excerpt(value)}", param=name)
    return value


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError("stream_options may hold only include_usage", param="stream_options")
    for key in ("include_usage", "continuous_usage_stats"):     # booleans, as vLLM's StreamOptions types them
        if options.get(key) is not None and not isinstance(options[key], bool):
            raise ApiError(f"stream_options.{key} must be true or false, got {excerpt(options[key])}",
                           param=f"stream_options.{key}")
    if options.get("continuous_usage_stats"):
        raise ApiError("stream_options.continuous_usage_stats is not supported", param="stream_options")
    return bool(options.get("include_usage", False))


# ----------------------------------------------------------------------------- metrics

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        return out + [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {cumulative}"]


def _label_value(text: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped (the model name comes
    from a user's file and must not break, or add lines to, /metrics)."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """What /metrics shows. Written by the engine thread, rendered on the event loop: one lock."""

    HISTOGRAMS = {
        "vllm:time_to_first_token_seconds": ("Time to first token, from arrival.", TTFT_BUCKETS),
        "vllm:request_time_per_output_token_seconds": ("Decode time per output token after the first.",
                                                       TOKEN_BUCKETS),
        "vllm:inter_token_latency_seconds": ("Gaps between successive tokens of a request.", TOKEN_BUCKETS),
        "vllm:e2e_request_latency_seconds": ("Arrival to last token.", E2E_BUCKETS),
    }

    def __init__(self, model_name: str, block_size: int, num_blocks: int):
        self._lock = threading.Lock()
        self.labels = f'model_name="{_label_value(model_name)}"'
        self.cache_labels = f'block_size="{block_size}",num_gpu_blocks="{num_blocks}"'
        self.gauges = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
                         "prompt_tokens": 0, "generation_tokens": 0}
        self.finished: dict[str, int] = {"length": 0, "stop": 0, "abort": 0}
        self.histograms = {name: Histogram(bounds) for name, (_, bounds) in self.HISTOGRAMS.items()}

    def set_state(self, scheduler) -> None:
        kv = scheduler.kv
        with self._lock:
            self.gauges.update(running=scheduler.num_running, waiting=scheduler.num_waiting, kv_usage=kv.usage)
            self.counters.update(prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
                                 num_preemptions=scheduler.num_preemptions)

    def observe_token(self, gap: Optional[float]) -> None:
        with self._lock:
            self.counters["generation_tokens"] += 1
            if gap is not None:
                self.histograms["vllm:inter_token_latency_seconds"].observe(gap)

    def count_prompt(self, tokens: int) -> None:
        with self._lock:
            self.counters["prompt_tokens"] += tokens

    def observe_end(self, live: "_Live", reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1
            if reason == "abort" or math.isnan(live.first_token):
                return
            n = live.req.num_output
            h = self.histograms
            h["vllm:time_to_first_token_seconds"].observe(live.first_token - live.arrival)
            h["vllm:e2e_request_latency_seconds"].observe(live.last_token - live.arrival)
            if n > 1:
                h["vllm:request_time_per_output_token_seconds"].observe(
                    (live.last_token - live.first_token) / (n - 1))

    def render(self) -> str:
        with self._lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self) -> list[str]:
        lb = self.labels
        out = []
        for name, help_, value in (
                ("vllm:num_requests_running", "Requests in the running batch.", self.gauges["running"]),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", self.gauges["waiting"]),
                ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full): referenced blocks / usable blocks.",
                 self.gauges["kv_usage"])):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{lb}}} {float(value)!r}"]
        out += ["# HELP vllm:cache_config_info KV cache configuration.", "# TYPE vllm:cache_config_info gauge",
                f"vllm:cache_config_info{{{self.cache_labels}}} 1.0"]
        for key, value in self.counters.items():
            out += [f"# TYPE vllm:{key} counter", f"vllm:{key}_total{{{lb}}} {float(value)!r}"]
        out.append("# TYPE vllm:request_success counter")
        out += [f'vllm:request_success_total{{{lb},finished_reason="{r}"}} {float(n)!r}'
                for r, n in self.finished.items()]
        for name, hist in self.histograms.items():
            out += [f"# HELP {name} {self.HISTOGRAMS[name][0]}", f"# TYPE {name} histogram", *hist.lines(name, lb)]
        return out


# ----------------------------------------------------------------------------- engine thread

@dataclass(frozen=True)
class Event:
    """One message from the engine thread to a request's stream."""

    kind: str                              # accepted | token | rejected | aborted | error
    token: Optional[int] = None
    finish_reason: Optional[str] = None    # on a request's last token: length | stop
    cached_tokens: int = 0
    message: str = ""


@dataclass
class _Live:
    """Engine-thread bookkeeping of one request."""

    req: Request
    stream: "Stream"
    arrival: float
    first_token: float = math.nan
    last_token: float = math.nan


class Stream:
    """The asyncio side of one request: the engine's events, in order."""

    FINAL = ("rejected", "aborted", "error")

    def __init__(self, engine: "EngineLoop", req_id: int):
        self.engine, self.req_id = engine, req_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.ended = False

    async def next(self) -> Event:
        event = await self.queue.get()
        if event.kind in self.FINAL or event.finish_reason:
            self.ended = True
        return event

    def abort(self) -> None:
        """The client is gone: free the request's blocks (a no-op once it ended)."""
        if not self.ended:
            self.ended = True
            self.engine.abort(self.req_id)


MAX_CONSECUTIVE_FAILURES = 3       # failing steps in a row that take the engine down


class EngineLoop:
    """The scheduler and runner on one thread, fed by commands from the event loop."""

    def __init__(self, scheduler, runner, served: ServedModel):
        self.scheduler, self.runner, self.served = scheduler, runner, served
        self.metrics = ServerMetrics(served.name, scheduler.kv.block_size, runner.num_blocks)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[int, _Live] = {}
        self.ids = itertools.count()
        self.counts = {"finished": 0, "aborted": 0, "rejected": 0, "failed": 0}
        self.error: Optional[BaseException] = None     # set when the engine went down
        self.failed_steps = self.consecutive_failures = 0
        self._batch = None                              # the step being run, for its failure
        self.drain: Optional[dict] = None      # set when a signal asks to shut down
        self._outbox: list[tuple[asyncio.Queue, Event]] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread = threading.Thread(target=self._run, name="kvtwin-engine", daemon=True)

    # -- event-loop side ------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, params: CompletionParams) -> Stream:
        req_id = next(self.ids)
        stream = Stream(self, req_id)
        req = Request(req_id, time.perf_counter(), [list(params.prompt)], params.max_tokens, [])
        if not params.ignore_eos:
            req.eos_token_id = self.served.eos_token_id
        self.commands.put(("add", _Live(req, stream, req.arrival)))
        return stream

    def abort(self, req_id: int) -> None:
        self.commands.put(("abort", req_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's /reset_prefix_cache); False while requests are in flight."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(("reset_prefix_cache", done))
        return await asyncio.wrap_future(done)

    def begin_drain(self, signal_name: str, grace_s: float) -> None:
        """Called from the signal handler: remember what was in flight, and abort what is
        still running after the grace period (its clients get an error event, not a cut)."""
        if self.drain is not None:
            return
        self.drain = {"signal": signal_name, "in_flight": len(self.live), **self.counts}
        # call_soon_threadsafe is the one loop call that is safe from a signal handler
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, grace_s, self.commands.put,
                                            ("abort_all", None))

    def stop(self, timeout: float = 30.0) -> dict:
        """Abort whatever is left, end the thread; returns the request counts."""
        self.commands.put(("stop", None))
        self._thread.join(timeout)
        return dict(self.counts)

    # -- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        """Steps until stopped. A failing step fails its own requests (their blocks freed) and
        the loop goes on; MAX_CONSECUTIVE_FAILURES failing steps in a row, or an error outside a
        step, take the engine down: every request in flight fails, and every later one is
        answered at once with an error (HTTP 503), as /health is. No request waits forever."""
        try:
            idle = True
            while self._take_commands(wait=idle):
                idle = not self._guarded_step()
                self._flush()
        except Exception as e:              # noqa: BLE001 - report it to every client, then /health
            traceback.print_exc()
            print("kvtwin serve: the engine is down; every request is now answered with 503",
                  file=sys.stderr, flush=True)
            self._go_down(e)
            self._serve_down()

    def _guarded_step(self) -> bool:
        try:
            ran = self._step()
        except Exception as e:              # noqa: BLE001 - the step's requests fail, the engine goes on
            self.failed_steps += 1
            self.consecutive_failures += 1
            print(f"kvtwin serve: a step failed ({e!r}); its requests fail, the engine goes on",
                  file=sys.stderr, flush=True)
            self._fail(list(self._batch.reqs) if self._batch is not None else [], e)
            if self.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
                raise
            return True
        if ran:                         # an idle turn proves nothing: only a step that ran resets
            self.consecutive_failures = 0
        return ran

    def _fail(self, reqs: list[Request], error: BaseException) -> None:
        """End these requests with an error event and free their blocks."""
        for req in reqs:
            live = self.live.get(req.id)
            if live is None:
                continue
            with contextlib.suppress(Exception):    # a scheduler left half-updated must not stop the rest
                self.scheduler.abort(req)
            self._end(live, Event("error", message=f"engine error: {error!r}"), count="failed")
        self._batch = None

    def _go_down(self, error: BaseException) -> None:
        self.error = error
        self._fail([live.req for live in self.live.values()], error)
        self._flush()

    def _serve_down(self) -> None:
        """The engine is down: answer every command until stop, so nothing queued hangs."""
        while True:
            kind, arg = self.commands.get()
            if kind == "stop":
                return
            if kind == "add":
                self.counts["failed"] += 1
                self._post(arg, Event("error", message=f"the engine is down: {self.error!r}"))
                self._flush()
            elif isinstance(arg, concurrent.futures.Future):       # e.g. reset_prefix_cache
                arg.set_exception(ApiError(f"the engine is down: {self.error!r}", 503))

    def _take_commands(self, wait: bool) -> bool:
        """Apply queued commands (blocking for the first one when idle). False after stop."""
        try:
            command = self.commands.get() if wait else self.commands.get_nowait()
            while True:
                if not self._apply(*command):
                    return False
                command = self.commands.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, kind: str, arg) -> bool:
        if kind == "add":
            self._add(arg)
        elif kind == "abort" and arg in self.live:
            self._abort(self.live[arg], "aborted: the client went away")
        elif kind == "reset_prefix_cache":
            try:
                arg.set_result(self._reset_prefix_cache())
            except Exception as e:                  # the caller must hear of it; then the engine is down
                arg.set_exception(e)
                raise
        elif kind in ("abort_all", "stop"):         # nothing in flight survives either
            for live in list(self.live.values()):
                self._abort(live, "aborted: the server is shutting down")
        if kind == "stop":
            self._flush()
            return False
        self.metrics.set_state(self.scheduler)
        return True

    def _reset_prefix_cache(self) -> bool:
        """A fresh pool and scheduler (no block holds a hash any more), keeping the counters that
        /metrics reports; refused, as vLLM refuses it, while a request holds blocks."""
        from sim.core.scheduler import Scheduler

        old = self.scheduler
        if self.live or old.num_running or old.num_waiting:
            return False
        kv = old.kv
        fresh_kv = kv.empty_copy()
        fresh_kv.stats = kv.stats
        fresh = Scheduler(old.config, fresh_kv)
        for counter in ("step", "num_added", "num_finished", "num_rejected", "num_aborted", "num_preemptions"):
            setattr(fresh, counter, getattr(old, counter))
        self.scheduler = fresh
        return True

    def _abort(self, live: _Live, message: str) -> None:
        self.scheduler.abort(live.req)              # frees its blocks
        self._end(live, Event("aborted", message=message), count="aborted")

    def _add(self, live: _Live) -> None:
        if self.scheduler.add(live.req):
            self.live[live.req.id] = live
            self.metrics.count_prompt(live.req.prompt_len)
            self._post(live, Event("accepted"))
        else:                                   # e.g. more KV blocks than the pool holds
            self.counts["rejected"] += 1
            self._post(live, Event("rejected", message=live.req.reject_reason or "rejected"))

    def _step(self) -> bool:
        """One engine step; False when there was nothing to run (then wait for a command)."""
        self._batch = batch = self.scheduler.schedule() if self.scheduler.has_unfinished() else None
        if batch is None:
            return False
        result = self.runner.execute(batch)
        finished = {r.id: r for r in self.scheduler.finish_step(batch)}
        now = time.perf_counter()
        for req_id, token in result.sampled.items():
            live = self.live[req_id]
            gap = None if math.isnan(live.last_token) else now - live.last_token
            if gap is None:
                live.first_token = now
            live.last_token = now
            self.metrics.observe_token(gap)
            req = finished.get(req_id)
            reason = None if req is None else self._finish_reason(req, token)
            self._post(live, Event("token", token, reason, live.req.num_cached_tokens))
            if req is not None:
                del self.live[req_id]
                self.counts["finished"] += 1
                self.metrics.observe_end(live, reason)
        self.metrics.set_state(self.scheduler)
        return True

    @staticmethod
    def _finish_reason(req: Request, token: int) -> str:
        return "stop" if req.eos_token_id is not None and token == req.eos_token_id else "length"

    def _end(self, live: _Live, event: Event, count: Optional[str]) -> None:
        del self.live[live.req.id]
        if count:
            self.counts[count] += 1
        self.metrics.observe_end(live, "abort")
        self._post(live, event)

    def _post(self, live: _Live, event: Event) -> None:
        self._outbox.append((live.stream.queue, event))

    def _flush(self) -> None:
        """Hand the step's events to the event loop in one wake-up."""
        if not self._outbox:
            return
        events, self._outbox = self._outbox, []
        with contextlib.suppress(RuntimeError):          # the loop closed under a forced exit
            self._loop.call_soon_threadsafe(_deliver, events)


def _deliver(events: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, event in events:
        q.put_nowait(event)


# ----------------------------------------------------------------------------- HTTP

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
        return JSONResponse(exc.body(), status_code=exc.status)

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
            body = await read_body(request, limits.max_body_bytes)
        except ClientDisconnect:           # the client left mid-body: nothing to answer, nothing to log
            log.debug("client disconnected while sending its request body")
            return Response(status_code=499)
        params = await asyncio.to_thread(parse_body, body, served, parse)     # off the event loop
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
    max_body_bytes: int = 4 * 2**20       # a 128k-token prompt of 6-digit ids is about 1 MiB
    max_waiting: Optional[int] = None     # None: unbounded, as vLLM


async def read_body(request, limit: int) -> bytes:
    """The body, or ApiError 413 once it is known to exceed `limit` bytes (without reading the rest)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError("Content-Length is not a number")
        if int(declared) > limit:
            raise ApiError(f"the request body is {int(declared)} bytes, more than the {limit} allowed", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"the request body is more than the {limit} bytes allowed", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(data: bytes, served: ServedModel, parse=None) -> CompletionParams:
    """JSON and validation of a completion body (run on a worker thread). Any malformed body,
    however it is malformed, is ApiError 400."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise ApiError("the request body nests too deeply") from None
    except ValueError as e:          # JSONDecodeError, bad UTF-8, an integer over 4300 digits
        raise ApiError(f"the request body is not valid JSON ({excerpt(str(e), 120)})") from None
    try:
        return (parse or parse_completion)(body, served)
    except ApiError:
        raise
    except (RecursionError, ValueError, TypeError, OverflowError) as e:   # e.g. comparing nested values
        raise ApiError(f"malformed request body ({type(e).__name__})") from None


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


@dataclass
class Completion:
    """The OpenAI completion (or chat completion) object, built up token by token. Without a
    tokenizer `text` holds the token ids as decimal numbers separated by spaces; with one, the
    decoded text (an id beyond the tokenizer's vocabulary, which only a model with random weights
    samples, reads `<id>`). `token_ids` holds the ids as integers (completions only)."""

    model: str
    prompt_tokens: int
    chat: bool = False
    tokenizer: Any = None
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    cached_tokens: int = 0
    finish_reason: Optional[str] = None

    def add(self, event: Event) -> str:
        """Record a token event; returns its text piece."""
        self.tokens.append(event.token)
        piece = self._piece()
        self.text += piece
        self.cached_tokens, self.finish_reason = event.cached_tokens, event.finish_reason
        return piece

    def _piece(self) -> str:
        token = self.tokens[-1]
        tok = self.tokenizer
        if tok is None:
            return ("" if len(self.tokens) == 1 else " ") + str(token)
        if token >= tok.vocab_size:
            return f"<{token}>"
        # decode a short window, so a character spread over several byte tokens comes out whole
        window = [t for t in self.tokens[-6:] if t < tok.vocab_size]
        return tok.decode(window)[len(tok.decode(window[:-1])):]

    def head(self, chunk: bool = True) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        n = len(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def choice(self, text: str, token_ids: list[int]) -> dict:
        if self.chat:
            delta = {"content": text} if len(self.tokens) > 1 else {"role": "assistant", "content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": self.finish_reason}
        return {"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
                "finish_reason": self.finish_reason, "stop_reason": None}

    def whole(self) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
                      "finish_reason": self.finish_reason}
        else:
            choice = self.choice(self.text, self.tokens)
        return {**self.head(chunk=False), "choices": [choice], "usage": self.usage()}


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
    if drain is None:
        return f"kvtwin serve: stopped; {served}"
    done = counts["finished"] - drain["finished"]
    aborted = counts["aborted"] - drain["aborted"]
    return (f"kvtwin serve: shut down on {drain['signal']}: {drain['in_flight']} request(s) in flight, "
            f"{done} finished during the grace period, {aborted} aborted; {served}")


# ----------------------------------------------------------------------------- CLI

def serve_parser() -> argparse.ArgumentParser:
    from engine.hardware import add_device_args

    p = argparse.ArgumentParser(prog="simrun serve",
                                description="Serve the paged engine behind an OpenAI-compatible HTTP API.")
    p.add_argument("--model", help="catalog model name (e.g. tiny) or a Hugging Face folder")
    p.add_argument("--scenario", type=Path, help="take model, device and engine settings from a scenario "
                                                   "(its workload is ignored)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override an engine setting, e.g. --set engine.max_num_seqs=8 (repeatable)")
    add_device_args(p)
    p.add_argument("--catalog-device", help="device catalog entry that sizes the KV pool "
                                            "(default: cpu, or the entry matching the visible GPU)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port, 0-65535 (0: any free port)")
    p.add_argument("--max-body-bytes", type=positive_int, default=ServeLimits.max_body_bytes,
                   help="larger request bodies get HTTP 413 (default %(default)s)")
    p.add_argument("--max-waiting", type=positive_int, default=None,
                   help="answer HTTP 429 while this many requests wait for the engine (default: no limit)")
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model)")
    p.add_argument("--eos-token-id", type=int, default=None,
                   help="stop a request at this token unless it sets ignore_eos (default: the folder's "
                        "config.json eos_token_id; catalog models have none, so they run to max_tokens)")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer.json or a transformers folder: text prompts, "
                                                   "/v1/chat/completions and decoded answers (default: the "
                                                   "model folder's, when it has one)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature for every request (0 = greedy)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM; "
                        "the rest are then aborted")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return p


def serve_main(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    from sim.errors import UserError
    from sim.extras import require

    require("simrun serve", "torch", "fastapi", "uvicorn")

    if not args.model and not args.scenario:
        raise UserError("give --model NAME|PATH (or --scenario FILE)")
    from engine.hardware import pick_device, set_cpu_threads

    device = pick_device(args.device)
    set_cpu_threads(device, args.threads)
    scenario = serving_scenario(args, device)
    sock = bind_socket(args.host, args.port)      # before the model build: a taken port fails at once
    engine, version = _start_engine(scenario, device, args)
    served = engine.served
    host, port = sock.getsockname()[:2]
    print(f"kvtwin serve: {served.name} on {device}, {engine.runner.num_blocks} KV blocks of "
          f"{scenario.engine.block_size} tokens, max_model_len {served.max_model_len}; "
          f"listening on http://{_url_host(host)}:{port}", file=sys.stderr, flush=True)
    limits = ServeLimits(args.max_body_bytes, args.max_waiting)
    _run_http(build_app(engine, version, limits), engine, args, sock)
    return 0 if engine.error is None else 1


def serving_scenario(args, device: str):
    """Model, device and engine settings; a scenario file's workload plays no part."""
    from sim.scenario import apply_overrides, expand_variants, load_raw, validate_scenario

    base_dir = Path.cwd()
    raw: dict[str, Any] = {}
    if args.scenario:
        raw = load_raw(args.scenario)
        base_dir = args.scenario.parent.resolve()
    if args.model:
        raw["model"] = ({"hf_config": str(Path(args.model).resolve())} if Path(args.model).exists()
                        else args.model)
    if args.catalog_device or "device" not in raw:
        from engine.hardware import catalog_device_for_cuda

        raw["device"] = args.catalog_device or ("cpu" if device == "cpu" else catalog_device_for_cuda())
    if device == "cpu" and not args.scenario:    # a pool and batch a CPU turns over quickly
        raw["engine"] = {"num_blocks": 1024, "max_num_seqs": 32, "max_num_batched_tokens": 512}
    scenario = validate_scenario(apply_overrides(raw, args.overrides), base_dir=base_dir)
    variants = expand_variants(scenario, base_dir)
    if len(variants) > 1:
        from sim.errors import UserError

        raise UserError(f"{args.scenario} has variants ({', '.join(variants)}); the server runs one "
                        f"configuration: write it as its own scenario")
    return scenario


def _start_engine(scenario, device: str, args) -> tuple[EngineLoop, str]:
    """Build the model and pool, pass the smoke request (and warm up on GPU), wrap them."""
    from engine.replay import new_scheduler, smoke_check, warm_up
    from engine.runner import ModelRunner
    from sim.predict import kvtwin_version

    runner = ModelRunner.from_scenario(scenario, device, temperature=args.temperature)
    smoke_check(scenario, runner)
    if runner.device.type == "cuda":
        warm_up(scenario, runner)              # compile the kernels before the first client waits
    eos = args.eos_token_id if args.eos_token_id is not None else _config_eos(args.model)
    served = ServedModel(args.served_model_name or args.model or scenario.model.name,
                         args.model or scenario.model.name, scenario.model.vocab_size,
                         runner.max_model_len, args.temperature, eos, _tokenizer(args, scenario.model.vocab_size))
    return EngineLoop(new_scheduler(scenario, runner.num_blocks), runner, served), kvtwin_version()


def _tokenizer(args, vocab_size: int):
    """--tokenizer, else a model folder's tokenizer.json; None serves token ids only."""
    from sim.datasets import DatasetError, text_tokenizer
    from sim.errors import UserError

    path = args.tokenizer
    if path is None and args.model and (Path(args.model) / "tokenizer.json").is_file():
        path = Path(args.model)
    if path is None:
        return None
    try:
        tok = text_tokenizer(path)
    except DatasetError as e:
        raise UserError(f"--tokenizer: {e}") from None
    if tok.vocab_size > vocab_size:
        raise UserError(f"--tokenizer {path}: {tok.vocab_size} tokens, more than the model's vocabulary "
                        f"({vocab_size}): its ids would not be valid prompts")
    return tok


def _config_eos(model: Optional[str]) -> Optional[int]:
    """A Hugging Face folder's eos_token_id (the first, when it lists several)."""
    config = Path(model or "") / "config.json"
    if not model or not config.is_file():
        return None
    cfg = read_json(config, "Hugging Face config.json")
    eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None


def port_number(text: str) -> int:
    """argparse `type=` for --port."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535)")
    return port


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a whole number >= 1")
    return value


def bind_socket(host: str, port: int):
    """A TCP socket bound to host:port (not yet listening: uvicorn listens once the app is ready)."""
    import socket

    from sim.errors import UserError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host {excerpt(host)}: not an address this machine can listen on ({e})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}"
                        + (" (another server holds the port; pick another --port)"
                           if getattr(e, "errno", None) == errno.EADDRINUSE else "")) from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _run_http(app, engine: EngineLoop, args, sock=None) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            engine.begin_drain(signal.Signals(sig).name, args.shutdown_grace)
            super().handle_exit(sig, frame)

    # The engine aborts what is left after the grace period, which ends those responses;
    # uvicorn's own timeout is only a backstop for a connection that still hangs on.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace + 5)
    # uvicorn re-raises the signal it handled once it has shut down; by then the drain is
    # done and reported, so these handlers let the process exit with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    Server(config).run(sockets=[sock] if sock is not None else None)
