"""Model and device catalogs: the one source of truth for shapes and datasheet figures.

The simulator (memory, cost model) and the engine (model construction) both read a
`ModelSpec` from here, so the KV arithmetic and the real allocation cannot drift apart.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from sim.core.files import check_bounded, excerpt, load_package_yaml
from sim.core.quantization import WeightQuant
from sim.core.strict import StrictModel

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
Dtype = Literal["float32", "float16", "bfloat16"]
MIB = 1024 * 1024
MAX_DEVICE_MIB = 2**24          # 16 TiB: far above any accelerator, and int64-safe in bytes
# PCIe bandwidth per lane and direction, GB/s, by generation (the PCI-SIG's nominal 16 / 32 / 64 /
# 128 GB/s for x16 links of Gen3 / 4 / 5 / 6)
PCIE_LANE_GBPS = {3: 1.0, 4: 2.0, 5: 4.0, 6: 8.0}
DEFAULT_LINK_LATENCY_US = 10.0


AttentionKind = Literal["full_attention", "sliding_attention"]


class ModelSpec(StrictModel):
    name: str = Field(default="custom", description="the model's name (a catalog entry's, or your own)")
    hf_id: Optional[str] = Field(
        default=None,
        description="the Hugging Face id a catalog entry stands for (`simrun from-vllm` matches it)")
    architecture: Literal["llama", "qwen2", "qwen3"] = Field(
        default="llama",
        description="the decoder variant the engine builds: llama | qwen2 (QKV bias) | qwen3 (q/k norm); "
                    "MoE, sliding windows and quantized weights are the fields below")
    # Upper bounds far above any real model: they keep products (KV bytes, FLOPs) in range.
    num_layers: int = Field(gt=0, le=4096, description="decoder layers")
    hidden_size: int = Field(gt=0, le=2**20, description="model width")
    num_heads: int = Field(gt=0, le=2**14, description="attention (query) heads")
    num_kv_heads: int = Field(
        gt=0, le=2**14,
        description="KV heads (GQA); split over tp, at least one per GPU")
    head_dim: int = Field(gt=0, le=2**14, description="dimension of one head")
    intermediate_size: int = Field(gt=0, le=2**22, description="the dense SwiGLU MLP's width")
    vocab_size: int = Field(gt=0, le=2**24, description="vocabulary size (the LM head's rows)")
    max_position_embeddings: int = Field(
        default=4096, gt=0, le=2**27,
        description="the model's context length: max_model_len's default")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base")
    # free-form: bounded by _bounded_rope_scaling
    rope_scaling: Optional[dict[str, Any]] = Field(
        default=None,
        description="Hugging Face rope_scaling (llama3, yarn, linear, dynamic, longrope); yarn / linear / "
                    "dynamic stretch the context as vLLM derives max_model_len")
    rms_norm_eps: float = Field(default=1e-6, gt=0, description="RMSNorm epsilon")
    tie_word_embeddings: bool = Field(default=False, description="the LM head shares the embedding matrix")
    dtype: Dtype = Field(
        default="bfloat16",
        description="weights' and activations' dtype: float32 | float16 | bfloat16")
    weights: Optional[Path] = Field(
        default=None,
        description="a local Hugging Face folder (config.json + *.safetensors) for the engine; random "
                    "weights when unset")
    quantization: Optional[WeightQuant] = Field(
        default=None,
        description="quantized linear weights (see `WeightQuant`); null = every weight in `dtype`")
    sliding_window: Optional[int] = Field(
        default=None, gt=0, le=2**27,
        description="sliding-window attention: the window in tokens (null = full attention everywhere)")
    layer_types: Optional[list[AttentionKind]] = Field(
        default=None, max_length=4096,
        description="which layers use the window (full_attention | sliding_attention per layer); unset = "
                    "every layer (Mistral v0.1); Gemma-2/3 and gpt-oss interleave")
    num_experts: int = Field(
        default=0, ge=0, le=2**16,
        description="mixture of experts: routed experts per MoE layer; 0 = a dense MLP of intermediate_size")
    num_experts_per_tok: int = Field(
        default=0, ge=0, le=2**16,
        description="experts each token is routed to (top-k)")
    moe_intermediate_size: Optional[int] = Field(
        default=None, gt=0, le=2**22,
        description="one expert's FFN width")
    shared_expert_intermediate_size: int = Field(
        default=0, ge=0, le=2**22,
        description="always-active shared experts' total width (Qwen2-MoE, DeepSeek-style); 0 = none")
    attention_bias: bool = Field(
        default=False,
        description="biases on the attention projections and experts (gpt-oss), counted in the parameters")

    @field_validator("rope_scaling")
    @classmethod
    def _bounded_rope_scaling(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        # HF's rope_scaling is a flat mapping of scalars and short factor lists; refuse anything
        # bigger before a dump or a copy walks it.
        if v is not None:
            check_bounded(v, "rope_scaling", max_depth=3, max_items=4096)
        return v

    @model_validator(mode="after")
    def _heads_group(self) -> "ModelSpec":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self

    @model_validator(mode="after")
    def _sliding_layers(self) -> "ModelSpec":
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries, the model "
                                 f"{self.num_layers} layers")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is unset")
        return self

    @model_validator(mode="after")
    def _experts(self) -> "ModelSpec":
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be 1..num_experts ({self.num_experts}), "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size is None:
                raise ValueError("a MoE model (num_experts > 0) needs moe_intermediate_size")
        elif self.num_experts_per_tok or self.shared_expert_intermediate_size:
            raise ValueError("num_experts_per_tok / shared_expert_intermediate_size need num_experts > 0")
        return self

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2" or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_sliding_layers(self) -> int:
        """Layers that attend to the last `sliding_window` tokens only."""
        if self.sliding_window is None:
            return 0
        if self.layer_types is None:
            return self.num_layers
        return self.layer_types.count("sliding_attention")

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    def linear_shapes(self) -> list[tuple[str, int, int, int]]:
        """Every decoder weight matrix as (part, fan_in, fan_out, count over all layers).

        part is attention / mlp / experts / shared_experts: what tensor parallelism splits, what
        expert parallelism spreads and what each quantization format covers.
        """
        h, d, n = self.hidden_size, self.head_dim, self.num_layers
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes = [("attention", h, q + 2 * kv, n), ("attention", q, h, n)]
        if not self.is_moe:
            return shapes + [("mlp", h, 2 * self.intermediate_size, n), ("mlp", self.intermediate_size, h, n)]
        e, inter = self.num_experts, self.moe_intermediate_size
        shapes += [("experts", h, 2 * inter, n * e), ("experts", inter, h, n * e)]
        if self.shared_expert_intermediate_size:
            s = self.shared_expert_intermediate_size
            shapes += [("shared_experts", h, 2 * s, n), ("shared_experts", s, h, n)]
        return shapes

    def _small_params(self) -> int:
        """Biases, norms and the router: parameters outside the big matrices, kept in `dtype`."""
        h, d, n = self.hidden_size, self.head_dim, self.num_layers
        q, kv = self.num_heads * d, self.num_kv_heads * d
        per_layer = 2 * h
        if self.qkv_bias:
            per_layer += q + 2 * kv + (h if self.attention_bias else 0)
        if self.qk_norm:
            per_layer += 2 * d
        if self.is_moe:
            per_layer += h * self.num_experts                      # the router
            if self.attention_bias:                                  # expert biases (gpt-oss)
                per_layer += self.num_experts * (2 * self.moe_intermediate_size + h)
        return n * per_layer + h

    def _embedding_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return embed if self.tie_word_embeddings else 2 * embed

    def num_params(self) -> int:
        """Parameter count from the shape (embeddings, attention, SwiGLU MLP or experts, norms, LM head)."""
        linear = sum(fan_in * fan_out * count for _, fan_in, fan_out, count in self.linear_shapes())
        return linear + self._small_params() + self._embedding_params()

    def quantized(self, part: str) -> bool:
        q = self.quantization
        return q is not None and (not q.experts_only or part == "experts")

    def part_bytes(self, part: str) -> int:
        """Bytes of one part's matrices (see linear_shapes), quantized when the format covers it."""
        total = 0
        for p, fan_in, fan_out, count in self.linear_shapes():
            if p == part:
                one = (self.quantization.matrix_bytes(fan_in, fan_out) if self.quantized(part)
                       else fan_in * fan_out * self.dtype_bytes)
                total += one * count
        return total

    def weight_bytes(self) -> int:
        parts = {p for p, *_ in self.linear_shapes()}
        unquantized = (self._small_params() + self._embedding_params()) * self.dtype_bytes
        return unquantized + sum(self.part_bytes(p) for p in parts)

    def expert_bytes(self) -> int:
        """Bytes of one expert's matrices in one layer (what a step reads when the expert is hit)."""
        if not self.is_moe:
            return 0
        return self.part_bytes("experts") // (self.num_layers * self.num_experts)


