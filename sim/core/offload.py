"""A CPU tier below the GPU prefix cache: vLLM's KV offloading (--kv-offloading-size).

What vLLM 0.19 does, and this module copies (vllm/config/vllm.py `_post_init_kv_transfer_config`,
vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py and worker.py,
vllm/v1/kv_offload/cpu/manager.py, cpu/spec.py, cpu/policies/lru.py and arc.py):

- capacity: `cpu_bytes_to_use` = size GiB x 2^30 over all ranks, divided by one offloaded
  block's bytes over all ranks (a GPU block x `block_size_factor`), rounded down;
- store, write-through: after every step, each scheduled request's newly *full* offloaded
  blocks (its computed tokens, output included) are prepared for storing: blocks already
  held are skipped, room is made by evicting ready, unreferenced blocks (LRU: least recently
  touched first; ARC: T1/T2 with ghost lists), and a store that cannot find room is skipped and
  retried next step. The copy starts at the next step's beginning (the worker defers it); the
  blocks become visible to lookups only once the request has finished (or was preempted) and
  its copies are done (`get_finished` reports a request's stores only after it finished);
- lookup (get_num_new_matched_tokens): only for a request with nothing computed, after the
  GPU hit: every block of the request is touched, then the run of ready blocks from the one
  holding the first token the GPU did not hit is counted; under one offloaded block: no hit;
- load: asynchronous. The request gets its GPU blocks at once, leaves the waiting queue
  (WAITING_FOR_REMOTE_KVS: no seat, no token budget) and comes back at the head of the
  queue once the copy is done, with the hit counted as computed (a full hit recomputes its
  last token). Its TTFT includes the wait.

Transfers: one host-to-device and one device-to-host channel per engine (PCIe is full duplex),
each copy queued behind the last on its channel: latency + bytes / bandwidth.

Not modelled: the GPU blocks a finished request keeps until its stores are done (vLLM delays
their free), a lookup that waits because another request is loading the same blocks, and the
hashes of a loading request's blocks being published at allocation rather than after the load.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, Optional

from pydantic import Field, model_validator

from sim.core.catalog import PCIE_LANE_GBPS, DeviceSpec, StrictModel
from sim.core.request import Request
from sim.core.status import Status
from sim.core.vllm_versions import dp_ranks_in_lockstep

GIB = 1 << 30
# LMCache's default chunk (LMCACHE_CHUNK_SIZE; vLLM 0.19's lmcache_integration/vllm_v1_adapter.py
# takes lmcache_chunk_size = 256): its unit of storing and lookup.
LMCACHE_CHUNK_TOKENS = 256
# The host link of parts whose catalog entry names no pcie_gen (their GPUs talk over NVLink /
# Infinity Fabric): PCIe Gen5 x16 on Hopper, Blackwell and MI300 boards, Gen4 x16 on A100
# (NVIDIA's H100 / H200 / A100 and AMD's MI300X datasheets: 128 / 64 GB/s both ways).
HOST_PCIE_GEN = {"a100-80g": 4, "a100-40g": 4}
DEFAULT_HOST_PCIE_GEN = 5
DEFAULT_LATENCY_US = 10.0     # per copy: a CUDA memcpy launch and its completion event


class KvOffload(StrictModel):
    """engine.kv_offload: vLLM's KV offloading to CPU memory (off when the section is absent)."""

    backend: Literal["native", "lmcache"] = Field(
        default="native",
        description="vLLM's --kv-offloading-backend: native (OffloadingConnector) | lmcache "
                    "(LMCacheConnectorV1, local CPU backend: 256-token chunks, LRU)")
    size_gib: float = Field(
        gt=0, le=1 << 20,
        description="vLLM's --kv-offloading-size: CPU memory for offloaded KV in GiB, summed over the "
                    "engine's ranks")
    eviction_policy: Literal["lru", "arc"] = Field(
        default="lru",
        description="the native CPU manager's cache policy (kv_connector_extra_config eviction_policy): "
                    "lru | arc; LMCache evicts by LRU")
    offloaded_block_size: Optional[int] = Field(
        default=None, ge=1, le=1 << 16,
        description="tokens per offloaded block (kv_connector_extra_config block_size), a multiple of "
                    "engine.block_size; unset: engine.block_size (native) or 256 (lmcache)")
    bandwidth_gbps: Optional[float] = Field(
        default=None, gt=0, le=1e5,
        description="host <-> device copy bandwidth each way, GB/s; unset: the device's PCIe host link "
                    "(its catalog pcie_gen, else Gen5 x16; Gen4 on A100)")
    latency_us: float = Field(
        default=DEFAULT_LATENCY_US, ge=0, le=1e6,
        description="fixed cost per copy, µs")

    @model_validator(mode="after")
    def _lmcache_is_lru(self) -> "KvOffload":
        if self.backend == "lmcache" and self.eviction_policy != "lru":
            raise ValueError("kv_offload.eviction_policy: LMCache's local CPU backend evicts by LRU only "
                             "(arc is the native backend's)")
        return self

    def offloaded_block_tokens(self, gpu_block_size: int) -> int:
        tokens = self.offloaded_block_size or (LMCACHE_CHUNK_TOKENS if self.backend == "lmcache" else gpu_block_size)
        if tokens % gpu_block_size:
            raise ValueError(f"engine.kv_offload.offloaded_block_size {tokens} must be a multiple of engine.block_size "
                             f"{gpu_block_size} (vLLM's OffloadingSpec asserts it)")
        return tokens


