"""Sliding-window and hybrid (local + global) models in the simulated block pool.

The hybrid coordinator (sim/core/kv/coordinator.py) keeps one block table per KV cache group,
frees the blocks a sliding group's window left behind, and finds prefix hits per group as vLLM's
hybrid KV cache manager does. Hand-checked small cases first, then whole runs checked block for block against
sim/core/memory.py's arithmetic, then scenarios from imported config.json files.
"""
import random
from pathlib import Path

import pytest

from sim.core.kv import NULL_BLOCK, KVCacheManager, new_kv_manager
from sim.core.memory import (BlockPoolUnsupportedError, KVCacheGroups, blocks_for_tokens, check_block_pool_supports,
                             plan_memory, sliding_window_hit_blocks, sliding_window_skipped_blocks)
from sim.core.request import Status, make_request
from sim.core.scheduler import SchedulerConfig
from sim.core.scheduler_variants import make_scheduler
from sim.core.catalog import get_model
from sim.scenario import validate_scenario
from sim.records import requests_frame
from sim.simulator import simulate

HF = Path(__file__).parents[1] / "data" / "hf_configs"


def sliding_only(window):
    return KVCacheGroups(group_size=4, full_groups=0, sliding_groups=1, sliding_window=window)


def hybrid(window, full=1, sliding=1):
    return KVCacheGroups(group_size=4, full_groups=full, sliding_groups=sliding, sliding_window=window)


def scheduler(groups, num_blocks=64, block_size=4, caching=True, budget=64, seqs=8, lazy=True, **cfg):
    kv = new_kv_manager(num_blocks, block_size, caching, "paged", 256, groups=groups, max_num_batched_tokens=budget)
    config = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=256, lazy_decode=lazy,
                             **cfg)
    return make_scheduler(config, kv)


# ----------------------------------------------------------------------------- hand-checked

