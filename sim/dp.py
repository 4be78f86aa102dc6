"""Data-parallel engines as vLLM runs them (`--data-parallel-size`), what the simulator builds from them.

vLLM 0.19 (the releases where they differ: sim/core/vllm_versions.py), docs/vllm_semantics.md
"Data parallel" walks through the code:

- Every dp rank is a whole engine: its own scheduler with the full max_num_seqs and
  max_num_batched_tokens, its own KV pool (vllm/config/parallel.py sets nothing per rank).
- Placement (`DPLoadBalancer`): each API server process (`--api-server-count`, default the dp
  size from 0.15) holds its own [waiting, running] count per rank and sends a request to the
  lowest `waiting * 4 + running`, scanning from its own start rank, then adds the API server
  count to that rank's waiting (v1/engine/core_client.py DPLBAsyncMPClient.
  get_core_engine_for_request). Those counts are overwritten whenever the DP coordinator
  publishes the ranks' own counts: at most every 100 ms while they change, else every 5 s
  (v1/engine/coordinator.py). Only DPEngineCoreProc ranks send counts (v1/engine/core.py
  `_maybe_publish_request_counts`): a dense model's independent ranks never do, so their API
  servers balance on their own increments alone, reset to zero every 5 s.
- Lockstep (`dp_ranks_in_lockstep`; the simulator's `_lockstep_loop`): a MoE model's ranks run
  DPEngineCoreProc.run_busy_loop, a step on every rank (a one-token dummy batch where a rank has
  nothing to run) joined by the MoE layers' collectives.
- Padding (`DPPadding`): the ranks agree each step on the tokens they run (v1/worker/dp_utils.py
  coordinate_batch_across_dp): all pad to the largest rank's when every rank's batch runs a CUDA
  graph, else each runs its own (0.12-0.16: padded whenever CUDA graphs are on).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

from sim.core import vllm_versions
from sim.routers.config import DEPLOYED_ROUTERS

# v1/engine/coordinator.py (0.12-0.21): DPCoordinator's min_stats_update_interval_ms, the 5 s it
# republishes unchanged counts after, and the 50 ms it waits for the rest of a step's counts
STATS_INTERVAL_S = 0.1
UNCHANGED_REPUBLISH_S = 5.0
SETTLE_S = 0.05
# v1/engine/core_client.py DPLBAsyncMPClient: score = waiting * WAITING_WEIGHT + running
WAITING_WEIGHT = 4
# config/vllm.py _set_cudagraph_sizes: the largest captured batch is min(2 x max_num_seqs, 512,
# max_num_batched_tokens), sizes 1, 2, 4, then steps of 8 to 256 and of 16 beyond
GRAPH_SIZE_CAP = 512


@dataclass(frozen=True)
class DPLayout:
    """How one scenario's data-parallel ranks are run: which step together, which share a load
    balancer (the groups a cluster router picks among), how many API servers balance each group."""

    dp: int
    lockstep: bool            # DPEngineCoreProc: ranks step together
    balancing: str            # internal | hybrid | external, as vLLM resolves it
    group_size: int           # ranks one load balancer spreads requests over (1: external)
    api_servers: int          # API server processes per group

    @classmethod
    def for_scenario(cls, scenario) -> "DPLayout":
        par, version = scenario.parallelism, scenario.engine.vllm_version
        dp = par.dp
        local = par.dp_local or dp
        balancing = par.dp_load_balancing
        # engine/arg_utils.py (0.19): hybrid with one rank per node is external; on one node, internal
        if balancing == "hybrid" and local == 1:
            balancing = "external"
        elif balancing == "hybrid" and local == dp:
            balancing = "internal"
        group = {"internal": dp, "hybrid": local, "external": 1}[balancing]
        servers = par.api_servers or vllm_versions.default_api_servers(version, group)
        return cls(dp=dp, lockstep=dp > 1 and vllm_versions.dp_ranks_in_lockstep(version, scenario.model.is_moe),
                   balancing=balancing, group_size=group, api_servers=servers)

    @property
    def balanced(self) -> bool:
        """Do vLLM's own API servers pick the rank (else the cluster router does)?"""
        return self.dp > 1 and self.group_size > 1

    def describe(self) -> dict:
        return {"ranks": self.dp, "lockstep": self.lockstep, "load_balancing": self.balancing,
                "ranks_per_balancer": self.group_size, "api_servers": self.api_servers}


