"""The waiting queue, one type per scheduling policy (vLLM's FCFSRequestQueue / PriorityRequestQueue).

The queue type is the policy: it orders the waiting requests and names the running request a
preemption takes. The scheduler only calls `add`, `add_preempted`, `peek`, `pop_head`, `discard`,
`preemption_victim` and `len()`, and with LoRA `skip_head` / `unskip` (vLLM's skipped_waiting_requests).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Optional, Union

from sim.core.request import Request


class FcfsQueue(deque):
    """First come, first served: arrivals join the tail, a preempted request goes back to the
    head (it is recomputed first), and the last admitted running request is the one preempted."""

    __slots__ = ()
    add = deque.append                 # (the deque's own methods: no Python call per request)
    add_preempted = deque.appendleft
    pop_head = deque.popleft
    skip_head = deque.popleft          # (LoRA: out of the queue for the rest of a pass)

    def unskip(self, skipped: list) -> None:
        """Put skipped heads back at the head, in the order they were skipped (vLLM's
        prepend_requests of its skipped_waiting_requests, which were prepended one by one)."""
        self.extendleft(reversed(skipped))

    def peek(self) -> Optional[Request]:
        return self[0] if self else None

    def discard(self, req: Request) -> None:
        if req in self:
            self.remove(req)

    @staticmethod
    def preemption_victim(running: list[Request]) -> Request:
        return running[-1]


class PriorityQueue(list):
    """Lowest `priority` value first, then earliest arrival, then the order they were queued
    (a preempted request re-queues by the same key: its priority and arrival put it back where
    it was). The victim is the running request that would come last in that order."""

    __slots__ = ("_queued",)

    def __init__(self) -> None:
        super().__init__()
        self._queued = 0               # requests queued so far: the tie-break after arrival

    def add(self, req: Request) -> None:
        self._queued += 1
        arrival = req.arrival if req.arrival is not None else 0.0
        heapq.heappush(self, (req.priority, arrival, self._queued, req))

    add_preempted = add

    def peek(self) -> Optional[Request]:
        return self[0][-1] if self else None

    def pop_head(self) -> Request:
        return heapq.heappop(self)[-1]

    def skip_head(self) -> tuple:
        """The head's entry, out of the queue for the rest of a pass (LoRA)."""
        return heapq.heappop(self)

    def unskip(self, skipped: list) -> None:
        """Skipped entries back by their own keys (vLLM's priority queue has no head to prepend to)."""
        for entry in skipped:
            heapq.heappush(self, entry)

    def discard(self, req: Request) -> None:
        kept = [entry for entry in self if entry[-1] is not req]
        if len(kept) != len(self):
            self[:] = kept
            heapq.heapify(self)

    @staticmethod
    def preemption_victim(running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival or 0.0, r.id))


RequestQueue = Union[FcfsQueue, PriorityQueue]


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