def test_a_window_of_two_blocks_holds_two_or_three_blocks_as_it_decodes():
    # blocks of 4, window 8 (two blocks); prompt 10, 10 outputs: one prefill step, then decodes
    # whose context before the step is c = 10..18. vLLM frees block i once c - 8 + 1 >= 4(i + 1)
    # and allocates a block when the token fed starts one (c % 4 == 0).
    sched = scheduler(sliding_only(8))
    req = make_request(0, 0.0, [(1, 10)], 10)
    sched.add(req)
    used, tables = [], []
    while sched.has_unfinished():
        batch = sched.schedule()
        used.append(sched.kv.num_used_blocks)
        tables.append(list(req.blocks))
        sched.kv.pool.check_invariants()
        sched.finish_step(batch)
    #        prefill c=10 c=11 c=12 c=13 c=14 c=15 c=16 c=17 c=18
    assert used == [3, 3, 2, 3, 3, 3, 2, 3, 3, 3]
    assert tables[2] == [NULL_BLOCK, 2, 3]             # block 0 freed when token 11 leaves it behind
    assert tables[-1][:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in tables[-1][2:]
    assert sched.kv.num_used_blocks == 0 and sched.kv.pool.num_free == 63
    assert sched.kv.coordinator.windowed_frees == 2


@pytest.mark.parametrize("sliding_first", [False, True])
def test_a_hybrid_request_holds_every_full_block_and_a_window_of_sliding_ones(sliding_first):
    # vLLM orders the groups by layer 0's type (Gemma, gpt-oss: sliding first); the first group allocates first
    sched = scheduler(KVCacheGroups(4, 1, 1, 8, sliding_first))
    req = make_request(0, 0.0, [(1, 10)], 10)
    sched.add(req)
    seen = []
    while sched.has_unfinished():
        batch = sched.schedule()
        full, slide = req.group_tables[::-1] if sliding_first else req.group_tables
        if batch.step == 0:
            assert req.group_tables[0] == [1, 2, 3] and req.group_tables[1] == [4, 5, 6]
        seen.append((len(full) - full.count(NULL_BLOCK), len(slide) - slide.count(NULL_BLOCK)))
        sched.kv.coordinator.check_request(req)
        sched.finish_step(batch)
    assert seen == [(3, 3), (3, 3), (3, 2), (4, 3), (4, 3), (4, 3), (4, 2), (5, 3), (5, 3), (5, 3)]


def test_a_long_prefill_chunk_holds_all_its_blocks_for_one_step():
    # vLLM frees behind the window from the tokens computed *before* the step, so a 40-token
    # prompt in one chunk holds 10 blocks during its step, then 2 (window 8: blocks 8, 9).
    sched = scheduler(sliding_only(8))
    req = make_request(0, 0.0, [(1, 40)], 3)
    sched.add(req)
    used = []
    while sched.has_unfinished():
        batch = sched.schedule()
        used.append(sched.kv.num_used_blocks)
        sched.finish_step(batch)
    assert used == [10, 3, 3]      # c=40: skipped (40-7)//4 = 8 blocks, the token fed starts block 10


def _compute(kv, req, n, hits=None):
    """Allocate and mark `n` more tokens computed (as the scheduler does), then check the pool."""
    hit_tokens = hits.num_blocks * kv.block_size if hits else 0
    assert kv.allocate_slots(req, n, hits)
    req.num_computed += hit_tokens + n
    kv.pool.check_invariants()


def test_a_sliding_group_hits_from_the_right_where_full_attention_stops_at_the_first_miss():
    # blocks of 4, window 9: a sliding hit needs cdiv(8, 4) = 2 consecutive cached blocks
    kv = KVCacheManager(7, 4, groups=sliding_only(9), max_num_batched_tokens=64)         # 6 usable blocks
    a = make_request(0, 0.0, [(1, 24)], 1)
    _compute(kv, a, 24)
    assert a.blocks == [1, 2, 3, 4, 5, 6]
    kv.remove_skipped_blocks(a)                                   # c=24: blocks 0-3 fall behind the window
    assert a.blocks == [NULL_BLOCK] * 4 + [5, 6]
    kv.free(a)                                                    # free queue, LRU first: 4 3 2 1 6 5
    assert list(kv.pool.free_queue) == [4, 3, 2, 1, 6, 5]
    filler = make_request(1, 0.0, [(2, 8)], 1)
    _compute(kv, filler, 8)                                       # evicts 4 and 3: prompt blocks 3 and 2
    b = make_request(2, 0.0, [(1, 24), (3, 4)], 1)                # a's prompt and 4 more tokens
    hits, tokens = kv.find_cached_prefix(b)
    assert tokens == 24 and hits.groups == [[NULL_BLOCK] * 4 + [5, 6]]   # blocks 4, 5: a window's worth
    full = KVCacheManager(7, 4)                                   # the same story with full attention
    fa = make_request(0, 0.0, [(1, 24)], 1)
    assert full.allocate_slots(fa, 24)
    fa.num_computed = 24
    full.free(fa)
    assert full.allocate_slots(make_request(1, 0.0, [(2, 8)], 1), 8)   # evicts the tail blocks 6 and 5
    assert full.find_cached_prefix(make_request(2, 0.0, [(1, 24), (3, 4)], 1))[1] == 16
    # b admitted on its hit: the two cached blocks revive (counted as taken from the free pool)
    assert kv.pool.num_free == 4
    _compute(kv, b, 4, hits)
    assert b.blocks == [NULL_BLOCK] * 4 + [5, 6, 2] and kv.pool.num_free == 1


@pytest.mark.parametrize("steps", range(8, 30))
def test_a_preempted_request_hits_the_private_blocks_its_window_left_behind(steps, monkeypatch):
    """A request's own output blocks stay out of the hash map (private, as with full attention),
    yet vLLM keeps the hash of every block a window frees: re-admitted after a preemption, the
    request's sliding hit may need one of those (window 14, blocks of 4: a run of 4 cached blocks,
    where it holds 3 of them at some steps). Mapped at the preemption if still free, they give the
    hits of a pool that maps every block (BlockPool) and of the simulator's (CountingBlockPool)."""
    from sim.core.fast.counting_pool import CountingBlockPool
    from sim.core.kv import BlockPool, HybridCoordinator

    def readmitted_hit(pool_class, private):
        monkeypatch.setattr(HybridCoordinator, "private_blocks", private)
        kv = new_kv_manager(64, 4, True, "paged", 256, groups=sliding_only(14), max_num_batched_tokens=64,
                            pool_class=pool_class)
        r = make_request(0, 0.0, [(1, 8)], 60)
        assert r.first_private_block(4) == 2
        _compute(kv, r, 8)
        r.num_output = 1
        for _ in range(steps):
            assert kv.append_slots(r, 1)
            r.num_computed += 1
            r.num_output += 1
        kv.free(r)                                     # preempted (the scheduler's order: free, then reset)
        r.num_computed, r.status, r.num_preemptions = 0, Status.PREEMPTED, 1
        kv.pool.check_invariants()
        return kv.find_cached_prefix(r)[1], kv.pool.num_cached_free

    public = readmitted_hit(BlockPool, False)
    assert readmitted_hit(BlockPool, True) == public
    assert readmitted_hit(CountingBlockPool, True) == public
    assert public[0] == (8 + steps) // 4 * 4          # every full block computed


def test_a_short_run_from_block_zero_is_a_hit_and_a_lone_tail_block_is_not():
    kv = KVCacheManager(7, 4, groups=sliding_only(9), max_num_batched_tokens=64)
    a = make_request(0, 0.0, [(1, 24)], 1)
    _compute(kv, a, 24)
    kv.free(a)                                          # no window pass: free queue 6 5 4 3 2 1
    assert list(kv.pool.free_queue) == [6, 5, 4, 3, 2, 1]
    _compute(kv, make_request(1, 0.0, [(2, 16)], 1), 16)     # evicts 6 5 4 3: prompt blocks 5 4 3 2
    hits, tokens = kv.find_cached_prefix(make_request(2, 0.0, [(1, 24), (3, 4)], 1))
    assert tokens == 8 and hits.groups == [[1, 2]]


def test_hybrid_hits_are_the_shorter_of_the_full_and_the_sliding_group():
    kv = KVCacheManager(20, 4, groups=hybrid(9), max_num_batched_tokens=64)
    a = make_request(0, 0.0, [(1, 24)], 1)
    _compute(kv, a, 24)
    full_blocks, sliding_blocks = (list(t) for t in a.group_tables)
    kv.remove_skipped_blocks(a)
    kv.free(a)
    # every group's blocks are cached under their own key: all 6 full, all 6 sliding (freed, kept)
    b = make_request(2, 0.0, [(1, 24), (3, 4)], 1)
    hits, tokens = kv.find_cached_prefix(b)
    assert tokens == 24
    assert hits.groups == [full_blocks, [NULL_BLOCK] * 4 + sliding_blocks[4:]]
    # lose the full group's block 3: the full hit stops at 3 blocks, the sliding scan runs within
    # it (blocks 1, 2 are cached) and the full hit is not cut further
    kv.pool.evict([full_blocks[3]])
    hits, tokens = kv.find_cached_prefix(make_request(3, 0.0, [(1, 24), (3, 4)], 1))
    assert tokens == 12 and hits.groups == [full_blocks[:3], [NULL_BLOCK] + sliding_blocks[1:3]]


def test_admission_counts_every_group_and_caps_the_sliding_ones():
    # 1 full + 2 sliding groups, blocks of 4, window 8, budget 8: a sliding group holds at most
    # cdiv(8 - 1 + 8, 4) + 1 = 5 blocks; a 40-token request needs 10 + 2 x 5 = 20 at most.
    kv = KVCacheManager(64, 4, groups=hybrid(8, full=1, sliding=2), max_num_batched_tokens=8)
    req = make_request(0, 0.0, [(1, 36)], 4)
    assert kv.coordinator.sliding_cap == 5 and kv.blocks_needed_at_most(req) == 20
    need, required = kv.coordinator._blocks_required(req, 8, [], gate_tokens=36, reserve_free=0, lookahead_tokens=0)
    assert (need, required) == (2, 9 + 2 * 5)       # gate: the whole prompt, sliding groups capped
    assert kv.allocate_slots(req, 8) and kv.num_used_blocks == 6


def test_contiguous_allocation_with_a_sliding_window_is_refused_by_name():
    check_block_pool_supports(get_model("mistral-7b-v0.1"), "paged")
    check_block_pool_supports(get_model("mixtral-8x7b"), "contiguous")
    with pytest.raises(BlockPoolUnsupportedError, match="engine.allocation"):
        check_block_pool_supports(get_model("mistral-7b-v0.1"), "contiguous")
    with pytest.raises(ValueError, match="paged"):
        new_kv_manager(10, 4, allocation="contiguous", groups=sliding_only(8), max_num_batched_tokens=8)
    assert type(new_kv_manager(10, 4, groups=KVCacheGroups(32, 1, 0, None))) is KVCacheManager


# ----------------------------------------------------------------------------- whole runs

def random_run(seed):
    rnd = random.Random(seed)
    bs = rnd.choice([1, 2, 4, 8])
    window = rnd.randint(2, 40)
    full, sliding = rnd.choice([(0, 1), (1, 1), (1, 2), (2, 3)])
    budget = rnd.randint(8, 96)
    groups = hybrid(window, full, sliding)
    sched = scheduler(groups, num_blocks=rnd.randint(20, 120), block_size=bs, caching=rnd.random() < 0.7,
                      budget=budget, seqs=rnd.randint(1, 8), policy=rnd.choice(["fcfs", "priority"]),
                      step_composition=rnd.choice(["mixed", "mixed", "prefill_first"]),
                      chunked_prefill=rnd.random() < 0.8, async_scheduling=rnd.random() < 0.3)
    reqs = [make_request(i, float(rnd.randint(0, 30)), ([(900 + rnd.randint(0, 1), 24)] if rnd.random() < 0.5 else [])
                         + [(i, rnd.randint(1, 60))], rnd.randint(1, 50), priority=rnd.randint(0, 2))
            for i in range(rnd.randint(2, 14))]
    return sched, reqs, groups


@pytest.mark.parametrize("seed", range(40))
def test_pool_use_over_whole_runs_follows_the_window_arithmetic(seed):
    """After every step (FCFS or priority, mixed or prefill_first, async scheduling or not), each
    running request holds exactly what memory.py says a request of its progress holds: cdiv(c + n, bs) blocks per full group, minus the blocks behind the window
    of the tokens computed before the step in each sliding group; never more than vLLM's
    per-request bound; and the pool's used blocks are the sum over running requests."""
    sched, reqs, groups = random_run(seed)
    kv, bs = sched.kv, sched.block_size
    last = {}                                    # request -> (context before its last step, tokens scheduled)
    tick = steps = 0
    while tick <= 30 or sched.has_unfinished():
        for r in reqs:
            if r.arrival == tick:
                sched.add(r)
        batch = sched.schedule()
        tick += 1
        if batch is None:
            continue
        for r, start, n in zip(batch.reqs, batch.starts(), batch.num_new):
            last[r] = (start, n)
        expected = 0
        for r in sched.running:
            c, n = last[r]
            blocks = blocks_for_tokens(c + n, bs)
            kept = blocks - sliding_window_skipped_blocks(c, bs, groups.sliding_window)
            held = groups.full_groups * blocks + groups.sliding_groups * kept
            assert kv.coordinator.held_blocks(r) == held, (seed, batch.step, r)
            assert held <= groups.blocks_per_request(r.max_len, bs, sched.config.max_num_batched_tokens)
            kv.coordinator.check_request(r)
            expected += held
        assert all(kv.coordinator.held_blocks(r) == 0 for r in reqs if r.status is not Status.RUNNING)
        shared = _shared_blocks(sched.running)
        assert kv.num_used_blocks == expected - shared
        kv.pool.check_invariants()
        sched.finish_step(batch)
        steps += 1
        assert steps < 5000
    sched.check_accounting()


def _shared_blocks(running):
    """Blocks referenced by more than one running request (prefix hits), counted once in the pool."""
    seen, dup = set(), 0
    for r in running:
        for t in r.group_tables or ():
            for b in t:
                if b == NULL_BLOCK:
                    continue
                if b in seen:
                    dup += 1
                seen.add(b)
    return dup


def scenario(model, max_model_len=8192, prompts=(3000, 7000), prefix=4500, **engine):
    doc = {"model": model, "device": "h100-sxm", "seed": 3,
           "engine": {"max_model_len": max_model_len, "max_num_batched_tokens": 2048, **engine},
           "workload": {"num_requests": 60, "arrival": {"process": "poisson", "rate": 30},
                        "prompt_len": {"dist": "uniform", "min": prompts[0], "max": prompts[1]},
                        "output_len": {"dist": "uniform", "min": 50, "max": 200},
                        "shared_prefix": {"groups": 1, "length": prefix, "fraction": 1.0}}}
    return validate_scenario(doc)


@pytest.mark.parametrize("model, num_blocks", [({"hf_config": str(HF / "lunahr__SystemGemma2-27b-it.json")}, 1400),
                                               ({"hf_config": str(HF / "openai__gpt-oss-20b.json")}, 1400),
                                               ("mistral-7b-v0.1", 900)], ids=["gemma2", "gpt-oss", "mistral"])
def test_imported_sliding_window_models_run_the_same_with_the_fast_paths_on_or_off(model, num_blocks):
    """A grouped KV cache runs the decode cohort and leaps while nobody waits: `fast` changes no step and no
    request, with hybrid groups (Gemma-2; gpt-oss, sliding first) and a window on every layer."""
    s = scenario(model, num_blocks=num_blocks)
    assert scheduler(hybrid(8), lazy=True).lazy
    fast, plan, _ = simulate(s, fast=True)
    slow, _, _ = simulate(s, fast=False)
    assert plan.kv_groups.sliding_groups
    a, b = fast.steps_frame(), slow.steps_frame()
    assert a.equals(b)
    assert requests_frame(fast).equals(requests_frame(slow))
    assert len(a) > 150 and a["kv_blocks_used"].max() <= plan.usable_blocks


def test_mistral_v01_holds_a_window_per_request_and_reuses_the_shared_prefixes_window():
    """Prompts of 10-14k tokens, past Mistral v0.1's 4096 window: no request ever holds more than
    vLLM's bound (window - 1 + budget, in blocks, + 1), so a pool of 1300 blocks runs several at
    once where full attention runs one; the prefix cache still hits on a 6000-token shared prefix
    (its last 256 blocks stay cached after the window moved past them). vLLM 0.20's admission cap
    (v1/core/single_type_kv_cache_manager.py _max_admission_blocks_per_request) lets 1299 // 385
    run; 0.19's gate asks every block of the prompt (625-875 here), so at most 2 start."""
    args = dict(max_model_len=16384, prompts=(10_000, 14_000), prefix=6000, num_blocks=1300)
    records, plan, _ = simulate(scenario("mistral-7b-v0.1", vllm_version="0.20", **args))
    steps = records.steps_frame()
    bound = plan.kv_groups.blocks_per_request(16384, 16, 2048)
    assert bound == (4095 + 2048 + 15) // 16 + 1 == 385
    assert steps["kv_blocks_used"].max() <= plan.usable_blocks
    assert steps["running"].max() >= 1299 // bound
    gated, _, _ = simulate(scenario("mistral-7b-v0.1", vllm_version="0.19", **args))
    assert gated.steps_frame()["running"].max() == 2
    full, _, _ = simulate(scenario({"base": "mistral-7b-v0.1", "sliding_window": None}, **args))
    assert full.steps_frame()["running"].max() == 1 and steps["running"].mean() > 2
    cached = requests_frame(records)["cached_tokens"]
    assert cached.max() == 6000


def test_a_static_batch_prefills_whole_prompts_so_its_window_bound_is_the_whole_sequence():
    """A static batch prefills each prompt whole, past the token budget, and a prefill holds all
    its blocks during its step: a request whose blocks exceed the pool is rejected with the
    reason, never admitted to wait forever; the rest run (here with prompts of 4-8k tokens over
    a budget of 2048)."""
    s = scenario("mistral-7b-v0.1", max_model_len=16384, prefix=1000, num_blocks=420, batching="static")
    assert s.max_step_tokens == s.max_model_len == 16384
    records, plan, _ = simulate(s)
    frame = requests_frame(records)
    rejected = frame[frame["status"] == "rejected"]
    assert len(rejected) and rejected["reject_reason"].str.contains("KV blocks at full length").all()
    finished = frame[frame["status"] == "finished"]
    assert len(finished) + len(rejected) == len(frame)
    assert finished["prompt_tokens"].max() > 2048


def test_the_memory_plan_of_imported_hybrids_sizes_the_pool_the_run_uses():
    for name in ("openai__gpt-oss-20b.json", "2point5p__krx-gemma2-9b-harvest.json"):
        s = scenario({"hf_config": str(HF / name)})
        plan = plan_memory(s)
        records, run_plan, _ = simulate(s)
        assert run_plan.num_blocks == plan.num_blocks
        assert records.steps_frame()["kv_blocks_used"].max() <= plan.usable_blocks


def test_the_engine_replay_refuses_a_hybrid_model_by_name():
    pytest.importorskip("torch")
    from engine.replay import EngineUnsupportedError, check_engine_supports

    check_engine_supports(validate_scenario({"model": "tiny", "device": "cpu"}))
    check_engine_supports(scenario("mistral-7b-v0.1"))            # one window on every layer: one group
    with pytest.raises(EngineUnsupportedError, match="sliding_window=4096.*one block table"):
        check_engine_supports(scenario({"hf_config": str(HF / "lunahr__SystemGemma2-27b-it.json")}))
    with pytest.raises(BlockPoolUnsupportedError, match="engine.allocation"):
        check_engine_supports(scenario("mistral-7b-v0.1", allocation="contiguous"))


HYBRID_LOGS = ["planner-google-gemma-2-27b-it--h100-80gb--tp1pp1dp1--8192",
               "planner-google-gemma-3-12b-it--h100-80gb--tp1pp1dp1--8192",
               "planner-openai-gpt-oss-20b--h100-80gb--tp2pp1dp1--8192"]


@pytest.mark.parametrize("log_id", HYBRID_LOGS)
def test_the_pool_vllm_logged_runs_its_printed_concurrency_of_full_length_requests(log_id):
    """vLLM's startup log for a hybrid model prints num_gpu_blocks and "Maximum concurrency for
    8192 tokens per request" (tests/data/vllm_public/startup_logs.yaml; the plan matches both,
    tests/core/test_models_memory.py). On that pool the simulated hybrid manager runs that many
    8192-token requests at once without a preemption, and its peak stays within the pool."""
    from test_models_memory import LOGS, scenario_for     # tests/ is on sys.path under pytest

    printed = LOGS[log_id]["printed"]
    s = scenario_for(log_id, printed["num_gpu_blocks"])
    n = int(printed["max_concurrency"])
    doc = s.model_dump(mode="json", exclude_none=True)
    doc["workload"] = {"num_requests": n, "arrival": {"process": "offline"},
                       "prompt_len": {"dist": "fixed", "value": 8192 - 512}, "output_len": {"dist": "fixed", "value": 512}}
    doc["engine"].update(prefix_caching=False, max_num_seqs=n)
    records, plan, _ = simulate(validate_scenario(doc))
    steps = records.steps_frame()
    assert plan.num_blocks == printed["num_gpu_blocks"] and n >= 2
    assert steps["running"].max() == n and steps["preemptions"].sum() == 0
    assert steps["kv_blocks_used"].max() <= plan.usable_blocks


def test_whatif_sliding_window_plans_the_same_pool_for_2_7_times_the_requests():
    from sim.scenario import load_scenario

    base = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "whatif_sliding_window.yaml")
    doc = base.model_dump(mode="json", exclude_none=True)
    window = plan_memory(base)
    full = plan_memory(validate_scenario({**doc, "model": {"base": "mistral-7b-v0.1", "sliding_window": None}}))
    assert window.num_blocks == full.num_blocks and window.block_bytes == full.block_bytes
    assert window.blocks_per_request(16384) == 385 and full.blocks_per_request(16384) == 1024
    assert window.max_concurrency(16384) / full.max_concurrency(16384) == pytest.approx(1024 / 385)


