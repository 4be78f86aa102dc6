"""NVIDIA Dynamo's KV router (ai-dynamo/dynamo, lib/kv-router/src/scheduling/selector.rs at
ccd1706e, DefaultWorkerSelector; config.rs at c2f2e1aa for the defaults; the router's
per-worker bookkeeping in lib/llm/src/kv_router/sequence.rs, ActiveSequences).

For each replica w, with the request's prompt of `isl` tokens in blocks of `bs`:
    overlap(w)        cached leading blocks of the prompt on w (KV events: the engine's own cache)
    prefill_tokens(w) = the uncached prompt tokens of w's requests still in prefill (until their
                        first token) + isl - overlap(w) x bs
    decode_blocks(w)  = the distinct prompt blocks (full blocks) of w's requests in flight
                        + the request's blocks not among them
    logit(w)          = overlap_score_weight x prefill_tokens(w) / bs + decode_blocks(w)
Temperature 0: the lowest logit; a tie goes to the smallest tree size (blocks the indexer holds for
w), then to a random one. Temperature T > 0: sample w with probability proportional to
exp(-(logit(w) / (max - min)) / T), uniform when all logits are equal (softmax_sample).
Output blocks are not tracked (router_track_output_blocks defaults to false). (Later selectors,
selector/default.rs at 07a6c9ce, write the cost as prefill_load_scale x max(0, raw prefill blocks -
overlap_score_credit x overlap) + decode blocks, the same at their 1.0 defaults, and break ties at
random without the tree size.)"""
from __future__ import annotations

import math
from typing import Optional

from sim.core.request import Request
from sim.routers.config import DynamoRouter
from sim.routers.deployed import DeployedRouter
from sim.routers.regret import RoutingRegret
from sim.routers.state import RoutedBlocks, engine_hit_tokens, prompt_block_hashes, tie_break


class ActiveSequences:
    """One replica's requests as the router tracks them: prompt blocks shared by reference count,
    and the prefill tokens of those not yet past their first token."""

    def __init__(self):
        self.block_refs: dict[int, int] = {}
        self.blocks_of: dict[int, list[int]] = {}
        self.prefill_of: dict[int, tuple[Request, int]] = {}
        self.prefill_tokens = 0

    def add(self, req: Request, blocks: list[int], prefill_tokens: int) -> None:
        self.blocks_of[req.id] = blocks
        for h in blocks:
            self.block_refs[h] = self.block_refs.get(h, 0) + 1
        self.prefill_of[req.id] = (req, prefill_tokens)
        self.prefill_tokens += prefill_tokens

    def mark_prefill_completed(self, req_id: int) -> None:
        entry = self.prefill_of.pop(req_id, None)
        if entry is not None:
            self.prefill_tokens -= entry[1]

    def free(self, req_id: int) -> None:
        self.mark_prefill_completed(req_id)
        for h in self.blocks_of.pop(req_id, ()):
            left = self.block_refs[h] - 1
            if left:
                self.block_refs[h] = left
            else:
                del self.block_refs[h]

    def refresh_prefills(self) -> None:
        """A first token streamed back ends a request's prefill for the router."""
        for req_id in [i for i, (req, _) in self.prefill_of.items() if req.first_token_step >= 0]:
            self.mark_prefill_completed(req_id)

    def new_blocks(self, blocks: list[int]) -> int:
        refs = self.block_refs
        return sum(1 for h in blocks if h not in refs)


def softmax_pick(logits: list[float], temperature: float, u: float) -> int:
    """softmax_sample for temperature > 0: logits scaled by their range, the lowest likeliest;
    `u` a uniform draw in [0, 1), walked along the cumulative probabilities."""
    low, high = min(logits), max(logits)
    if low == high:
        probs = [1.0 / len(logits)] * len(logits)
    else:
        span = high - low
        scaled = [-(v / span) / temperature for v in logits]
        top = max(scaled)
        weights = [math.exp(s - top) for s in scaled]
        total = sum(weights)
        probs = [w / total for w in weights]
    cumulative = 0.0
    for i, p in enumerate(probs):
        cumulative += p
        if u <= cumulative:
            return i
    return len(logits) - 1


class DynamoKvRouter(DeployedRouter):
    name = "dynamo"

    def __init__(self, replicas: list, config: DynamoRouter, seed: int, regret: Optional[RoutingRegret] = None):
        super().__init__(replicas, seed, regret)
        self.config = config
        self.active = [ActiveSequences() for _ in replicas]
        self.approx = [RoutedBlocks() for _ in replicas]     # the ApproxKvIndexer (use_kv_events false)
        self._pending: tuple = ()

    def pick(self, req: Request) -> int:
        bs = self.replicas[0].kv.block_size
        blocks = prompt_block_hashes(req, bs)
        for active in self.active:
            active.refresh_prefills()
        overlaps = self.overlaps(req, blocks, bs)
        logits = self.logits(req.prompt_len, blocks, overlaps, bs)
        index = self.select(logits)
        self._pending = (blocks, req.prompt_len - overlaps[index] * bs)
        return index

    def overlaps(self, req: Request, blocks: list[int], bs: int) -> list[int]:
        if self.config.use_kv_events:
            return [engine_hit_tokens(r, req) // bs for r in self.replicas]
        now = req.arrival
        for view in self.approx:
            view.expire(now - self.config.router_ttl_secs)
        return [view.leading_matches(blocks) for view in self.approx]

    def logits(self, isl: int, blocks: list[int], overlaps: list[int], bs: int) -> list[float]:
        w = self.config.overlap_score_weight
        out = []
        for active, overlap in zip(self.active, overlaps):
            prefill_blocks = (active.prefill_tokens + max(0, isl - overlap * bs)) / bs
            decode_blocks = len(active.block_refs) + active.new_blocks(blocks)
            out.append(w * prefill_blocks + decode_blocks)
        return out

    def select(self, logits: list[float]) -> int:
        if self.config.router_temperature > 0:
            return softmax_pick(logits, self.config.router_temperature, float(self.rng.random()))
        low = min(logits)
        tied = [i for i, v in enumerate(logits) if v == low]
        if len(tied) == 1:
            return tied[0]
        sizes = [self.tree_size(i) for i in tied]
        smallest = min(sizes)
        return tie_break(self.rng, [i for i, s in zip(tied, sizes) if s == smallest])

    def tree_size(self, index: int) -> int:
        """The blocks the router's indexer holds for the replica: its cached blocks (KV events),
        or what the approximate index keeps."""
        if self.config.use_kv_events:
            return len(self.replicas[index].kv.pool.cached)
        return len(self.approx[index])

    def sent(self, index: int, req: Request) -> None:
        blocks, prefill_tokens = self._pending
        self.active[index].add(req, blocks, prefill_tokens)
        if not self.config.use_kv_events:
            view = self.approx[index]
            view.touch(blocks, req.arrival)
            if len(view) > self.config.router_max_tree_size:
                view.drop_oldest(int(self.config.router_max_tree_size * self.config.router_prune_target_ratio))

    def ended(self, index: int, req: Request) -> None:
        self.active[index].free(req.id)
