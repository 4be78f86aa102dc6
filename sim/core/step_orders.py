"""The step orders besides vLLM V1's: mixins that `make_scheduler` (sim/core/scheduler_variants.py) puts in
front of the reference scheduler.

`StaticBatching` (HF `generate`): a batch forms only when none runs, its prompts computed in one
padded forward, and it runs until its last member finishes; every step computes all B rows, padded
to the longest (a finished member's row too: `Batch.pad_rows`).
`PrefillFirst` (vLLM V0, nano-vllm, Vidur's vLLM model): a step is all prefills while any can be
scheduled, otherwise all decodes; only a step's first prefill may be chunked.
"""
from __future__ import annotations

import math

from sim.core.batch import StaticBatch


class StaticBatching:
    """HF `generate`: the waiting pass runs only when nothing runs, and takes whole prompts."""

    __slots__ = ()
    state = ()
    static = True

    def __init__(self, config, kv, offload=None):
        super().__init__(config, kv, offload)
        self.prefill_cap = 0           # whole prompts: no long-prefill cap

    def _compose(self, batch, budget: int) -> None:
        admit = not self.running
        self._schedule_running(batch, budget)
        if admit and not batch.preempted:
            self._schedule_waiting(batch, math.inf)     # one padded forward, whatever the budget

    def _first_chunk(self, n: int, budget: int, batch_empty: bool) -> int:
        return n

    def _schedule_pass(self):
        """Every step computes the padded batch HF `generate` computes."""
        batch = super()._schedule_pass()
        if batch is None:
            return None
        if batch.admitted:             # (a new batch formed)
            self.static_batch = StaticBatch(rows=len(batch.admitted), first_step=batch.step,
                                            length=max(r.num_tokens for r in batch.admitted))
        batch.pad_static(self.static_batch, self.block_size)
        return batch


def _prefills(reqs) -> list:
    """The requests that are not decodes (one generated token to feed back), in order."""
    return [r for r in reqs if r.num_tokens - r.num_computed != 1 or not r.num_output]


def _decodes(reqs) -> list:
    return [r for r in reqs if r.num_tokens - r.num_computed == 1 and r.num_output > 0]


class PrefillFirst:
    """vLLM V0: the running requests' prefills, then the waiting; only a step with no prefill decodes."""

    __slots__ = ()
    state = ()
    mixed = False

    def _compose(self, batch, budget: int) -> None:
        # (the cohort's members are decodes: the one-by-one requests are `active`)
        candidates = self.active if self.cohort.members else self.running
        if candidates:                 # (most steps none outside the cohort: no calls)
            budget = self._schedule_each(_prefills(candidates), budget, batch)
        if not batch.preempted:
            budget = self._schedule_waiting(batch, budget)
        if batch.decodes or batch.prefills:     # a prefill step: the decodes wait; the cohort sits it out intact
            self.cohort.pause(batch.step)
            return
        self._schedule_running(batch, budget, _decodes)

    def _first_chunk(self, n: int, budget: int, batch_empty: bool):
        """Only the step's first prefill may be chunked (nano-vllm). (The reference rule with that
        one condition more, written out: every admission check of a V0 run comes here.)"""
        cap = self.prefill_cap
        if 0 < cap < n:
            n = cap
        if n > budget and (not batch_empty or not self.config.chunked_prefill):
            return None
        return budget if budget < n else n     # (min(n, budget) without the call: ~1,200 instructions)