@pytest.mark.parametrize("backend, num_requests, output_len", [("torch", 4, 12), ("triton", 2, 4)])
def test_the_engine_replays_a_windowed_model_on_freed_blocks_with_the_same_logits(backend, num_requests, output_len):
    """A model whose every layer has a window (Mistral v0.1's case) runs on the engine with the
    shared policy's grouped manager: blocks behind the window are null in the tables the runner
    reads. Every step's logits equal those of the same schedule on full-attention tables (the
    kernels mask the window), with fewer blocks held; prefix hits take only the window's blocks."""
    pytest.importorskip("torch")
    from engine.runner import ModelRunner
    from engine.weights import build_model, init_random_weights

    spec = get_model("tiny").model_copy(update={"sliding_window": 8})
    model = build_model(spec, "cpu", backend)
    init_random_weights(model, seed=4, std=0.1)

    def run(kv):
        runner = ModelRunner(model, kv.pool.num_blocks, 4, 128)
        sched = make_scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128), kv)
        for i in range(num_requests):
            sched.add(make_request(i, 0.0, [(7, 20), (10 + i, 5 + 3 * i)], output_len))
        logits, peak = [], 0
        while sched.has_unfinished():
            batch = sched.schedule()
            logits.append(runner.execute(batch).logits)
            peak = max(peak, kv.num_used_blocks)
            sched.finish_step(batch)
        return logits, peak, kv.stats.hits

    windowed = new_kv_manager(64, 4, True, groups=KVCacheGroups(2, 0, 1, 8), max_num_batched_tokens=16)
    ours, peak, hits = run(windowed)
    full, full_peak, full_hits = run(KVCacheManager(64, 4, True))
    assert len(ours) == len(full) > output_len and hits == full_hits > 0
    for a, b in zip(ours, full):
        assert torch_equal(a, b)
    assert windowed.coordinator.windowed_frees > 0 and peak < full_peak


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# vLLM's own unit-test cases for the sliding-window manager, expected values theirs:
# https://github.com/vllm-project/vllm/blob/00b08dc44519a82cbdd9061d92d1226985094622/tests/v1/core/test_single_type_kv_cache_manager.py
# (test_sliding_window_possible_cached_prefix, test_sliding_window_remove_skipped_blocks; block 2, window 4)
T, F = True, False


