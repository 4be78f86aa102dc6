"""Block pool and prefix cache: vLLM's behaviours, and invariants under random operations."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sim.core.kv import PRIVATE, BlockPool, KVCacheManager
from sim.core.memory import cdiv
from sim.core.request import NO_PRIVATE_BLOCK, Request, Status, make_request, stable_key

VOCAB = 50


def req(id, prompt, out=4, tenant=None, salted=False):
    return make_request(id, 0.0, prompt, out, tenant=tenant, salted=salted)


def admit(kv, r):
    hits, hit_tokens = kv.find_cached_prefix(r)
    n = r.num_tokens - hit_tokens
    assert kv.allocate_slots(r, n, hits, gate_tokens=r.num_tokens)
    r.num_computed = hit_tokens + n
    return hit_tokens


def test_paged_allocation_grows_block_by_block():
    kv = KVCacheManager(10, 16, enable_caching=False)
    r = req(0, [(1, 16)])
    admit(kv, r)
    assert len(r.blocks) == 1
    r.append_output()                      # decoding the 17th token starts block 2 (vLLM)
    assert kv.allocate_slots(r, 1)
    assert len(r.blocks) == 2 and kv.num_used_blocks == 2


def test_contiguous_reserves_max_model_len_up_front():
    kv = KVCacheManager(100, 16, enable_caching=False, allocation="contiguous", max_model_len=512)
    r = req(0, [(1, 20)], out=10)
    admit(kv, r)
    assert len(r.blocks) == 512 // 16
    oracle = KVCacheManager(100, 16, enable_caching=False, allocation="contiguous",
                            max_model_len=512, contiguous_reserve="request")
    r2 = req(1, [(1, 20)], out=10)
    admit(oracle, r2)
    assert len(r2.blocks) == cdiv(30, 16)


def test_hit_leaves_last_token_and_block_aligned_prompt_recomputes_last_block():
    kv = KVCacheManager(20, 16)
    a = req(0, [(7, 32)])
    admit(kv, a)
    b = req(1, [(7, 32)])
    hits, hit_tokens = kv.find_cached_prefix(b)
    assert hit_tokens == 16 and hits.groups == [a.blocks[:1]]   # 32 tokens: at most (32-1)//16 = 1 block


def test_only_full_blocks_are_cached_and_freed_blocks_stay_revivable():
    kv = KVCacheManager(20, 16)
    a = req(0, [(7, 40)])
    admit(kv, a)
    kv.free(a)
    assert kv.num_used_blocks == 0 and kv.num_cached_free_blocks == 2   # 40 tokens = 2 full blocks
    b = req(1, [(7, 40), (8, 10)])
    assert admit(kv, b) == 32


def test_lru_eviction_frees_the_tail_of_a_request_first():
    kv = KVCacheManager(4, 16)      # 3 usable blocks
    a = req(0, [(7, 48)], out=1)
    admit(kv, a)
    kv.free(a)                      # freed last-first: block order in queue = tail .. head
    c = req(1, [(9, 16)], out=1)    # needs one block: evicts a's last block, not its first
    admit(kv, c)
    again = req(2, [(7, 48)], out=1)
    hits, hit_tokens = kv.find_cached_prefix(again)
    assert hit_tokens == 32 and kv.pool.evictions == 1


def test_tenant_salt_isolates_identical_prompts():
    kv = KVCacheManager(20, 16)
    admit(kv, req(0, [(7, 64)], tenant="a", salted=True))
    assert kv.find_cached_prefix(req(1, [(7, 64)], tenant="b", salted=True))[1] == 0
    assert kv.find_cached_prefix(req(2, [(7, 64)], tenant="a", salted=True))[1] == 48


def test_segment_boundaries_do_not_matter_only_tokens_do():
    # A literal prompt equal token-for-token to a keyed one is a different segment: no hit.
    # But the same keyed segments, however they split across blocks, hash identically.
    kv = KVCacheManager(20, 4)
    a = req(0, [(1, 6), (2, 10)])
    admit(kv, a)
    b = req(1, [(1, 6), (2, 10), (3, 5)])
    assert kv.find_cached_prefix(b)[1] == 16


def test_literal_token_prompts_share_by_content():
    kv = KVCacheManager(20, 4)
    admit(kv, req(0, [list(range(10))]))
    assert kv.find_cached_prefix(req(1, [list(range(8)) + [99, 98]]))[1] == 8


def test_usage_counts_referenced_blocks_only():
    kv = KVCacheManager(11, 16)
    a = req(0, [(7, 64)])
    admit(kv, a)
    assert kv.usage == 0.4
    kv.free(a)
    assert kv.usage == 0.0   # cached-free blocks count as free, as in vLLM (#5176)


# ------------------------------------------------------------------- property test

segment = st.one_of(
    st.tuples(st.sampled_from([11, 12, 13]), st.integers(1, 40)),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
)


class PoolMachine(RuleBasedStateMachine):
    """Random admit/decode/free/lookup sequences; tracks what each physical block holds."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(24, 4)
        self.live: list[Request] = []
        self.content: dict[int, tuple] = {}
        self.next_id = 0

    def _write(self, r, lo, hi):
        bs = self.kv.block_size
        for i in range(lo // bs, cdiv(hi, bs)):
            end = min((i + 1) * bs, r.num_computed)
            self.content[r.blocks[i]] = tuple(r.token_ids(i * bs, end, VOCAB))

    @rule(prompt=st.lists(segment, min_size=1, max_size=3), salted=st.booleans())
    def admit(self, prompt, salted):
        r = make_request(self.next_id, 0.0, prompt, 20, tenant="t" if salted else None, salted=salted)
        self.next_id += 1
        hits, hit_tokens = self.kv.find_cached_prefix(r)
        bs = self.kv.block_size
        for i, b in enumerate(hits.groups[0] if hits.groups else []):   # a hit never hands out a block holding other tokens
            assert self.content[b] == tuple(r.token_ids(i * bs, (i + 1) * bs, VOCAB))
        n = r.num_tokens - hit_tokens
        if self.kv.allocate_slots(r, n, hits, gate_tokens=r.num_tokens):
            r.num_computed = r.num_tokens
            self._write(r, hit_tokens, r.num_computed)
            self.live.append(r)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def decode(self, i):
        r = self.live[i % len(self.live)]
        if r.num_output + 1 >= r.output_len:
            return
        r.append_output()
        if self.kv.allocate_slots(r, 1):
            r.num_computed += 1
            self._write(r, r.num_computed - 1, r.num_computed)
        else:
            r.num_output -= 1     # undo: the token could not be placed

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.kv.free(self.live.pop(i % len(self.live)))

    @invariant()
    def pool_is_consistent(self):
        pool = self.kv.pool
        pool.check_invariants()
        assert pool.num_used + pool.num_free == pool.usable_blocks
        owners = [0] * pool.num_blocks
        for r in self.live:
            assert len(set(r.blocks)) == len(r.blocks), "a request holds a block twice"
            assert len(r.blocks) == cdiv(r.num_computed, self.kv.block_size)
            for b in r.blocks:
                owners[b] += 1
        assert owners[1:] == pool.ref_cnt[1:]

    def teardown(self):
        for r in self.live:
            self.kv.free(r)
        assert self.kv.pool.num_free == self.kv.pool.usable_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_block_pool_rejects_too_few_blocks():
    import pytest
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)
    assert stable_key("a") == stable_key("a") != stable_key("b")


