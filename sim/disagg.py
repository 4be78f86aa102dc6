"""Prefill/decode disaggregation in the SimPy model: vLLM's P/D serving with NixlConnector.

A request goes as vLLM's disaggregation proxy sends it (tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py, vllm 0.19): first to a prefill engine (kv_role kv_producer) with max_tokens=1,
then, once that answers, to a decode engine (kv_consumer), which streams the answer the client
sees. So the client's first token comes from the decode engine, after the prefill, the KV read and
one decode step (TTFT includes all three). What each side does (vllm/distributed/kv_transfer/
kv_connector/v1/nixl_connector.py and vllm/v1/core/sched/scheduler.py, 0.19):

- prefill: the request is prefilled and samples one token; NixlConnectorScheduler.request_finished
  then delays freeing its blocks (delay_free_blocks) until the decode side has read them, or
  VLLM_NIXL_ABORT_REQUEST_TIMEOUT passed (`transfer_timeout_s`). Its max_num_seqs seat frees at once.
- decode: get_num_new_matched_tokens says the whole prompt (less any local prefix hit) loads
  asynchronously; the scheduler allocates its blocks (it waits, first in line, while they do not
  fit: the back-pressure) and parks it in WAITING_FOR_REMOTE_KVS, taking no seat and no token
  budget, while the blocks are read. Then it becomes an ordinary waiting request with every
  prompt token computed but the last (`_update_waiting_for_remote_kv`), which it recomputes for
  the logits of its first output token, and decodes with no prefill of its own.

Modelled, not in vLLM's code: the read starts as soon as the blocks are allocated (vLLM's worker
starts it with the next step); transfers into one decode engine share its link equally (a fluid
fair share, `SharedLink`); the busiest GPU of the pair bounds a transfer (disagg_config.
transfer_shard_bytes). A read that times out (the prefill engine freed the KV) makes the decode
engine recompute the prompt. The engines run the reference path (no leaps): a decode engine's
requests arrive at transfer ends, which the leap planner does not foresee.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import simpy

from sim.costmodel import IDLE_GAP_S, CostModel
from sim.core.memory import check_block_pool_supports, plan_memory
from sim.core.request import Request
from sim.core.status import REJECTED
from sim.disagg_config import SIDES, transfer_shard_bytes
from sim.errors import UserError
from sim.scenario import pool_scenario
from sim.records import RequestTable, RunRecords
from sim.router import reject_follow_ups
from sim.routers.factory import make_router
from sim.simulator import Replica, Simulation, build_replica
from sim.workload import build_requests, stream_requests


@dataclass(eq=False)          # (a key by identity: SharedLink keeps the transfers in flight in a dict)
class Transfer:
    """One request's KV on its way from a prefill engine to a decode engine."""

    prefill_leg: Request
    request: Request                      # the client's request, decoded on `decode`
    prefill: Replica
    decode: Replica
    prefill_done_s: float
    blocks: int = 0                       # blocks read (the prompt's, less a local prefix hit)
    shard_bytes: int = 0
    allocated_s: float = math.nan         # decode blocks allocated, the read starts
    done_s: float = math.nan
    expired: bool = False                 # the prefill engine freed the KV first (timeout)
    held_on_both: tuple[int, int] = (0, 0)   # blocks used (prefill, decode) as the read ends


