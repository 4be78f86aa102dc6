"""KV offloading to CPU (engine.kv_offload, sim/core/offload.py): schema, vLLM's store and
lookup policy, eviction, the load in TTFT, accounting, the from-vllm mapping, the engine's refusal.

vLLM sources read (release 0.19.0): vllm/config/vllm.py (_post_init_kv_transfer_config),
vllm/config/cache.py (kv_offloading_size, kv_offloading_backend),
vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py and worker.py,
vllm/v1/kv_offload/spec.py, cpu/spec.py, cpu/manager.py, cpu/policies/lru.py and arc.py,
vllm/v1/core/sched/scheduler.py (WAITING_FOR_REMOTE_KVS).
"""
import json
import math

import pytest

from sim.core.fast.counting_pool import CountingBlockPool
from sim.core.kv import KVCacheManager
from sim.core.offload import CpuTier, KvOffload, build_cpu_tier, host_link_gbps
from sim.core.request import make_request
from sim.core.scheduler import SchedulerConfig
from sim.core.scheduler_variants import make_scheduler
from sim.errors import UserError
from sim.predict import predict
from sim.scenario import ScenarioError, validate_scenario
from sim.vllm.serve_flags import translate

BS = 16


def chat(offload=None, rate=1.0, n=120, **engine):
    """A small multi-turn chat on an L4: the GPU cache cannot keep the conversations between turns."""
    eng = {"max_model_len": 8192, "num_blocks": 600, **engine}
    if offload is not None:
        eng["kv_offload"] = offload
    return validate_scenario({
        "name": "offload", "seed": 3, "model": "qwen2.5-7b", "device": "l4", "engine": eng,
        "workload": {"num_requests": n, "arrival": {"process": "poisson", "rate": rate},
                     "prompt_len": {"dist": "uniform", "min": 1024, "max": 2048},
                     "output_len": {"dist": "uniform", "min": 32, "max": 96},
                     "multi_turn": {"turns": {"value": 3}, "user_len": {"value": 64}, "think_time_s": 20}}})


# -- schema -------------------------------------------------------------------------------

@pytest.mark.parametrize("offload, message", [
    ({"size_gib": 0}, "engine.kv_offload.size_gib"),
    ({"size_gib": 8, "policy": "lru"}, "engine.kv_offload.policy: unknown key"),
    ({"size_gib": 8, "backend": "mooncake"}, "engine.kv_offload.backend"),
    ({"size_gib": 8, "backend": "lmcache", "eviction_policy": "arc"}, "LRU only"),
    ({"size_gib": 8, "offloaded_block_size": 24}, "multiple of engine.block_size"),
    ({"size_gib": 8, "bandwidth_gbps": -1}, "engine.kv_offload.bandwidth_gbps"),
])
def test_bad_offload_sections_name_the_field(offload, message):
    with pytest.raises(ScenarioError, match=message):
        chat(offload)


def test_offload_needs_one_kv_group_and_a_gpu():
    """OffloadingConnectorScheduler asserts one KV cache group; CPUOffloadingSpec.get_handlers
    refuses non-CUDA platforms (vLLM 0.19)."""
    with pytest.raises(ScenarioError, match="one full-attention KV cache group"):
        validate_scenario({"model": "mistral-7b-v0.1", "device": "l4", "engine": {"kv_offload": {"size_gib": 8}}})
    with pytest.raises(ScenarioError, match="needs a GPU device"):
        validate_scenario({"model": "tiny", "device": "cpu", "engine": {"kv_offload": {"size_gib": 1}}})


def test_capacity_and_link_follow_vllm_and_the_catalog():
    """CPUOffloadingSpec: num_blocks = cpu_bytes_to_use // (page bytes x layers x world size x
    block_size_factor); the default link is the device's PCIe host link (Gen4 x16 on L4 and A100,
    Gen5 x16 on H100 SXM)."""
    s = chat({"size_gib": 2, "offloaded_block_size": 64})
    kv_per_token = 28 * 2 * 4 * 128 * 2            # Qwen2.5-7B: layers x K,V x kv heads x head dim x bf16
    tier = build_cpu_tier(s.engine.kv_offload, s.device, BS, kv_per_token * BS)
    assert tier.block_factor == 4 and tier.block_bytes == kv_per_token * 64
    assert tier.capacity_blocks == (2 << 30) // (kv_per_token * 64)
    assert host_link_gbps(s.device) == 32.0
    assert host_link_gbps(validate_scenario({"model": "tiny", "device": "a100-80g"}).device) == 32.0
    assert host_link_gbps(validate_scenario({"model": "tiny", "device": "h100-sxm"}).device) == 64.0


