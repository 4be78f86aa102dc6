"""`make_router`: the router `cluster.router` names, built-in (sim/router.py) or deployed (llm-d,
Dynamo, SGLang: this package)."""
from __future__ import annotations

from sim.router import LeastOutstandingTokens, PrefixAware, RoundRobin, Router
from sim.routers.config import DEPLOYED_ROUTERS
from sim.routers.dynamo import DynamoKvRouter
from sim.routers.llm_d import LlmDEndpointPicker
from sim.routers.regret import RoutingRegret
from sim.routers.sglang import SglangCacheAware


def make_router(cluster, replicas: list, seed: int = 0) -> Router:
    """The router `cluster.router` names; `seed` (the scenario's) seeds its random draws."""
    regret = RoutingRegret() if measures_regret(cluster) else None
    if cluster.router == "round_robin":
        return RoundRobin(replicas, regret)
    if cluster.router == "least_outstanding_tokens":
        return LeastOutstandingTokens(replicas, regret)
    if cluster.router == "prefix_aware":
        return PrefixAware(replicas, cluster.load_bound, regret)
    kinds = {"llm_d": (LlmDEndpointPicker, cluster.llm_d), "dynamo": (DynamoKvRouter, cluster.dynamo),
             "sglang": (SglangCacheAware, cluster.sglang)}
    kind, config = kinds[cluster.router]
    return kind(replicas, config, seed, regret)


def measures_regret(cluster) -> bool:
    """cluster.routing_regret, or unset: on for the deployed routers, off for the built-in ones
    (whose summaries then stay as they were)."""
    flag = cluster.routing_regret
    return flag if flag is not None else cluster.router in DEPLOYED_ROUTERS
