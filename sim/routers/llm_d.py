"""llm-d's endpoint picker (the EPP, llm-d/llm-d-inference-scheduler 520af478, 2026-05, module
github.com/llm-d/llm-d-router): its default scheduling profile, pkg/epp/config/loader/defaults.go:
no filter; queue-scorer (weight 2), kv-cache-utilization-scorer (2), prefix-cache-scorer (3);
the max-score picker. Each scorer gives every replica a score in [0, 1]; the profile sums
score x weight (scheduling/scheduler_profile.go, runScorerPlugins, scorers in profile order);
the picker shuffles the replicas and takes the first of the highest (picker/maxscore/picker.go:
a random tie-break). Metrics are read at routing time (the EPP scrapes them every 50 ms: not
modelled)."""
from __future__ import annotations

from typing import Optional

from sim.core.request import Request
from sim.routers.config import LlmDRouter
from sim.routers.deployed import DeployedRouter
from sim.routers.regret import RoutingRegret
from sim.routers.state import RoutedBlocks, engine_hit_tokens, prompt_block_hashes

# requestcontrol/dataproducer/approximateprefix/types.go: defaultLRUCapacityPerServer, used where
# the replica reports no cache size (autoTune reads vLLM's num_gpu_blocks, which a replica has here)
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250


def queue_scores(waiting: list[int]) -> list[float]:
    """queue-scorer (scorer/queuedepth/queue.go): (max - q) / (max - min) of the waiting queue
    sizes (vllm:num_requests_waiting); 1.0 for all when they are equal."""
    low, high = min(waiting), max(waiting)
    if high == low:
        return [1.0] * len(waiting)
    return [(high - q) / (high - low) for q in waiting]


def kv_utilization_scores(usage: list[float]) -> list[float]:
    """kv-cache-utilization-scorer (scorer/kvcacheutilization/kvcache_utilization.go): 1 - usage
    (vllm:kv_cache_usage_perc, a fraction)."""
    return [1 - u for u in usage]


def greedy_prefix_matches(hashes: list[int], views: list[RoutedBlocks]) -> list[int]:
    """approx-prefix-cache-producer's matchLongestPrefix (approximateprefix/plugin.go): walk the
    prompt's hashes from the first while any replica holds the hash, counting one for each
    replica that holds it (a replica that lost a middle block still counts the later ones)."""
    counts = [0] * len(views)
    for h in hashes:
        holders = [i for i, view in enumerate(views) if h in view]
        if not holders:
            break
        for i in holders:
            counts[i] += 1
    return counts


def clamp01(score: float) -> float:
    """enforceScoreRange (scheduling/scheduler_profile.go)."""
    return 0.0 if score < 0 else 1.0 if score > 1 else score


class LlmDEndpointPicker(DeployedRouter):
    name = "llm_d"

    def __init__(self, replicas: list, config: LlmDRouter, seed: int, regret: Optional[RoutingRegret] = None):
        super().__init__(replicas, seed, regret)
        self.config = config
        self.views = [RoutedBlocks() for _ in replicas]          # the approximate index, per replica
        self._hashes: list[int] = []

    def pick(self, req: Request) -> int:
        scores = self.scores(req)
        order = self.rng.permutation(len(scores))                # ShuffleScoredEndpoints
        return int(max(order, key=lambda i: scores[i]))          # the first of the highest

    def scores(self, req: Request) -> list[float]:
        c = self.config
        queue = queue_scores([r.scheduler.num_waiting for r in self.replicas])
        kv = kv_utilization_scores([r.kv.usage for r in self.replicas])
        prefix = self.prefix_scores(req)
        return [clamp01(q) * c.queue_scorer_weight + clamp01(k) * c.kv_cache_utilization_scorer_weight
                + clamp01(p) * c.prefix_cache_scorer_weight for q, k, p in zip(queue, kv, prefix)]

    def prefix_scores(self, req: Request) -> list[float]:
        if self.config.prefix_scorer == "precise":
            return self.precise_prefix_scores(req)
        self._hashes = hashes = self.approximate_hashes(req)
        if not hashes:
            return [0.0] * len(self.replicas)
        return [n / len(hashes) for n in greedy_prefix_matches(hashes, self.views)]

    def precise_prefix_scores(self, req: Request) -> list[float]:
        """precise-prefix-cache-scorer (scorer/preciseprefixcache, utils.go absoluteScoredPods):
        the replica's longest run of cached leading blocks (llm-d-kv-cache v0.8.0 LongestPrefixScorer,
        GPU tier weight 1.0) / the prompt's full blocks (kvblock/token_processor.go: no partial
        block). The cached blocks are the engine's own (the KV events' view, without their delay)."""
        bs = self.replicas[0].kv.block_size
        total = req.prompt_len // bs
        if not total:
            return [0.0] * len(self.replicas)
        return [min(1.0, engine_hit_tokens(r, req) // bs / total) for r in self.replicas]

    def approximate_hashes(self, req: Request) -> list[int]:
        """hashPrompt (approximateprefix/hashing.go): the prompt in blocks of the engine's block size
        (autoTune), the last partial block hashed too, at most max_prefix_blocks_to_match blocks."""
        bs = self.replicas[0].kv.block_size
        if req.prompt_len < bs:                                  # "too small for prefix cache"
            return []
        hashes = list(prompt_block_hashes(req, bs))
        if req.prompt_len % bs:
            hashes.append(hash((hashes[-1] if hashes else req.salt, "partial", req.id)))
        return hashes[:self.config.max_prefix_blocks_to_match]

    def sent(self, index: int, req: Request) -> None:
        """PreRequest: the chosen replica's LRU index takes the prompt's hashes."""
        if self.config.prefix_scorer != "approximate" or not self._hashes:
            return
        view = self.views[index]
        view.touch(self._hashes, req.arrival)
        view.drop_oldest(self.lru_capacity(index))

    def lru_capacity(self, index: int) -> int:
        if self.config.lru_capacity_per_server is not None:
            return self.config.lru_capacity_per_server
        return self.replicas[index].kv.pool.usable_blocks or DEFAULT_LRU_CAPACITY_PER_SERVER