def host_link_gbps(device: DeviceSpec) -> float:
    """The device's PCIe host link, GB/s each way."""
    gen = device.pcie_gen or HOST_PCIE_GEN.get(device.name, DEFAULT_HOST_PCIE_GEN)
    return PCIE_LANE_GBPS[gen] * device.pcie_lanes


@dataclass
class OffloadStats:
    """What the tier did (summary.json's kv_offload section)."""

    lookups: int = 0               # admissions that asked the tier
    hit_tokens: int = 0            # tokens served from CPU to first admissions
    preempted_hit_tokens: int = 0  # ... and to preempted requests coming back (their own blocks, often)
    loads: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    blocks_stored: int = 0
    blocks_evicted: int = 0
    stores_skipped: int = 0        # a store that found no room (retried next step)
    load_wait_s: float = 0.0       # sum over loads of (copy done - admission)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _Block:
    __slots__ = ("ready_at", "refs")

    def __init__(self) -> None:
        self.ready_at = math.inf     # visible to lookups from this time on (inf: its store is pending)
        self.refs = 0                # loads reading it (an evictable block has none)

    def evictable(self, now: float) -> bool:
        return self.refs == 0 and self.ready_at <= now


class LruPolicy:
    """vLLM's LRUCachePolicy: one ordered map, least recently touched first."""

    def __init__(self, capacity: int):
        self.blocks: OrderedDict[int, _Block] = OrderedDict()

    def get(self, key: int) -> Optional[_Block]:
        return self.blocks.get(key)

    def insert(self, key: int, block: _Block) -> None:
        self.blocks[key] = block

    def touch(self, keys: list[int], now: float) -> None:
        for key in reversed(keys):          # the first block ends most recent: tails go first
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(self, n: int, protected: set, now: float) -> Optional[list[int]]:
        chosen = []
        for key, block in self.blocks.items():
            if len(chosen) == n:
                break
            if block.evictable(now) and key not in protected:
                chosen.append(key)
        if len(chosen) < n:
            return None
        for key in chosen:
            del self.blocks[key]
        return chosen


