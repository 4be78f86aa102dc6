"""Model and device catalogs: the one source of truth for shapes and datasheet figures.

The simulator (memory, cost model) and the engine (model construction) both read a
`ModelSpec` from here, so the KV arithmetic and the real allocation cannot drift apart.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sim.core.files import check_bounded, excerpt, load_json, read_text

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
Dtype = Literal["float32", "float16", "bfloat16"]
MIB = 1024 * 1024
MAX_DEVICE_MIB = 2**24          # 16 TiB: far above any accelerator, and int64-safe in bytes


class StrictModel(BaseModel):
    """Base for every schema object: unknown keys are errors, values are re-validated on assignment."""

    # allow_inf_nan=False: every float field of every schema object is finite (`gt=0` admits .inf)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


class ModelSpec(StrictModel):
    name: str = "custom"
    hf_id: Optional[str] = None
    architecture: Literal["llama", "qwen2", "qwen3"] = "llama"
    # Upper bounds far above any real model: they keep products (KV bytes, FLOPs) in range.
    num_layers: int = Field(gt=0, le=4096)
    hidden_size: int = Field(gt=0, le=2**20)
    num_heads: int = Field(gt=0, le=2**14)
    num_kv_heads: int = Field(gt=0, le=2**14)
    head_dim: int = Field(gt=0, le=2**14)
    intermediate_size: int = Field(gt=0, le=2**22)
    vocab_size: int = Field(gt=0, le=2**24)
    max_position_embeddings: int = Field(default=4096, gt=0, le=2**27)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: Optional[dict[str, Any]] = None     # free-form: bounded by _bounded_rope_scaling
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    tie_word_embeddings: bool = False
    dtype: Dtype = "bfloat16"
    # A local Hugging Face folder (config.json + *.safetensors) for the engine; random weights when unset.
    weights: Optional[Path] = None

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

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def num_params(self) -> int:
        """Parameter count from the shape (embeddings, attention, SwiGLU MLP, norms, LM head)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * d
        per_layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + head + h

    def weight_bytes(self) -> int:
        return self.num_params() * self.dtype_bytes


class DeviceSpec(StrictModel):
    name: str = "custom"
    full_name: Optional[str] = None
    memory_mib: float = Field(gt=0, le=MAX_DEVICE_MIB)
    bf16_tflops: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0)
    link_gbps: float = Field(default=32.0, gt=0)
    link_latency_us: float = Field(default=10.0, ge=0)
    reserved_mib: float = Field(default=0.0, ge=0, le=MAX_DEVICE_MIB)
    cost_per_hour: Optional[float] = Field(default=None, ge=0)
    # A calibrated cost-model profile (validate/calibrate.py writes it); datasheet defaults when unset.
    profile: Optional[Path] = None

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mib * MIB)

    @property
    def reserved_bytes(self) -> int:
        return int(self.reserved_mib * MIB)


@lru_cache(maxsize=None)
def _catalog(kind: str) -> dict[str, dict[str, Any]]:
    text = resources.files("sim.core").joinpath("catalog", f"{kind}.yaml").read_text()
    return yaml.safe_load(text)


def model_names() -> list[str]:
    return sorted(_catalog("models"))


def device_names() -> list[str]:
    return sorted(_catalog("devices"))


def catalog_entry(kind: str, name: str) -> dict[str, Any]:
    """The raw catalog entry (a fresh dict), or KeyError naming the valid choices."""
    table = _catalog(kind)
    if not isinstance(name, str):
        raise ValueError(f"expected a {kind[:-1]} name from the catalog (text), got {excerpt(name)} "
                         f"(known: {', '.join(sorted(table))})")
    if name not in table:
        import difflib

        close = difflib.get_close_matches(name[:200], table, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise KeyError(f"unknown {kind[:-1]} {excerpt(name)}{hint} (known: {', '.join(sorted(table))})")
    return {"name": name, **table[name]}


def get_model(name: str) -> ModelSpec:
    return ModelSpec(**catalog_entry("models", name))


def get_device(name: str) -> DeviceSpec:
    return DeviceSpec(**catalog_entry("devices", name))


# Hugging Face config.json key -> our field.
_HF_KEYS = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "torch_dtype": "dtype",
    "dtype": "dtype",
}
_HF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
            "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def model_fields_from_hf_config(path: Path) -> dict[str, Any]:
    """Read a Hugging Face config.json (or a folder holding one) into ModelSpec fields."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config_file = path / "config.json" if path.is_dir() else path
    cfg = load_json(read_text(config_file, "Hugging Face config.json"), config_file)
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file}: a JSON {type(cfg).__name__}, expected an object (a Hugging Face config)")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise ValueError(f"{config_file}: architectures is {type(archs).__name__}, expected a list of class names")
    arch = next((_HF_ARCH[a] for a in archs if isinstance(a, str) and a in _HF_ARCH), None)
    if arch is None:
        raise ValueError(f"{config_file}: architectures {excerpt(archs, 120)} not supported "
                         f"(supported: {', '.join(sorted(_HF_ARCH))})")
    fields: dict[str, Any] = {"architecture": arch, "name": cfg.get("_name_or_path") or folder.name}
    for hf_key, ours in _HF_KEYS.items():
        if cfg.get(hf_key) is not None:
            fields[ours] = cfg[hf_key]
    rope = cfg.get("rope_parameters")   # transformers >= 5 nests rope_theta and the scaling here
    if rope and not isinstance(rope, dict):
        raise ValueError(f"{config_file}: rope_parameters is a {type(rope).__name__}, expected an object")
    if rope:
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        fields["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "num_kv_heads" not in fields and "num_heads" in fields:
        fields["num_kv_heads"] = fields["num_heads"]
    if "head_dim" not in fields and _positive_ints(fields.get("hidden_size"), fields.get("num_heads")):
        fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]
    scaling = fields.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        fields["rope_scaling"] = None
    if any(folder.glob("*.safetensors")):
        fields["weights"] = folder
    return fields


def _positive_ints(*values: Any) -> bool:
    return all(type(v) is int and v > 0 for v in values)