@pytest.mark.parametrize("cached, expected", [
    ([F] * 10, 0), ([T], 1), ([T, F], 1), ([T, T], 2), ([T, T, F], 2), ([T, T, T], 3), ([T, T, T, F], 3),
    ([T, T, F, T, F, F, T, T, F, T, T, T], 12), ([T, T, F, T, F, F, T, T, F, F, F], 8),
    ([T, T, F, T, F, F, T, T, F, F, F, T], 8)])
def test_sliding_hits_as_vllms_own_cases(cached, expected):
    assert sliding_window_hit_blocks(cached, 2, 4) == expected
    # and through the pool: the hit's last two blocks are the cached ones, the rest null
    kv = KVCacheManager(40, 2, groups=sliding_only(4), max_num_batched_tokens=8)
    req = make_request(0, 0.0, [(5, 2 * len(cached) + 1)], 1)
    req.extend_block_hashes(len(cached), 2)
    for i, hit in enumerate(cached):
        if hit:
            kv.pool.cache_block(10 + i, req.block_hashes[i])
    hits, tokens = kv.find_cached_prefix(req)
    assert tokens == 2 * expected
    if expected:
        table = hits.groups[0]
        tail = min(expected, 2)
        assert table[:expected - tail] == [NULL_BLOCK] * (expected - tail)
        assert table[expected - tail:] == [10 + i for i in range(expected - tail, expected)]


