"""Block pool, paged/contiguous allocation and the prefix cache, as in vLLM V1.

Mechanism (`BlockPool`): reference counts, a free queue in LRU order, the hash -> block
map. Policy (`KVCacheManager`): how many blocks a request gets this step, which cached
blocks it hits. No notion of time; the scheduler calls these between steps.

vLLM behaviours copied on purpose (docs/vllm_semantics.md sections 2-3; vLLM's
vllm/v1/core/block_pool.py, kv_cache_manager.py):
- block 0 is the null block, never handed out;
- only full blocks are hashed; a hash chains the parent's hash with the block's tokens;
- hashes are registered when slots are allocated (schedule time), not after the step;
- freed blocks keep their hash and stay reusable until popped for reuse (lazy eviction),
  a request's blocks are freed last-first, so its tail is evicted before its head;
- a block that fills with content already cached is registered too (several blocks per
  hash; a lookup returns the first registered, the next takes over when it is evicted);
- lookup happens only for requests with nothing computed, stops at the first miss and
  always leaves at least the last prompt token to compute.
One departure, invisible to every lookup and figure: blocks only their own request can ever look
up (`KVCacheManager.private_blocks`) stay out of the hash map unless that request is preempted.
The simulator's pool (`CountingBlockPool`) goes further: only blocks the hash map holds have an
id; the others are counted (ANON in a block table).
"""
from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass
from operator import and_
from typing import Optional

from sim.core.memory import KVCacheGroups, cdiv, sliding_window_hit_run, sliding_window_skipped_blocks
from sim.core.request import Request
from sim.core.status import FINISHED

NULL_BLOCK = 0
# The simulator's pool (CountingBlockPool) names only the blocks the hash map holds. A block table
# holds ANON for any other block; its free queue holds CACHED for a free block with private content
# (it counts as cached, and its reuse as an eviction) and EMPTY for one with none.
ANON, CACHED, EMPTY = -1, -2, -3


class _Private:
    """The mark of a full block registered privately: it holds content (it counts as cached when
    freed, and its reuse counts as an eviction) that no lookup can ask for, so it stays out of
    the hash map and needs no hash (Request.first_private_block)."""

    def __repr__(self) -> str:
        return "PRIVATE"


PRIVATE = _Private()


