"""Batching policies: continuous (vLLM V1 iteration-level, or V0 prefill-first) and static.

The scheduler owns no clock. A driver (the SimPy simulator, or the engine in wall-clock
time) calls `add`, `schedule` and `finish_step`; steps are counted, never timed.

Continuous, `mixed` composition (vLLM V1, research/VLLM_SEMANTICS.md section 4):
RUNNING requests first, in admission order, each taking what it still needs (1 token for
a decode, the rest of a prompt chunked to the budget); when a block cannot be had, the
last-admitted (FCFS) or lowest-priority (PRIORITY) running request is preempted and will
be recomputed. Then, if nothing was preempted, WAITING requests are admitted head first
until the token budget, max_num_seqs or the KV pool stops the first one (head-of-line).
`prefill_first` (V0, nano-vllm, Vidur's vLLM model): a step is all prefills while any can
be scheduled, otherwise all decodes; only a step's first prefill may be chunked.
`static` (HF `generate`, research/VLLM_SEMANTICS.md section 5): a batch is formed only
when none is running, its prompts computed in one padded forward (no token budget, no
chunks), and it runs until its last member finishes. Every step computes all B rows, padded
to the longest prompt: a finished member's row keeps being computed (`Batch.pad_rows`).

Async scheduling (vLLM's AsyncScheduler, `async_scheduling`): vLLM plans step N+1 while step
N runs and processes N's outputs only after that, so a request that emits its last token in
step N is removed from RUNNING, and its blocks freed, after step N+1 was planned. Step N+1
does not compute for it (vLLM knows it reaches max_tokens), but it still holds its KV blocks
and its max_num_seqs seat there; it can even be chosen as a preemption victim, which frees its
blocks at once (it finishes all the same). Here `finish_step` retires such requests but keeps
them in `running` (`_finishing`) until the next pass of `schedule` has run. When nothing else
is waiting or running there is no next step to plan, and vLLM processes the outputs at once: the
finishers are freed in `finish_step`, so an engine that goes idle does not keep their blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Optional

from sim.core.fast.cohort import DecodeCohort
from sim.core.kvcache import KVCacheManager
from sim.core.memory import cdiv
from sim.core.request import Request
from sim.core.request_queue import make_request_queue
from sim.core.status import ABORTED, FINISHED, PREEMPTED, REJECTED, RUNNING, WAITING


_by_run_seq = attrgetter("run_seq")     # a request's position in the running list (a C-level sort key)


@dataclass(frozen=True)
class StaticBatch:
    """The static batch running now: its rows, the padded prompt length, the step that formed it."""

    rows: int
    length: int
    first_step: int


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    batching: str = "continuous"            # continuous | static
    chunked_prefill: bool = True
    policy: str = "fcfs"                    # fcfs | priority
    step_composition: str = "mixed"         # mixed | prefill_first
    admission_watermark: float = 0.0
    reserve_full_prompt: bool = True
    # Advance steady decodes as a cohort (sim/core/fast/cohort.py); False forces the one-by-one loop.
    lazy_decode: bool = True
    # vLLM's async scheduling: finished requests leave RUNNING one step late (module docstring).
    async_scheduling: bool = False

    @classmethod
    def from_scenario(cls, s) -> "SchedulerConfig":
        """The policy's settings from a validated scenario: every scenario field the scheduler
        consults is read here, and nowhere else."""
        e = s.engine
        return cls(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                   max_model_len=s.max_model_len, batching=e.batching, chunked_prefill=e.chunked_prefill,
                   policy=e.scheduling_policy, step_composition=e.step_composition,
                   admission_watermark=e.admission_watermark, reserve_full_prompt=e.reserve_full_prompt,
                   async_scheduling=s.async_scheduling)


class Batch:
    """One step's work: which requests compute how many new tokens, plus its composition.

    Decodes (one generated token fed back) and prefills (whole prompts, chunks, recomputes)
    are kept apart, so the hot decode path needs no per-sequence token count.
    """

    __slots__ = ("step", "decodes", "num_decode", "pad_rows", "pad_len", "cohort_size", "prefills", "prefill_new",
                 "decode_ctx", "num_prefill_tokens", "prefill_ctx", "prefill_attn", "blocks_read", "preempted",
                 "admitted")

    def __init__(self, step: int):
        self.step = step
        self.decodes: list[Request] = []   # cohort members first, then decodes scheduled one by one
        self.cohort_size = 0
        # Decode rows computed: len(decodes) + pad_rows, kept as they change (the cost model and
        # the recorder read it every step; a property read is a call)
        self.num_decode = 0
        self.pad_rows = 0            # static batching: rows computed for members that finished
        self.pad_len = 0             # static batching: the padded length every row reaches this step
        self.prefills: list[Request] = []
        self.prefill_new: list[int] = []
        self.decode_ctx = 0          # sum of decode context lengths (tokens attended)
        self.num_prefill_tokens = 0  # prompt tokens computed (whole prompts and chunks)
        self.prefill_ctx = 0         # sum of cached context the prefill chunks attend to
        self.prefill_attn = 0        # sum over chunks of q x (context + (q + 1) / 2): causal score pairs
        self.blocks_read = 0         # KV blocks the attention kernels walk
        self.preempted: list[Request] = []
        self.admitted: list[Request] = []

    def __len__(self) -> int:
        return len(self.decodes) + len(self.prefills)

    @property
    def num_seqs(self) -> int:
        return self.num_decode + len(self.prefills)

    @property
    def num_tokens(self) -> int:
        """Tokens computed (with a static batch's padding once `Scheduler.schedule` returned it)."""
        return self.num_prefill_tokens + self.num_decode

    @property
    def reqs(self) -> list[Request]:
        return self.decodes + self.prefills

    @property
    def num_new(self) -> list[int]:
        return [1] * len(self.decodes) + self.prefill_new

    def starts(self) -> list[int]:
        """Context length before this step, per sequence in `reqs` order."""
        return [r.num_computed - n for r, n in zip(self.reqs, self.num_new)]

    def add(self, req: Request, n: int, block_size: int) -> None:
        """Schedule `n` new tokens of `req` (its num_computed advances now, as in vLLM).
        Requests are added one by one, so never as cohort members: their fields are their progress."""
        assert req.cohort is None
        start = req.num_computed
        ctx = start + n
        tokens = req.prompt_len + req.num_output
        self.blocks_read += -(-ctx // block_size)
        # A decode is the one token that completes the sequence. A resumed request's 1-token
        # recompute chunk that leaves more to compute is a prefill chunk: it emits nothing.
        if n == 1 and req.num_output and ctx == tokens:
            self.decodes.append(req)
            self.num_decode += 1
            self.decode_ctx += ctx
        else:
            self.prefills.append(req)
            self.prefill_new.append(n)
            self.num_prefill_tokens += n
            self.prefill_ctx += start
            self.prefill_attn += n * start + n * (n + 1) // 2
            if ctx < tokens:                     # a chunk that emits nothing: remember its step
                req.chunk_steps.append(self.step)
        req.num_computed = ctx

    def remove(self, req: Request, block_size: int) -> int:
        """Take a request back out (it was preempted after being scheduled); returns its tokens."""
        ctx = req.num_computed
        if req in self.decodes:
            i = self.decodes.index(req)
            del self.decodes[i]
            self.num_decode -= 1
            self.cohort_size -= i < self.cohort_size
            n = 1
            self.decode_ctx -= ctx
        else:
            i = self.prefills.index(req)
            del self.prefills[i]
            n = self.prefill_new.pop(i)
            start = ctx - n
            self.num_prefill_tokens -= n
            self.prefill_ctx -= start
            self.prefill_attn -= n * start + n * (n + 1) // 2
            if req.chunk_steps and req.chunk_steps[-1] == self.step:
                req.chunk_steps.pop()
        self.blocks_read -= -(-ctx // block_size)
        return n


class Scheduler:
    # Slots: attribute reads stay cheap on the hot paths whatever the number of attributes (an
    # instance dict past CPython's shared-key limit makes every read a dict lookup)
    __slots__ = ("config", "kv", "block_size", "static", "mixed", "lazy", "cohort", "waiting", "running",
                 "active", "step", "num_added", "num_finished",
                 "num_rejected", "num_aborted", "num_preemptions", "tokens_held", "_run_seq",
                 "_empty_preempted", "_returned", "_usable_blocks", "_watermark_blocks", "static_batch",
                 "_finishing", "pending_release")

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.static = config.batching == "static"
        self.mixed = config.step_composition == "mixed" or self.static
        self.lazy = config.lazy_decode
        # (a grouped KV cache: a block per table at each crossing, frees behind sliding windows)
        self.cohort = DecodeCohort(kv.layout())
        self.waiting = make_request_queue(config.policy)     # the queue type is the fcfs/priority policy
        self.running: list[Request] = []
        # Running requests outside the decode cohort, in admission order (usually a few prefills).
        self.active: dict[Request, None] = {}
        self.step = 0
        self.num_added = self.num_finished = self.num_rejected = self.num_aborted = 0
        self.num_preemptions = 0
        self.tokens_held = 0           # sum of num_computed over running requests
        self._run_seq = 0
        self._empty_preempted: list[Request] = []
        self._returned = 0
        self._usable_blocks = kv.pool.usable_blocks     # (the pool's size is fixed: read once, not per request)
        self._watermark_blocks = int(config.admission_watermark * self._usable_blocks)
        self.static_batch: Optional[StaticBatch] = None       # (static batching)
        # async scheduling: requests that finished in the last step, still in `running` with their
        # blocks until the next scheduling pass has run (vLLM processes step N's outputs after
        # planning step N+1)
        self._finishing: list[Request] = []
        # Async scheduling: finished requests still hold blocks and seats until the next pass, i.e.
        # `_finishing` is not empty (kept with it: the leap planner reads it every leap).
        self.pending_release = False

    # -- intake --------------------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue a request, or reject it with a reason when it can never run. Returns accepted."""
        self.num_added += 1
        reason = self._reject_reason(req)
        if reason:
            req.status = REJECTED
            req.reject_reason = reason
            self.num_rejected += 1
            return False
        req.status = WAITING
        self.waiting.add(req)
        return True

    def _reject_reason(self, req: Request) -> Optional[str]:
        limit = self.config.max_model_len
        if req.prompt_len >= limit:
            return f"prompt of {req.prompt_len} tokens leaves no room for output within max_model_len {limit}"
        if req.max_len > limit:
            return (f"prompt ({req.prompt_len}) + max output ({req.output_len}) = {req.max_len} tokens "
                    f"exceeds max_model_len {limit}")
        need = self.kv.blocks_needed_at_most(req)
        usable = self._usable_blocks
        if need > usable:
            return f"needs {need} KV blocks at full length but the pool has {usable} usable blocks"
        if (not self.config.chunked_prefill and not self.static
                and req.max_len > self.config.max_num_batched_tokens):
            return (f"{req.max_len} tokens cannot be recomputed within max_num_batched_tokens "
                    f"{self.config.max_num_batched_tokens} without chunked prefill")
        return None

    def abort(self, req: Request) -> None:
        """Drop a queued or running request (a client went away), freeing its blocks."""
        if req.is_finished:
            return
        if req.cohort is not None:
            self.cohort.leave(req)
        if req in self.running:
            self.running.remove(req)
            self.active.pop(req, None)
        else:
            self.waiting.discard(req)
        if req.status is RUNNING:
            self.tokens_held -= req.num_computed
        self.kv.free(req)
        req.status = ABORTED
        req.reject_reason = "aborted"
        req.close_emit_run()
        self.num_aborted += 1

    # -- queues --------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return len(self.running) > len(self._finishing) or self.num_waiting > 0

    def has_other_work(self, finished: list) -> bool:
        """Is anything left to schedule besides the step's finishers? Only then does an async
        engine plan the next step before processing this one's outputs."""
        return self.num_waiting > 0 or len(self.running) > len(finished)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> Optional[Batch]:
        """Choose this step's work. Returns None when nothing can run.

        A pass can preempt every request it tried and schedule nothing (the last running
        request preempts itself); vLLM's next step then admits from the waiting queue. That
        empty step takes no time, so it is folded into the next one (its preemptions with it)
        rather than returned as nothing to do, which would leave the engine asleep.
        """
        preempted: list[Request] = []
        while True:
            batch = self._schedule_step()
            # Async scheduling: after the pass, the last step's outputs retire their finished
            # requests (vLLM's update_from_output runs after the next schedule).
            released = bool(self._finishing)
            if released:
                self.release_finishing()
            # A pass that finds nothing only because the last step's finishers still held their
            # blocks or seats is an empty step in vLLM; their release lets the next pass run.
            if batch is not None or not (self._empty_preempted or released):
                break
            preempted += self._empty_preempted
        if batch is not None and preempted:
            batch.preempted[:0] = preempted
        self._empty_preempted = []
        return batch

    def _schedule_step(self) -> Optional[Batch]:
        batch = Batch(self.step)
        self._empty_preempted = []
        budget = self.config.max_num_batched_tokens
        if self.mixed:
            admit = not (self.static and self.running)
            budget = self._schedule_running(batch, budget, want="all")
            if admit and not batch.preempted:
                self._schedule_waiting(batch, budget)
        else:
            budget = self._schedule_running(batch, budget, want="prefill")
            if not batch.preempted:
                budget = self._schedule_waiting(batch, budget)
            if len(batch):         # a prefill step: the decodes wait; the cohort sits it out intact
                self.cohort.pause(batch.step)
            else:
                self._schedule_running(batch, budget, want="decode")
        if not (batch.decodes or batch.prefills):
            self._empty_preempted = batch.preempted
            return None
        self.tokens_held += batch.num_prefill_tokens + len(batch.decodes)    # (no padding rows yet)
        if self.static:
            self._pad_static(batch)
        self.step += 1
        return batch

    def _pad_static(self, batch: Batch) -> None:
        """Make a static batch's step the padded one HF `generate` computes.

        The forming step is one [B, P] prefill, P the longest sequence; step k after it feeds
        one token per row to all B rows, each attending P + k positions, whether its member
        finished or not. Only the cost figures change: the members' own progress is untouched.
        """
        bs = self.block_size
        if batch.admitted:
            self.static_batch = StaticBatch(rows=len(batch.admitted), length=max(r.num_tokens for r in batch.admitted),
                                            first_step=batch.step)
        rows, length, first_step = self.static_batch.rows, self.static_batch.length, self.static_batch.first_step
        if batch.step == first_step:
            batch.pad_len = length
            batch.num_prefill_tokens = rows * length
            batch.prefill_ctx = 0
            batch.prefill_attn = rows * (length * (length + 1) // 2)
            batch.blocks_read = rows * -(-length // bs)
            return
        ctx = length + batch.step - first_step     # every prompt was computed when the batch formed
        batch.pad_rows = rows - len(batch.decodes)
        batch.num_decode = rows
        batch.pad_len = ctx
        batch.decode_ctx = rows * ctx
        batch.blocks_read = rows * -(-ctx // bs)

    @property
    def slack_tokens(self) -> int:
        """Slots allocated to running requests but holding no token (tails, reservations)."""
        return self.kv.held_slots - self.tokens_held

    def kv_figures(self) -> tuple[int, int, int]:
        """(blocks in use, cached free blocks, slack tokens): what a step record keeps, in one call."""
        kv = self.kv
        pool = kv.pool
        return pool.num_blocks - 1 - pool.num_free, pool.num_cached_free, kv.held_slots - self.tokens_held

    def _schedule_running(self, batch: Batch, budget: int, want: str) -> int:
        """RUNNING requests in admission order: decodes and the rest of their prompts."""
        cohort = self.cohort
        candidates = self.running
        if want == "prefill":              # prefill_first's prefill pass: the cohort holds decodes only
            candidates = list(self.active) if cohort.members else candidates
        elif cohort.members:
            others = self._cohort_can_take(batch.step, budget)
            if others is None:
                cohort.dissolve()              # some member may not get its token: go one by one
                self.active = dict.fromkeys(self.running)
            else:
                cohort.advance(batch.step, self.kv)
                n = len(cohort.members)          # (len(cohort) would call DecodeCohort.__len__)
                batch.decodes.extend(cohort.members)
                batch.num_decode += n
                batch.cohort_size = n
                batch.decode_ctx += cohort.ctx_offset_sum + n * cohort.scheduled_step
                batch.blocks_read += cohort.blocks_walked
                budget -= n
                candidates = others
        if want != "prefill":
            cohort.sync(batch.step)
        # A victim (the fcfs tail, or any priority's) leaves `running` while it is walked: walk a
        # snapshot and skip the preempted.
        candidates = list(candidates)
        for req in candidates:
            if budget <= 0:
                break
            if req.status is not RUNNING:
                continue
            n = req.num_tokens - req.num_computed
            if want != "all" and (n == 1 and req.num_output > 0) != (want == "decode"):
                continue               # prefill_first: this pass takes only prefills or only decodes
            if n > budget:
                if not self.config.chunked_prefill and req.num_computed == 0:
                    continue           # a whole prompt must fit one step without chunking
                n = budget
            budget = self._schedule_slow(req, n, batch, budget)
            if req.status is not RUNNING:
                break                  # it preempted itself
        return budget

    def _last_freeing_member(self, step: int) -> int:
        """The latest running position among members that may free behind their window at `step`."""
        freeing = self.cohort.freeing(step)
        return max(map(_by_run_seq, freeing)) if freeing else -1

    def _cohort_can_take(self, step: int, budget: int) -> Optional[list[Request]]:
        """The running non-members (admission order) if every member gets its token this step.

        That holds when no member sits after the point where the token budget runs out and
        the free blocks cover every allocation of the step, so no preemption can happen. The
        cohort then goes first, so no non-member may take blocks (or, behind a sliding window,
        free them) before a member would in the running order.
        """
        cohort, kv = self.cohort, self.kv
        left = budget - len(cohort.members)
        if left < 0:
            return None
        others = list(self.active)
        blocks = cohort.due_blocks(step)
        first_crossing = cohort.first_crossing_seq(step) if others else None
        last_freeing = self._last_freeing_member(step) if others and kv.sliding else -1
        for req in others:
            n = req.num_tokens - req.num_computed
            if n > left:
                if not self.config.chunked_prefill and req.num_computed == 0:
                    continue
                n = left
            if not kv.contiguous:
                new = max(0, cdiv(req.num_computed + n, self.block_size) - len(req.blocks))
                if new and req.run_seq < first_crossing:
                    return None        # it takes its blocks before a member would: keep vLLM's order
                blocks += new * kv.num_groups
            if req.run_seq < last_freeing and kv.frees_behind_window(req):
                return None            # it frees before a member would: keep the free queue's order
            left -= n
            if left == 0:
                later = self.running[self.running.index(req) + 1:]
                if any(r.cohort is not None for r in later):
                    return None
                break
        return others if blocks <= kv.pool.num_free else None

    def _schedule_slow(self, req: Request, n: int, batch: Batch, budget: int) -> int:
        """Schedule `n` tokens of a running request that may need blocks (and preemptions)."""
        kv, bs = self.kv, self.block_size
        if kv.sliding:                     # vLLM frees behind the window as it allocates, every step
            kv.remove_skipped_blocks(req)
        covered = req.num_computed + n
        if covered <= len(req.blocks) * bs:
            if kv.enable_caching and covered // bs > req.num_registered:
                kv.register_full_blocks(req, covered)
        elif not self._allocate_or_preempt(req, n, batch):
            return budget + self._take_returned()                  # it preempted itself
        budget += self._take_returned()
        batch.add(req, n, bs)
        return budget - n

    def _take_returned(self) -> int:
        """Tokens given back by victims that had already been scheduled this step."""
        returned, self._returned = self._returned, 0
        return returned

    def _allocate_or_preempt(self, req: Request, n: int, batch: Batch) -> bool:
        """Allocate slots, preempting victims until they fit; False if `req` itself was preempted."""
        while not self.kv.allocate_slots(req, n):
            victim = self._pick_victim()
            self._preempt(victim, batch)
            if victim is req:
                return False
        return True

    def _pick_victim(self) -> Request:
        return self.waiting.preemption_victim(self.running)

    def _preempt(self, victim: Request, batch: Batch) -> None:
        if victim.status is FINISHED:
            self._preempt_finishing(victim, batch)
            return
        if victim.cohort is not None:
            self.cohort.leave(victim)
        self.running.remove(victim)
        self.active.pop(victim, None)
        scheduled_now = 0
        if victim in batch.decodes or victim in batch.prefills:
            scheduled_now = batch.remove(victim, self.block_size)
            self._returned += scheduled_now
        self.tokens_held -= victim.num_computed - scheduled_now
        self.kv.free(victim)
        victim.num_computed = 0
        victim.status = PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)
        self.waiting.add_preempted(victim)

    def _preempt_finishing(self, victim: Request, batch: Batch) -> None:
        """Async scheduling: the victim emitted its last token in the step in flight. vLLM frees
        its blocks now and counts a preemption; its output then finishes it from the waiting queue,
        before anything is admitted, so it simply finishes here."""
        self.running.remove(victim)
        self._finishing.remove(victim)
        self.pending_release = bool(self._finishing)
        self._free_finished(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)

    def _schedule_waiting(self, batch: Batch, budget: int) -> int:
        """Admit WAITING requests head first until one does not fit (head-of-line blocking)."""
        cfg, kv = self.config, self.kv
        running = self.running
        while self.num_waiting and len(running) < cfg.max_num_seqs and (budget > 0 or self.static):
            req = self.waiting.peek()
            resumed = req.status is PREEMPTED
            args = self._admission(req, budget, not (batch.decodes or batch.prefills))
            if args is None:
                break
            hits, hit_tokens, n_now, gate, reserve = args
            if not kv.allocate_slots(req, n_now, hits, gate_tokens=gate, reserve_free=reserve):
                break
            self.waiting.pop_head()
            kv.stats.record(req.prompt_len + req.num_output, hit_tokens, resumed)   # (num_tokens: no member waits)
            if not resumed:
                req.num_cached_tokens = hit_tokens
                req.admit_step = batch.step
            req.status = RUNNING
            req.num_computed = hit_tokens
            self.tokens_held += hit_tokens
            self._run_seq += 1
            req.run_seq = self._run_seq
            running.append(req)
            self.active[req] = None
            batch.admitted.append(req)
            if n_now:
                budget -= n_now
                batch.add(req, n_now, self.block_size)
        return budget

    def _admission(self, req: Request, budget: int, batch_empty: bool) -> Optional[tuple]:
        """How the waiting head would be admitted now: (hits, hit tokens, tokens now, gate tokens,
        blocks kept free), or None when the token budget stops it before the pool is asked."""
        cfg = self.config
        hits, hit_tokens = self.kv.find_cached_prefix(req)
        num_tokens = req.prompt_len + req.num_output       # (no cohort member waits)
        n = num_tokens - hit_tokens
        # prefill_first (nano-vllm): only the step's first prefill may be chunked.
        may_chunk = cfg.chunked_prefill and (self.mixed or batch_empty)
        if not may_chunk and n > budget and not self.static:
            return None
        n_now = n if self.static else min(n, budget)    # a static batch: one padded forward
        gate = num_tokens if cfg.reserve_full_prompt else hit_tokens + n_now
        # The watermark keeps room for running requests to grow; with none running it
        # would only stop a request that fits the pool from ever starting (vLLM skips it then).
        reserve = self._watermark_blocks if self.running else 0
        return hits, hit_tokens, n_now, gate, reserve

    def head_would_start(self, budget: int, batch_empty: bool, free_blocks: int) -> bool:
        """Would the waiting pass admit its head with `budget` tokens left and `free_blocks` free?
        (No state changes; the leap planner asks this, sim/core/fast/leap.py.)"""
        if len(self.running) >= self.config.max_num_seqs or (budget <= 0 and not self.static):
            return False
        req = self.waiting.peek()
        if req is None:
            return False
        args = self._admission(req, budget, batch_empty)
        if args is None:
            return False
        hits, _, n_now, gate, reserve = args
        return self.kv.would_fit(req, n_now, hits, gate, reserve, free_blocks)

    # -- after the step ------------------------------------------------------------------
    def finish_step(self, batch: Batch) -> list[Request]:
        """Append each completed sequence's next token; retire finished requests. Returns them.

        A live request (the server) that samples EOS has had its output_len cut to its
        length by the runner, so one length test covers scripted and live requests.
        """
        step = batch.step
        emitted = batch.decodes[batch.cohort_size:]       # the members emit through the cohort
        for r in batch.prefills:     # (a loop, not a comprehension: that is a call, for one or two)
            if r.num_computed >= r.prompt_len + r.num_output:    # (one by one: no member, fields are progress)
                emitted.append(r)
        finished = self._cohort_finishers(step)            # (members, then the others, in batch order)
        for req in emitted:
            if req.emit(step):
                finished.append(req)
        if finished or self._finishing:
            self._retire_finished(step, finished)
        if self.lazy:
            for req in emitted:
                if req.status is RUNNING and not req.is_live:
                    self.cohort.join(req, step)
                    del self.active[req]
        return finished

    def finish_cohort_step(self, step: int) -> list[Request]:
        """`finish_step` of a step in which only the cohort's members computed (a leap's last)."""
        finished = self._cohort_finishers(step)
        if finished or self._finishing:
            self._retire_finished(step, finished)
        return finished

    def _cohort_finishers(self, step: int) -> list[Request]:
        """The members emitted at `step`: those that emitted their last token leave the cohort."""
        cohort = self.cohort
        cohort.finish(step)
        finished = cohort.finishing(step)
        for req in finished:
            cohort.leave(req)
        return finished

    def _retire_finished(self, step: int, finished: list[Request]) -> None:
        """Mark the step's finished requests and free them (async: after the next pass).
        (Its callers skip it when nothing finished and nothing is held over: most steps.)"""
        if len(finished) > 1:              # freed in the running list's order, as vLLM walks the step's requests
            finished.sort(key=_by_run_seq)
        for req in finished:
            req.status = FINISHED
            req.finish_step = step
            req.close_emit_run()
            self.active.pop(req, None)
        self._finishing = finished
        self.pending_release = bool(finished)
        # Async: released after the next scheduling pass, unless nothing else is left to plan
        # (then vLLM processes the outputs at once, as a synchronous engine always does).
        if not (self.config.async_scheduling and self.has_other_work(finished)):
            self.release_finishing()
        self.num_finished += len(finished)

    def _free_finished(self, req: Request) -> None:
        self.tokens_held -= req.num_computed  # (num_computed: a finished request has left the cohort)
        self.kv.free(req)
        req.drop_block_hashes()            # never looked up again: 40 B a block, most of a finished request

    def release_finishing(self) -> None:
        """Free the finished requests in `_finishing` and take them out of RUNNING."""
        finishing, self._finishing = self._finishing, []
        self.pending_release = False
        for req in finishing:
            self._free_finished(req)
        if len(finishing) == len(self.running):
            self.running.clear()
        else:
            for req in finishing:
                self.running.remove(req)

    # -- checks --------------------------------------------------------------------------
    def check_accounting(self) -> None:
        """Every added request is finished, rejected, aborted, waiting or running."""
        if self.pending_release != bool(self._finishing):
            raise AssertionError(f"pending_release {self.pending_release} with {len(self._finishing)} finishing")
        live = self.num_waiting + len(self.running) - len(self._finishing)
        ended = self.num_finished + self.num_rejected + self.num_aborted
        if self.num_added != ended + live:
            raise AssertionError(f"request accounting broken: added {self.num_added} != finished "
                                 f"{self.num_finished} + rejected {self.num_rejected} + aborted "
                                 f"{self.num_aborted} + waiting {self.num_waiting} + running {len(self.running)}")