def test_window_frees_as_vllms_own_case():
    kv = KVCacheManager(20, 2, False, groups=sliding_only(4), max_num_batched_tokens=8)
    req = make_request(0, 0.0, [(5, 22)], 1)
    assert kv.allocate_slots(req, 22)
    first = list(req.blocks)                       # 11 blocks
    kept = {0: first, 4: first, 5: [0] + first[1:], 6: [0] + first[1:], 7: [0, 0] + first[2:],
            11: [0] * 4 + first[4:]}
    for computed, table in kept.items():
        req.num_computed = computed
        kv.remove_skipped_blocks(req)
        assert req.blocks == table, computed
    assert list(kv.pool.free_queue)[-4:] == [first[0], first[1], first[3], first[2]]   # 1003 before 1002


def test_the_c_speed_window_searches_equal_the_plain_scans():
    """`sliding_window_hit_run` searches the cached flags as bytes and `remove_skipped_blocks`
    slices a prefill chunk's run; both equal the plain right-to-left scans vLLM writes."""
    from sim.core.kv import SlidingWindowManager
    from sim.core.memory import sliding_window_hit_run

    def hit_scan(cached, block_size, window):
        need, run = blocks_for_tokens(window - 1, block_size), 0
        for i in range(len(cached) - 1, -1, -1):
            run = run + 1 if cached[i] else 0
            if cached[i] and run >= need:
                return i, i + run
        return 0, run

    def remove_scan(table, skipped):
        removed, i = [], skipped - 1
        while i >= 0 and table[i] != NULL_BLOCK:
            removed.append(table[i])
            table[i] = NULL_BLOCK
            i -= 1
        return removed

    rnd = random.Random(26)
    manager = SlidingWindowManager(0, 8, 4)
    for _ in range(3000):
        cached = [rnd.random() < 0.7 for _ in range(rnd.randint(0, 14))]
        block_size, window = rnd.randint(1, 5), rnd.randint(1, 20)
        assert sliding_window_hit_run(cached, block_size, window) == hit_scan(cached, block_size, window)
        table = [rnd.choice([NULL_BLOCK, rnd.randint(1, 99)]) for _ in range(rnd.randint(0, 12))]
        skipped = rnd.randint(0, len(table))
        expected = list(table)
        assert manager.remove_skipped_blocks(table, skipped) == remove_scan(expected, skipped)
        assert table == expected


