"""The coordinators: how a request's blocks are taken, looked up and freed over the KV cache groups,
as vLLM's kv_cache_coordinator.py (0.19) splits it: `UnitaryCoordinator` for one full-attention
group (every uniform model: one table, `Request.blocks`), `HybridCoordinator` for several groups
or a sliding window (a table per group, `Request.group_tables`, each group run by its
single-type manager, sim/core/kv/single_type.py). Both answer the same calls (`API`), which
`KVCacheManager` (sim/core/kv/manager.py) hands to the scheduler and the decode cohort; a prefix
hit is always per group (`KVCacheBlocks`). (vLLM's UnitaryKVCacheCoordinator also runs a lone
sliding-window group; here the hybrid coordinator does, so the unitary one knows nothing of
windows.) Both run on the simulator's id-light pool (CountingBlockPool) or the engine's.

vLLM behaviours copied on purpose (docs/vllm_semantics.md sections 2-3):
- lookup happens only for requests with nothing computed, stops at the first miss and always
  leaves at least the last prompt token to compute;
- hashes are registered when slots are allocated (schedule time), not after the step;
- a request's blocks are freed last block first, so its tail is evicted before its head.
One departure, invisible to every lookup and figure: blocks only their own request can ever look
up (`private_blocks` of either coordinator) stay out of the hash map unless that request is
preempted (with a window: also those its sliding groups freed that the pool still holds).

Both coordinators' per-request paths take the lesser or greater of two ints with a
comparison, not `min`/`max`: under CPython 3.11 a call to either costs ~1,200 instructions (it
parses keywords), a comparison ~100, and each request passes here several times.
"""
from __future__ import annotations

import weakref
from typing import Optional

from sim.core.kv.block_pool import ANON, NULL_BLOCK, BlockPool
from sim.core.kv.blocks import NO_BLOCKS, KVCacheBlocks
from sim.core.kv.single_type import FullAttentionManager, SlidingWindowManager, group_keys, group_salt
from sim.core.memory import KVCacheGroups, cdiv
from sim.core.request import Request
from sim.core.status import FINISHED


class KVCacheCoordinator:
    """What both coordinators share: the pool, the block size, the prefix-cache lookup span."""

    # The calls a coordinator answers for its KVCacheManager (bound there, no call in between).
    API = ("blocks_needed_at_most", "find_cached_prefix", "allocate_slots", "append_slots", "would_fit",
           "register_full_blocks", "free")

    def __init__(self, manager, pool: BlockPool, block_size: int, enable_caching: bool):
        # (its held_slots: slots held over all requests, the cohort's too). A weak proxy: the
        # manager holds this coordinator's bound methods, and a strong reference back would make
        # a cycle that keeps the whole pool alive until a full collection (which, after
        # sim.core.collector.gc_paused, comes rarely: a LODO refit grew to 13 GB of pools)
        self.manager = weakref.proxy(manager)
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching

    def lookup_span(self, req: Request, private_blocks: bool) -> int:
        """How many leading blocks of a new request a prefix hit may cover (their hashes made):
        floor((num_tokens - 1) / bs), 0 without caching or once the request computed anything."""
        if not self.enable_caching or req.num_computed:
            return 0
        max_blocks = (req.prompt_len + req.num_output - 1) // self.block_size
        if private_blocks and not req.num_preemptions:     # its private blocks cannot be mapped yet
            private = req.first_private_block(self.block_size)
            if private < max_blocks:
                max_blocks = private
        req.extend_block_hashes(max_blocks, self.block_size)
        return max_blocks