class BlockPool:
    """Physical blocks: ref counts, an LRU free queue and the prefix-cache hash map.

    The free queue is the blocks never handed out yet (a range: they come first, in id order),
    then a list read from `_head` on, with lazy deletion: a block revived from the
    middle of the queue (a cache hit on a free block) leaves a stale entry behind, whose position
    goes on a heap; takes skip the stale positions and a block freed again is appended anew. So a
    take of n blocks with no stale entry among them is one list slice, a free is one extend, and
    the per-block work left is the reference counts and the hashes, in plain loops.
    """

    # The queue drops its taken front, and rebuilds without its stale entries, once they pass
    # this many and half the list: each costs O(list) after O(list) takes or revivals.
    compact_at = 4096

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK] = 1
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self._fresh = 1                    # blocks _fresh .. num_blocks - 1 were never handed out
        self._queue: list[int] = []        # blocks freed since, oldest first (from _head on)
        self._head = 0                     # index in _queue of the oldest entry not yet taken
        self._base = 0                     # entries dropped from the front of _queue (compaction)
        # where each free block's live entry is (an index counted from the first entry ever queued);
        # only read for blocks in the queue, to mark that entry stale when the block is revived.
        # A typed array: storing a position allocates no int object and frees none (the pool is
        # large and its blocks come back in scattered order, so each would be a cache miss).
        self._where = array("q", bytes(8 * num_blocks)) if enable_caching else None
        self._stale: list[int] = []        # heap of the positions of stale entries
        self.num_free = num_blocks - 1
        # block hash -> the first block holding it (the one a lookup returns). vLLM never
        # de-duplicates a block that fills with content already cached (block tables are
        # append-only), so a hash can have several blocks: the later ones wait in `duplicates`,
        # in insertion order, and take over when the first is evicted.
        self.cached: dict[int, int] = {}
        self.duplicates: dict[int, list[int]] = {}
        self.num_cached_free = 0              # free blocks that still hold a hash (revivable)
        self.evictions = 0

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    @property
    def free_queue(self) -> list[int]:
        """The free blocks in LRU order, oldest first (a copy: tests and checks read it)."""
        return [*range(self._fresh, self.num_blocks), *self._freed_queue()]

    def _freed_queue(self) -> list[int]:
        stale = set(self._stale)
        start = self._base + self._head
        return [b for i, b in enumerate(self._queue[self._head:], start) if i not in stale]

    def get_new_blocks(self, n: int, evicted_at: Optional[list[int]] = None) -> list[int]:
        """Take the n least recently freed blocks (reference 1 each), evicting the hashes they still
        hold; `evicted_at`, if given, gets the index (in the returned list) of each evicting block."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        blocks = self._pop(n)
        ref = self.ref_cnt
        for block in blocks:
            ref[block] = 1
        if self.num_cached_free:     # lazy eviction (a block holds a hash only while the map holds it)
            self._drop_hashes(blocks, evicted_at)
        return blocks

    def take_one(self) -> int:
        """Pop the least recently freed block, evicting its cached hash if it still has one."""
        return self.get_new_blocks(1)[0]

    def _pop(self, n: int) -> list[int]:
        """The first n live entries of the free queue, removed."""
        self.num_free -= n
        fresh = self._fresh
        if fresh == self.num_blocks:
            return self._pop_freed(n)
        k = min(n, self.num_blocks - fresh)
        self._fresh = fresh + k
        blocks = list(range(fresh, fresh + k))
        return blocks if k == n else blocks + self._pop_freed(n - k)

    def _pop_freed(self, n: int) -> list[int]:
        queue, head, stale = self._queue, self._head, self._stale
        end = head + n
        if not stale or stale[0] >= self._base + end:
            blocks = queue[head:end]
        else:                                    # skip the stale entries on the way
            blocks = []
            pos = self._base + head
            while len(blocks) < n:
                if stale and stale[0] == pos:
                    heapq.heappop(stale)
                else:
                    blocks.append(queue[pos - self._base])
                pos += 1
            end = pos - self._base
        self._head = end
        if end > self.compact_at and end * 2 > len(queue):
            del queue[:end]
            self._base += end
            self._head = 0
        return blocks

    def _drop_hashes(self, blocks: list[int], evicted_at: Optional[list[int]] = None) -> None:
        """Evict the hashes these blocks still hold (they are being reused, or evicted on request)."""
        hashes, cached, duplicates = self.block_hash, self.cached, self.duplicates
        dropped = 0
        for i, block in enumerate(blocks):
            h = hashes[block]
            if h is not None:
                hashes[block] = None
                if h is not PRIVATE:             # (a private block has no map entry)
                    if h in duplicates:
                        self._forget(h, block)
                    else:
                        del cached[h]
                dropped += 1
                if evicted_at is not None:
                    evicted_at.append(i)
        self.num_cached_free -= dropped
        self.evictions += dropped

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cache-hit blocks, reviving those sitting in the free queue."""
        ref = self.ref_cnt
        for block in blocks:
            count = ref[block]
            if not count:
                if not self.enable_caching:
                    raise AssertionError("cache hits in a pool without prefix caching")
                heapq.heappush(self._stale, self._where[block])
                self.num_free -= 1
                self.num_cached_free -= 1
            ref[block] = count + 1
        if len(self._stale) > self.compact_at and len(self._stale) * 2 > len(self._queue) - self._head:
            self._compact()

    def free_among(self, blocks: list[int]) -> int:
        """How many of these blocks are free (cache hits on them take them off the free queue)."""
        return list(map(self.ref_cnt.__getitem__, blocks)).count(0)

    def touch_shared(self, blocks: list[int]) -> Optional[int]:
        """touch() for a request's prefix hit; returns the key of a shared lease on the blocks, or None.
        (The engine's pool takes a reference per block and holder: it never leases.)"""
        self.touch(blocks)
        return None

    def _compact(self) -> None:
        """Rebuild the queue without its stale entries (when they outnumber the live ones)."""
        live = self._freed_queue()
        self._queue, self._head, self._base, self._stale = live, 0, 0, []
        where = self._where
        for i, block in enumerate(live):
            if block > 0:                  # (CountingBlockPool's unnamed entries have no position kept)
                where[block] = i

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one reference each; blocks reaching zero join the tail of the free queue in the given order."""
        ref, hashes = self.ref_cnt, self.block_hash
        if not self.enable_caching:          # never shared, never revived: every count drops 1 -> 0
            for block in blocks:
                ref[block] = 0
            self._queue += blocks
            self.num_free += len(blocks)
            return
        freed = []
        revivable = 0
        for block in blocks:
            left = ref[block] - 1
            ref[block] = left
            if not left:
                freed.append(block)
                if hashes[block] is not None:
                    revivable += 1
        if not freed:
            return
        queue, where = self._queue, self._where
        for i, block in enumerate(freed, self._base + len(queue)):
            where[block] = i
        queue += freed
        self.num_free += len(freed)
        self.num_cached_free += revivable

    def free_table(self, table: list[int], num_registered: int, lease: Optional[int] = None) -> None:
        """Free a request's block table (its first `num_registered` blocks full and registered),
        last block first: its tail is evicted first. The table is consumed; `lease`: what
        touch_shared returned for its prefix hit."""
        table.reverse()
        self.free_blocks(table)

    def cache_blocks(self, blocks: list[int], hashes: list[int]) -> None:
        """Register full blocks under their hashes (beside any other block with the same content);
        a block that already holds a hash keeps it."""
        held, setdefault = self.block_hash, self.cached.setdefault
        for block, block_hash in zip(blocks, hashes):
            if held[block] is None:
                held[block] = block_hash
                if setdefault(block_hash, block) != block:
                    self.duplicates.setdefault(block_hash, []).append(block)

    def cache_private(self, blocks: list[int]) -> None:
        """Mark full blocks as holding private content (none of them holds a hash yet)."""
        held = self.block_hash
        for block in blocks:
            if held[block] is None:
                held[block] = PRIVATE

    def publish(self, blocks: list[int], hashes: list[int]) -> None:
        """Map full blocks registered privately (or not marked yet), in order."""
        held = self.block_hash
        for block in blocks:
            if held[block] is PRIVATE:
                held[block] = None
        self.cache_blocks(blocks, hashes)

    def cache_block(self, block: int, block_hash: int) -> None:
        """Register one full block under its hash."""
        self.cache_blocks((block,), (block_hash,))

    def evict(self, blocks: list[int]) -> None:
        """Drop the cached hashes of free blocks, which stay free where they are (as vLLM's
        BlockPool.evict_blocks; tests use it to lose a chosen block)."""
        for block in blocks:
            if self.ref_cnt[block] or self.block_hash[block] is None:
                raise ValueError(f"block {block} is not a free cached block")
        self._drop_hashes(blocks)

    def _forget(self, block_hash: int, block: int) -> None:
        """Drop one block from a hash's entry; the next duplicate, if any, becomes the one found."""
        dups = self.duplicates.get(block_hash)
        if self.cached[block_hash] == block:
            if dups:
                self.cached[block_hash] = dups.pop(0)
            else:
                del self.cached[block_hash]
        else:
            dups.remove(block)
        if dups is not None and not dups:
            del self.duplicates[block_hash]

    def lookup(self, block_hash: int) -> Optional[int]:
        return self.cached.get(block_hash)

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency (tests call this after every operation)."""
        queue = self.free_queue
        free = set(queue)
        assert len(free) == len(queue) == self.num_free
        assert NULL_BLOCK not in free and self.ref_cnt[NULL_BLOCK] >= 1
        for b in range(1, self.num_blocks):
            assert (self.ref_cnt[b] == 0) == (b in free), f"block {b}: ref {self.ref_cnt[b]}, free {b in free}"
            assert self.ref_cnt[b] >= 0
        self._check_positions()
        self._check_map()
        assert self.num_cached_free == sum(1 for b in free if self.block_hash[b] is not None)

    def _check_positions(self) -> None:
        stale = set(self._stale)
        start = self._base + self._head
        live = [(b, i) for i, b in enumerate(self._queue[self._head:], start) if i not in stale and b > 0]
        if self.enable_caching:            # (a pool without caching never revives, so never reads them)
            assert all(self._where[b] == i for b, i in live), "a free block's position is out of date"

    def _check_map(self) -> None:
        mapped = [(h, b) for h, b in self.cached.items()]
        mapped += [(h, b) for h, dups in self.duplicates.items() for b in dups]
        for h, b in mapped:
            assert self.block_hash[b] == h
        assert all(dups and h in self.cached for h, dups in self.duplicates.items())
        hashed = [b for b in range(1, self.num_blocks) if self.block_hash[b] not in (None, PRIVATE)]
        assert len(hashed) == len(mapped) == len(set(b for _, b in mapped)), \
            "a block holds a hash the map does not hold"


class CountingBlockPool(BlockPool):
    """The simulator's pool: the same counts, LRU order, hash map and evictions as `BlockPool`,
    with an id only for the blocks the hash map holds.

    Nothing a simulation predicts reads a block's id, only whether a lookup can find the block.
    A block no lookup can find (private content, a partial block, one not registered yet) needs
    no name: a table holds ANON for it and the free queue CACHED or EMPTY, so taking and freeing
    such blocks are C-speed list operations. A block gets an id when it is registered under a
    hash (`name`) and gives it back when the hash is evicted; ids given back are reused first.
    So the ids in use stay few and warm: a pool of 10^5 blocks cycled in scrambled order costs
    a cache miss per block visit otherwise. The engine needs real ids (they address its KV
    tensors): it uses `BlockPool`.

    A prefix hit shared by many running requests (a system prompt) is held through a lease:
    the first holder takes a reference on each block, later holders of the very same hit
    only count themselves on the lease, and the blocks lose the lease's reference when its
    last holder frees them. A block's count is then zero exactly when the per-holder count
    would be (`ref_count` gives that count), so the free queue and every eviction are the
    same, and a hit on a hot prefix costs O(1) instead of a count per block and holder.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        super().__init__(num_blocks, enable_caching)
        self._spare: list[int] = []        # ids given back
        self._next_id = 1                  # ids from here on were never given
        # last block of a leased hit -> [holders beyond the first, the hit's blocks]. While a
        # lease holds its blocks none is evicted, so their hashes keep mapping to them: any
        # hit ending at the same block is the same hit (touch_shared still compares).
        self._leases: dict[int, list] = {}

    @property
    def free_queue(self) -> list[int]:
        """The free blocks in LRU order, oldest first: ids, or CACHED / EMPTY for unnamed ones."""
        return [EMPTY] * (self.num_blocks - self._fresh) + self._freed_queue()

    def get_new_blocks(self, n: int, evicted_at: Optional[list[int]] = None) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        self.num_free -= n
        fresh = min(n, self.num_blocks - self._fresh)
        self._fresh += fresh
        if n > fresh:
            entries = self._pop_freed(n - fresh)
            empty = entries.count(EMPTY)
            if empty < len(entries):
                self._evict_entries(entries, empty, fresh, evicted_at)
        return [ANON] * n

    def _evict_entries(self, entries: list[int], empty: int, offset: int, evicted_at: Optional[list[int]]) -> None:
        """Evict what taken free-queue entries hold (`empty` of them hold nothing; `offset`: their
        index among the blocks taken)."""
        evicted = len(entries) - empty
        if entries.count(CACHED) < evicted:            # some are named: unmap them, their ids go spare
            hashes, cached, duplicates, spare = self.block_hash, self.cached, self.duplicates, self._spare
            for block in entries:
                if block > 0:
                    h = hashes[block]
                    hashes[block] = None
                    if h in duplicates:
                        self._forget(h, block)
                    else:
                        del cached[h]
                    spare.append(block)
        self.num_cached_free -= evicted
        self.evictions += evicted
        if evicted_at is not None:
            evicted_at += ([i for i, block in enumerate(entries, offset) if block != EMPTY] if empty
                           else range(offset, offset + evicted))

    def name(self, n: int) -> list[int]:
        """Ids for n held blocks about to be registered under a hash (reference 1 each)."""
        spare = self._spare
        reused = min(n, len(spare))
        ids = spare[len(spare) - reused:]
        del spare[len(spare) - reused:]
        if reused < n:
            first = self._next_id
            self._next_id = first + n - reused
            ids += range(first, self._next_id)
        ref = self.ref_cnt
        for block in ids:
            ref[block] = 1
        return ids

    def touch_shared(self, blocks: list[int]) -> Optional[int]:
        key = blocks[-1]
        lease = self._leases.get(key)
        if lease is None:
            self.touch(blocks)
            self._leases[key] = [0, list(blocks)]
            return key
        if lease[1] != blocks:             # (a hash collision: not the same hit, so no lease)
            self.touch(blocks)
            return None
        lease[0] += 1
        return key

    def free_among(self, blocks: list[int]) -> int:
        lease = self._leases.get(blocks[-1])
        if lease is not None and lease[1] == blocks:       # (a hit leased already: all held)
            return 0
        return super().free_among(blocks)

    def ref_count(self, block: int) -> int:
        """The block's reference count with one reference per holder (as BlockPool counts)."""
        return self.ref_cnt[block] + sum(extra for extra, blocks in self._leases.values() if block in blocks)

    def free_table(self, table: list[int], num_registered: int, lease: Optional[int] = None) -> None:
        if lease is not None:
            entry = self._leases[lease]
            if entry[0]:                   # other holders keep the leased blocks (the table's head)
                entry[0] -= 1
                leased = len(entry[1])
                del table[:leased]
                num_registered -= leased
            else:
                del self._leases[lease]
        n = len(table)
        unnamed = table.count(ANON)
        named = n - unnamed
        queue = self._queue
        if table[named:].count(ANON) == unnamed:     # named blocks first (hits, a public prompt): usual
            freed = self._release(table[named - 1::-1], len(queue) + unnamed) if named else []
            queue += [EMPTY] * (n - num_registered)
            queue += [CACHED] * (num_registered - named)
            queue += freed
            self.num_free += unnamed + len(freed)
            self.num_cached_free += num_registered - named + len(freed)
        else:
            entries = self._free_mixed(table, num_registered)
            queue += entries
            self.num_free += len(entries)
            self.num_cached_free += len(entries) - entries.count(EMPTY)

    def _release(self, named: list[int], at: int) -> list[int]:
        """Drop a reference on each named block; those reaching zero, which join the free queue at
        position `at` on in this order."""
        ref, where = self.ref_cnt, self._where
        freed = []
        for block in named:
            left = ref[block] - 1
            ref[block] = left
            if not left:
                where[block] = self._base + at + len(freed)
                freed.append(block)
        return freed

    def _free_mixed(self, table: list[int], num_registered: int) -> list[int]:
        """free_table's entries for a table with unnamed blocks before named ones (a preempted
        request that hit its own published blocks), last block first."""
        entries: list[int] = []
        at = len(self._queue)
        for i in range(len(table) - 1, -1, -1):
            block = table[i]
            if block == ANON:
                entries.append(CACHED if i < num_registered else EMPTY)
            else:
                entries += self._release([block], at + len(entries))
        return entries

    def cache_private(self, blocks: list[int]) -> None:
        """(Nothing to mark: free_table counts a table's registered unnamed blocks as cached.)"""

    def evict(self, blocks: list[int]) -> None:
        for block in blocks:
            if block <= 0 or self.ref_cnt[block] or self.block_hash[block] is None:
                raise ValueError(f"block {block} is not a free cached block")
        for block in blocks:               # each stays free where it is, with nothing in it
            self._queue[self._where[block] - self._base] = EMPTY
        self._evict_entries(list(blocks), 0, 0, None)

    def check_invariants(self) -> None:
        queue = self.free_queue
        assert len(queue) == self.num_free
        named_free = [b for b in queue if b > 0]
        assert set(b for b in queue if b <= 0) <= {CACHED, EMPTY}, "an unknown free-queue entry"
        assert len(set(named_free)) == len(named_free)
        assert self.num_cached_free == queue.count(CACHED) + len(named_free)
        issued = range(1, self._next_id)
        held = [b for b in issued if self.ref_cnt[b] > 0]
        assert self._next_id <= self.num_blocks and len(held) <= self.num_used
        assert sorted(self._spare + named_free + held) == list(issued), "an id is lost or in two places"
        for b in self._spare + named_free:
            assert self.ref_cnt[b] == 0
        for b in self._spare:
            assert self.block_hash[b] is None, f"spare id {b} holds a hash"
        for b in named_free + held:
            assert self.block_hash[b] not in (None, PRIVATE), f"named block {b} holds no hash"
        for key, (extra, blocks) in self._leases.items():
            assert extra >= 0 and blocks[-1] == key and all(self.ref_cnt[b] > 0 for b in blocks), \
                f"lease {key} does not hold its blocks"
        self._check_positions()
        self._check_map()


