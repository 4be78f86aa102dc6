"""The block pool against a plain reference model: same LRU free order, same evictions, same
prefix-cache map, under random takes, frees, revivals and registrations (with the queue's
compaction forced often), and block hashes that do not depend on how they were asked for."""
import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.fast.counting_pool import CountingBlockPool
from sim.core.kv import ANON, CACHED, EMPTY, PRIVATE, BlockPool
from sim.core.request import make_request


class ReferencePool:
    """vLLM's free queue as the simplest structure that has its semantics (an ordered dict:
    pop the head, remove from the middle, append), and the hash map with its duplicates."""

    def __init__(self, num_blocks):
        self.ref = [0] * num_blocks
        self.ref[0] = 1
        self.hash = [None] * num_blocks
        self.queue = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached, self.dups, self.evictions = {}, {}, 0

    def take(self, n):
        blocks = [self.queue.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self.ref[b] = 1
            h = self.hash[b]
            if h is not None:
                self.hash[b] = None
                self.evictions += 1
                others = self.dups.get(h, [])
                if self.cached[h] == b:
                    if others:
                        self.cached[h] = others.pop(0)
                    else:
                        del self.cached[h]
                else:
                    others.remove(b)
                if h in self.dups and not others:
                    del self.dups[h]
        return blocks

    def free(self, blocks):
        for b in blocks:
            self.ref[b] -= 1
            if not self.ref[b]:
                self.queue[b] = None

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                del self.queue[b]
            self.ref[b] += 1

    def cache(self, b, h):
        if self.hash[b] is None:
            self.hash[b] = h
            if self.cached.setdefault(h, b) != b:
                self.dups.setdefault(h, []).append(b)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_pool_matches_the_reference_under_random_operations(seed, caching):
    rng = random.Random(seed)
    n = rng.choice([6, 40, 300])
    pool, ref = BlockPool(n, enable_caching=caching), ReferencePool(n)
    pool.compact_at = rng.choice([0, 2, 16])         # compaction on almost every take / revival
    held: list[int] = []                              # one entry per reference taken
    for _ in range(600):
        op = rng.random()
        if op < 0.3 and ref.queue:
            k = rng.randint(1, min(len(ref.queue), 8))
            taken = ref.take(k)
            assert pool.get_new_blocks(k) == taken
            held.extend(taken)
        elif op < 0.55 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            chunk, held[:] = held[:k], held[k:]
            pool.free_blocks(chunk)
            ref.free(chunk)
        elif not caching:
            continue
        elif op < 0.75:                               # a hit: revive cached blocks, free or held
            cached = list(ref.cached.values())
            if cached:
                hit = rng.sample(cached, rng.randint(1, min(4, len(cached))))
                pool.touch(hit)
                ref.touch(hit)
                held.extend(hit)
        elif held:                                    # register held blocks (some share content)
            b = rng.choice(held)
            h = rng.randint(0, 12)
            pool.cache_block(b, h)
            ref.cache(b, h)
        assert pool.free_queue == list(ref.queue)
        assert pool.cached == ref.cached and pool.duplicates == ref.dups
        assert pool.evictions == ref.evictions and pool.ref_cnt == ref.ref
    pool.check_invariants()


def test_evict_drops_a_free_blocks_hash_and_leaves_it_free_in_place():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], 7)
    pool.free_blocks(blocks)
    pool.evict([blocks[0]])
    assert pool.lookup(7) is None and pool.free_queue[-2:] == blocks and pool.num_cached_free == 0
    with pytest.raises(ValueError, match="not a free cached block"):
        pool.evict([blocks[0]])
    pool.check_invariants()


