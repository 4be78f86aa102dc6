"""Triton kernel that scatters new K/V rows into the paged cache (vLLM's reshape_and_cache).

Layouts and semantics match `reference.write_kv_reference`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._checks import check_dtype, check_last_dim_contiguous, check_same_device, check_shape
from .reference import FP8_DTYPES


@triton.jit
def _round_to_fp8(x, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """x (fp32) rounded to the nearest value of the fp8 format and clamped to +-FP8_MAX, still
    in fp32, so the conversion that follows is exact. (The interpreter's own fp32 -> fp8
    rounding loses the exponent carry: 7.94 became 4.0.) Ties round to even, as torch does."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_NORMAL_EXP)          # subnormals share the smallest quantum
    quantum = tl.exp2((exponent - MANTISSA_BITS).to(tl.float32))
    steps = tl.abs(x) / quantum                              # exact: quantum is a power of two
    nearest = tl.floor(steps + 0.5)
    odd = nearest - 2.0 * tl.floor(nearest * 0.5)
    nearest = tl.where((nearest - steps == 0.5) & (odd == 1.0), nearest - 1.0, nearest)   # ties to even
    magnitude = nearest * quantum
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def _store_kv(cache_ptr, dst, x, mask, scale_ptr, offs_h, NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr,
              FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    if FP8:
        scale = tl.load(scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)[:, None]
        x = _round_to_fp8(x.to(tl.float32) / scale, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP)
    tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0, MANTISSA_BITS: tl.constexpr = 3,
    MIN_NORMAL_EXP: tl.constexpr = -6,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:                       # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = tok.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + src * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    _store_kv(k_cache_ptr, k_dst, k, mask, k_scale_ptr, offs_h, NUM_KV_HEADS, FP8, FP8_MAX, MANTISSA_BITS,
              MIN_NORMAL_EXP)
    _store_kv(v_cache_ptr, v_dst, v, mask, v_scale_ptr, offs_h, NUM_KV_HEADS, FP8, FP8_MAX, MANTISSA_BITS,
              MIN_NORMAL_EXP)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, check: bool = True,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write key/value ([num_tokens, num_kv_heads, head_dim]) into cache slots; slot -1 = skip.
    Into an fp8 cache, each head's rows are divided by its scale (fp32 [num_kv_heads]),
    rounded to nearest and clamped to the format's range."""
    if check:
        _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype in FP8_DTYPES
    scales = (k_scale, v_scale) if fp8 else (slot_mapping, slot_mapping)     # unused when not fp8
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, *scales,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], **(_fp8_format(k_cache.dtype) if fp8 else {}),
    )


def _fp8_format(dtype: torch.dtype) -> dict:
    """Largest finite value, mantissa bits and smallest normal exponent of an fp8 format."""
    info = torch.finfo(dtype)
    mantissa = 3 if dtype == torch.float8_e4m3fn else 2
    return dict(FP8=True, FP8_MAX=float(info.max), MANTISSA_BITS=mantissa,
                MIN_NORMAL_EXP=int(round(math.log2(info.smallest_normal))))


def _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    check_shape("k_cache", k_cache, 4)
    _, _, num_kv_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("key", key, (None, num_kv_heads, head_dim))
    check_shape("value", value, tuple(key.shape))
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    # One dtype throughout (a converting store would round differently in the interpreter),
    # except into an fp8 cache, where the kernel quantizes with the scales.
    check_dtype("k_cache", k_cache, (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES))
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} must match k_cache's {k_cache.dtype}")
    if k_cache.dtype in FP8_DTYPES:
        check_dtype("key", key, (torch.float16, torch.bfloat16, torch.float32))
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None:
                raise ValueError(f"writing into an fp8 KV cache needs {name} (fp32, one per KV head)")
            check_shape(name, t, (k_cache.shape[2],))
            check_dtype(name, t, (torch.float32,))
    for name, t in (("key", key), ("value", value)):
        if k_cache.dtype not in FP8_DTYPES and t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} must match k_cache's {k_cache.dtype}")
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype {value.dtype} must match key's {key.dtype}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_last_dim_contiguous(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
