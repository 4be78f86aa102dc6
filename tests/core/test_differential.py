"""Differential fuzz: the fast paths of the policy against the one-by-one loop.

Each seed draws a small random scenario (pool, block size, limits, policy, composition,
chunking, caching, arrivals, shared prefixes, priorities; async scheduling on for odd seeds) and drives two schedulers side by
side: one with the decode cohort, one forced one by one. After every step they must agree
on the step's composition, every request's state and blocks, and the pool's free queue in
LRU order and its prefix-cache map. Small scenarios keep a few hundred seeds cheap.
"""
import random

import pytest

from sim.core.fast.counting_pool import CountingBlockPool
from sim.core.kv import (CACHED, EMPTY, PRIVATE, BlockPool, HybridCoordinator, KVCacheManager, UnitaryCoordinator,
                         new_kv_manager)
from sim.core.memory import KVCacheGroups
from sim.core.request import make_request
from sim.core.scheduler import SchedulerConfig
from sim.core.scheduler_variants import make_scheduler

SEEDS = range(300)


def random_case(seed):
    rnd = random.Random(seed)
    batching = rnd.choice(["continuous", "continuous", "continuous", "static"])
    max_num_seqs = rnd.randint(1, 8)
    case = dict(
        num_blocks=rnd.randint(6, 60), block_size=rnd.choice([1, 2, 4, 8, 16]),
        caching=rnd.random() < 0.6, allocation=rnd.choice(["paged"] * 4 + ["contiguous"]),
        config=dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_num_seqs, rnd.randint(4, 200)),
                    max_model_len=256, batching=batching, chunked_prefill=rnd.random() < 0.7,
                    policy=rnd.choice(["fcfs", "priority"]),
                    step_composition=rnd.choice(["mixed", "prefill_first"]),
                    admission_watermark=rnd.choice([0.0, 0.0, 0.05]),
                    async_scheduling=seed % 2 == 1),         # vLLM's one-step lag in retiring finishers
        requests=[(rnd.randint(0, 40), rnd.choice([0, 0, 16, 48]), rnd.randint(1, 60), rnd.randint(1, 50),
                   rnd.randint(0, 2), rnd.randint(0, 2)) for _ in range(rnd.randint(1, 14))])
    return case


def with_sliding_windows(case, seed):
    """The case on a grouped KV cache (the hybrid coordinator, sim/core/kv/coordinator.py): a
    sliding window of a few blocks, alone or beside full-attention groups, in either order; paged,
    as vLLM requires."""
    rnd = random.Random(seed + 10_000)
    full, sliding = rnd.choice([(0, 1), (1, 1), (1, 2), (2, 1)])
    window = rnd.randint(1, 5 * case["block_size"] + 3)
    return dict(case, allocation="paged", num_blocks=case["num_blocks"] * (full + sliding),
                groups=KVCacheGroups(4, full, sliding, window, rnd.random() < 0.5))


def max_step_tokens(config):
    """The most tokens a request computes in one step (a static batch prefills whole prompts)."""
    return config["max_model_len"] if config["batching"] == "static" else config["max_num_batched_tokens"]


def build(case, lazy, block_ids=True):
    if case.get("groups"):
        kv = new_kv_manager(case["num_blocks"], case["block_size"], case["caching"], "paged", 256,
                            groups=case["groups"], max_num_batched_tokens=max_step_tokens(case["config"]),
                            pool_class=BlockPool if block_ids else CountingBlockPool)
    else:
        kv = KVCacheManager(case["num_blocks"], case["block_size"], case["caching"], case["allocation"], 256,
                            pool_class=BlockPool if block_ids else CountingBlockPool)
    sched = make_scheduler(SchedulerConfig(**case["config"], lazy_decode=lazy), kv)
    reqs = []
    for i, (at, shared, prompt, out, group, prio) in enumerate(case["requests"]):
        segments = ([(900 + group, shared)] if shared else []) + [(i, prompt)]
        reqs.append(make_request(i, float(at), segments, out, priority=prio))
    return sched, reqs


def step_view(batch, sched, content=False):
    """Everything a step decides, in a form two schedulers can be compared on."""
    return (batch.num_decode, batch.decode_ctx, batch.num_prefill_tokens, batch.prefill_ctx, batch.prefill_attn,
            batch.blocks_read, rows_of(batch, sched), [r.id for r in batch.preempted],
            [r.id for r in batch.admitted], sched.kv.num_used_blocks, sched.slack_tokens,
            pool_view(sched.kv.pool, content))


