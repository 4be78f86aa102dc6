"""The SimPy serving model: an arrival process, a router, and one engine loop per replica.

Each engine loop reads like the engine it models: schedule a batch with the shared
policy, spend the cost model's step time, finish the step, repeat; sleep when there is
nothing to do and wake on the next arrival. One SimPy event per engine step, never per token.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import simpy

from sim.costmodel import IDLE_GAP_S, CostModel
from sim.core.kvcache import KVCacheManager
from sim.core.memory import MemoryPlan, check_block_pool_supports, plan_memory
from sim.records import RunRecords, StepRecorder
from sim.core.request import Request, Status
from sim.router import make_router
from sim.core.scheduler import Scheduler, SchedulerConfig
from sim.workload import build_requests, gc_paused


@dataclass
class Replica:
    """One engine: its own KV pool, scheduler and step records."""

    index: int
    scheduler: Scheduler
    recorder: StepRecorder
    wakeup: Optional[simpy.Event] = None
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


def build_replica(index: int, scenario, plan: MemoryPlan) -> Replica:
    e = scenario.engine
    kv = KVCacheManager(plan.num_blocks, e.block_size, e.prefix_caching, e.allocation,
                        scenario.max_model_len, e.contiguous_reserve)
    return Replica(index, Scheduler(SchedulerConfig.from_scenario(scenario), kv), StepRecorder(index))


class Client:
    """The load generator's side: open loop (every request sent when due), or closed loop with
    at most `max_concurrency` in flight, as vLLM bench's semaphore: a request due while the
    client is full waits for a finish (or a rejection), and its arrival is when it is sent.
    While requests wait here, any replica's finish routes one: `pending` says so, for anything
    that plans ahead to the next routing."""

    def __init__(self, env: simpy.Environment, router, max_concurrency: Optional[int]):
        self.env, self.router, self.limit = env, router, max_concurrency
        self.in_flight = 0
        self.queue: deque[Request] = deque()

    def send(self, req: Request) -> None:
        if self.limit is None:
            self.router.route(req)
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
        req.arrival = self.env.now
        self.router.route(req)
        if req.status is Status.REJECTED:           # answered at once: the slot frees
            self.in_flight -= 1


@dataclass
class Simulation:
    scenario: object
    requests: list[Request]
    plan: MemoryPlan
    cost_model: CostModel
    replicas: list[Replica] = field(default_factory=list)
    progress: Optional[Callable[[int], None]] = None

    def run(self) -> RunRecords:
        with gc_paused():
            return self._run()

    def _run(self) -> RunRecords:
        env = simpy.Environment()
        self.replicas = [build_replica(i, self.scenario, self.plan)
                         for i in range(self.scenario.cluster.replicas * self.scenario.parallelism.dp)]
        router = make_router(self.scenario.cluster, self.replicas)
        self._finished = 0
        for replica in self.replicas:
            env.process(self._engine_loop(env, replica))
        first_turns = [r for r in self.requests if r.arrival is not None]
        self._client = Client(env, router, self.scenario.workload.max_concurrency)
        env.process(self._arrivals(env, first_turns, router))
        self._router = router
        env.run()
        for replica in self.replicas:
            replica.scheduler.check_accounting()
        self._check_every_request_ended()
        return RunRecords(self.requests, [r.recorder for r in self.replicas],
                          kv_blocks_total=self.plan.usable_blocks,
                          block_size=self.scenario.engine.block_size,
                          meta={"kv_evictions": sum(r.kv.pool.evictions for r in self.replicas)})

    def _arrivals(self, env: simpy.Environment, requests: list[Request], router):
        for req in requests:
            if req.arrival > env.now:
                yield env.timeout(req.arrival - env.now)
            self._client.send(req)

    def _follow_up(self, env: simpy.Environment, req: Request, delay: float):
        yield env.timeout(delay)
        req.arrival = env.now
        self._client.send(req)

    def _engine_loop(self, env: simpy.Environment, replica: Replica):
        sched, kv, recorder = replica.scheduler, replica.kv, replica.recorder
        step_time = self.cost_model.step_time
        last_end = float("-inf")
        while True:
            batch = sched.schedule()
            if batch is None:
                replica.wakeup = env.event()
                yield replica.wakeup
                replica.wakeup = None
                continue
            kv_used, kv_cached, slack = kv.pool.num_used, kv.pool.num_cached_free, sched.slack_tokens
            host, device = step_time(batch, env.now - last_end > IDLE_GAP_S)
            start = env.now
            yield env.timeout(host + device)
            recorder.record(batch, sched, start, env.now, host, device, kv_used, kv_cached, slack)
            last_end = env.now
            for req in sched.finish_step(batch):
                self._client.done()
                replica.outstanding_tokens -= req.max_len
                if req.next_turn is not None:
                    env.process(self._follow_up(env, req.next_turn, req.think_time))
                self._finished += 1
                if self.progress is not None and self._finished % 256 == 0:
                    self.progress(self._finished)

    def _check_every_request_ended(self) -> None:
        """Every request that entered the run ends finished or rejected (with a reason)."""
        stuck = [r for r in self.requests if r.arrival is not None and not r.is_finished]
        if stuck:
            raise AssertionError(f"{len(stuck)} requests never ended, e.g. {stuck[0]!r}")
        never_sent = [r for r in self.requests if r.arrival is None and r.status.name != "REJECTED"]
        if never_sent:
            raise AssertionError(f"{len(never_sent)} follow-up turns were never released, e.g. {never_sent[0]!r}")


def simulate(scenario, requests: Optional[list[Request]] = None,
             progress: Optional[Callable[[int], None]] = None) -> tuple[RunRecords, MemoryPlan, CostModel]:
    """Predict one scenario: build its workload, size its KV pool, run the SimPy model."""
    cost_model = CostModel.for_scenario(scenario)
    plan = plan_memory(scenario, cost_model.profile.activation_scale)
    check_block_pool_supports(scenario.model, plan, scenario.max_model_len)
    if requests is None:
        requests = build_requests(scenario)
    else:
        for r in requests:
            r.reset()
    sim = Simulation(scenario, requests, plan, cost_model, progress=progress)
    t0 = time.perf_counter()
    records = sim.run()
    records.meta["wall_s"] = time.perf_counter() - t0
    return records, plan, cost_model
