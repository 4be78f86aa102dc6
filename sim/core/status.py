"""A request's status, the one enum every layer uses (scheduler, KV cache, simulator, engine).

The members are also exported as module constants (`from sim.core.status import RUNNING`): the
hot loops compare a status on every request of every step, and in CPython 3.11 a member read off
its class costs a descriptor call where a module global costs a dict lookup.
"""
from __future__ import annotations

import enum


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2   # back in the waiting queue, to be recomputed
    FINISHED = 3    # FINISHED and the statuses after it are final (Request.is_finished)
    REJECTED = 4
    ABORTED = 5


WAITING = Status.WAITING
RUNNING = Status.RUNNING
PREEMPTED = Status.PREEMPTED
FINISHED = Status.FINISHED
REJECTED = Status.REJECTED
ABORTED = Status.ABORTED
