"""The reference scheduling policy: vLLM V1's scheduler, plus the V0 order and static batching.

The scheduler owns no clock. A driver (the SimPy simulator, or the engine in wall-clock time)
calls `add`, `schedule` and `finish_step`; steps are counted, never timed. docs/architecture_core.md
walks through it; in short (vLLM's vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`):

`mixed` (vLLM V1): RUNNING requests first, in admission order, each taking what it still needs
(one token for a decode, the rest of a prompt chunked to the budget); when a block cannot be had,
the queue type's victim (sim/core/request_queue.py) is preempted, to be recomputed. Then, if
nothing was preempted, WAITING requests from the head until the token budget, max_num_seqs or the
KV pool stops the head (head-of-line blocking).
`prefill_first` (V0, nano-vllm, Vidur's vLLM model): a step is all prefills while any can be
scheduled, otherwise all decodes; only a step's first prefill may be chunked.
`static` (HF `generate`): a batch forms only when none runs, its prompts computed in one padded
forward, and it runs until its last member finishes; every step computes all B rows, padded to
the longest (a finished member's row too: `Batch.pad_rows`).

Async scheduling (vLLM's AsyncScheduler): vLLM plans step N+1 before it processes step N's
outputs, so a request that emits its last token in step N still holds its blocks and its
max_num_seqs seat while step N+1 is planned (it can even be the victim of a preemption, which
frees its blocks at once). `finish_step` retires such requests but keeps them in `running`
(`_finishing`) until the next `schedule` pass has run; with nothing else left to plan, vLLM
processes the outputs at once, and so does `finish_step`. New requests are likewise taken only
between loop turns: one added while a step is in flight waits in `arriving` through the next
pass (vLLM's turn after step N plans N+2), docs/vllm_semantics.md.

The decode cohort (sim/core/fast/cohort.py) is the one fast path inside a step: `take_step` gives
every steady decode its token at once when that cannot change any outcome, else it dissolves.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Optional

from sim.core import vllm_versions
from sim.core.batch import Batch, StaticBatch
from sim.core.fast.cohort import DecodeCohort
from sim.core.kvcache import KVCacheManager
from sim.core.lora import LoraSlots
from sim.core.request import Request
from sim.core.request_queue import make_request_queue
from sim.core.speculative import SpecDecoder
from sim.core.status import ABORTED, FINISHED, PREEMPTED, REJECTED, RUNNING, WAITING


_by_run_seq = attrgetter("run_seq")     # a request's position in the running list (a C-level sort key)


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
    # vLLM's async scheduling: finished requests leave RUNNING one step late, and requests that
    # arrive while a step runs join WAITING one pass late (module docstring).
    async_scheduling: bool = False
    # vLLM's long_prefill_token_threshold: the most tokens one prompt chunk computes (0 = no cap).
    long_prefill_token_threshold: int = 0
    # vLLM >= 0.20 caps a sliding-window group's admission need at the window (sim/core/vllm_versions.py).
    sliding_admission_cap: bool = True
    # Speculative decoding (sim/core/speculative.py): (method, num_speculative_tokens, per-position
    # acceptance rates, seed), or None. It turns the decode cohort and leaps off (one token a step).
    speculative: Optional[tuple] = None
    # LoRA (sim/core/lora.py): (max_loras, max_cpu_loras), or None. It turns the decode cohort off
    # (every step's adapters are counted one request at a time).
    lora: Optional[tuple] = None

    @classmethod
    def from_scenario(cls, s) -> "SchedulerConfig":
        """The policy's settings from a validated scenario: every scenario field the scheduler
        consults is read here, and nowhere else."""
        e = s.engine
        return cls(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                   max_model_len=s.max_model_len, batching=e.batching, chunked_prefill=e.chunked_prefill,
                   policy=e.scheduling_policy, step_composition=e.step_composition,
                   admission_watermark=e.admission_watermark, reserve_full_prompt=e.reserve_full_prompt,
                   async_scheduling=s.async_scheduling,
                   long_prefill_token_threshold=s.long_prefill_token_threshold,
                   sliding_admission_cap=vllm_versions.has(e.vllm_version, "sliding_window_admission_cap"),
                   speculative=e.speculative.policy(s.seed) if e.speculative is not None else None,
                   lora=e.lora.policy() if e.lora is not None else None)


class Scheduler:
    # (slots: attribute reads stay cheap on the hot paths, however many attributes there are)
    __slots__ = ("config", "kv", "block_size", "static", "mixed", "lazy", "cohort", "waiting", "running",
                 "active", "step", "num_added", "num_finished", "num_rejected", "num_aborted", "num_preemptions",
                 "tokens_held", "_run_seq", "_empty_preempted", "_returned", "_usable_blocks", "_watermark_blocks",
                 "static_batch", "_finishing", "pending_release", "arriving", "in_flight", "offload", "spec",
                 "lora")

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.static = config.batching == "static"
        self.mixed = config.step_composition == "mixed" or self.static
        # Speculative decoding: drafts per decode and their verification; the fast paths assume
        # one token per step, so they are off with it.
        self.spec = SpecDecoder(*config.speculative) if config.speculative else None
        # LoRA: GPU slots, the CPU cache and the max_loras limit of a step (no cohort with it).
        self.lora = LoraSlots(*config.lora) if config.lora else None
        self.lazy = config.lazy_decode and self.spec is None and self.lora is None
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
        # Async scheduling: the last step's finishers, in `running` with their blocks until the next
        # pass has run; `pending_release` says whether there are any (the leap planner reads it).
        self._finishing: list[Request] = []
        self.pending_release = False
        # Async scheduling: vLLM's busy loop takes new requests only between loop turns, and the turn
        # that follows step N plans N+2 (N+1 was planned while N ran). So a request added while a step
        # is in flight (`in_flight`: the last schedule() returned one) waits in `arriving` through
        # the next pass and joins WAITING after it: it is scheduled in N+2 at the earliest.
        self.arriving: list[Request] = []
        self.in_flight = False
        kv.sliding_admission_cap = config.sliding_admission_cap
        self.offload = None            # a CPU tier below the prefix cache (sim/core/offload.py), or None

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
        if self.in_flight:               # async scheduling: seen after the next pass (__init__)
            self.arriving.append(req)
            return True
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
        elif req in self.arriving:        # async scheduling: added while a step ran, not yet waiting
            self.arriving.remove(req)
        else:
            self.waiting.discard(req)
        if self.offload is not None:
            self.offload.forget(req)
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
        return len(self.waiting)      # (hot loops read len(self.waiting), a C call, not this property)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return (len(self.running) > len(self._finishing) or len(self.waiting) > 0 or bool(self.arriving)
                or (self.offload is not None and bool(self.offload.loading)))

    def has_other_work(self, finished: list) -> bool:
        """Is anything left to schedule besides the step's finishers? Only then does an async
        engine plan the next step before processing this one's outputs."""
        return len(self.waiting) > 0 or len(self.running) > len(finished)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> Optional[Batch]:
        """Choose this step's work. Returns None when nothing can run.

        Async scheduling: the pass does not see the requests that arrived while the last step ran
        (`arriving`); they join WAITING after it, or at once when it finds nothing to run (vLLM's
        empty turn costs nothing and the next turn takes them).
        """
        batch = self._schedule_pass()
        if self.arriving:
            self.take_arriving()
            if batch is None:
                batch = self._schedule_pass()
        self.in_flight = batch is not None and self.config.async_scheduling
        return batch

    def take_arriving(self) -> None:
        """Move the requests held in `arriving` to WAITING (in arrival order)."""
        for req in self.arriving:
            self.waiting.add(req)
        self.arriving = []

    def _schedule_pass(self) -> Optional[Batch]:
        """One scheduling pass over RUNNING and WAITING. Returns None when nothing can run.

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
        """One scheduling pass; None when it scheduled nothing."""
        batch = Batch(self.step)
        self._empty_preempted = []
        if self.mixed:
            self._schedule_mixed(batch, self.config.max_num_batched_tokens)
        else:
            self._schedule_prefill_first(batch, self.config.max_num_batched_tokens)
        if not (batch.decodes or batch.prefills):
            self._empty_preempted = batch.preempted
            return None
        # (no padding rows yet; draft tokens count until their rejection rolls them back)
        self.tokens_held += batch.num_prefill_tokens + len(batch.decodes) + batch.spec_tokens
        if self.lora is not None:          # the step's adapters made resident (loads priced by the cost model)
            batch.lora = self.lora.activate(batch)
        if self.static:                    # every step computes the padded batch HF `generate` computes
            if batch.admitted:             # (a new batch formed)
                self.static_batch = StaticBatch(rows=len(batch.admitted), first_step=batch.step,
                                                length=max(r.num_tokens for r in batch.admitted))
            batch.pad_static(self.static_batch, self.block_size)
        self.step += 1
        return batch

    def _schedule_mixed(self, batch: Batch, budget: int) -> None:
        """vLLM V1 (and static batching): the running requests, then, unless that preempted, the waiting."""
        admit = not (self.static and self.running)     # a static batch forms only when none runs
        budget = self._schedule_running(batch, budget)
        if admit and not batch.preempted:
            self._schedule_waiting(batch, budget)

    def _schedule_prefill_first(self, batch: Batch, budget: int) -> None:
        """V0: the running requests' prefills, then the waiting; only a step with no prefill decodes."""
        budget = self._schedule_running(batch, budget, only="prefill")
        if not batch.preempted:
            budget = self._schedule_waiting(batch, budget)
        if len(batch):                     # a prefill step: the decodes wait; the cohort sits it out intact
            self.cohort.pause(batch.step)
        else:
            self._schedule_running(batch, budget, only="decode")

    def _schedule_running(self, batch: Batch, budget: int, only: Optional[str] = None) -> int:
        """RUNNING requests in admission order, each given what it still needs: one token for a
        decode, the rest of its prompt (chunked to the budget) otherwise. `only` is prefill_first's
        pass, taking only "prefill"s or only "decode"s."""
        candidates = self.running
        cohort = self.cohort
        if only == "prefill":
            if cohort.members:             # (members are decodes: the one-by-one requests are `active`)
                candidates = self.active
        else:
            if cohort.members:             # fast path: every member's token at once (sim/core/fast/cohort.py)
                others = cohort.take_step(self, batch, budget)
                if others is None:         # some member might not get its token: it dissolved
                    self.active = dict.fromkeys(self.running)
                else:
                    budget -= batch.cohort_size
                    candidates = others
            cohort.sync(batch.step)
        for req in list(candidates):       # (a snapshot: victims leave `running` while it is walked)
            if budget <= 0:
                break
            if req.status is not RUNNING:
                continue                   # preempted in this pass
            if only is not None and (only == "decode") != (req.num_tokens - req.num_computed == 1
                                                           and req.num_output > 0):
                continue
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
        n = req.num_tokens - req.num_computed
        if n == 1 and self.spec is not None and req.num_output:     # a decode carries its drafts
            n = min(1 + self.spec.k, self.config.max_model_len - 1 - req.num_computed)
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n and not self.static:      # vLLM's long_prefill_token_threshold caps every chunk
            n = threshold
        if n > budget:
            if not self.config.chunked_prefill and req.num_computed == 0:
                return None
            n = budget
        return n

    def _schedule_tokens(self, req: Request, n: int, batch: Batch, budget: int) -> int:
        """Schedule `n` tokens of a running request, preempting others while its slots do not fit."""
        if self.spec is not None:
            return self._schedule_spec_tokens(req, n, batch, budget)
        if not self._allocate_or_preempt(req, n, batch):
            return budget + self._take_returned()                  # it preempted itself
        budget += self._take_returned()
        batch.add(req, n, self.block_size)
        return budget - n

    def _schedule_spec_tokens(self, req: Request, n: int, batch: Batch, budget: int) -> int:
        """`_schedule_tokens` under speculative decoding: the slots come with the lookahead (never
        past max_model_len), and a decode carrying drafts goes in as one (Batch.add_spec). (Apart,
        so that a run without speculation pays nothing for it on this per-request path.)"""
        lookahead = min(self.spec.lookahead, self.config.max_model_len - req.num_computed - n)
        if not self._allocate_or_preempt(req, n, batch, lookahead):
            return budget + self._take_returned()                  # it preempted itself
        budget += self._take_returned()
        if n > 1 and req.num_output and req.num_computed + 1 == req.num_tokens:
            batch.add_spec(req, n, self.block_size)                # a decode verifying n - 1 drafts
        else:
            batch.add(req, n, self.block_size)
        return budget - n

    def _take_returned(self) -> int:
        """Tokens given back by victims that had already been scheduled this step."""
        returned, self._returned = self._returned, 0
        return returned

    def _allocate_or_preempt(self, req: Request, n: int, batch: Batch, lookahead: int = 0) -> bool:
        """Allocate slots (and `lookahead` slots past them, speculative decoding), preempting victims
        until they fit; False if `req` itself was preempted."""
        while not self.kv.append_slots(req, n, lookahead):
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
        if self.offload is not None:
            self.offload.request_done(victim)
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
        tier = self.offload
        if tier is not None and tier.loading:      # loads done: back at the head (vLLM's skipped queue)
            for req in reversed(tier.take_loaded()):
                self.waiting.add_preempted(req)
        lora = self.lora
        if lora is not None:               # vLLM's scheduled_loras: the running pass's adapters
            scheduled_loras, skipped, skipped_reqs = lora.scheduled(batch), [], []
        while self.waiting and len(running) < cfg.max_num_seqs and (budget > 0 or self.static):
            req = self.waiting.peek()
            if lora is not None and lora.must_skip(req, scheduled_loras):
                skipped.append(self.waiting.skip_head())     # max_loras taken: later requests may go
                skipped_reqs.append(req)
                continue
            resumed = req.status is PREEMPTED
            admit = self._admission(req, budget, not (batch.decodes or batch.prefills))
            if admit is None:
                break
            hits, hit_tokens, n_now, gate, reserve = admit
            cpu_tokens = tier.match(req, hit_tokens) if tier is not None and not req.num_computed else 0
            if cpu_tokens:     # loaded asynchronously: blocks now, the request back once copied
                if not kv.allocate_slots(req, cpu_tokens, hits, gate_tokens=gate, reserve_free=reserve):
                    break
                self.waiting.pop_head()
                kv.stats.record(req.prompt_len + req.num_output, hit_tokens, resumed)
                tier.start_load(req, hit_tokens, cpu_tokens)
                continue
            if not kv.allocate_slots(req, n_now, hits, gate_tokens=gate, reserve_free=reserve):
                break
            self.waiting.pop_head()
            if not (tier is not None and req.num_computed):      # (a loaded request was counted at its load)
                kv.stats.record(req.prompt_len + req.num_output, hit_tokens, resumed)
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
            if lora is not None and req.lora_id:
                scheduled_loras.add(req.lora_id)
            if n_now:
                budget -= n_now
                batch.add(req, n_now, self.block_size)
        if lora is not None and skipped:   # back at the head, in their order (vLLM's prepend_requests)
            self.waiting.unskip(skipped)
            lora.skipped(skipped_reqs)
        return budget

    def _admission(self, req: Request, budget: int, batch_empty: bool) -> Optional[tuple]:
        """How the waiting head would be admitted now: (prefix hit as the KV manager found it,
        hit tokens, tokens computed now, tokens whose blocks must be free, blocks kept free), or
        None when the token budget stops it before the pool is asked. (Every admission rule is
        here: the waiting pass's, and the leap planner's through `head_would_start`. A plain
        tuple: it is made at every admission attempt.)"""
        cfg = self.config
        if req.kv_transfer == "receive" and not req.num_preemptions:
            # P/D: its prompt's blocks are held and filled from a prefill engine (sim/disagg.py);
            # the last prompt token is recomputed for its logits, as vLLM's scheduler does after
            # a remote read (_update_waiting_for_remote_kv, vllm/v1/core/sched/scheduler.py, 0.19)
            hits, hit_tokens = [], req.prompt_len - 1
        else:
            hits, hit_tokens = self.kv.find_cached_prefix(req)
            hit_tokens += req.num_computed     # (a request back from a CPU load: its hit is computed)
        num_tokens = req.prompt_len + req.num_output
        n = num_tokens - hit_tokens
        threshold = cfg.long_prefill_token_threshold
        if 0 < threshold < n and not self.static:       # vLLM caps the first chunk too
            n = threshold
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
        admit = self._admission(req, budget, batch_empty)
        if admit is None:
            return False
        hits, _, n_now, gate, reserve = admit
        return self.kv.would_fit(req, n_now, hits, gate, reserve, free_blocks)

    # -- after the step ------------------------------------------------------------------
    def finish_step(self, batch: Batch) -> list[Request]:
        """Append each completed sequence's next token; retire finished requests. Returns them.

        A live request (the server) that samples EOS has had its output_len cut to its
        length by the runner, so one length test covers scripted and live requests.
        """
        step = batch.step
        if batch.spec_drafts:              # speculative decoding: rejected drafts roll back, accepted ones count
            self.tokens_held -= self.spec.settle(batch)
        emitted = batch.decodes[batch.cohort_size:]       # the members emit through the cohort
        for r in batch.prefills:     # (a loop, not a comprehension: that is a call, for one or two)
            if r.num_computed >= r.prompt_len + r.num_output:    # (one by one: no member, fields are progress)
                emitted.append(r)
        finished = self.cohort.end_step(step)            # (members, then the others, in batch order)
        for req in emitted:
            if req.emit(step):
                finished.append(req)
        if self.offload is not None:       # write-through of the blocks this step filled
            self.offload.after_step(batch.prefills + batch.decodes)
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
        finished = self.cohort.end_step(step)
        if finished or self._finishing:
            self._retire_finished(step, finished)
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
        if self.offload is not None:
            self.offload.request_done(req)
        if req.kv_transfer == "send":
            return      # P/D: held until a decode engine read them (NixlConnector.request_finished)
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
        if self.pending_release != bool(self._finishing):
            raise AssertionError(f"pending_release {self.pending_release} with {len(self._finishing)} finishing")
        live = self.num_waiting + len(self.running) - len(self._finishing) + len(self.arriving)
        live += len(self.offload.loading) if self.offload is not None else 0
        ended = self.num_finished + self.num_rejected + self.num_aborted
        if self.num_added != ended + live:
            raise AssertionError(f"request accounting broken: added {self.num_added} != finished "
                                 f"{self.num_finished} + rejected {self.num_rejected} + aborted "
                                 f"{self.num_aborted} + waiting {self.num_waiting} + running {len(self.running)}")
