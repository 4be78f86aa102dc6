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

What it does not price: the per-token streaming work of the same loop (the output handler's
detokenization, `vllm/v1/engine/output_processor.py` `process_outputs`, and one SSE chunk per token in
`chat_completion_stream_generator`), which competes with intake on the same loop (docs/fidelity.md
"The API-server front end" says why it is left out).
"""
from __future__ import annotations

import heapq
from typing import Optional

MAX_FRONT_END_S = 1.0      # the scenario field's bound: a second per request is no API server's


class FrontEnd:
    """`servers` API-server processes taking requests first come, first served, `service_s` each."""

    __slots__ = ("service_s", "_free")

    def __init__(self, servers: int, service_s: float):
        if servers < 1:
            raise ValueError(f"a front end needs at least one API server, got {servers}")
        if not 0 < service_s <= MAX_FRONT_END_S:
            raise ValueError(f"front-end service time {service_s!r} s outside (0, {MAX_FRONT_END_S}]")
        self.service_s = service_s
        self._free = [0.0] * servers      # a heap: when each server is next free

    def admit(self, t: float) -> float:
        """A request handed over at `t` (calls in order of t): when it leaves for the engine."""
        free = self._free[0]
        end = (t if t > free else free) + self.service_s
        heapq.heapreplace(self._free, end)
        return end

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
        return cls(layout.api_servers * groups * scenario.cluster.replicas, service)


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
    e = scenario.engine
    if e.front_end_s is not None:
        return float(e.front_end_s)
    if e.batching != "continuous" or e.allocation != "paged" or scenario.device.profile:
        return 0.0
    from sim.trained import front_end_default

    return front_end_default(scenario.engine_generation)