class SharedLink:
    """A decode engine's inbound KV link: each transfer waits its latency, then the transfers in
    flight share the bandwidth equally (processor sharing); `on_done` is called at each end."""

    def __init__(self, env: simpy.Environment, bytes_per_s: float, latency_s: float):
        self.env, self.rate, self.latency = env, bytes_per_s, latency_s
        self.active: dict[Transfer, tuple] = {}       # transfer -> (bytes left, on_done)
        self.last = 0.0
        self.version = 0

    def start(self, transfer: Transfer, on_done) -> None:
        self.env.process(self._after_latency(transfer, on_done))

    def _after_latency(self, transfer: Transfer, on_done):
        yield self.env.timeout(self.latency)
        self._advance()
        self.active[transfer] = (float(transfer.shard_bytes), on_done)
        self._reschedule()

    def _advance(self) -> None:
        now = self.env.now
        if self.active:
            moved = self.rate / len(self.active) * (now - self.last)
            for t, (left, cb) in self.active.items():
                self.active[t] = (left - moved, cb)
        self.last = now

    def _reschedule(self) -> None:
        self.version += 1
        if self.active:
            least = min(left for left, _ in self.active.values())
            self.env.process(self._next_end(self.version, max(least, 0.0) * len(self.active) / self.rate))

    def _next_end(self, version: int, delay: float):
        yield self.env.timeout(delay)
        if version != self.version:
            return                        # a transfer joined or ended meanwhile: rescheduled
        self._advance()
        done = [t for t, (left, _) in self.active.items() if left <= 1e-9 * max(t.shard_bytes, 1)]
        callbacks = [self.active.pop(t)[1] for t in done]
        self._reschedule()
        for t, cb in zip(done, callbacks):
            cb(t)


