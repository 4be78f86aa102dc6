"""Llama / Qwen2 / Qwen3 decoder on the paged KV cache, built from a ModelSpec.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are fused into
`qkv_proj` and `gate_up_proj` (one matmul each, as in vLLM); engine/weights.py maps the
checkpoint's names onto the fused rows. Parameters are created uninitialised and without
grad: weights.py fills them.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import FULL, AttentionMetadata, LayerKV, make_attention
from engine.moe import MoE, MoESpec
from sim.core.catalog import ModelSpec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32, cast back before the weight: what HF does, so bf16 results match it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama 3's long-context rescaling."""
    d = spec.head_dim
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (default, llama3)")
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate halves), as HF's Llama/Qwen; cos/sin tabled once in fp32."""

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(spec))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, spec.hidden_size, False, dtype)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        self.qk_norm = spec.qk_norm
        self.k_cache = self.v_cache = None      # views of the runner's pool, set by bind_kv_cache
        self.kv = FULL                          # fp8 scales and sliding window, set by bind_kv_cache

    def forward(self, x, positions, rotary: RotaryEmbedding, attention, ops) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:                        # Qwen3: per-head RMSNorm before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(positions, q, k, rotary)
        o = attention(q, k, v, self.k_cache, self.v_cache, self.scale, self.kv)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, False, dtype)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, moe: Optional[MoESpec] = None):
        """moe: the layer's feed-forward is a mixture of experts (engine/moe.py); by default
        the model's own (MoESpec.from_model), a dense SwiGLU MLP for a dense model."""
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        moe = moe or MoESpec.from_model(spec)
        self.mlp = MoE(moe, dtype) if moe else MLP(spec, dtype)

    def forward(self, h, residual, positions, rotary, attention, ops):
        """(this layer's output, the residual stream before it): the next layer (or the final
        norm) adds them, so the add fuses into its RMSNorm. Same sums as h + attn, h + mlp."""
        x, residual = ops.add_norm(h, residual, self.input_layernorm)
        h = self.self_attn(x, positions, rotary, attention, ops)
        x, residual = ops.add_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(x, ops), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.embed_tokens = _param(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(spec, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)


def layer_window(spec: ModelSpec, layer: int) -> Optional[int]:
    """The sliding window of a layer: every layer's when the model has one and no layer_types
    (Mistral v0.1), the `sliding_attention` layers' otherwise (Gemma-2/3, gpt-oss)."""
    window = getattr(spec, "sliding_window", None)
    kinds = getattr(spec, "layer_types", None)
    if window is None or (kinds is not None and kinds[layer] != "sliding_attention"):
        return None
    return window


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, attention_backend: str = "torch", max_positions: int | None = None):
        super().__init__()
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        self.attention_backend = attention_backend
        self.max_positions = max_positions or spec.max_position_embeddings
        self.model = DecoderModel(spec, self.dtype, self.max_positions)
        if not spec.tie_word_embeddings:
            self.lm_head = _param(spec.vocab_size, spec.hidden_size, dtype=self.dtype)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.device

    def bind_kv_cache(self, kv_cache: torch.Tensor, kv_scales: Optional[torch.Tensor] = None) -> None:
        """Point each layer at its K and V slices of the pool [layers, 2, blocks, bs, kv_heads, d],
        with its fp8 scales (kv_scales [layers, 2, kv_heads] fp32, fp8 pools only) and window."""
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            attn.k_cache, attn.v_cache = kv_cache[i, 0], kv_cache[i, 1]
            scales = (kv_scales[i, 0], kv_scales[i, 1]) if kv_scales is not None else (None, None)
            attn.kv = LayerKV(*scales, window=layer_window(self.spec, i))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [num_tokens, hidden] of a packed batch of sequences."""
        attention = make_attention(self.attention_backend, attn_metadata)
        ops = TRITON_OPS if self.attention_backend == "triton" else TORCH_OPS
        h, residual = F.embedding(input_ids, self.model.embed_tokens), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, positions, self.model.rotary, attention, ops)
        return ops.add_norm(h, residual, self.model.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head
        return F.linear(hidden, head).float()


class TorchOps:
    """The elementwise steps of a layer in plain torch: the CPU path and the reference."""

    @staticmethod
    def add_norm(h, residual, norm: RMSNorm):
        residual = h if residual is None else residual + h
        return norm(residual), residual

    @staticmethod
    def rotary(positions, q, k, rotary: RotaryEmbedding):
        return rotary(positions, q, k)

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonOps:
    """The same steps as one fused Triton launch each (engine.kernels.fused), with the Triton
    attention backend: the add goes into the norm, rotary works in place on the qkv views."""

    @staticmethod
    def add_norm(h, residual, norm: RMSNorm):
        from engine.kernels.fused import add_rms_norm

        if residual is None:                    # the first layer: the embeddings are the stream
            return add_rms_norm(h, norm.weight, norm.eps), h
        return add_rms_norm(h, norm.weight, norm.eps, residual), residual

    @staticmethod
    def rotary(positions, q, k, rotary: RotaryEmbedding):
        from engine.kernels.fused import rotary as fused_rotary

        return fused_rotary(positions, q, k, rotary.cos, rotary.sin)

    @staticmethod
    def silu_mul(gate_up):
        from engine.kernels.fused import silu_mul

        return silu_mul(gate_up)


TORCH_OPS, TRITON_OPS = TorchOps(), TritonOps()


class Sampler:
    """Greedy at temperature 0, else a seeded draw from softmax(logits / temperature)."""

    def __init__(self, temperature: float = 0.0, seed: int = 0, device: torch.device | str = "cpu"):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature = temperature
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