class ArcPolicy:
    """vLLM's ARCCachePolicy (vllm/v1/kv_offload/cpu/policies/arc.py, 0.19): T1 (seen once), T2
    (touched again), ghost lists B1 / B2 of evicted keys steering T1's target size."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: OrderedDict[int, _Block] = OrderedDict()
        self.t2: OrderedDict[int, _Block] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def get(self, key: int) -> Optional[_Block]:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: int, block: _Block) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def touch(self, keys: list[int], now: float) -> None:
        for key in reversed(keys):
            if key in self.t1:
                block = self.t1.pop(key)
                # a block still being stored was not really used twice: it stays in T1, as newest
                (self.t1 if block.ready_at > now else self.t2)[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                self.target_t1 = min(self.target_t1 + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target_t1 = max(self.target_t1 - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def evict(self, n: int, protected: set, now: float) -> Optional[list[tuple[int, bool]]]:
        chosen: list[tuple[int, bool]] = []
        taken: set = set()
        t1_size = len(self.t1)
        for _ in range(n):
            pick = None
            if t1_size >= int(self.target_t1):
                pick = self._first(self.t1, protected, taken, now, True)
                if pick is not None:
                    t1_size -= 1
            if pick is None:
                pick = self._first(self.t2, protected, taken, now, False)
            if pick is None:
                return None
            chosen.append(pick)
            taken.add(pick[0])
        for key, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return [key for key, _ in chosen]

    @staticmethod
    def _first(queue: OrderedDict, protected: set, taken: set, now: float, from_t1: bool):
        for key, block in queue.items():
            if block.evictable(now) and key not in protected and key not in taken:
                return key, from_t1
        return None


@dataclass
class _Load:
    done_at: float
    keys: list[int]
    computed: int          # the request's computed tokens once loaded
    order: int


@dataclass
class CpuTier:
    """One engine's CPU tier. The driver sets `now` (the step's start before `schedule`, its end
    before `finish_step`); the scheduler calls `match`, `start_load`, `take_loaded`, `after_step`
    and `request_done`."""

    capacity_blocks: int
    gpu_block_size: int
    block_factor: int                  # offloaded block / GPU block
    block_bytes: int                   # one offloaded block over all ranks
    bandwidth_Bps: float
    latency_s: float
    policy_name: str = "lru"
    now: float = 0.0
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __post_init__(self) -> None:
        self.policy = (ArcPolicy if self.policy_name == "arc" else LruPolicy)(self.capacity_blocks)
        self.num_held = 0
        self.h2d_free = 0.0            # when the host-to-device channel is next free
        self.d2h_free = 0.0
        self.loading: dict[Request, _Load] = {}
        self._next_stored: dict[Request, int] = {}        # next offloaded block index to store
        self._pending: dict[Request, list[int]] = {}      # keys stored, not yet visible
        self._store_done: dict[Request, float] = {}
        self._loads_started = 0

    @property
    def block_tokens(self) -> int:
        return self.gpu_block_size * self.block_factor

    # -- keys -------------------------------------------------------------------------------
    def _keys(self, req: Request, end_block: int, start_block: int = 0) -> list[int]:
        """The keys of offloaded blocks [start, end): the hash of each one's last GPU block."""
        f = self.block_factor
        req.extend_block_hashes(end_block * f, self.gpu_block_size)
        return req.block_hashes[start_block * f + f - 1: end_block * f: f]

    # -- lookup and load ---------------------------------------------------------------------
    def match(self, req: Request, gpu_hit_tokens: int) -> int:
        """Tokens beyond the GPU hit that the tier holds, ready, as vLLM's
        get_num_new_matched_tokens counts them (0: none worth loading)."""
        if req.is_live:                    # a live request's output tokens cannot be hashed ahead
            return 0
        bt = self.block_tokens
        num_blocks = (req.prompt_len + req.num_output) // bt
        if not num_blocks:
            return 0
        self.stats.lookups += 1
        keys = self._keys(req, num_blocks)
        self.policy.touch(keys, self.now)
        if num_blocks * bt - gpu_hit_tokens < bt:
            return 0
        start = gpu_hit_tokens // bt
        hits = 0
        for key in keys[start:]:
            block = self.policy.get(key)
            if block is None or block.ready_at > self.now:
                break
            hits += 1
        tokens = bt * (start + hits) - gpu_hit_tokens
        return tokens if tokens >= bt else 0

    def start_load(self, req: Request, gpu_hit_tokens: int, cpu_tokens: int) -> None:
        """Queue the copy of the matched blocks; the request waits in `loading` until it is done."""
        bt = self.block_tokens
        start, end = gpu_hit_tokens // bt, (gpu_hit_tokens + cpu_tokens) // bt
        keys = self._keys(req, end, start)
        for key in keys:
            self.policy.get(key).refs += 1
        nbytes = len(keys) * self.block_bytes
        begin = max(self.h2d_free, self.now)
        done = begin + self.latency_s + nbytes / self.bandwidth_Bps
        self.h2d_free = done
        computed = gpu_hit_tokens + cpu_tokens
        if computed >= req.prompt_len + req.num_output:      # a full hit recomputes its last token
            computed -= 1
        self._loads_started += 1
        self.loading[req] = _Load(done, keys, computed, self._loads_started)
        # blocks [0, end) need no store: they are on the CPU already (update_state_after_alloc)
        self._next_stored[req] = end
        s = self.stats
        s.loads += 1
        if req.num_preemptions:
            s.preempted_hit_tokens += cpu_tokens
        else:
            s.hit_tokens += cpu_tokens
        s.bytes_loaded += nbytes
        s.load_wait_s += done - self.now

    def take_loaded(self) -> list[Request]:
        """The requests whose copy is done by `now`, in the order their loads finish."""
        if not self.loading:
            return []
        done = sorted((ld.done_at, ld.order, req) for req, ld in self.loading.items() if ld.done_at <= self.now)
        out = []
        for _, _, req in done:
            load = self.loading.pop(req)
            for key in load.keys:
                block = self.policy.get(key)
                if block is not None:
                    block.refs -= 1
            req.num_computed = load.computed
            out.append(req)
        return out

    def next_load_done(self) -> float:
        return min((ld.done_at for ld in self.loading.values()), default=math.inf)

    def forget(self, req: Request) -> None:
        """A request aborted while loading: its blocks are no longer read."""
        load = self.loading.pop(req, None)
        if load is not None:
            for key in load.keys:
                block = self.policy.get(key)
                if block is not None:
                    block.refs -= 1
        self.request_done(req)

    # -- store -------------------------------------------------------------------------------
    def after_step(self, requests) -> None:
        """Write-through: store each scheduled request's newly full offloaded blocks (vLLM's
        _get_reqs_to_store, copied at the next step's start)."""
        bt = self.block_tokens
        for req in requests:
            if req.is_live:
                continue
            full = min(req.num_computed, req.prompt_len + req.num_output) // bt
            first = self._next_stored.get(req, 0)
            if full <= first:
                continue
            if self._store(req, self._keys(req, full, first), full):
                self._next_stored[req] = full

    def _store(self, req: Request, keys: list[int], full: int) -> bool:
        policy = self.policy
        new = [k for k in keys if policy.get(k) is None]
        if not new:
            return True
        short = len(new) - (self.capacity_blocks - self.num_held)
        if short > 0:
            evicted = policy.evict(short, set(keys), self.now)
            if evicted is None:
                self.stats.stores_skipped += 1
                return False
            self.num_held -= len(evicted)
            self.stats.blocks_evicted += len(evicted)
        for key in new:
            policy.insert(key, _Block())
        self.num_held += len(new)
        policy.touch(self._keys(req, full), self.now)
        nbytes = len(new) * self.block_bytes
        begin = max(self.d2h_free, self.now)
        self.d2h_free = begin + self.latency_s + nbytes / self.bandwidth_Bps
        self._store_done[req] = self.d2h_free
        self._pending.setdefault(req, []).extend(new)
        self.stats.blocks_stored += len(new)
        self.stats.bytes_stored += nbytes
        return True

    def request_done(self, req: Request) -> None:
        """A request finished or was preempted: its stored blocks become visible once copied."""
        self._next_stored.pop(req, None)
        keys = self._pending.pop(req, None)
        done = self._store_done.pop(req, self.now)
        if keys:
            ready = max(done, self.now)
            for key in keys:
                block = self.policy.get(key)
                if block is not None:
                    block.ready_at = ready