def rows_of(batch, sched) -> list:
    """The ids of a step's requests, its cohort members too where the scheduler does not list them
    in the batch (Scheduler.lists_members: every member is scheduled with the cohort, or none)."""
    rows = [r.id for r in batch.reqs]
    if not sched.lists_members and batch.cohort_size:
        rows += [r.id for r in sched.cohort.members]
    return sorted(rows)


def by_content(*scheds):
    """Compare pools by content unless each has an id for every block (the engine's BlockPool:
    then the ids must agree too). CountingBlockPool names a block when it is registered, so two
    runs may name the same content differently."""
    return not all(sched.kv.layout().named_blocks for sched in scheds)


def pool_view(pool, content=False):
    """The pool's free queue (LRU order) and prefix-cache map, by block id or by content."""
    if not content:
        return (list(pool.free_queue), dict(pool.cached), {h: list(d) for h, d in pool.duplicates.items()},
                pool.evictions)
    return content_view(pool)


def content_view(pool):
    """A pool as content: each free block's hash, or "cached" (private content) / "empty", in
    LRU order; how many blocks hold each mapped hash; the evictions. Equal for both pool kinds."""
    def content(block):
        if block in (CACHED, EMPTY):
            return "cached" if block == CACHED else "empty"
        h = pool.block_hash[block]
        return "empty" if h is None else "cached" if h is PRIVATE else h
    return ([content(b) for b in pool.free_queue], {h: 1 + len(pool.duplicates.get(h, ())) for h in pool.cached},
            pool.num_free, pool.num_cached_free, pool.evictions)


REQUEST_FIELDS = ("status", "num_output", "num_computed", "blocks", "first_token_step", "finish_step",
                  "chunk_steps", "num_preemptions", "num_cached_tokens", "admit_step", "group_tables")


def request_view(reqs, pool=None):
    """Every request's state; its blocks by content if a `pool` is given."""
    view = [tuple(getattr(r, f) for f in REQUEST_FIELDS) + emission_view(r) for r in reqs]
    if pool is not None:
        at, grouped = REQUEST_FIELDS.index("blocks"), REQUEST_FIELDS.index("group_tables")
        view = [list(v) for v in view]
        for v, r in zip(view, reqs):
            v[at] = table_view(pool, r.blocks)
            v[grouped] = r.group_tables and [table_view(pool, table) for table in r.group_tables]
        view = [tuple(v) for v in view]
    return view


def request_views(sched_a, reqs_a, sched_b, reqs_b):
    """Both sides' request views, by content unless both pools have ids for every block."""
    content = by_content(sched_a, sched_b)
    return (request_view(reqs_a, sched_a.kv.pool if content else None),
            request_view(reqs_b, sched_b.kv.pool if content else None))


def table_view(pool, blocks):
    """A block table as content: each block's mapped hash, or "-" (unmapped or unnamed), or
    "null" (a sliding window's entry behind it)."""
    hashes = pool.block_hash
    return [hashes[b] if b > 0 and hashes[b] not in (None, PRIVATE) else "null" if b == 0 else "-" for b in blocks]


def emission_view(req):
    """(closed runs, open run's start, latest emission); a cohort member's runs are built lazily."""
    if req.cohort is not None:
        return req.cohort.emission(req)
    return req.emit_runs, req.emit_start, req.last_emit


def add_arrivals(tick, *pairs):
    """Give each scheduler of (scheduler, requests) pairs the requests arriving at `tick`."""
    for sched, reqs in pairs:
        for r in reqs:
            if r.arrival == tick:
                sched.add(r)


def step_both(fast, slow, tick) -> bool:
    """One step on each scheduler: the same batch, or nothing on both. True if a step ran."""
    a, b = fast.schedule(), slow.schedule()
    assert (a is None) == (b is None), f"tick {tick}"
    assert a is not None or not fast.has_unfinished(), f"tick {tick}: work left but nothing scheduled"
    if a is None:
        return False
    content = by_content(fast, slow)
    assert step_view(a, fast, content) == step_view(b, slow, content), f"step {a.step}"
    assert all(r.num_computed == r.num_tokens for r in b.decodes), "a decode that is not the last token"
    fast.finish_step(a)
    slow.finish_step(b)
    return True


