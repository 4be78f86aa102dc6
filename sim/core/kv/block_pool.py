"""The block pool, as vLLM V1's (vllm/v1/core/block_pool.py, 0.19): reference counts, a free queue
in LRU order and the prefix cache's hash -> block map. It knows nothing of requests or groups;
the KV cache groups' managers (sim/core/kv/single_type.py) and their coordinator take and free its
blocks.

vLLM behaviours copied on purpose (docs/vllm_semantics.md sections 2-3):
- block 0 is the null block, never handed out;
- only full blocks are hashed; a hash chains the parent's hash with the block's tokens;
- hashes are registered when slots are allocated (schedule time), not after the step;
- freed blocks keep their hash and stay reusable until popped for reuse (lazy eviction),
  a request's blocks are freed last-first, so its tail is evicted before its head;
- a block that fills with content already cached is registered too (several blocks per
  hash; a lookup returns the first registered, the next takes over when it is evicted).
One departure, invisible to every lookup and figure: blocks only their own request can ever look
up stay out of the hash map (marked PRIVATE) unless that request is preempted
(sim/core/kv/coordinator.py). The simulator's pool (sim/core/fast/counting_pool.py) goes further:
only blocks the hash map holds have an id.
"""
from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left
from typing import Optional


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

    names_every_block = True       # (the simulator's CountingBlockPool names only mapped blocks)

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
        # Each compaction's (first position it kept, the stale positions it dropped, sorted), kept
        # only once `track_positions` is called: a free entry's position, taken with queue_mark,
        # can then be followed across compactions (queued_at).
        self._moves: list[tuple[int, list[int]]] = []
        self._tracking = False

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
        ref, stale, where, push = self.ref_cnt, self._stale, self._where, heapq.heappush
        revived = 0
        for block in blocks:
            count = ref[block]
            if not count:
                if where is None:          # (no positions kept: a pool without prefix caching)
                    raise AssertionError("cache hits in a pool without prefix caching")
                push(stale, where[block])
                revived += 1
            ref[block] = count + 1
        if revived:                        # (the counts once a call: a sliding hit revives ~8 blocks)
            self.num_free -= revived
            self.num_cached_free -= revived
        if len(stale) > self.compact_at and len(stale) * 2 > len(self._queue) - self._head:
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
        if self._tracking:
            self._moves.append((self._base + self._head, sorted(self._stale)))
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
        queue, where = self._queue, self._where
        if list(map(ref.__getitem__, blocks)).count(1) == len(blocks):    # none shared (most calls): all go
            for i, block in enumerate(blocks, self._base + len(queue)):
                ref[block] = 0
                where[block] = i
            queue += blocks
            self.num_free += len(blocks)
            self.num_cached_free += len(blocks) - list(map(hashes.__getitem__, blocks)).count(None)
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
        for i, block in enumerate(freed, self._base + len(queue)):
            where[block] = i
        queue += freed
        self.num_free += len(freed)
        self.num_cached_free += revivable

    def free_in_steps(self, blocks: list[int], ends: list[int]) -> tuple[list[int], list[int]]:
        """free_blocks of each step's blocks in turn (blocks[:ends[0]], then blocks[ends[0]:ends[1]],
        ...); returns the free and the cached-free blocks gained by each step's end."""
        free0, cached0 = self.num_free, self.num_cached_free
        free: list[int] = []
        cached: list[int] = []
        start = 0
        for end in ends:
            if end > start:
                self.free_blocks(blocks[start:end])
                start = end
            free.append(self.num_free - free0)
            cached.append(self.num_cached_free - cached0)
        return free, cached

    def track_positions(self) -> None:
        """Keep what queued_at needs to follow a free entry's position across compactions."""
        self._tracking = True

    def queue_mark(self) -> tuple[int, int]:
        """Where the next freed block joins the free queue: (compactions so far, position)."""
        return len(self._moves), self._base + len(self._queue)

    def queued_at(self, epoch: int, position: int) -> Optional[int]:
        """The position now of the free-queue entry that was at `position` after `epoch`
        compactions (queue_mark), or None if it was taken since. (For entries no cache hit can
        revive: only takes and compactions move them.)"""
        for start, stale in self._moves[epoch:]:
            if position < start:
                return None
            position -= start + bisect_left(stale, position)
        return position if position >= self._base + self._head else None

    def publish_queued(self, blocks: list[int], positions: list[int], hashes: list[int]) -> None:
        """Map free blocks registered privately (at these queue positions), in order."""
        self.publish(blocks, hashes)

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