class Tables:
    """Block tables over one pool, as KVCacheManager keeps them: each table's first `registered`
    blocks are full and registered (publicly under a hash, or privately), the rest unfilled."""

    def __init__(self, pool):
        self.pool, self.tables, self.leases = pool, [], []
        self.shared_hits = 0               # hits that joined a lease another table holds

    def new(self, hit_hashes):
        """A table starting from cache hits (blocks found by hash, referenced through a lease)."""
        hits = [self.pool.lookup(h) for h in hit_hashes]
        lease = self.pool.touch_shared(hits) if hits else None
        self.shared_hits += lease in self.leases
        self.tables.append([hits, len(hits)])
        self.leases.append(lease)

    def take(self, t, n):
        self.tables[t][0].extend(self.pool.get_new_blocks(n))

    def register(self, t, hashes):
        """Register the table's next blocks: under these hashes, or privately where one is None."""
        blocks, start = self.tables[t]
        for i, h in enumerate(hashes, start):
            if h is None:
                self.pool.cache_private([blocks[i]])
            else:
                if blocks[i] == ANON:
                    blocks[i] = self.pool.name(1)[0]
                self.pool.cache_block(blocks[i], h)
        self.tables[t][1] = start + len(hashes)

    def free(self, t):
        blocks, registered = self.tables.pop(t)
        self.pool.free_table(blocks, registered, self.leases.pop(t))

    def ref_counts(self):
        """Each named block's count with one reference per holder, table by table."""
        count = getattr(self.pool, "ref_count", self.pool.ref_cnt.__getitem__)
        return [[count(b) if b > 0 else None for b in blocks] for blocks, _ in self.tables]

    def free_queue(self):
        """The free queue as content: hash, "cached" (private content) or "empty", in LRU order."""
        pool = self.pool
        def content(b):
            if b in (CACHED, EMPTY):
                return "cached" if b == CACHED else "empty"
            h = pool.block_hash[b]
            return "empty" if h is None else "cached" if h is PRIVATE else h
        return [content(b) for b in pool.free_queue]

    def contents(self):
        hashes = self.pool.block_hash
        return [[hashes[b] if b > 0 and hashes[b] not in (None, PRIVATE) else "-" for b in blocks]
                for blocks, _ in self.tables]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_counting_pool_matches_the_id_pool_under_random_tables(seed, caching):
    """CountingBlockPool (ids only for mapped blocks, leases on shared hits) against BlockPool,
    table by table: the same free queue by content (LRU order, cached vs empty), map, evictions
    and counts (per holder), with public and private registrations in any order (so unnamed
    blocks also precede named ones) and hits repeated (leased) or ending at the same block."""
    rng = random.Random(seed)
    n = rng.choice([6, 40, 300])
    ids, counting = Tables(BlockPool(n, caching)), Tables(CountingBlockPool(n, caching))
    for pool in (ids.pool, counting.pool):
        pool.compact_at = rng.choice([0, 2, 16])
    recent_hits = []
    for _ in range(500):
        op, tables = rng.random(), ids.tables
        if op < 0.2 or not tables:
            mapped = list(ids.pool.cached) if caching else []
            hits = rng.sample(mapped, rng.randint(0, min(3, len(mapped))))
            if recent_hits and rng.random() < 0.5:       # the same hit again: a shared lease
                hits = [h for h in rng.choice(recent_hits) if h in ids.pool.cached]
            recent_hits = (recent_hits + [hits])[-3:]
            for side in (ids, counting):
                side.new(hits)
        elif op < 0.5:
            t, k = rng.randrange(len(tables)), rng.randint(1, 6)
            if k <= ids.pool.num_free:
                for side in (ids, counting):
                    side.take(t, k)
        elif op < 0.75 and caching:
            t = rng.randrange(len(tables))
            blocks, registered = tables[t]
            k = rng.randint(0, len(blocks) - registered)
            hashes = [rng.choice([None, None, rng.randint(0, 15)]) for _ in range(k)]
            for side in (ids, counting):
                side.register(t, hashes)
        else:
            t = rng.randrange(len(tables))
            for side in (ids, counting):
                side.free(t)
        assert counting.free_queue() == ids.free_queue()
        assert counting.contents() == ids.contents()
        named = [[c for c in counts if c is not None] for counts in counting.ref_counts()]
        assert named == [[c for c, b in zip(counts, blocks) if b is not None]
                         for counts, blocks in zip(ids.ref_counts(), counting.ref_counts())]
        a, b = ids.pool, counting.pool
        assert (a.num_free, a.num_cached_free, a.evictions) == (b.num_free, b.num_cached_free, b.evictions)
        assert {h: 1 + len(a.duplicates.get(h, ())) for h in a.cached} == \
               {h: 1 + len(b.duplicates.get(h, ())) for h in b.cached}
        counting.pool.check_invariants()
    ids.pool.check_invariants()
    assert not caching or counting.shared_hits > 0, "no hit was shared: the leases went untested"


