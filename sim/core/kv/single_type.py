"""One manager per KV cache group, by the group's attention type: vLLM's single-type managers
(vllm/v1/core/single_type_kv_cache_manager.py, 0.19: FullAttentionManager, SlidingWindowManager).

A group's manager knows what its attention type needs of a request's table: which cached blocks
a new request can start from (`find_longest_cache_hit`, over all the groups of its type at once,
as vLLM's classmethod does) and, for a sliding window, which blocks fell behind it
(`remove_skipped_blocks`). The coordinator (sim/core/kv/coordinator.py) runs them over a request's
tables; the pool (sim/core/kv/block_pool.py) is shared by every group.
"""
from __future__ import annotations

from itertools import repeat
from operator import and_, xor

from sim.core.kv.block_pool import NULL_BLOCK, BlockPool
from sim.core.memory import sliding_window_hit_run, sliding_window_skipped_blocks


def group_salt(group: int) -> int:
    """What a block hash is XORed with to key it in KV cache group `group`: 0 for group 0, else a
    64-bit hash of the group id (of ints only, so the same in every process)."""
    return 0 if group == 0 else hash((group, 0x9E3779B97F4A7C15))


def group_key(block_hash: int, group: int) -> int:
    """The prefix-cache key of a block hash in KV cache group `group` (vLLM keys its map by
    (hash, group id)): group 0 keeps the hash itself, so a one-group pool keys by the hash; another
    group XORs it with a salt of its own, a 64-bit hash, so two keys collide with the chance two
    block hashes do (and a request's keys are one C-speed `map` over its hashes: group_keys)."""
    return block_hash ^ group_salt(group)


def group_keys(hashes: list[int], group: int) -> list[int]:
    """The prefix-cache keys of block hashes in `group` (group 0: the hashes themselves)."""
    # (operator.xor: a bound int.__xor__ is a slot wrapper, ~1,100 instructions an element under 3.11)
    return hashes if group == 0 else list(map(xor, hashes, repeat(group_salt(group))))


class FullAttentionManager:
    """A full-attention group: a request holds every block of its context."""

    sliding = False

    def __init__(self, group_id: int):
        self.group_id = group_id

    @staticmethod
    def find_longest_cache_hit(pool: BlockPool, hashes: list[int], max_blocks: int,
                               group_ids: list[int]) -> list[list[int]]:
        """Per group in `group_ids`, the blocks of the longest run of leading blocks cached in every
        one of them (a left-to-right scan that stops at the first miss)."""
        lookup = pool.cached.get
        if len(group_ids) == 1:                # one group: its keys looked up at C speed
            hits = list(map(lookup, group_keys(hashes[:max_blocks], group_ids[0])))
            if None in hits:
                del hits[hits.index(None):]
            return [hits]
        tables: list[list[int]] = [[] for _ in group_ids]
        for i in range(max_blocks):
            found = [lookup(group_key(hashes[i], g)) for g in group_ids]
            if None in found:
                break
            for table, block in zip(tables, found):
                table.append(block)
        return tables


class SlidingWindowManager:
    """A sliding-window group: a request needs only the blocks its window still reaches; the ones
    behind it go back to the pool and leave the null block in the table."""

    sliding = True

    def __init__(self, group_id: int, window: int, block_size: int):
        self.group_id = group_id
        self.window = window
        self.block_size = block_size

    @staticmethod
    def find_longest_cache_hit(pool: BlockPool, hashes: list[int], max_blocks: int, group_ids: list[int],
                               window: int, block_size: int) -> tuple[int, int]:
        """The blocks [first, end) of the hit the sliding groups `group_ids` take: a run of
        cdiv(window - 1, block_size) blocks cached in every one of them, scanned from the right
        within the first `max_blocks` (a run reaching block 0 counts even when shorter)."""
        cached = None                      # is block i cached in every group (looked up at C speed)
        for g in group_ids:
            found = list(map(pool.cached.__contains__, group_keys(hashes[:max_blocks], g)))
            cached = found if cached is None else list(map(and_, cached, found))
        return sliding_window_hit_run(cached, block_size, window)

    def skipped_blocks(self, num_computed: int) -> int:
        """Leading table entries behind the window of the token after `num_computed`."""
        return sliding_window_skipped_blocks(num_computed, self.block_size, self.window)

    def remove_skipped_blocks(self, table: list[int], skipped: int) -> list[int]:
        """Null the table's entries before `skipped`, nearest first, stopping at the first already
        null; returns the blocks removed, in that order (to be freed)."""
        last = skipped - 1
        if last < 0 or table[last] == NULL_BLOCK:
            return []
        if last == 0 or table[last - 1] == NULL_BLOCK:    # a decode step's one block (most calls)
            removed = [table[last]]
        else:                              # several (a prefill chunk's): back to the last null, at C speed
            before = table[:last]
            first = last - before[::-1].index(NULL_BLOCK) if NULL_BLOCK in before else 0
            removed = table[first:skipped]
            removed.reverse()
        table[skipped - len(removed):skipped] = [NULL_BLOCK] * len(removed)
        return removed
