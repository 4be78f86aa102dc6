"""LoRA adapters' scenario sections (`engine.lora`: vLLM's --enable-lora, --max-loras,
--max-lora-rank, --max-cpu-loras; `workload.lora`: which adapter each request asks for), the
adapters' bytes, the GPU buffers vLLM reserves for them, and their cost per step. The policy (the
max_loras limit of a step, the GPU slots and the CPU cache) is sim/core/lora.py;
docs/whatif/lora.md describes both.

What vLLM does (vllm/config/lora.py LoRAConfig; vllm/lora/layers/*.py, vllm/lora/punica_wrapper,
0.11-0.19):
- defaults: max_loras 1, max_lora_rank 16 (one of 1, 8, 16, 32, 64, 128, 256, 320, 512),
  max_cpu_loras = max_loras (>= max_loras required), lora_dtype = the model's dtype;
- every LoRA-capable linear layer (qkv_proj, o_proj, gate_up_proj, down_proj of each decoder
  layer) gets stacked A and B buffers of max_loras x max_lora_rank, allocated with the weights
  (so the profiled weights include them) whatever the adapters target. With tensor parallelism
  (fully_sharded_loras off) a column-parallel layer (qkv, gate_up) keeps A whole and shards B's
  outputs; a row-parallel one (o, down) shards A's inputs and keeps B whole;
- the kernels (punica's shrink x @ A then expand @ B, Triton) run over the buffers' full
  max_lora_rank for every token that has an adapter, reading each active adapter's A and B.
Not modelled: LoRA on MoE experts, the LM head and embeddings; fully_sharded_loras.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from sim.core.catalog import ModelSpec, StrictModel
from sim.core.strict import refuse_unread
from sim.core.lora import TARGET_MODULES, LoraStep, adapter_bytes, lora_layer_groups, reserved_bytes
from sim.core.request import stable_key

# vllm/config/lora.py MaxLoRARanks
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_ADAPTERS = 100_000
# Reading an adapter's safetensors from local disk into CPU memory: an assumption (a datacenter NVMe
# drive reads 3-7 GB/s sequentially; safetensors parsing and the copies into tensors take some of it),
# documented in docs/whatif/lora.md; engine.lora.disk_gbps sets another.
DEFAULT_DISK_GBPS = 2.0
# The shortest time one punica kernel (a shrink or an expand over one layer's slices) takes however
# little it computes: a Triton launch's fixed work, an assumption (docs/whatif/lora.md: the published
# comparison there moves from 0.972x to 0.956x as it goes from 0 to 5 µs). engine.lora.kernel_floor_us
# sets another.
DEFAULT_KERNEL_FLOOR_US = 2.0
_UNIT = float(1 << 63)


class LoraConfig(StrictModel):
    """engine.lora: vLLM's LoRA serving (--enable-lora and its limits); off when the section is absent."""

    max_loras: int = Field(default=1, ge=1, le=1024,
                           description="vLLM's --max-loras: the most distinct adapters one step may hold (its GPU slots)")
    max_lora_rank: int = Field(
        default=16, description="vLLM's --max-lora-rank: the rank every slot is sized (and computed) at; one of "
                                "1, 8, 16, 32, 64, 128, 256, 320, 512")
    max_cpu_loras: Optional[int] = Field(
        default=None, ge=1, le=MAX_ADAPTERS,
        description="vLLM's --max-cpu-loras: adapters kept in CPU memory (LRU), >= max_loras; unset: max_loras")
    disk_gbps: float = Field(
        default=DEFAULT_DISK_GBPS, gt=0, le=1e4,
        description="reading an adapter that is not in CPU memory from disk, GB/s (an assumption: "
                    "docs/whatif/lora.md)")
    pcie_gbps: Optional[float] = Field(
        default=None, gt=0, le=1e5,
        description="copying an adapter from CPU memory into a GPU slot, GB/s; unset: the device's PCIe host link")
    kernel_floor_us: float = Field(
        default=DEFAULT_KERNEL_FLOOR_US, ge=0, le=1e4,
        description="the shortest time of one punica shrink or expand kernel (one per LoRA layer group and "
                    "layer), µs")

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, v: int) -> int:
        if v not in VLLM_MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank {v}: vLLM accepts one of {', '.join(map(str, VLLM_MAX_LORA_RANKS))}")
        return v

    @model_validator(mode="after")
    def _cpu_default(self) -> "LoraConfig":
        if self.max_cpu_loras is None:
            self.__dict__["max_cpu_loras"] = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}), "
                             f"as vLLM's LoRAConfig requires")
        return self

    def policy(self) -> tuple:
        """The scheduler's settings (SchedulerConfig.lora)."""
        return self.max_loras, self.max_cpu_loras