class OffloadScheduling:
    """The scheduler's part (a mixin `make_scheduler` puts in front of the reference
    Scheduler, with the tier as `offload`): the waiting pass looks a request up in the tier after
    its GPU hit and loads it asynchronously; loaded requests come back at the head; every step's
    filled blocks are written through; a request's stores become visible when it leaves RUNNING."""

    __slots__ = ()
    state = ()

    def abort(self, req: Request) -> None:
        if not req.is_finished:
            self.offload.forget(req)
        super().abort(req)

    def num_live(self) -> int:
        return super().num_live() + len(self.offload.loading)

    def _schedule_waiting(self, batch, budget: int) -> int:
        tier = self.offload
        if tier.loading:               # loads done: back at the head (vLLM's skipped queue)
            for req in reversed(tier.take_loaded()):
                self.waiting.add_preempted(req)
        return super()._schedule_waiting(batch, budget)

    def _admit(self, req: Request, admission, batch) -> Optional[int]:
        """A CPU hit is loaded asynchronously: blocks now, the request back once copied."""
        tier, kv = self.offload, self.kv
        hits, hit_tokens, _, gate, reserve = admission
        cpu_tokens = tier.match(req, hit_tokens) if not req.num_computed else 0
        if not cpu_tokens:
            return super()._admit(req, admission, batch)
        if not kv.allocate_slots(req, cpu_tokens, hits, gate_tokens=gate, reserve_free=reserve):
            return None
        resumed = req.status is Status.PREEMPTED
        self.waiting.pop_head()
        kv.stats.record(req.prompt_len + req.num_output, hit_tokens, resumed)
        tier.start_load(req, hit_tokens, cpu_tokens)
        return 0

    def finish_step(self, batch) -> list:
        # Write-through, before the step's finishers are freed (their stores then become visible);
        # what it stores does not depend on the tokens the step emits.
        self.offload.after_step(batch.prefills + batch.decodes)
        return super().finish_step(batch)

    def _preempt(self, victim: Request, batch) -> None:
        self.offload.request_done(victim)
        super()._preempt(victim, batch)

    def _free_finished(self, finished: list) -> None:
        for req in finished:
            self.offload.request_done(req)
        super()._free_finished(finished)