class DeviceSpec(StrictModel):
    name: str = Field(default="custom", description="the device's name (a catalog entry's, or your own)")
    full_name: Optional[str] = Field(default=None, description="the product's full name")
    memory_mib: float = Field(gt=0, le=MAX_DEVICE_MIB, description="device memory (datasheet), MiB")
    bf16_tflops: float = Field(gt=0, description="dense bf16 tensor-core peak, TFLOP/s")
    fp8_tflops: Optional[float] = Field(
        default=None, gt=0,
        description="dense fp8 tensor-core peak, TFLOP/s; null where the part has none (before "
                    "Ada/Hopper/CDNA3): quantized GEMMs then run weight-only at the 16-bit peak, as vLLM's "
                    "Marlin does")
    int8_tops: Optional[float] = Field(
        default=None, gt=0,
        description="dense int8 tensor-core peak, TOP/s; null where the part has none")
    hbm_gbps: float = Field(gt=0, description="memory bandwidth, GB/s")
    link_gbps: float = Field(
        default=32.0, gt=0,
        description="GPU-to-GPU bandwidth for tp / dp / ep collectives, GB/s")
    link_latency_us: Optional[float] = Field(
        default=None, ge=0,
        description="latency per collective on an nvlink / infinity_fabric / generic link, µs (unset: "
                    "DEFAULT_LINK_LATENCY_US); refused on pcie cards")
    interconnect: Optional[Literal["nvlink", "infinity_fabric", "pcie"]] = Field(
        default=None, description="GPU-to-GPU link for tensor-parallel collectives: nvlink, infinity_fabric "
                                  "(link_gbps, link_latency_us) or pcie (pcie_gen x pcie_lanes, NCCL's ring "
                                  "model); unset: a generic link priced like nvlink")
    pcie_gen: Optional[Literal[3, 4, 5, 6]] = Field(
        default=None, description="PCIe generation of the card's host link (needed when interconnect is pcie)")
    pcie_lanes: Literal[1, 2, 4, 8, 16] = Field(default=16, description="PCIe lanes of the card's host link")
    peer_to_peer: bool = Field(
        default=True, description="PCIe cards: can GPUs read each other's memory over PCIe (false on GeForce "
                                  "cards, whose driver disables it: collectives then go through host memory)")
    reserved_mib: float = Field(
        default=0.0, ge=0, le=MAX_DEVICE_MIB,
        description="memory the simple memory plan keeps back (driver, runtime), MiB")
    visible_mib: Optional[float] = Field(
        default=None, gt=0, le=MAX_DEVICE_MIB,
        description="the total torch.cuda.mem_get_info reports (vLLM's \"Free memory on device (free/total GiB)\"), below memory_mib by the driver's reservation, MiB; from a public log where one printed it")
    visible_source: Optional[str] = Field(
        default=None, max_length=500,
        description="where visible_mib was printed (a URL: a vLLM startup log or torch's out-of-memory message)")
    cost_per_hour: Optional[float] = Field(
        default=None, ge=0,
        description="an illustrative price per GPU-hour in $ (`simrun plan --cost` overrides it)")
    source: Optional[str] = Field(default=None, description="the datasheet the figures come from (a URL)")
    profile: Optional[Path] = Field(
        default=None,
        description="a calibrated cost-model profile YAML (`simrun calibrate` writes one); unset: the "
                    "scenario's `step_times` (default trained)")

    @model_validator(mode="before")
    @classmethod
    def _pcie_link(cls, value: Any) -> Any:
        """A PCIe card's link bandwidth is its generation times its lanes (link_gbps, when given,
        must agree: two figures for one link would disagree silently)."""
        if not isinstance(value, dict) or value.get("interconnect") != "pcie":
            return value
        gen, lanes = value.get("pcie_gen"), value.get("pcie_lanes", 16)
        if gen not in PCIE_LANE_GBPS or lanes not in (1, 2, 4, 8, 16):
            return value            # the field validators name what is wrong
        if value.get("link_latency_us") is not None:
            raise ValueError("link_latency_us is for nvlink / infinity_fabric links: a PCIe card's collectives "
                             "are priced by NCCL's latency model (the cost model's pcie_latency_scale tunes it)")
        nominal = PCIE_LANE_GBPS[gen] * lanes
        given = value.get("link_gbps")
        if given is not None and given != nominal:
            raise ValueError(f"link_gbps {excerpt(given)} disagrees with PCIe Gen{gen} x{lanes} ({nominal:g} GB/s "
                             f"each way): leave link_gbps out for a PCIe card")
        return {**value, "link_gbps": nominal}

    @model_validator(mode="after")
    def _pcie_needs_generation(self) -> "DeviceSpec":
        if self.interconnect == "pcie" and self.pcie_gen is None:
            raise ValueError("interconnect pcie needs pcie_gen (3, 4, 5 or 6)")
        return self

    @property
    def link_latency_s(self) -> float:
        """Per-collective latency of an nvlink / infinity_fabric / generic link."""
        return (DEFAULT_LINK_LATENCY_US if self.link_latency_us is None else self.link_latency_us) * 1e-6

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mib * MIB)

    @property
    def reserved_bytes(self) -> int:
        return int(self.reserved_mib * MIB)


