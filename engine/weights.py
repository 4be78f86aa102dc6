"""Model weights: seeded random ones at Hugging Face's init scale, or a local HF folder.

Nothing is ever downloaded: `ModelSpec.weights` must name a folder holding config.json and
*.safetensors (one file, or shards with model.safetensors.index.json).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from engine.model import CausalLM
from sim.core.catalog import ModelSpec
from sim.core.hf_config import model_fields_from_hf_config


class WeightsError(ValueError):
    """A checkpoint that does not fit the model: names the folder, the tensor and the shapes."""


def build_model(spec: ModelSpec, device: torch.device | str | None = None,
                attention_backend: Optional[str] = None, seed: int = 0,
                max_positions: Optional[int] = None) -> CausalLM:
    """The model on `device` (CUDA when present), with spec.weights loaded or random ones."""
    if spec.quantization is not None:
        raise NotImplementedError(f"{spec.name}: quantized weights ({spec.quantization.method}) are simulator-only; "
                                  f"the engine runs models in {spec.dtype} (drop model.quantization to replay)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = attention_backend or ("triton" if device.type == "cuda" else "torch")
    with device:
        model = CausalLM(spec, backend, max_positions)
    if spec.weights is not None:
        load_weights(model, spec.weights)
    else:
        init_random_weights(model, seed)
    return model


def init_random_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """HF's init: normal(0, std) matrices, zero biases, unit norms. Deterministic per seed and device."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=generator)


# -- Hugging Face checkpoints -----------------------------------------------------------------

def spec_from_hf_folder(folder: Path | str) -> ModelSpec:
    return ModelSpec(**model_fields_from_hf_config(Path(folder)))


def checkpoint_names(spec: ModelSpec) -> dict[str, tuple[str, Optional[slice]]]:
    """HF tensor name -> (our parameter, the rows of it the tensor fills; None = all of it)."""
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    packed = {"self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
              "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
              "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
              "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
              "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter))}
    whole = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
             "mlp.down_proj.weight"]
    if spec.qk_norm:
        whole += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names: dict[str, tuple[str, Optional[slice]]] = {
        "model.embed_tokens.weight": ("model.embed_tokens", None),
        "model.norm.weight": ("model.norm.weight", None)}
    if not spec.tie_word_embeddings:
        names["lm_head.weight"] = ("lm_head", None)
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        names.update({prefix + n: (prefix + n, None) for n in whole})
        for hf, (ours, rows) in packed.items():
            names[f"{prefix}{hf}.weight"] = (f"{prefix}{ours}.weight", rows)
            if spec.qkv_bias and hf.startswith("self_attn"):
                names[f"{prefix}{hf}.bias"] = (f"{prefix}{ours}.bias", rows)
    return names


def load_weights(model: CausalLM, folder: Path | str) -> None:
    """Copy a local HF checkpoint into `model`, refusing any missing, extra or misshapen tensor."""
    folder = Path(folder)
    check_config(model.spec, folder)
    where = tensor_files(folder)
    targets = checkpoint_names(model.spec)
    missing = [n for n in targets if n not in where]
    if missing:
        raise WeightsError(f"{folder}: the checkpoint lacks {len(missing)} tensor(s) the "
                           f"{model.spec.architecture} model needs, first {missing[0]!r}"
                           f"{_expected_shape(model, targets[missing[0]])}")
    extra = [n for n in where if n not in targets and not _ignorable(n)]
    if extra:
        raise WeightsError(f"{folder}: {len(extra)} tensor(s) the {model.spec.architecture} model has no "
                           f"place for, first {extra[0]!r} (in {where[extra[0]].name})")
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        by_file[where[name]].append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device=str(model.device)) as f:
            for name in names:
                ours, rows = targets[name]
                dst = params[ours] if rows is None else params[ours][rows]
                shape = list(f.get_slice(name).get_shape())
                if shape != list(dst.shape):
                    raise WeightsError(f"{file}: tensor {name!r} has shape {shape}, the model spec "
                                       f"needs {list(dst.shape)}")
                dst.copy_(f.get_tensor(name))


def tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the shard index when there is one)."""
    if not folder.is_dir():
        raise WeightsError(f"weights folder {folder} does not exist (weights are never downloaded)")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        where = {n: folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        absent = sorted({f.name for f in where.values() if not f.exists()})
        if absent:
            raise WeightsError(f"{index} names shard {absent[0]}, which is not in {folder}")
        return where
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"no *.safetensors in {folder} (weights are never downloaded)")
    where = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), shard))
    return where


# Fields that change the tensors' shapes or the numbers computed from them.
_CHECKED_FIELDS = ("architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                   "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_theta", "rope_scaling",
                   "rms_norm_eps")


def check_config(spec: ModelSpec, folder: Path) -> None:
    """The folder's config.json must describe the model the spec builds."""
    try:
        cfg = model_fields_from_hf_config(folder)
    except (ValueError, FileNotFoundError) as e:
        raise WeightsError(f"weights folder {folder}: {e}") from None
    diffs = [f"{k}: config.json has {cfg[k]!r}, the model spec {getattr(spec, k)!r}"
             for k in _CHECKED_FIELDS if k in cfg and cfg[k] != getattr(spec, k)]
    if diffs:
        raise WeightsError(f"{folder}/config.json does not match the model spec '{spec.name}': "
                           + "; ".join(diffs))


def _ignorable(name: str) -> bool:
    # Tied checkpoints sometimes still carry lm_head.weight; old ones saved rotary buffers.
    return name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")


def _expected_shape(model: CausalLM, target: tuple[str, Optional[slice]]) -> str:
    ours, rows = target
    p = dict(model.named_parameters())[ours]
    return f" (shape {list((p if rows is None else p[rows]).shape)})"