class WorkloadLora(StrictModel):
    """workload.lora: which adapter each request asks for (vLLM's `model` field naming a --lora-modules
    adapter), drawn from the scenario's seed."""

    num_adapters: int = Field(ge=1, le=MAX_ADAPTERS, description="distinct adapters the requests use")
    distribution: Literal["uniform", "zipf"] = Field(
        default="uniform", description="uniform | zipf (adapter i, from 1, asked with weight 1 / i^zipf_s)")
    zipf_s: float = Field(default=1.0, gt=0, le=100, description="zipf: the exponent")
    rank: Union[int, list[int]] = Field(
        default=16, description="the adapters' rank: one for all, or a list of one per adapter; each at most "
                                "engine.lora.max_lora_rank")
    base_fraction: float = Field(default=0.0, ge=0, le=1,
                                 description="share of requests that ask for the base model (no adapter)")
    target_modules: list[Literal[TARGET_MODULES]] = Field(
        default=list(TARGET_MODULES), min_length=1, max_length=len(TARGET_MODULES),
        description="the projections the adapters train (their bytes, to load); vLLM's buffers and kernels "
                    "cover every projection whatever this says")

    @model_validator(mode="after")
    def _ranks(self) -> "WorkloadLora":
        refuse_unread(self, "distribution", {"zipf_s": ("zipf",)})
        ranks = self.rank if isinstance(self.rank, list) else [self.rank]
        if isinstance(self.rank, list) and len(self.rank) != self.num_adapters:
            raise ValueError(f"rank lists {len(self.rank)} ranks for num_adapters {self.num_adapters}: give one "
                             f"per adapter, or one number for all")
        if any(not 1 <= r <= 512 for r in ranks):
            raise ValueError(f"rank {self.rank}: each rank must lie in 1..512")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"target_modules {self.target_modules} lists a module twice")
        return self

    def rank_of(self, adapter: int) -> int:
        """The rank of adapter `adapter` (1-based)."""
        return self.rank[adapter - 1] if isinstance(self.rank, list) else self.rank

    @property
    def max_rank(self) -> int:
        return max(self.rank) if isinstance(self.rank, list) else self.rank

    def cumulative(self) -> list[float]:
        """The adapters' cumulative shares (1-based adapters in order)."""
        n = self.num_adapters
        weights = [1.0] * n if self.distribution == "uniform" else [1.0 / (i + 1) ** self.zipf_s for i in range(n)]
        total, acc, out = sum(weights), 0.0, []
        for w in weights:
            acc += w
            out.append(acc / total)
        out[-1] = 1.0
        return out


def scenario_problems(scenario) -> list[str]:
    """What a scenario's LoRA settings cannot be (the scenario's cross-field checks)."""
    eng, wl = scenario.engine.lora, scenario.workload.lora
    problems = []
    if wl is not None and eng is None:
        problems.append("workload.lora: requests ask for adapters but engine.lora is unset (vLLM serves "
                        "adapters only with --enable-lora); add an engine.lora section")
    if eng is None:
        return problems
    e = scenario.engine
    if e.batching != "continuous" or e.step_composition != "mixed":
        problems.append("engine.lora: modelled for vLLM V1's scheduler only (batching continuous, "
                        "step_composition mixed)")
    if scenario.model.is_moe:
        problems.append(f"engine.lora: LoRA on a mixture-of-experts model ({scenario.model.name}) is not modelled "
                        f"(its expert buffers); use a dense model or engine.lora: null")
    if scenario.cluster.disaggregation is not None:
        problems.append("engine.lora: not modelled with cluster.disaggregation")
    if wl is not None and wl.max_rank > eng.max_lora_rank:
        problems.append(f"workload.lora.rank: an adapter of rank {wl.max_rank} exceeds engine.lora.max_lora_rank "
                        f"{eng.max_lora_rank} (vLLM refuses to load it); raise max_lora_rank")
    return problems


def assign_adapters(requests, lora: Optional[WorkloadLora], seed: int):
    """Give each request its adapter (Request.lora_id, 0 = the base model) and keep requests with
    different adapters from sharing prefix-cache blocks (vLLM puts the adapter's name in every block
    hash's extra keys: vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`). One draw per
    conversation (turns of one conversation keep their adapter), from a hash of the seed: no other
    draw moves. Yields the requests (a stream stays a stream)."""
    if lora is None:
        yield from requests
        return
    cumulative = lora.cumulative()
    base = lora.base_fraction
    for req in requests:
        key = req.conversation if req.conversation is not None else req.id
        u = stable_key("lora", seed, key) / _UNIT
        if u < base:
            yield req
            continue
        v = (u - base) / (1.0 - base)
        adapter = next((i for i, c in enumerate(cumulative) if v < c), len(cumulative) - 1) + 1
        req.lora_id = adapter
        req.salt = stable_key("lora-salt", req.salt, adapter)
        yield req


