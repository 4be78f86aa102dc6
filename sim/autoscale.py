"""`cluster.autoscaling`: replicas added and drained with load, as KEDA + the Kubernetes HPA do it
on vLLM's Prometheus metrics.

KEDA's Prometheus scaler (keda.sh/docs/2.x/scalers/prometheus, metricType AverageValue, its
default) hands the HPA one external metric: the query's value, e.g. sum(vllm:num_requests_waiting)
over the serving pods, with the trigger's `threshold` as the target per replica. The HPA
controller then, every sync period (--horizontal-pod-autoscaler-sync-period, default 15 s):

1. desired = ceil(metric / target), unless |metric / (target x current) - 1| <= tolerance (0.1),
   where it keeps `current` (GetExternalPerPodMetricReplicas, pkg/controller/podautoscaler/
   replica_calculator.go). `current` is the scale target's status replicas: pods that exist,
   started or still starting, not those terminating.
2. stabilisation (stabilizeRecommendationWithBehaviors, horizontal.go): the result stays at
   least the lowest recommendation of the last scale-up window (default 0 s) and at most the
   highest of the last scale-down window (default 300 s), so a dip must last 5 minutes before
   replicas go.
3. rate limits (the default behavior: scale up by at most max(4 pods, 100%) per 15 s, down by at
   most 100% per 15 s, counted from the replicas at the start of each policy period), then the
   clamp to [min_replicas, max_replicas].

Modelled lifecycle. A new replica holds its GPUs from the decision on, and takes traffic only
after `startup_s` (model load, torch.compile, CUDA graph capture: vLLM issue #20264 reports the
first response 59 s after a pod started with a warm compile cache; #19824, ~215 s for a 70B
model at tp=8). A replica scaled away stops taking new requests at once (the router sees only
ready, non-draining replicas), finishes what it holds (queue included), then releases its GPUs.
Scale-down removes starting replicas first, then the newest ready one (the ReplicaSet
controller's order: not-ready pods before ready ones, younger before older). The metric is read
from the ready, non-draining replicas at the decision instant (no scrape delay). KEDA's
pollingInterval (30 s) and cooldownPeriod (300 s) govern scaling between 0 and 1 replica only
(keda.sh/docs/2.x/reference/scaledobject-spec); min_replicas is at least 1 here, so neither applies.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Literal, Optional

from pydantic import Field, model_validator

from sim.core.catalog import StrictModel

MAX_AUTOSCALE_REPLICAS = 1024
# vLLM's gauges the policies read (vllm/v1/metrics/loggers.py, 0.19)
POLICY_METRICS = {"queue_depth": "vllm:num_requests_waiting", "running": "vllm:num_requests_running",
                  "kv_usage": "vllm:kv_cache_usage_perc"}


class Autoscaling(StrictModel):
    """KEDA's Prometheus trigger on one vLLM gauge, through the HPA's algorithm (sim/autoscale.py)."""

    policy: Literal["queue_depth", "running", "kv_usage"] = Field(
        description="queue_depth (sum of vllm:num_requests_waiting) | running (vllm:num_requests_running) | "
                    "kv_usage (vllm:kv_cache_usage_perc, 0-1): the metric summed over ready replicas")
    target: float = Field(gt=0, le=1e6, description="the trigger's threshold: the metric's target per replica")
    min_replicas: int = Field(default=1, ge=1, le=MAX_AUTOSCALE_REPLICAS,
                              description="KEDA minReplicaCount (>= 1: scale-to-zero is not modelled)")
    max_replicas: int = Field(default=100, ge=1, le=MAX_AUTOSCALE_REPLICAS,
                              description="KEDA maxReplicaCount (default 100)")
    interval_s: float = Field(default=15.0, gt=0, le=3600,
                              description="how often the HPA decides (--horizontal-pod-autoscaler-sync-period, 15 s)")
    tolerance: float = Field(default=0.1, ge=0, lt=1,
                             description="no change while |metric / (target x replicas) - 1| <= this (HPA: 0.1)")
    scale_up_stabilization_s: float = Field(default=0.0, ge=0, le=3600,
                                            description="HPA behavior.scaleUp.stabilizationWindowSeconds (0)")
    scale_down_stabilization_s: float = Field(default=300.0, ge=0, le=3600,
                                              description="HPA behavior.scaleDown.stabilizationWindowSeconds (300)")
    scale_up_pods: int = Field(default=4, ge=0, le=MAX_AUTOSCALE_REPLICAS,
                               description="HPA default scale-up policy: at most this many pods per period (4)")
    scale_up_percent: float = Field(default=100.0, ge=0, le=10_000,
                                    description="... or this percent of the replicas per period, whichever is more (100)")
    scale_down_percent: float = Field(default=100.0, ge=0, le=100,
                                      description="HPA default scale-down policy: at most this percent per period (100)")
    policy_period_s: float = Field(default=15.0, gt=0, le=3600,
                                   description="the period of both rate-limit policies, s (HPA default 15)")
    startup_s: float = Field(default=60.0, ge=0, le=3600,
                             description="from the scale-up decision to taking traffic: model load + torch.compile + "
                                         "CUDA graph capture (60 s: vLLM issue #20264's 59 s to a first response)")

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        if self.policy == "kv_usage" and self.target > 1:
            raise ValueError(f"target {self.target:g}: kv_usage is a fraction of the KV pool; expected 0 < target <= 1")
        return self


def autoscaling_problems(scenario) -> list[str]:
    """Cross-section checks (sim/scenario.py's _cross_checks)."""
    a, c = scenario.cluster.autoscaling, scenario.cluster
    if a is None:
        return []
    problems = []
    if not a.min_replicas <= c.replicas <= a.max_replicas:
        problems.append(f"cluster.replicas: {c.replicas} (the starting fleet) must lie within "
                        f"cluster.autoscaling's min_replicas {a.min_replicas} and max_replicas {a.max_replicas}")
    if scenario.parallelism.dp > 1:
        problems.append("cluster.autoscaling: data-parallel engines (parallelism.dp > 1) are not modelled; "
                        "scale replicas of dp=1 engines")
    return problems


# ----------------------------------------------------------------------------- the HPA's arithmetic

def desired_replicas(metric: float, target: float, current: int, tolerance: float) -> int:
    """Step 1 of the module docstring (GetExternalPerPodMetricReplicas)."""
    ratio = metric / (target * current)
    if abs(1.0 - ratio) <= tolerance:
        return current
    return math.ceil(metric / target)


def stabilised(desired: int, current: int, history: list[tuple[float, int]], now: float,
               up_window_s: float, down_window_s: float) -> int:
    """Step 2: within [lowest of the up window, highest of the down window], starting from current.
    `history` holds earlier (time, desired) recommendations; the caller appends this one."""
    up = down = desired
    for when, rec in history:
        if when > now - up_window_s:
            up = min(up, rec)
        if when > now - down_window_s:
            down = max(down, rec)
    return min(max(current, up), down)


def rate_limited(proposal: int, current: int, events: list[tuple[float, int]], now: float,
                 config: Autoscaling) -> int:
    """Step 3: the default scale-up and scale-down policies (select: Max), each from the replicas
    at the start of its period, then min/max."""
    period = config.policy_period_s
    changed = sum(change for when, change in events if when > now - period)
    start = current - changed                       # replicas at the period's start
    if proposal > current:
        limit = max(start + config.scale_up_pods, math.ceil(start * (1 + config.scale_up_percent / 100)))
        proposal = min(proposal, max(limit, current))
    elif proposal < current:
        limit = math.ceil(start * (1 - config.scale_down_percent / 100))
        proposal = max(proposal, min(limit, current))
    return min(max(proposal, config.min_replicas), config.max_replicas)


# ----------------------------------------------------------------------------- the controller in a run

@dataclass
class ReplicaLife:
    """One replica's time on its GPUs: asked for, serving, draining, gone (None: not yet)."""
    replica: int
    requested_s: float
    ready_s: Optional[float] = None
    draining_s: Optional[float] = None
    stopped_s: Optional[float] = None


class Autoscaler:
    """Decides every interval_s over the simulation's replicas; `routable` is the router's list
    (ready, not draining), changed in place. `launch()` makes a new replica with its engine loop;
    `work_left()` says whether anything can still arrive or is in flight (else the loop ends)."""

    def __init__(self, config: Autoscaling, env, routable: list, launch: Callable, work_left: Callable[[], bool]):
        self.config, self.env, self.routable = config, env, routable
        self.launch, self.work_left = launch, work_left
        self.lives: dict[int, ReplicaLife] = {r.index: ReplicaLife(r.index, 0.0, 0.0) for r in routable}
        self.starting: list = []
        self.draining: dict[int, object] = {}
        self.history: list[tuple[float, int]] = []       # (time, desired) recommendations
        self.events: list[tuple[float, int]] = []        # (time, replicas added (+) or removed (-))
        self.decisions: list[dict] = []
        self.next_poll = config.interval_s     # (0 + interval: the first timeout)

    def process(self):
        """The HPA's loop, as a SimPy process."""
        env, interval = self.env, self.config.interval_s
        while True:
            self.next_poll = env.now + interval        # where SimPy's timeout lands, to the bit
            yield env.timeout(interval)
            if not self.work_left():
                self.next_poll = math.inf
                return
            self.decide(env.now)

    def metric(self) -> float:
        """The policy's gauge summed over the ready, non-draining replicas."""
        policy = self.config.policy
        if policy == "queue_depth":
            return float(sum(r.scheduler.num_waiting for r in self.routable))
        if policy == "running":
            return float(sum(r.scheduler.num_running for r in self.routable))
        return sum(r.scheduler.kv_figures()[0] / r.kv.pool.usable_blocks for r in self.routable)

    def decide(self, now: float) -> None:
        c = self.config
        current = len(self.routable) + len(self.starting)
        metric = self.metric()
        raw = desired_replicas(metric, c.target, current, c.tolerance)
        stable = stabilised(raw, current, self.history, now, c.scale_up_stabilization_s, c.scale_down_stabilization_s)
        self.history.append((now, raw))
        horizon = now - max(c.scale_up_stabilization_s, c.scale_down_stabilization_s, c.policy_period_s)
        self.history = [h for h in self.history if h[0] > horizon]
        final = rate_limited(stable, current, self.events, now, c)
        self.events = [e for e in self.events if e[0] > now - c.policy_period_s]
        if final != current:
            self.events.append((now, final - current))
        for _ in range(final - current):
            self._scale_up(now)
        for _ in range(current - final):
            self._scale_down(now)
        self.decisions.append({"time_s": now, "metric": metric, "replicas": current, "desired": raw,
                               "stabilised": stable, "decided": final, **self.counts()})

    def counts(self) -> dict[str, int]:
        return {"ready": len(self.routable), "starting": len(self.starting), "draining": len(self.draining)}

    def _scale_up(self, now: float) -> None:
        replica = self.launch()
        self.lives[replica.index] = ReplicaLife(replica.index, now)
        self.starting.append(replica)
        self.env.process(self._start(replica))

    def _start(self, replica):
        yield self.env.timeout(self.config.startup_s)
        if replica in self.starting:            # (not scaled away while it started)
            self.starting.remove(replica)
            self.routable.append(replica)
            self.lives[replica.index].ready_s = self.env.now

    def _scale_down(self, now: float) -> None:
        if self.starting:
            replica = self.starting.pop()       # newest starting one first: it serves nothing yet
            self.lives[replica.index].stopped_s = now
            return
        replica = max(self.routable, key=lambda r: (self.lives[r.index].ready_s, r.index))
        self.routable.remove(replica)
        self.lives[replica.index].draining_s = now
        self.draining[replica.index] = replica
        self.retired(replica, now)

    def retired(self, replica, now: float) -> None:
        """A replica finished requests: a draining one with nothing left stops now."""
        if replica.index in self.draining and not replica.scheduler.has_unfinished():
            del self.draining[replica.index]
            self.lives[replica.index].stopped_s = now

    def timeline(self) -> dict:
        return {"replicas": [asdict(life) for life in self.lives.values()], "decisions": self.decisions}


def gpu_seconds(lives: list[dict], end_s: float, gpus_per_replica: int) -> float:
    """GPU time of every replica from its request to its stop (or `end_s`, the run's end)."""
    total = 0.0
    for life in lives:
        stop = life["stopped_s"] if life["stopped_s"] is not None else end_s
        total += max(min(stop, end_s) - life["requested_s"], 0.0)
    return total * gpus_per_replica


def replicas_over_time(lives: list[dict], end_s: float) -> list[dict]:
    """At every change, a step function from t=0: replicas holding GPUs (draining ones too), the
    fleet the HPA counts (started or starting, not draining), and those serving (ready, not draining)."""
    changes = sorted({0.0, end_s, *(t for life in lives for t in (life["requested_s"], life["ready_s"],
                                                                  life["draining_s"], life["stopped_s"])
                                     if t is not None and t <= end_s)})
    rows = []
    for t in changes:
        held = counted = serving = 0
        for life in lives:
            stop = life["stopped_s"] if life["stopped_s"] is not None else math.inf
            if life["requested_s"] <= t < stop or (t == end_s and life["requested_s"] <= t and stop >= end_s):
                held += 1
                ready, drain = life["ready_s"], life["draining_s"]
                if drain is None or t < drain:
                    counted += 1
                    serving += ready is not None and ready <= t
        rows.append({"time_s": t, "replicas": held, "counted": counted, "serving": serving})
    return rows


def autoscaling_summary(timeline: dict, end_s: float, gpus_per_replica: int) -> dict:
    """The run summary's `autoscaling` entry: GPU-hours and the fleet's size over the run."""
    series = replicas_over_time(timeline["replicas"], end_s)
    held = gpu_seconds(timeline["replicas"], end_s, 1)
    return {"gpu_hours": held * gpus_per_replica / 3600, "mean_replicas": held / end_s if end_s > 0 else None,
            "peak_replicas": max(row["counted"] for row in series),
            "peak_replicas_holding_gpus": max(row["replicas"] for row in series),
            "replicas_started": len(timeline["replicas"]), "decisions": len(timeline["decisions"])}


def run_end(requests) -> float:
    """A run's end from its requests frame: the last finish, or arrival (a request rejected at once)."""
    return float(requests[["finish_s", "arrival_s"]].max().max())
