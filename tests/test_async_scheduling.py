"""vLLM's async scheduling in the shared policy: finished requests leave RUNNING one step late.

vLLM plans step N+1 while step N runs and processes step N's outputs after that, so a request
that emits its last token in step N still holds its KV blocks and its max_num_seqs seat while
step N+1 is planned (it is not computed in N+1: vLLM knows it reached max_tokens). Each case
below is small enough to follow by hand; the expected steps are worked out in the comments.
"""
from sim.core.kvcache import KVCacheManager
from sim.core.request import Status, make_request
from sim.core.scheduler import Scheduler, SchedulerConfig
from sim.scenario import validate_scenario


def run(async_scheduling, requests, num_blocks=64, max_num_seqs=8, block_size=4):
    """All requests at t=0, in order; (scheduler, requests, per step the ids it computed and the
    running count right after it was planned)."""
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=256,
                             async_scheduling=async_scheduling)
    sched = Scheduler(config, kv)
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
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                                      async_scheduling=True), kv)
    for i, output in enumerate((2, 5)):
        sched.add(make_request(i, 0.0, [(100 + i, 4)], output))
    sched.finish_step(sched.schedule())
    sched.finish_step(sched.schedule())         # request 0 emits its last token here
    assert sched.pending_release and sched.num_running == 2
