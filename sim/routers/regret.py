"""Prefix-aware routing regret: the prefix-cache hits a router gave up against an oracle.

At each request's arrival (the moment the router decides), for every replica r, hit(r) = the
prompt tokens r's prefix cache holds for the request then (the engine's own lookup, full blocks).
The oracle sends the request to the replica with the largest hit(r); the router's choice c gets
hit(c). Over the measured (non-warm-up) requests routed among two or more replicas:

    lost_hit_tokens  = sum(max_r hit(r) - hit(c))
    hit_rate_lost    = lost_hit_tokens / prompt tokens          (points of prefix hit rate given up)
    regret_fraction  = lost_hit_tokens / sum(max_r hit(r))      (share of the oracle's hits lost)

Both hits are measured at arrival: what the request finally reuses at admission can differ either
way (blocks evicted or added while it waits), which the run's prefix_hit_rate reports.
The oracle is greedy and load-blind: it is an upper bound on the hits of one routing decision
given the caches at that moment, not the best hit rate any routing policy could reach overall.
"""
from __future__ import annotations

from sim.core.request import Request
from sim.routers.state import engine_hit_tokens


class RoutingRegret:
    def __init__(self):
        self.requests = 0
        self.misrouted = 0            # requests whose replica held a shorter prefix than the best
        self.prompt_tokens = 0
        self.oracle_hit_tokens = 0
        self.routed_hit_tokens = 0

    def observe(self, req: Request, chosen, replicas: list) -> None:
        """Record one routing decision (before the request reaches the replica)."""
        if req.is_warmup:
            return
        hits = [engine_hit_tokens(r, req) for r in replicas]
        best, got = max(hits), hits[replicas.index(chosen)]
        self.requests += 1
        self.misrouted += got < best
        self.prompt_tokens += req.prompt_len
        self.oracle_hit_tokens += best
        self.routed_hit_tokens += got

    def figures(self) -> dict:
        lost = self.oracle_hit_tokens - self.routed_hit_tokens
        return {
            "requests": self.requests,
            "requests_misrouted": self.misrouted,
            "prompt_tokens": self.prompt_tokens,
            "oracle_hit_tokens": self.oracle_hit_tokens,
            "routed_hit_tokens": self.routed_hit_tokens,
            "lost_hit_tokens": lost,
            "hit_rate_lost": lost / self.prompt_tokens if self.prompt_tokens else 0.0,
            "regret_fraction": lost / self.oracle_hit_tokens if self.oracle_hit_tokens else 0.0,
        }