@dataclass
class DisaggSimulation(Simulation):
    """The SimPy model with a prefill pool, a decode pool and the KV link (module docstring)."""

    pool_plans: dict = field(default_factory=dict)      # side -> MemoryPlan
    pool_costs: dict = field(default_factory=dict)      # side -> CostModel

    def _run(self) -> RunRecords:
        env = simpy.Environment()
        d = self.scenario.cluster.disaggregation
        self.fast = False          # the reference path: leaps cannot foresee arrivals at transfer ends
        self._next_arrival = math.inf
        self._follow_up_times: list[float] = []
        self._ended = RequestTable()
        self._sends = None         # no client on the engine's loop: disaggregation is modelled on V1 only
        self._finished = 0
        first_turns = self._first_turns()
        scenarios = {side: pool_scenario(self.scenario, side) for side in SIDES}
        self.pools: dict[str, list[Replica]] = {}
        for side in SIDES:
            start = len(self.replicas)
            self.pools[side] = [build_replica(start + i, scenarios[side], self.pool_plans[side], False, self.block_ids)
                                for i in range(d.pool(side).replicas)]
            self.replicas += self.pools[side]
        self._routers = {side: make_router(self.scenario.cluster, self.pools[side], self.scenario.seed) for side in SIDES}
        self._side = {r.index: side for side in SIDES for r in self.pools[side]}
        self._links = {r.index: SharedLink(env, d.link.bytes_per_s, d.link.latency) for r in self.pools["decode"]}
        self._awaiting: dict[int, list[Transfer]] = {r.index: [] for r in self.pools["decode"]}
        self._transfers: dict[Request, Transfer] = {}          # by prefill leg
        self._legs: dict[Request, Request] = {}                # prefill leg -> the client's request
        self._prefill_cached: dict[Request, int] = {}          # request -> its prefill leg's prefix hit
        self.transfers: list[Transfer] = []
        for replica in self.replicas:
            self._start(env, self._pool_loop(env, replica, self.pool_costs[self._side[replica.index]]))
        self._router = self
        self._autoscaler = None      # (no autoscaling with P/D: refused by the scenario checks)
        self._start_arrivals(env, first_turns)
        env.run()
        self._check_no_decode_stall()
        for replica in self.replicas:
            replica.scheduler.check_accounting()
        self._check_every_request_ended()
        self._check_transfers_ended()
        return RunRecords(self._ended, [r.recorder for r in self.replicas],
                          kv_blocks_total=self.pool_plans["decode"].usable_blocks,
                          block_size=self.scenario.engine.block_size,
                          meta={"kv_evictions": sum(r.kv.pool.evictions for r in self.replicas),
                                "disaggregation": self._meta(env.now)})

    # -- the proxy ----------------------------------------------------------------------------
    def route(self, req: Request) -> None:
        """The proxy: the prefill leg to a prefill engine (the client's request waits for it)."""
        leg = prefill_leg(req)
        reason = None
        if self.pools["prefill"][0].scheduler.refusal(leg) is None:    # (else the prefill engine refuses it)
            reason = self._decode_reject_reason(req)
        if reason is None:
            self._routers["prefill"].route(leg)
            reason = leg.reject_reason and f"prefill engine: {leg.reject_reason}"
        if reason is not None:
            req.status, req.reject_reason, req.replica = REJECTED, reason, leg.replica
            reject_follow_ups(req)
            return
        self._legs[leg] = req

    def _decode_reject_reason(self, req: Request) -> Optional[str]:
        """Why no decode engine would take the request (longer than its max_model_len, or than its
        pool): the proxy gets that engine's error, before any KV is read for it."""
        reason = self.pools["decode"][0].scheduler.refusal(req)
        return reason and f"decode engine: {reason}"

    # -- the engines --------------------------------------------------------------------------
    def _pool_loop(self, env: simpy.Environment, replica: Replica, cost_model: CostModel):
        """One engine, step by step (the simulator's reference path), priced by its pool's cost model."""
        sched, recorder = replica.scheduler, replica.recorder
        decode = self._side[replica.index] == "decode"
        last_end = -math.inf
        while True:
            batch = sched.schedule()
            if batch is None:
                replica.wakeup, replica.busy_until = env.event(), math.inf
                yield replica.wakeup
                replica.wakeup = None
                continue
            now = env.now
            kv_used, kv_cached, slack = sched.kv_figures()
            host, device = cost_model.step_time(batch, now - last_end > IDLE_GAP_S)
            replica.busy_until = now + (host + device)
            yield env.timeout(host + device)
            last_end = env.now
            recorder.record(batch, sched, now, last_end, host, device, kv_used, kv_cached, slack)
            finished = sched.finish_step(batch)
            if finished and decode:
                self._decode_finished(env, replica, finished)
            elif finished:
                self._prefill_finished(env, replica, finished)
            if decode:
                self._allocate_waiting(env, replica)

    def _prefill_finished(self, env: simpy.Environment, replica: Replica, legs: list[Request]) -> None:
        """Prefill legs answered the proxy: their requests go to a decode engine's queue."""
        for leg in legs:
            replica.outstanding_tokens -= leg.max_len
            req = self._legs.pop(leg)
            decode = self._choose_decode(req)
            transfer = Transfer(leg, req, replica, decode, env.now)
            self._transfers[leg] = transfer
            self._awaiting[decode.index].append(transfer)
            env.process(self._expire(env, transfer))
            self._allocate_waiting(env, decode)

    def _choose_decode(self, req: Request) -> Replica:
        pool = self.pools["decode"]
        decode = pool[0] if len(pool) == 1 else self._routers["decode"].choose(req)
        decode.outstanding_tokens += req.max_len      # routed there now (counted for the router)
        req.replica = decode.index
        return decode

    def _allocate_waiting(self, env: simpy.Environment, decode: Replica) -> None:
        """The decode engine's waiting requests whose KV is still remote, first in line first: blocks
        for the prompt as soon as they fit (vLLM's waiting pass), then the read starts."""
        queue = self._awaiting[decode.index]
        kv, sched = decode.kv, decode.scheduler
        while queue:
            t = queue[0]
            if t.expired:                     # the prefill engine gave up: recompute here
                queue.pop(0)
                self._submit(decode, t.request)
                continue
            if len(sched.running) >= sched.config.max_num_seqs:
                return                        # vLLM's waiting pass does not run with every seat taken
            req = t.request
            hits, hit_tokens = kv.find_cached_prefix(req)
            if not kv.allocate_slots(req, req.prompt_len - hit_tokens, hits, gate_tokens=req.prompt_len):
                return                        # back-pressure: the prefill engine keeps holding the KV
            queue.pop(0)
            t.allocated_s = env.now
            t.blocks = len(req.blocks) - hit_tokens // kv.block_size     # (the blocks read from the prefill engine)
            t.shard_bytes = transfer_shard_bytes(self.scenario, t.blocks)
            self._links[decode.index].start(t, lambda done, env=env: self._read_done(env, done))

    def _read_done(self, env: simpy.Environment, t: Transfer) -> None:
        """The decode engine has the prompt's KV: the prefill engine frees it, the request waits to decode."""
        t.done_s = env.now
        t.held_on_both = (t.prefill.kv.num_used_blocks, t.decode.kv.num_used_blocks)
        self._release_prefill(t)
        t.request.kv_transfer = "receive"
        self._prefill_cached[t.request] = t.prefill_leg.num_cached_tokens
        self._submit(t.decode, t.request)
        self.transfers.append(t)

    def _expire(self, env: simpy.Environment, t: Transfer):
        yield env.timeout(self.scenario.cluster.disaggregation.transfer_timeout_s)
        if math.isnan(t.allocated_s) and not t.expired:
            t.expired = True
            self._release_prefill(t)
            self.transfers.append(t)
            self._allocate_waiting(env, t.decode)

    def _release_prefill(self, t: Transfer) -> None:
        leg = t.prefill_leg
        del self._transfers[leg]
        t.prefill.kv.free(leg)
        leg.drop_block_hashes()
        wake(t.prefill)                       # blocks freed: its waiting requests may fit now

    def _submit(self, decode: Replica, req: Request) -> None:
        decode.outstanding_tokens -= req.max_len      # (submit counts it again)
        decode.submit(req)
        if req.status is REJECTED:                    # (checked at the proxy: only a safety net)
            self._prefill_cached.pop(req, None)
            self._route_ended(req)

    def _route_ended(self, req: Request) -> None:
        """A request the decode engine refused has ended: recorded (with its later turns), slot freed."""
        turn: Optional[Request] = req
        while turn is not None:
            self._ended.add(turn)
            turn = turn.next_turn
        self._client.done()

    def _decode_finished(self, env: simpy.Environment, replica: Replica, finished: list[Request]) -> None:
        # the prompt tokens the client's request found cached: the prefill engine's hit (the decode
        # engine's "hit" is the KV it read)
        for req in finished:
            req.num_cached_tokens = self._prefill_cached.pop(req, req.num_cached_tokens)
        self._retire(env, replica, finished)

    # -- checks and figures -------------------------------------------------------------------
    def _check_no_decode_stall(self) -> None:
        """The clock ran out with requests still waiting on a decode engine that runs none: the head
        of its queue (a request it preempted, or one whose read timed out) needs blocks that reads
        queued behind it hold. (Here a read's blocks are allocated as soon as they fit, not in the
        waiting pass's order as vLLM allocates them, so a small decode pool can end this way.)"""
        for replica in self.pools["decode"]:
            sched = replica.scheduler
            if sched.waiting and not sched.running:
                head = sched.waiting.peek()
                raise UserError(
                    f"decode engine {replica.index} stalled with {len(sched.waiting)} requests waiting and none "
                    f"running: request {head.id} at its head needs KV blocks, and {replica.kv.num_used_blocks} of "
                    f"its {replica.kv.pool.usable_blocks} usable blocks are held by received prompts queued behind "
                    f"it (a limit of kvtwin's P/D model); give the decode pool more KV "
                    f"blocks (cluster.disaggregation.decode.engine.num_blocks or gpu_memory_utilization, "
                    f"engine.num_blocks) or shorter outputs")

    def _check_transfers_ended(self) -> None:
        left = len(self._transfers) + len(self._legs) + sum(map(len, self._awaiting.values()))
        if left:
            raise AssertionError(f"{left} prefill/decode hand-overs never ended")
        for side in SIDES:
            for replica in self.pools[side]:
                if replica.kv.num_used_blocks:
                    raise AssertionError(f"{side} engine {replica.index} still holds "
                                         f"{replica.kv.num_used_blocks} KV blocks after the run")

    def _meta(self, end_s: float) -> dict:
        read = [t for t in self.transfers if not t.expired]
        seconds = np.array([t.done_s - t.allocated_s for t in read])
        waited = np.array([t.allocated_s - t.prefill_done_s for t in read])
        pct = (lambda a, q: float(np.percentile(a, q)) if len(a) else None)     # noqa: E731
        return {
            "pools": {side: {"replicas": [r.index for r in self.pools[side]],
                             "kv_blocks_total": self.pool_plans[side].usable_blocks} for side in SIDES},
            "transfers": len(read), "transfer_timeouts": len(self.transfers) - len(read),
            "transfer_blocks": int(sum(t.blocks for t in read)),
            "transfer_s": {"mean": float(seconds.mean()) if len(read) else None, "p99": pct(seconds, 99)},
            "decode_wait_s": {"mean": float(waited.mean()) if len(read) else None, "p99": pct(waited, 99)},
        }