@pytest.mark.parametrize("counting", [False, True])
@pytest.mark.parametrize("groups", [sliding_only(9), hybrid(9), hybrid(9, full=1, sliding=2)])
def test_a_stretch_of_window_frees_in_one_call_is_the_calls_step_by_step(counting, groups):
    """`free_behind_windows` over several steps (the decode cohort's stretch: members' contexts
    `ahead` tokens past their num_computed) frees, records and counts what one call a step does,
    a member freeing at two steps of one call included; with `gains`, the pool's free and
    cached-free blocks gained by the end of each step. With `clock` (a cohort's members: their
    contexts read as `cohort_computed + clock`) it is the same call: what the preempted requests'
    windows freed is mapped alike."""
    from sim.core.fast.counting_pool import CountingBlockPool
    pool_class = CountingBlockPool if counting else KVCacheManager.__init__.__kwdefaults__["pool_class"]

    def run(stretch: bool, clock=None):
        kv = KVCacheManager(128, 4, groups=groups, max_num_batched_tokens=64, pool_class=pool_class)
        # a shared prefix, then its own (private: what the windows free of it is mapped at the preemption)
        a = make_request(0, 0.0, [(1, 8), (2, 40)], 30, own_prompt_tokens=40)
        b = make_request(1, 0.0, [(1, 8), (3, 30)], 30, own_prompt_tokens=30)
        for req in (a, b):
            _compute(kv, req, req.prompt_len)
        steps = [((a, b), 0), ((), 1), ((b,), 4), ((a, b), 8)]      # contexts: +0, +1, +4, +8 tokens
        gains = ([], [])
        if clock is not None:              # as a cohort holds them: offsets from its clock
            for req in (a, b):
                req.cohort_computed = req.num_computed - clock
                req.num_computed = -10**6          # (must not be read)
        if stretch:
            kv.free_behind_windows(steps, gains, clock=clock)
            if clock is not None:
                for req in (a, b):
                    req.num_computed = req.cohort_computed + clock
        else:
            free0, cached0 = kv.pool.num_free, kv.pool.num_cached_free
            for reqs, ahead in steps:
                for req in (a, b):
                    req.num_computed += ahead
                kv.free_behind_windows([(reqs, 0)])
                for req in (a, b):
                    req.num_computed -= ahead
                gains[0].append(kv.pool.num_free - free0)
                gains[1].append(kv.pool.num_cached_free - cached0)
        kv.pool.check_invariants()
        for req in (a, b):
            req.status = Status.PREEMPTED                               # (its window frees are published)
            kv.free(req)
        kv.pool.check_invariants()
        return gains, list(kv.pool.free_queue), dict(kv.pool.cached), kv.coordinator.windowed_frees

    stepwise = run(False)
    assert stepwise == run(True)
    assert stepwise == run(True, clock=37)
    assert stepwise[0][0][-1] > stepwise[0][0][0] > 0 and stepwise[3] > 0


