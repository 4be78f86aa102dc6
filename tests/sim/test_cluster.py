"""Clusters and parallelism: routers, per-replica figures, and the tensor-parallel what-if."""
from types import SimpleNamespace

import pytest

import sim.router
from sim.core.catalog import get_device, get_model
from sim.costmodel import CostModel
from sim.core.memory import kv_bytes_per_token, plan_memory
from sim.predict import predict
from sim.scenario import validate_scenario
from sim.core.scheduler import Batch
from sim.whatif.sweep import run_sweep, split_sets


def cluster_scenario(router: str, replicas: int = 3, **workload):
    return validate_scenario({
        "name": router, "seed": 0, "model": "qwen2.5-0.5b", "device": "l4",
        "engine": {"max_model_len": 4096, "num_blocks": 400},
        "cluster": {"replicas": replicas, "router": router, "load_bound": 1.5},
        "workload": {"num_requests": 90, "arrival": {"process": "poisson", "rate": 30},
                     "prompt_len": {"dist": "uniform", "min": 16, "max": 64},
                     "output_len": {"dist": "uniform", "min": 8, "max": 32}, **workload},
    })


def per_replica(result, key: str) -> list:
    return [r[key] for r in result.summary["replicas"]]


# ----------------------------------------------------------------------------- routers

def test_round_robin_splits_requests_evenly_and_replicas_add_up():
    result = predict(cluster_scenario("round_robin"))
    assert per_replica(result, "requests") == [30, 30, 30]
    assert sum(per_replica(result, "request_throughput")) == pytest.approx(result.summary["request_throughput"])
    assert max(per_replica(result, "kv_blocks_peak")) == result.summary["kv_blocks_peak"]


def test_one_replica_has_no_per_replica_breakdown():
    assert "replicas" not in predict(cluster_scenario("round_robin", replicas=1)).summary


def test_least_outstanding_tokens_balances_tokens_where_round_robin_does_not():
    """All requests arrive at once, so nothing finishes while routing: least-outstanding is
    greedy balancing and leaves the replicas within one request of each other."""
    skewed = {"arrival": {"process": "offline"}, "num_requests": 60,
              "prompt_len": {"dist": "uniform", "min": 16, "max": 1500},
              "output_len": {"dist": "uniform", "min": 1, "max": 600}}

    def tokens_per_replica(router):
        df = predict(cluster_scenario(router, **skewed)).requests
        return (df["prompt_tokens"] + df["output_tokens"]).groupby(df["replica"]).sum()

    balanced, round_robin = tokens_per_replica("least_outstanding_tokens"), tokens_per_replica("round_robin")
    assert balanced.max() - balanced.min() <= 1500 + 600
    assert balanced.max() - balanced.min() < round_robin.max() - round_robin.min()


def shared_prefix_workload():
    return {"num_requests": 200, "arrival": {"process": "poisson", "rate": 40},
            "shared_prefix": {"groups": 12, "length": 512, "fraction": 1.0}}


def test_prefix_aware_routing_raises_the_hit_rate_within_the_load_bound(monkeypatch):
    """The pool (400 blocks of 16) holds about 12 prefixes of 32 blocks: round-robin makes every
    replica cache every prefix; prefix-aware keeps each prefix where it is cached."""
    checked = []
    original = sim.router.PrefixAware.choose

    def choose_within_bound(self, req):
        mean = sum(r.outstanding_tokens for r in self.replicas) / len(self.replicas)
        chosen = original(self, req)
        hit = chosen.kv.find_cached_prefix(req)[1]
        if hit and chosen is not min(self.replicas, key=lambda r: (r.outstanding_tokens, r.index)):
            assert chosen.outstanding_tokens <= self.load_bound * mean + req.max_len
            checked.append(req.id)
        return chosen

    monkeypatch.setattr(sim.router.PrefixAware, "choose", choose_within_bound)
    aware = predict(cluster_scenario("prefix_aware", **shared_prefix_workload())).summary
    spread = predict(cluster_scenario("round_robin", **shared_prefix_workload())).summary
    assert aware["prefix_hit_rate"] > spread["prefix_hit_rate"] + 0.05
    assert checked                                     # the bound was exercised, not vacuous
    assert min(r["requests"] for r in aware["replicas"]) > 0