def run_pair(case, max_steps=5000, fast_ids=True, slow_ids=True, lists_members=True):
    """Drive the fast and the one-by-one scheduler in lockstep (their pools with or without ids
    for every block; the fast one's batches listing its cohort's members or not, as the
    simulator's); returns the number of steps."""
    (fast, fast_reqs), (slow, slow_reqs) = build(case, True, fast_ids), build(case, False, slow_ids)
    fast.lists_members = lists_members
    last_arrival = max(r[0] for r in case["requests"])
    tick = steps = cohort_steps = 0
    while tick <= last_arrival or fast.has_unfinished() or slow.has_unfinished():
        add_arrivals(tick, (fast, fast_reqs), (slow, slow_reqs))
        cohort_steps += bool(fast.cohort.members)
        if step_both(fast, slow, tick):
            view_a, view_b = request_views(fast, fast_reqs, slow, slow_reqs)
            assert view_a == view_b, f"tick {tick}"
            assert getattr(fast.kv.coordinator, "windowed_frees", 0) == getattr(slow.kv.coordinator, "windowed_frees", 0), f"tick {tick}"
            steps += 1
        tick += 1
        assert tick < max_steps, "no progress"
    for sched in (fast, slow):
        sched.check_accounting()
        sched.kv.pool.check_invariants()
    return steps, cohort_steps


def run_seeds(seeds, make_case, run) -> list:
    """`run(case)` for each seed's case; a failure names the seed and the case."""
    results = []
    for seed in seeds:
        case = make_case(seed)
        try:
            results.append(run(case))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {case}") from e
    return results


def sliding_case(seed):
    return with_sliding_windows(random_case(seed), seed)


@pytest.mark.parametrize("chunk", range(6))
@pytest.mark.parametrize("ids", [(True, True), (False, False), (True, False)], ids=["ids", "counting", "mixed"])
def test_fast_paths_match_the_one_by_one_loop(chunk, ids):
    """The cohort against the one-by-one loop, with the engine's pool (ids for every block), the
    simulator's (CountingBlockPool), and one of each (then compared by content)."""
    run_seeds(SEEDS[chunk::6], random_case, lambda case: run_pair(case, fast_ids=ids[0], slow_ids=ids[1]))


def test_batches_that_do_not_list_the_members_schedule_the_same_steps():
    """The simulator's scheduler does not copy the cohort's members into each Batch.decodes
    (Scheduler.lists_members off): every step's counts, rows (the members added back), preemptions
    and the pool still match the one-by-one loop's."""
    run_seeds(SEEDS, random_case, lambda case: run_pair(case, fast_ids=False, slow_ids=True, lists_members=False))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_member_preempted_after_the_cohort_was_scheduled_leaves_the_same_batch_listed_or_not(async_scheduling):
    """A cohort step leaves no room for a preemption in its pass (take_step counts every block the
    step takes), so the differential runs never preempt a member the step scheduled; should a
    pass ever do it, the batch takes it out the same whether it listed the members or not
    (Batch.remove of an unlisted member): counts, rows, tokens given back and held."""
    case = dict(num_blocks=60, block_size=4, caching=False, allocation="paged",
                config=dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, batching="continuous",
                            chunked_prefill=True, policy="fcfs", step_composition="mixed", admission_watermark=0.0,
                            async_scheduling=async_scheduling),
                requests=[(0, 0, 5, 30, 0, 0), (0, 0, 7, 30, 0, 0), (0, 0, 3, 30, 0, 0)])
    views = []
    for lists in (True, False):
        sched, reqs = build(case, True, block_ids=False)
        sched.lists_members = lists
        for r in reqs:
            sched.add(r)
        for _ in range(3):                 # prefills, then the three decode in the cohort
            sched.finish_step(sched.schedule())
        batch = sched.schedule()
        assert batch.cohort_size == 3
        victim = reqs[1]
        sched._preempt(victim, batch)
        views.append((batch.num_decode, batch.cohort_size, batch.decode_ctx, batch.blocks_read,
                      rows_of(batch, sched), [r.id for r in batch.preempted], sched._take_returned(),
                      sched.tokens_held, sched.slack_tokens))
        sched.finish_step(batch)
        assert victim.num_computed == 0 and victim not in sched.running
    assert views[0] == views[1]
    assert views[0][1] == 2 and views[0][6] == 1


