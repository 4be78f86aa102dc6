"""vLLM's API-server front end: the time a request spends before it reaches the engine.

A vLLM server answers HTTP in its API-server process(es), not in the engine core. Per request that
process parses the HTTP body, renders the chat template and tokenizes the prompt, builds the engine
request and sends it to the engine core over ZMQ (vLLM 0.19.1
vllm/entrypoints/openai/chat_completion/serving.py `create_chat_completion` -> `render_chat_request`,
then `engine_client.generate`: vllm/v1/engine/async_llm.py `generate` -> `add_request` ->
`input_processor.process_inputs`), all on one asyncio loop per process. `--api-server-count` sets
how many such processes share the port (vllm/entrypoints/cli/serve.py `ServeSubcommand.cmd`: 1
without data parallelism, the dp size under internal load balancing; more than one runs
`run_multi_api_server`, each process its own loop). kvtwin prices that as a FIFO multi-server
queue with one service time per request ahead of the router: a request handed over at t starts
when a server is free, max(t, earliest free), and reaches the engine `service_s` later. One server
and one service time make it a closed-form recurrence (start = max(arrival, previous finish)), so
it needs no SimPy process per request. 0 = no front end (kvtwin's own engine, which the engine
replays drive in-process, has no HTTP server).

The same loop streams the outputs (`token_s`, engine.front_end_token_s): AsyncLLM's output handler
task (vllm 0.11.0 vllm/v1/engine/async_llm.py `_run_output_handler`: `output_handler`) takes each
engine step's EngineCoreOutputs off the ZMQ socket and runs `OutputProcessor.process_outputs` over
them (vllm/v1/engine/output_processor.py: per request its detokenizer's `update` and a RequestOutput
put on the request's queue), and each request's `chat_completion_stream_generator`
(vllm/entrypoints/openai/serving_chat.py) then serializes one SSE chunk for it, all on the asyncio
loop that also takes new requests. kvtwin prices a step's outputs as one job of (requests in the
step: a prefill chunk that ends no prompt, which vLLM sends nothing for, counted too) x `token_s`
on that loop, due at the step's end (`outputs`): first come, first served with the intake, on the
server free first (vLLM yields the loop between slices of VLLM_V1_OUTPUT_PROC_CHUNK_SIZE outputs;
kvtwin's job is one piece). It delays the intake of the requests handed over after it, and the
step's tokens reach the client when it is done (`delivered`, StepRecorder.token_times).
A job is served only once every job due before the next intake is known (`admit` serves those due
by its time; the simulator reports a step when it is planned, a leap's steps at once), so a leap
and its steps one by one give the same answer.
"""
from __future__ import annotations

import heapq
import math
from typing import Optional

MAX_FRONT_END_S = 1.0      # the scenario field's bound: a second per request is no API server's
MAX_FRONT_END_TOKEN_S = 0.01   # and per streamed token: 10 ms is 100 tokens/s through one loop


class FrontEnd:
    """`servers` API-server processes taking requests first come, first served, `service_s` each,
    and streaming each step's outputs at `token_s` per request in the step (0: none priced)."""

    __slots__ = ("service_s", "token_s", "_free", "_jobs", "_done")

    def __init__(self, servers: int, service_s: float, token_s: float = 0.0):
        if servers < 1:
            raise ValueError(f"a front end needs at least one API server, got {servers}")
        if not 0 < service_s <= MAX_FRONT_END_S:
            raise ValueError(f"front-end service time {service_s!r} s outside (0, {MAX_FRONT_END_S}]")
        if not 0 <= token_s <= MAX_FRONT_END_TOKEN_S:
            raise ValueError(f"front-end time per token {token_s!r} s outside [0, {MAX_FRONT_END_TOKEN_S}]")
        self.service_s, self.token_s = service_s, token_s
        self._free = [0.0] * servers      # a heap: when each server is next free
        self._jobs: list = []             # a heap of output jobs not served yet: (due, replica, seconds)
        self._done: dict[int, list] = {}  # per replica, in its steps' order: when each step's job is done

    def admit(self, t: float) -> float:
        """A request handed over at `t` (calls in order of t): when it leaves for the engine."""
        if self._jobs:
            self._serve(t)
        free = self._free[0]
        end = (t if t > free else free) + self.service_s
        heapq.heapreplace(self._free, end)
        return end

    def outputs(self, replica: int, ends, tokens: int) -> None:
        """Steps of `replica` (in its order) ending at `ends`, each of `tokens` requests:
        their output jobs (served at the next `admit` after them, or by `delivered`)."""
        seconds = tokens * self.token_s
        for end in ends:
            heapq.heappush(self._jobs, (end, replica, seconds))      # (one due time: the lower replica first)

    def _serve(self, until: float) -> None:
        """Serve the output jobs due by `until`, in order, each on the server free first."""
        jobs, free, done = self._jobs, self._free, self._done
        while jobs and jobs[0][0] <= until:
            due, replica, seconds = heapq.heappop(jobs)
            start = free[0]
            end = (due if due > start else start) + seconds
            heapq.heapreplace(free, end)
            done.setdefault(replica, []).append(end)

    def delivered(self, replica: int) -> list:
        """When each of `replica`'s steps' tokens reach the client (after the run: every job served)."""
        self._serve(math.inf)
        return self._done.get(replica, [])

    @classmethod
    def for_scenario(cls, scenario) -> Optional["FrontEnd"]:
        """The scenario's front end, None where its service time is 0: one FIFO over every API
        server of the deployment (per replica the layout's servers of each dp group; a cluster's
        replicas pooled, so their router picks among requests already through the front end)."""
        service = front_end_s(scenario)
        if service <= 0:
            return None
        from sim.dp import DPLayout

        layout = DPLayout.for_scenario(scenario)
        groups = max(1, layout.dp // max(1, layout.group_size))
        return cls(layout.api_servers * groups * scenario.cluster.replicas, service, front_end_token_s(scenario))


def front_end_s(scenario) -> float:
    """engine.front_end_s resolved: the value set; unset, on a vLLM server (continuous batching over
    a paged pool) the trained family's value for the scenario's engine generation
    (sim.trained.front_end_default, fitted with the family on the public runs: 0 where it has none)
    under the datasheet, tables and trained sources alike, else 0. Each of those sources' error band
    is measured with this front end in the replays (docs/fidelity.md), so an answer and its band
    describe the same server. A device profile (a calibration of your own engine or vLLM runs) leaves
    it at 0: the calibration replays without it and fits the server's own host and API-server terms
    (validate/vllm_fit.py). kvtwin's own engine has no API server: its replays set 0
    (validate/run.py `synchronous`)."""
    return _resolved(scenario, "front_end_s")


def front_end_token_s(scenario) -> float:
    """engine.front_end_token_s resolved as front_end_s is (the family's `front_end_token_s` for the
    engine generation where unset on a vLLM server without a device profile, else 0); only a
    scenario with a front end (front_end_s above 0) streams through it."""
    return _resolved(scenario, "front_end_token_s")


def _resolved(scenario, name: str) -> float:
    """engine.`name` where set; unset, the family's fitted value on a vLLM server (continuous
    batching over a paged pool) without a device profile, else 0."""
    e = scenario.engine
    value = getattr(e, name)
    if value is not None:
        return float(value)
    if e.batching != "continuous" or e.allocation != "paged" or scenario.device.profile:
        return 0.0
    from sim.trained import front_end_default

    return front_end_default(scenario.engine_generation, name)