def build_cpu_tier(cfg: KvOffload, device: DeviceSpec, gpu_block_size: int, gpu_block_bytes_all_ranks: int) -> CpuTier:
    """The tier vLLM builds from the flags: CPU blocks = size / offloaded block bytes (all ranks)."""
    tokens = cfg.offloaded_block_tokens(gpu_block_size)
    factor = tokens // gpu_block_size
    block_bytes = gpu_block_bytes_all_ranks * factor
    capacity = int(cfg.size_gib * GIB) // block_bytes
    gbps = cfg.bandwidth_gbps or host_link_gbps(device)
    return CpuTier(capacity_blocks=capacity, gpu_block_size=gpu_block_size, block_factor=factor,
                   block_bytes=block_bytes, bandwidth_Bps=gbps * 1e9, latency_s=cfg.latency_us * 1e-6,
                   policy_name=cfg.eviction_policy)


def offload_tier(scenario, plan, kv) -> Optional[CpuTier]:
    """The CPU tier of one replica of a validated scenario, or None when engine.kv_offload is unset."""
    cfg = scenario.engine.kv_offload
    if cfg is None:
        return None
    if not kv.is_one_full_attention_group:
        raise ValueError("engine.kv_offload: vLLM 0.19's OffloadingConnector takes one KV cache group "
                         "(OffloadingConnectorScheduler asserts it); this model has sliding-window or hybrid groups")
    tp = scenario.parallelism.tp
    return build_cpu_tier(cfg, scenario.device, scenario.engine.block_size, plan.block_bytes * tp)


def offload_meta(replicas) -> dict:
    """summary.json's kv_offload section, summed over replicas ({} when no replica offloads)."""
    tiers = [(r.scheduler.offload, r.kv.stats) for r in replicas if r.scheduler.offload is not None]
    if not tiers:
        return {}
    total: dict = {"cpu_blocks": 0, "block_tokens": tiers[0][0].block_tokens, "gpu_hit_tokens": 0,
                   "gpu_preempted_hit_tokens": 0}
    for tier, gpu in tiers:
        total["cpu_blocks"] += tier.capacity_blocks
        total["gpu_hit_tokens"] += gpu.hits
        total["gpu_preempted_hit_tokens"] += gpu.preempted_hits
        for key, value in tier.stats.as_dict().items():
            total[key] = total.get(key, 0) + value
    total["cpu_hit_tokens"] = total.pop("hit_tokens")
    total["cpu_preempted_hit_tokens"] = total.pop("preempted_hit_tokens")
    return {"kv_offload": total}


def scenario_problem(scenario) -> Optional[str]:
    """Why a scenario's engine.kv_offload cannot be modelled as vLLM runs it, or None."""
    from sim.core.memory import kv_cache_groups

    cfg, engine = scenario.engine.kv_offload, scenario.engine
    if engine.batching != "continuous" or engine.allocation != "paged" or engine.step_composition != "mixed":
        return "is modelled for vLLM V1's engine only (continuous batching, paged allocation, mixed steps)"
    tokens = cfg.offloaded_block_size or (LMCACHE_CHUNK_TOKENS if cfg.backend == "lmcache" else engine.block_size)
    if tokens % engine.block_size:
        return (f"offloaded_block_size {tokens} must be a multiple of engine.block_size {engine.block_size} "
                f"(vLLM's OffloadingSpec asserts it)")
    groups = kv_cache_groups(scenario.model)
    if groups.is_hybrid or groups.full_groups > 1 or groups.sliding_groups:
        return ("is modelled for one full-attention KV cache group (vLLM 0.19's OffloadingConnectorScheduler "
                "asserts one group; a sliding window's freed blocks are not modelled in the tier); this model "
                "has sliding-window attention")
    if scenario.parallelism.dp > 1 and dp_ranks_in_lockstep(scenario.engine.vllm_version, scenario.model.is_moe):
        return "with data-parallel ranks stepping in lockstep (MoE, or dense before vLLM 0.14) is not modelled"
    if scenario.device.name == "cpu":
        return "needs a GPU device (vLLM's CPU offloading runs on CUDA-alike GPUs only, cpu/spec.py)"
    return None
