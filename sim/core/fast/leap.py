"""Event leaps: advance a scheduler over many decode steps at once.

Between two events the batch composition of a replica is fixed: the same requests decode,
each one token per step, so step k of the stretch has a known shape (members, total decode
context = c0 + members x k, blocks walked growing at each member's block boundary). A
driver may then plan the stretch here, price all its steps in bulk, and apply as many of
them as it likes in one go, instead of calling `schedule` / `finish_step` per step.

A leap covers steps t .. t+K-1 that the one-step path would schedule as pure cohort steps:
  - every running request is a cohort member (no prefill, chunk or live request running);
  - each step's token budget covers the members, and the free blocks cover every block
    the members cross, step by step (so no preemption can happen);
  - the waiting head would not be admitted at step t. Free blocks only shrink during the
    stretch and a cached prefix only loses blocks, so a head that cannot start at step t
    cannot start later in it either (the requirement never drops, the supply never grows).
    A grouped KV cache's members also free blocks behind sliding windows, so the supply can
    grow: it leaps only when nobody waits;
  - no member emits its last token before step t+K-1 (a finish may end the leap);
  - with async scheduling, requests that finished at step t-1 still hold their blocks and seats
    through step t's scheduling pass and are released right after it (sim/core/scheduler.py):
    free blocks and seats grow once, after step t. Such a plan first covers step t alone; once a
    driver knows step t runs (`LeapPlan.settle`), step t is scheduled and its finishers released,
    and the waiting head is checked again at t+1 against what they freed.
Arrivals are the driver's business: it must end the leap before the next request reaches
any router (sim/simulator.py cuts it at the first step ending at or after that time). With async
scheduling, a request that arrives while a step is in flight joins WAITING only after the next
step's pass, so a driver that alone sees the arrivals (a chained run) may take that step too
(`LeapPlan.timed`'s `held_over`) and move them to WAITING after it.

`apply_leap` takes the stretch's blocks from a paged pool in one go, in the order the one-step
path takes them, and registers the blocks the members fill (DecodeCohort.advance_many, so every
block id, hash and eviction comes out the same; grouped caches, whose members free behind their
windows between crossings, then free step by step: DecodeCohort.advance_grouped); static and
contiguous batches replay their steps through the cohort itself. It closes with one `finish_step`. The driver's step times come from the cost model
in bulk; equal, bit for bit, to pricing the steps one by one (same float operations).
"""
from __future__ import annotations

import math
from itertools import accumulate, repeat
from operator import sub
from typing import Optional

import numpy as np

from sim.core.scheduler import Scheduler


