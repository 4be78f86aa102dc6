"""Fused elementwise kernels of the decoder layer: one launch each instead of 5-20 torch ops.

  add_rms_norm : residual += x (optional), then RMSNorm of the sum (HF's arithmetic: the
                 sum rounded to the model dtype, normalised in fp32, cast back, times weight)
  rotary       : neox-style rotary embedding of q and k in place, cos/sin read from tables
  silu_mul     : silu(gate) * up from the fused gate_up projection

Each matches the torch reference in engine/model.py bit for bit in fp32 and within one
rounding in 16-bit types (tests/engine/test_fused.py, under the interpreter). Rows are programs;
every load is masked (the interpreter does not check bounds) and 16-bit values are cast to
fp32 right after loading, so the same code runs interpreted and compiled.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)   # the sum, rounded as torch does
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = (x32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [rows, n] (of residual + x, with residual updated in place, if given)."""
    rows, n = x.shape
    _check_rows("x", x, n)
    if residual is not None:
        _check_rows("residual", residual, n, rows, x.dtype)
    out = torch.empty_like(x)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), eps,
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None)
    return out


@triton.jit
def _rotate_heads(base, tok, stride_t, stride_h, cos, sin, heads, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HALF)
    first = base + tok * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                   HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d)[None, :]
    _rotate_heads(q_ptr, tok, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HEADS_PAD, HALF)
    _rotate_heads(k_ptr, tok, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, HEADS_PAD, HALF)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, d] and k [tokens, kv_heads, d] in place (views of the qkv
    projection are fine: only the last dimension must be contiguous); cos/sin [positions, d/2] fp32."""
    tokens, _, d = q.shape
    if k.shape[0] != tokens or k.shape[2] != d or positions.shape != (tokens,):
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary: the last dimension of q, k, cos and sin must be contiguous")
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1],
            HEADS_PAD=triton.next_power_of_2(max(q.shape[1], k.shape[1])), HALF=d // 2)
    return q, k


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    gate = tl.load(gate_up_ptr + row * stride_in + col, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + N + col, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)     # silu rounded, as F.silu
    tl.store(out_ptr + row * stride_out + col, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [rows, 2 * n] (gate first): [rows, n]."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    _check_rows("gate_up", gate_up, two_n)
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                         N=n, BLOCK=block)
    return out


def _check_rows(name: str, t: torch.Tensor, n: int, rows: int | None = None, dtype=None) -> None:
    if t.dim() != 2 or t.shape[1] != n or (rows is not None and t.shape[0] != rows):
        raise ValueError(f"{name} must be [{rows if rows is not None else 'rows'}, {n}], got {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} dtype {t.dtype} must match {dtype}")


__all__ = ["add_rms_norm", "rotary", "silu_mul"]