# -- the tier on its own --------------------------------------------------------------------

def tier(capacity, policy="lru", factor=1):
    return CpuTier(capacity_blocks=capacity, gpu_block_size=BS, block_factor=factor, block_bytes=1000,
                   bandwidth_Bps=1e6, latency_s=0.001, policy_name=policy)


def request(i, prompt_blocks, output=0, key=None):
    return make_request(i, 0.0, [(key if key is not None else 1000 + i, prompt_blocks * BS)], output)


def test_store_is_write_through_of_full_blocks_visible_after_finish():
    """_get_reqs_to_store: each step stores the newly full blocks of the request's computed tokens;
    the worker reports a request's stores (finished_sending -> complete_store) only once it has
    finished, so lookups see them only then, and only once their copy is done."""
    t = tier(100)
    a = request(1, 3)
    a.num_computed = 2 * BS + 5                # 2 full blocks computed
    t.now = 1.0
    t.after_step([a])
    assert t.stats.blocks_stored == 2 and t.stats.bytes_stored == 2000
    b = request(2, 3, key=1001)                # same content as a
    t.now = 5.0
    assert t.match(b, 0) == 0                  # a still runs: not visible
    a.num_computed = 3 * BS
    t.after_step([a])                          # the third block: stored once, not the first two again
    assert t.stats.blocks_stored == 3
    t.request_done(a)
    # 3 copies queued on the device-to-host channel from t=1: each latency + 1000 B at 1 MB/s
    assert t.match(b, 0) == 0                  # now=5 > copies' end? they end at 1.002, 5.002 ...
    t.now = 10.0
    assert t.match(b, 0) == 3 * BS
    assert t.match(b, BS) == 2 * BS            # after a one-block GPU hit: the rest
    assert t.match(b, 3 * BS - 1 - (3 * BS - 1) % BS) == BS


def test_lookup_rules_follow_get_num_new_matched_tokens():
    """Less than one offloaded block beyond the GPU hit: no load; the run stops at the first
    block that is absent (offloading/scheduler.py get_num_new_matched_tokens, 0.19)."""
    t = tier(100, factor=2)                    # 32-token offloaded blocks
    a = request(1, 6)
    a.num_computed = 6 * BS
    t.after_step([a])
    t.request_done(a)
    t.now = 100.0
    b = request(2, 6, key=1001)
    assert t.match(b, 0) == 6 * BS
    assert t.match(b, 5 * BS) == 0             # 16 tokens left in the last offloaded block: < 32
    assert t.match(b, 4 * BS) == 2 * BS
    c = make_request(3, 0.0, [(1001, 4 * BS), (77, 2 * BS)], 0)   # shares only the first 4 GPU blocks
    assert t.match(c, 0) == 4 * BS


def test_lru_evicts_the_least_recently_touched_tail_first():
    """LRUCachePolicy.touch walks the hashes in reverse, so a request's first block ends most
    recent; prepare_store evicts ready, unreferenced blocks from the LRU end, and skips (retries
    next step) a store that cannot make room (cpu/manager.py, policies/lru.py, 0.19)."""
    t = tier(4)
    a, b = request(1, 3), request(2, 2)
    a.num_computed = 3 * BS
    t.after_step([a])
    t.request_done(a)
    t.now = 100.0
    b.num_computed = 2 * BS
    t.after_step([b])                          # needs 2, 1 free: evicts a's tail (block 2)
    assert t.stats.blocks_evicted == 1
    keys_a = a.block_hashes[:3]
    assert t.policy.get(keys_a[2]) is None and t.policy.get(keys_a[0]) is not None
    c = request(3, 4)
    c.num_computed = 4 * BS
    t.after_step([c])                          # b's 2 blocks are still pending: only a's 2 evictable
    assert t.stats.stores_skipped == 1 and t.stats.blocks_stored == 5


