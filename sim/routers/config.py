"""The deployed routers' settings, one section each under `cluster`, with the defaults of the
release each cites (docs/whatif/routers.md lists the sources)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from sim.core.catalog import StrictModel

DEPLOYED_ROUTERS = ("llm_d", "dynamo", "sglang")
MAX_WEIGHT = 1e6
MAX_TREE = 1 << 40


class LlmDRouter(StrictModel):
    """llm-d's endpoint picker, its default scheduling profile (pkg/epp/config/loader/defaults.go,
    llm-d/llm-d-inference-scheduler 520af478, 2026-05): queue-scorer x2, kv-cache-utilization-scorer
    x2, prefix-cache-scorer x3, no filter, max-score picker with random tie-break."""

    prefix_scorer: Literal["approximate", "precise"] = Field(
        default="approximate",
        description="approximate: the prefix-cache-scorer over the router's own LRU index of what it sent "
                    "where (approx-prefix-cache-producer, the default profile) | precise: the "
                    "precise-prefix-cache-scorer over the replicas' real cached blocks (KV events)")
    queue_scorer_weight: float = Field(default=2.0, ge=0, le=MAX_WEIGHT,
                                       description="weight of the queue-scorer (waiting requests, min-max scaled)")
    kv_cache_utilization_scorer_weight: float = Field(
        default=2.0, ge=0, le=MAX_WEIGHT, description="weight of the kv-cache-utilization-scorer (1 - KV usage)")
    prefix_cache_scorer_weight: float = Field(
        default=3.0, ge=0, le=MAX_WEIGHT, description="weight of the prefix-cache scorer (matched / prompt blocks)")
    max_prefix_blocks_to_match: int = Field(
        default=256, ge=1, le=1 << 20,
        description="approximate: at most this many prompt blocks hashed (maxPrefixBlocksToMatch)")
    lru_capacity_per_server: Optional[int] = Field(
        default=None, ge=1, le=MAX_TREE,
        description="approximate: block hashes the index keeps per replica; unset: the replica's KV blocks "
                    "(autoTune from vLLM's cache config)")


class DynamoRouter(StrictModel):
    """NVIDIA Dynamo's KV router (lib/kv-router/src/scheduling/config.rs and selector.rs,
    ai-dynamo/dynamo): cost = overlap_score_weight x prefill blocks + decode blocks, lowest wins."""

    overlap_score_weight: float = Field(default=1.0, ge=0, le=MAX_WEIGHT,
                                        description="--kv-overlap-score-weight: weight of the prefill blocks")
    router_temperature: float = Field(
        default=0.0, ge=0, le=MAX_WEIGHT,
        description="--router-temperature: 0 picks the lowest cost, > 0 samples a softmax of the costs")
    use_kv_events: bool = Field(
        default=True,
        description="true: overlaps from the replicas' real cached blocks (KV events) | false: from the "
                    "router's own record of what it sent where, expiring after router_ttl_secs")
    router_ttl_secs: float = Field(default=120.0, gt=0, le=1e9,
                                   description="use_kv_events false: seconds a routed block stays in the index")
    router_max_tree_size: int = Field(default=1 << 20, ge=1, le=MAX_TREE,
                                      description="use_kv_events false: blocks in the index before pruning")
    router_prune_target_ratio: float = Field(
        default=0.8, ge=0, le=1, description="use_kv_events false: pruning keeps this fraction of max_tree_size")


class SglangRouter(StrictModel):
    """SGLang's cache-aware router as `python -m sglang_router.launch_router` starts it
    (sgl-router/py_src/sglang_router/router_args.py, sgl-project/sglang e46dcd87)."""

    cache_threshold: float = Field(
        default=0.3, ge=0, le=1,
        description="route to the best prefix match only when it covers more than this fraction of the prompt")
    balance_abs_threshold: int = Field(default=64, ge=0, le=1 << 40,
                                       description="imbalanced when max - min in-flight requests exceeds this ...")
    balance_rel_threshold: float = Field(default=1.5, ge=0, le=MAX_WEIGHT,
                                         description="... and max exceeds min x this: then shortest queue")
    eviction_interval_secs: float = Field(default=120.0, gt=0, le=1e9,
                                          description="seconds between LRU evictions of the approximate trees")
    max_tree_size: int = Field(default=1 << 26, ge=1, le=MAX_TREE,
                               description="tokens each replica's approximate tree keeps at an eviction")