def test_live_output_blocks_hash_as_the_list_grows():
    live = Request(0, 0.0, [(1, 10)], 8, [])
    live.segments[-1].extend([5, 6])
    live.extend_block_hashes(3, 4)                 # the third block ends exactly at the known end
    live.segments[-1].extend([7, 8, 9, 10])
    live.extend_block_hashes(4, 4)
    same = Request(1, 0.0, [(1, 10)], 8, [5, 6, 7, 8, 9, 10])
    same.extend_block_hashes(4, 4)
    assert live.block_hashes == same.block_hashes


def test_a_recomputed_duplicate_block_keeps_its_hash_beside_the_first():
    """A block-aligned prompt recomputes its last block even when it is cached;
    the copy is registered too (vLLM keeps several blocks per hash), lookups return the first
    copy, and when that one is evicted the second still serves hits."""
    kv = KVCacheManager(8, 16)
    a = req(0, [(7, 32)])
    admit(kv, a)
    b = req(1, [(7, 32)])
    assert admit(kv, b) == 16                       # hits block 0 only, recomputes block 1
    h = a.block_hashes[1]
    assert b.blocks[1] != a.blocks[1] and kv.pool.block_hash[b.blocks[1]] == h
    assert kv.pool.lookup(h) == a.blocks[1]         # the first copy is the one found
    kv.pool.check_invariants()
    first_copy, second_copy = a.blocks[1], b.blocks[1]
    kv.free(a)                                       # queue tail: a's last block, then b's, then the shared first
    kv.free(b)
    for _ in range(kv.pool.num_free - 2):            # reuse everything up to and including a's copy
        kv.pool.take_one()
    assert kv.pool.block_hash[first_copy] is None
    kv.pool.check_invariants()
    assert kv.pool.lookup(h) == second_copy
    c = req(2, [(7, 32), (9, 16)])
    hits, hit_tokens = kv.find_cached_prefix(c)
    assert hit_tokens == 32                          # both blocks still cached, via b's copy
    kv.pool.check_invariants()


