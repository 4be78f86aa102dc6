"""SGLang's cache-aware router (sgl-project/sglang, sgl-router/src/policies/cache_aware.rs at
b6f20641, the approximate tree in sgl-router/src/policies/tree.rs at 4d40eec0; defaults as
launch_router starts it, sgl-router/py_src/sglang_router/router_args.py at e46dcd87).

Per request, with load(w) = the requests the router has in flight on worker w:
  imbalanced  = max - min load > balance_abs_threshold  and  max > min x balance_rel_threshold
  imbalanced: the least loaded worker (the first of them), the request still entered in its tree;
  balanced:   the longest prefix match over every worker's approximate tree (the router's record
              of the prompts it sent there, refreshed on each match, evicted least-recent-leaf
              first every eviction_interval_secs down to max_tree_size per worker);
              match rate = matched / prompt; above cache_threshold the worker holding the match,
              else the worker with the smallest tree; the request entered in the chosen tree.
The tree here holds the prompt's full KV blocks (hash chains), not characters: a match, the
rate and the tree size count whole blocks of tokens."""
from __future__ import annotations

from typing import Optional

import numpy as np

from sim.core.request import Request
from sim.routers.config import SglangRouter
from sim.routers.deployed import DeployedRouter
from sim.routers.regret import RoutingRegret
from sim.routers.state import prompt_block_hashes, tie_break


def is_imbalanced(loads: list[int], abs_threshold: int, rel_threshold: float) -> bool:
    """cache_aware.rs select_worker: both conditions; the relative one in f32, as Rust's."""
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and np.float32(high) > np.float32(low) * np.float32(rel_threshold)


class ApproximateTree:
    """One worker's tree: block hash -> (last access time, depth in the prompt)."""

    def __init__(self):
        self.nodes: dict[int, tuple[float, int]] = {}

    def size_blocks(self) -> int:
        return len(self.nodes)

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.nodes:
                break
            n += 1
        return n

    def touch(self, hashes: list[int], now: float) -> None:
        """Tree.insert, and prefix_match's timestamp refresh along the matched path."""
        nodes = self.nodes
        for depth, h in enumerate(hashes):
            nodes[h] = (now, depth)

    def evict_to(self, max_blocks: int) -> None:
        """evict_tenant_by_size: least recently used leaves first (a path shares its access time,
        so among equal times the deepest block is the leaf) until the tree fits."""
        excess = len(self.nodes) - max_blocks
        if excess <= 0:
            return
        order = sorted(self.nodes.items(), key=lambda kv: (kv[1][0], -kv[1][1]))
        for h, _ in order[:excess]:
            del self.nodes[h]


class SglangCacheAware(DeployedRouter):
    name = "sglang"

    def __init__(self, replicas: list, config: SglangRouter, seed: int, regret: Optional[RoutingRegret] = None):
        super().__init__(replicas, seed, regret)
        self.config = config
        self.trees = [ApproximateTree() for _ in replicas]
        self.evictions_done = 0
        self._hashes: list[int] = []

    def pick(self, req: Request) -> int:
        self.evict_due(req.arrival)
        bs = self.replicas[0].kv.block_size
        self._hashes = hashes = prompt_block_hashes(req, bs)
        c = self.config
        loads = [self.in_flight.count(i) for i in range(len(self.replicas))]
        if is_imbalanced(loads, c.balance_abs_threshold, c.balance_rel_threshold):
            return loads.index(min(loads))
        matches = [tree.match(hashes) for tree in self.trees]
        best = max(matches)
        if best == 0:
            return self.smallest_tree()
        holder = tie_break(self.rng, [i for i, m in enumerate(matches) if m == best])
        self.trees[holder].touch(hashes[:best], req.arrival)        # prefix_match refreshes its path
        rate = best * bs / req.prompt_len
        return holder if rate > c.cache_threshold else self.smallest_tree()

    def smallest_tree(self) -> int:
        sizes = [tree.size_blocks() for tree in self.trees]
        low = min(sizes)
        return tie_break(self.rng, [i for i, s in enumerate(sizes) if s == low])

    def sent(self, index: int, req: Request) -> None:
        self.trees[index].touch(self._hashes, req.arrival)

    def evict_due(self, now: float) -> None:
        """The eviction thread runs every eviction_interval_secs from the router's start; between
        two routings nothing enters the trees, so the evictions due since the last one act as one."""
        due = int(now // self.config.eviction_interval_secs)
        if due > self.evictions_done:
            self.evictions_done = due
            bs = self.replicas[0].kv.block_size
            for tree in self.trees:
                tree.evict_to(self.config.max_tree_size // bs)