def run_leaps_pair(case, max_ticks=5000, fast_ids=True, slow_ids=True):
    """Drive a scheduler by leaps (sim/core/fast/leap.py, of random lengths) wherever one qualifies,
    and a one-by-one scheduler by steps, in lockstep; after each leap every request's state,
    blocks and emissions, the figures the leap reports and the pool's free queue must agree.
    Returns the number of steps that ran inside leaps."""
    from sim.core.fast.leap import apply_leap, finish_leap, plan_leap

    rnd = random.Random(len(case["requests"]))
    (fast, fast_reqs), (slow, slow_reqs) = build(case, True, fast_ids), build(case, False, slow_ids)
    content = by_content(fast, slow)
    last_arrival = max(r[0] for r in case["requests"])
    tick = leapt = settled = 0
    while tick <= last_arrival or fast.has_unfinished() or slow.has_unfinished():
        add_arrivals(tick, (fast, fast_reqs), (slow, slow_reqs))
        plan = plan_leap(fast, max_steps=rnd.randint(1, 40))
        if plan is not None and plan.pending and rnd.random() < 0.7:
            plan.settle(fast)          # async: step t scheduled and its finishers released; the plan goes on
            settled += 1
        k = plan.reach(rnd.randint(1, plan.max_steps)) if plan is not None else 0
        if k:
            used, cached, slack = apply_leap(fast, plan, k)
            for i in range(k):
                b = slow.schedule()
                assert b is not None and not b.prefills and b.num_decode == plan.rows, f"tick {tick}"
                assert (used[i], cached[i], slack[i]) == (slow.kv.num_used_blocks, slow.kv.pool.num_cached_free,
                                                          slow.slack_tokens), f"step {b.step}"
                if i < k - 1:
                    slow.finish_step(b)
            assert [r.id for r in finish_leap(fast)] == [r.id for r in slow.finish_step(b)]
            leapt += k
        else:
            step_both(fast, slow, tick)
        assert pool_view(fast.kv.pool, content) == pool_view(slow.kv.pool, content), f"tick {tick}"
        assert getattr(fast.kv.coordinator, "windowed_frees", 0) == getattr(slow.kv.coordinator, "windowed_frees", 0), f"tick {tick}"
        view_a, view_b = request_views(fast, fast_reqs, slow, slow_reqs)
        assert view_a == view_b, f"tick {tick}"
        tick += 1
        assert tick < max_ticks, "no progress"
    for sched in (fast, slow):
        sched.check_accounting()
        sched.kv.pool.check_invariants()
    return leapt, settled


@pytest.mark.parametrize("chunk", range(3))
@pytest.mark.parametrize("ids", [(True, True), (False, True)], ids=["ids", "counting"])
def test_scheduler_leaps_match_the_one_by_one_loop(chunk, ids):
    """Leaps applied straight to a scheduler: blocks handed out (with or without prefix caching)
    and figures reported equal the step-by-step path's, over random cases (leaps with the
    simulator's CountingBlockPool against steps with the engine's BlockPool, too)."""
    results = run_seeds(SEEDS[chunk::3], random_case,
                        lambda case: run_leaps_pair(case, fast_ids=ids[0], slow_ids=ids[1]))
    leapt, settled = map(sum, zip(*results))
    assert leapt > 500
    assert settled > 20        # async cases: leaps that release the last step's finishers after step t


@pytest.mark.parametrize("chunk", range(3))
@pytest.mark.parametrize("ids", [(True, True), (False, False), (True, False)], ids=["ids", "counting", "mixed"])
def test_the_cohort_on_sliding_windows_matches_the_one_by_one_loop(chunk, ids):
    """Grouped KV caches (sliding-only and hybrid, either group first): members take a block per
    table at a crossing and free what falls behind the window; every table, the free queue and
    the prefix-cache map equal the one-by-one loop's after every step, with the engine's pool,
    the simulator's (CountingBlockPool) and one of each (then compared by content). (Seed 1481:
    a running non-member frees behind its window before a member would, so the cohort must
    stand down for the step to keep the free queue's order.)"""
    results = run_seeds([*SEEDS, 1481][chunk::3], sliding_case,
                        lambda case: run_pair(case, fast_ids=ids[0], slow_ids=ids[1]))
    assert sum(in_cohort for _, in_cohort in results) > 1000


@pytest.mark.parametrize("ids", [(True, True), (False, True)], ids=["ids", "counting"])
def test_scheduler_leaps_on_sliding_windows_match_the_one_by_one_loop(ids):
    """Leaps on grouped KV caches (with nobody waiting; each step through the cohort, frees
    behind the windows included): every table, figure and the free queue equal the one-by-one
    loop's after every leap (leaps with the simulator's CountingBlockPool against steps with the
    engine's BlockPool, too)."""
    results = run_seeds(SEEDS[::2], sliding_case, lambda case: run_leaps_pair(case, fast_ids=ids[0], slow_ids=ids[1]))
    assert sum(leapt for leapt, _ in results) > 500


# -- the simulator: event leaps and the cohort against the one-by-one path --------------------

