"""The simulator's block pool: `BlockPool`'s counts, LRU order, hash map and evictions, with an id
only for the blocks the hash map holds (the engine needs every id: it uses `BlockPool`)."""
from __future__ import annotations

from typing import Optional

from sim.core.kv.block_pool import ANON, CACHED, EMPTY, PRIVATE, BlockPool


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

    names_every_block = False

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
        fresh = self.num_blocks - self._fresh         # (never taken yet; min(n, that) without the call)
        if fresh > n:
            fresh = n
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

    def free_blocks(self, blocks: list[int]) -> None:
        """Free table entries of full blocks (a sliding window's, behind it): an unnamed one joins
        the free queue as private content (CACHED; EMPTY without prefix caching), a named one
        drops a reference and joins when it reaches zero."""
        unnamed = blocks.count(ANON)
        if unnamed == len(blocks):                   # (most calls)
            self.free_unnamed(unnamed)
            return
        queue = self._queue
        content = CACHED if self.enable_caching else EMPTY
        entries: list[int] = []
        ref, where, at = self.ref_cnt, self._where, self._base + len(queue)
        for block in blocks:
            if block == ANON:
                entries.append(content)
            else:                          # (_release, inline: a shared prefix's blocks, one by one)
                left = ref[block] - 1
                ref[block] = left
                if not left:
                    where[block] = at + len(entries)
                    entries.append(block)
        queue += entries
        self.num_free += len(entries)
        self.num_cached_free += len(entries) - entries.count(EMPTY)

    def free_in_steps(self, blocks: list[int], ends: list[int]) -> tuple[list[int], list[int]]:
        # (free_blocks' loop over the steps at once: one pass, the queue extended once)
        queue = self._queue
        content = CACHED if self.enable_caching else EMPTY
        entries: list[int] = []
        gained: list[int] = []
        ref, where, at = self.ref_cnt, self._where, self._base + len(queue)
        start = 0
        for end in ends:
            if end > start:
                for block in blocks[start:end]:
                    if block == ANON:
                        entries.append(content)
                    else:                  # (_release, inline)
                        left = ref[block] - 1
                        ref[block] = left
                        if not left:
                            where[block] = at + len(entries)
                            entries.append(block)
                start = end
            gained.append(len(entries))
        queue += entries
        self.num_free += len(entries)
        self.num_cached_free += len(entries) - entries.count(EMPTY)
        return gained, gained if self.enable_caching else [0] * len(gained)

    def free_unnamed(self, n: int) -> tuple[int, int]:
        """free_blocks of n unnamed blocks (private content: CACHED; EMPTY without prefix caching);
        returns where the first of them joined the free queue (queue_mark before the free: a
        window's usual free takes its record's mark and frees in one call)."""
        queue = self._queue
        mark = len(self._moves), self._base + len(queue)
        if self.enable_caching:
            queue += [CACHED] * n
            self.num_cached_free += n
        else:
            queue += [EMPTY] * n
        self.num_free += n
        return mark

    def publish_queued(self, blocks: list[int], positions: list[int], hashes: list[int]) -> None:
        """Map free blocks with private content at these queue positions, in order (the unnamed
        ones among `blocks`: each gets an id where its CACHED entry was, staying free)."""
        picked = [(at, h) for block, at, h in zip(blocks, positions, hashes) if block == ANON]
        if not picked:
            return
        ids = self.name(len(picked))
        queue, where, base, ref = self._queue, self._where, self._base, self.ref_cnt
        for block, (at, _) in zip(ids, picked):
            ref[block] = 0
            queue[at - base] = block
            where[block] = at
        self.cache_blocks(ids, [h for _, h in picked])

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
        if not named or table[named:].count(ANON) == unnamed:     # named blocks first (hits, a public prompt): usual
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
