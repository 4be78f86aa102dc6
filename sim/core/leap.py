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
    cannot start later in it either (the requirement never drops, the supply never grows);
  - no member emits its last token before step t+K-1 (a finish may end the leap);
  - with async scheduling, no finished request is waiting to be released (sim/core/scheduler.py).
Arrivals are the driver's business: it must end the leap before the next request reaches
any router (sim/simulator.py cuts it at the first step ending at or after that time).

`apply_leap` takes the stretch's blocks from a paged pool in one go, in the order the one-step
path takes them, and registers the blocks the members fill (DecodeCohort.advance_many, so every
block id, hash and eviction comes out the same); static and contiguous batches replay their
steps through the cohort itself. It closes with one `finish_step`. The driver's step times come from the cost model
in bulk; equal, bit for bit, to pricing the steps one by one (same float operations).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional

import numpy as np

from sim.core.scheduler import Batch, Scheduler


class LeapPlan:
    """Up to `max_steps` pure decode steps from `first_step`; step k's shape on demand.

    `max_steps` is first the bound set by the members' next finish; the steps whose blocks
    the pool can still give are counted lazily (`reach`), as far as a driver asks."""

    __slots__ = ("first_step", "max_steps", "rows", "members", "_ctx0", "_ctx_per_step", "_walked",
                 "_walked_before", "_static", "_clock", "_groups", "_free", "_taken", "_limit")

    def __init__(self, sched: Scheduler, max_steps: int):
        cohort = sched.cohort
        self.first_step = sched.step
        self.max_steps = max_steps
        self.members = len(cohort)
        self._walked: list[int] = []       # blocks the members start walking at each step
        self._walked_before = cohort.blocks_walked
        self._clock = cohort.clock(sched.step)
        self._groups = cohort.phase_groups()
        self._free = sched.kv.pool.num_free if not sched.kv.contiguous else None
        self._taken = 0
        self._limit = max_steps            # lowered where the pool runs out
        if sched.static:                   # every row of the padded batch attends the same length
            self.rows = sched._static_rows
            self._static = (sched._static_len - sched._static_step, sched.block_size)
            self._ctx0, self._ctx_per_step = self.rows * (sched._static_len - sched._static_step), self.rows
        else:                              # members' context at step t: _computed + clock(t)
            self.rows = self.members
            self._static = None
            self._ctx0 = cohort.ctx_offset_sum - self.members * cohort.offset
            self._ctx_per_step = self.members

    def reach(self, k: int) -> int:
        """How many of the first k steps can run (their blocks are free); counts them on demand."""
        walked = self._walked
        k = min(k, self._limit)
        if len(walked) < k:
            groups, bs = self._groups, len(self._groups)
            i, clock, free, taken = len(walked), self._clock, self._free, self._taken
            while i < k:
                w = len(groups[(1 - clock - i) % bs])
                if free is not None:
                    taken += w
                    if taken > free:
                        self._limit = k = i
                        break
                walked.append(w)
                i += 1
            self._taken = taken
        return k

    def shapes(self, k: int, start: int = 0) -> tuple[list[int], list[int]]:
        """(decode context, blocks read) of steps start .. k-1 (k <= reach(k))."""
        t = self.first_step
        ctx0, per = self._ctx0, self._ctx_per_step
        if self._static is not None:
            offset, bs = self._static
            return ([ctx0 + per * (t + i) for i in range(start, k)],
                    [self.rows * -(-(offset + t + i) // bs) for i in range(start, k)])
        ctx = [ctx0 + per * (t + i) for i in range(start, k)]
        walked = self._walked
        before = self._walked_before + sum(walked[:start])
        return ctx, list(accumulate(walked[start:k], initial=before))[1:]

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
    num_prefill_tokens = prefill_ctx = prefill_attn = 0

    def __init__(self, rows: int, decode_ctx: int, blocks_read: int):
        self.num_decode, self.decode_ctx, self.blocks_read = rows, decode_ctx, blocks_read


def plan_leap(sched: Scheduler, max_steps: int, min_steps: int = 1) -> Optional[LeapPlan]:
    """The pure-decode stretch starting at the scheduler's next step, or None if there is none
    (or if a member finishes within fewer than `min_steps`: a short leap does not pay).
    The plan's steps are bounded by the next finish; `LeapPlan.reach` counts how many of
    them the free blocks allow."""
    cohort, kv, cfg = sched.cohort, sched.kv, sched.config
    members = len(cohort)
    t = sched.step
    clock = t - cohort.offset
    # (async scheduling: not while the last step's finishers still hold blocks and seats; the
    # one-step path releases them after its next pass)
    if (not sched.lazy or not members or sched.active or sched.pending_release or cohort.scheduled_step != clock - 1
            or cohort.finished_step != clock - 1 or members > cfg.max_num_batched_tokens):
        return None
    max_steps = int(min(max_steps, cohort.next_finish() - t + 1))
    if max_steps < max(1, min_steps):
        return None
    first = cohort.due_blocks(t)           # blocks the members take at the first step
    free = kv.pool.num_free
    if first > free or _head_starts(sched, members, free - first):
        return None
    return LeapPlan(sched, max_steps)


def _head_starts(sched: Scheduler, members: int, free_after_first: int) -> bool:
    """Would the waiting pass admit its head during the stretch? (Checked at its first step.)"""
    if not sched.num_waiting or sched.static:      # a static batch admits only when none runs
        return False
    budget = sched.config.max_num_batched_tokens
    if sched.mixed:        # mixed: the waiting pass follows the running one, in the same step
        return sched.head_would_start(budget - members, False, free_after_first)
    # prefill_first: the prefill pass comes before the decodes take their blocks
    return sched.head_would_start(budget, True, sched.kv.pool.num_free)


def apply_leap(sched: Scheduler, plan: LeapPlan, k: int) -> tuple[list[int], list[int], list[int]]:
    """Schedule the plan's first k steps: (kv blocks used, cached-free, slack tokens) after each.
    Call `finish_leap` once they have run."""
    assert 1 <= k <= plan.max_steps and sched.step == plan.first_step
    if sched.cohort.paged and plan._static is None:
        figures = _apply_bulk(sched, plan, k)
    else:
        figures = _apply_by_step(sched, plan, k)
    sched.tokens_held += plan.members * k
    sched.step = plan.first_step + k
    return figures


def _apply_bulk(sched: Scheduler, plan: LeapPlan, k: int) -> tuple[list[int], list[int], list[int]]:
    """A paged pool: the leap's blocks taken in one go, in the order the step-by-step calls
    would take them, and the blocks filled registered after (DecodeCohort.advance_many); the
    figures follow from the crossings the plan counted and the evictions the take made."""
    kv, pool = sched.kv, sched.kv.pool
    walked = plan._walked[:k]
    used0, slots0, cached0 = pool.num_used, kv.held_slots, pool.num_cached_free
    evicted = sched.cohort.advance_many(plan.first_step, walked, kv)
    crossed = list(accumulate(walked))
    bs, members, held = sched.block_size, plan.members, sched.tokens_held
    slack = [slots0 + bs * c - held - members * i for i, c in enumerate(crossed, 1)]
    return [used0 + c for c in crossed], [cached0 - e for e in evicted], slack


def _apply_by_step(sched: Scheduler, plan: LeapPlan, k: int) -> tuple[list[int], list[int], list[int]]:
    """Each step through the cohort, as the one-step path does."""
    cohort, kv, pool = sched.cohort, sched.kv, sched.kv.pool
    used, cached, slack = [], [], []
    t = plan.first_step
    advance = cohort.advance
    members, held = plan.members, sched.tokens_held
    usable = pool.usable_blocks
    # A step at which no member reaches a block boundary changes nothing but the cohort's clock
    # (set at the end), so only boundary steps go through the cohort; without prefix caching
    # that is the steps with a member crossing into a new block (the plan counted them).
    walked = None if kv.enable_caching or plan._static is not None else plan._walked
    used_now, cached_now = usable - pool.num_free, pool.num_cached_free
    for i, step in enumerate(range(t, t + k)):
        if walked is None or walked[i]:
            advance(step, kv)
            used_now, cached_now = usable - pool.num_free, pool.num_cached_free
        held += members
        used.append(used_now)
        cached.append(cached_now)
        slack.append(kv.held_slots - held)
    cohort.scheduled_step = t + k - 1 - cohort.offset
    return used, cached, slack


def finish_leap(sched: Scheduler) -> list:
    """After a leap's steps ran: the finish of its last step (only that one can retire members)."""
    return sched.finish_step(Batch(sched.step - 1))