def random_scenario(seed):
    """A small random scenario over every policy knob the leap must respect."""
    rnd = random.Random(10_000 + seed)
    batching = rnd.choice(["continuous"] * 3 + ["static"])
    composition = "mixed" if batching == "static" else rnd.choice(["mixed", "prefill_first"])
    chunked = rnd.random() < 0.6
    seqs = rnd.randint(2, 24)
    workload = {
        "num_requests": rnd.randint(20, 80),
        "arrival": rnd.choice([{"process": "poisson", "rate": rnd.choice([5.0, 50.0, 500.0])},
                               {"process": "offline"}, {"process": "gamma", "rate": 100.0, "cv": 3.0}]),
        "prompt_len": {"dist": "uniform", "min": 4, "max": rnd.choice([64, 300])},
        "output_len": {"dist": "uniform", "min": 1, "max": rnd.choice([16, 200])},
    }
    if rnd.random() < 0.5:
        workload["shared_prefix"] = {"groups": 2, "length": rnd.choice([16, 40]), "fraction": 0.7}
    if rnd.random() < 0.3:
        workload["multi_turn"] = {"turns": 3, "user_len": 20, "think_time_s": rnd.choice([0.0, 0.05])}
    if rnd.random() < 0.3:
        workload["tenants"] = [{"name": "a", "share": 1.0, "salt": True}, {"name": "b", "share": 1.0, "salt": False}]
    if rnd.random() < 0.3:
        workload["priorities"] = {"values": [0, 1, 2]}
    if rnd.random() < 0.25:
        workload["max_concurrency"] = rnd.choice([3, 8])        # a closed-loop client
    block_size = rnd.choice([4, 16])
    raw = {
        "name": f"fuzz{seed}", "seed": seed, "model": "tiny", "device": "cpu",
        "engine": {"batching": batching, "allocation": "contiguous" if batching == "static" and rnd.random() < 0.5
                   else "paged", "block_size": block_size,
                   "num_blocks": rnd.choice([140, 400, 2000] if block_size == 4 else [40, 120, 2000]),
                   "max_num_seqs": seqs, "max_num_batched_tokens": max(seqs, 512 if not chunked else rnd.choice([64, 512])),
                   "max_model_len": 512, "chunked_prefill": chunked, "prefix_caching": rnd.random() < 0.6,
                   "scheduling_policy": rnd.choice(["fcfs", "priority"]), "step_composition": composition,
                   "admission_watermark": rnd.choice([0.0, 0.01]),
                   "async_scheduling": seed % 2 == 1},      # on for odd seeds, off for even ones
        "workload": workload,
        "cluster": {"replicas": rnd.choice([1, 1, 2, 3]),
                    "router": rnd.choice(["round_robin", "least_outstanding_tokens", "prefix_aware"])},
    }
    return raw


def simulate_both(raw):
    """The fast path's run and the one-by-one path's."""
    return [simulate_one(raw, fast) for fast in (True, False)]


def simulate_one(raw, fast=True):
    """(steps frame, requests frame, each replica's final pool by content) of one run."""
    from sim.records import requests_frame
    from sim.scenario import validate_scenario
    from sim.simulator import Simulation, simulate
    from sim.workload import build_requests

    scenario = validate_scenario(raw)
    captured = {}
    original = Simulation.run

    def run(self):
        out = original(self)
        captured["pools"] = [content_view(r.kv.pool) for r in self.replicas]
        return out
    Simulation.run = run
    try:
        records, _, _ = simulate(scenario, build_requests(scenario), fast=fast)
    finally:
        Simulation.run = original
    return records.steps_frame(), requests_frame(records), captured["pools"]


def assert_switch_changes_nothing(raw, switch, monkeypatch, seed):
    """The same steps, requests and final pools with a Simulation class switch on and off."""
    from sim.simulator import Simulation

    runs = []
    for value in (True, False):
        monkeypatch.setattr(Simulation, switch, value)
        runs.append(simulate_one(raw))
    (steps_a, reqs_a, pools_a), (steps_b, reqs_b, pools_b) = runs
    assert steps_a.equals(steps_b), (switch, seed, raw)
    assert reqs_a.equals(reqs_b), (switch, seed, raw)
    assert pools_a == pools_b, (switch, seed, raw)


@pytest.mark.parametrize("chunk", range(4))
def test_leaps_match_the_one_by_one_simulation(chunk):
    """Every step record and every request figure equal bit for bit, and the pools' free queues
    (LRU order) and prefix-cache maps equal at the end, over random scenarios."""
    for seed in range(chunk, 48, 4):
        raw = random_scenario(seed)
        (steps_a, reqs_a, pools_a), (steps_b, reqs_b, pools_b) = simulate_both(raw)
        assert len(steps_a) == len(steps_b), (seed, raw)
        assert steps_a.equals(steps_b), (seed, raw)
        assert reqs_a.equals(reqs_b), (seed, raw)
        assert pools_a == pools_b, (seed, raw)


