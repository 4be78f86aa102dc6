"""The routers people deploy (sim/routers/): each one's score on hand-built replica states, against
the formula in its source; tie-breaks; seeded sampling; routing regret; the schema.

Sources (read for these tests; the modules cite the same):
- llm-d: llm-d/llm-d-inference-scheduler at 520af478 (2026-05): pkg/epp/config/loader/defaults.go,
  pkg/epp/framework/plugins/scheduling/scorer/{queuedepth/queue.go, kvcacheutilization/
  kvcache_utilization.go, prefix/plugin.go, preciseprefixcache/utils.go}, picker/maxscore/picker.go,
  requestcontrol/dataproducer/approximateprefix/{plugin.go, indexer.go, types.go}.
- Dynamo: ai-dynamo/dynamo lib/kv-router/src/scheduling/selector.rs at ccd1706e (DefaultWorkerSelector,
  softmax_sample), lib/kv-router/src/scheduling/config.rs at c2f2e1aa (KvRouterConfig::default),
  lib/llm/src/kv_router/sequence.rs (ActiveSequences).
- SGLang: sgl-project/sglang sgl-router/src/policies/cache_aware.rs at b6f20641, policies/tree.rs at
  4d40eec0, py_src/sglang_router/router_args.py at e46dcd87 (launch_router's defaults).
"""
import math
from types import SimpleNamespace

import pytest

from sim.core.request import make_request
from sim.core.status import FINISHED
from sim.predict import predict
from sim.records import requests_frame
from sim.simulator import simulate
from sim.routers.config import DynamoRouter, LlmDRouter, SglangRouter
from sim.routers.dynamo import DynamoKvRouter, softmax_pick
from sim.routers.llm_d import LlmDEndpointPicker, greedy_prefix_matches, queue_scores
from sim.routers.regret import RoutingRegret
from sim.routers.sglang import SglangCacheAware, is_imbalanced
from sim.routers.state import RoutedBlocks, prompt_block_hashes
from sim.scenario import validate_scenario

BS = 16


class FakeKV:
    """What a router reads of a replica's KV cache: block size, usage, the prefix hit of a new
    request (the engine's lookup) and the cached-block map's size."""

    def __init__(self, hit_tokens=0, usage=0.0, cached_blocks=0, usable_blocks=1000):
        self.block_size = BS
        self.usage = usage
        self.hit_tokens = hit_tokens
        self.pool = SimpleNamespace(cached=dict.fromkeys(range(cached_blocks)), usable_blocks=usable_blocks)

    def find_cached_prefix(self, req):
        return [], self.hit_tokens


def replicas(n=3, hits=None, usage=None, waiting=None, cached=None):
    hits, usage = hits or [0] * n, usage or [0.0] * n
    waiting, cached = waiting or [0] * n, cached or [0] * n
    return [SimpleNamespace(index=i, kv=FakeKV(hits[i], usage[i], cached[i]),
                            scheduler=SimpleNamespace(num_waiting=waiting[i]), submit=lambda req: None)
            for i in range(n)]


def request(id=0, prompt=160, key=7, arrival=0.0, warmup=False):
    return make_request(id, arrival, [(key, prompt)], 8, is_warmup=warmup)


# ----------------------------------------------------------------------------- llm-d

def test_llm_d_default_profile_scores_as_its_scorers_sum():
    """defaults.go: queue-scorer x2, kv-cache-utilization-scorer x2, prefix-cache-scorer x3.
    queue.go: (max - q) / (max - min); kvcache_utilization.go: 1 - usage; the precise prefix score
    (preciseprefixcache/utils.go absoluteScoredPods): cached leading blocks / prompt blocks."""
    reps = replicas(hits=[0, 64, 144], usage=[0.2, 0.5, 0.9], waiting=[0, 5, 10])
    router = LlmDEndpointPicker(reps, LlmDRouter(prefix_scorer="precise"), seed=0)
    req = request(prompt=160)                                   # 10 full blocks
    expected = [2 * 1.0 + 2 * (1 - 0.2) + 3 * 0.0,
                2 * 0.5 + 2 * (1 - 0.5) + 3 * 0.4,
                2 * 0.0 + 2 * (1 - 0.9) + 3 * 0.9]
    assert router.scores(req) == pytest.approx(expected, abs=0, rel=1e-15)
    assert router.choose(req) is reps[0]                        # 3.6 > 3.2 > 2.9