# ----------------------------------------------------------------------------- bytes and cost

def scenario_reserved_bytes(scenario) -> int:
    """The scenario's LoRA buffers per GPU (0 without engine.lora)."""
    lora = getattr(scenario.engine, "lora", None)
    if lora is None:
        return 0
    return reserved_bytes(scenario.model, lora.max_loras, lora.max_lora_rank, scenario.parallelism.tp)


# ----------------------------------------------------------------------------- cost

class LoraCost:
    """A step's LoRA device time: the adapters copied into GPU slots (from CPU memory over PCIe,
    from disk first when not cached), then per layer and wrapped projection one shrink and one
    expand kernel, each max(FLOPs / peak, bytes / bandwidth, the kernel floor)."""

    def __init__(self, model: ModelSpec, tp: int, config: LoraConfig, workload: Optional[WorkloadLora],
                 peak_flops: float, hbm_bytes_s: float, pcie_bytes_s: float):
        r = config.max_lora_rank
        s = model.dtype_bytes
        self.layers = model.num_layers
        self.floor_s = config.kernel_floor_us * 1e-6
        groups = lora_layer_groups(model, tp)
        # per layer group: (shrink FLOPs per token, shrink bytes per token, A bytes per adapter,
        #                   expand FLOPs per token, expand bytes per token, B bytes per adapter)
        self.groups = []
        for _, slices in groups:
            n = len(slices)
            fan_in = slices[0][1]
            outs = sum(o for _, _, o in slices)
            self.groups.append((2 * fan_in * r * n, fan_in * s + r * n * 4, r * fan_in * s * n,
                                2 * r * outs, r * n * 4 + 2 * outs * s, r * outs * s))
        self.flop_s = 1.0 / peak_flops
        self.byte_s = 1.0 / hbm_bytes_s
        self.pcie_byte_s = 1.0 / pcie_bytes_s
        self.disk_byte_s = 1.0 / (config.disk_gbps * 1e9)
        modules = workload.target_modules if workload is not None else TARGET_MODULES
        self.h2d_bytes: dict = {}
        self.disk_bytes: dict = {}
        if workload is not None:
            for a in range(1, workload.num_adapters + 1):
                rank = workload.rank_of(a)
                self.h2d_bytes[a] = adapter_bytes(model, rank, modules, tp)
                self.disk_bytes[a] = adapter_bytes(model, rank, modules, 1)

    @classmethod
    def for_scenario(cls, scenario, peak_flops: float, flops_eff: float, bw_eff: float) -> Optional["LoraCost"]:
        config = scenario.engine.lora
        if config is None:
            return None
        from sim.core.offload import host_link_gbps

        pcie = config.pcie_gbps or host_link_gbps(scenario.device)
        return cls(scenario.model, scenario.parallelism.tp, config, scenario.workload.lora,
                   peak_flops * flops_eff, scenario.device.hbm_gbps * 1e9 * bw_eff, pcie * 1e9)

    def load_s(self, step: LoraStep) -> float:
        """Seconds the step's adapter loads add (before its forward: vLLM's worker loads them)."""
        t = 0.0
        for a in step.from_cpu:
            t += self.h2d_bytes[a] * self.pcie_byte_s
        for a in step.from_disk:
            t += self.disk_bytes[a] * self.disk_byte_s + self.h2d_bytes[a] * self.pcie_byte_s
        return t

    def loads_s(self, cpu_loads, disk_loads) -> float:
        """Seconds of a run's loads ({adapter: count} copied from CPU memory, read from disk first),
        summed over the replicas (each replica's loads hold up its own steps)."""
        t = 0.0
        for a in sorted(cpu_loads):
            t += cpu_loads[a] * self.h2d_bytes[a] * self.pcie_byte_s
        for a in sorted(disk_loads):
            t += disk_loads[a] * (self.disk_bytes[a] * self.disk_byte_s + self.h2d_bytes[a] * self.pcie_byte_s)
        return t

    def kernel_s(self, step: LoraStep) -> float:
        """Seconds of the step's punica kernels over every layer."""
        tokens, adapters, floor = step.tokens, step.adapters, self.floor_s
        flop_s, byte_s = self.flop_s, self.byte_s
        per_layer = 0.0
        for sf, sb, a_bytes, ef, eb, b_bytes in self.groups:
            per_layer += max(tokens * sf * flop_s, (tokens * sb + adapters * a_bytes) * byte_s, floor)
            per_layer += max(tokens * ef * flop_s, (tokens * eb + adapters * b_bytes) * byte_s, floor)
        return per_layer * self.layers

    def device_s(self, step: LoraStep) -> float:
        return self.load_s(step) + self.kernel_s(step)
