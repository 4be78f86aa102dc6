"""The reference scheduling policy: vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py, 0.19).

The scheduler owns no clock. A driver (the SimPy simulator, or the engine in wall-clock time)
calls `add`, `schedule` and `finish_step`; steps are counted, never timed. There is no prefill or
decode phase, only each request's `num_computed` against its `num_tokens`:

1. RUNNING requests first, in admission order, each taking what it still lacks (one token for a
   decode, the rest of a prompt chunked to the token budget); when a block cannot be had, the
   queue type's victim (sim/core/request_queue.py) is preempted, to be recomputed.
2. Then, if nothing was preempted, WAITING requests from the head until the token budget,
   max_num_seqs or the KV pool stops the head (head-of-line blocking).

This class is that policy and nothing else: `make_scheduler` (sim/core/scheduler_variants.py)
puts the variants a config asks for in front of it, and the decode cohort (sim/core/fast/cohort.py)
is its one fast path inside a step. docs/architecture_core.md walks through the whole.
"""
from __future__ import annotations

from bisect import bisect_left
from operator import attrgetter
from typing import Optional

from sim.core.batch import Batch, StaticBatch  # noqa: F401  (drivers import Batch from here)
from sim.core.fast.cohort import DecodeCohort
from sim.core.kv import NO_BLOCKS, KVCacheManager
from sim.core.offload import CpuTier
from sim.core.request import Request
from sim.core.request_queue import make_request_queue
from sim.core.scheduler_config import SchedulerConfig, variants_of
from sim.core.status import ABORTED, FINISHED, PREEMPTED, REJECTED, RUNNING, WAITING

__all__ = ["Batch", "Scheduler", "SchedulerConfig"]

_by_run_seq = attrgetter("run_seq")     # a request's position in the running list (a C-level sort key)