def prefill_leg(req: Request) -> Request:
    """The proxy's request to the prefill engine: the same prompt, max_tokens=1."""
    out = req.segments[-1]
    first = (out[0], 1) if isinstance(out, tuple) else list(out[:1])
    leg = Request(req.id, req.arrival, req.segments[:-1], 1, first, req.tenant, req.salt, req.priority,
                  req.is_warmup)
    leg.own_prompt_tokens = req.own_prompt_tokens if req.next_turn is None else 0
    leg.kv_transfer = "send"
    return leg


def wake(replica: Replica) -> None:
    if replica.wakeup is not None and not replica.wakeup.triggered:
        replica.wakeup.succeed()


def build_simulation(scenario, requests=None, progress=None, release: bool = False) -> DisaggSimulation:
    """The run of a scenario with cluster.disaggregation, each pool sized and priced as its own engine."""
    plans, costs = {}, {}
    for side in SIDES:
        s = pool_scenario(scenario, side)
        costs[side] = CostModel.for_scenario(s)
        plans[side] = plan_memory(s, costs[side].profile.activation_scale)
        check_block_pool_supports(s.model, s.engine.allocation)
    if requests is None:
        requests, release = stream_requests(scenario) or build_requests(scenario), True
    elif isinstance(requests, list):
        for r in requests:
            r.reset()
    return DisaggSimulation(scenario, requests, plans["decode"], costs["decode"], progress=progress, fast=False,
                            release=release, pool_plans=plans, pool_costs=costs)