def test_arc_promotes_a_block_touched_again_and_evicts_t1_first():
    """ARCCachePolicy (0.19): a ready block in T1 touched again moves to T2; eviction takes T1
    while it is at least its target size (0 at first)."""
    t = tier(3, policy="arc")
    a = request(1, 2)
    a.num_computed = 2 * BS
    t.after_step([a])
    t.request_done(a)
    t.now = 100.0
    t.match(request(9, 2, key=1001), 0)        # a lookup touches a's blocks: into T2
    assert set(t.policy.t2) == set(a.block_hashes[:2])
    c = request(3, 1)
    c.num_computed = BS
    t.after_step([c])
    t.request_done(c)
    t.now = 200.0
    d = request(4, 1)
    d.num_computed = BS
    t.after_step([d])                          # full: evicts from T1 (c), not the reused a
    assert t.policy.get(c.block_hashes[0]) is None
    assert all(t.policy.get(h) is not None for h in a.block_hashes[:2])
    assert c.block_hashes[0] in t.policy.b1


# -- in the scheduler ----------------------------------------------------------------------

def scheduler(num_blocks=12, capacity=100):
    kv = KVCacheManager(num_blocks, BS, pool_class=CountingBlockPool)
    return make_scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096,
                                          lazy_decode=False), kv, offload=tier(capacity))


def run_to_end(sched, clock, step_s=0.01, limit=10_000):
    while sched.has_unfinished() and limit:
        limit -= 1
        sched.offload.now = clock
        batch = sched.schedule()
        if batch is None:
            clock = max(clock, sched.offload.next_load_done())
            continue
        clock += step_s
        sched.offload.now = clock
        sched.finish_step(batch)
    return clock


def test_gpu_hit_first_then_cpu_and_the_request_waits_for_its_load():
    """A new request takes its GPU prefix hit, then the CPU tier's blocks after it; while they
    load it holds its blocks but no seat (WAITING_FOR_REMOTE_KVS), and it is scheduled from the
    head of the queue once the copy is done, with the hit counted as computed
    (vllm/v1/core/sched/scheduler.py, 0.19)."""
    sched = scheduler(num_blocks=12)
    first = request(1, 8, output=4)
    sched.add(first)
    clock = run_to_end(sched, 0.0)
    # a filler overwrites the GPU cache (11 usable blocks): first's blocks survive only on the CPU
    sched.add(request(2, 10, output=4))
    clock = run_to_end(sched, clock)
    again = make_request(3, clock, [(1001, 8 * BS), [5] * 8], 4)     # first's prompt + 8 new tokens
    sched.offload.now = clock
    assert sched.kv.find_cached_prefix(again)[1] == 0
    sched.add(again)
    sched.offload.now = clock
    assert sched.schedule() is None            # loading: nothing to run
    assert again in sched.offload.loading and again not in sched.running
    sched.check_accounting()
    load = sched.offload.loading[again]
    assert load.done_at == pytest.approx(clock + 0.001 + 8 * 1000 / 1e6)
    sched.offload.now = load.done_at
    batch = sched.schedule()
    assert batch is not None and again in batch.prefills
    assert again.num_cached_tokens == 8 * BS and again.num_computed == 8 * BS + 8
    assert sched.offload.stats.hit_tokens == 8 * BS


# -- whole runs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs():
    return {"off": predict(chat()), "on": predict(chat({"size_gib": 16}))}


def test_offload_is_off_by_default(runs):
    assert chat().engine.kv_offload is None
    assert "kv_offload" not in runs["off"].summary


def test_offload_raises_the_hit_rate_and_cuts_ttft(runs):
    off, on = runs["off"].summary, runs["on"].summary
    tiers = on["kv_offload"]
    assert tiers["cpu_hit_tokens"] > 0 and tiers["loads"] > 0
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"] + 0.2
    assert on["ttft_s"]["p50"] < off["ttft_s"]["p50"]


