"""vLLM's async scheduling in the shared policy: finished requests leave RUNNING one step late.

vLLM plans step N+1 while step N runs and processes step N's outputs after that, so a request
that emits its last token in step N still holds its KV blocks and its max_num_seqs seat while
step N+1 is planned (it is not computed in N+1: vLLM knows it reached max_tokens). Each case
below is small enough to follow by hand; the expected steps are worked out in the comments.
"""
import pytest

from sim.core.kv import KVCacheManager
from sim.core.request import Status, make_request
from sim.core.scheduler import SchedulerConfig
from sim.core.scheduler_variants import make_scheduler
from sim.scenario import validate_scenario


def run(async_scheduling, requests, num_blocks=64, max_num_seqs=8, block_size=4):
    """All requests at t=0, in order; (scheduler, requests, per step the ids it computed and the
    running count right after it was planned)."""
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=256,
                             async_scheduling=async_scheduling)
    sched = make_scheduler(config, kv)
    reqs = [make_request(i, 0.0, [(100 + i, prompt)], output) for i, (prompt, output) in enumerate(requests)]
    for r in reqs:
        sched.add(r)
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None
        steps.append((sorted(r.id for r in batch.reqs), len(sched.running), [r.id for r in batch.preempted]))
        sched.finish_step(batch)
        assert len(steps) < 100
    sched.check_accounting()
    sched.kv.pool.check_invariants()
    return sched, reqs, steps


def test_a_freed_seat_admits_one_step_later():
    # max_num_seqs 2: requests 0 (output 2) and 1 (output 6) start at step 0; 2 (output 3) waits.
    # Request 0 emits its last token in step 1. Synchronously its seat is free for step 2, which
    # admits 2. Async, step 2 is planned while step 1 runs: 0 still sits in RUNNING (not computed
    # again), so 2 waits until step 3. (0 is retired right after step 2's pass: 1 running then.)
    spec = [(4, 2), (4, 6), (4, 3)]
    _, reqs, steps = run(False, spec, max_num_seqs=2)
    assert reqs[2].admit_step == 2 and steps[2][0] == [1, 2]
    _, reqs, steps = run(True, spec, max_num_seqs=2)
    assert reqs[2].admit_step == 3
    assert steps[2] == ([1], 1, [])
    assert steps[3][0] == [1, 2]
    assert reqs[0].finish_step == 1 and reqs[2].finish_step == 3 + 3 - 1
    assert [r.status for r in reqs] == [Status.FINISHED] * 3


def test_freed_blocks_admit_one_step_later():
    # Block size 4, 4 usable blocks. Step 0: request 0 (prompt 8, 2 blocks, output 1) and 1
    # (prompt 4, 1 block, output 10) prefill; 0 finishes at once. Request 2 (prompt 8) needs 2.
    # Sync, step 1: 0's blocks are back (3 free), 1's decode takes its 2nd block, 2 fits (2 free).
    # Async, step 1: 0 still holds 2 blocks, 1 free, taken by 1's decode: 2 waits for step 2.
    spec = [(8, 1), (4, 10), (8, 2)]
    _, reqs, _ = run(False, spec, num_blocks=5)
    assert reqs[2].admit_step == 1
    _, reqs, steps = run(True, spec, num_blocks=5)
    assert reqs[2].admit_step == 2
    assert steps[1] == ([1], 1, [])


def test_a_finishing_request_can_be_the_preemption_victim():
    # 4 usable blocks of 4 tokens: 0 (prompt 4, output 8: 1 block) then 1 (prompt 12, output 1:
    # 3 blocks) fill them at step 0, where 1 emits its only token. 2 (prompt 4) waits.
    # Sync, step 1: 1's blocks are back, 0's decode takes one, 2 is admitted.
    # Async, step 1: 0's decode needs a block and none is free; the last-admitted running request
    # is 1, finished but not yet retired: vLLM preempts it (freeing its blocks now, counting a
    # preemption) and, as the step preempted, admits nobody: 2 starts at step 2. 1 still finishes
    # at step 0 with its token.
    spec = [(4, 8), (12, 1), (4, 2)]
    _, reqs, steps = run(False, spec, num_blocks=5)
    assert reqs[2].admit_step == 1 and sum(r.num_preemptions for r in reqs) == 0
    sched, reqs, steps = run(True, spec, num_blocks=5)
    assert steps[1] == ([0], 1, [1])
    assert reqs[1].status is Status.FINISHED and reqs[1].finish_step == 0 and reqs[1].num_output == 1
    assert reqs[1].num_preemptions == 1 and sched.num_preemptions == 1
    assert reqs[2].admit_step == 2