def simulate_disaggregated(scenario, requests=None, progress=None, release: bool = False):
    """`sim.simulator.simulate` for a scenario with cluster.disaggregation. Returns the decode pool's
    memory plan and cost model (both pools' block counts are in records.meta['disaggregation'])."""
    sim = build_simulation(scenario, requests, progress, release)
    del requests
    t0 = time.perf_counter()
    records = sim.run()
    records.meta["wall_s"] = time.perf_counter() - t0
    return records, sim.plan, sim.cost_model


def pool_figures(records: RunRecords, requests) -> Optional[dict]:
    """summary.json's `pools`: per pool, its engines' busy fraction and KV usage, and the KV transfers."""
    meta = records.meta.get("disaggregation")
    if meta is None:
        return None
    finished = requests[requests["status"] == "finished"]
    span = float(finished["finish_s"].max() - finished["arrival_s"].min()) if len(finished) else 0.0
    out = {}
    for side, pool in meta["pools"].items():
        busy, used_mean, used_peak = [], [], 0
        for rec in records.recorders:
            if rec.replica not in pool["replicas"]:
                continue
            start, end, used = rec.step_column("start_s"), rec.step_column("end_s"), rec.step_column("kv_blocks_used")
            dur = end - start
            busy.append(float(dur.sum() / span) if span > 0 else 0.0)
            if len(rec):
                used_mean.append(float(np.average(used, weights=dur)) if dur.sum() > 0 else float(used.mean()))
                used_peak = max(used_peak, int(used.max()))
        total = pool["kv_blocks_total"]
        out[side] = {"replicas": len(pool["replicas"]), "kv_blocks_total": total,
                     "utilization": float(np.mean(busy)) if busy else 0.0,
                     "kv_usage_mean": float(np.mean(used_mean)) / total if used_mean and total else 0.0,
                     "kv_usage_peak": used_peak / total if total else 0.0}
    out["transfers"] = {k: meta[k] for k in ("transfers", "transfer_timeouts", "transfer_blocks", "transfer_s",
                                             "decode_wait_s")}
    return out