def test_prefix_aware_skips_an_overloaded_replica_holding_the_prefix():
    def replica(index, outstanding, hit):
        kv = SimpleNamespace(find_cached_prefix=lambda req: ([], hit))
        return SimpleNamespace(index=index, outstanding_tokens=outstanding, kv=kv)

    req = SimpleNamespace(max_len=100)
    hot, idle, other = replica(0, 5000, 512), replica(1, 0, 0), replica(2, 200, 256)
    router = sim.router.PrefixAware([hot, idle, other], load_bound=1.5)
    assert router.choose(req) is other                 # the hot replica is past 1.5 x mean + 100
    router.load_bound = 10.0
    assert router.choose(req) is hot


# ----------------------------------------------------------------------------- tensor parallel

def test_tp_splits_weights_and_kv_heads_per_gpu():
    model = get_model("llama-3.1-8b")                  # 8 KV heads: tp=2 gives 4 per GPU
    one, two = (validate_scenario({"model": "llama-3.1-8b", "device": "l4", "parallelism": {"tp": tp},
                                   "engine": {"max_model_len": 4096}}) for tp in (1, 2))
    assert plan_memory(two).weight_bytes == -(-plan_memory(one).weight_bytes // 2)
    assert kv_bytes_per_token(model, 2) * 2 == kv_bytes_per_token(model, 1)
    assert plan_memory(two).num_blocks > 2 * plan_memory(one).num_blocks    # half the weights leave more KV


def test_tp_step_time_includes_two_all_reduces_per_layer():
    """Over NVLink (PCIe cards: tests/sim/test_cost_physics.py) a ring of the link's bandwidth plus its
    per-collective latency, twice per layer."""
    model = get_model("llama-3.1-8b")
    h100 = get_device("h100-sxm")
    free_link = h100.model_copy(update={"link_gbps": 1e12, "link_latency_us": 0.0})
    batch = Batch(0)
    batch.decodes, batch.num_decode = [None] * 32, 32
    batch.decode_ctx, batch.blocks_read = 32 * 500, 32 * 32
    paid = sum(CostModel(model, h100, tp=2).step_time(batch))
    free = sum(CostModel(model, free_link, tp=2).step_time(batch))
    ring, bytes_per_token = 2 * (2 - 1) / 2, model.hidden_size * model.dtype_bytes
    per_layer = 2 * 32 * ring * bytes_per_token / (h100.link_gbps * 1e9) + 2 * h100.link_latency_us * 1e-6
    assert paid - free == pytest.approx(model.num_layers * per_layer, rel=1e-6)


def test_tp2_on_two_l4s_vs_tp1_on_one_h100_is_one_zipped_sweep(tmp_path):
    raw = {"name": "tp", "seed": 0, "model": "llama-3.1-8b", "device": "h100-sxm",
           "engine": {"max_model_len": 2048, "prefix_caching": False},
           "workload": {"num_requests": 60, "arrival": {"process": "poisson", "rate": 2},
                        "prompt_len": {"dist": "uniform", "min": 64, "max": 256},
                        "output_len": {"dist": "uniform", "min": 16, "max": 64}}}
    _, axes = split_sets(["device=l4,h100-sxm", "parallelism.tp=2,1"])
    frame = run_sweep(raw, tmp_path, "tp.yaml", axes, zipped=True, quiet=True).frame.set_index("device")
    assert frame.loc["l4", "memory.weight_bytes"] * 2 == pytest.approx(frame.loc["h100-sxm", "memory.weight_bytes"],
                                                                       abs=1)
    assert frame.loc["l4", "gpus"] == 2 and frame.loc["l4", "cost_per_hour"] == pytest.approx(2 * 0.80)
    assert frame.loc["l4", "mean_step_s"] > frame.loc["h100-sxm", "mean_step_s"]
