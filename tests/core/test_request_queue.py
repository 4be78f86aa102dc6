"""The waiting queue types (sim/core/request_queue.py) and the decode cohort's member view.

vLLM's FCFSRequestQueue / PriorityRequestQueue (vllm/v1/core/sched/request_queue.py, v0.11):
FCFS pops arrivals in order and a preempted request is put back at the front; PRIORITY pops the
lowest (priority, arrival) first. vLLM's scheduler preempts the last running request under FCFS
and the max (priority, arrival) under PRIORITY (vllm/v1/core/sched/scheduler.py, `schedule`).
"""
import pytest

from sim.core.fast.cohort import CohortMember, DecodeCohort
from sim.core.kv import KVCacheManager
from sim.core.request import Request, make_request
from sim.core.request_queue import FcfsQueue, PriorityQueue, make_request_queue


def req(i, arrival, priority=0):
    return make_request(i, arrival, [(i, 8)], 4, priority=priority)


def test_fcfs_pops_in_arrival_order_and_puts_a_preempted_request_first():
    q = make_request_queue("fcfs")
    a, b, c = req(0, 0.0), req(1, 1.0), req(2, 2.0)
    q.add(a), q.add(b)
    q.add_preempted(c)
    assert isinstance(q, FcfsQueue) and len(q) == 3 and q.peek() is c
    assert [q.pop_head() for _ in range(3)] == [c, a, b] and q.peek() is None
    assert FcfsQueue.preemption_victim([a, b, c]) is c


def test_priority_pops_lowest_priority_then_earliest_arrival_then_queue_order():
    q = make_request_queue("priority")
    late_urgent, early, tie_first, tie_second = req(0, 5.0, -1), req(1, 0.0, 1), req(2, 3.0, 0), req(3, 3.0, 0)
    for r in (early, tie_first, tie_second, late_urgent):
        q.add(r)
    assert isinstance(q, PriorityQueue) and q.peek() is late_urgent
    assert [q.pop_head() for _ in range(4)] == [late_urgent, tie_first, tie_second, early]
    q.add(early), q.add_preempted(late_urgent)       # a preempted request re-queues by the same key
    assert q.peek() is late_urgent
    assert PriorityQueue.preemption_victim([late_urgent, early, tie_first]) is early


def test_discard_takes_out_only_that_request():
    for policy in ("fcfs", "priority"):
        q = make_request_queue(policy)
        a, b = req(0, 0.0), req(1, 1.0)
        q.add(a), q.add(b)
        q.discard(a)
        q.discard(a)                                   # (not queued any more: nothing happens)
        assert len(q) == 1 and q.pop_head() is b


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="'fcfs' or 'priority'"):
        make_request_queue("lifo")


def test_a_cohort_member_reads_its_progress_off_the_cohort_and_cannot_write_it():
    kv = KVCacheManager(64, 16, enable_caching=False)
    cohort = DecodeCohort(kv.layout())
    r = make_request(0, 0.0, [(1, 20)], 10)
    cohort.sync(0)                                      # step 0 ran: the prompt computed, one token out
    assert cohort.end_step(0) == []
    r.num_computed, r.num_output = 21, 1
    cohort.join(r, step=0)
    assert type(r) is CohortMember and r.cohort is cohort
    cohort.sync(3)                                      # steps 1..3 scheduled, 1..2 emitted
    assert cohort.end_step(2) == []
    assert (r.num_computed, r.num_output, r.num_tokens) == (24, 3, 23)
    with pytest.raises(AttributeError):
        r.num_computed = 0
    cohort.leave(r)
    assert type(r) is Request and r.cohort is None and (r.num_computed, r.num_output) == (24, 3)