class LeapPlan:
    """Up to `max_steps` pure decode steps from `first_step`; step k's shape on demand.

    `max_steps` is first the bound set by the members' next finish; the steps whose blocks
    the pool can still give are counted lazily (`reach`), as far as a driver asks. (`plan_leap`
    makes it, from what it read of the scheduler: the cohort's `clock` at the first step, the
    pool's `free` blocks.)"""

    __slots__ = ("first_step", "max_steps", "rows", "members", "pending", "settled", "_first_ctx",
                 "walked", "_walked_before", "static_shape", "_clock", "_crossings", "_tables", "_free", "_taken", "_limit")

    def reach(self, k: int) -> int:
        """How many of the first k steps can run (their blocks are free); counts them on demand."""
        walked = self.walked
        if k > self._limit:                # (min(k, limit) without the call: asked ~3 times a request)
            k = self._limit
        n = len(walked)
        if n < k:
            # the members crossing into a block at step i: crossings[(clock + i) % bs], so steps
            # n .. k-1 are one slice of the cycle repeated (at C speed, where most leaps are short)
            crossings, tables = self._crossings, self._tables
            bs = len(crossings)
            start = (self._clock + n) % bs
            end = start + k - n
            new = crossings[start:end] if end <= bs else (crossings * (1 + (end - 1) // bs))[start:end]
            taken = self._taken + sum(new) * tables    # (blocks freed behind windows are not counted)
            if taken > self._free:                     # the pool runs out in these steps: at which?
                taken = self._taken
                for i, w in enumerate(new):
                    taken += w * tables
                    if taken > self._free:
                        self._limit = k = n + i
                        del new[i:]
                        break
            walked += new
            self._taken = taken
        return k

    def settle(self, sched: Scheduler) -> None:
        """Schedule the first step now and release the last step's finishers after it, as the
        one-step path's pass does (a plan with finishers pending; the driver knows step t runs).
        The plan then reaches past step t unless the waiting head would start at t + 1."""
        if not self.pending or self.settled is not None:
            return
        if sched.step != self.first_step:  # (its blocks are counted: `plan_leap` counts step t's)
            raise AssertionError("settle: the plan's first step is not the scheduler's next one")
        t, cohort, kv = self.first_step, sched.cohort, sched.kv
        cohort.advance(t, kv)
        sched.tokens_held += self.members
        sched.release_finishing()
        pool = kv.pool
        self.settled = sched.kv_figures()
        # Free blocks only shrink from here on (or grow, behind sliding windows): steps t+1 ... are
        # counted against what is free now.
        if self._free != math.inf:
            self._free, self._taken = pool.num_free, 0
        first = cohort.due_blocks(t + 1)
        if self.max_steps > 1 and not (first > pool.num_free or sched.waiting and _head_starts(
                sched, self.members, pool.num_free - first)):
            self._limit = self.max_steps

    def timed(self, sched: Scheduler, price, start: float, horizon: float, most: int,
              held_over: bool = False) -> tuple:
        """Price the plan's first steps one by one, up to `most`: step i ends where step i-1 ended
        plus its host + device time (`price(decode ctx, blocks read)`), the first at `start` plus
        its own, added one by one as SimPy's clock adds them, until the step in flight at `horizon`
        or the plan's end. (A step ending exactly at `horizon` is left out: which of the two comes
        first is the driver's queue order.) With `held_over` (async scheduling: what arrives while
        a step is in flight joins WAITING only after the next step's pass) the step after the one
        in flight is the leap's last, where the plan reaches it (`_held_over_step`). Returns (ends,
        hosts, devices, ctx, blocks, more), with `more` when all `most` steps end before `horizon`
        and the plan goes on. A pending plan is settled (`settle`) once its first step ends before
        `horizon` (or is in flight then, with `held_over`)."""
        ends: list[float] = []
        hosts: list[float] = []
        devices: list[float] = []
        ctxs: list[int] = []
        reads: list[int] = []
        per = self.rows                    # (every row's context grows by one a step)
        ctx = self._first_ctx
        if self.static_shape is None:
            blocks, crossed = self._walked_before, self.walked
        else:
            blocks, crossed = self._static_reads(most)
        t = start
        done = 0
        reached = self.reach(most)     # (a pending plan: step t alone until it settles)
        while True:
            # (the steps counted so far; each step's blocks read are the last step's plus what it
            # crossed: no index, no test of how far the plan reaches, per step)
            for walked in crossed[done:reached]:
                blocks += walked
                h, d = price(ctx, blocks)
                t = t + (h + d)
                if t >= horizon:
                    if t > horizon:            # the step in flight when the horizon comes
                        ends.append(t)
                        hosts.append(h)
                        devices.append(d)
                        ctxs.append(ctx)
                        reads.append(blocks)
                        if held_over:
                            self._held_over_step(sched, price, len(ends) - 1, t, ctx + per, blocks,
                                                 (ends, hosts, devices, ctxs, reads))
                    return ends, hosts, devices, ctxs, reads, False
                ends.append(t)
                hosts.append(h)
                devices.append(d)
                ctxs.append(ctx)
                reads.append(blocks)
                ctx += per
            if self.pending and self.settled is None and ends:
                self.settle(sched)             # step t runs: its finishers go, the plan goes on
                done = 1
                reached = self.reach(most)
                continue
            return ends, hosts, devices, ctxs, reads, reached == most and self.reach(most + 1) > most

    def _static_reads(self, most: int) -> tuple[int, list[int]]:
        """A static batch's blocks read before its first step and what each of its first `most`
        steps adds: every row walks cdiv(padded length, block_size) blocks (`timed`'s steps add
        these up, to the same integers)."""
        offset, bs = self.static_shape
        t, rows = self.first_step, self.rows
        reads = [rows * -(-(offset + t + i) // bs) for i in range(-1, most)]
        return reads[0], [b - a for a, b in zip(reads, reads[1:])]

    def _held_over_step(self, sched: Scheduler, price, i: int, t: float, ctx: int, blocks: int,
                        columns: tuple) -> None:
        """Step i + 1 after step i, in flight at the horizon, ending at `t` (`timed`), appended to
        `columns` where the plan reaches it. With async scheduling, requests that arrive while
        step i runs wait in `arriving` through step i + 1's pass (sim/core/async_scheduling.py),
        which therefore schedules what it would without them: the plan's next step (the waiting
        head, as the plan found it, does not start). The driver moves them to WAITING after it."""
        if not i and self.pending:
            self.settle(sched)                 # step t runs: its finishers go
        if len(self.walked) < i + 2 and self.reach(i + 2) <= i + 1:     # (counted already: it reaches)
            return                             # the plan ends at step i
        blocks += self.walked[i + 1]
        static = self.static_shape
        read = blocks if static is None else self.rows * -(-(static[0] + self.first_step + i + 1) // static[1])
        h, d = price(ctx, read)
        ends, hosts, devices, ctxs, reads = columns
        ends.append(t + (h + d))
        hosts.append(h)
        devices.append(d)
        ctxs.append(ctx)
        reads.append(read)

    def shapes(self, k: int, start: int = 0) -> tuple[list[int], list[int]]:
        """(decode context, blocks read) of steps start .. k-1 (k <= reach(k))."""
        t = self.first_step
        ctx0, per = self._first_ctx, self.rows
        if self.static_shape is not None:
            offset, bs = self.static_shape
            return ([ctx0 + per * i for i in range(start, k)],
                    [self.rows * -(-(offset + t + i) // bs) for i in range(start, k)])
        # (members >= 1 a step: the context grows by a constant, a range does the list at C speed)
        ctx = list(range(ctx0 + per * start, ctx0 + per * k, per))
        walked = self.walked
        blocks = list(accumulate(walked[start:k], initial=self._walked_before + sum(walked[:start])))
        del blocks[0]
        return ctx, blocks

    def columns(self, k: int) -> dict[str, np.ndarray]:
        """The first k steps as step-record columns (`CostModel.step_times` prices them in bulk)."""
        ctx, blocks = self.shapes(k)
        zeros = np.zeros(k, dtype=np.int64)
        rows = np.full(k, self.rows, dtype=np.int64)
        return {"num_seqs": rows, "decode_seqs": rows, "prefill_tokens": zeros,
                "decode_ctx": np.asarray(ctx, dtype=np.int64), "prefill_ctx": zeros, "prefill_attn": zeros,
                "blocks_read": np.asarray(blocks, dtype=np.int64)}


class StepShape:
    """A decode-only step's composition, read by the cost model like a Batch."""

    __slots__ = ("num_decode", "decode_ctx", "blocks_read")
    prefills = ()
    decodes = ()        # (their contexts: within the CUDA graphs, where a leap stops: Simulation._graph_steps)
    num_prefill_tokens = prefill_ctx = prefill_attn = 0

    def __init__(self, rows: int, decode_ctx: int, blocks_read: int):
        self.num_decode, self.decode_ctx, self.blocks_read = rows, decode_ctx, blocks_read


def plan_leap(sched: Scheduler, max_steps: int, min_steps: int = 1) -> Optional[LeapPlan]:
    """The pure-decode stretch starting at the scheduler's next step, or None if there is none
    (or if a member finishes within fewer than `min_steps`: a short leap does not pay).
    The plan's steps are bounded by the next finish; `LeapPlan.reach` counts how many of
    them the free blocks allow."""
    cohort, kv, cfg = sched.cohort, sched.kv, sched.config
    members = len(cohort.members)
    t = sched.step
    clock = t - cohort.offset
    # (async scheduling: the last step's finishers, still holding blocks and seats, are neither
    # members nor active; the plan waits for `settle` to go past step t, see LeapPlan)
    # A grouped KV cache leaps only with nobody waiting: its members also free blocks behind their
    # windows, so the free blocks can grow during the stretch and let a waiting head start in it.
    # Async scheduling: requests that arrived during the last step join WAITING only after the
    # next schedule() pass (Scheduler.arriving), which a leap would skip: no leap until then.
    if (not sched.lazy or not cohort.free_blocks_only_shrink and sched.waiting or not members or sched.active
            or sched.arriving
            or cohort.scheduled_step != clock - 1
            or cohort.finished_step != clock - 1 or members > cfg.max_num_batched_tokens):
        return None
    to_finish = cohort.next_finish() - t + 1
    if to_finish < max_steps:
        max_steps = int(to_finish)
    if max_steps < min_steps or max_steps < 1:
        return None
    # blocks the members take at the first step (due_blocks(t), inline: a call every plan)
    crossing = cohort.crossings[clock % cohort.block_size]
    first = crossing * cohort.tables if cohort.paged else 0
    free = kv.pool.num_free
    if first > free or sched.waiting and _head_starts(sched, members, free - first):
        return None
    # The plan, made here from what was read above (no __init__ to read it all again: a plan a leap)
    plan = _new_plan(LeapPlan)
    plan.first_step, plan.max_steps, plan.members = t, max_steps, members
    # blocks the members start walking at each step, the first step's counted here (`reach` goes
    # on from it: a pending plan, step t alone until settled, asks no more)
    plan.walked = [crossing]
    plan._walked_before, plan._clock = cohort.blocks_walked, clock
    plan._crossings, plan._tables = cohort.crossings, cohort.tables    # (no member joins or leaves during the plan)
    plan._free = free if cohort.paged else math.inf    # (a contiguous pool holds its blocks already)
    plan._taken = first
    # Async scheduling: the last step's finishers are released after step t's pass. Until `settle`
    # has run it (and re-checked the waiting head), the plan is step t alone (`_limit`, lowered
    # where the pool runs out).
    plan.pending = pending = sched.pending_release
    plan._limit = 1 if pending else max_steps
    plan.settled = None                    # step t's KV figures once settled
    if sched.static:                       # every row of the padded batch attends the same length
        batch = sched.static_batch
        plan.rows = rows = batch.rows
        plan.static_shape = (batch.length - batch.first_step, sched.block_size)
        plan._first_ctx = rows * (batch.length - batch.first_step + t)
    else:                                  # members' context at step t: cohort_computed + clock(t)
        plan.rows = members
        plan.static_shape = None
        plan._first_ctx = cohort.ctx_offset_sum + members * clock
    return plan


_new_plan = object.__new__     # (LeapPlan's instances come from plan_leap alone)


def _head_starts(sched: Scheduler, members: int, free_after_first: int) -> bool:
    """Would the waiting pass admit its head during the stretch? (Checked at its first step; the
    caller has seen requests waiting.)"""
    if sched.static:                       # a static batch admits only when none runs
        return False
    budget = sched.config.max_num_batched_tokens
    if sched.mixed:        # mixed: the waiting pass follows the running one, in the same step
        return sched.head_would_start(budget - members, False, free_after_first)
    # prefill_first: the prefill pass comes before the decodes take their blocks
    return sched.head_would_start(budget, True, sched.kv.pool.num_free)


def apply_leap(sched: Scheduler, plan: LeapPlan, k: int) -> tuple[list[int], list[int], list[int]]:
    """Schedule the plan's first k steps: (kv blocks used, cached-free, slack tokens) after each.
    Call `finish_leap` once they have run. A paged pool (most leaps) takes them in one go
    (`_apply_bulk`); static and contiguous batches, and a leap of its settled first step alone,
    go step by step (`_apply_by_step`)."""
    assert 1 <= k <= plan.max_steps and sched.step == plan.first_step
    done = 0                               # steps already scheduled (a settled first step)
    if plan.pending:
        if plan.settled is None:           # (`timed` settles most)
            plan.settle(sched)
        done = 1
    if done == k or plan.static_shape is not None or not sched.cohort.takes_stretch_in_bulk:
        figures = _apply_by_step(sched, plan, done, k)
    else:
        figures = _apply_bulk(sched, plan, done, k)
    sched.tokens_held += plan.members * (k - done)
    sched.step = plan.first_step + k
    return figures


def _apply_bulk(sched: Scheduler, plan: LeapPlan, done: int, k: int) -> tuple[list[int], list[int], list[int]]:
    """A paged pool: steps done .. k-1 of the leap, their blocks taken in one go, in the order the
    step-by-step calls would take them, and the blocks filled registered after
    (DecodeCohort.advance_many; with a table per group, `advance_grouped`, which then frees behind
    the windows step by step); the figures follow from the crossings the plan counted and the
    evictions the take made (and what the frees gave back). After a settled first step (`done`),
    whose figures the pool and the tokens still show (nothing ran since `settle` read them), each
    list starts with them: the running sums' initial value is kept instead of inserted."""
    cohort = sched.cohort
    walked = plan.walked[done:k]
    used0, cached0, slack0 = plan.settled if done else sched.kv_figures()
    # per step, as running sums: the blocks used grow by the blocks crossed, the slack by
    # block_size x those, less one token per member. (One loop: itertools' accumulate over map
    # and repeat counted ~3x its instructions on a 5-step leap, and ~1.1x on long ones.)
    bs, members = sched.block_size, plan.members
    used, slack = ([used0], [slack0]) if done else ([], [])
    blocks_used, slack_tokens = used0, slack0
    for crossed in walked:
        blocks_used += crossed
        slack_tokens += bs * crossed - members
        used.append(blocks_used)
        slack.append(slack_tokens)
    if cohort.per_group_tables:
        return _advance_grouped(sched, plan, done, k, used0, cached0, slack)
    evicted = cohort.advance_many(plan.first_step + done, walked, sched.kv)
    if evicted:                                         # (counts so far)
        cached = list(map(sub, repeat(cached0), evicted))
        if done:
            cached.insert(0, cached0)
    else:
        cached = [cached0] * (len(walked) + done)
    return used, cached, slack


def _advance_grouped(sched: Scheduler, plan: LeapPlan, done: int, k: int, used0: int, cached0: int,
                     slack: list[int]) -> tuple[list[int], list[int], list[int]]:
    """`_apply_bulk`'s take with a table per KV cache group: the blocks used and cached follow from
    the free and cached-free blocks `advance_grouped` counts after each step (the frees behind the
    windows give some back)."""
    kv = sched.kv
    free, cached = sched.cohort.advance_grouped(plan.first_step + done, k - done, kv)
    # (maps, not comprehensions: one reading a local makes it a cell at every call)
    used = list(map(sub, repeat(kv.pool.usable_blocks), free))
    if done:
        used.insert(0, used0)
        cached.insert(0, cached0)
    return used, cached, slack


def _apply_by_step(sched: Scheduler, plan: LeapPlan, done: int, k: int) -> tuple[list[int], list[int], list[int]]:
    """Steps done .. k-1 of the leap, each through the cohort, as the one-step path does (none
    where the leap is its settled first step alone: then its figures alone)."""
    cohort, kv, pool = sched.cohort, sched.kv, sched.kv.pool
    used, cached, slack = [], [], []
    t = plan.first_step
    advance = cohort.advance
    members, held = plan.members, sched.tokens_held
    usable = pool.usable_blocks
    # A step at which no member reaches a block boundary changes nothing but the cohort's clock
    # (set at the end), so only boundary steps go through the cohort; without prefix caching
    # that is the steps with a member crossing into a new block (the plan counted them).
    layout = cohort.layout
    walked = None if layout.prefix_caching or plan.static_shape is not None else plan.walked
    used_now, cached_now = usable - pool.num_free, pool.num_cached_free
    for i in range(done, k):
        if walked is None or walked[i]:
            advance(t + i, kv)
            used_now, cached_now = usable - pool.num_free, pool.num_cached_free
        held += members
        used.append(used_now)
        cached.append(cached_now)
        slack.append(kv.held_slots - held)
    cohort.scheduled_step = t + k - 1 - cohort.offset
    if done:                               # (the settled first step's figures first)
        for column, first in zip((used, cached, slack), plan.settled):
            column.insert(0, first)
    return used, cached, slack


def finish_leap(sched: Scheduler) -> list:
    """After a leap's steps ran: the finish of its last step (only that one can retire members)."""
    return sched.finish_cohort_step(sched.step - 1)