def vidur_shaped(caching: bool, num_blocks: int, rate: float) -> dict:
    """Vidur's comparison run in miniature: prefill_first, unchunked, fixed lengths, one replica
    under Poisson arrivals, so leaps chain and the cohort sits out every prefill step."""
    return {"name": "vidur_small", "seed": 3, "model": "tiny", "device": "cpu",
            "engine": {"batching": "continuous", "allocation": "paged", "block_size": 16, "num_blocks": num_blocks,
                       "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 512,
                       "chunked_prefill": False, "prefix_caching": caching, "step_composition": "prefill_first",
                       "admission_watermark": 0.01, "async_scheduling": False},
            "workload": {"num_requests": 150, "arrival": {"process": "poisson", "rate": rate},
                         "prompt_len": 64, "output_len": 48,
                         **({"shared_prefix": {"groups": 2, "length": 32, "fraction": 0.5}} if caching else {})}}


@pytest.mark.parametrize("caching,num_blocks", [(False, 2000), (False, 40), (True, 2000), (True, 40)])
def test_prefill_first_leaps_pause_the_cohort_and_match(caching, num_blocks, monkeypatch):
    """The fast path on a prefill_first run: the cohort sits out prefill steps (no dissolving),
    leaps cover most steps, and everything still equals the one-by-one path (with a pool small
    enough to preempt, too)."""
    import sim.simulator as simulator

    covered = []
    original = simulator.apply_leap

    def counting(sched, plan, k):
        covered.append(k)
        return original(sched, plan, k)
    monkeypatch.setattr(simulator, "apply_leap", counting)
    raw = vidur_shaped(caching, num_blocks, rate=400.0)
    (steps_a, reqs_a, pools_a), (steps_b, reqs_b, pools_b) = simulate_both(raw)
    assert steps_a.equals(steps_b) and reqs_a.equals(reqs_b) and pools_a == pools_b
    prefill_steps = int((steps_a["prefill_tokens"] > 0).sum())
    assert prefill_steps > 20 and len(steps_a) > 3 * prefill_steps       # decodes between prefills
    if num_blocks > 100:
        assert sum(covered) > 0.5 * len(steps_a), (sum(covered), len(steps_a))
    else:
        assert (reqs_a["preemptions"] > 0).any()


def test_cohort_sits_out_prefill_steps_without_dissolving():
    """prefill_first at the policy level: members keep their cohort across a prefill step and
    their emission runs split around it exactly as the one-by-one loop records them."""
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, chunked_prefill=False,
               step_composition="prefill_first")
    fast = make_scheduler(SchedulerConfig(**cfg), KVCacheManager(200, 4, False, "paged", 256))
    slow = make_scheduler(SchedulerConfig(**cfg, lazy_decode=False), KVCacheManager(200, 4, False, "paged", 256))
    pairs = [[make_request(i, 0.0, [(i, 10)], 20) for i in range(4)] for _ in range(2)]
    for sched, reqs in zip((fast, slow), pairs):
        for r in reqs[:3]:
            sched.add(r)
    for step in range(12):
        if step == 4:                            # an arrival: its prefill step pauses the decodes
            for sched, reqs in zip((fast, slow), pairs):
                sched.add(reqs[3])
        a, b = fast.schedule(), slow.schedule()
        assert step_view(a, fast) == step_view(b, slow)
        members = set(fast.cohort.members)
        fast.finish_step(a)
        slow.finish_step(b)
        if step == 4:
            assert a.num_prefill_tokens and members == set(pairs[0][:3]), "the cohort stayed whole"
        assert request_view(pairs[0]) == request_view(pairs[1])
    assert fast.cohort.pauses == [4]
    runs, start, last = emission_view(pairs[0][0])
    assert runs == [0, 3] and start == 5 and last == 11    # first token at its prefill step 0