class DPLoadBalancer:
    """vLLM's internal DP load balancer over one group of ranks, with the coordinator's
    publications of their counts modelled as it makes them (v1/engine/coordinator.py,
    process_input_socket): the ranks send (waiting, running) after a step that changed them
    (`step_ended`); the coordinator sends the API servers the counts at most every 100 ms,
    taken before the latest step's (its `last_step_counts`), or, when no newer step follows,
    50 ms after the last change; unchanged counts go out every 5 s. A publication replaces each
    API server's counts, its own increments included. Requests go to the API servers in turn
    (the kernel's spreading of connections over the server processes is not vLLM's code)."""

    def __init__(self, ranks: list, api_servers: int, publishes: bool):
        n = len(ranks)
        self.ranks, self.publishes = ranks, publishes
        self.views = [[[0, 0] for _ in range(n)] for _ in range(api_servers)]
        self.starts = [(n * i) // api_servers for i in range(api_servers)]
        self._turn = 0
        self._held: tuple = ((0, 0),) * n          # the counts the coordinator holds
        self._inbox: list[tuple[float, tuple]] = []  # (time, counts) received since it last published
        self._last_sent: tuple = self._held
        self._last_publish = 0.0
        self.publications = 0

    def pick(self, now: float):
        """The rank an arriving request goes to (DPLBAsyncMPClient.get_core_engine_for_request)."""
        self._catch_up(now)
        server = self._turn
        self._turn = (server + 1) % len(self.views)
        view, start, n = self.views[server], self.starts[server], len(self.ranks)
        best, best_score = 0, None
        for i in range(n):
            index = (start + i) % n
            waiting, running = view[index]
            score = waiting * WAITING_WEIGHT + running
            if best_score is None or score < best_score:
                best, best_score = index, score
        view[best][0] += len(self.views)       # the local increment, scaled by the client count
        return self.ranks[best]

    def step_ended(self, now: float, counts: tuple) -> None:
        """The ranks' (waiting, running) after a step; sent to the coordinator when they changed."""
        if self.publishes and counts != self._last_sent:
            self._inbox.append((now, counts))
            self._last_sent = counts

    def _catch_up(self, now: float) -> None:
        """Apply every publication the coordinator made by `now`."""
        while True:
            when, counts, consumed = self._next_publication()
            if when > now:
                return
            if consumed:
                self._held = self._inbox[consumed - 1][1]
                del self._inbox[:consumed]
            for view in self.views:
                for index, (waiting, running) in enumerate(counts):
                    view[index][0], view[index][1] = waiting, running
            self._last_publish = when
            self.publications += 1

    def _next_publication(self) -> tuple[float, tuple, int]:
        """(when, the counts it carries, messages it uses up) of the coordinator's next publication,
        given the messages received so far (those after `now` cannot change one due by `now`)."""
        inbox, due = self._inbox, self._last_publish + STATS_INTERVAL_S
        if not inbox:
            return self._last_publish + UNCHANGED_REPUBLISH_S, self._held, 0
        before = bisect.bisect_left([t for t, _ in inbox], due)
        if before >= 2:
            # a newer step's counts arrived after the first change: the snapshot taken before
            # the latest goes out when the interval is up (the latest stays pending)
            return due, inbox[before - 2][1], before - 1
        first = before - 1 if before == 1 else 0
        quiet = max(inbox[first][0] + SETTLE_S, due)
        if first + 1 < len(inbox) and inbox[first + 1][0] < quiet:
            return inbox[first + 1][0], inbox[first][1], first + 1
        return quiet, inbox[first][1], first + 1


class DPGroup:
    """The ranks one load balancer spreads requests over, as a cluster router sees them: one
    endpoint (its built-in routers read `outstanding_tokens`, `kv.find_cached_prefix`, `index`)."""

    def __init__(self, index: int, ranks: list, balancer: DPLoadBalancer, clock):
        self.index, self.ranks, self.balancer, self._clock = index, ranks, balancer, clock
        self.kv = _GroupCache(ranks)

    @property
    def outstanding_tokens(self) -> int:
        return sum(rank.outstanding_tokens for rank in self.ranks)

    def submit(self, req) -> None:
        self.balancer.pick(self._clock()).submit(req)


class _GroupCache:
    """A group's prefix cache as a router's KV-event view sees it: the longest hit of any rank."""

    def __init__(self, ranks: list):
        self.ranks = ranks

    def find_cached_prefix(self, req):
        return max((rank.kv.find_cached_prefix(req) for rank in self.ranks), key=lambda found: found[1])


@dataclass(frozen=True)
class DPPadding:
    """The tokens each rank of a lockstep step runs its GEMMs and MoE layers at
    (v1/worker/dp_utils.py coordinate_batch_across_dp; gpu_model_runner.py
    _determine_batch_execution_and_padding): a batch runs a CUDA graph when it has at most
    `graph_max` tokens (0: CUDA graphs off); the ranks pad to the largest when all of them do
    (0.17 on) or whenever graphs are on (0.12-0.16)."""

    graph_max: int = GRAPH_SIZE_CAP
    only_when_all_graphed: bool = True

    @classmethod
    def for_scenario(cls, scenario) -> "DPPadding":
        e, par = scenario.engine, scenario.parallelism
        # config/compilation.py (0.19): DeepEP high-throughput with dp > 1 turns CUDA graphs off
        graphs = not e.enforce_eager and not (par.all2all_backend == "deepep_high_throughput" and par.dp > 1)
        return cls(graph_max=largest_graph(scenario.max_num_seqs, scenario.max_num_batched_tokens) if graphs else 0,
                   only_when_all_graphed=vllm_versions.has(e.vllm_version, "dp_pad_only_under_graphs"))

    def run_tokens(self, tokens: list[int]) -> list[int]:
        """Per rank, the tokens it runs, from those it scheduled (a dummy batch: 1)."""
        top = max(tokens)
        if self.graph_max and (not self.only_when_all_graphed or top <= self.graph_max):
            return [top] * len(tokens)
        return list(tokens)


def largest_graph(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The largest CUDA-graph batch vLLM captures by default (config/vllm.py _set_cudagraph_sizes,
    0.12-0.21): the largest of 1, 2, 4, 8, 16, ..., 248, 256, 272, ... up to min(2 x max_num_seqs,
    512, max_num_batched_tokens)."""
    cap = min(2 * max_num_seqs, GRAPH_SIZE_CAP, max_num_batched_tokens)
    if cap >= 256:
        return 256 + (cap - 256) // 16 * 16
    if cap >= 8:
        return cap // 8 * 8
    return max(size for size in (1, 2, 4) if size <= cap)


def engine_peak_running(steps, groups: list[list[int]]) -> list[int]:
    """Per engine (its ranks' indices), the most requests running on all its ranks at once, as
    vLLM's vllm:num_requests_running summed over the engine label reads it: a step's count holds
    from its start to its end (a frame of recorded steps, one row per step)."""
    out = []
    replica = steps["replica"].to_numpy()
    for ranks in groups:
        mine = steps[[r in ranks for r in replica]] if len(ranks) > 1 else steps[replica == ranks[0]]
        if mine.empty:
            out.append(0)
            continue
        # ends before starts at the same moment: a step ending as the next starts does not overlap it
        events = sorted([(t, 0, -n) for t, n in zip(mine["end_s"], mine["running"])]
                        + [(t, 1, n) for t, n in zip(mine["start_s"], mine["running"])])
        level = peak = 0
        for _, _, delta in events:
            level += delta
            peak = max(peak, level)
        out.append(int(peak))
    return out


def remote_ranks(experts: int, top_k: int, ep: int) -> float:
    """Expected ranks other than its own that hold at least one of a token's top_k experts, with
    experts / ep whole experts on each of ep ranks (uniform routing): what an all-to-all kernel
    sends a token to."""
    if ep <= 1:
        return 0.0
    per_rank = experts // ep
    miss = 1.0
    for i in range(top_k):          # C(E - E/ep, k) / C(E, k): none of the k on a given rank
        miss *= max(experts - per_rank - i, 0) / (experts - i)
    return (ep - 1) * (1.0 - miss)


def check_router(scenario) -> Optional[str]:
    """A deployed router reads per-engine state a group of balanced ranks does not model."""
    layout = DPLayout.for_scenario(scenario)
    groups = scenario.cluster.most_replicas * (layout.dp // layout.group_size)
    if layout.balanced and groups > 1 and scenario.cluster.router in DEPLOYED_ROUTERS:
        return (f"cluster.router: {scenario.cluster.router} in front of data-parallel engines whose own API "
                f"servers balance their ranks (parallelism.dp {layout.dp}, dp_load_balancing {layout.balancing}) "
                f"is not modelled; use parallelism.dp_load_balancing: external (the router picks each rank) "
                f"or a built-in router (round_robin, least_outstanding_tokens, prefix_aware)")
    return None
