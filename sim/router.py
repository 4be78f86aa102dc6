"""Routing requests across replicas: round-robin, least outstanding tokens, prefix-aware, and the
routers people deploy (sim/routers/: llm-d, Dynamo, SGLang)."""
from __future__ import annotations

from typing import Optional

from sim.core.request import Request
from sim.core.status import REJECTED
from sim.routers.regret import RoutingRegret


class Router:
    def __init__(self, replicas: list, regret: Optional[RoutingRegret] = None):
        self.replicas = replicas
        self._next = 0
        self.regret = regret

    def route(self, req: Request) -> None:
        if len(self.replicas) == 1:
            replica = self.replicas[0]
        else:
            replica = self.choose(req)
            if self.regret is not None:
                self.regret.observe(req, replica, self.replicas)
        replica.submit(req)
        if req.status is REJECTED:
            reject_follow_ups(req)

    def choose(self, req: Request):
        raise NotImplementedError

    def figures(self) -> dict:
        """What the run's records keep of the router (summary.json: routing_regret)."""
        return {} if self.regret is None else {"routing_regret": self.regret.figures()}


class RoundRobin(Router):
    def choose(self, req: Request):
        replica = self.replicas[self._next % len(self.replicas)]
        self._next += 1
        return replica


class LeastOutstandingTokens(Router):
    """The replica with the fewest prompt + output tokens routed to it and not yet finished."""

    def choose(self, req: Request):
        return min(self.replicas, key=lambda r: (r.outstanding_tokens, r.index))


class PrefixAware(LeastOutstandingTokens):
    """The replica whose cache holds the longest prefix of the request, unless it is overloaded.

    A replica is eligible while its outstanding tokens stay within `load_bound` x the mean
    (plus this request), so one hot prefix cannot pin all traffic to one replica.
    """

    def __init__(self, replicas: list, load_bound: float, regret: Optional[RoutingRegret] = None):
        super().__init__(replicas, regret)
        self.load_bound = load_bound

    def choose(self, req: Request):
        mean = sum(r.outstanding_tokens for r in self.replicas) / len(self.replicas)
        limit = self.load_bound * mean + req.max_len
        best, best_hit = None, 0
        for replica in self.replicas:
            if replica.outstanding_tokens > limit:
                continue
            hit = replica.kv.find_cached_prefix(req)[1]
            if hit > best_hit:
                best, best_hit = replica, hit
        return best if best is not None else super().choose(req)


def reject_follow_ups(req: Request) -> None:
    """Later turns of a rejected conversation can never arrive: reject them with the reason."""
    turn = req.next_turn
    while turn is not None:
        turn.status = REJECTED
        turn.reject_reason = f"an earlier turn (request {req.id}) was rejected"
        turn = turn.next_turn