def test_llm_d_queue_scorer_is_neutral_when_queues_are_equal():
    """queue.go: all equal -> 1.0 for every endpoint (not 0/0)."""
    assert queue_scores([3, 3, 3]) == [1.0, 1.0, 1.0]
    assert queue_scores([2, 4, 6]) == [1.0, 0.5, 0.0]


def test_llm_d_max_score_picker_breaks_ties_at_random_from_the_scenario_seed():
    """picker/maxscore/picker.go: shuffle, stable sort by score, take the first: a tie is a
    uniform draw. Here the draw is seeded: the same seed picks the same sequence."""
    def picks(seed):
        router = LlmDEndpointPicker(replicas(4), LlmDRouter(prefix_scorer="precise"), seed=seed)
        return [router.choose(request(i, key=100 + i)).index for i in range(40)]
    assert picks(3) == picks(3)
    assert picks(3) != picks(4)
    assert set(picks(3)) == {0, 1, 2, 3}


def test_llm_d_approximate_index_learns_what_it_sent_and_scores_matched_over_total():
    """approximateprefix/plugin.go: the prompt hashed in blocks (a partial last block too), the
    chosen replica's LRU takes the hashes (PreRequest), prefix score = matched / total hashes."""
    reps = replicas(2, waiting=[0, 0])
    router = LlmDEndpointPicker(reps, LlmDRouter(), seed=0)
    first = router.choose(request(0, prompt=168, key=5))        # 10 full blocks + 8 tokens
    follow = request(1, prompt=168, key=5)
    scores = router.prefix_scores(follow)
    assert scores[first.index] == pytest.approx(10 / 11)        # the partial block is its own
    assert scores[1 - first.index] == 0.0
    assert router.choose(follow) is first


def test_llm_d_approximate_match_counts_every_holder_along_the_greedy_walk():
    """matchLongestPrefix: walk while any replica holds the hash, +1 for each holder, so a
    replica missing a middle block still counts the later ones it holds."""
    a, b = RoutedBlocks(), RoutedBlocks()
    a.touch([1, 3], 0.0)
    b.touch([1, 2], 0.0)
    assert greedy_prefix_matches([1, 2, 3, 4], [a, b]) == [2, 2]
    assert greedy_prefix_matches([9, 1], [a, b]) == [0, 0]


def test_llm_d_lru_capacity_evicts_the_least_recent_hashes():
    """indexer.go: a per-replica LRU of lruCapacityPerServer hashes (autoTune: the replica's KV
    blocks); Add refreshes a hash, and evicts the least recent when full."""
    router = LlmDEndpointPicker(replicas(1 + 1), LlmDRouter(lru_capacity_per_server=4), seed=0)
    chosen = router.choose(request(0, prompt=96, key=5))        # 6 blocks
    kept = list(router.views[chosen.index].blocks)
    assert kept == prompt_block_hashes(request(0, prompt=96, key=5), BS)[2:]
    assert router.prefix_scores(request(1, prompt=96, key=5))[chosen.index] == 0.0


# ----------------------------------------------------------------------------- Dynamo

