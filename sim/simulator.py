"""The SimPy serving model: an arrival process, a router, and one engine loop per replica.

Each engine loop reads like the engine it models: schedule a batch with the shared
policy, spend the cost model's step time, finish the step, repeat; sleep when there is
nothing to do and wake on the next arrival. One SimPy event per engine step, never per token,
and one per *leap* where it can (sim/core/fast/leap.py): a stretch of pure decode steps between
two events runs as one, priced in bulk, and ends before the next request reaches a router
(so every routing decision sees the same replica states as the step-by-step path).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Callable, ClassVar, Iterator, Optional, Union

import numpy as np
import simpy

from sim.costmodel import IDLE_GAP_S, CostModel
from sim.dp import DPGroup, DPLayout, DPLoadBalancer, engine_peak_running
from sim.core.kv import BlockPool, KVCacheManager, new_kv_manager
from sim.core.fast.counting_pool import CountingBlockPool
from sim.core.fast.leap import LeapPlan, StepShape, apply_leap, plan_leap
from sim.front_end import FrontEnd
from sim.core.memory import MemoryPlan, check_block_pool_supports, plan_memory
from sim.core.offload import offload_meta, offload_tier
from sim.records import RequestTable, RunRecords, StepRecorder
from sim.core.request import Request
from sim.core.status import REJECTED
from sim.routers.factory import make_router
from sim.autoscale import Autoscaler
from sim.core.scheduler import Scheduler, SchedulerConfig
from sim.core.scheduler_variants import make_scheduler
from sim.core.collector import gc_paused
from sim.core.lora import lora_meta
from sim.core.speculative import speculative_meta
from sim.workload import StreamedWorkload, build_requests, stream_requests


@dataclass
class Replica:
    """One engine: its own KV pool, scheduler and step records."""

    index: int
    scheduler: Scheduler
    recorder: StepRecorder
    wakeup: Optional[simpy.Event] = None
    busy_until: float = math.inf         # end of the step or leap in flight (inf while idle)
    outstanding_tokens: int = 0          # prompt + output tokens routed here and not yet finished

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    def submit(self, req: Request) -> None:
        req.replica = self.index
        if self.scheduler.add(req):
            self.outstanding_tokens += req.max_len
        if self.wakeup is not None and not self.wakeup.triggered:
            self.wakeup.succeed()
            # It starts a step later at this same instant; until it does, another replica
            # planning a leap must not count on it staying idle.
            self.busy_until = -math.inf


def build_replica(index: int, scenario, plan: MemoryPlan, lazy_decode: bool = True, block_ids: bool = False,
                  recorder: Optional[StepRecorder] = None) -> Replica:
    e = scenario.engine
    kv = new_kv_manager(plan.num_blocks, e.block_size, e.prefix_caching, e.allocation, scenario.max_model_len,
                        e.contiguous_reserve, plan.kv_groups, scenario.max_step_tokens,
                        pool_class=BlockPool if block_ids else CountingBlockPool)
    config = replace(SchedulerConfig.from_scenario(scenario), lazy_decode=lazy_decode)
    sched = make_scheduler(config, kv, offload=offload_tier(scenario, plan, kv))
    recorder = StepRecorder(index) if recorder is None else recorder
    recorder.tokens_after_next_host = scenario.tokens_after_next_host
    return Replica(index, sched, recorder)


LEAP_SCALAR_STEPS = 32     # a leap's first steps priced one by one (numpy for the rest of a long one)
# A member finishing at the next step leaves a leap of one step, whose fixed work (plan, apply,
# record) costs more than the one-by-one step (bench/instructions.py bench-150: 1,043.3M with such
# leaps, 1,037.8M without; 1,044.2M without two-step ones too)
LEAP_MIN_STEPS = 2
# vLLM's data-parallel ranks all-reduce "any unfinished requests?" only every 32nd step
# (DPEngineCoreProc._has_global_unfinished_reqs, vllm/v1/engine/core.py, 0.19)
LOCKSTEP_CHECK_STEPS = 32


class Client:
    """The load generator's side: open loop (every request sent when due), or closed loop with
    at most `max_concurrency` in flight, as vLLM bench's semaphore: a request due while the
    client is full waits for a finish (or a rejection), and its arrival is when it is sent.
    While requests wait here, any replica's finish routes one: `pending` says so, for anything
    that plans ahead to the next routing."""

    def __init__(self, env: simpy.Environment, route: Callable[[Request], None], max_concurrency: Optional[int]):
        self.env, self.route, self.limit = env, route, max_concurrency
        self.in_flight = 0
        self.queue: deque[Request] = deque()
        if max_concurrency is None:    # open loop: every request straight to the router (no call in between)
            self.send = route

    def send(self, req: Request) -> None:
        if self.limit is None:
            self.route(req)
        elif self.in_flight < self.limit:
            self._go(req)
        else:
            self.queue.append(req)

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def done(self) -> None:
        if self.limit is None:
            return
        self.in_flight -= 1
        while self.queue and self.in_flight < self.limit:
            self._go(self.queue.popleft())

    def _go(self, req: Request) -> None:
        self.in_flight += 1
        req.sent_at(self.env.now)
        self.route(req)
        if req.status is REJECTED:           # answered at once: the slot frees
            self.in_flight -= 1


@dataclass
class Simulation:
    scenario: object
    requests: Union[list[Request], StreamedWorkload]     # a stream is read as the run reaches it
    plan: MemoryPlan
    cost_model: CostModel
    replicas: list[Replica] = field(default_factory=list)
    progress: Optional[Callable[[int], None]] = None
    # The fast paths (decode cohort, event leaps); off = the one-by-one reference path.
    fast: bool = True
    # Ids for every KV block (the engine's pool) instead of only for those the prefix cache maps
    # (sim/core/fast/counting_pool.py): the same predictions, slower (tests compare the two).
    block_ids: ClassVar[bool] = False
    # The caller hands `requests` over: the list is emptied as the run starts, and each request
    # is dropped once it ended and its figures went into the records (a million requests then
    # never all live at once beside their records).
    release: bool = False
    # Where nothing else acts between arrivals (one replica, open loop, no follow-ups), run steps
    # and leaps back to back and take the arrivals at the replica's own events (`_chained`);
    # off, every step waits for SimPy's clock and a SimPy process sends the arrivals (tests compare).
    chain: ClassVar[bool] = True
    # Where the records go as the run makes them: None keeps them in memory; a RecordSpill
    # (sim/output/streamed.py) writes them to disk chunk by chunk (`simrun --spill-records`).
    spill: Optional[object] = None

    def run(self) -> RunRecords:
        self._loops: list = []           # the processes that live as long as the run (`_start`)
        with gc_paused():
            try:
                return self._run()
            finally:
                self._drop_callbacks()

    def _start(self, env: simpy.Environment, loop) -> simpy.Process:
        """A process that lives as long as the run (an engine loop, the arrivals, the autoscaler)."""
        self._loops.append(loop)
        return env.process(loop)

    def _drop_callbacks(self) -> None:
        """The run is over: close the loops still waiting for work (their frames hold this
        simulation, and the event each waits on holds them) and let go of the client, the arrival
        path and the router, which call back into it (`self._route`). Kept, they make cycles,
        simulation -> client -> simulation, that hold the replicas (their KV pools, schedulers)
        until a full collection, and gc_paused moves everything the run made to the oldest
        generation, whose full collections come rarely: a LODO refit (validate/lodo.py), a
        simulation per evaluation, grew to 13.7 GB. Without them the simulation goes as soon as
        its caller drops it (tests/sim/test_simulator_memory.py)."""
        for loop in self._loops:
            loop.close()
        self._loops = []
        self._client = self._inline = self._router = None

    def _run(self) -> RunRecords:
        env = simpy.Environment()
        if self.scenario.engine.kv_offload is not None:
            self.fast = False        # loads end between steps: the fast paths do not plan for them
        if self.scenario.engine.lora is not None:
            self.fast = False        # every step's adapters are counted and gated one request at a time
        self.replicas = [build_replica(i, self.scenario, self.plan, self.fast, self.block_ids, self._recorder(i))
                         for i in range(self.scenario.cluster.replicas * self.scenario.parallelism.dp)]
        self._next_arrival = math.inf
        self._streams: Optional[FrontEnd] = None     # set with the arrivals (`_start_arrivals`)
        self._pricers: dict = {}                     # rows -> the cost model's decode pricer
        self._follow_up_times: list[float] = []      # heap: when pending follow-up turns reach the router
        self._ended = RequestTable() if self.spill is None else self.spill.request_table()   # taken as each ends
        if self.spill is not None:
            self.spill.tokens_after_next_host = self.scenario.tokens_after_next_host
        # the client's sends, where its asyncio loop is the engine's (Scenario.tokens_at_loop_wake)
        self._sends: Optional[list[float]] = [] if self.scenario.tokens_at_loop_wake else None
        first_turns = self._first_turns()
        self._layout = DPLayout.for_scenario(self.scenario)
        # With autoscaling the router sees only the ready, non-draining replicas (a list the
        # autoscaler changes); without it, every replica (or, where vLLM's own API servers balance
        # data-parallel ranks, every group of them: `_balanced_groups`), as before.
        autoscaling = self.scenario.cluster.autoscaling
        routable = self.replicas if autoscaling is None else list(self.replicas)
        if self._layout.balanced:
            routable = self._balanced_groups(env)
        router = make_router(self.scenario.cluster, routable, self.scenario.seed)
        self._autoscaler = None if autoscaling is None else Autoscaler(
            autoscaling, env, routable, lambda: self._launch_replica(env), self._work_left)
        self._finished = 0
        self._dummy_steps = 0           # a lockstep rank's steps with nothing scheduled
        for engine in self._engines():
            self._start(env, self._engine_loop(env, engine[0]) if len(engine) == 1 else self._lockstep_loop(env, engine))
        self._router = router
        self._start_arrivals(env, first_turns)
        if self._autoscaler is not None:
            self._start(env, self._autoscaler.process())
        env.run()
        for replica in self.replicas:
            replica.scheduler.check_accounting()
        self._check_every_request_ended()
        if self._sends is not None:
            self._wake_loops_at_sends(np.sort(np.asarray(self._sends, dtype=float)))
        if self._streams is not None:
            self._deliver_through(self._streams)
        return RunRecords(self._ended, [r.recorder for r in self.replicas],
                          kv_blocks_total=self.plan.usable_blocks,
                          block_size=self.scenario.engine.block_size,
                          meta={"kv_evictions": sum(r.kv.pool.evictions for r in self.replicas),
                                **self._router.figures(), **offload_meta(self.replicas),
                                **speculative_meta([r.scheduler for r in self.replicas]),
                                **lora_meta([r.scheduler for r in self.replicas], self.cost_model.lora),
                                **({} if self._autoscaler is None else {"autoscaling": self._autoscaler.timeline()}),
                                **self._dp_meta()})

    def _wake_loops_at_sends(self, sends: np.ndarray) -> None:
        """A load generator on the engine's asyncio loop sleeps until each send: those timers wake
        the loop, and a token waiting for it reaches the client then (StepRecorder.token_times)."""
        for replica in self.replicas:
            replica.recorder.loop_wakes = sends
        if self.spill is not None:
            self.spill.loop_wakes = sends

    def _deliver_through(self, front: FrontEnd) -> None:
        """Each step's tokens reach the client when the API server has streamed them (FrontEnd.outputs)."""
        for replica in self.replicas:
            delivered = np.asarray(front.delivered(replica.index), dtype=float)
            if self.spill is None:
                replica.recorder.delivered = delivered
            else:
                self.spill.delivered[replica.index] = delivered

    def _recorder(self, index: int) -> Optional[StepRecorder]:
        return None if self.spill is None else self.spill.step_recorder(index)

    def _start_arrivals(self, env: simpy.Environment, first_turns: Iterator[Request]) -> None:
        """The client, vLLM's API-server front end and the arrival path, sending to `self._router`
        (set before). The front end (sim/front_end.py, none where engine.front_end_s is 0)
        is one FIFO recurrence either way: an open-loop run with no follow-up turns hands each
        request over at its arrival, in order, so the arrival path delivers it where it leaves
        the front end (`_Arrivals`, no event of its own); where a closed-loop client or a
        follow-up turn sends at a time of the run's own, the request waits in `_front_exits`
        for the one process that routes each as it leaves (`_front_end_exits`)."""
        front = FrontEnd.for_scenario(self.scenario)
        # the front end that streams each step's outputs (engine.front_end_token_s or front_end_step_s
        # above 0): the engine loops report their steps to it as they plan them (`outputs`)
        self._streams = front if front is not None and front.streams else None
        self._front_exits: deque = deque()       # (when it leaves the front end, request)
        in_stream = front is not None and self.scenario.workload.max_concurrency is None \
            and self._min_think == math.inf
        route = self._route
        if front is not None and not in_stream:
            route = self._front_end_entry(env, front)
        self._client = Client(env, route, self.scenario.workload.max_concurrency)
        # One replica, an open-loop client and no follow-up turns: between a leap's end and the
        # next arrival nothing but this replica acts, so leaps run back to back in one event.
        self._chained = (self.chain and self.fast and len(self.replicas) == 1 and self._client.limit is None
                         and self._min_think == math.inf and self._autoscaler is None)
        # One arrival path (`_Arrivals`): a SimPy process hands the requests over as they fall due;
        # in a chained run nothing but the one replica acts between arrivals, so it takes them
        # itself at each of its own events, in the order the process would have delivered them.
        arrivals = _Arrivals(first_turns, self._client.send, front if in_stream else None)
        if self._chained:
            self._inline = arrivals
            self._next_arrival = arrivals.next_time
        else:
            self._inline = None
            self._start(env, self._arrivals(env, arrivals))

    def _front_end_entry(self, env: simpy.Environment, front: FrontEnd) -> Callable[[Request], None]:
        """What the client sends to where requests go through the front end at times of the
        run's own: each queues for when it leaves (`front.admit(now)`, calls in time order), and
        one process routes them (started here)."""
        exits = self._front_exits
        idle: list = []          # the exits process's wake-up event while it waits for a request

        def enter(req: Request) -> None:
            exits.append((front.admit(env.now), req))
            if idle:
                idle.pop().succeed()

        def leave():
            while True:
                if not exits:
                    idle.append(env.event())
                    yield idle[0]
                    continue
                when = exits[0][0]
                if when > env.now:
                    yield from sleep_until(env, when)
                req = exits.popleft()[1]
                self._route(req)
                if req.status is REJECTED:       # answered at once: its client slot frees
                    self._client.done()

        self._start(env, leave())
        return enter

    def _launch_replica(self, env: simpy.Environment) -> Replica:
        """A replica the autoscaler adds mid-run, with its engine loop (routable once started)."""
        index = len(self.replicas)
        replica = build_replica(index, self.scenario, self.plan, self.fast, self.block_ids, self._recorder(index))
        self.replicas.append(replica)
        self._start(env, self._engine_loop(env, replica))
        return replica

    def _work_left(self) -> bool:
        """Can a request still arrive, or is one in flight? (The autoscaler stops when not.)"""
        return (self._next_arrival < math.inf or bool(self._follow_up_times) or self._client.pending
                or bool(self._front_exits)
                or any(r.scheduler.has_unfinished() for r in self.replicas))

    def _engines(self) -> list[list[Replica]]:
        """The replicas that step as one: a data-parallel engine's dp ranks where vLLM runs them in
        lockstep (DPEngineCoreProc: MoE models, and dense ones before 0.14: sim/dp.py), else each
        replica alone."""
        dp = self.scenario.parallelism.dp
        if not self._layout.lockstep:
            return [[replica] for replica in self.replicas]
        return [self.replicas[i:i + dp] for i in range(0, len(self.replicas), dp)]

    def _balanced_groups(self, env: simpy.Environment) -> list[DPGroup]:
        """The groups of dp ranks vLLM's own API servers spread requests over (every rank of an
        engine; a node's ranks with hybrid balancing), each behind its DPLoadBalancer, which hears
        the ranks' counts only where they step in lockstep (DPEngineCoreProc publishes them)."""
        size, layout = self._layout.group_size, self._layout
        groups, self._balancers = [], {}
        for start in range(0, len(self.replicas), size):
            ranks = self.replicas[start:start + size]
            balancer = DPLoadBalancer(ranks, layout.api_servers, publishes=layout.lockstep)
            for rank in ranks:
                self._balancers[rank.index] = balancer
            groups.append(DPGroup(len(groups), ranks, balancer, lambda: env.now))
        return groups

    def _dp_meta(self) -> dict:
        """What summary.json keeps of a data-parallel run (only such runs: other summaries unchanged)."""
        layout = self._layout
        if layout.dp == 1:
            return {}
        dp = layout.dp
        engines = [list(range(i, i + dp)) for i in range(0, len(self.replicas), dp)]
        balancers = {id(b): b for b in getattr(self, "_balancers", {}).values()}.values()
        return {"data_parallel": {
            **layout.describe(),
            "peak_running_per_engine": engine_peak_running(self._steps_frame(), engines),
            "dummy_steps": self._dummy_steps,
            "load_balancer_publications": sum(b.publications for b in balancers),
        }}

    def _steps_frame(self):
        import pandas as pd

        frames = [r.recorder.frame(full=True) for r in self.replicas]
        frames = [f for f in frames if len(f)]
        if not frames:
            return pd.DataFrame({"replica": [], "start_s": [], "end_s": [], "running": []})
        return pd.concat(frames, ignore_index=True)

    def _lockstep_loop(self, env: simpy.Environment, ranks: list[Replica]):
        """A data-parallel engine whose ranks step together, as vLLM's DPEngineCoreProc.run_busy_loop
        runs it (vllm/v1/engine/core.py, 0.19): while any rank has work every rank steps, one with
        nothing scheduled running a dummy batch; the MoE layers' collectives hold each step to its
        slowest rank (CostModel.lockstep_times); the ranks ask whether any still has work only every
        32nd step, so an engine that ran dry goes on with dummy steps until that check, then sleeps
        until a request comes. After each step the ranks' (waiting, running) go to the DP load
        balancer (`_maybe_publish_request_counts`). One step at a time, no leaps."""
        lockstep_times = self.cost_model.lockstep_times
        by_rank = getattr(self, "_balancers", {})
        balancers = list({id(b): b for b in (by_rank.get(rank.index) for rank in ranks) if b is not None}.values())
        last_end = float("-inf")
        wave_steps = 0                  # steps since the engine woke (vLLM's step_counter)
        while True:
            now = env.now
            batches = [rank.scheduler.schedule() for rank in ranks]
            if all(batch is None for batch in batches) and wave_steps % LOCKSTEP_CHECK_STEPS == 0:
                wave_steps = 0
                wakeup = env.event()
                for rank in ranks:
                    rank.wakeup, rank.busy_until = wakeup, math.inf
                yield wakeup
                for rank in ranks:
                    rank.wakeup = None
                continue
            figures = [rank.scheduler.kv_figures() for rank in ranks]
            times = lockstep_times(batches, now - last_end > IDLE_GAP_S)
            duration = max(host + device for host, device in times)
            for rank, batch in zip(ranks, batches):
                rank.busy_until = now + duration
                if self._streams is not None and batch is not None:
                    self._streams.outputs(rank.index, (now + duration,), batch.num_seqs)
            yield env.timeout(duration)
            end = last_end = env.now
            wave_steps += 1
            for rank, batch, (host, _), (kv_used, kv_cached, slack) in zip(ranks, batches, times, figures):
                if batch is None:
                    self._dummy_steps += 1
                    continue
                # the rank's device time includes its wait for the slowest rank in the collectives
                rank.recorder.record(batch, rank.scheduler, now, end, host, (end - now) - host, kv_used, kv_cached,
                                     slack)
                finished = rank.scheduler.finish_step(batch)
                if finished:
                    self._retire(env, rank, finished)
            for balancer in balancers:
                balancer.step_ended(end, tuple((len(rank.scheduler.waiting), len(rank.scheduler.running))
                                               for rank in balancer.ranks))

    def _first_turns(self) -> Iterator[Request]:
        """The requests that arrive on their own, in order (follow-up turns hang off their previous
        turn); sets the count and the shortest think time. A stream, or a released list, is read
        so that the run holds a request only while it is in flight."""
        if isinstance(self.requests, StreamedWorkload):
            stream, self.requests, self.release = self.requests, [], True
            self._num_requests, self._min_think = stream.count, stream.min_think
            if stream.min_think == math.inf:        # no follow-up turn: each request arrives on its own
                return stream.requests              # (no generator to resume per request)
            return (r for r in stream.requests if r.arrival is not None)
        # A finish on one replica can send a follow-up turn to another after its think time.
        turns = [r.think_time for r in self.requests if r.next_turn is not None]
        self._min_think = min(turns) if turns else math.inf
        self._num_requests = len(self.requests)
        queue = deque([r for r in self.requests if r.arrival is not None])    # (a generator resumes per item)
        if self.release:
            self.requests.clear()
        return _drain(queue)

    def _arrivals(self, env: simpy.Environment, arrivals: "_Arrivals"):
        """The arrival process: sleep until the next request is due, hand over all that are."""
        while arrivals.next_time < math.inf:
            if arrivals.next_time > env.now:
                self._next_arrival = arrivals.next_time
                yield env.timeout(arrivals.next_delay())    # (lands on next_time: the same sum)
            arrivals.deliver(env.now)
        self._next_arrival = math.inf

    def _route(self, req: Request) -> None:
        """Send a request to the router; one rejected at once (with the later turns of its
        conversation) has ended: its figures go into the records."""
        if self._sends is not None:
            self._sends.append(req.arrival)
        self._router.route(req)
        if req.status is REJECTED:
            turn: Optional[Request] = req
            while turn is not None:
                self._ended.add(turn)
                turn = turn.next_turn

    def _follow_up(self, env: simpy.Environment, req: Request, delay: float):
        yield env.timeout(delay)
        heapq.heappop(self._follow_up_times)
        req.sent_at(env.now)
        self._client.send(req)

    def _next_route_time(self, replica: Replica) -> float:
        """The earliest moment a request may reach the router (a leap must end before it):
        the next arrival, a pending follow-up turn, or one that another replica's next finish
        could release (no earlier than the end of its step in flight plus the shortest think time)."""
        # (each min(horizon, t) as `t if t < horizon else horizon`: min() costs ~1,200 instructions
        # under CPython 3.11, and this runs at every step of a run with several replicas)
        horizon = self._next_arrival
        if self._follow_up_times:
            follow = self._follow_up_times[0]
            horizon = follow if follow < horizon else horizon
        if self._front_exits:                   # one leaving the API-server front end
            leaves = self._front_exits[0][0]
            horizon = leaves if leaves < horizon else horizon
        if self._autoscaler is not None:        # it reads every replica's gauges then
            poll = self._autoscaler.next_poll
            horizon = poll if poll < horizon else horizon
        # A closed-loop client holding requests sends one at any replica's finish.
        think = 0.0 if self._client.pending else self._min_think
        if think < math.inf:
            for other in self.replicas:
                if other is not replica:
                    sends = other.busy_until + think
                    horizon = sends if sends < horizon else horizon
        return horizon

    def _engine_loop(self, env: simpy.Environment, replica: Replica):
        sched, recorder = replica.scheduler, replica.recorder
        schedule, finish_step, record = sched.schedule, sched.finish_step, recorder.record
        step_time = self.cost_model.step_time
        fast, chained = self.fast, self._chained
        # A decode-only step (no prompt tokens, no drafts) is priced by the leaps' decode pricer of
        # its rows where one was made: the same function with its batch-size terms worked out once
        # (`_decode_pricer`), so the same floats without working them out again.
        cost = self.cost_model
        plain = fast and cost.draft is None and cost.lora is None and cost.eager_context is None
        decode_pricers = self._pricers if plain else {}
        woken = cost.woken        # the idle rule (step_time applies it to the steps it prices)
        inline = self._inline
        streams = self._streams
        tier = sched.offload
        # Nothing here reads a step's rows but a CPU tier, LoRA, a drafter and V0's eager check: the
        # cohort's members, ~25 a step, are not copied into each step's Batch.decodes without them.
        sched.lists_members = not (plain and tier is None and sched.lora is None)
        queue = sched.waiting     # (its len() is a C call; the scheduler's num_waiting a property)
        last_end = float("-inf")
        seen_waiting = 0          # requests waiting when this replica last scheduled
        waited = True             # SimPy's clock may have moved since `clock` read it
        while True:
            # Where nothing else can act before the next arrival (`_chained`), steps and leaps run
            # back to back without waiting for SimPy's clock (`now` runs ahead): the replica takes
            # the arrivals due by each of its ends itself, and SimPy's clock only where it sleeps.
            # (So a chained loop reads the clock, a property, only after it slept: idle, below.)
            if waited:
                clock = env.now
                waited = not chained
            now = last_end if last_end > clock else clock
            # (chained: no follow-up turn, no other replica, no client queue; the next arrival it is)
            horizon = (self._next_arrival if chained else self._next_route_time(replica)) if fast else math.inf
            # A request that arrived during the last step is most likely admitted now: no leap.
            # (plan_leap finds none while arrivals wait to join WAITING, async: not asked then)
            if (fast and now == last_end and len(queue) <= seen_waiting
                    and horizon > now and not sched.arriving):
                leap = self._plan_leap(sched, now, horizon)
                if leap is not None:
                    seen_waiting = len(queue)
                    last_end = yield from self._leaps(env, replica, leap, now, horizon)
                    continue
            if tier is not None:
                tier.now = now
            arrived = len(sched.arriving)    # (async: they join WAITING after this pass, new to the next)
            batch = schedule()
            seen_waiting = len(queue) - arrived
            if batch is None:
                waited = True
                if now > env.now:            # catch up before sleeping
                    yield from sleep_until(env, now)
                if tier is not None and tier.loading:       # asleep until a load ends or a request comes
                    replica.wakeup = env.event()
                    replica.busy_until = math.inf
                    until = max(tier.next_load_done(), env.now)
                    yield env.any_of([replica.wakeup, timeout_at(env, until)])
                    while not replica.wakeup.triggered and env.now != until:
                        yield env.any_of([replica.wakeup, timeout_at(env, until)])
                    replica.wakeup = None
                    continue
                if inline is not None:       # sleep until the next arrival (none: the run is over)
                    if self._next_arrival == math.inf:
                        return
                    replica.busy_until = math.inf
                    yield from sleep_until(env, self._next_arrival)
                    self._next_arrival = inline.deliver(env.now)
                    continue
                replica.wakeup = env.event()
                replica.busy_until = math.inf
                yield replica.wakeup
                replica.wakeup = None
                continue
            kv_used, kv_cached, slack = sched.kv_figures()
            if batch.prefills or batch.num_prefill_tokens or (price := decode_pricers.get(batch.num_decode)) is None:
                host, device = step_time(batch, now - last_end > IDLE_GAP_S)
            else:
                host, device = price(batch.decode_ctx, batch.blocks_read)
                if now - last_end > IDLE_GAP_S:
                    host = woken(host)
            end = now + (host + device)      # as SimPy's timeout adds it
            if streams is not None:
                streams.outputs(replica.index, (end,), batch.num_seqs)
            if chained:
                if end >= horizon:
                    self._next_arrival = inline.deliver(end)
            else:
                replica.busy_until = end
                yield from sleep_until(env, end)
            record(batch, sched, now, end, host, device, kv_used, kv_cached, slack)
            last_end = end
            if tier is not None:
                tier.now = end
            finished = finish_step(batch)
            if finished:
                self._retire(env, replica, finished)

    def _leaps(self, env: simpy.Environment, replica: Replica, leap: tuple, now: float, horizon: float):
        """Run a planned leap; where nothing else can see the moments between them (`_chained`),
        also the leaps that follow it before `horizon`, each planned from where the last ended,
        without waiting for SimPy's clock. Returns the end of the last."""
        sched, recorder = replica.scheduler, replica.recorder
        start = now
        while True:
            plan, ends, host, device, ctx, blocks = leap
            if self._streams is not None:
                self._streams.outputs(replica.index, ends, plan.rows)
            waiting = len(sched.waiting)
            used, cached, slack = apply_leap(sched, plan, len(ends))
            running = len(sched.running)     # (after an async release at the leap's first step)
            end = float(ends[-1])
            chained = self._chained and end < horizon
            if self._chained:
                if not chained:
                    if len(ends) > 1 and ends[-2] > horizon:
                        # held over (LeapPlan.timed): what arrived by the end of the step in flight
                        # at the horizon joined WAITING after the last step's pass, the rest after
                        self._inline.deliver(float(ends[-2]))
                        sched.take_arriving()
                    self._next_arrival = self._inline.deliver(end)
            else:
                replica.busy_until = end
                yield from sleep_until(env, end)
            # (first_step, start_s, ends, rows, decode_ctx, blocks_read, running, waiting, kv_used,
            # kv_cached, slack, host, device, waiting_last: positional, once a leap)
            recorder.record_leap(plan.first_step, start, ends, plan.rows, ctx, blocks, running, waiting,
                                 used, cached, slack, host, device, len(sched.waiting))
            finished = sched.finish_cohort_step(sched.step - 1)     # (finish_leap, inline: a call a leap)
            if finished:
                self._retire(env, replica, finished)
            if not chained:
                return end
            start = end
            leap = self._plan_leap(sched, end, horizon)
            if leap is None:
                return end

    def _retire(self, env: simpy.Environment, replica: Replica, finished: list[Request]) -> None:
        closed_loop = self._client.limit is not None     # (an open loop's client has nothing to do)
        for req in finished:
            self._ended.add(req)
            if closed_loop:
                self._client.done()
            replica.outstanding_tokens -= req.max_len
            if req.next_turn is not None:
                # known now, though the process starts later: a leap planned meanwhile must see it
                heapq.heappush(self._follow_up_times, env.now + req.think_time)
                env.process(self._follow_up(env, req.next_turn, req.think_time))
            self._finished += 1
            if self.progress is not None and self._finished % 256 == 0:
                self.progress(self._finished)
        if self._autoscaler is not None:
            self._autoscaler.retired(replica, env.now)

    def _plan_leap(self, sched: Scheduler, now: float, horizon: float):
        """A leap from `now`: (plan, end times, host s, device s, decode ctx, blocks read) of its
        steps, None when not one step qualifies. It ends with the step in flight at `horizon`
        (the next routing): that step was scheduled before the routing in the one-by-one path
        too, and its finish comes after it, so the router sees the same states. (A step ending
        exactly at `horizon` is left out: which of the two comes first is SimPy's queue order.)"""
        plan = plan_leap(sched, 1 << 30, LEAP_MIN_STEPS)
        if plan is not None and self.cost_model.eager_context is not None:
            graph_steps = self._graph_steps(sched)
            if graph_steps < plan.max_steps:        # (plan_leap reads the scheduler, changes nothing)
                plan = plan_leap(sched, max_steps=graph_steps)
        if plan is None:
            return None
        price = self._pricers.get(plan.rows)
        if price is None:
            plan.reach(1)
            (ctx,), (blocks,) = plan.shapes(1)
            price = self._decode_pricer(plan.rows, ctx, blocks)
        # most leaps are short: their first steps priced one by one (cheaper than numpy for a few)
        # Async scheduling in a chained run: what arrives at the horizon joins WAITING only after
        # the next step's pass, so the leap runs through that step too (LeapPlan.timed, `_leaps`).
        held_over = self._chained and sched.holds_arrivals and sched.in_flight
        ends, hosts, devices, ctx, blocks, more = plan.timed(sched, price, now, horizon, LEAP_SCALAR_STEPS, held_over)
        if more:
            return self._bulk_times(plan, now, ends, hosts, devices, horizon, held_over)
        if not ends:
            return None
        return plan, ends, hosts, devices, ctx, blocks

    def _graph_steps(self, sched: Scheduler) -> int:
        """For a V0 engine whose decode steps run eagerly past a context (`CostModel.eager_context`):
        the steps a leap may run before its longest member's context passes it (each member's
        context grows by one a step; step_time prices the rest one by one)."""
        return self.cost_model.eager_context - max(member.num_computed for member in sched.cohort.members)

    def _decode_pricer(self, rows: int, ctx: int, blocks: int):
        """The cost model's decode-only pricer for `rows` (made once per batch size and checked
        then against step_time: if they ever differ, step_time prices every such step)."""
        pricer = self._pricers.get(rows)
        if pricer is None:
            step_time = self.cost_model.step_time
            pricer = self.cost_model.decode_pricer(rows)
            if pricer is None or pricer(ctx, blocks) != step_time(StepShape(rows, ctx, blocks), False):
                def pricer(c, b, rows=rows):
                    return step_time(StepShape(rows, c, b), False)
            self._pricers[rows] = pricer
        return pricer

    def _bulk_times(self, plan: LeapPlan, now: float, ends: list, hosts: list, devices: list, horizon: float,
                    held_over: bool):
        """A long leap priced with numpy (the same float operations, element by element), in
        growing stretches until one crosses the horizon (or the plan ends); with `held_over`, one
        step past the one in flight then, where it is priced already (see LeapPlan.timed)."""
        size = 4 * len(ends)
        while True:
            size *= 4
            k_max = plan.reach(size)
            columns = plan.columns(k_max)
            host, device = self.cost_model.step_times(columns)
            if host[0] != hosts[0] or device[0] != devices[0]:
                # an element-wise function (a power, say) rounded differently from its scalar form:
                # price this leap step by step, so that it stays exact
                host, device = zip(*(self.cost_model.step_time(StepShape(plan.rows, int(c), int(b)), False)
                                     for c, b in zip(columns["decode_ctx"], columns["blocks_read"])))
                host, device = np.array(host), np.array(device)
            tail = np.cumsum(np.concatenate(([ends[-1]], host[len(ends):] + device[len(ends):])))[1:]
            before = int(np.searchsorted(tail, horizon, side="left"))       # steps ending before it
            if before < len(tail) or k_max < size:
                break
        if before < len(tail) and tail[before] > horizon:
            before += 1                                                      # and the one in flight then
            if held_over and before < len(tail):
                before += 1                                                  # and the next (async)
        k = len(ends) + before
        ends = np.concatenate((ends, tail[:before]))
        return plan, ends, host[:k], device[:k], columns["decode_ctx"][:k], columns["blocks_read"][:k]

    def _check_every_request_ended(self) -> None:
        """Every request that entered the run ends finished or rejected (with a reason)."""
        missing = self._num_requests - len(self._ended)
        if self.release:
            if missing:
                raise AssertionError(f"{missing} of {self._num_requests} requests never ended "
                                     f"(or follow-up turns were never released)")
            return
        stuck = [r for r in self.requests if r.arrival is not None and not r.is_finished]
        if stuck:
            raise AssertionError(f"{len(stuck)} requests never ended, e.g. {stuck[0]!r}")
        never_sent = [r for r in self.requests if r.arrival is None and r.status.name != "REJECTED"]
        if never_sent:
            raise AssertionError(f"{len(never_sent)} follow-up turns were never released, e.g. {never_sent[0]!r}")
        if missing:
            raise AssertionError(f"{missing} requests ended without being recorded")