def test_leap_timing_prices_step_by_step_and_stops_at_the_horizon():
    """LeapPlan.timed: step i ends at the running sum of the prices (added one by one), the step
    in flight at the horizon is the last, one ending exactly at it is left out, and `more` says
    the plan goes on past the steps asked for."""
    from sim.core.fast.leap import plan_leap

    cfg = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
    sched = make_scheduler(SchedulerConfig(**cfg), KVCacheManager(200, 4, False, "paged", 256))
    for i in range(3):
        sched.add(make_request(i, 0.0, [(i, 10 + 3 * i)], 60))
    for _ in range(2):
        sched.finish_step(sched.schedule())
    plan = plan_leap(sched, max_steps=1 << 30)
    assert plan is not None and plan.rows == 3

    def price(ctx, blocks):
        return ctx * 1e-5 + 0.1, blocks * 3e-5 + 0.2

    plan.reach(10)
    shapes = plan.shapes(10)
    expected, t = [], 1.0
    for c, b in zip(*shapes):
        h, d = price(c, b)
        t = t + (h + d)
        expected.append(t)
    ends, hosts, devices, ctx, blocks, more = plan.timed(sched, price, 1.0, float("inf"), 10)
    assert ends == expected and more and (ctx, blocks) == tuple(map(list, shapes))
    assert [h + d for h, d in zip(hosts, devices)] == [price(c, b)[0] + price(c, b)[1] for c, b in zip(*shapes)]
    between = (expected[3] + expected[4]) / 2
    assert plan.timed(sched, price, 1.0, between, 10)[0] == expected[:5]      # the step in flight
    assert plan.timed(sched, price, 1.0, expected[4], 10)[0] == expected[:4]  # a tie: left out
    assert plan.timed(sched, price, 1.0, expected[0], 10)[0] == []
    # the plan ends at the members' first finish: no more steps past it
    ends, *_, more = plan.timed(sched, price, 1.0, float("inf"), plan.max_steps)
    assert len(ends) == plan.max_steps and not more


def simulate_with_private_blocks(raw, private: bool, monkeypatch):
    from sim.records import requests_frame
    from sim.scenario import validate_scenario
    from sim.simulator import simulate
    from sim.workload import build_requests

    monkeypatch.setattr(UnitaryCoordinator, "private_blocks", private)
    monkeypatch.setattr(HybridCoordinator, "private_blocks", private)
    scenario = validate_scenario(raw)
    records, _, _ = simulate(scenario, build_requests(scenario))
    return records.steps_frame(), requests_frame(records)


@pytest.mark.parametrize("chunk", range(2))
def test_private_blocks_change_no_prediction(chunk, monkeypatch):
    """Keeping a request's own output blocks out of the hash map (UnitaryCoordinator.private_blocks)
    gives the same steps (incl. KV used / cached-free) and requests as mapping every block at
    once, as vLLM does: over random scenarios with caching on, preemption pressure, multi-turn."""
    for seed in range(chunk, 32, 2):
        raw = random_scenario(seed)
        raw["engine"]["prefix_caching"] = True
        if seed % 4 < 2:       # a tight pool: preemptions publish the victims' private blocks
            raw["engine"]["num_blocks"] = 140 if raw["engine"]["block_size"] == 4 else 40
        steps_a, reqs_a = simulate_with_private_blocks(raw, True, monkeypatch)
        steps_b, reqs_b = simulate_with_private_blocks(raw, False, monkeypatch)
        assert steps_a.equals(steps_b), (seed, raw)
        assert reqs_a.equals(reqs_b), (seed, raw)


@pytest.mark.parametrize("chunk", range(2))
def test_counting_pool_changes_no_prediction(chunk, monkeypatch):
    """The simulator's pool (ids only for mapped blocks, sim/core/fast/counting_pool.py) against the
    engine's (an id for every block): the same steps, requests and final pools (by content), over
    random scenarios with caching on, preemption pressure (victims publish private blocks),
    multi-turn, tenants and replicas."""
    for seed in range(chunk, 32, 2):
        raw = random_scenario(seed)
        raw["engine"]["prefix_caching"] = seed % 8 != 7
        if seed % 4 < 2:
            raw["engine"]["num_blocks"] = 140 if raw["engine"]["block_size"] == 4 else 40
        assert_switch_changes_nothing(raw, "block_ids", monkeypatch, seed)


@pytest.mark.parametrize("chunk", range(2))
def test_chained_runs_take_arrivals_as_simpy_would(chunk, monkeypatch):
    """A chained run (one replica, open loop, no follow-ups) takes its arrivals at the replica's own
    events instead of through SimPy's arrival process, and runs its leaps back to back: the same
    steps, requests and final pools as the same run with every step on SimPy's clock, over random
    one-replica scenarios (offline arrivals: every request due at once, at time 0)."""
    for seed in range(chunk, 24, 2):
        raw = random_scenario(seed)
        raw["cluster"]["replicas"] = 1
        raw["workload"].pop("max_concurrency", None)
        raw["workload"].pop("multi_turn", None)
        assert_switch_changes_nothing(raw, "chain", monkeypatch, seed)