def test_auto_follows_vllm_default_for_the_version_and_engine():
    def resolved(**engine):
        return validate_scenario({"model": "tiny", "device": engine.pop("device", "h100-sxm"),
                                  "engine": {"num_blocks": 64, **engine}}).async_scheduling
    assert resolved()                                     # vllm_version 0.19: on
    assert not resolved(vllm_version="0.11.0")            # opt-in before 0.14
    assert resolved(vllm_version="0.11.0", async_scheduling=True)
    assert not resolved(async_scheduling=False)
    assert not resolved(device="cpu")                     # kvtwin's own engine is synchronous
    assert not resolved(batching="static")


def test_vllm_serve_flag_sets_the_switch():
    from sim.vllm.serve_flags import translate

    for flag, expected in (("--async-scheduling", True), ("--no-async-scheduling", False)):
        raw = translate(f"vllm serve Qwen/Qwen2.5-0.5B-Instruct {flag}", "h100-sxm").raw
        assert raw["engine"]["async_scheduling"] is expected
        assert validate_scenario(raw).async_scheduling is expected
    assert "async_scheduling" not in translate("vllm serve Qwen/Qwen2.5-0.5B-Instruct", "h100-sxm").raw.get("engine", {})


def test_an_engine_that_goes_idle_frees_its_finishers_at_once():
    # One request (prompt 8: 2 blocks, output 2). It emits its last token in step 1 and nothing
    # else waits or runs: vLLM has no step 2 to plan, so it processes step 1's outputs at once.
    # The pool must be whole right after finish_step (an idle engine holds no finished blocks),
    # while a second, longer request keeps the first one's release pending for one pass.
    sched, reqs, _ = run(True, [(8, 2)], num_blocks=5)
    assert not sched.pending_release and sched.num_running == 0
    assert sched.kv.pool.num_free == sched.kv.pool.usable_blocks
    kv = KVCacheManager(5, 4, enable_caching=False)
    sched = make_scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                                      async_scheduling=True), kv)
    for i, output in enumerate((2, 5)):
        sched.add(make_request(i, 0.0, [(100 + i, 4)], output))
    sched.finish_step(sched.schedule())
    sched.finish_step(sched.schedule())         # request 0 emits its last token here
    assert sched.pending_release and sched.num_running == 2


# -- arrivals: vLLM's busy loop takes new requests between loop turns -------------------------

def lagged_admission(async_scheduling, first_output=6):
    """Request 0 alone from step 0; request 1 added while step 1 is in flight (after schedule(),
    before finish_step). Returns (request 1's admit step, the steps each computed)."""
    kv = KVCacheManager(64, 4, enable_caching=False)
    sched = make_scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                                      async_scheduling=async_scheduling), kv)
    first, late = make_request(0, 0.0, [(100, 4)], first_output), make_request(1, 0.5, [(101, 4)], 2)
    sched.add(first)
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        if batch is None:
            break
        if batch.step == 1:
            sched.add(late)              # arrives while step 1 runs
        steps.append(sorted(r.id for r in batch.reqs))
        sched.finish_step(batch)
    sched.check_accounting()
    return late.admit_step, steps


def test_a_request_arriving_during_step_n_is_scheduled_in_n_plus_2():
    """vLLM 0.19 v1/engine/core.py: with async scheduling the busy loop (run_busy_loop: first
    _process_input_queue, then step_with_batch_queue) schedules step N+1 and launches it before
    blocking on step N's output (batch_queue_size 2), so the turn after step N plans N+2, and the
    requests that arrived while N ran are drained only at that turn. Synchronous: N+1."""
    assert lagged_admission(False)[0] == 2
    admit, steps = lagged_admission(True)
    assert admit == 3
    assert steps[2] == [0] and steps[3] == [0, 1]


def test_an_idle_or_empty_turn_takes_arrivals_at_once():
    """vLLM 0.19 v1/engine/core.py: an idle engine blocks on its input queue and schedules as soon
    as a request comes; a turn whose plan is empty (here request 0 ends at step 1, and the async
    scheduler knows it) appends an empty batch and the next turn, right after step 1's output,
    takes the new request: no extra step. The simulator's first request (t=0) is not delayed."""
    admit, steps = lagged_admission(True, first_output=2)
    assert admit == 2 and steps == [[0], [0], [1], [1]]
    kv = KVCacheManager(64, 4, enable_caching=False)
    sched = make_scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                                      async_scheduling=True), kv)
    req = make_request(0, 0.0, [(100, 4)], 1)
    sched.add(req)
    assert [r.id for r in sched.schedule().reqs] == [0]