def _drain(queue: deque) -> Iterator[Request]:
    """The queue's requests, each popped as it is taken (a C-level iterator: no generator to
    resume per request)."""
    return map(deque.popleft, repeat(queue, len(queue)))


class _Arrivals:
    """The requests that arrive on their own, in order, each due where a SimPy timeout from the
    previous one lands (`t + (arrival - t)`), and the one way they arrive: `deliver(now)` hands
    over every request due by `now`. The arrival process (`Simulation._arrivals`) sleeps until
    `next_time` and delivers; in a chained run (Simulation._chained) the one replica delivers at
    each of its own events instead, a request due exactly then first, as the process's timeout,
    queued earlier, would have. With a `front_end` (sim/front_end.py) a request is due where it
    leaves the API servers, `front_end.admit(arrival)` taken in arrival order; its arrival, which its
    latencies count from, stays the client's. Where the front end streams the steps' outputs too
    (`FrontEnd.streams`), the admission waits for the handover itself (a first due time, when nothing is
    sent): by then every step ending before it has been reported, whether the engine took it one by
    one or in a leap, and the intake queues behind those steps' outputs."""

    def __init__(self, requests: Iterator[Request], send: Callable[[Request], None],
                 front_end: Optional[FrontEnd] = None):
        self._requests, self._send = requests, send
        self._admit = None if front_end is None else front_end.admit
        self._staged = front_end is not None and front_end.streams
        self._at_handover = False        # (staged) due at the head's handover, not yet admitted
        self._time = 0.0                 # the arrival process's clock (SimPy's starts at 0)
        self._handed = 0.0               # (front end) the latest arrival handed to it
        self._head = next(requests, None)
        self.next_time = self._due(self._head)

    def _due(self, req: Optional[Request]) -> float:
        if req is None:
            return math.inf
        t, target = self._time, req.arrival
        if self._admit is not None:
            handed = self._handed = target if target > self._handed else self._handed
            self._at_handover = self._staged
            target = self._target = handed if self._staged else self._admit(handed)
        return t + (target - t) if target > t else t

    def next_delay(self) -> float:
        """The timeout from the latest arrival's time to the next one's (`next_time` is its sum)."""
        return (self._head.arrival if self._admit is None else self._target) - self._time

    def deliver(self, now: float) -> float:
        """Send every request due by `now`; returns when the next one is due (inf: none left)."""
        while self.next_time <= now:
            if self._at_handover:
                self._at_handover = False
                t = self._time = self.next_time
                target = self._target = self._admit(self._handed)
                self.next_time = t + (target - t) if target > t else t
                continue
            self._time, req = self.next_time, self._head
            self._head = next(self._requests, None)
            self._send(req)
            self.next_time = self._due(self._head)
        return self.next_time