@lru_cache(maxsize=None)
def _catalog(kind: str) -> dict[str, dict[str, Any]]:
    text = resources.files("sim.core").joinpath("catalog", f"{kind}.yaml").read_text()
    return load_package_yaml(text)


def model_names() -> list[str]:
    return sorted(_catalog("models"))


def device_names() -> list[str]:
    return sorted(_catalog("devices"))


def model_names_by_hf_id() -> dict[str, str]:
    """Catalog model names by their Hugging Face id (models without one are left out)."""
    return {entry["hf_id"]: name for name, entry in _catalog("models").items() if entry.get("hf_id")}


def catalog_entry(kind: str, name: str) -> dict[str, Any]:
    """The raw catalog entry (a fresh dict), or KeyError naming the closest and the valid choices."""
    table = _catalog(kind)
    if not isinstance(name, str):
        raise ValueError(f"expected a {kind[:-1]} name from the catalog (text), got {excerpt(name)} "
                         f"(known: {', '.join(sorted(table))})")
    if name not in table:
        close = closest_names(name[:200], table)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise KeyError(f"unknown {kind[:-1]} {excerpt(name)}{hint} (known: {', '.join(sorted(table))})")
    return {"name": name, **table[name]}


def _squash(text: str) -> str:
    return "".join(ch for ch in str(text).lower() if ch.isalnum())


def closest_names(name: str, known) -> list[str]:
    """Catalog names a mistyped one most likely meant: every name containing it once case and
    punctuation are ignored ('H100' -> h100-nvl, h100-pcie, h100-sxm), else the nearest spelling."""
    import difflib

    want = _squash(name)
    if not want:
        return []
    containing = sorted(k for k in known if want in _squash(k))
    if containing:
        return containing
    squashed = {_squash(k): k for k in known}
    return [squashed[c] for c in difflib.get_close_matches(want, list(squashed), n=2, cutoff=0.6)]


def get_model(name: str) -> ModelSpec:
    return ModelSpec(**catalog_entry("models", name))


def get_device(name: str) -> DeviceSpec:
    return DeviceSpec(**catalog_entry("devices", name))


def model_fields_from_hf_config(path: Path) -> dict[str, Any]:
    """Read a Hugging Face config.json (or a folder holding one) into ModelSpec fields.

    Every field that changes memory or cost is modelled or refused naming the field
    (sim/core/hf_config.py). Only sim/scenario.py still imports it from here; new callers
    import sim.core.hf_config, and this forwarder goes once scenario.py does too.
    """
    from sim.core.hf_config import model_fields_from_hf_config as read

    return read(path)
