"""Triton kernel that scatters new K/V rows into the paged cache (vLLM's reshape_and_cache).

Layouts and semantics match `reference.write_kv_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_dtype, check_last_dim_contiguous, check_same_device, check_shape


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
    tl.store(k_cache_ptr + k_dst, k, mask=mask)
    tl.store(v_cache_ptr + v_dst, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, check: bool = True) -> None:
    """Write key/value ([num_tokens, num_kv_heads, head_dim]) into cache slots; slot -1 = skip."""
    if check:
        _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    check_shape("k_cache", k_cache, 4)
    _, _, num_kv_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("key", key, (None, num_kv_heads, head_dim))
    check_shape("value", value, tuple(key.shape))
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    # One dtype throughout: a converting store would round differently in the interpreter.
    check_dtype("k_cache", k_cache, (torch.float16, torch.bfloat16, torch.float32))
    for name, t in (("key", key), ("value", value), ("v_cache", v_cache)):
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} must match k_cache's {k_cache.dtype}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_last_dim_contiguous(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