def timeout_at(env: simpy.Environment, when: float) -> simpy.Timeout:
    """SimPy's timeout toward the absolute time `when`: a leap or a chain of steps ends at a
    sum now + d1 + d2 + ..., added step by step, and SimPy's clock must land on exactly that
    float. The delay `when - now` is exact whenever when <= 2 * now (Sterbenz's lemma), and so
    is now + delay then; beyond that, now + (when - now) can miss `when` by one ulp (from
    now = 0.13319044464948654, no float delay reaches 0.9392256727552156). There the timeout
    goes to 2 * now, itself exact, and the caller waits again (`sleep_until`): the clock
    doubles until the last delay is exact. Which delay lands where is float arithmetic, so
    the timeout is the same event, priority and order as any other (docs/architecture_core.md)."""
    now = env.now
    if when < now:
        raise ValueError(f"cannot schedule at {when} before now ({now})")
    delay = when - now
    if now + delay != when:
        delay = now                    # (only when > 2 * now: the doubling above)
    return env.timeout(delay)


def sleep_until(env: simpy.Environment, when: float):
    """Wait until SimPy's clock reads exactly `when` (see timeout_at)."""
    yield timeout_at(env, when)
    while env.now != when:
        yield timeout_at(env, when)


def simulate(scenario, requests: Union[list[Request], StreamedWorkload, None] = None,
             progress: Optional[Callable[[int], None]] = None,
             fast: bool = True, release: bool = False, spill=None) -> tuple[RunRecords, MemoryPlan, CostModel]:
    """Predict one scenario: build its workload, size its KV pool, run the SimPy model.
    With `release` the caller hands `requests` over (see Simulation.release); a workload made
    here is streamed when synthetic (sim.workload.stream_requests), else built and released."""
    if scenario.cluster.disaggregation is not None:
        raise ValueError("cluster.disaggregation: prefill and decode pools run in "
                         "sim.disagg.simulate_disaggregated (sim.predict.predict picks it)")
    cost_model = CostModel.for_scenario(scenario)
    plan = plan_memory(scenario, cost_model.profile.activation_scale)
    check_block_pool_supports(scenario.model, scenario.engine.allocation)
    if requests is None:
        requests, release = stream_requests(scenario) or build_requests(scenario), True
    elif isinstance(requests, list):
        for r in requests:
            r.reset()
    sim = Simulation(scenario, requests, plan, cost_model, progress=progress, fast=fast, release=release,
                     spill=spill)
    del requests
    t0 = time.perf_counter()
    records = sim.run()
    records.meta["wall_s"] = time.perf_counter() - t0
    return records, plan, cost_model
