"""Batching policies as specifications: the primer's two-slot example, vLLM's rules, and invariants."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.kv import KVCacheManager
from sim.core.request import Status, make_request
from sim.core.scheduler import SchedulerConfig
from sim.core.scheduler_variants import make_scheduler


def make(num_blocks=1000, block_size=16, caching=True, allocation="paged", **cfg):
    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 256)
    cfg.setdefault("max_model_len", 4096)
    kv = KVCacheManager(num_blocks, block_size, caching, allocation, cfg["max_model_len"])
    return make_scheduler(SchedulerConfig(**cfg), kv)


def drive(sched, max_steps=100_000):
    """Run to completion; returns a snapshot per step."""
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None, "work remains but nothing could be scheduled"
        bs = sched.block_size
        assert sched.slack_tokens == sum(len(r.blocks) * bs - r.num_computed for r in sched.running) >= 0
        assert list(sched.active) == [r for r in sched.running if r.cohort is None]
        assert batch.num_decode == len(batch.decodes) + batch.pad_rows     # (a count kept as they change)
        steps.append(dict(n=len(batch), tokens=batch.num_tokens, decode=batch.num_decode,
                          prefill=batch.num_prefill_tokens, running=sched.num_running,
                          admitted=len(batch.admitted), preempted=len(batch.preempted)))
        sched.finish_step(batch)
        steps[-1]["running_after"] = sched.num_running
        assert len(steps) < max_steps
    sched.check_accounting()
    return steps


def seed_example(batching):
    s = make(max_num_seqs=2, batching=batching)
    for i, out in enumerate([10, 500, 10, 500]):
        s.add(make_request(i, 0.0, [(100 + i, 20)], out))
    return drive(s)


def test_seed_static_vs_continuous_step_counts():
    static, continuous = len(seed_example("static")), len(seed_example("continuous"))
    assert 995 <= static <= 1005        # two batches, each as long as its 500-token member
    assert 515 <= continuous <= 525     # short requests leave, the next joins at once
    assert static / continuous > 1.9


def test_static_admits_only_into_an_empty_batch():
    steps = seed_example("static")
    admissions = [i for i, s in enumerate(steps) if s["admitted"]]
    assert len(admissions) == 2 and all(steps[i - 1]["running_after"] == 0 for i in admissions[1:])
    # while the long member runs alone, the finished short member's slot stays empty
    assert all(s["running"] == 1 for s in steps[20:400])


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    s = make(max_num_batched_tokens=64)
    s.add(make_request(0, 0.0, [(1, 200)], 2))
    steps = drive(s)
    assert [st["prefill"] for st in steps[:4]] == [64, 64, 64, 8]
    assert steps[3]["tokens"] == 8 and steps[4]["decode"] == 1


def test_decodes_and_prefill_chunks_share_a_step_in_mixed_mode():
    s = make(max_num_batched_tokens=64)
    s.add(make_request(0, 0.0, [(1, 10)], 50))
    s.add(make_request(1, 0.0, [(2, 300)], 2))
    steps = drive(s)
    assert any(st["decode"] and st["prefill"] for st in steps)
    assert all(st["tokens"] <= 64 for st in steps)


def test_prefill_first_never_mixes():
    s = make(max_num_batched_tokens=512, step_composition="prefill_first")
    for i in range(6):
        s.add(make_request(i, 0.0, [(i, 100)], 20))
    steps = drive(s)
    assert all(not (st["decode"] and st["prefill"]) for st in steps)
    assert steps[0]["prefill"] == 500  # 5 whole prompts fit the budget, the 6th waits


def test_prompt_over_max_model_len_is_rejected_with_a_reason():
    s = make(max_model_len=128)
    r = make_request(0, 0.0, [(1, 100)], 50)
    assert not s.add(r)
    assert r.status is Status.REJECTED and "exceeds max_model_len 128" in r.reject_reason
    s.check_accounting()


def test_request_larger_than_the_pool_is_rejected_not_looped_forever():
    s = make(num_blocks=5)  # 4 usable blocks = 64 tokens
    r = make_request(0, 0.0, [(1, 60)], 10)
    assert not s.add(r) and "pool has 4 usable blocks" in r.reject_reason


def test_preemption_under_a_tiny_pool_makes_progress_and_finishes_everything():
    s = make(num_blocks=12, max_num_seqs=8)    # 11 usable blocks
    reqs = [make_request(i, 0.0, [(i, 30)], 60) for i in range(6)]
    for r in reqs:
        s.add(r)
    steps = drive(s)
    assert s.num_preemptions > 0
    assert all(r.status is Status.FINISHED and r.num_output == 60 for r in reqs)
    assert all(not st["admitted"] for st in steps if st["preempted"])  # no admission in a preempting step
    assert s.kv.num_used_blocks == 0


def test_fcfs_preempts_the_last_admitted_and_requeues_it_first():
    s = make(num_blocks=7, max_num_seqs=4, caching=False)   # 6 usable blocks
    a, b = make_request(0, 0.0, [(1, 40)], 40), make_request(1, 1.0, [(2, 40)], 40)
    s.add(a), s.add(b)
    while not (a.num_preemptions or b.num_preemptions):
        s.finish_step(s.schedule())
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert s.waiting.peek() is b and b.num_computed == 0


def test_priority_policy_preempts_the_lowest_priority():
    s = make(num_blocks=7, max_num_seqs=4, caching=False, policy="priority")
    low = make_request(0, 0.0, [(1, 40)], 40, priority=5)
    high = make_request(1, 1.0, [(2, 40)], 40, priority=0)
    s.add(low), s.add(high)
    drive(s)
    assert low.num_preemptions >= 1 and high.num_preemptions == 0


def test_priority_policy_admits_high_priority_first():
    s = make(max_num_seqs=1, policy="priority")
    late_high = make_request(1, 5.0, [(2, 10)], 2, priority=0)
    early_low = make_request(0, 0.0, [(1, 10)], 2, priority=1)
    s.add(early_low), s.add(late_high)
    batch = s.schedule()
    assert batch.reqs == [late_high]


def test_prefix_hits_cut_prefill_and_are_counted_once_per_request():
    s = make()
    shared = (999, 64)
    s.add(make_request(0, 0.0, [shared, (1, 10)], 3))
    drive(s)
    second = make_request(1, 0.0, [shared, (2, 10)], 3)
    s.add(second)
    batch = s.schedule()
    assert batch.num_prefill_tokens == 10 and second.num_cached_tokens == 64
    drive(s)
    assert (s.kv.stats.queries, s.kv.stats.hits) == (74 + 74, 64)


def test_watermark_keeps_blocks_free_at_admission():
    s = make(num_blocks=101, admission_watermark=0.1, max_num_seqs=100, caching=False,
             max_num_batched_tokens=4096)
    for i in range(30):
        s.add(make_request(i, 0.0, [(i, 64)], 2))   # 4 blocks each
    batch = s.schedule()
    assert len(batch.admitted) == 22 and s.kv.pool.num_free == 12   # 100 - 22 x 4 >= 10


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 80), st.integers(0, 3)), min_size=1, max_size=25),
    num_blocks=st.integers(12, 200),
    block_size=st.sampled_from([1, 4, 16, 32]),
    max_num_seqs=st.integers(1, 16),
    budget=st.integers(16, 512),
    batching=st.sampled_from(["continuous", "static"]),
    composition=st.sampled_from(["mixed", "prefill_first"]),
    allocation=st.sampled_from(["paged", "contiguous"]),
    chunked=st.booleans(),
)
def test_budget_and_seq_limits_hold_and_no_request_is_lost(lens, num_blocks, block_size, max_num_seqs,
                                                          budget, batching, composition, allocation, chunked):
    if batching == "static":
        composition = "mixed"
    budget = max(budget, max_num_seqs)
    s = make(num_blocks, block_size, True, allocation, max_num_seqs=max_num_seqs,
             max_num_batched_tokens=budget, max_model_len=400, batching=batching,
             step_composition=composition, chunked_prefill=chunked)
    reqs = [make_request(i, 0.0, [(g, p)], o) for i, (p, o, g) in enumerate(lens)]
    for r in reqs:
        s.add(r)
    for st_ in drive(s):
        assert st_["n"] <= max_num_seqs and st_["running"] <= max_num_seqs
        assert st_["tokens"] <= budget or batching == "static"     # a static batch is one padded forward
    for r in reqs:
        assert r.status in (Status.FINISHED, Status.REJECTED)
        assert (r.status is Status.FINISHED) == (r.num_output == r.output_len)
    assert s.kv.num_used_blocks == 0


def test_slack_counts_unfilled_slots_of_running_requests():
    s = make(caching=False)
    for i, n in enumerate([35, 17, 64]):            # docs/primer.md: 13 + 15 + 0 unused slots
        s.add(make_request(i, 0.0, [(i, n)], 1))
    s.schedule()
    assert s.kv.num_used_blocks == 9 and s.slack_tokens == 28


def test_slack_with_shared_blocks_and_contiguous_reservation():
    s = make(caching=True)
    s.add(make_request(0, 0.0, [(5, 40)], 30))
    s.finish_step(s.schedule())
    s.add(make_request(1, 0.0, [(5, 40)], 30))     # hits the first 32 tokens
    s.schedule()
    expected = sum(len(r.blocks) * 16 - r.num_computed for r in s.running)
    assert s.slack_tokens == expected
    c = make(caching=False, allocation="contiguous", max_model_len=256)
    c.add(make_request(0, 0.0, [(1, 20)], 5))
    c.schedule()
    assert c.slack_tokens == 256 - 20


@settings(max_examples=80, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 200), st.integers(1, 60), st.integers(0, 2),
                            st.integers(0, 2)), min_size=1, max_size=20),
    num_blocks=st.integers(10, 120),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 12),
    budget=st.integers(12, 300),
    batching=st.sampled_from(["continuous", "static"]),
    allocation=st.sampled_from(["paged", "contiguous"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    caching=st.booleans(),
)
def test_decode_cohort_matches_the_one_by_one_loop(reqs, num_blocks, block_size, max_num_seqs, budget,
                                                   batching, allocation, policy, chunked, caching):
    """The O(1)-per-step cohort is an optimisation: every step and every request come out the same."""
    budget = max(budget, max_num_seqs)

    def build(lazy):
        s = make(num_blocks, block_size, caching, allocation, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=budget, max_model_len=300, batching=batching, policy=policy,
                 chunked_prefill=chunked, lazy_decode=lazy)
        return s, [make_request(i, float(at), [(900 + g, 32), (i, p)], o, priority=pr)
                   for i, (at, p, o, g, pr) in enumerate(reqs)]

    (lazy, lazy_reqs), (exact, exact_reqs) = build(True), build(False)
    step = 0
    while True:
        for s, rs in ((lazy, lazy_reqs), (exact, exact_reqs)):
            for r in rs:
                if r.arrival == step:
                    s.add(r)
        if not (lazy.has_unfinished() or exact.has_unfinished()) and step > 30:
            break
        a, b = lazy.schedule(), exact.schedule()
        assert (a is None) == (b is None)
        if a is not None:
            shape = lambda x: (x.num_decode, x.decode_ctx, x.num_prefill_tokens, x.prefill_ctx,  # noqa: E731
                               x.prefill_attn, x.blocks_read, len(x.preempted), len(x.admitted))
            assert shape(a) == shape(b), f"step {step}"
            assert (lazy.kv.num_used_blocks, lazy.slack_tokens) == (exact.kv.num_used_blocks, exact.slack_tokens)
            assert list(lazy.active) == [r for r in lazy.running if r.cohort is None]
            lazy.finish_step(a)
            exact.finish_step(b)
        step += 1
        assert step < 20_000
    fields = ("status", "num_output", "num_computed", "first_token_step", "finish_step", "emit_runs",
              "chunk_steps", "num_preemptions", "num_cached_tokens", "admit_step")
    for x, y in zip(lazy_reqs, exact_reqs):
        assert [getattr(x, f) for f in fields] == [getattr(y, f) for f in fields]


@pytest.mark.parametrize("num_blocks, policy", [(40, "fcfs"), (40, "priority"), (400, "fcfs")])
def test_decode_cohort_is_used_and_exact_under_pressure(num_blocks, policy):
    """A fixed workload where the cohort carries most steps and the small pool forces preemptions."""
    def run(lazy):
        s = make(num_blocks, 4, True, max_num_seqs=8, max_num_batched_tokens=64, policy=policy, lazy_decode=lazy)
        reqs = [make_request(i, 0.0, [(7, 12), (i, 5 + 3 * (i % 4))], 20 + 7 * (i % 5), priority=i % 3)
                for i in range(24)]
        for r in reqs:
            s.add(r)
        shapes, cohort_steps = [], 0
        while s.has_unfinished():
            b = s.schedule()
            cohort_steps += b.cohort_size > 0
            shapes.append((b.num_decode, b.decode_ctx, b.num_prefill_tokens, b.blocks_read, len(b.preempted),
                           s.kv.num_used_blocks, s.slack_tokens))
            s.finish_step(b)
        return shapes, cohort_steps, s.num_preemptions, [(r.emit_runs, r.num_cached_tokens) for r in reqs]

    lazy, exact = run(True), run(False)
    assert lazy[0] == exact[0] and lazy[2:] == exact[2:]
    assert lazy[1] > len(lazy[0]) // 2            # the cohort carried most steps
    assert (lazy[2] > 0) == (num_blocks == 40)     # the small pool preempts


def test_a_one_token_recompute_chunk_is_not_a_decode():
    """A resumed request whose recompute chunk is cut to 1 token by the budget
    must not emit a token (it has not recomputed its context yet) nor join the cohort.
    Minimal case found by differential fuzzing."""
    s = make(num_blocks=6, block_size=4, caching=False, max_num_seqs=3, max_num_batched_tokens=7,
             max_model_len=64)
    reqs = [make_request(0, 0.0, [(1, 8)], 8), make_request(1, 0.0, [(1, 1)], 8),
            make_request(2, 0.0, [(0, 3)], 8)]
    for r in reqs:
        s.add(r)
    chunks_of_one = 0
    while s.has_unfinished():
        batch = s.schedule()
        for r in batch.decodes:
            assert r.num_computed == r.num_tokens, f"step {batch.step}: {r} booked as a decode"
        chunks_of_one += sum(1 for r, n in zip(batch.prefills, batch.prefill_new) if n == 1 and r.num_output)
        s.finish_step(batch)
    assert chunks_of_one >= 1                      # the case really has such a chunk
    assert all(r.num_output == r.output_len and r.status is Status.FINISHED for r in reqs)


def test_watermark_is_skipped_when_nothing_runs():
    """A request that fits the pool but not pool - watermark starts when the
    engine is empty (vLLM skips the watermark then), instead of waiting forever."""
    s = make(num_blocks=101, admission_watermark=0.1, caching=False, max_num_batched_tokens=2048,
             max_model_len=2048)
    big, small = make_request(0, 0.0, [(1, 95 * 16)], 2), make_request(1, 0.0, [(2, 16)], 2)
    s.add(big), s.add(small)
    batch = s.schedule()
    assert batch is not None and batch.admitted == [big]
    assert s.kv.pool.num_free == 5            # the watermark (10 blocks) holds against the second request
    drive(s)
    assert big.status is Status.FINISHED and small.status is Status.FINISHED


def test_static_batch_costs_the_padded_batch_hf_generate_computes():
    """A static batch prefills all prompts in one padded [B, P] forward (no
    budget, no chunks) and computes all B rows, at P + k positions, until its longest member ends."""
    s = make(max_num_seqs=2, batching="static", max_num_batched_tokens=64)
    short, long_ = make_request(0, 0.0, [(1, 20)], 10), make_request(1, 0.0, [(2, 100)], 50)
    s.add(short), s.add(long_)
    first = s.schedule()
    assert first.admitted == [short, long_] and first.num_prefill_tokens == 2 * 100
    assert first.prefill_attn == 2 * (100 * 101 // 2) and first.blocks_read == 2 * 7
    s.finish_step(first)
    for k in range(1, 50):
        batch = s.schedule()
        assert batch.num_decode == 2 and batch.num_seqs == 2, k      # the finished row is still computed
        assert batch.decode_ctx == 2 * (100 + k) and batch.blocks_read == 2 * -(-(100 + k) // 16)
        assert batch.pad_rows == (1 if short.status is Status.FINISHED else 0)
        s.finish_step(batch)
    assert short.finish_step == 9 and long_.finish_step == 49 and not s.has_unfinished()
    assert s.kv.num_used_blocks == 0 and s.tokens_held == 0