def test_dynamo_logit_is_overlap_weight_times_prefill_blocks_plus_decode_blocks():
    """selector.rs: logit = overlap_score_weight x prefill_tokens / block_size + decode_blocks, with
    prefill_tokens = active prefill tokens + isl - overlap x block_size and decode_blocks = active
    blocks + the request's new blocks (sequence.rs potential_blocks_and_tokens)."""
    reps = replicas(hits=[0, 64, 144])
    router = DynamoKvRouter(reps, DynamoRouter(overlap_score_weight=2.0), seed=0)
    busy = request(50, prompt=80, key=99)                       # 5 blocks in flight on replica 0
    router.active[0].add(busy, prompt_block_hashes(busy, BS), prefill_tokens=80)
    req = request(prompt=160)                                   # 10 blocks
    blocks = prompt_block_hashes(req, BS)
    logits = router.logits(160, blocks, [0, 4, 9], BS)
    assert logits == [2.0 * (80 + 160) / 16 + (5 + 10), 2.0 * (160 - 64) / 16 + 10, 2.0 * (160 - 144) / 16 + 10]
    assert router.choose(req) is reps[2]


def test_dynamo_defaults_are_its_config_rs():
    """KvRouterConfig::default: overlap_score_weight 1.0, router_temperature 0.0, use_kv_events
    true, router_ttl_secs 120, router_max_tree_size 2^20, router_prune_target_ratio 0.8."""
    c = DynamoRouter()
    assert (c.overlap_score_weight, c.router_temperature, c.use_kv_events) == (1.0, 0.0, True)
    assert (c.router_ttl_secs, c.router_max_tree_size, c.router_prune_target_ratio) == (120.0, 1 << 20, 0.8)


def test_dynamo_ties_go_to_the_smallest_tree_then_at_random():
    """selector.rs: several lowest logits -> the smallest indexer tree; all trees equal -> random."""
    router = DynamoKvRouter(replicas(3, cached=[50, 20, 20]), DynamoRouter(), seed=1)
    assert router.select([4.0, 4.0, 9.0]) == 1
    picks = {router.select([4.0, 4.0, 4.0]) for _ in range(50)}
    assert picks == {1, 2}
    even = DynamoKvRouter(replicas(3, cached=[7, 7, 7]), DynamoRouter(), seed=1)
    assert {even.select([1.0, 1.0, 1.0]) for _ in range(60)} == {0, 1, 2}


def test_dynamo_softmax_probabilities_scale_logits_by_their_range():
    """softmax_sample: p(w) proportional to exp(-(logit / (max - min)) / T); uniform when equal;
    the draw walks the cumulative probabilities."""
    p_low = 1 / (1 + math.exp(-1 / 0.5))                       # logits [10, 20], T = 0.5
    assert softmax_pick([10.0, 20.0], 0.5, p_low - 1e-9) == 0
    assert softmax_pick([10.0, 20.0], 0.5, p_low + 1e-9) == 1
    assert softmax_pick([3.0, 3.0, 3.0, 3.0], 2.0, 0.74) == 2


def test_dynamo_temperature_sampling_is_seeded_and_follows_the_softmax():
    def picks(seed):
        router = DynamoKvRouter(replicas(2), DynamoRouter(router_temperature=0.5), seed=seed)
        return [router.select([10.0, 20.0]) for _ in range(4000)]
    assert picks(7) == picks(7)
    share = picks(7).count(0) / 4000
    assert share == pytest.approx(1 / (1 + math.exp(-2)), abs=0.02)


def test_dynamo_bookkeeping_ends_prefill_at_first_token_and_frees_at_finish():
    """sequence.rs: mark_prefill_completed drops a request's prefill tokens; free drops its blocks."""
    reps = replicas(2)
    router = DynamoKvRouter(reps, DynamoRouter(), seed=0)
    req = request(0, prompt=160)
    index = router.choose(req).index
    active = router.active[index]
    assert active.prefill_tokens == 160 and len(active.block_refs) == 10
    req.first_token_step = 3
    router.choose(request(1, key=8))
    assert active.prefill_tokens == 0 and len(active.block_refs) == 10
    req.status = FINISHED
    router.choose(request(2, key=9))
    assert len(router.active[index].block_refs) == 10 * (router.in_flight.count(index) == 1)
    assert req.id not in active.blocks_of