def test_counting_pool_evict_empties_a_free_named_block_in_place():
    pool = CountingBlockPool(6)
    table = pool.get_new_blocks(3)
    assert table == [ANON] * 3
    table[0] = pool.name(1)[0]
    pool.cache_block(table[0], 7)
    named = table[0]
    pool.free_table(table, 2)              # block 1 registered privately, block 2 unfilled
    assert pool.free_queue[-3:] == [EMPTY, CACHED, named] and pool.num_cached_free == 2
    pool.evict([named])
    assert pool.lookup(7) is None and pool.free_queue[-3:] == [EMPTY, CACHED, EMPTY]
    assert pool.num_cached_free == 1 and pool.evictions == 1
    with pytest.raises(ValueError, match="not a free cached block"):
        pool.evict([named])
    pool.check_invariants()
    assert pool.get_new_blocks(5) == [ANON] * 5 and pool.evictions == 2    # the private block's reuse
    pool.check_invariants()


@pytest.mark.parametrize("pool_class", [BlockPool, CountingBlockPool])
def test_a_free_entrys_position_is_followed_across_takes_and_compactions(pool_class):
    """queue_mark / queued_at (what a preempted request's sliding groups use to find the private
    blocks they freed behind the window): a free entry's position is followed while cache hits
    revive other free blocks and the queue is compacted, and is None once a take passed it."""
    pool = pool_class(12)
    pool.track_positions()
    pool.compact_at = 2
    table = pool.get_new_blocks(11)
    named = pool.name(4) if pool_class is CountingBlockPool else table[:4]
    pool.cache_blocks(named, [10, 11, 12, 13])
    private = table[4] if pool_class is BlockPool else ANON
    pool.free_blocks(named)                            # 4 named free blocks, then the private one
    epoch, at = pool.queue_mark()
    pool.free_blocks([private])
    pool.free_blocks(table[5:6] if pool_class is BlockPool else [ANON])
    pool.touch(named)                                  # 4 stale entries of 6: a compaction
    assert pool._moves and pool.queued_at(epoch, at) == 0
    assert pool.free_queue[-2] == (private if pool_class is BlockPool else CACHED)
    pool.free_blocks(named[:1])                        # (it joins behind)
    assert pool.queued_at(epoch, at) == 0
    pool.get_new_blocks(1)                             # takes it
    assert pool.queued_at(epoch, at) is None
    pool.check_invariants()


def test_a_shared_block_two_requests_free_at_once_joins_where_its_last_reference_goes():
    """Two requests freeing behind their windows at one step can both hold a prefix hit's block:
    it comes twice in one free_blocks call and joins the free queue once, where the second
    reference goes; private blocks join as they come (both pools; the queue compared by content;
    the coordinator's record of the positions agrees)."""
    from sim.core.kv.coordinator import _queue_positions

    def queue_after(pool_class):
        pool = pool_class(8)
        table = pool.get_new_blocks(3)
        shared = pool.name(1)[0] if pool_class is CountingBlockPool else table[0]
        pool.cache_blocks([shared], [5])
        pool.touch([shared])                           # a second holder
        private = table[1:] if pool_class is BlockPool else [ANON, ANON]
        pool.cache_private(private if pool_class is BlockPool else [])
        freed = [shared, private[0], shared, private[1]]
        refs = [pool.ref_cnt[b] if b != ANON else 1 for b in freed]
        assert _queue_positions(freed, refs, 10) == [None, 10, 11, 12]
        pool.free_blocks(freed)
        pool.check_invariants()
        return free_queue_view(pool)

    assert queue_after(BlockPool) == queue_after(CountingBlockPool)
    assert queue_after(BlockPool)[-3:] == [CACHED, 5, CACHED]


