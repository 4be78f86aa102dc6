"""The engine loop with one step in flight: step N's device work overlaps step N+1's host side.

    synchronous:  schedule N, prepare N, launch N, wait N, finish N | schedule N+1, ...
    overlapped:   schedule N, prepare N, launch N, finish N | schedule N+1, prepare N+1,
                  launch N+1, wait N (step N handed out) | ...

The device runs a stream of launches: on a GPU, step N+1 is queued behind step N before the host
waits for step N's sampled ids (a non-blocking copy into a pinned buffer, then an event), so the
scheduler's work, block tables, positions and slot mapping of step N+1 happen while step N
computes, and the device does not idle between the two. On CPU the forward runs inside launch,
so the order changes and nothing overlaps; the results are the same either way.

`Scheduler.finish_step(N)` runs before step N's ids reach the host only when none of its
decisions can depend on them: every request that samples in step N is scripted (its output ids
come from the workload, its length is fixed). A step that samples for a live request (the
server's: EOS cuts its length, prefix-cache hashes read its tokens) is finished after the wait,
and step N+1 is scheduled only then. So both loops give the same batches, tokens and request
records (tests/engine/test_pipeline.py), and vLLM's one-step lag (a request scheduled once more after
its last token) is not reproduced here. KVTWIN_OVERLAP=0 (or overlap=False) turns overlap off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Optional

from engine.runner import ModelRunner, PendingStep, StepResult
from sim.core.request import Request
from sim.core.scheduler import Batch, Scheduler


def overlap_wanted() -> bool:
    return os.environ.get("KVTWIN_OVERLAP", "1") != "0"


@dataclass
class CompletedStep:
    batch: Batch
    result: StepResult
    finished: list[Request]          # what Scheduler.finish_step retired at this step


class StepPipeline:
    """Drives a scheduler and a runner step by step; `step()` returns each step once its
    sampled ids are on the host, in order. With overlap, requests added between two calls
    join the step after the one already launched."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: Optional[bool] = None):
        self.scheduler, self.runner = scheduler, runner
        self.overlap = overlap_wanted() if overlap is None else overlap
        self._pending: Optional[PendingStep] = None
        self._finished: Optional[list[Request]] = None   # finish_step of the pending step, if done early
        self.launched: list[PendingStep] = []             # the steps the last step() call launched

    def busy(self) -> bool:
        """Work left: a step in flight or requests the scheduler holds."""
        return self._pending is not None or self.scheduler.has_unfinished()

    def drain(self) -> Iterator[CompletedStep]:
        """Every step left, in order, until no work is left (a scheduler holding requests it can
        never schedule raises instead of looping)."""
        while self.busy():
            done = self.step()
            if done is None:
                raise RuntimeError("the scheduler stalled with work left")
            yield done

    def step(self) -> Optional[CompletedStep]:
        """The next completed step, or None when nothing is in flight and nothing can be scheduled."""
        self.launched = []
        if self._pending is not None:
            # Overlapped: step N+1 was planned before the requests added since the last call, so
            # they are what vLLM's next loop turn takes (N+2): the scheduler need not hold them too.
            if self.scheduler.arriving:         # (only async scheduling holds arrivals back)
                self.scheduler.take_arriving()
        if self._pending is None and not self._launch_next():
            return None
        pending, finished = self._pending, self._finished
        self._pending = self._finished = None
        if finished is not None:                # step N is settled: queue step N+1 before waiting
            self._launch_next()
        result = self.runner.collect(pending)
        if finished is None:
            finished = self.scheduler.finish_step(pending.step.batch)
        return CompletedStep(pending.step.batch, result, finished)

    def _launch_next(self) -> bool:
        batch = self.scheduler.schedule() if self.scheduler.has_unfinished() else None
        if batch is None:
            return False
        self._pending = self.runner.launch(self.runner.prepare(batch))
        self.launched.append(self._pending)
        if self.overlap and not self._samples_live(batch, self._pending):
            self._finished = self.scheduler.finish_step(batch)
        return True

    @staticmethod
    def _samples_live(batch: Batch, pending: PendingStep) -> bool:
        reqs = batch.reqs
        return any(reqs[s].is_live for s in pending.step.emit)