def test_dynamo_without_kv_events_uses_its_own_index_with_a_ttl():
    """use_kv_events false (ApproxKvIndexer): overlaps from what the router sent, expiring after
    router_ttl_secs."""
    reps = replicas(2)
    router = DynamoKvRouter(reps, DynamoRouter(use_kv_events=False, router_ttl_secs=10.0), seed=0)
    first = router.choose(request(0, prompt=160, arrival=0.0)).index
    assert router.overlaps(request(1, arrival=5.0), prompt_block_hashes(request(1), BS), BS)[first] == 10
    assert router.overlaps(request(2, arrival=11.0), prompt_block_hashes(request(2), BS), BS)[first] == 0


# ----------------------------------------------------------------------------- SGLang

def test_sglang_defaults_are_launch_routers():
    """router_args.py: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5,
    eviction_interval_secs 120, max_tree_size 2^26."""
    c = SglangRouter()
    assert (c.cache_threshold, c.balance_abs_threshold, c.balance_rel_threshold) == (0.3, 64, 1.5)
    assert (c.eviction_interval_secs, c.max_tree_size) == (120.0, 1 << 26)


def test_sglang_imbalance_needs_both_thresholds():
    """cache_aware.rs: (max - min) > abs_threshold AND max > min x rel_threshold."""
    assert is_imbalanced([70, 5], 64, 1.5)
    assert not is_imbalanced([70, 50], 4, 1.5)         # relative spread too small
    assert not is_imbalanced([60, 0], 64, 1.5)         # absolute spread too small


def test_sglang_routes_to_the_match_above_threshold_else_the_smallest_tree():
    reps = replicas(3)
    router = SglangCacheAware(reps, SglangRouter(cache_threshold=0.5), seed=0)
    router.trees[1].touch(prompt_block_hashes(request(0, prompt=160, key=5), BS), 0.0)   # 10 blocks
    router.trees[2].touch(list(range(1000, 1003)), 0.0)
    assert router.choose(request(1, prompt=160, key=5)) is reps[1]                       # rate 1.0
    other = make_request(2, 0.0, [(5, 48), (6, 112)], 8)                                 # 3 of 10 blocks shared
    assert router.choose(other) is reps[0]                                               # rate 0.3: smallest


def test_sglang_switches_to_shortest_queue_when_imbalanced():
    reps = replicas(2)
    router = SglangCacheAware(reps, SglangRouter(balance_abs_threshold=2, balance_rel_threshold=1.0), seed=0)
    for i in range(3):
        router.in_flight.add(0, request(100 + i, key=100 + i))
    router.trees[0].touch(prompt_block_hashes(request(0, key=5), BS), 0.0)
    assert router.choose(request(1, key=5)) is reps[1]                       # 3 - 0 > 2: the least loaded
    assert router.trees[1].match(prompt_block_hashes(request(1, key=5), BS)) == 10   # and it enters its tree


def test_sglang_eviction_keeps_the_most_recent_paths_leaf_first():
    """tree.rs evict_tenant_by_size: least recently used leaves go first, down to max_tree_size."""
    reps = replicas(2)
    router = SglangCacheAware(reps, SglangRouter(eviction_interval_secs=10.0, max_tree_size=8 * BS), seed=0)
    old, new = prompt_block_hashes(request(0, key=5), BS), prompt_block_hashes(request(1, key=6), BS)
    router.trees[0].touch(old, 1.0)
    router.trees[0].touch(new[:4], 2.0)
    router.evict_due(9.0)
    assert router.trees[0].size_blocks() == 14
    router.evict_due(10.5)
    assert router.trees[0].size_blocks() == 8
    assert router.trees[0].match(new) == 4 and router.trees[0].match(old) == 4


# ----------------------------------------------------------------------------- regret

def test_regret_is_the_hits_lost_against_the_longest_cached_prefix_at_arrival():
    reps = replicas(3, hits=[0, 96, 32])
    regret = RoutingRegret()
    regret.observe(request(0, prompt=160), reps[2], reps)
    regret.observe(request(1, prompt=160), reps[1], reps)
    regret.observe(request(2, prompt=160, warmup=True), reps[0], reps)      # warm-up: not counted
    f = regret.figures()
    assert (f["requests"], f["requests_misrouted"], f["prompt_tokens"]) == (2, 1, 320)
    assert (f["oracle_hit_tokens"], f["routed_hit_tokens"], f["lost_hit_tokens"]) == (192, 128, 64)
    assert f["hit_rate_lost"] == 64 / 320 and f["regret_fraction"] == 64 / 192