class Scheduler:
    # The variants this class runs (a composed class names its mixins: sim/core/scheduler_variants.py).
    variants: frozenset = frozenset()
    static = False             # static batching (the leap planner asks)
    mixed = True               # running and waiting in one step (False: V0's prefill-first order)
    holds_arrivals = False     # requests added while a step is in flight wait through the next pass (async)
    # (slots: attribute reads stay cheap on the hot paths, however many attributes there are)
    __slots__ = ("config", "kv", "block_size", "lazy", "cohort", "waiting", "running", "active", "step",
                 "num_added", "num_finished", "num_rejected", "num_aborted", "num_preemptions", "tokens_held",
                 "_run_seq", "_empty_preempted", "_returned", "_usable_blocks", "_watermark_blocks", "lists_members",
                 "prefill_cap", "static_batch", "pending_release", "arriving", "offload", "spec", "lora")

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, offload: Optional[CpuTier] = None):
        wanted = variants_of(config, offload)
        if wanted != self.variants:
            raise TypeError(f"this config needs the scheduler variants {sorted(wanted)}: build it with "
                            f"sim.core.scheduler_variants.make_scheduler")
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.lazy = config.lazy_decode       # (a variant that schedules one request at a time turns it off)
        self.prefill_cap = config.long_prefill_token_threshold     # the most tokens a chunk takes (0: no cap)
        self.cohort = DecodeCohort(kv.layout())
        self.waiting = make_request_queue(config.policy)     # the queue type is the fcfs/priority policy
        self.running: list[Request] = []
        # Running requests outside the decode cohort, in admission order (usually a few prefills).
        self.active: dict[Request, None] = {}
        self.step = 0
        self.num_added = self.num_finished = self.num_rejected = self.num_aborted = self.num_preemptions = 0
        self.tokens_held = 0           # sum of num_computed over running requests
        self._run_seq = 0
        self._empty_preempted: list[Request] = []
        self._returned = 0
        self._usable_blocks = kv.pool.usable_blocks     # (the pool's size is fixed: read once, not per request)
        self._watermark_blocks = int(config.admission_watermark * self._usable_blocks)
        kv.set_sliding_admission_cap(config.sliding_admission_cap)
        # What the fast paths and drivers read, set by the variants that have them.
        self.static_batch: Optional[StaticBatch] = None
        self.pending_release = False   # finishers still hold blocks until the next pass (async)
        self.arriving: list[Request] = []    # added while a step ran, not yet WAITING (async)
        self.offload = offload         # the CPU tier (OffloadScheduling)
        self.spec = self.lora = None   # SpecScheduling's drafts, LoraScheduling's slots
        self.lists_members = True      # Batch.decodes lists the cohort's members (Batch.remove; the simulator: off)

    # -- intake --------------------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue a request, or reject it with a reason when it can never run. Returns accepted."""
        self.num_added += 1
        reason = self.refusal(req)
        if reason:
            req.status = REJECTED
            req.reject_reason = reason
            self.num_rejected += 1
            return False
        req.status = WAITING
        self._enqueue(req)
        return True

    def _enqueue(self, req: Request) -> None:
        self.waiting.add(req)

    def refusal(self, req: Request) -> Optional[str]:       # why add() rejects req (P/D's proxy asks too)
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
        if (not self.config.chunked_prefill and not self.static      # (a static batch: one padded forward)
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
            self._dequeue(req)
        if req.status is RUNNING:
            self.tokens_held -= req.num_computed
        self.kv.free(req)
        req.status = ABORTED
        req.reject_reason = "aborted"
        req.close_emit_run()
        self.num_aborted += 1

    def _dequeue(self, req: Request) -> None:
        self.waiting.discard(req)

    # -- queues (hot loops read len(self.waiting), a C call, not the property) ---------------
    num_waiting = property(lambda self: len(self.waiting))
    num_running = property(lambda self: len(self.running))

    def has_unfinished(self) -> bool:
        return self.num_live() > 0

    def num_live(self) -> int:
        """Requests accepted and not yet ended."""
        return len(self.waiting) + len(self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> Optional[Batch]:
        """Choose this step's work. Returns None when nothing can run.

        A pass can preempt every request it tried and schedule nothing (the last running request
        preempts itself); vLLM's next step then admits from the waiting queue. That empty step takes
        no time, so it is folded into the next one with its preemptions (None would idle the engine).
        """
        preempted: list[Request] = []
        while True:
            batch = self._schedule_pass()
            freed = self.pending_release and self._after_pass()    # (only async holds finishers over)
            if batch is not None or not (self._empty_preempted or freed):
                break
            preempted += self._empty_preempted
        if batch is not None and preempted:
            batch.preempted[:0] = preempted
        return batch

    def _after_pass(self) -> bool:
        """After a pass with finishers held over (async): True when it freed what a second pass can use."""
        return False

    def _schedule_pass(self) -> Optional[Batch]:
        """One scheduling pass over RUNNING and WAITING; None when it scheduled nothing."""
        batch = Batch(self.step)
        self._empty_preempted = []
        self._compose(batch, self.config.max_num_batched_tokens)
        if not (batch.num_decode or batch.prefills):     # (num_decode: the members, listed or not)
            self._empty_preempted = batch.preempted
            return None
        # (draft tokens count until their rejection rolls them back)
        self.tokens_held += batch.num_prefill_tokens + batch.num_decode + batch.spec_tokens
        self.step += 1
        return batch

    def _compose(self, batch: Batch, budget: int) -> None:
        """vLLM V1's step order: the RUNNING requests, then, unless that preempted, the WAITING ones."""
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)

    def _schedule_running(self, batch: Batch, budget: int, select=None) -> int:
        """The decode cohort's turn (all its members at once, or it dissolves), then the requests
        left, one by one (those `select` picks: prefill_first's decode pass, sim/core/step_orders.py)."""
        candidates = self.running
        cohort = self.cohort
        if cohort.members:             # fast path: every member's token at once (sim/core/fast/cohort.py)
            others = cohort.take_step(self, batch, budget)
            if others is None:         # some member might not get its token: it dissolved
                self.active = dict.fromkeys(self.running)
            else:
                budget -= batch.cohort_size
                candidates = others
        if not batch.cohort_size:      # (else take_step's advance moved the cohort's clock to the step)
            cohort.sync(batch.step)
        if select is not None:
            candidates = select(candidates)
        return self._schedule_each(candidates, budget, batch) if candidates else budget

    def _schedule_each(self, candidates, budget: int, batch: Batch) -> int:
        for req in list(candidates):       # (a snapshot: victims leave `running` while it is walked)
            if budget <= 0:
                break
            if req.status is not RUNNING:
                continue                   # preempted in this pass
            n = self.num_new_tokens(req, budget)
            if n is None:
                continue
            budget = self._schedule_tokens(req, n, batch, budget)
            if req.status is not RUNNING:
                break                      # it preempted itself
        return budget

    def num_new_tokens(self, req: Request, budget: int) -> Optional[int]:
        """The tokens a running request computes this step with `budget` left: what it still lacks,
        chunked to the budget; None when its prompt must be computed whole (no chunked prefill) and
        does not fit. (The one place the chunking rule lives; the decode cohort asks it too.)"""
        return self._chunk(req, req.prompt_len + req.num_output - req.num_computed, budget)

    def _chunk(self, req: Request, n: int, budget: int) -> Optional[int]:
        cap = self.prefill_cap
        if 0 < cap < n:                    # vLLM's long_prefill_token_threshold caps every chunk
            n = cap
        if n > budget:
            if not self.config.chunked_prefill and req.num_computed == 0:
                return None
            n = budget
        return n

    def _schedule_tokens(self, req: Request, n: int, batch: Batch, budget: int) -> int:
        """Schedule `n` tokens of a running request, preempting others while its slots do not fit."""
        if not self.kv.append_slots(req, n):
            fits = self._preempt_until_fits(req, n, batch)
            budget += self._take_returned()
            if not fits:
                return budget              # it preempted itself
        batch.add(req, n, self.block_size)
        return budget - n

    def _take_returned(self) -> int:
        """Tokens given back by victims that had already been scheduled this step."""
        returned, self._returned = self._returned, 0
        return returned

    def _preempt_until_fits(self, req: Request, n: int, batch: Batch, lookahead: int = 0) -> bool:
        """The pool is short of slots for `req` (and `lookahead` slots past them, speculative
        decoding): preempt victims until they fit; False if `req` itself was preempted."""
        while True:
            victim = self.waiting.preemption_victim(self.running)
            self._preempt(victim, batch)
            if victim is req:
                return False
            if self.kv.append_slots(req, n, lookahead):
                return True

    def _preempt(self, victim: Request, batch: Batch) -> None:
        scheduled_now = 0              # (a member scheduled with the cohort, listed or not, is taken out first)
        if victim in batch.decodes or victim in batch.prefills or victim.cohort is not None and batch.cohort_size:
            scheduled_now = batch.remove(victim, self.block_size)
            self._returned += scheduled_now
        if victim.cohort is not None:
            self.cohort.leave(victim)
        self.running.remove(victim)
        self.active.pop(victim, None)
        self.tokens_held -= victim.num_computed - scheduled_now
        self.kv.free(victim)
        victim.num_computed = 0
        victim.status = PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)
        self.waiting.add_preempted(victim)

    def _schedule_waiting(self, batch: Batch, budget: int) -> int:
        """Admit WAITING requests head first until one does not fit (head-of-line blocking)."""
        max_num_seqs, running, waiting = self.config.max_num_seqs, self.running, self.waiting
        while waiting and len(running) < max_num_seqs and budget > 0:
            req = waiting.peek()
            if self._skip_head(req):
                continue
            admission = self._admission(req, budget, not (batch.num_decode or batch.prefills))
            if admission is None:
                break
            scheduled = self._admit(req, admission, batch)
            if scheduled is None:
                break
            budget -= scheduled
        return budget

    def _skip_head(self, req: Request) -> bool:
        """Take the head out of this pass and go on to the next (LoRA's max_loras)?"""
        return False

    def _admit(self, req: Request, admission: tuple, batch: Batch) -> Optional[int]:
        """Give the waiting head its blocks and run it; the tokens it computes now, or None when
        the pool cannot give them (it stays at the head)."""
        kv = self.kv
        hits, hit_tokens, n_now, gate, reserve = admission
        if not kv.allocate_slots(req, n_now, hits, gate_tokens=gate, reserve_free=reserve):
            return None
        self.waiting.pop_head()
        resumed = req.status is PREEMPTED
        if not req.num_computed:           # (a request back from a CPU load was counted at its load)
            kv.stats.record(req.prompt_len + req.num_output, hit_tokens, resumed)
        if not resumed:
            req.num_cached_tokens = hit_tokens
            req.admit_step = batch.step
        req.status = RUNNING
        req.num_computed = hit_tokens
        self.tokens_held += hit_tokens
        req.run_seq = self._run_seq = self._run_seq + 1
        self.running.append(req)
        self.active[req] = None
        batch.admitted.append(req)
        if n_now:
            batch.add(req, n_now, self.block_size)
        return n_now

    def _admission(self, req: Request, budget: int, batch_empty: bool) -> Optional[tuple]:
        """How the waiting head would be admitted now: (prefix hit as the KV manager found it,
        hit tokens, tokens computed now, tokens whose blocks must be free, blocks kept free), or
        None when the token budget stops it before the pool is asked. (The leap planner asks it too.)"""
        if req.kv_transfer == "receive" and not req.num_preemptions:
            # P/D: its prompt's blocks are held and filled from a prefill engine (sim/disagg.py);
            # the last prompt token is recomputed for its logits, as vLLM's scheduler does after
            # a remote read (_update_waiting_for_remote_kv, vllm/v1/core/sched/scheduler.py, 0.19)
            hits, hit_tokens = NO_BLOCKS, req.prompt_len - 1
        else:
            hits, hit_tokens = self.kv.find_cached_prefix(req)
            hit_tokens += req.num_computed     # (a request back from a CPU load: its hit is computed)
        num_tokens = req.prompt_len + req.num_output
        n_now = self._first_chunk(num_tokens - hit_tokens, budget, batch_empty)
        if n_now is None:
            return None
        gate = num_tokens if self.config.reserve_full_prompt else hit_tokens + n_now
        # The watermark keeps room for running requests to grow; with none running it
        # would only stop a request that fits the pool from ever starting (vLLM skips it then).
        reserve = self._watermark_blocks if self.running else 0
        return hits, hit_tokens, n_now, gate, reserve

    def _first_chunk(self, n: int, budget: int, batch_empty: bool) -> Optional[int]:
        """The tokens a newly admitted request computes now out of the `n` it lacks (vLLM caps
        the first chunk at long_prefill_token_threshold too); None if it must wait."""
        cap = self.prefill_cap
        if 0 < cap < n:
            n = cap
        if not self.config.chunked_prefill and n > budget:
            return None
        return budget if budget < n else n     # (min(n, budget) without the call: ~1,200 instructions)

    def head_would_start(self, budget: int, batch_empty: bool, free_blocks: int) -> bool:
        """Would the waiting pass admit its head with `budget` tokens left and `free_blocks` free?
        (No state changes; the leap planner asks this, sim/core/fast/leap.py.)"""
        if len(self.running) >= self.config.max_num_seqs or budget <= 0:
            return False
        req = self.waiting.peek()
        if req is None:
            return False
        admission = self._admission(req, budget, batch_empty)
        if admission is None:
            return False
        hits, _, n_now, gate, reserve = admission
        return self.kv.would_fit(req, n_now, hits, gate, reserve, free_blocks)

    # -- after the step ------------------------------------------------------------------
    def finish_step(self, batch: Batch) -> list[Request]:
        """Append each completed sequence's next token; retire finished requests. Returns them.

        A live request (the server) that samples EOS has had its output_len cut to its
        length by the runner, so one length test covers scripted and live requests.
        """
        step = batch.step
        emitted = batch.decodes[batch.cohort_size if self.lists_members else 0:]    # (members: the cohort's)
        for r in batch.prefills:           # a prefill emits once its prompt is all computed
            if r.num_computed >= r.prompt_len + r.num_output:
                emitted.append(r)
        finished = self.cohort.end_step(step)            # (members, then the others, in batch order)
        for req in emitted:
            if req.emit(step):
                finished.append(req)
        if finished or self.pending_release:
            self._retire_finished(step, finished)
        if self.lazy:
            for req in emitted:
                if req.status is RUNNING and not req.is_live:
                    self.cohort.join(req, step)
                    del self.active[req]
        return finished

    def finish_cohort_step(self, step: int) -> list[Request]:
        """`finish_step` of a step in which only the cohort's members computed (a leap's last)."""
        finished = self.cohort.end_step(step)
        if finished or self.pending_release:
            self._retire_finished(step, finished)
        return finished

    def _retire_finished(self, step: int, finished: list[Request]) -> None:
        """Mark the step's finished requests and free them (not called on most steps: none finished)."""
        if len(finished) > 1:              # freed in the running list's order, as vLLM walks the step's requests
            finished.sort(key=_by_run_seq)
        for req in finished:
            req.status = FINISHED
            req.finish_step = step
            req.close_emit_run()
            self.active.pop(req, None)
        self._free_finished(finished)
        self.num_finished += len(finished)

    def _free_finished(self, finished: list[Request]) -> None:
        """Free finished requests and take them out of RUNNING."""
        for req in finished:
            self.tokens_held -= req.num_computed  # (num_computed: a finished request has left the cohort)
            if req.kv_transfer != "send":  # P/D: held until a decode engine read them (NixlConnector.request_finished)
                self.kv.free(req)
                req.drop_block_hashes()    # never looked up again: 40 B a block, most of a finished request
        if len(finished) == len(self.running):
            self.running.clear()
        else:               # (in run_seq order: a bisection, not list.remove's comparison with each)
            for req in finished:
                del self.running[bisect_left(self.running, req.run_seq, key=_by_run_seq)]

    # -- figures a step record keeps ------------------------------------------------------
    @property
    def slack_tokens(self) -> int:
        """Slots allocated to running requests but holding no token (tails, reservations)."""
        return self.kv.held_slots - self.tokens_held

    def kv_figures(self) -> tuple[int, int, int]:
        """(blocks in use, cached free blocks, slack tokens): what a step record keeps, in one call."""
        kv = self.kv
        pool = kv.pool
        return pool.num_blocks - 1 - pool.num_free, pool.num_cached_free, kv.held_slots - self.tokens_held

    # -- checks --------------------------------------------------------------------------
    def check_accounting(self) -> None:
        """Every added request is finished, rejected, aborted, waiting or running."""
        live = self.num_live()
        ended = self.num_finished + self.num_rejected + self.num_aborted
        if self.num_added != ended + live:
            raise AssertionError(f"request accounting broken: added {self.num_added} != finished "
                                 f"{self.num_finished} + rejected {self.num_rejected} + aborted "
                                 f"{self.num_aborted} + waiting {self.num_waiting} + running {len(self.running)}")