def test_accounting_of_the_tiers(runs):
    """Every request ends; the tokens each tier served first admissions add up to the cached tokens
    the requests report (no full hit here: that one recomputes its last token), and the bytes to
    the blocks moved (a preempted request's way back counted apart)."""
    s, df = runs["on"].summary, runs["on"].requests
    tiers = s["kv_offload"]
    assert (df["status"] == "finished").all()
    assert tiers["gpu_hit_tokens"] + tiers["cpu_hit_tokens"] == df["cached_tokens"].sum()
    block_bytes = tiers["bytes_stored"] // tiers["blocks_stored"]
    moved = tiers["cpu_hit_tokens"] + tiers["cpu_preempted_hit_tokens"]
    assert tiers["bytes_loaded"] == moved // tiers["block_tokens"] * block_bytes
    assert tiers["cpu_hit_rate"] == pytest.approx(tiers["cpu_hit_tokens"] / df["prompt_tokens"].sum())


def test_load_time_is_in_ttft():
    """A slower link makes every load wait longer, and the requests' TTFT grows by at least the
    extra wait (the request waits for its async load before its prefill)."""
    fast = predict(chat({"size_gib": 16, "bandwidth_gbps": 32}))
    slow = predict(chat({"size_gib": 16, "bandwidth_gbps": 0.05}))
    f, s = fast.summary["kv_offload"], slow.summary["kv_offload"]
    assert s["load_wait_s"] > f["load_wait_s"] * 100
    extra = (s["load_wait_s"] - f["load_wait_s"]) / s["loads"]
    assert slow.requests["ttft_s"].mean() > fast.requests["ttft_s"].mean() + 0.5 * extra


def test_same_seed_same_prediction(runs):
    again = predict(chat({"size_gib": 16}))
    assert json.dumps(again.summary, sort_keys=True, default=str) == \
        json.dumps(runs["on"].summary, sort_keys=True, default=str)


def test_offload_works_without_the_gpu_prefix_cache():
    """vLLM hashes the request's blocks when a KV connector is set, prefix caching or not
    (vllm/v1/engine/core.py, 0.19: enable_prefix_caching or kv_connector is not None): every hit
    then comes from the CPU tier."""
    s = predict(chat({"size_gib": 16}, prefix_caching=False)).summary["kv_offload"]
    assert s["gpu_hit_tokens"] == 0 and s["cpu_hit_tokens"] > 0


def test_a_small_tier_evicts():
    s = predict(chat({"size_gib": 0.05})).summary["kv_offload"]
    assert s["blocks_evicted"] > 0 and s["cpu_blocks"] < 1000


# -- from-vllm --------------------------------------------------------------------------------

def test_offloading_size_and_backend_map_as_vllm_combines_them():
    """_post_init_kv_transfer_config (vllm/config/vllm.py, 0.19): the size turns offloading on;
    the backend alone does nothing; lmcache takes the size over all ranks."""
    t = translate("vllm serve Qwen/Qwen2.5-7B-Instruct --kv-offloading-size 64", "h100-sxm")
    assert t.raw["engine"]["kv_offload"] == {"backend": "native", "size_gib": 64.0}
    assert not t.ignored and not t.unknown
    t = translate("vllm serve Qwen/Qwen2.5-7B-Instruct --kv-offloading-backend lmcache", "h100-sxm")
    assert "kv_offload" not in t.raw.get("engine", {})
    assert [flag for flag, _, _ in t.ignored] == ["--kv-offloading-backend"]
    t = translate("vllm serve Qwen/Qwen2.5-7B-Instruct -tp 2 --kv-offloading-size 64 "
                  "--kv-offloading-backend lmcache", "h100-sxm")
    assert t.raw["engine"]["kv_offload"] == {"backend": "lmcache", "size_gib": 64.0}
    validate_scenario(t.raw)


