"""The engine thread of `simrun serve`: the shared Scheduler and ModelRunner, fed by commands
from the event loop, handing each step's tokens back into per-request asyncio queues."""

import asyncio
import concurrent.futures
import contextlib
import itertools
import math
import queue
import sys
import threading
import traceback
import time
from dataclasses import dataclass
from typing import Optional

from engine.serve.metrics import ServerMetrics
from engine.serve.protocol import ApiError, CompletionParams, Event, ServedModel
from sim.core.request import Request

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
        # every request submitted ends finished, aborted, rejected or failed (shutdown_report checks it)
        self.counts = {"submitted": 0, "finished": 0, "aborted": 0, "rejected": 0, "failed": 0}
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
        self.counts["submitted"] += 1         # the one key this thread writes
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
            try:
                self._add(arg)
            except Exception as e:              # answer it before the engine goes down (nothing hangs)
                if arg.req.id not in self.live:
                    self.counts["failed"] += 1
                    self._post(arg, Event("error", message=f"engine error: {e!r}"))
                raise
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
        from sim.core.scheduler_variants import make_scheduler

        old = self.scheduler
        if self.live or old.num_running or old.num_waiting:
            return False
        kv = old.kv
        fresh_kv = kv.empty_copy()
        fresh_kv.stats = kv.stats
        fresh = make_scheduler(old.config, fresh_kv)
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