keyed = st.tuples(st.integers(1, 4), st.integers(1, 70))
literal = st.lists(st.integers(0, 5), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(segments=st.lists(st.one_of(keyed, literal), min_size=1, max_size=5), block=st.sampled_from([1, 4, 16]),
       cuts=st.lists(st.integers(0, 40), max_size=6))
def test_block_hashes_do_not_depend_on_how_they_were_asked_for(segments, block, cuts):
    whole = make_request(0, 0.0, segments, 1)
    total = (whole.prompt_len) // block
    whole.extend_block_hashes(total, block)
    pieces = make_request(1, 0.0, segments, 1)
    for cut in sorted(cuts):
        pieces.extend_block_hashes(min(cut, total), block)
    pieces.extend_block_hashes(total, block)
    assert pieces.block_hashes == whole.block_hashes
    assert len(set(whole.block_hashes)) == total            # every block's content differs by position


def test_block_hashes_follow_content_not_segment_layout_within_a_run():
    # same keyed content up to a block -> same hash; a different key or an earlier difference -> different
    a = make_request(0, 0.0, [(1, 64), (2, 64)], 1)
    b = make_request(1, 0.0, [(1, 64), (3, 64)], 1)
    c = make_request(2, 0.0, [(9, 64), (2, 64)], 1)
    for r in (a, b, c):
        r.extend_block_hashes(8, 16)
    assert a.block_hashes[:4] == b.block_hashes[:4] and a.block_hashes[4] != b.block_hashes[4]
    assert not set(a.block_hashes) & set(c.block_hashes)


def two_named_two_private(pool_class, size: int):
    """A pool of `size` blocks holding one table of four: two named blocks (hashes 5 and 6; the
    first with a second holder) and two private ones, as either pool names them."""
    pool = pool_class(size)
    table = pool.get_new_blocks(4)
    if pool_class is CountingBlockPool:
        named = pool.name(2)
        private = [ANON, ANON]
    else:
        named, private = table[:2], table[2:]
        pool.cache_private(private)
    pool.cache_blocks(named, [5, 6])
    pool.touch(named[:1])                          # named[0] has a second holder
    return pool, named, private


def free_queue_view(pool) -> list:
    """The free queue as both pools can be compared: a named block by its hash, private and
    cached blocks as CACHED, empty ones as EMPTY."""
    hashes = pool.block_hash
    return [b if b in (CACHED, EMPTY) else CACHED if hashes[b] is PRIVATE else hashes[b] if hashes[b] else EMPTY
            for b in pool.free_queue]


@pytest.mark.parametrize("order", [(1, 2, 0, 0, 3), (0, 0, 3), (1, 2, 3, 0, 0), (1, 0, 2, 0)])
def test_a_window_free_of_private_then_named_blocks_queues_as_the_engines_pool(order):
    """A window free mixing private blocks and named ones (a window passing a hit: private first,
    then named, or any other mix) queues in CountingBlockPool what BlockPool queues, a named
    block freed twice in one call joining once, where its last reference goes."""
    def queue_after(pool_class):
        pool, named, private = two_named_two_private(pool_class, 10)
        blocks = {0: named[0], 1: private[0], 2: private[1], 3: named[1]}
        pool.free_blocks([blocks[i] for i in order])
        pool.check_invariants()
        return free_queue_view(pool)

    assert queue_after(CountingBlockPool) == queue_after(BlockPool)


@pytest.mark.parametrize("ends", [[5], [2, 2, 5], [0, 3, 3, 5], [1, 2, 3, 4, 5]])
def test_a_stretch_of_window_frees_in_steps_is_its_steps_freed_in_turn(ends):
    """free_in_steps (a decode stretch's window frees, each step's blocks in turn) gives the free
    queue and the free and cached-free gains by each step's end that free_blocks called step by
    step gives, on both pools: private blocks, a named block with a second holder (it joins only
    at its last reference, freed twice) and steps that free nothing."""
    def freed(pool_class, in_steps):
        pool, named, private = two_named_two_private(pool_class, 12)
        blocks = [private[0], named[0], private[1], named[0], named[1]]
        if in_steps:
            gains = pool.free_in_steps(blocks, ends)
        else:
            free0, cached0, gains, start = pool.num_free, pool.num_cached_free, ([], []), 0
            for end in ends:
                pool.free_blocks(blocks[start:end])
                start = end
                gains[0].append(pool.num_free - free0)
                gains[1].append(pool.num_cached_free - cached0)
        pool.check_invariants()
        return gains, free_queue_view(pool)

    expected = freed(BlockPool, in_steps=False)
    assert expected[0][0][-1] == 4 and expected[1][-2:] == [5, 6]    # named[0] joined once, at its last free
    for pool_class in (BlockPool, CountingBlockPool):
        assert freed(pool_class, in_steps=True) == expected
        assert freed(pool_class, in_steps=False) == expected
