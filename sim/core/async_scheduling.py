"""Async scheduling (vLLM's AsyncScheduler, vllm/v1/core/sched/async_scheduler.py, 0.19): a mixin
that `make_scheduler` (sim/core/scheduler_variants.py) puts in front of the reference scheduler.

vLLM plans step N+1 before it processes step N's outputs, so a request that emits its last token in
step N still holds its blocks and its max_num_seqs seat while step N+1 is planned (it can even be
the victim of a preemption, which frees its blocks at once). `_free_finished` keeps such requests in
`running` (`_finishing`) until the next pass has run; with nothing else left to plan, vLLM
processes the outputs at once, and so does this. New requests are likewise taken only between
loop turns: one added while a step is in flight waits in `arriving` through the next pass (vLLM's
turn after step N plans N+2), docs/vllm_semantics.md.
"""
from __future__ import annotations

from sim.core.status import FINISHED


class AsyncScheduling:
    """Finishers release one pass late; arrivals during a step join WAITING one pass late."""

    __slots__ = ()
    holds_arrivals = True                   # (while `in_flight`: the leap planner asks)
    state = ("_finishing", "in_flight")     # the composed class's slots (make_scheduler)

    def __init_subclass__(cls, **kwargs):
        """The composed scheduler's (sim/core/scheduler_variants.py) next `schedule` and
        `_free_finished` after this mixin, found once: `super()` makes a proxy and walks the MRO
        at every call (Python 3.11), and these two run at every step and every finish."""
        super().__init_subclass__(**kwargs)
        after = cls.__mro__[cls.__mro__.index(AsyncScheduling) + 1:]
        cls._next_schedule = next(c.__dict__["schedule"] for c in after if "schedule" in c.__dict__)
        cls._next_free_finished = next(c.__dict__["_free_finished"] for c in after if "_free_finished" in c.__dict__)

    def __init__(self, config, kv, offload=None):
        super().__init__(config, kv, offload)
        self._finishing: list = []     # the last step's finishers, in `running` until the next pass ran
        self.in_flight = False         # the last schedule() returned a step

    def _enqueue(self, req) -> None:
        if self.in_flight:
            self.arriving.append(req)
        else:
            super()._enqueue(req)

    def _dequeue(self, req) -> None:
        if req in self.arriving:
            self.arriving.remove(req)
        else:
            super()._dequeue(req)

    def num_live(self) -> int:
        return super().num_live() - len(self._finishing) + len(self.arriving)

    def schedule(self):
        """The pass does not see the requests that arrived while the last step ran (`arriving`);
        they join WAITING after it, or at once when it finds nothing to run (vLLM's empty turn
        costs nothing and the next turn takes them)."""
        batch = self._next_schedule()
        if self.arriving:
            self.take_arriving()
            if batch is None:
                batch = self._next_schedule()
        self.in_flight = batch is not None
        return batch

    def take_arriving(self) -> None:
        """Move the requests held in `arriving` to WAITING, in arrival order."""
        for req in self.arriving:
            self.waiting.add(req)
        self.arriving = []

    def _after_pass(self) -> bool:
        """After the pass, the last step's outputs retire their finished requests (vLLM's
        update_from_output runs after the next schedule); a pass that found nothing only because
        they still held their blocks or seats is an empty step, and their release lets the next run."""
        released = bool(self._finishing)
        if released:
            self.release_finishing()
        return released

    def _preempt(self, victim, batch) -> None:
        if victim.status is not FINISHED:
            super()._preempt(victim, batch)
            return
        # The victim emitted its last token in the step in flight. vLLM frees its blocks now and
        # counts a preemption; its output then finishes it from the waiting queue, before anything
        # is admitted, so it simply finishes here.
        self._finishing.remove(victim)
        self.pending_release = bool(self._finishing)
        super()._free_finished([victim])
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)

    def _free_finished(self, finished: list) -> None:
        """Held until after the next pass, unless nothing else is left to plan."""
        self._finishing = finished
        self.pending_release = bool(finished)
        if not (len(self.waiting) > 0 or len(self.running) > len(finished)):
            self.release_finishing()

    def release_finishing(self) -> None:
        """Free the finished requests in `_finishing` and take them out of RUNNING."""
        finishing, self._finishing = self._finishing, []
        self.pending_release = False
        self._next_free_finished(finishing)

    def check_accounting(self) -> None:
        if self.pending_release != bool(self._finishing):
            raise AssertionError(f"pending_release {self.pending_release} with {len(self._finishing)} finishing")
        super().check_accounting()