class UnitaryCoordinator(KVCacheCoordinator):
    """One full-attention group (vLLM's UnitaryKVCacheCoordinator): the request's one table is
    `Request.blocks`.

    `contiguous` reserves `reserve_tokens(request)` tokens' worth of blocks at admission (the
    traditional max-length reservation), so nothing is allocated later; paged grows a request
    block by block as tokens are scheduled.

    Blocks only their request can look up (Request.first_private_block: its scripted output and
    the prompt tail the workload marked as its own, when no later turn repeats them) are
    registered privately (BlockPool.cache_private) and mapped if it is freed unfinished;
    `private_blocks = False` maps every full block at once, as vLLM does (tests check both give
    the same predictions). The simulator's pool (CountingBlockPool) leaves such blocks unnamed.
    """

    private_blocks = True
    per_group_tables = False
    num_groups = 1
    window = None
    API = KVCacheCoordinator.API + ("filled_entries",)

    def __init__(self, manager, pool: BlockPool, *, block_size: int, enable_caching: bool, contiguous: bool,
                 max_model_len: Optional[int], contiguous_reserve: str, named: bool):
        super().__init__(manager, pool, block_size, enable_caching)
        self.contiguous = contiguous
        self.paged = not contiguous
        self.max_model_len = max_model_len
        self.contiguous_reserve = contiguous_reserve
        self.named = named             # every block has an id (BlockPool, not CountingBlockPool)

    def reserve_tokens(self, req: Request) -> int:
        """Tokens a request's allocation must cover by the time it finishes."""
        if self.contiguous and self.contiguous_reserve == "max_model_len" and self.max_model_len:
            return self.max_model_len
        return req.max_len

    def blocks_needed_at_most(self, req: Request) -> int:
        return cdiv(self.reserve_tokens(req), self.block_size)

    def find_cached_prefix(self, req: Request) -> tuple[KVCacheBlocks, int]:
        """The longest run of cached full blocks at the start of the request, and its tokens."""
        max_blocks = self.lookup_span(req, self.private_blocks)
        if not max_blocks:
            return NO_BLOCKS, 0
        # (FullAttentionManager.find_longest_cache_hit of the one group, inline: group 0's keys are
        # the hashes themselves, looked up at C speed)
        hits = list(map(self.pool.cached.get, req.block_hashes[:max_blocks]))
        # (a miss is None, a hit a block id >= 1, never NULL_BLOCK: all() tests each for truth at C
        # speed, where `None in hits` compared None with each id, a rich comparison each)
        if not all(hits):
            del hits[hits.index(None):]
            if not hits:
                return NO_BLOCKS, 0
        return KVCacheBlocks([hits]), len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: Optional[KVCacheBlocks] = None,
                       gate_tokens: int = 0, reserve_free: int = 0, lookahead_tokens: int = 0) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens (after any `hit`).

        For admission, `gate_tokens` > 0 also requires blocks for that many tokens to be
        free (vLLM's reserve-full-prompt gate) and `reserve_free` blocks to stay free (the
        V0 watermark). `lookahead_tokens` are allocated but not published to the prefix
        cache (their KV is computed in a later step). Returns False, changing nothing,
        when the pool is too small. (`req` is no decode-cohort member, which the cohort
        allocates for: its progress fields are read as they are.)
        """
        pool = self.pool
        bs = self.block_size
        hit_blocks = hit.groups[0] if hit is not None and hit.groups else []
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
        self.manager.held_slots += (len(req.blocks) - held) * bs
        if self.enable_caching:
            covered = req.num_computed + len(hit_blocks) * bs + num_new_tokens
            known = req.prompt_len + req.num_output
            self.register_full_blocks(req, covered if covered < known else known)
        return True

    def append_slots(self, req: Request, num_new_tokens: int, lookahead_tokens: int = 0) -> bool:
        """Slots for `num_new_tokens` more tokens of a running request (what vLLM's allocate_slots
        does for a request it schedules again), and `lookahead_tokens` past them (speculative
        decoding's num_lookahead_tokens): within the blocks it holds, only the blocks its known
        tokens fill are published (draft tokens are not known yet); past them, `allocate_slots`.
        False, changing nothing, when the pool is too small."""
        # (_append_within_held's body, inline: every running request comes here every step)
        covered = req.num_computed + num_new_tokens
        bs = self.block_size
        if covered + lookahead_tokens > len(req.blocks) * bs:
            return self.allocate_slots(req, num_new_tokens, lookahead_tokens=lookahead_tokens)
        if self.enable_caching and covered // bs > req.num_registered:
            self.register_full_blocks(req, min(covered, req.prompt_len + req.num_output))
        return True

    def would_fit(self, req: Request, num_new_tokens: int, hit: KVCacheBlocks, gate_tokens: int,
                  reserve_free: int, free_blocks: int) -> bool:
        """Would `allocate_slots` succeed with `free_blocks` free? (No state changes.)"""
        hit_blocks = hit.groups[0] if hit.groups else []
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
            target = cdiv(covered + lookahead_tokens, bs)
        need = target - held - len(hit_blocks)
        if need < 0:
            need = 0
        if not (gate_tokens or reserve_free or hit_blocks):
            return need, need
        gate = cdiv(gate_tokens, bs) - held - len(hit_blocks)
        if gate < need:
            gate = need
        hit_in_free = self.pool.free_among(hit_blocks) if hit_blocks else 0
        return need, gate + hit_in_free + reserve_free

    def register_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish the hashes of the request's blocks that `num_tokens` tokens fill completely."""
        bs = self.block_size
        full = num_tokens // bs
        first = req.num_registered
        if full <= first:
            return
        public_end = full
        if self.private_blocks:
            private = req.first_private_block(bs)
            if private < full:
                public_end = private
        if public_end > first:
            req.extend_block_hashes(public_end, bs)
            self.pool.cache_blocks(self.named_blocks(req, first, public_end), req.block_hashes[first:public_end])
        if full > public_end and self.named:     # (CountingBlockPool counts them as cached at free)
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
            if self.enable_caching and self.private_blocks and (self.named or req.status < FINISHED):
                self._settle_private(req)
            self.manager.held_slots -= len(blocks) * self.block_size
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

    def filled_entries(self, reqs: list[Request], indexes: list[int]) -> tuple[list[int], list[int]]:
        """(blocks, hashes) that publish each request's block at its index, in turn (the decode
        cohort's fills; a block the pool left unnamed is named here, in that order)."""
        blocks = [self.named_blocks(req, index, index + 1)[0] for req, index in zip(reqs, indexes)]
        return blocks, [req.block_hashes[index] for req, index in zip(reqs, indexes)]

    def named_blocks(self, req: Request, start: int, end: int) -> list[int]:
        """The ids of the request's blocks start .. end - 1, naming those the pool left unnamed
        (CountingBlockPool: a block gets an id when it is registered under a hash)."""
        blocks = req.blocks[start:end]
        unnamed = blocks.count(ANON) if not self.named else 0
        if unnamed:
            ids = self.pool.name(unnamed)
            if unnamed < len(blocks):
                fresh = iter(ids)
                blocks = [b if b != ANON else next(fresh) for b in blocks]
            else:
                blocks = ids
            req.blocks[start:end] = blocks
        return blocks


class HybridCoordinator(KVCacheCoordinator):
    """Several KV cache groups, or a sliding window (vLLM's HybridKVCacheCoordinator): one block
    table per group, all drawing on one pool.

    The groups (sim/core/memory.py KVCacheGroups: `full_groups` full-attention groups and
    `sliding_groups` sliding-window ones, in vLLM's order: the type of layer 0 first) each give a
    request one block per `block_size` tokens it holds, so every table has the same length. A
    sliding group frees the blocks whose tokens all fell behind the window (`remove_skipped_blocks`,
    run before each allocation as vLLM's allocate_slots does) and keeps the null block in their
    place. Prefix caching is per group (a block's key includes its group): full groups hit from
    the left, sliding groups need cdiv(window - 1, block_size) consecutive cached blocks found
    scanning from the right, within the full groups' hit; the full groups' hit is then cut to the
    sliding one (the coordinator's simple-hybrid pass). Free order: group by group, each table
    last block first. A request's `blocks` is its first group's table; `group_tables` holds all.

    Private blocks as `UnitaryCoordinator`'s, in every group: registered privately and mapped if
    the request is freed unfinished, with what its sliding groups freed behind the window and the
    pool has not reused since (the request records where those entries joined the free queue:
    a preempted request looks them up too, as vLLM keeps every freed block's hash). The simulator's
    pool (CountingBlockPool) leaves such blocks unnamed, so a table holds ANON for them.
    """

    API = KVCacheCoordinator.API + ("frees_behind_window", "remove_skipped_blocks", "free_behind_windows",
                                     "filled_entries")
    per_group_tables = True
    paged = True
    private_blocks = True

    def __init__(self, manager, pool: BlockPool, *, block_size: int, enable_caching: bool, groups: KVCacheGroups,
                 max_num_batched_tokens: int, named: bool):
        super().__init__(manager, pool, block_size, enable_caching)
        self.named = named             # every block has an id (BlockPool, not CountingBlockPool)
        if groups.sliding_groups and (groups.sliding_window is None or groups.sliding_window < 1):
            raise ValueError(f"sliding-window groups need a sliding_window >= 1, got {groups.sliding_window}")
        self.groups = groups
        self.num_groups = groups.num_groups
        self.window = groups.sliding_window if groups.sliding_groups else None
        kinds = [False] * groups.full_groups + [True] * groups.sliding_groups    # is the group sliding
        if groups.sliding_first:
            kinds.reverse()
        self.managers = [SlidingWindowManager(g, groups.sliding_window, block_size) if sliding
                         else FullAttentionManager(g) for g, sliding in enumerate(kinds)]
        self.full_ids = [m.group_id for m in self.managers if not m.sliding]
        self.sliding_ids = [m.group_id for m in self.managers if m.sliding]
        self.sliding_managers = [m for m in self.managers if m.sliding]
        # is group g of full attention (its hit is leased: held whole until the request is freed)
        self.full_attention = [not m.sliding for m in self.managers]
        # The most blocks a sliding group holds for one request (vLLM's admission cap, as its startup check).
        self.sliding_cap = groups.sliding_blocks_cap(block_size, max_num_batched_tokens) if self.window else 0
        # vLLM >= 0.20 caps a sliding group's admission need at its window; 0.19 asks every block of
        # the prompt (KVCacheManager.set_sliding_admission_cap).
        self.sliding_admission_cap = True
        self.windowed_frees = 0        # blocks freed because they fell behind a window
        self.salts = [group_salt(g) for g in range(self.num_groups)]      # group_key(h, g) = h ^ salts[g]
        # (what a request's sliding groups freed behind the window: its `window_frees`, read by
        # _publish_window_freed)
        self._track_window_frees = bool(enable_caching and self.private_blocks and self.sliding_managers)
        self._one_window = len(self.sliding_managers) == 1     # (free_behind_windows' usual case)
        if self._track_window_frees:
            pool.track_positions()

    def _tables(self, req: Request) -> list[list[int]]:
        tables = req.group_tables
        if tables is None:
            req.blocks = []
            tables = req.group_tables = [req.blocks, []] if self.num_groups == 2 else \
                [req.blocks] + [[] for _ in range(self.num_groups - 1)]    # (a hybrid's two groups: no comprehension)
            if self._track_window_frees:
                req.window_frees = []
        return tables

    def blocks_needed_at_most(self, req: Request) -> int:
        """Blocks of every group a request holds at its longest (a sliding group: at most the cap)."""
        bs, g = self.block_size, self.groups
        blocks = cdiv(req.max_len, bs)
        # (the lesser and greater by comparisons: see the module's docstring)
        most = g.full_groups * blocks + g.sliding_groups * (blocks if blocks < self.sliding_cap else self.sliding_cap)
        if not self.sliding_admission_cap:     # vLLM 0.19's gate: the whole prompt in every group
            prompt = self.num_groups * cdiv(req.prompt_len, bs)
            if prompt > most:
                return prompt
        return most

    def find_cached_prefix(self, req: Request) -> tuple[KVCacheBlocks, int]:
        """Per group, the cached blocks a new request starts from (null where a sliding group
        needs nothing), and the hit's tokens; (NO_BLOCKS, 0) without a hit."""
        max_blocks = self.lookup_span(req, self.private_blocks)
        if not max_blocks:
            return NO_BLOCKS, 0
        hashes, pool = req.block_hashes, self.pool
        full = FullAttentionManager.find_longest_cache_hit(pool, hashes, max_blocks, self.full_ids) \
            if self.full_ids else []
        length = len(full[0]) if full else max_blocks
        first = 0
        if self.sliding_ids:
            first, length = SlidingWindowManager.find_longest_cache_hit(pool, hashes, length, self.sliding_ids,
                                                                        self.window, self.block_size)
        if not length:
            return NO_BLOCKS, 0
        hits: list = [None] * self.num_groups      # (every group's hit set below)
        for g, table in zip(self.full_ids, full):
            hits[g] = table[:length]
        lookup = pool.cached.get
        for g in self.sliding_ids:
            hits[g] = [NULL_BLOCK] * first + list(map(lookup, group_keys(hashes[first:length], g)))
        return KVCacheBlocks(hits), length * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: Optional[KVCacheBlocks] = None,
                       gate_tokens: int = 0, reserve_free: int = 0, lookahead_tokens: int = 0) -> bool:
        """As UnitaryCoordinator.allocate_slots, for every group: the blocks behind the window are
        freed first (even when the allocation then fails, as vLLM does), then each group takes the
        same number of new blocks."""
        if req.group_tables:               # (remove_skipped_blocks: a request being admitted holds nothing yet)
            self.remove_skipped_blocks(req)
        pool = self.pool
        hits = hit.groups if hit is not None else ()
        need, required = self._blocks_required(req, num_new_tokens, hits, gate_tokens, reserve_free,
                                               lookahead_tokens)
        if required > pool.num_free:
            return False
        tables = self._tables(req)
        held = len(req.blocks)
        if hits:                               # every group's hits first: no allocation may evict them
            leases = []                        # (a loop, not a comprehension: a function and a frame a call)
            for table, full in zip(hits, self.full_attention):
                leases.append(pool.touch_shared(table) if full else pool.touch(_held(table)))     # (touch: None)
            if leases.count(None) < len(leases):
                req.kv_lease = leases
            for table, hit_table in zip(tables, hits):
                table.extend(hit_table)
            req.num_registered = len(req.blocks)
        if need:
            for table in tables:
                table.extend(pool.get_new_blocks(need))
        self.manager.held_slots += (len(req.blocks) - held) * self.block_size
        if self.enable_caching:
            covered = req.num_computed + (len(hits[0]) if hits else 0) * self.block_size + num_new_tokens
            known = req.num_tokens
            self.register_full_blocks(req, covered if covered < known else known)
        return True

    def would_fit(self, req: Request, num_new_tokens: int, hit: KVCacheBlocks, gate_tokens: int,
                  reserve_free: int, free_blocks: int) -> bool:
        """Would `allocate_slots` succeed with `free_blocks` free? (No state changes.)"""
        return self._blocks_required(req, num_new_tokens, hit.groups, gate_tokens, reserve_free, 0)[1] <= free_blocks

    def _blocks_required(self, req: Request, num_new_tokens: int, hit_blocks, gate_tokens: int,
                         reserve_free: int, lookahead_tokens: int) -> tuple[int, int]:
        """(new blocks each group takes, free blocks the allocation requires to go ahead)."""
        bs = self.block_size
        held = len(req.blocks)
        num_hit = len(hit_blocks[0]) if hit_blocks else 0
        covered = req.num_computed + num_hit * bs + num_new_tokens
        need = cdiv(covered + lookahead_tokens, bs) - held - num_hit
        if need < 0:
            need = 0
        if not (gate_tokens or reserve_free or hit_blocks):
            return need, need * self.num_groups
        ref = self.pool.ref_cnt
        revived = 0                        # hit blocks now free (the null block's count is 1)
        for table in hit_blocks:
            revived += list(map(ref.__getitem__, table)).count(0)
        gate = cdiv(gate_tokens, bs)
        g = self.groups
        full = gate - held - num_hit
        if full < need:
            full = need
        capped = gate if not self.sliding_admission_cap or gate < self.sliding_cap else self.sliding_cap  # vLLM >= 0.20's cap
        sliding = capped - held - num_hit
        if sliding < need:
            sliding = need
        return need, g.full_groups * full + g.sliding_groups * sliding + revived + reserve_free

    def append_slots(self, req: Request, num_new_tokens: int, lookahead_tokens: int = 0) -> bool:
        """Slots for more tokens of a running request, after freeing the blocks behind the window
        (vLLM frees them as it allocates, every step, whether or not a block is needed)."""
        self.remove_skipped_blocks(req)
        return _append_within_held(self, req, num_new_tokens, lookahead_tokens)

    def frees_behind_window(self, req: Request) -> int:
        """How many leading table entries are behind the window of the request's next token,
        when the nearest of them still holds a block (remove_skipped_blocks would free); else 0."""
        tables = req.group_tables
        if not self.sliding_managers or not tables:
            return 0
        first = self.sliding_managers[0]
        skipped = min(first.skipped_blocks(req.num_computed), len(req.blocks))
        if not skipped or tables[first.group_id][skipped - 1] == NULL_BLOCK:
            return 0
        return skipped

    def remove_skipped_blocks(self, req: Request) -> None:
        """Free, in every sliding group, the blocks behind the window of the request's next token
        (null in the table), nearest first, stopping at the first already null."""
        if req.group_tables and self.sliding_managers:     # (a request being admitted holds nothing yet)
            self.free_behind_windows((((req,), 0),))

    def free_behind_windows(self, steps, gains: Optional[tuple[list[int], list[int]]] = None,
                            clock: Optional[int] = None) -> None:
        """`remove_skipped_blocks` of each request in turn: `steps` is (members, ahead) per step, the
        decode cohort's members freeing at that step in running order, their contexts `ahead` tokens
        past their `num_computed` (a stretch's later steps: the cohort's clock moves after the
        call). Their blocks go back in that order; a free only appends to the free queue, so one
        pool call is the calls one after the other. With `gains` (two lists), appends the free and
        cached-free blocks the pool gained by the end of each step. With `clock`, the requests are
        a decode cohort's members at that scheduled step: their `num_computed` is
        `cohort_computed + clock`, read as the field (the property is a call a member visit).
        (`frees_behind_window`'s test, inline: a member's every 16th step or so comes here; so is
        SlidingWindowManager.remove_skipped_blocks' one-block case, a decode step's, with one
        sliding group.)"""
        bs, first, one_window, null = self.block_size, self.sliding_ids[0], self._one_window, NULL_BLOCK
        removed: list[int] = []
        track = self._track_window_frees
        if track:                          # what each request freed: see _publish_window_freed
            free = [0, 0, removed, None]   # (where the free queue ends: filled in once anything is freed)
        ends = [] if gains is not None else None
        offsets = clock is not None        # (members' contexts as offsets from the cohort's clock)
        # a context c leaves (c - edge) // bs blocks behind the window (sliding_window_skipped_blocks);
        # the nearest of them is table entry (c - edge - bs) // bs
        edge = self.window - 1 - (clock or 0) + bs
        for reqs, ahead in steps:
            behind = edge - ahead
            for req in reqs:
                last = ((req.cohort_computed if offsets else req.num_computed) - behind) // bs
                if last < 0:
                    continue
                table = req.group_tables[first]
                try:
                    block = table[last]
                except IndexError:         # (no more than the request holds)
                    last = len(table) - 1
                    if last < 0:
                        continue
                    block = table[last]
                if not block:              # (NULL_BLOCK: freed already)
                    continue
                # (most visits: one block, its predecessor freed already; with last == 0, table[-1] is
                # a held block, so the test fails and the general path frees it)
                if one_window and not table[last - 1]:
                    if track:
                        req.window_frees.append((last, len(removed), free))
                    removed.append(block)
                    table[last] = null
                    continue
                start = len(removed)
                self._remove_behind(req.group_tables, last + 1, removed)
                if track:
                    req.window_frees.append((last + 1, start, len(removed), free))
            if ends is not None:
                ends.append(len(removed))
        if not removed:
            if gains is not None:
                gains[0].extend(ends)      # (all 0)
                gains[1].extend(ends)
            return
        pool = self.pool
        self.windowed_frees += len(removed)
        if removed.count(ANON) < len(removed) or self.named:
            self._free_removed(removed, free if track else None, ends, gains)
            return
        # (the usual free, unnamed blocks only: each joins the free queue, one a block)
        mark = pool.free_unnamed(len(removed))
        if track:                          # (the queue had not moved since the call began)
            free[0], free[1] = mark
        if gains is not None:
            gains[0].extend(ends)
            gains[1].extend(ends if pool.enable_caching else [0] * len(ends))

    def _remove_behind(self, tables: list[list[int]], skipped: int, removed: list[int]) -> None:
        """Null every sliding table's entries before `skipped`, nearest first, back to the first
        null (the sliding tables hold nulls at the same entries), adding their blocks to `removed`."""
        last = skipped - 1
        for g in self.sliding_ids:
            table = tables[g]
            if last == 0 or table[last - 1] == NULL_BLOCK:
                removed.append(table[last])
                table[last] = NULL_BLOCK
            else:
                removed += self.managers[g].remove_skipped_blocks(table, skipped)

    def _free_removed(self, removed: list[int], free: Optional[list], ends: Optional[list[int]],
                      gains: Optional[tuple[list[int], list[int]]]) -> None:
        """Give the pool the blocks free_behind_windows removed when any is named or the pool names
        every block (`ends`: where each step's end)."""
        pool = self.pool
        if free is not None:               # (the queue has not moved since the call began)
            free[0], free[1] = pool.queue_mark()
            free[3] = list(map(pool.ref_cnt.__getitem__, removed))   # (named blocks join only when no one holds them)
            if self.named:                 # (private ones registered unmarked: the cohort's fills)
                pool.cache_private(removed)
        if gains is None:
            pool.free_blocks(removed)
            return
        freed, cached = pool.free_in_steps(removed, ends)   # (a named block joins only when no one holds it)
        gains[0].extend(freed)
        gains[1].extend(cached)

    def register_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish, in every group, the request's blocks that `num_tokens` tokens fill completely
        (its private ones registered privately: see the class)."""
        bs = self.block_size
        full = num_tokens // bs
        first = req.num_registered
        if full <= first:
            return
        public_end = full
        if self.private_blocks:
            private = req.first_private_block(bs)
            if private < full:
                public_end = private
        tables = req.group_tables or self._tables(req)
        if public_end > first:
            req.extend_block_hashes(public_end, bs)
            hashes = req.block_hashes[first:public_end]
            for g, table in enumerate(tables):
                self.pool.cache_blocks(*self._named_entries(table, first, public_end, group_keys(hashes, g)))
        if full > public_end and self.named:     # (CountingBlockPool counts them as cached at free)
            for table in tables:
                self.pool.cache_private(_held(table[max(first, public_end):full]))
        req.num_registered = full

    def _named_entries(self, table: list[int], start: int, end: int, keys: list[int]) -> tuple[list[int], list[int]]:
        """The blocks of table[start:end] and their keys, null entries left out, naming those the
        pool left unnamed (written back into the table)."""
        blocks = table[start:end]
        if not self.named:
            unnamed = blocks.count(ANON)
            if unnamed:
                ids = iter(self.pool.name(unnamed))
                blocks = [next(ids) if b == ANON else b for b in blocks]
                table[start:end] = blocks
        if NULL_BLOCK in blocks:
            kept = [i for i, b in enumerate(blocks) if b != NULL_BLOCK]
            blocks, keys = [blocks[i] for i in kept], [keys[i] for i in kept]
        return blocks, keys

    def filled_entries(self, reqs: list[Request], indexes: list[int]) -> tuple[list[int], list[int]]:
        """(blocks, prefix-cache keys) that publish each request's block at its index, in turn, in
        every group holding it, in group order (register_full_blocks' order for one block)."""
        blocks: list[int] = []
        keys: list[int] = []
        salts = self.salts
        for req, index in zip(reqs, indexes):
            h = req.block_hashes[index]
            for table, salt in zip(req.group_tables, salts):
                block = table[index]
                if block != NULL_BLOCK:
                    if block == ANON:          # (CountingBlockPool: named as it is registered)
                        block = table[index] = self.pool.name(1)[0]
                    blocks.append(block)
                    keys.append(h ^ salt)          # group_key(h, g)
        return blocks, keys

    def free(self, req: Request) -> None:
        """Release a request's blocks, group by group, each table last block first. Its private
        blocks are marked (a pool that names every block), or mapped if it is freed unfinished,
        with those its sliding groups freed behind the window that are still free (see the class)."""
        tables = req.group_tables
        window_freed, req.window_frees = req.window_frees, None
        if tables:
            if self.enable_caching and self.private_blocks and (self.named or req.status < FINISHED):
                self._settle_private(req, window_freed)
            self.manager.held_slots -= len(req.blocks) * self.block_size
            registered, leases = req.num_registered, req.kv_lease
            for g, (table, full) in enumerate(zip(tables, self.full_attention)):
                if full:                   # (a full-attention table holds no null block)
                    self.pool.free_table(table, registered, leases[g] if leases else None)
                    continue
                # (its null entries: none, or leading ones, behind the window or a hit's before it;
                # counted once, over the registered blocks as the pool counts them)
                nulls = table.count(NULL_BLOCK)
                if not nulls:
                    held = table
                elif table[nulls - 1] == NULL_BLOCK:
                    held = table[nulls:]
                    if nulls > registered:
                        nulls = registered
                else:
                    held = _held(table)
                    nulls = table[:registered].count(NULL_BLOCK)
                self.pool.free_table(held, registered - nulls, leases[g] if leases else None)
        req.blocks = []
        req.group_tables = None
        req.num_registered = 0
        req.kv_lease = None

    def _settle_private(self, req: Request, window_freed: Optional[list[tuple]]) -> None:
        first, end = req.first_private_block(self.block_size), req.num_registered
        if end <= first:
            return
        if req.is_finished:
            for table in req.group_tables:
                self.pool.cache_private(_held(table[first:end]))
            return
        req.extend_block_hashes(end, self.block_size)
        if window_freed:
            self._publish_window_freed(req, window_freed)
        hashes = req.block_hashes
        for g, table in enumerate(req.group_tables):
            self.pool.publish(*self._named_entries(table, first, end, group_keys(hashes[first:end], g)))

    def _publish_window_freed(self, req: Request, window_freed: list[tuple]) -> None:
        """Map a request's private blocks freed behind its windows that are still free. Each record
        of free_behind_windows: (skipped, where the request's blocks start and end in the free's
        list, the free: [compactions by then, the free queue's end then, the blocks freed, their
        reference counts before it, or None if all were unnamed]), or for a visit that freed one
        block (its table entry, its place in the free's list, the free); a request's blocks are
        each sliding table's entries skipped - 1, skipped - 2, ..., table after table."""
        pool, salts, sliding = self.pool, self.salts, self.sliding_ids
        first_private = req.first_private_block(self.block_size)
        hashes = req.block_hashes
        blocks: list[int] = []
        positions: list[int] = []
        keys: list[int] = []
        for record in window_freed:
            if len(record) == 3:           # (one block: table entry `last`)
                last, start, free = record
                skipped, end = last + 1, start + 1
            else:
                skipped, start, end, free = record
            epoch, at, removed, refs = free
            per_table = (end - start) // len(sliding)
            where = range(at + start, at + end) if refs is None else _queue_positions(removed, refs, at)[start:end]
            for i, (block, position) in enumerate(zip(removed[start:end], where)):
                index = skipped - 1 - i % per_table
                if position is None or index < first_private:      # (a public block: mapped already)
                    continue
                position = pool.queued_at(epoch, position)
                if position is not None:
                    blocks.append(block)
                    positions.append(position)
                    keys.append(hashes[index] ^ salts[sliding[i // per_table]])      # group_key
        if blocks:
            pool.publish_queued(blocks, positions, keys)

    def held_blocks(self, req: Request) -> int:
        """Pool blocks the request holds over all groups (null entries excluded; tests)."""
        return sum(len(t) - t.count(NULL_BLOCK) for t in req.group_tables or ())

    def check_request(self, req: Request) -> None:
        """Assert a request's tables are consistent (tests): equal lengths, nulls only where a
        sliding group may have freed, every real block referenced."""
        tables = req.group_tables or [[]]
        assert tables[0] is req.blocks and len({len(t) for t in tables}) == 1
        for g, table in enumerate(tables):
            for b in table:
                assert b in (NULL_BLOCK, ANON) or self.pool.ref_cnt[b] >= 1
            if g in self.full_ids:
                assert NULL_BLOCK not in table, f"full-attention group {g} holds a null block"


def _append_within_held(coordinator, req: Request, num_new_tokens: int, lookahead_tokens: int) -> bool:
    """append_slots of either coordinator once its frees are done: within the blocks the request
    holds, publish the blocks its known tokens fill; past them, allocate_slots."""
    covered = req.num_computed + num_new_tokens
    if covered + lookahead_tokens > len(req.blocks) * coordinator.block_size:
        return coordinator.allocate_slots(req, num_new_tokens, lookahead_tokens=lookahead_tokens)
    if coordinator.enable_caching and covered // coordinator.block_size > req.num_registered:
        coordinator.register_full_blocks(req, min(covered, req.prompt_len + req.num_output))
    return True


def _queue_positions(blocks: list[int], refs: list[int], at: int) -> list[Optional[int]]:
    """Where each of these blocks joined the free queue, freed in turn from position `at` with these
    reference counts before (None: a named block another request still held; a block shared by
    two of the requests freeing comes twice)."""
    positions: list[Optional[int]] = []
    left: dict[int, int] = {}
    for block, ref in zip(blocks, refs):
        if block != ANON:
            ref = left[block] = left.get(block, ref) - 1
        if block == ANON or not ref:
            positions.append(at)
            at += 1
        else:
            positions.append(None)
    return positions


def _held(table: list[int]) -> list[int]:
    """A table's entries without its null ones (at C speed where they lead it, as a sliding
    group's do: what fell behind the window, or its hit's blocks before the window)."""
    nulls = table.count(NULL_BLOCK)
    if not nulls:
        return table
    if table[nulls - 1] == NULL_BLOCK:
        return table[nulls:]
    return [b for b in table if b != NULL_BLOCK]
