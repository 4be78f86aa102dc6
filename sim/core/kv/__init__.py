"""The paged KV cache in vLLM V1's shape (vllm/v1/core/, 0.19): a block pool shared by every KV
cache group (block_pool.py; the simulator's id-light variant is sim/core/fast/counting_pool.py), one manager per
group by attention type (single_type.py), a coordinator over them (coordinator.py) and the manager
the scheduler talks to (manager.py), which hands prefix hits out as `KVCacheBlocks` (blocks.py).
Code outside this package asks it questions (`layout()`, `is_one_full_attention_group`, ...) and
never reads how the cache is built (tests/repo/test_kv_encapsulation.py)."""
from sim.core.kv.block_pool import ANON, CACHED, EMPTY, NULL_BLOCK, PRIVATE, BlockPool
from sim.core.kv.blocks import NO_BLOCKS, CacheLayout, KVCacheBlocks, PrefixCacheStats
from sim.core.kv.coordinator import HybridCoordinator, UnitaryCoordinator
from sim.core.kv.manager import KVCacheManager, new_kv_manager
from sim.core.kv.single_type import FullAttentionManager, SlidingWindowManager, group_key

__all__ = ["ANON", "CACHED", "EMPTY", "NULL_BLOCK", "NO_BLOCKS", "PRIVATE", "BlockPool", "CacheLayout",
           "FullAttentionManager", "HybridCoordinator", "KVCacheBlocks", "KVCacheManager",
           "PrefixCacheStats", "SlidingWindowManager", "UnitaryCoordinator", "group_key", "new_kv_manager"]