# ----------------------------------------------------------------------------- schema and runs

def routers_scenario(router, replicas=3, **cluster):
    return validate_scenario({
        "name": router, "seed": 0, "model": "qwen2.5-0.5b", "device": "l4",
        "engine": {"max_model_len": 4096, "num_blocks": 600},
        "cluster": {"replicas": replicas, "router": router, **cluster},
        "workload": {"num_requests": 120, "arrival": {"process": "poisson", "rate": 20},
                     "prompt_len": {"dist": "uniform", "min": 16, "max": 64},
                     "output_len": {"dist": "uniform", "min": 8, "max": 32},
                     "shared_prefix": {"groups": 6, "length": 256, "fraction": 1.0}},
    })


def test_a_router_section_for_another_router_is_an_error():
    with pytest.raises(ValueError, match=r"cluster\.dynamo configures the dynamo router.*'llm_d'"):
        routers_scenario("llm_d", dynamo={"router_temperature": 0.5})
    routers_scenario("llm_d", dynamo={"router_temperature": 0.0})      # its defaults change nothing


@pytest.mark.parametrize("cluster, field", [
    ({"router": "dynamo", "dynamo": {"router_temperature": -1}}, "router_temperature"),
    ({"router": "sglang", "sglang": {"cache_threshold": 1.5}}, "cache_threshold"),
    ({"router": "llm_d", "llm_d": {"prefix_scorer": "exact"}}, "prefix_scorer"),
    ({"router": "llm_d", "llm_d": {"queue_weight": 1}}, "queue_weight"),
    ({"router": "nginx"}, "router"),
])
def test_bad_router_settings_name_the_field(cluster, field):
    router = cluster.pop("router")
    with pytest.raises(ValueError, match=field):
        routers_scenario(router, **cluster)


@pytest.mark.parametrize("router", ["llm_d", "dynamo", "sglang"])
def test_deployed_routers_run_deterministically_and_report_regret(router):
    first, second = predict(routers_scenario(router)).summary, predict(routers_scenario(router)).summary
    assert first == second
    regret = first["routing_regret"]
    assert regret["requests"] == 120 and 0 <= regret["lost_hit_tokens"] <= regret["oracle_hit_tokens"]
    assert first["requests_finished"] == 120


def test_built_in_routers_report_regret_only_when_asked():
    assert "routing_regret" not in predict(routers_scenario("round_robin")).summary
    assert predict(routers_scenario("round_robin", routing_regret=True)).summary["routing_regret"]["requests"] == 120


@pytest.mark.parametrize("router", ["llm_d", "dynamo", "sglang"])
def test_deployed_routers_see_the_same_states_with_the_fast_paths_on_or_off(router):
    """Leaps end before each routing (sim/simulator.py), so a router that reads queues, KV usage,
    cached blocks and its requests' progress routes every request the same on both paths."""
    s = routers_scenario(router, replicas=2)
    s = validate_scenario({**s.model_dump(mode="json"), "workload": {
        **s.workload.model_dump(mode="json", exclude_none=True),
        "multi_turn": {"turns": {"value": 3}, "think_time_s": 0.2}}})
    fast, _, _ = simulate(s, fast=True)
    slow, _, _ = simulate(s, fast=False)
    assert requests_frame(fast).equals(requests_frame(slow))
    assert fast.meta["routing_regret"] == slow.meta["routing_regret"]


def test_llm_d_approximate_skips_prompts_shorter_than_a_block():
    """hashing.go hashPrompt: a body smaller than one block gives no hashes: every score 0."""
    router = LlmDEndpointPicker(replicas(2), LlmDRouter(), seed=0)
    assert router.prefix_scores(request(0, prompt=BS - 1)) == [0.0, 0.0]
