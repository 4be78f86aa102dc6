"""What the KV package hands out: a prefix hit (`KVCacheBlocks`), the cache's shape for the decode
cohort (`CacheLayout`) and the prefix-cache counters (`PrefixCacheStats`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class KVCacheBlocks:
    """The cached blocks a request starts from, one list per KV cache group (vLLM's KVCacheBlocks,
    vllm/v1/core/kv_cache_manager.py: a tuple of per-group block lists). `find_cached_prefix` makes
    it and `allocate_slots` / `would_fit` take it back; the scheduler passes it on without looking
    inside. A group that needs none of the hit (a sliding window's blocks before its run) holds
    the null block there; every group's list has the hit's length."""

    __slots__ = ("groups",)

    def __init__(self, groups: tuple):
        self.groups = groups

    def __repr__(self) -> str:
        return f"KVCacheBlocks({list(self.groups)!r})"

    @property
    def num_blocks(self) -> int:
        """The hit's length in blocks (the same in every group)."""
        return len(self.groups[0]) if self.groups else 0


NO_BLOCKS = KVCacheBlocks(())           # no hit (shared: never written)


@dataclass(frozen=True)
class CacheLayout:
    """The shape of a KV cache, as the decode cohort (sim/core/fast/cohort.py) and the leap planner
    must know it to take and publish their members' blocks in bulk exactly as `allocate_slots`
    would one by one. Each field answers one of their questions."""

    block_size: int
    paged: bool                   # blocks are taken as tokens are scheduled (contiguous: at admission)
    prefix_caching: bool
    private_blocks: bool          # a request's private blocks stay out of the hash map (coordinator.py)
    tables: int                   # blocks a request takes at each block crossing (one per group)
    per_group_tables: bool        # a request's tables are `Request.group_tables` (HybridCoordinator)
    sliding_window: Optional[int]     # the window a group frees behind, None without one
    named_blocks: bool            # every block has an id (BlockPool), not only the mapped ones

    @property
    def free_blocks_only_shrink(self) -> bool:
        """Do free blocks only shrink over a stretch of pure decode steps? (Not with per-group
        tables, whose sliding groups free behind their windows between crossings: the leap planner
        then leaps only with nobody waiting.)"""
        return not self.per_group_tables

    @property
    def takes_stretch_in_bulk(self) -> bool:
        """Can a stretch of decode steps take its blocks from the pool in one go (paged; with a
        table per group, the frees behind the windows follow step by step)? Otherwise the cohort
        replays the stretch step by step."""
        return self.paged


class PrefixCacheStats:
    """Token counts of prefix-cache lookups, as vLLM's PrefixCacheStats (first admissions only)."""

    __slots__ = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")

    def __init__(self) -> None:
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0

    def record(self, num_tokens: int, hit_tokens: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += hit_tokens
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