@dataclass(frozen=True)
class CacheLayout:
    """The shape of a KV cache, as the decode cohort (sim/core/fast/cohort.py) must know it to
    take and publish its members' blocks in bulk exactly as `allocate_slots` would one by one."""

    block_size: int
    paged: bool                   # blocks are taken as tokens are scheduled (contiguous: at admission)
    prefix_caching: bool
    private_blocks: bool          # a request's private blocks stay out of the hash map (KVCacheManager)
    tables: int                   # block tables per request: one per KV cache group
    grouped: bool                 # a table per group, even a single one (GroupedKVCacheManager)
    sliding_window: Optional[int]     # the window sliding groups free behind, None without one
    named_blocks: bool            # every block has an id (BlockPool), not only the mapped ones


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


class KVCacheManager:
    """Decides how many blocks a request holds and which cached blocks it reuses (one KV cache
    group of full-attention layers; `GroupedKVCacheManager` for sliding-window and hybrid models).

    `allocation="paged"` grows a request block by block as tokens are scheduled.
    `allocation="contiguous"` reserves `reserve_len(request)` tokens' worth of blocks at
    admission (the traditional max-length reservation), so nothing is allocated later.

    Blocks only their request can look up (Request.first_private_block: its scripted output and
    the prompt tail the workload marked as its own, when no later turn repeats them) are
    registered privately (BlockPool.cache_private) and mapped if it is freed unfinished;
    `private_blocks = False` maps every full block at once, as vLLM does (tests check both give
    the same predictions).
    """

    private_blocks = True
    # vLLM >= 0.20 caps a sliding group's admission need at its window; 0.19 asks every block of the
    # prompt (set by the Scheduler from SchedulerConfig.sliding_admission_cap; full attention ignores it).
    sliding_admission_cap = True

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 allocation: str = "paged", max_model_len: Optional[int] = None,
                 contiguous_reserve: str = "max_model_len", block_ids: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if allocation not in ("paged", "contiguous"):
            raise ValueError(f"allocation must be 'paged' or 'contiguous', got {allocation!r}")
        # block_ids=False: the simulator's pool, which names only the blocks the prefix cache maps
        self.block_ids = block_ids
        self.pool = (BlockPool if block_ids else CountingBlockPool)(num_blocks, enable_caching)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.contiguous = allocation == "contiguous"
        self.max_model_len = max_model_len
        self.contiguous_reserve = contiguous_reserve
        self.stats = PrefixCacheStats()
        self.grouped = False          # one block table per request (GroupedKVCacheManager: one per group)
        self.num_groups = 1           # block tables per request
        self.sliding = False          # some group frees the blocks behind a sliding window
        self.window: Optional[int] = None
        # Slots in blocks held, counted once per owner (a shared block counts for each holder,
        # as do its tokens), so held_slots - tokens computed = unfilled slots (slack).
        self.held_slots = 0

    def empty_copy(self) -> "KVCacheManager":
        """A manager with the same settings and a fresh pool (no block held, nothing cached)."""
        return KVCacheManager(self.pool.num_blocks, self.block_size, self.enable_caching,
                              "contiguous" if self.contiguous else "paged", self.max_model_len,
                              self.contiguous_reserve, self.block_ids)

    def layout(self) -> CacheLayout:
        return CacheLayout(block_size=self.block_size, paged=not self.contiguous, prefix_caching=self.enable_caching,
                           private_blocks=self.private_blocks, tables=self.num_groups, grouped=self.grouped,
                           sliding_window=self.window if self.sliding else None, named_blocks=self.block_ids)

    # -- sizes ---------------------------------------------------------------------------
    def reserve_tokens(self, req: Request) -> int:
        """Tokens a request's allocation must cover by the time it finishes."""
        if self.contiguous and self.contiguous_reserve == "max_model_len" and self.max_model_len:
            return self.max_model_len
        return req.max_len

    def blocks_needed_at_most(self, req: Request) -> int:
        return (self.reserve_tokens(req) + self.block_size - 1) // self.block_size

    # -- prefix cache ---------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks at the start of the request, and its tokens.

        Only for a request with nothing computed; at most floor((num_tokens - 1) / bs)
        blocks, so the last token is always computed (it produces the next token's logits).
        """
        max_blocks = self._lookup_span(req)
        if not max_blocks:
            return [], 0
        hits = list(map(self.pool.cached.get, req.block_hashes[:max_blocks]))   # (at C speed)
        if None in hits:
            del hits[hits.index(None):]
        return hits, len(hits) * self.block_size

    def _lookup_span(self, req: Request) -> int:
        """How many leading blocks of a new request a prefix hit may cover (their hashes made):
        floor((num_tokens - 1) / bs), 0 without caching or once the request computed anything."""
        if not self.enable_caching or req.num_computed:
            return 0
        max_blocks = (req.prompt_len + req.num_output - 1) // self.block_size
        if self.private_blocks and not req.num_preemptions:     # its private blocks cannot be mapped yet
            max_blocks = min(max_blocks, req.first_private_block(self.block_size))
        req.extend_block_hashes(max_blocks, self.block_size)
        return max_blocks

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, hit_blocks: Optional[list[int]] = None,
                       gate_tokens: int = 0, reserve_free: int = 0, lookahead_tokens: int = 0) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens (after any `hit_blocks`).

        For admission, `gate_tokens` > 0 also requires blocks for that many tokens to be
        free (vLLM's reserve-full-prompt gate) and `reserve_free` blocks to stay free (the
        V0 watermark). `lookahead_tokens` are allocated but not published to the prefix
        cache (their KV is computed in a later step). Returns False, changing nothing,
        when the pool is too small. (`req` is no decode-cohort member, which the cohort
        allocates for: its progress fields are read as they are.)
        """
        pool = self.pool
        bs = self.block_size
        hit_blocks = hit_blocks or []
        held = len(req.blocks)
        need, required = self._blocks_required(req, num_new_tokens, hit_blocks, gate_tokens, reserve_free,
                                               lookahead_tokens)
        if required > pool.num_free:
            return False
        if hit_blocks:
            req.kv_lease = pool.touch_shared(hit_blocks)
            req.blocks.extend(hit_blocks)
            req.num_registered = len(req.blocks)   # hit blocks are already registered
        if need:
            req.blocks.extend(pool.get_new_blocks(need))
        self.held_slots += (len(req.blocks) - held) * bs
        if self.enable_caching:
            covered = req.num_computed + len(hit_blocks) * bs + num_new_tokens
            self.register_full_blocks(req, min(covered, req.prompt_len + req.num_output))
        return True

    def append_slots(self, req: Request, num_new_tokens: int, lookahead_tokens: int = 0) -> bool:
        """Slots for `num_new_tokens` more tokens of a running request (what vLLM's allocate_slots
        does for a request it schedules again), and `lookahead_tokens` past them (speculative
        decoding's num_lookahead_tokens): within the blocks it holds, only the blocks its known
        tokens fill are published (draft tokens are not known yet); past them, `allocate_slots`.
        False, changing nothing, when the pool is too small."""
        covered = req.num_computed + num_new_tokens
        if covered + lookahead_tokens > len(req.blocks) * self.block_size:
            return self.allocate_slots(req, num_new_tokens, lookahead_tokens=lookahead_tokens)
        if self.enable_caching and covered // self.block_size > req.num_registered:
            self.register_full_blocks(req, min(covered, req.prompt_len + req.num_output))
        return True

    def would_fit(self, req: Request, num_new_tokens: int, hit_blocks: list[int], gate_tokens: int,
                  reserve_free: int, free_blocks: int) -> bool:
        """Would `allocate_slots` succeed with `free_blocks` free? (No state changes.)"""
        return self._blocks_required(req, num_new_tokens, hit_blocks, gate_tokens, reserve_free, 0)[1] <= free_blocks

    def _blocks_required(self, req: Request, num_new_tokens: int, hit_blocks: list[int], gate_tokens: int,
                         reserve_free: int, lookahead_tokens: int) -> tuple[int, int]:
        """(new blocks an allocation takes, free blocks it requires to go ahead)."""
        bs = self.block_size
        held = len(req.blocks)
        covered = req.num_computed + len(hit_blocks) * bs + num_new_tokens
        if self.contiguous and held == 0:
            target = self.blocks_needed_at_most(req)
        else:
            target = (covered + lookahead_tokens + bs - 1) // bs      # (cdiv, inline: once per allocation)
        need = max(target - held - len(hit_blocks), 0)
        if not (gate_tokens or reserve_free or hit_blocks):
            return need, need
        gate = max((gate_tokens + bs - 1) // bs - held - len(hit_blocks), need)
        hit_in_free = self.pool.free_among(hit_blocks) if hit_blocks else 0
        return need, gate + hit_in_free + reserve_free

    def register_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish the hashes of the request's blocks that `num_tokens` tokens fill completely."""
        bs = self.block_size
        full = num_tokens // bs
        first = req.num_registered
        if full <= first:
            return
        public_end = min(full, req.first_private_block(bs)) if self.private_blocks else full
        if public_end > first:
            req.extend_block_hashes(public_end, bs)
            self.pool.cache_blocks(self.named_blocks(req, first, public_end), req.block_hashes[first:public_end])
        if full > public_end and self.block_ids:     # (CountingBlockPool counts them as cached at free)
            self.pool.cache_private(req.blocks[max(first, public_end):full])
        req.num_registered = full

    def free(self, req: Request) -> None:
        """Release a request's blocks, last block first (it is evicted first). Its private blocks
        are marked (the decode cohort leaves its members' unmarked: nothing reads the mark of a
        held block), or mapped if it is freed unfinished (preempted, aborted): a preempted
        request looks them up when it is admitted again."""
        blocks = req.blocks
        if blocks:
            # (CountingBlockPool counts a finished request's private blocks as cached at free)
            if self.enable_caching and self.private_blocks and (self.block_ids or req.status < FINISHED):
                self._settle_private(req)
            self.held_slots -= len(blocks) * self.block_size
            self.pool.free_table(blocks, req.num_registered, req.kv_lease)
        req.blocks = []
        req.num_registered = 0
        req.kv_lease = None

    def _settle_private(self, req: Request) -> None:
        first, end = req.first_private_block(self.block_size), req.num_registered
        if end <= first:
            return
        if req.is_finished:
            self.pool.cache_private(req.blocks[first:end])
        else:
            req.extend_block_hashes(end, self.block_size)
            self.pool.publish(self.named_blocks(req, first, end), req.block_hashes[first:end])

    def named_blocks(self, req: Request, start: int, end: int) -> list[int]:
        """The ids of the request's blocks start .. end - 1, naming those the pool left unnamed
        (CountingBlockPool: a block gets an id when it is registered under a hash)."""
        blocks = req.blocks[start:end]
        unnamed = blocks.count(ANON) if not self.block_ids else 0
        if unnamed:
            ids = self.pool.name(unnamed)
            if unnamed < len(blocks):
                fresh = iter(ids)
                blocks = [b if b != ANON else next(fresh) for b in blocks]
            else:
                blocks = ids
            req.blocks[start:end] = blocks
        return blocks

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


def group_key(block_hash: int, group: int) -> int:
    """The prefix-cache key of a block hash in KV cache group `group` (vLLM keys its map by
    (hash, group id)): group 0 keeps the hash itself, so a one-group pool keys as KVCacheManager does."""
    return block_hash if group == 0 else hash((block_hash, group))


class GroupedKVCacheManager(KVCacheManager):
    """vLLM's hybrid KV cache manager: one block table per KV cache group, all drawing on one pool.

    The groups (sim/core/memory.py KVCacheGroups: `full_groups` full-attention groups and
    `sliding_groups` sliding-window ones, in vLLM's order: the type of layer 0 first) each give a request one block per `block_size` tokens
    it holds, so every table has the same length. A sliding group frees the blocks whose tokens
    all fell behind the window (`remove_skipped_blocks`, run before each allocation as vLLM's
    allocate_slots does) and keeps the null block in their place. Prefix caching is per group
    (a block's key includes its group): full groups hit from the left, sliding groups need
    cdiv(window - 1, block_size) consecutive cached blocks found scanning from the right, within
    the full groups' hit; the full groups' hit is then cut to the sliding one (the coordinator's
    simple-hybrid pass). Free order: group by group, each table last block first.
    A request's `blocks` is its first group's table; `group_tables` holds all of them.
    """

    private_blocks = False        # (every full block is registered under its group key, the cohort's fills too)

    def __init__(self, num_blocks: int, block_size: int, groups: KVCacheGroups, max_num_batched_tokens: int,
                 enable_caching: bool = True, max_model_len: Optional[int] = None):
        super().__init__(num_blocks, block_size, enable_caching, "paged", max_model_len)
        if groups.sliding_groups and (groups.sliding_window is None or groups.sliding_window < 1):
            raise ValueError(f"sliding-window groups need a sliding_window >= 1, got {groups.sliding_window}")
        self.groups = groups
        self.grouped = True
        self.sliding = groups.sliding_groups > 0
        self.num_groups = groups.num_groups
        self.window = groups.sliding_window
        kinds = [False] * groups.full_groups + [True] * groups.sliding_groups    # is the group sliding
        if groups.sliding_first:
            kinds.reverse()
        self.full_ids = [g for g, sliding in enumerate(kinds) if not sliding]
        self.sliding_ids = [g for g, sliding in enumerate(kinds) if sliding]
        # The most blocks a sliding group holds for one request (vLLM's admission cap, as its startup check).
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sliding_cap = groups.sliding_blocks_cap(block_size, max_num_batched_tokens) if self.sliding else 0
        self.windowed_frees = 0       # blocks freed because they fell behind a window

    def empty_copy(self) -> "GroupedKVCacheManager":
        return GroupedKVCacheManager(self.pool.num_blocks, self.block_size, self.groups, self.max_num_batched_tokens,
                                     self.enable_caching, self.max_model_len)

    def _tables(self, req: Request) -> list[list[int]]:
        tables = req.group_tables
        if tables is None:
            req.blocks = []
            tables = req.group_tables = [req.blocks] + [[] for _ in range(self.num_groups - 1)]
        return tables

    # -- sizes ---------------------------------------------------------------------------
    def blocks_needed_at_most(self, req: Request) -> int:
        """Blocks of every group a request holds at its longest (a sliding group: at most the cap)."""
        blocks = cdiv(self.reserve_tokens(req), self.block_size)
        g = self.groups
        if not self.sliding_admission_cap:     # vLLM 0.19's gate: the whole prompt in every group
            return max(g.full_groups * blocks + g.sliding_groups * min(blocks, self.sliding_cap),
                       g.num_groups * cdiv(req.prompt_len, self.block_size))
        return g.full_groups * blocks + g.sliding_groups * min(blocks, self.sliding_cap)

    # -- prefix cache ---------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> tuple[list[list[int]], int]:
        """Per group, the cached blocks a new request starts from (null where a sliding group
        needs nothing), and the hit's tokens; ([], 0) without a hit."""
        max_blocks = self._lookup_span(req)
        if not max_blocks:
            return [], 0
        bs = self.block_size
        hashes, lookup = req.block_hashes, self.pool.cached.get
        full: list[list[int]] = [[] for _ in self.full_ids]
        length = max_blocks
        if full:
            for i in range(max_blocks):
                found = [lookup(group_key(hashes[i], g)) for g in self.full_ids]
                if None in found:
                    break
                for table, block in zip(full, found):
                    table.append(block)
            length = len(full[0])
        first = 0
        if self.sliding_ids:
            cached = None               # is block i cached in every sliding group (looked up at C speed)
            for g in self.sliding_ids:
                found = list(map(self.pool.cached.__contains__, self._keys(hashes[:length], g)))
                cached = found if cached is None else list(map(and_, cached, found))
            first, length = sliding_window_hit_run(cached.__getitem__, length, bs, self.window)
        if not length:
            return [], 0
        hits: list[list[int]] = [[] for _ in range(self.num_groups)]
        for g, table in zip(self.full_ids, full):
            hits[g] = table[:length]
        for g in self.sliding_ids:
            hits[g] = [NULL_BLOCK] * first + [lookup(group_key(hashes[i], g)) for i in range(first, length)]
        return hits, length * bs

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, hit_blocks: Optional[list[list[int]]] = None,
                       gate_tokens: int = 0, reserve_free: int = 0, lookahead_tokens: int = 0) -> bool:
        """As KVCacheManager.allocate_slots, for every group: the blocks behind the window are
        freed first (even when the allocation then fails, as vLLM does), then each group takes the
        same number of new blocks."""
        self.remove_skipped_blocks(req)
        pool = self.pool
        hits = hit_blocks or []
        need, required = self._blocks_required(req, num_new_tokens, hits, gate_tokens, reserve_free,
                                               lookahead_tokens)
        if required > pool.num_free:
            return False
        tables = self._tables(req)
        held = len(req.blocks)
        if hits:
            for table in hits:                 # every group's hits first: no allocation may evict them
                pool.touch([b for b in table if b != NULL_BLOCK])
            for table, hit in zip(tables, hits):
                table.extend(hit)
            req.num_registered = len(req.blocks)
        if need:
            for table in tables:
                table.extend(pool.get_new_blocks(need))
        self.held_slots += (len(req.blocks) - held) * self.block_size
        if self.enable_caching:
            covered = req.num_computed + (len(hits[0]) if hits else 0) * self.block_size + num_new_tokens
            self.register_full_blocks(req, min(covered, req.num_tokens))
        return True

    def _blocks_required(self, req: Request, num_new_tokens: int, hit_blocks: list, gate_tokens: int,
                         reserve_free: int, lookahead_tokens: int) -> tuple[int, int]:
        """(new blocks each group takes, free blocks the allocation requires to go ahead)."""
        bs = self.block_size
        held = len(req.blocks)
        num_hit = len(hit_blocks[0]) if hit_blocks else 0
        covered = req.num_computed + num_hit * bs + num_new_tokens
        need = max(cdiv(covered + lookahead_tokens, bs) - held - num_hit, 0)
        if not (gate_tokens or reserve_free or hit_blocks):
            return need, need * self.num_groups
        ref = self.pool.ref_cnt
        revived = sum(1 for table in hit_blocks for b in table if b != NULL_BLOCK and ref[b] == 0)
        gate = cdiv(gate_tokens, bs)
        g = self.groups
        full = max(gate - held - num_hit, need)
        capped = min(gate, self.sliding_cap) if self.sliding_admission_cap else gate   # vLLM >= 0.20's cap
        sliding = max(capped - held - num_hit, need)
        return need, g.full_groups * full + g.sliding_groups * sliding + revived + reserve_free

    def append_slots(self, req: Request, num_new_tokens: int, lookahead_tokens: int = 0) -> bool:
        """As KVCacheManager.append_slots, after freeing the blocks behind the window (vLLM frees
        them as it allocates, every step, whether or not a block is needed)."""
        self.remove_skipped_blocks(req)
        return super().append_slots(req, num_new_tokens, lookahead_tokens)

    def frees_behind_window(self, req: Request) -> int:
        """How many leading table entries are behind the window of the request's next token,
        when the nearest of them still holds a block (remove_skipped_blocks would free); else 0."""
        tables = req.group_tables
        if not self.sliding or not tables:
            return 0
        skipped = min(sliding_window_skipped_blocks(req.num_computed, self.block_size, self.window),
                      len(req.blocks))
        if not skipped or tables[self.sliding_ids[0]][skipped - 1] == NULL_BLOCK:
            return 0
        return skipped

    def remove_skipped_blocks(self, req: Request) -> None:
        """Free, in every sliding group, the blocks behind the window of the request's next token
        (null in the table), nearest first, stopping at the first already null."""
        skipped = self.frees_behind_window(req)
        if not skipped:
            return
        tables = req.group_tables
        for g in self.sliding_ids:
            table = tables[g]
            removed = []
            i = skipped - 1
            while i >= 0 and table[i] != NULL_BLOCK:
                removed.append(table[i])
                table[i] = NULL_BLOCK
                i -= 1
            self.windowed_frees += len(removed)
            self.pool.free_blocks(removed)

    def register_full_blocks(self, req: Request, num_tokens: int) -> None:
        full = num_tokens // self.block_size
        if full <= req.num_registered:
            return
        req.extend_block_hashes(full, self.block_size)
        first = req.num_registered
        hashes = req.block_hashes[first:full]
        for g, table in enumerate(self._tables(req)):
            blocks, keys = table[first:full], self._keys(hashes, g)
            if NULL_BLOCK in blocks:
                kept = [i for i, b in enumerate(blocks) if b != NULL_BLOCK]
                blocks, keys = [blocks[i] for i in kept], [keys[i] for i in kept]
            self.pool.cache_blocks(blocks, keys)
        req.num_registered = full

    @staticmethod
    def _keys(hashes: list[int], group: int) -> list[int]:
        """The prefix-cache keys of block hashes in `group` (group 0: the hashes themselves)."""
        return hashes if group == 0 else [group_key(h, group) for h in hashes]

    def filled_entries(self, req: Request, index: int) -> tuple[list[int], list[int]]:
        """(blocks, prefix-cache keys) that publish the request's block `index` in every group
        holding it, in group order (register_full_blocks' order for one block)."""
        h = req.block_hashes[index]
        blocks, keys = [], []
        for g, table in enumerate(req.group_tables):
            if table[index] != NULL_BLOCK:
                blocks.append(table[index])
                keys.append(group_key(h, g))
        return blocks, keys

    def free(self, req: Request) -> None:
        tables = req.group_tables
        if tables:
            self.held_slots -= len(req.blocks) * self.block_size
            for table in tables:
                self.pool.free_blocks([b for b in reversed(table) if b != NULL_BLOCK])
        req.blocks = []
        req.group_tables = None
        req.num_registered = 0

    def held_blocks(self, req: Request) -> int:
        """Pool blocks the request holds over all groups (null entries excluded)."""
        return sum(len(t) - t.count(NULL_BLOCK) for t in req.group_tables or ())

    def check_request(self, req: Request) -> None:
        """Assert a request's tables are consistent (tests): equal lengths, nulls only where a
        sliding group may have freed, every real block referenced."""
        tables = req.group_tables or [[]]
        assert tables[0] is req.blocks and len({len(t) for t in tables}) == 1
        for g, table in enumerate(tables):
            for b in table:
                assert b == NULL_BLOCK or self.pool.ref_cnt[b] >= 1
            if g in self.full_ids:
                assert NULL_BLOCK not in table, f"full-attention group {g} holds a null block"


def new_kv_manager(num_blocks: int, block_size: int, enable_caching: bool = True, allocation: str = "paged",
                   max_model_len: Optional[int] = None, contiguous_reserve: str = "max_model_len",
                   groups: Optional[KVCacheGroups] = None, max_num_batched_tokens: int = 0,
                   block_ids: bool = True) -> KVCacheManager:
    """The manager for a model's KV cache groups: one table per request for one full-attention
    group (every uniform model), one per group otherwise (sliding-window and hybrid models).
    `max_num_batched_tokens`: the most tokens a request computes in one step (a static batch:
    a whole sequence, Scenario.max_step_tokens), which bounds the blocks a sliding group holds.
    `block_ids=False` (the simulator): a pool that names only the blocks the prefix cache maps,
    for one table per request (grouped tables always use ids)."""
    if groups is None or not groups.is_hybrid and groups.full_groups <= 1:
        return KVCacheManager(num_blocks, block_size, enable_caching, allocation, max_model_len, contiguous_reserve,
                              block_ids)
    if allocation != "paged":
        raise ValueError(f"allocation '{allocation}' cannot free the blocks behind a sliding window; use 'paged'")
    return GroupedKVCacheManager(num_blocks, block_size, groups, max_num_batched_tokens, enable_caching,
                                 max_model_len)