def light_load(async_scheduling):
    """Two requests on an H100: the second arrives half-way through the first's first decode
    step (step 1). Returns (request 1's record, the steps' frame)."""
    from sim.records import requests_frame
    from sim.simulator import simulate

    scenario = validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm",
                                  "engine": {"max_model_len": 4096, "async_scheduling": async_scheduling},
                                  "workload": {"num_requests": 2}})
    probe, _, _ = simulate(scenario, [make_request(0, 0.0, [(1, 512)], 64)])
    start, end = probe.steps_frame()[["start_s", "end_s"]].iloc[1]
    late = (start + end) / 2
    records, _, _ = simulate(scenario, [make_request(0, 0.0, [(1, 512)], 64),
                                        make_request(1, late, [(2, 512)], 64)])
    return requests_frame(records).set_index("id").loc[1], records.steps_frame()


def test_the_simulator_admits_a_mid_step_arrival_one_step_later():
    """The simulator's driver shares the policy: under async scheduling (vLLM >= 0.14's default,
    v1/engine/core.py step_with_batch_queue) the request arriving during step 1 is admitted at
    step 3 instead of step 2, so its TTFT grows by step 2's duration."""
    sync, sync_steps = light_load(False)
    lagged, async_steps = light_load(True)
    assert sync["admitted_s"] == pytest.approx(sync_steps["start_s"].iloc[2])
    assert lagged["admitted_s"] == pytest.approx(async_steps["start_s"].iloc[3])
    step_2 = async_steps["end_s"].iloc[2] - async_steps["start_s"].iloc[2]
    assert lagged["ttft_s"] - sync["ttft_s"] == pytest.approx(step_2, rel=0.2)


def test_the_overlapped_pipeline_admits_as_vllm_does():
    """engine/pipeline.py: with overlap, step N+1 is launched before step() returns, so the
    requests added after it are what vLLM's next turn takes (N+2): the scheduler must not hold
    them once more; synchronous, the scheduler's hold gives the same N+2."""
    import numpy as np

    from engine.pipeline import StepPipeline
    from engine.runner import ModelRunner
    from engine.weights import build_model, init_random_weights
    from sim.core.catalog import get_model

    model = build_model(get_model("tiny"), "cpu")
    init_random_weights(model, seed=1, std=0.1)
    admitted = {}
    for overlap in (False, True):
        kv = KVCacheManager(24, 4, enable_caching=False, max_model_len=64)
        sched = make_scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                                          async_scheduling=True), kv)
        pipeline = StepPipeline(sched, ModelRunner(model, 24, 4, 64, seed=7), overlap=overlap)
        first, late = make_request(0, 0.0, [(100, 6)], 8), make_request(1, 0.0, [(101, 6)], 3)
        sched.add(first)
        done = pipeline.step()               # step 0 completed (overlap: step 1 already launched)
        last_launched = done.batch.step + len(pipeline.launched) - (0 if overlap else 1)
        sched.add(late)
        while pipeline.busy():
            pipeline.step()
        admitted[overlap] = (late.admit_step, last_launched)
        assert np.all([r.is_finished for r in (first, late)])
    # vLLM: a request arriving once step 0 is done, step 1 planned, is scheduled at step 2
    assert admitted[True][0] == admitted[False][0] == 2


def test_a_request_aborted_before_it_joins_waiting_never_runs():
    """A client that goes away while its request is still held for the next pass (the server's
    abort) leaves nothing behind: the request is not scheduled and the accounting holds."""
    kv = KVCacheManager(64, 4, enable_caching=False)
    sched = make_scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                                      async_scheduling=True), kv)
    first, gone = make_request(0, 0.0, [(100, 4)], 4), make_request(1, 0.0, [(101, 4)], 4)
    sched.add(first)
    batch = sched.schedule()
    sched.add(gone)
    sched.abort(gone)
    sched.finish_step(batch)
    while sched.has_unfinished():
        batch = sched.schedule()
        assert gone not in batch.reqs
        sched.finish_step(batch)
    assert gone.status is Status.ABORTED and first.status is Status.FINISHED
    sched.check_accounting()