# ------------------------------------------------------------------- private blocks

def decode(kv, r, tokens):
    for _ in range(tokens):
        r.append_output()
        assert kv.allocate_slots(r, 1)
        r.num_computed += 1


def test_a_requests_own_output_blocks_stay_out_of_the_map_but_count_as_cached():
    kv = KVCacheManager(20, 4)
    r = req(0, [(7, 8)], out=12)
    admit(kv, r)                                   # 8 prompt tokens: 2 public blocks
    decode(kv, r, 9)                               # 17 tokens: blocks 2, 3 full of output
    public = {kv.pool.lookup(h) for h in r.block_hashes[:2]}
    assert public == set(r.blocks[:2]) and len(kv.pool.cached) == 2
    assert [kv.pool.block_hash[b] for b in r.blocks[2:4]] == [PRIVATE, PRIVATE]
    r.status = Status.FINISHED
    kv.free(r)
    assert kv.num_cached_free_blocks == 4 and len(kv.pool.cached) == 2
    kv.pool.get_new_blocks(kv.pool.num_free)       # reusing them all counts 4 evictions
    assert kv.pool.evictions == 4 and not kv.pool.cached
    kv.pool.check_invariants()


def test_a_preempted_request_publishes_its_output_blocks_and_hits_them_again():
    kv = KVCacheManager(20, 4)
    r = req(0, [(7, 8)], out=12)
    admit(kv, r)
    decode(kv, r, 9)
    blocks = list(r.blocks)
    kv.free(r)                                     # unfinished: a preemption (as the scheduler does it)
    r.num_computed, r.num_preemptions = 0, 1
    hits, tokens = kv.find_cached_prefix(r)        # prompt + 9 outputs = 17 tokens: 4 blocks
    assert tokens == 16 and hits.groups == [blocks[:4]]
    kv.pool.check_invariants()


def test_output_blocks_are_public_when_a_later_turn_or_a_client_may_send_them_back():
    kv = KVCacheManager(40, 4)
    first = req(0, [(7, 8)], out=12)
    first.next_turn = req(1, [(7, 8)], out=1)      # its prompt would carry first's output
    live = Request(2, 0.0, [(8, 8)], 12, [])       # a live output: literal tokens
    for r in (first, live):
        admit(kv, r)
        if r.is_live:
            r.segments[-1].extend(range(9))
        decode(kv, r, 9)
        assert kv.pool.lookup(r.block_hashes[3]) == r.blocks[3]
    assert first.first_private_block(4) == live.first_private_block(4) == NO_PRIVATE_BLOCK


def test_the_prompt_tail_a_workload_marks_as_the_requests_own_is_private_too():
    kv = KVCacheManager(20, 4)
    r = make_request(0, 0.0, [(7, 8), (9, 6)], 4, own_prompt_tokens=6)   # shared 8, own 6 tokens
    admit(kv, r)                                   # 14 tokens: blocks 0, 1 shared; block 2 holds own tokens
    assert r.first_private_block(4) == 2
    assert [kv.pool.block_hash[b] for b in r.blocks[:3]] == [*r.block_hashes[:2], PRIVATE]
    other = make_request(1, 0.0, [(7, 8), (9, 6)], 4)                   # same content, found up to block 2
    assert kv.find_cached_prefix(other)[1] == 8