@pytest.mark.parametrize("stretch", [False, True], ids=["step-by-step", "stretch"])
@pytest.mark.parametrize("join_order", [(0, 1, 2), (2, 0, 1)], ids=["in-running-order", "out-of-order"])
def test_a_cohort_frees_behind_its_windows_in_running_order_whatever_order_its_members_joined(join_order, stretch):
    """At a step, the blocks a decode cohort's members leave behind their windows join the free
    queue in the running list's order: vLLM 0.19's Scheduler.schedule walks `self.running` in order
    (vllm/v1/core/sched/scheduler.py) and KVCacheManager.allocate_slots frees each request's blocks
    behind its window first (`coordinator.remove_skipped_blocks`, vllm/v1/core/kv_cache_manager.py).
    A phase group keeps its members in the order they joined, which is that order unless one joined
    behind a member admitted after it: then the group is sorted."""
    sched = scheduler(hybrid(8), num_blocks=64, block_size=4)       # a window of 2 blocks of 4 tokens
    kv, cohort = sched.kv, sched.cohort
    reqs = [make_request(i, 0.0, [(10 + i, 12)], 40) for i in range(3)]
    for seq, req in enumerate(reqs, 1):
        req.run_seq = seq
        _compute(kv, req, 12)
        req.num_output = 1                 # (its prefill emitted its first token)
    cohort.sync(0)
    for i in join_order:
        cohort.join(reqs[i], 0)            # one phase: each frees a block at the same steps
    sliding = kv.coordinator.sliding_ids[0]
    held = [list(req.group_tables[sliding]) for req in reqs]
    if stretch:                            # (a leap's four steps at once)
        cohort.advance_grouped(1, 4, kv)
    else:                                  # its first step frees what the prefill left behind, the 4th the next block
        for step in range(1, 5):
            cohort.advance(step, kv)
    assert [req.group_tables[sliding][:2] for req in reqs] == [[NULL_BLOCK] * 2] * 3
    assert kv.pool.free_queue[-6:] == [table[0] for table in held] + [table[1] for table in held]


def test_the_decode_cohort_keeps_its_attributes_where_cpython_reads_them_fastest():
    """CPython 3.11 caps a class's shared instance keys (SHARED_KEYS_MAX_SIZE, Objects/dictobject.c):
    under this project's 3.11.7 an instance with 30 attributes or more reads each `self.` attribute
    ~18 instructions dearer than with 29 (valgrind, a loop of reads), and a 30th attribute on
    DecodeCohort cost 13.7M more instructions on bench/instructions.py's mistral-sliding line (+3 %).
    A new attribute must replace one, or go where it is read (the layout, a member)."""
    sched = scheduler(hybrid(8), num_blocks=64, block_size=4)
    assert sched.cohort.window is not None
    assert len(vars(sched.cohort)) < 30
