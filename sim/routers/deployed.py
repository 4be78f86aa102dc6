"""The deployed routers' common frame (sim/routers/factory.py builds them)."""
from __future__ import annotations

from typing import Optional

from sim.core.request import Request
from sim.router import Router
from sim.routers.regret import RoutingRegret
from sim.routers.state import InFlight, router_rng


class DeployedRouter(Router):
    """A router with its own bookkeeping of the requests in flight and seeded random draws:
    `pick(req)` returns a replica's position; what it learns of the choice goes into `sent`."""

    name = "deployed"

    def __init__(self, replicas: list, seed: int, regret: Optional[RoutingRegret] = None):
        super().__init__(replicas, regret)
        self.rng = router_rng(seed, self.name)
        self.in_flight = InFlight(len(replicas))

    def choose(self, req: Request):
        for index, ended in self.in_flight.prune():
            self.ended(index, ended)
        index = self.pick(req)
        self.in_flight.add(index, req)
        self.sent(index, req)
        return self.replicas[index]

    def pick(self, req: Request) -> int:
        raise NotImplementedError

    def sent(self, index: int, req: Request) -> None:
        """The router's own view after sending `req` to replica `index`."""

    def ended(self, index: int, req: Request) -> None:
        """The router saw `req` end on replica `index`."""