def test_kv_transfer_config_offloading_connectors_map():
    """OffloadingConnector's extra config: cpu_bytes_to_use, block_size, eviction_policy
    (vllm/v1/kv_offload/spec.py, cpu/spec.py, 0.19); LMCacheConnectorV1's
    lmcache.max_local_cpu_size is per rank."""
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 32 << 30, "block_size": 64, "eviction_policy": "arc"}}
    t = translate(["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct", "--kv-transfer-config", json.dumps(cfg)], "h100-sxm")
    assert t.raw["engine"]["kv_offload"] == {"backend": "native", "size_gib": 32.0, "offloaded_block_size": 64,
                                             "eviction_policy": "arc"}
    assert not t.ignored and any(f == "engine.kv_offload" for _, f, _ in t.mapped)
    validate_scenario(t.raw)
    lm = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
          "kv_connector_extra_config": {"lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 10}}
    t = translate(["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct", "-tp", "2", "--kv-transfer-config", json.dumps(lm)],
                  "h100-sxm")
    assert t.raw["engine"]["kv_offload"] == {"backend": "lmcache", "size_gib": 20.0}
    # LMCache's own default, 5 GB per worker (LMCache lmcache/v1/config.py), when the JSON names none:
    # a public command (tests/data/vllm_public/startup_logs.yaml, vLLM issue 21348)
    t = translate("vllm serve Qwen/Qwen2.5-7B-Instruct --tensor-parallel-size 4 --kv-transfer-config "
                  '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}', "h100-sxm")
    assert t.raw["engine"]["kv_offload"] == {"backend": "lmcache", "size_gib": 20.0}


def test_other_connectors_stay_ignored():
    t = translate(["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct", "--kv-transfer-config",
                   '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'], "h100-sxm")
    assert "kv_offload" not in t.raw.get("engine", {})
    assert [flag for flag, _, _ in t.ignored] == ["--kv-transfer-config"]


@pytest.mark.parametrize("argv, message", [
    (["--kv-offloading-size", "-3"], "--kv-offloading-size"),
    (["--kv-offloading-size", "inf"], "--kv-offloading-size"),
    (["--kv-transfer-config", "{not json"], "--kv-transfer-config: not JSON"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'], "cpu_bytes_to_use"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
                              '{"cpu_bytes_to_use": 1e9, "eviction_policy": "lfu"}}'], "eviction_policy"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
                              '{"cpu_bytes_to_use": 1e9, "store_threshold": 2}}'], "store_threshold"),
    (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": '
                              '{"lmcache.local_cpu": false}}'], "disk / remote"),
    (["--kv-transfer-config", "[" * 20_000], "at most 10,000 characters"),
])
def test_bad_offload_flags_are_refused_clearly(argv, message):
    with pytest.raises(UserError, match=message):
        translate(["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct", *argv], "h100-sxm")


# -- the engine -------------------------------------------------------------------------------

def test_the_engine_refuses_a_scenario_with_offload():
    from engine.replay import EngineUnsupportedError, check_engine_supports

    check_engine_supports(validate_scenario({"model": "tiny", "device": "h100-sxm"}))
    with pytest.raises(EngineUnsupportedError, match="engine.kv_offload"):
        check_engine_supports(validate_scenario({"model": "tiny", "device": "h100-sxm",
                                                 "engine": {"kv_offload": {"size_gib": 4}}}))


def test_kv_offload_model_defaults():
    cfg = KvOffload(size_gib=1)
    assert (cfg.backend, cfg.eviction_policy, cfg.offloaded_block_tokens(16)) == ("native", "lru", 16)
    assert KvOffload(size_gib=1, backend="lmcache").offloaded_block_tokens(16) == 256
    assert math.isfinite(cfg.latency_us)


def test_cached_prompt_ttft_gain_matches_vllms_published_range():
    """vLLM's offloading blog (https://blog.vllm.ai/2026/01/08/kv-offloading-connector.html, H100):
    "2-22x faster TTFT for cached prompts", growing with the prompt. One request alone on an
    H100 with Llama-3.1-8B: recompute vs CPU load + the last token's step, 1k to 32k tokens."""
    from sim.whatif.kv_offload import cached_prompt_ttft

    # datasheet step times, on which the range was checked (trained's slower H100 prefill: 4.8-30.9x)
    s = validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm", "engine": {"max_model_len": 32768},
                           "step_times": "datasheet"})
    gains = [recompute / loaded for recompute, loaded in
             (cached_prompt_ttft(s, n) for n in (1024, 4096, 16384, 32000))]
    assert gains == sorted(gains)
    assert 2 <= gains[0] <= 6 and 15 <= gains[-1] <= 30
