"""Model and device catalogs: the one source of truth for shapes and datasheet figures.

The simulator (memory, cost model) and the engine (model construction) both read a
`ModelSpec` from here, so the KV arithmetic and the real allocation cannot drift apart.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
Dtype = Literal["float32", "float16", "bfloat16"]
MIB = 1024 * 1024


class StrictModel(BaseModel):
    """Base for every schema object: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ModelSpec(StrictModel):
    name: str = "custom"
    hf_id: Optional[str] = None
    architecture: Literal["llama", "qwen2", "qwen3"] = "llama"
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(default=4096, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: Optional[dict[str, Any]] = None
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    tie_word_embeddings: bool = False
    dtype: Dtype = "bfloat16"
    # A local Hugging Face folder (config.json + *.safetensors) for the engine; random weights when unset.
    weights: Optional[Path] = None

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
    memory_mib: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0)
    link_gbps: float = Field(default=32.0, gt=0)
    link_latency_us: float = Field(default=10.0, ge=0)
    reserved_mib: float = Field(default=0.0, ge=0)
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
    if name not in table:
        import difflib

        close = difflib.get_close_matches(name, table, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise KeyError(f"unknown {kind[:-1]} '{name}'{hint} (known: {', '.join(sorted(table))})")
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
    try:
        cfg = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ValueError(f"no Hugging Face config at {config_file}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    archs = cfg.get("architectures") or []
    arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None)
    if arch is None:
        raise ValueError(f"{config_file}: architectures {archs} not supported "
                         f"(supported: {', '.join(sorted(_HF_ARCH))})")
    fields: dict[str, Any] = {"architecture": arch, "name": cfg.get("_name_or_path") or folder.name}
    for hf_key, ours in _HF_KEYS.items():
        if cfg.get(hf_key) is not None:
            fields[ours] = cfg[hf_key]
    rope = cfg.get("rope_parameters")   # transformers >= 5 nests rope_theta and the scaling here
    if rope:
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        fields["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "num_kv_heads" not in fields and "num_heads" in fields:
        fields["num_kv_heads"] = fields["num_heads"]
    if "head_dim" not in fields and "num_heads" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_heads"]
    scaling = fields.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        fields["rope_scaling"] = None
    if any(folder.glob("*.safetensors")):
        fields["weights"] = folder
    return fields
