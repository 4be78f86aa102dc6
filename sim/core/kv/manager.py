"""`KVCacheManager`: the KV cache as the scheduler, the decode cohort and the engine see it, as
vLLM's kv_cache_manager.py (0.19) presents it over a coordinator.

The manager owns the pool, the prefix-cache counters and the slots held; how a request's blocks are
looked up, taken and freed over the KV cache groups is its coordinator's
(sim/core/kv/coordinator.py: one full-attention group, or several groups with sliding windows,
each run by its single-type manager, sim/core/kv/single_type.py). Callers never ask which: a
prefix hit is a `KVCacheBlocks` they hand back unopened, and what the fast paths must know of the
cache's shape is `layout()`.
"""
from __future__ import annotations

from typing import Optional

from sim.core.kv.block_pool import BlockPool
from sim.core.kv.blocks import CacheLayout, PrefixCacheStats
from sim.core.kv.coordinator import HybridCoordinator, UnitaryCoordinator
from sim.core.memory import KVCacheGroups


class KVCacheManager:
    """Decides how many blocks a request holds and which cached blocks it reuses.

    The calls in its coordinator's `API` are the coordinator's own methods, bound here (no call in
    between on the hot path): `find_cached_prefix(req) -> (KVCacheBlocks, hit tokens)`,
    `allocate_slots(req, n, hit, gate_tokens, reserve_free, lookahead_tokens) -> bool`,
    `append_slots(req, n, lookahead_tokens) -> bool`, `would_fit(...)`, `register_full_blocks`,
    `free(req)`, `blocks_needed_at_most(req)`, and the decode cohort's bulk helpers
    (`filled_entries`; `frees_behind_window`, `remove_skipped_blocks` and `free_behind_windows`
    with a table per group).

    `allocation="contiguous"` reserves a request's whole length at admission (one group only).
    `groups`: the model's KV cache groups (sim/core/memory.py); None or one full-attention group
    is the unitary coordinator. `max_num_batched_tokens`: the most tokens a request computes in
    one step (a static batch: a whole sequence), which bounds the blocks a sliding group holds.
    `pool_class`: the block pool. The simulator passes its id-light pool
    (sim/core/fast/counting_pool.py: names only the blocks the prefix cache maps); the engine
    `BlockPool`, whose every block has an id (they address its KV tensors).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 allocation: str = "paged", max_model_len: Optional[int] = None,
                 contiguous_reserve: str = "max_model_len", *, pool_class: type[BlockPool] = BlockPool,
                 groups: Optional[KVCacheGroups] = None, max_num_batched_tokens: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if allocation not in ("paged", "contiguous"):
            raise ValueError(f"allocation must be 'paged' or 'contiguous', got {allocation!r}")
        unitary = groups is None or not groups.is_hybrid and groups.full_groups <= 1
        if not unitary and allocation != "paged":
            raise ValueError(f"allocation '{allocation}' cannot free the blocks behind a sliding window; use 'paged'")
        self._settings = (num_blocks, block_size, enable_caching, allocation, max_model_len, contiguous_reserve)
        self._keywords = dict(pool_class=pool_class, groups=groups, max_num_batched_tokens=max_num_batched_tokens)
        named = pool_class.names_every_block
        self.pool = pool_class(num_blocks, enable_caching)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()
        # Slots in blocks held, counted once per owner (a shared block counts for each holder,
        # as do its tokens), so held_slots - tokens computed = unfilled slots (slack).
        self.held_slots = 0
        if unitary:
            self.coordinator = UnitaryCoordinator(self, self.pool, block_size=block_size, enable_caching=enable_caching,
                                                  contiguous=allocation == "contiguous", max_model_len=max_model_len,
                                                  contiguous_reserve=contiguous_reserve, named=named)
        else:
            self.coordinator = HybridCoordinator(self, self.pool, block_size=block_size, enable_caching=enable_caching,
                                                 groups=groups, max_num_batched_tokens=max_num_batched_tokens,
                                                 named=named)
        for name in self.coordinator.API:
            setattr(self, name, getattr(self.coordinator, name))

    def empty_copy(self) -> "KVCacheManager":
        """A manager with the same settings and a fresh pool (no block held, nothing cached)."""
        return KVCacheManager(*self._settings, **self._keywords)

    def layout(self) -> CacheLayout:
        c = self.coordinator
        return CacheLayout(block_size=self.block_size, paged=c.paged, prefix_caching=self.enable_caching,
                           private_blocks=c.private_blocks, tables=c.num_groups, per_group_tables=c.per_group_tables,
                           sliding_window=c.window, named_blocks=c.named)

    def set_sliding_admission_cap(self, on: bool) -> None:
        """vLLM >= 0.20 caps a sliding-window group's admission need at its window; 0.19 asks every
        block of the prompt (the scheduler sets it from its config; full attention has no window)."""
        if self.coordinator.window is not None:
            self.coordinator.sliding_admission_cap = on

    @property
    def is_one_full_attention_group(self) -> bool:
        """One table per request, of full attention (what vLLM 0.19's OffloadingConnector takes)."""
        return not self.coordinator.per_group_tables

    # -- counters -------------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage: referenced blocks / usable blocks (cached-free count as free)."""
        return self.pool.num_used / self.pool.usable_blocks


def new_kv_manager(num_blocks: int, block_size: int, enable_caching: bool = True, allocation: str = "paged",
                   max_model_len: Optional[int] = None, contiguous_reserve: str = "max_model_len",
                   groups: Optional[KVCacheGroups] = None, max_num_batched_tokens: int = 0,
                   pool_class: type[BlockPool] = BlockPool) -> KVCacheManager:
    """The manager for a model's KV cache groups (KVCacheManager's arguments, positionally as the
    simulator and engine pass them)."""
    return KVCacheManager(num_blocks, block_size, enable_caching, allocation, max_model_len, contiguous_reserve,
                          pool_class=pool_class, groups=groups, max_num_batched_tokens=max_num_batched_tokens)
