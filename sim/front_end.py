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

The same loop streams the outputs: AsyncLLM's output handler task (vllm 0.11.0 and 0.19.1
vllm/v1/engine/async_llm.py `_run_output_handler`: `output_handler`) takes each engine step's
EngineCoreOutputs off the engine core's socket and runs `OutputProcessor.process_outputs` over them
(vllm/v1/engine/output_processor.py: per request its detokenizer's `update` and a RequestOutput put
in the request's RequestOutputCollector), and each request's stream, a task of its own
(`chat_completion_stream_generator`, vllm 0.11.0 vllm/entrypoints/openai/serving_chat.py), wakes on
that collector and serializes one SSE chunk, all on the asyncio loop that also takes new requests.
kvtwin prices a step's outputs as one job on that loop, due at the step's end (`outputs`): a fixed
`step_s` per engine step (engine.front_end_step_s: the handler's pass over one step's message) plus
`token_s` per request in the step (engine.front_end_token_s: a prefill chunk that ends no prompt,
which vLLM sends nothing for, counted too). A collector merges the outputs put into it while its
stream has not run (`RequestOutputCollector.put`: "merged if the producer gets ahead of the
consumer"), and the handler drains every step already queued before it yields (`await
outputs_queue.get()` returns at once while one is queued; it yields between slices of
VLLM_V1_OUTPUT_PROC_CHUNK_SIZE only within a step): so when the loop reaches a replica's outputs,
its steps already due by then stream as one round, `step_s` per step plus `token_s` per request of
the largest step, one chunk per stream (`_serve`). A loop that falls behind therefore streams fewer,
larger chunks rather than queueing every step's chunks, and does not fall behind the engine for
good through the streaming (only where the steps' fixed `step_s` outlasts the steps themselves, as
vLLM's handler would). Rounds and intakes are otherwise served first come, first served, on the
server free first: a round delays the intake of the requests handed over after it, and its steps'
tokens reach the client when it is done (`delivered`, StepRecorder.token_times). A round is served
only once every step due before the next intake is known (`admit` serves those due by its time; the
simulator reports a step when it is planned, a leap's steps at once), so a leap and its steps one
by one give the same answer; a step due by a round's start but reported after it joins that round.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Optional

MAX_FRONT_END_S = 1.0      # the scenario field's bound: a second per request is no API server's
MAX_FRONT_END_TOKEN_S = 0.01   # and per streamed token: 10 ms is 100 tokens/s through one loop
MAX_FRONT_END_STEP_S = 0.01    # and per engine step's outputs: 10 ms is longer than a decode step


class FrontEnd:
    """`servers` API-server processes taking requests first come, first served, `service_s` each,
    and streaming each step's outputs at `step_s` per step plus `token_s` per request in the step
    (both 0: none priced), a replica's steps due by the time the loop reaches them in one job."""

    __slots__ = ("service_s", "token_s", "step_s", "_free", "_heads", "_pending", "_done", "_rounds")

    def __init__(self, servers: int, service_s: float, token_s: float = 0.0, step_s: float = 0.0):
        if servers < 1:
            raise ValueError(f"a front end needs at least one API server, got {servers}")
        if not 0 < service_s <= MAX_FRONT_END_S:
            raise ValueError(f"front-end service time {service_s!r} s outside (0, {MAX_FRONT_END_S}]")
        if not 0 <= token_s <= MAX_FRONT_END_TOKEN_S:
            raise ValueError(f"front-end time per token {token_s!r} s outside [0, {MAX_FRONT_END_TOKEN_S}]")
        if not 0 <= step_s <= MAX_FRONT_END_STEP_S:
            raise ValueError(f"front-end time per step {step_s!r} s outside [0, {MAX_FRONT_END_STEP_S}]")
        self.service_s, self.token_s, self.step_s = service_s, token_s, step_s
        self._free = [0.0] * servers      # a heap: when each server is next free
        self._heads: list = []            # a heap: (due, replica) of each replica's first step not served
        self._pending: dict[int, deque] = {}   # per replica, its steps not served: (due, requests)
        self._done: dict[int, list] = {}  # per replica, in its steps' order: when each step's job is done
        self._rounds: dict[int, list] = {}     # per replica, its latest round: [start, end, requests]

    @property
    def streams(self) -> bool:
        """Whether the steps' outputs are priced (the simulator reports its steps only then)."""
        return self.token_s > 0 or self.step_s > 0

    def admit(self, t: float) -> float:
        """A request handed over at `t` (calls in order of t): when it leaves for the engine."""
        if self._heads:
            self._serve(t)
        free = self._free[0]
        end = (t if t > free else free) + self.service_s
        heapq.heapreplace(self._free, end)
        return end

    def outputs(self, replica: int, ends, requests: int) -> None:
        """Steps of `replica` (in its order) ending at `ends`, each of `requests` requests: their
        output jobs (served at the next `admit` after them, or by `delivered`)."""
        pending = self._pending.get(replica)
        if pending is None:
            pending = self._pending[replica] = deque()
        for end in ends:
            if not pending:
                heapq.heappush(self._heads, (end, replica))      # (one due time: the lower replica first)
            pending.append((end, requests))

    def _serve(self, until: float) -> None:
        """Serve the output jobs due by `until`, in order, each on the server free first. A job is a
        round of the replica's streams: its steps due by its start (and by `until`), `step_s` each
        and one chunk per request of the largest; a step due by the start of the replica's previous
        round, reported only after it, was that round's (its chunk merged there, its tokens out at
        that round's end): it adds only its pass and its requests beyond that round's."""
        heads, free, done, rounds = self._heads, self._free, self._done, self._rounds
        step_s, token_s = self.step_s, self.token_s
        while heads and heads[0][0] <= until:
            due, replica = heapq.heappop(heads)
            pending, last = self._pending[replica], rounds.get(replica)
            start = free[0]
            start = due if due > start else start
            limit = start if start < until else until
            late = extra = 0
            if last is not None:
                merged = last[0] if last[0] < limit else limit
                while pending and pending[0][0] <= merged:
                    n = pending.popleft()[1] - last[2]
                    late += 1
                    extra = n if n > extra else extra
            steps = requests = 0
            while pending and pending[0][0] <= limit:
                n = pending.popleft()[1]
                steps += 1
                requests = n if n > requests else requests
            end = start + (late + steps) * step_s + (extra + requests) * token_s
            heapq.heapreplace(free, end)
            served = done.setdefault(replica, [])
            if late:
                served.extend([last[1]] * late)
                last[2] += extra
            if steps:
                served.extend([end] * steps)
                rounds[replica] = [start, end, requests]
            if pending:
                heapq.heappush(heads, (pending[0][0], replica))

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
        return cls(layout.api_servers * groups * scenario.cluster.replicas, service, front_end_token_s(scenario),
                   front_end_step_s(scenario))


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


def front_end_step_s(scenario) -> float:
    """engine.front_end_step_s resolved as front_end_s is (the family's `front_end_step_s` for the
    engine generation where unset on a vLLM server without a device profile, else 0); only a
    scenario with a front end (front_end_s above 0) streams through it."""
    return _resolved(scenario, "front_end_step_s")


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
