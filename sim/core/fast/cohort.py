"""The decode cohort: steady decodes advanced one token per step in O(1), not O(batch).

Most of a serving run is running requests each feeding back one token per step. Touching
every one of them every step costs ~0.5 us of Python per token, which is what made 100k
simulated requests slow. Between a few well-defined moments such a request's progress is
a straight line in the step number, so the cohort stores it as offsets from two counters
(`CohortMember`) and only visits a member at its *events*:

  cross  - the step whose token starts a new block: allocate it (paged), count it walked;
  fill   - the step whose token completes a block: publish its hash to the prefix cache;
  finish - the step that emits the member's last token.

Members are grouped by the phase of their context within a block, so the members crossing
or filling a block at a step are one group: per step the work is O(members at a block
boundary + finishing), ~batch / block_size.
The scheduler uses the cohort only when every running request gets all it asks for this
step (budget and free blocks suffice): then the order in which vLLM would visit them
cannot matter and the outcome equals the one-by-one loop exactly. Otherwise it dissolves
the cohort (materialising each member) and takes the one-by-one path (`lazy_decode=False`
forces that path; tests compare the two).

Grouped KV caches (sliding-window and hybrid models): a crossing member takes a block in each
of its tables, and a member with a sliding window frees the block its window left behind on the
steps whose context before the token is window - 1 mod block_size (a phase group too), or at its
first step after joining (a prefill chunk may have left several), in the running order.

Pauses (`prefill_first`): a prefill step schedules no decode, so the members skip it. Rather
than dissolving, the cohort keeps its own clock, which counts the steps it advanced: `clock =
step - offset`, `offset` the number of steps it sat out. Members' offsets (`cohort_computed`,
`cohort_output`), phases and finish times all run on that clock, so a pause is O(1): the offset grows
and the step is remembered in `pauses`. A member's emission runs (split by every pause it sat
through) are built from that list when it leaves (`emission`), not at each pause.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import defaultdict
from functools import partial
from itertools import accumulate
from operator import attrgetter
from typing import Optional

from sim.core.kv import ANON, CacheLayout
from sim.core.request import Request


_run_seq = attrgetter("run_seq")      # a request's position in the running list (a C-level sort key)
_own_last_emit = Request.last_emit.__get__    # a member's own last_emit field (the property hides it)
_own_blocks = Request.blocks.__get__          # a member's own block table (the property hides it)


class CohortMember(Request):
    """A request while it belongs to a decode cohort. Its progress is a straight line in the
    cohort's clock: the cohort's counters plus the member's offsets (`cohort_computed`,
    `cohort_output`), so these properties give the true values and nobody but the cohort can
    change them (they have no setter). `DecodeCohort.join` turns a Request into one, `leave`
    turns it back, writing the true values into its fields."""

    __slots__ = ()

    @property
    def num_computed(self) -> int:
        return self.cohort_computed + self.cohort.scheduled_step

    @property
    def num_output(self) -> int:
        return self.cohort_output + self.cohort.finished_step

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.cohort_output + self.cohort.finished_step

    @property
    def last_emit(self) -> int:
        return self.cohort.last_emit(self)

    @property
    def blocks(self) -> list:
        return self.cohort.block_table(self)


class DecodeCohort:
    def __init__(self, layout: CacheLayout):
        self.layout = layout
        self.block_size = layout.block_size
        self.paged = layout.paged
        self.caching = layout.prefix_caching
        # (the leap planner's questions, read once: CacheLayout answers them in properties)
        self.free_blocks_only_shrink = layout.free_blocks_only_shrink
        self.takes_stretch_in_bulk = layout.takes_stretch_in_bulk
        self.named = layout.named_blocks  # every block has an id: crossing members take theirs in running order
        # Per-group tables (sim/core/kv/coordinator.py HybridCoordinator): `tables` block tables
        # per member, each taking a block at a crossing; with a sliding `window` a member also
        # frees the block behind it, on the steps whose token leaves a block behind the window.
        self.tables = layout.tables
        self.per_group_tables = layout.per_group_tables
        self.window = layout.sliding_window
        # One table of blocks with no ids (CountingBlockPool): crossing members take theirs in any
        # order, and all alike, so `advance` and `advance_many` only count them: a member's table
        # is written when read (`block_table`; paged: a contiguous table is whole from admission).
        self.any_order = not self.per_group_tables and not self.named
        self.tables_owed = self.any_order and self.paged
        self._joined: dict[Request, None] = {}   # (window) members yet to free what their join left
        self.private_blocks = layout.private_blocks   # members' private fills registered as such (kv/coordinator.py)
        self._public_fillers = 0      # members whose fills are mapped as they happen (caching only)
        self.members: dict[Request, None] = {}      # insertion-ordered set
        self.offset = 0               # steps the cohort sat out (pauses): clock = step - offset
        self.scheduled_step = -1      # clock of the latest step whose tokens are scheduled
        self.finished_step = -1       # clock of the latest step whose tokens were emitted
        self.last_emit_step = -2      # the (global) step at which the members last emitted
        self.pauses: list[int] = []   # steps sat out while the cohort had members, ascending
        self._paused = -1             # the latest step sat out
        self.ctx_offset_sum = 0       # sum of members' cohort_computed (context - scheduled_step)
        self.blocks_walked = 0        # sum of members' cdiv(context, block_size) at scheduled_step
        # A member's context at step t is cohort_computed + t, so its block boundaries fall on the steps
        # t with t = -cohort_computed (mod block_size): members grouped by cohort_computed % block_size all
        # cross (start a block) and fill (complete one) on the same steps, with no per-member events:
        # at clock c, phase (1 - c) % block_size crosses into a new block (read by sim/core/fast/leap.py).
        self.by_phase: list[dict[Request, None]] = [{} for _ in range(self.block_size)]
        # (window) Phases whose group may not be in running order (a member joined behind one
        # admitted after it; a phase stays marked, sorted at each of its frees as before): the
        # others are, as members join in running order and leaving keeps the order, so a window's
        # frees read them as they are (no sort a step: `advance`).
        # (29 attributes: from the 30th, CPython 3.11 keeps an instance's attributes in a dict of
        # its own and every `self.` read costs more, +3 % of Mistral v0.1's line; a test holds it.)
        self._unordered: set[int] = set()
        # The same groups counted by the clocks at which they cross: crossings[c % block_size] members
        # start a block at clock c (the leap planner reads a stretch's crossings as a slice of it).
        self.crossings = [0] * self.block_size
        self._finish: dict[int, list] = defaultdict(list)
        self._finish_steps: list[int] = []          # heap of the keys of _finish

    def __len__(self) -> int:
        return len(self.members)

    # -- membership ------------------------------------------------------------------------
    def join(self, req: Request, step: int) -> None:
        """Take a decoding request after finish_step(step); its next token is scheduled at step + 1."""
        bs = self.block_size
        computed, output = req.num_computed, req.num_output
        offset = req.cohort_computed = computed - self.scheduled_step
        req.cohort_output = output - self.finished_step
        req.cohort = self
        req.cohort_pause_index = len(self.pauses)
        req.cohort_gen += 1
        req.__class__ = CohortMember
        self.members[req] = None
        phase = self.by_phase[offset % bs]
        if self.window is not None:
            if phase and next(reversed(phase)).run_seq > req.run_seq:
                self._unordered.add(offset % bs)
            self._joined[req] = None
        phase[req] = None
        self.crossings[(1 - offset) % bs] += 1
        self.ctx_offset_sum += offset
        self.blocks_walked += -(-computed // bs)
        finish = self.finished_step + req.output_len - output        # on the cohort's clock
        if finish not in self._finish:
            heapq.heappush(self._finish_steps, finish)
        self._finish[finish].append((req, req.cohort_gen))
        # Every block a member fills holds some of its output: private, or hashed now in bulk
        # (scripted outputs are known up front).
        req.cohort_private_fills = self.private_blocks and req.first_private_block(bs) <= computed // bs
        if self.caching and not req.cohort_private_fills:
            req.extend_block_hashes((req.max_len - 1) // bs, bs)
            self._public_fillers += 1

    def leave(self, req: Request) -> None:
        """Materialise a member's progress and let it go (finished, preempted, dissolved)."""
        offset = req.cohort_computed
        computed, output = offset + self.scheduled_step, req.cohort_output + self.finished_step
        self.ctx_offset_sum -= offset
        self.blocks_walked -= -(-computed // self.block_size)
        del self.by_phase[offset % self.block_size][req]
        self.crossings[(1 - offset) % self.block_size] -= 1
        if self._joined:
            self._joined.pop(req, None)
        if self.tables_owed:
            self.block_table(req)            # (its table written up to its context)
        runs, start, last = self.emission(req)
        req.__class__ = Request
        req.emit_runs, req.emit_start, req.last_emit = runs, start, last
        req.num_computed, req.num_output = computed, output
        req.cohort = None
        req.cohort_gen += 1
        del self.members[req]
        if self.caching:
            if req.cohort_private_fills:     # its fills were not marked one by one (the pool marks them at free)
                full = computed // self.block_size
                if full > req.num_registered:
                    req.num_registered = full
            else:
                self._public_fillers -= 1

    def block_table(self, req: Request) -> list:
        """A member's block table (`Request.blocks`). Unnamed blocks (`any_order`) are all alike, so
        the steps hand a crossing member none: the pool counts them, and the member's table is
        written up to its context when it is read (the one-by-one loop's table: one ANON per block
        since it joined), at the latest when it leaves."""
        blocks = _own_blocks(req)
        if self.tables_owed:
            owed = -(-(req.cohort_computed + self.scheduled_step) // self.block_size) - len(blocks)
            if owed > 0:
                blocks += [ANON] * owed
        return blocks

    def last_emit(self, req: Request) -> int:
        """The step of a member's latest token (it joined after emitting one)."""
        own, members = _own_last_emit(req), self.last_emit_step
        return members if members > own else own              # max(own, members), without a call

    def emission(self, req: Request) -> tuple[list[int], int, int]:
        """A member's (closed emission runs, open run's start, latest emission): it emitted at every
        step from its open run's start on, except at the pauses it sat through (no state changes)."""
        own, members = _own_last_emit(req), self.last_emit_step
        last = members if members > own else own          # last_emit(req), without the call
        runs, start = req.emit_runs, req.emit_start
        pauses = self.pauses
        i = req.cohort_pause_index
        j = bisect_left(pauses, last, i)       # the pauses it sat through before its latest token
        if j > i:                              # (a loop: two comprehensions made two functions a call)
            runs = list(runs)
            for p in pauses[i:j]:              # a run up to the step before each pause, the next after it
                if start <= p - 1:             # back-to-back pauses leave no run between them
                    runs += (start, p - 1)
                start = p + 1
        return runs, start, last

    # -- the clock ---------------------------------------------------------------------------
    def clock(self, step: int) -> int:
        return step - self.offset

    def pause(self, step: int) -> None:
        """Sit out `step` (a prefill_first prefill step): nobody advances, nobody emits."""
        self.offset += 1
        self.scheduled_step = step - self.offset
        self._paused = step
        if self.members:
            self.pauses.append(step)

    def sync(self, step: int) -> None:
        """`step` is scheduled (with or without members)."""
        self.scheduled_step = step - self.offset

    def dissolve(self) -> list[Request]:
        members = list(self.members)
        for req in members:
            self.leave(req)
        return members

    # -- one step --------------------------------------------------------------------------
    def take_step(self, sched, batch, budget: int) -> Optional[list[Request]]:
        """The members' part of the scheduler's running pass at `batch.step`: if every member gets
        its token this step, schedule them all at once (`advance`) and put them in `batch`; returns
        the running non-members (admission order), which the pass then walks one by one.
        Otherwise the cohort dissolves (its members are plain requests again) and returns None.

        Every member gets its token when no member sits after the point where the token budget
        runs out and the free blocks cover every allocation of the step, so no preemption can
        happen. The cohort then goes first, so no non-member may take blocks (or, behind a sliding
        window, free them) before a member would in the running order (`_others_blocks`).
        """
        step, kv = batch.step, sched.kv
        n = len(self.members)              # (len(self) would call __len__)
        active = sched.active
        others = list(active) if active else []     # (most steps none: list({}) counts ~1k instructions)
        # (due_blocks(step), inline: a call every step)
        blocks = self.crossings[(step - self.offset) % self.block_size] * self.tables if self.paged else 0
        if others and n <= budget:
            blocks = self._others_blocks(sched, others, step, budget - n, blocks)
        if n > budget or blocks is None or blocks > kv.pool.num_free:
            self.dissolve()
            return None
        self.advance(step, kv)
        if sched.lists_members:
            batch.decodes.extend(self.members)
        batch.num_decode += n
        batch.cohort_size = n
        batch.decode_ctx += self.ctx_offset_sum + n * self.scheduled_step
        batch.blocks_read += self.blocks_walked
        return others

    def _others_blocks(self, sched, others: list[Request], step: int, left: int, blocks: int) -> Optional[int]:
        """The blocks the step takes, the members' `blocks` and what the non-members `others`
        take with `left` tokens after the members', or None when one of them would take blocks or
        free behind its window before a member would, or leave no budget to a member after it."""
        kv, bs = sched.kv, self.block_size
        first_crossing = self.first_crossing_seq(step)
        last_freeing = self._last_freeing_seq(step) if self.window is not None else -1
        num_new_tokens = sched.num_new_tokens
        for req in others:
            n = num_new_tokens(req, left)
            if n is None:
                continue
            if self.paged:
                new = max(0, -(-(req.num_computed + n) // bs) - len(req.blocks))
                if new and req.run_seq < first_crossing:
                    return None        # it takes its blocks before a member would: keep vLLM's order
                blocks += new * self.tables
            if req.run_seq < last_freeing and kv.frees_behind_window(req):
                return None            # it frees before a member would: keep the free queue's order
            left -= n
            if left == 0:
                running = sched.running
                if any(r.cohort is not None for r in running[running.index(req) + 1:]):
                    return None
                break
        return blocks

    def _last_freeing_seq(self, step: int) -> int:
        """The latest running position among members that may free behind their window at `step`."""
        freeing = self.freeing(step)
        return max(map(_run_seq, freeing)) if freeing else -1

    def end_step(self, step: int) -> list[Request]:
        """`step` ran: the members emitted. Returns those that emitted their last token, which
        have left the cohort."""
        clock = step - self.offset
        if step != self._paused:           # (unless the cohort sat this step out)
            self.last_emit_step = step
        self.finished_step = clock
        due = self._finish.pop(clock, None)
        if due is None:                    # most steps
            return []
        finished = []                      # (a loop: a comprehension makes a function and a frame a call)
        for req, gen in due:
            if req.cohort_gen == gen:      # (leave moves only its own request's generation on)
                self.leave(req)
                finished.append(req)
        return finished

    def _crossing(self, step: int) -> dict[Request, None]:
        """Members whose token at `step` starts a new block (context before it is a multiple of bs)."""
        return self.by_phase[(1 - step + self.offset) % self.block_size]

    def first_crossing_seq(self, step: int) -> float:
        """The earliest running position among members that need a block at `step`."""
        crossing = self._crossing(step) if self.paged else ()
        return min(map(_run_seq, crossing)) if crossing else float("inf")

    def due_blocks(self, step: int) -> int:
        """Blocks the members need at `step` (`_crossing`'s group counted, read here without the
        call: the scheduler and the leap planner ask this at every step)."""
        return self.crossings[(step - self.offset) % self.block_size] * self.tables if self.paged else 0

    def freeing(self, step: int) -> dict[Request, None]:
        """Members whose token at `step` may leave blocks behind the window: those whose context
        before it is window - 1 mod block_size (sliding_window_skipped_blocks steps up there),
        and those that joined since the last step (a prefill chunk may have left several)."""
        due = self.by_phase[(self.window - step + self.offset) % self.block_size]
        return {**due, **self._joined} if self._joined else due

    def advance(self, step: int, kv) -> None:
        """Schedule one token for every member at `step`, handling the members' block boundaries."""
        clock = step - self.offset
        if self.window is not None:        # before the clock moves: members' contexts before the token
            phase = (self.window - clock) % self.block_size     # (freeing(step), inline, in running order)
            freeing = self.by_phase[phase]
            if self._joined:               # (members that joined since the last step: a prefill may have left several)
                freeing = sorted({**freeing, **self._joined}, key=_run_seq)
                self._joined = {}
            elif len(freeing) > 1 and phase in self._unordered:
                freeing = sorted(freeing, key=_run_seq)
            if freeing:
                kv.free_behind_windows(((freeing, 0),), clock=self.scheduled_step)
        self.scheduled_step = clock
        bs = self.block_size
        crossing = self.by_phase[(1 - clock) % bs]
        self.blocks_walked += len(crossing)
        if self.paged and crossing:
            blocks = kv.pool.get_new_blocks(len(crossing) * self.tables)
            if not self.any_order:         # (unnamed blocks: the take counts and evicts; `block_table`)
                self._hand_out((crossing,), blocks)
            kv.held_slots += bs * len(crossing)
        if self._public_fillers:
            self._register_fills(range(clock, clock + 1), kv)

    def _hand_out(self, crossings, blocks: list[int]) -> None:
        """Give the members crossing into a block at a run of steps (`crossings`, step by step) the
        blocks taken for them, as the one-by-one loop takes them: step, then running order (a pool
        that names its blocks), then each member's tables in turn (a table per group)."""
        blocks = iter(blocks)
        if not self.per_group_tables:
            named = self.named
            for crossing in crossings:
                if crossing:
                    for req, block in zip(self._in_running_order(crossing) if named else crossing, blocks):
                        req.blocks.append(block)
            return
        if not self.named:                 # (unnamed blocks are all alike: any order, no ids to hand out)
            if self.tables == 2:           # (a hybrid model's usual two groups: no loop over the tables)
                for crossing in crossings:
                    for req in crossing:
                        first, second = req.group_tables
                        first.append(ANON)
                        second.append(ANON)
                return
            for crossing in crossings:
                for req in crossing:
                    for table in req.group_tables:
                        table.append(ANON)
            return
        for crossing in crossings:
            if crossing:
                for req in self._in_running_order(crossing):
                    for table, block in zip(req.group_tables, blocks):     # (zip stops at the tables' end)
                        table.append(block)

    def _register_fills(self, clocks: range, kv) -> None:
        """Publish the blocks the members' tokens complete at these clocks, in step order (members
        whose fills are private are left alone: see `leave`)."""
        by_phase, bs = self.by_phase, self.block_size
        filling: list[Request] = []
        indexes: list[int] = []
        for clock in clocks:
            for req in by_phase[-clock % bs]:
                if not req.cohort_private_fills:
                    index = (req.cohort_computed + clock) // bs - 1
                    filling.append(req)
                    indexes.append(index)
                    req.num_registered = index + 1
        if filling:
            kv.pool.cache_blocks(*kv.filled_entries(filling, indexes))

    def advance_grouped(self, step: int, steps: int, kv) -> tuple[list[int], list[int]]:
        """`advance` over steps step .. step + steps - 1 with a table per KV cache group (members
        behind sliding windows free blocks between their crossings). The stretch's blocks come off
        the free queue in one take (step, then running order, then each member's tables in turn),
        the blocks the members fill are registered, then the blocks behind the windows are freed,
        step by step, each step's in running order. That is what the step-by-step order (at each
        step: frees, takes, registrations) does:
          - the takes come off the queue's head ahead of every block freed in the stretch: a
            stretch runs only when its blocks are free before any of its frees (the cohort's
            `take_step`, the leap's `reach`), and a free only appends to the tail;
          - registrations commute with takes (see `advance_many`), and frees touch no hash;
          - a block freed behind a window was filled, so registered, at least a step before, and
            a free drops a reference held until then: what it counts as cached is what it would.
        Returns the pool's free and cached-free blocks after each step."""
        bs, by_phase, pool = self.block_size, self.by_phase, kv.pool
        clock = step - self.offset
        free0, cached0 = pool.num_free, pool.num_cached_free
        # by_phase[(1 - c) % bs] for c in the stretch: a slice of the groups in reverse, repeated (C speed)
        first = (clock - 2) % bs
        end = first + steps
        cycle = by_phase[::-1]
        crossings = cycle[first:end] if end <= bs else (cycle * (1 + (end - 1) // bs))[first:end]
        walked = list(map(len, crossings))
        total = sum(walked)
        taken = total * self.tables
        evicted_at: list[int] = []
        if total:
            self._hand_out(crossings, pool.get_new_blocks(taken, evicted_at))
            kv.held_slots += bs * total
            self.blocks_walked += total
        if self._public_fillers:
            self._register_fills(range(clock, clock + steps), kv)
        free_after: list[int] = []
        cached_after: list[int] = []
        if self.window is not None:
            # each step's freeing members, with how far their contexts are past their `num_computed`
            # then (the clock moves step by step; `num_computed` reads the stretch's start until the end):
            # by_phase[(window - c) % bs] for c in the stretch, a slice of `cycle` as the crossings
            first = (clock - self.window - 1) % bs
            end = first + steps
            freeing = cycle[first:end] if end <= bs else (cycle * (1 + (end - 1) // bs))[first:end]
            if self._joined:               # (as in `advance`: a prefill may have left several)
                freeing[0] = sorted({**freeing[0], **self._joined}, key=_run_seq)
                self._joined = {}
            for phase in self._unordered:  # (its steps in the stretch; a list sorted above stays so)
                for i in range((self.window - phase - clock) % bs, steps, bs):
                    if len(freeing[i]) > 1:
                        freeing[i] = sorted(freeing[i], key=_run_seq)
            # (the stretch starts at the step after the scheduled one: its i-th step's contexts are
            # i tokens past what `num_computed` reads until the end)
            kv.free_behind_windows(zip(freeing, range(steps)), (free_after, cached_after), clock=self.scheduled_step)
        else:
            free_after = cached_after = [0] * steps
        self.scheduled_step = clock + steps - 1
        # the pool's figures step by step: what the frees gave back by then, less the blocks taken
        # and the hashes evicted by then
        per_table = self.tables
        ends = list(accumulate(walked))
        if not evicted_at:                 # (most stretches: nothing evicted; one loop, not two comprehensions)
            free, cached = [], []
            for end, f, r in zip(ends, free_after, cached_after):
                free.append(free0 - end * per_table + f)
                cached.append(cached0 + r)
            return free, cached
        free = [free0 - end * per_table + f for end, f in zip(ends, free_after)]
        evicted = [bisect_left(evicted_at, end * per_table) for end in ends]
        return free, [cached0 - e + r for e, r in zip(evicted, cached_after)]

    def advance_many(self, step: int, walked: list[int], kv) -> list[int]:
        """`advance` over steps step .. step + len(walked) - 1 at once (a paged pool), `walked[i]`
        the members crossing into a new block at step + i. The leap's blocks come off the free
        queue in one take, in the order the step-by-step calls take them (step, then running
        order); then the blocks the members fill are registered, step by step. Taking before
        registering changes nothing: a take only drops hashes of free blocks, a registration only
        adds hashes of held ones, and per hash those are a removal and an append on one ordered
        list of blocks, which commute. Returns the hashes evicted by the end of each step (an
        empty list when none was)."""
        total = sum(walked)
        bs = self.block_size
        by_phase, clock = self.by_phase, step - self.offset
        evicted_by_step: list[int] = []    # (none evicted: empty)
        if total:
            evicted_at: list[int] = []
            blocks = kv.pool.get_new_blocks(total, evicted_at)
            if not self.any_order:         # (unnamed blocks: the take counts and evicts; `block_table`)
                phase = 1 - clock
                crossings = []
                for i, w in enumerate(walked):
                    if w:
                        crossings.append(by_phase[(phase - i) % bs])
                self._hand_out(crossings, blocks)
            if evicted_at:
                # (map, not a comprehension: one reading a local makes it a cell at every call)
                evicted_by_step = list(map(partial(bisect_left, evicted_at), accumulate(walked)))
            kv.held_slots += bs * total
            self.blocks_walked += total
        self.scheduled_step = step + len(walked) - 1 - self.offset   # (before the fills read members' tables)
        if self._public_fillers:
            self._register_fills(range(clock, clock + len(walked)), kv)
        return evicted_by_step

    @staticmethod
    def _in_running_order(crossing: dict[Request, None]):
        """Members taking a block at one step, in the order the one-by-one loop hands them out
        (the running list's). Only a pool that names its blocks needs it: unnamed blocks are all
        alike, so callers skip the call (one per crossing step) and take any order."""
        return sorted(crossing, key=_run_seq) if len(crossing) > 1 else crossing

    def next_finish(self) -> float:
        """The earliest step at which a member may emit its last token, if no pause comes first
        (inf if none)."""
        heap = self._finish_steps
        while heap and heap[0] not in self._finish:
            heapq.heappop(heap)
        return heap[0] + self.offset if heap else float("inf")