@pytest.mark.parametrize("chunk", range(2))
def test_leaps_held_over_past_an_arrival_match_the_one_by_one_simulation(chunk, monkeypatch):
    """Async scheduling in a chained run: a request that arrives while a step is in flight waits
    through the next step's pass, so a leap cut by the arrival runs one step further
    (LeapPlan.timed's `held_over`) and the arrivals join WAITING after it. Over random one-replica
    async scenarios with arrivals every few steps: the same steps, requests and final pools as
    the one-by-one loop, and the held-over steps were taken."""
    from sim.core.fast.leap import LeapPlan

    held = []
    original = LeapPlan._held_over_step

    def spy(self, sched, price, i, t, ctx, blocks, columns):
        before = len(columns[0])
        original(self, sched, price, i, t, ctx, blocks, columns)
        held.append(len(columns[0]) - before)
    monkeypatch.setattr(LeapPlan, "_held_over_step", spy)
    for seed in range(2 * chunk + 1, 48, 4):
        raw = random_scenario(seed)
        raw["cluster"]["replicas"] = 1
        raw["workload"].pop("max_concurrency", None)
        raw["workload"].pop("multi_turn", None)
        raw["workload"]["num_requests"] = 120
        raw["workload"]["arrival"] = {"process": "poisson", "rate": random.Random(seed).choice([100.0, 300.0])}
        raw["engine"].update(batching="continuous", allocation="paged", async_scheduling=True)
        (steps_a, reqs_a, pools_a), (steps_b, reqs_b, pools_b) = simulate_both(raw)
        assert steps_a.equals(steps_b), (seed, raw)
        assert reqs_a.equals(reqs_b), (seed, raw)
        assert pools_a == pools_b, (seed, raw)
    assert sum(held) >= 20


def sliding_scenario(seed):
    """random_scenario on the tiny model with a sliding window (every layer, or one of its two
    layers: a hybrid, either first), prefix caching on and a pool just big enough for
    max_model_len, so that requests are preempted and looked up again."""
    from sim.scenario import validate_scenario

    raw = random_scenario(seed)
    rnd = random.Random(seed)
    block_size = raw["engine"]["block_size"]
    model = {"base": "tiny", "sliding_window": rnd.choice([5, 2 * block_size, 3 * block_size + 2, 24])}
    if seed % 2:
        model["layer_types"] = rnd.choice([["sliding_attention", "full_attention"],
                                           ["full_attention", "sliding_attention"]])
    raw["model"] = model
    raw["engine"].update(allocation="paged", prefix_caching=True, max_num_seqs=max(raw["engine"]["max_num_seqs"], 8),
                         num_blocks=100_000)
    raw["workload"]["output_len"] = {"dist": "uniform", "min": 20, "max": 200}
    raw["cluster"]["replicas"] = 1
    plan_blocks = max_model_len_blocks(validate_scenario(raw))
    raw["engine"]["num_blocks"] = plan_blocks + 1 + (seed % 3) * 8
    return raw


def max_model_len_blocks(scenario) -> int:
    """The fewest usable blocks the startup check accepts for the scenario's max_model_len."""
    from sim.core.memory import plan_memory

    plan = plan_memory(scenario)
    return plan.kv_groups.blocks_per_request(scenario.engine.max_model_len, scenario.engine.block_size,
                                            scenario.engine.max_num_batched_tokens)


@pytest.mark.parametrize("chunk", range(2))
def test_grouped_caches_on_the_counting_pool_change_no_prediction(chunk, monkeypatch):
    """Sliding-window and hybrid caches on the simulator's pool (unnamed blocks) against the
    engine's (an id for every block): the same steps, requests and final pools (by content),
    over random scenarios under preemption pressure."""
    for seed in range(chunk, 24, 2):
        assert_switch_changes_nothing(sliding_scenario(seed), "block_ids", monkeypatch, seed)


@pytest.mark.parametrize("chunk", range(2))
def test_private_blocks_on_grouped_caches_change_no_prediction(chunk, monkeypatch):
    """Private blocks in every KV cache group (HybridCoordinator.private_blocks: mapped when their
    request is preempted, with those its windows freed and the pool still holds) give the steps
    and requests of mapping every full block at once, as vLLM does, over random sliding-window
    and hybrid scenarios under preemption pressure."""
    preempted = 0
    for seed in range(chunk, 24, 2):
        raw = sliding_scenario(seed)
        steps_a, reqs_a = simulate_with_private_blocks(raw, True, monkeypatch)
        steps_b, reqs_b = simulate_with_private_blocks(raw, False, monkeypatch)
        assert steps_a.equals(steps_b), (seed, raw)
        assert reqs_a.equals(reqs_b), (seed, raw)
        preempted += int(reqs_a["preemptions"].sum())
    assert preempted > 10
