"""What a deployed router knows, modelled as it has it: the requests it sent and has not seen end
(its own bookkeeping), the replicas' real cached blocks (KV events, read at routing time), or its
own index of the blocks it sent where (approximate). A router reads its state only when a request
arrives, so pruning what ended at that moment equals pruning on each completion event."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import numpy as np

from sim.core.request import Request, stable_key
from sim.core.status import REJECTED


def router_rng(seed: int, name: str) -> np.random.Generator:
    """The router's random draws (softmax sampling, random tie-breaks): seeded by the scenario."""
    return np.random.Generator(np.random.PCG64(stable_key("router", seed, name)))


def prompt_block_hashes(req: Request, block_size: int) -> list[int]:
    """The hashes of the prompt's full blocks (each identifies all content up to its end)."""
    n = req.prompt_len // block_size
    req.extend_block_hashes(n, block_size)
    return req.block_hashes[:n]


def engine_hit_tokens(replica, req: Request) -> int:
    """The prompt tokens the replica's prefix cache holds for `req` now (its own lookup: full
    blocks, at most (prompt - 1) // block_size of them, vLLM's rule)."""
    if req.num_computed:
        return 0
    return replica.kv.find_cached_prefix(req)[1]


def tie_break(rng: np.random.Generator, candidates: list[int]) -> int:
    """One of several equally good replicas, drawn uniformly (each source breaks ties by a random
    draw or by a hash map's arbitrary order; a seeded draw models both)."""
    if len(candidates) == 1:
        return candidates[0]
    return candidates[int(rng.integers(len(candidates)))]


class InFlight:
    """Per replica, the requests the router sent there and has not yet seen end."""

    def __init__(self, num_replicas: int):
        self.by_replica: list[dict[int, Request]] = [{} for _ in range(num_replicas)]

    def add(self, index: int, req: Request) -> None:
        self.by_replica[index][req.id] = req

    def prune(self) -> list[tuple[int, Request]]:
        """Forget the requests that ended (finished, rejected, aborted); returns them."""
        ended = []
        for index, live in enumerate(self.by_replica):
            done = [req for req in live.values() if req.is_finished]
            for req in done:
                del live[req.id]
                ended.append((index, req))
        return ended

    def count(self, index: int) -> int:
        return len(self.by_replica[index])


def was_rejected(req: Request) -> bool:
    return req.status is REJECTED


class RoutedBlocks:
    """One replica's blocks as a router infers them from what it sent there: block hash -> last
    time the router sent or matched it, least recent first."""

    def __init__(self):
        self.blocks: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def leading_matches(self, hashes: Iterable[int]) -> int:
        """How many of the hashes, from the first, this replica holds without a gap."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Iterable[int], now: float) -> None:
        """Record (or refresh) the hashes as sent at `now`, in order."""
        blocks = self.blocks
        for h in hashes:
            blocks[h] = now
            blocks.move_to_end(h)

    def drop_oldest(self, keep: int) -> None:
        """Evict the least recently touched until at most `keep` remain."""
        blocks = self.blocks
        while len(blocks) > keep:
            blocks.popitem(last=False)

    def expire(self, cutoff: float) -> None:
        """Drop the blocks last touched at or before `cutoff`."""
        blocks = self.blocks
        while blocks:
            h, t = next(iter(blocks.items()))
            if t > cutoff:
                break
            del blocks[h]
