"""Unified Triton paged attention (after vLLM's triton_unified_attention).

One kernel serves any mix of per-sequence query lengths: full prompts, prefill chunks,
prompt tails after a prefix-cache hit and single-token decodes. Layouts and semantics match
`reference.paged_attention_reference`.

Design:
* Grid (query blocks, KV heads[, segments]). A program owns BLOCK_Q query tokens of one
  sequence and all GROUP query heads that share its KV head (GQA packing), i.e.
  BLOCK_M = padded BLOCK_Q * GROUP rows, so every K/V tile is loaded once per group and
  tl.dot gets M >= 16. Axis 0 has total_tokens // BLOCK_Q + num_seqs programs, an upper
  bound on the query blocks; each program finds its sequence by binary search over
  query_start_loc and exits if it has no block.
* The context is read in tiles of TILE_SIZE tokens gathered through the block table token
  by token (block_tables[seq, pos // block_size], offset pos % block_size), so any block
  size works and a tile may span blocks. Online softmax in fp32 (base 2).
* Split-KV ("flash decoding") for small decode batches with long contexts: a third grid
  axis of NUM_SEGMENTS splits each program's tiles; segments write fp32 partial
  outputs, maxima and sums, and a reduce kernel merges them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import check_dtype, check_last_dim_contiguous, check_same_device, check_shape
from .reference import FP8_DTYPES

# Read when the kernels below are decorated, which fixes interpreted vs compiled for this process.
INTERPRET = triton.knobs.runtime.interpret
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters; `paged_attention` picks them unless one is passed (tests, tuning)."""
    block_m: int           # query rows per program (tokens x heads of a group), power of 2 >= 16
    tile_size: int         # context tokens per inner-loop step, power of 2 >= 16
    num_warps: int = 4
    num_stages: int = 3
    num_segments: int = 16  # split-KV path only; power of 2 >= 2
    prefetch: bool = False  # load tile t+1 while computing tile t (double-buffered K/V registers)


@functools.lru_cache(maxsize=None)
def default_config(decode: bool, group: int, head_dim: int,
                   dtype: torch.dtype = torch.float16) -> AttentionConfig:
    """Chosen from register/shared-memory use of the sm_90 builds (ptxas -v), not GPU timings.

    Decode: 16 rows (the smallest MMA tile) and 32-token tiles: ~80 registers, so many
    programs per SM to hide the memory latency of this bandwidth-bound loop.
    Prefill: 128 rows so each K/V tile serves many queries (wgmma), 64-token tiles, 8 warps.
    fp32 runs exact (non-tensor-core) dots, so it keeps tiles small to stay in registers.
    """
    rows = triton.next_power_of_2(group)
    if dtype == torch.float32:
        return AttentionConfig(block_m=max(16 if decode else 32, rows), tile_size=32 if head_dim <= 64 else 16)
    if decode:  # bandwidth-bound: keep the next tile's loads in flight (not measured on a GPU yet)
        return AttentionConfig(block_m=max(16, rows), tile_size=32 if head_dim <= 128 else 16, prefetch=True)
    if head_dim <= 128:
        return AttentionConfig(block_m=max(128, rows), tile_size=64, num_warps=8, num_stages=2)
    return AttentionConfig(block_m=max(64, rows), tile_size=32, num_warps=8, num_stages=2)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200, so the interpreter makes the same choices


def use_split_kv(max_query_len: int, num_seqs: int, num_kv_heads: int, max_seq_len: int,
                 cfg: AttentionConfig, num_sms: int) -> bool:
    """Split the context only for decode batches too small to fill the GPU (fewer
    (sequence, KV head) programs than SMs) whose contexts are long enough to give every
    segment at least one tile."""
    return (max_query_len <= 1 and num_seqs * num_kv_heads < num_sms
            and max_seq_len >= cfg.num_segments * cfg.tile_size)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """Last sequence whose first query block index (query_start // BLOCK_Q + seq) is <= q_block_global."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_tile(t, num_tiles, kv_end, block_table, k_cache_ptr, v_cache_ptr, kv_head,
               stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, offs_d,
               BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr):
    """Positions, in-context mask, K^T [d, tile] and V [tile, d] of context tile t. A tile
    inside one block reads one block-table entry (contiguous rows); otherwise each token its
    own. Tiles past the context (a prefetch beyond the last) load nothing: every K/V load is
    masked, and the block-table index is clamped to the last tile so it stays in the row."""
    pos = t * TILE_SIZE + tl.arange(0, TILE_SIZE)
    in_ctx = pos < kv_end
    if BLOCK_SIZE % TILE_SIZE == 0:
        first = tl.minimum(t, num_tiles - 1) * TILE_SIZE
        phys = tl.load(block_table + first // BLOCK_SIZE).to(tl.int64)
        slot = first % BLOCK_SIZE + tl.arange(0, TILE_SIZE)
    else:
        phys = tl.load(block_table + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
    k_off = phys * stride_kb + slot * stride_kt + kv_head * stride_kh
    v_off = phys * stride_vb + slot * stride_vt + kv_head * stride_vh
    k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=in_ctx[None, :], other=0.0)
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=in_ctx[:, None], other=0.0)
    return pos, in_ctx, k, v


# num_seqs and stride_bt (the block-table width) change every step: specialising on them
# (== 1, % 16 == 0) would mean recompiles inside timed runs.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    segm_out_ptr, segm_max_ptr, segm_sum_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    DOT_F32: tl.constexpr, FP8_KV: tl.constexpr, WINDOW: tl.constexpr, PREFETCH: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    # Row m holds query token m // GROUP of this block, head m % GROUP of the KV group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_local = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = seq_len - q_len + q_local               # absolute position: the causal limit
    tok = (q_start + q_local).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None], other=0.0)
    if DOT_F32:  # the interpreter's bf16 tl.dot multiplies bit patterns
        q = q.to(tl.float32)

    # Tiles up to the causal limit of the block's last row (from the window start of its first
    # row when a sliding window applies), shared out among the segments.
    kv_end = tl.minimum(seq_len - q_len + (q_block + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, TILE_SIZE)
    first_tile = 0
    if WINDOW > 0:
        first_tile = tl.maximum(seq_len - q_len + q_block * BLOCK_Q - WINDOW + 1, 0) // TILE_SIZE
    tiles_per_segment = tl.cdiv(num_tiles - first_tile, NUM_SEGMENTS)
    tile_lo = first_tile + segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)
    k_scale = 1.0
    v_scale = 1.0
    if FP8_KV:  # per-KV-head scales: they factor out of the dots
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    if PREFETCH:  # double buffering: tile t+1's K/V loads are in flight while tile t is computed
        pos, in_ctx, k, v = _load_tile(tile_lo, num_tiles, kv_end, block_table, k_cache_ptr, v_cache_ptr, kv_head,
                                       stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, offs_d,
                                       BLOCK_SIZE, TILE_SIZE)
    for t in range(tile_lo, tile_hi):
        if PREFETCH:
            next_pos, next_in_ctx, next_k, next_v = _load_tile(
                t + 1, num_tiles, kv_end, block_table, k_cache_ptr, v_cache_ptr, kv_head, stride_kb, stride_kt,
                stride_kh, stride_vb, stride_vt, stride_vh, offs_d, BLOCK_SIZE, TILE_SIZE)
        else:
            pos, in_ctx, k, v = _load_tile(t, num_tiles, kv_end, block_table, k_cache_ptr, v_cache_ptr, kv_head,
                                           stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, offs_d,
                                           BLOCK_SIZE, TILE_SIZE)
        if DOT_F32 or FP8_KV:  # fp8 widens exactly to q's type (or fp32 in the interpreter)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        # ieee: exact fp32 (not tf32) for fp32 inputs; 16-bit inputs use MMA either way.
        s = tl.dot(q, k, input_precision="ieee") * (qk_scale * k_scale)  # [BLOCK_M, TILE_SIZE], log2 domain
        visible = pos[None, :] <= q_pos[:, None]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row can be fully masked in a late segment; keep exp2 away from (-inf) - (-inf).
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee") * v_scale
        m_i = m_new
        if PREFETCH:
            pos, in_ctx, k, v = next_pos, next_in_ctx, next_k, next_v

    if NUM_SEGMENTS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:  # scratch [tokens, heads, segments(, head_dim)], contiguous fp32
        row = (tok * (tl.num_programs(1) * GROUP) + head) * NUM_SEGMENTS + segment
        tl.store(segm_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask[:, None])
        tl.store(segm_max_ptr + row, m_i, mask=row_mask)
        tl.store(segm_sum_ptr + row, l_i, mask=row_mask)


@triton.jit
def _reduce_segments_kernel(
    out_ptr, segm_out_ptr, segm_max_ptr, segm_sum_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (tok * tl.num_programs(1) + head) * NUM_SEGMENTS + offs_s
    seg_max = tl.load(segm_max_ptr + row)
    weight = tl.exp2(seg_max - tl.max(seg_max, axis=0))  # empty segments (max -inf) weigh 0
    total = tl.sum(tl.load(segm_sum_ptr + row) * weight, axis=0)
    acc = tl.load(segm_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, out: torch.Tensor | None = None, *,
                    force_split: bool | None = None,
                    config: AttentionConfig | None = None, check: bool = True,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context.

    An fp8 cache (float8_e4m3fn / float8_e5m2) holds K/V divided by k_scale / v_scale (fp32,
    one per KV head, or one for all); the kernel multiplies them back. sliding_window=W: a
    query at position p sees keys p-W+1..p only (Mistral, Gemma local layers).

    max_query_len / max_seq_len only steer the launch configuration (no device sync);
    results do not depend on them. force_split: None = heuristic, True/False = force the
    split-KV path on/off. Rows of `out` past query_start_loc[-1] are left unspecified.
    check=False skips the argument checks (a caller that checked the same shapes already).
    """
    if check:
        _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
        _check_fp8_and_window(q, k_cache, v_cache, k_scale, v_scale, sliding_window)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    fp8 = k_cache.dtype in FP8_DTYPES
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if config is not None:
        _check_config(config, group)
    cfg = config or default_config(max_query_len <= 1, group, head_dim, q.dtype)
    split = force_split
    if split is None:
        split = use_split_kv(max_query_len, num_seqs, num_kv_heads, max_seq_len, cfg, sm_count(q.device))
    num_segments = cfg.num_segments if split else 1

    block_q = cfg.block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    scratch = _split_scratch(q, num_segments)
    scales = (k_scale, v_scale) if fp8 else (_dummy(q.device),) * 2
    _attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *scratch, *scales,
        scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], TILE_SIZE=cfg.tile_size, NUM_SEGMENTS=num_segments,
        DOT_F32=INTERPRET and q.dtype == torch.bfloat16, FP8_KV=fp8, WINDOW=sliding_window or 0,
        PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, *scratch, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SEGMENTS=num_segments, num_warps=4,
        )
    return out


def _split_scratch(q: torch.Tensor, num_segments: int) -> tuple[torch.Tensor, ...]:
    """fp32 partial outputs, maxima and sums of the split path; unused dummies otherwise."""
    if num_segments == 1:
        return (_dummy(q.device),) * 3
    rows = (*q.shape[:2], num_segments)
    return (torch.empty(*rows, q.shape[2], dtype=torch.float32, device=q.device),
            torch.empty(rows, dtype=torch.float32, device=q.device),
            torch.empty(rows, dtype=torch.float32, device=q.device))


@functools.lru_cache(maxsize=None)
def _dummy(device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device)


def _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out) -> None:
    check_shape("k_cache", k_cache, 4)
    _, _, num_kv_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("q", q, (None, None, head_dim))
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of k_cache's {num_kv_heads} KV heads")
    if head_dim < 32 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [32, 256], got {head_dim}")
    check_shape("block_tables", block_tables, 2)
    num_seqs = block_tables.shape[0]
    check_shape("seq_lens", seq_lens, (num_seqs,))
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_dtype("q", q, _FLOAT_DTYPES)
    if v_cache.dtype != k_cache.dtype or (k_cache.dtype != q.dtype and k_cache.dtype not in FP8_DTYPES):
        raise ValueError(f"k_cache/v_cache dtypes {k_cache.dtype}/{v_cache.dtype} must match q's {q.dtype} "
                         f"(or both be fp8)")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        check_dtype(name, t, (torch.int32,))
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                   seq_lens=seq_lens, query_start_loc=query_start_loc)
    if out is not None:
        check_shape("out", out, tuple(q.shape))
        if out.dtype != q.dtype:
            raise ValueError(f"out dtype {out.dtype} must match q's {q.dtype}")
        tensors["out"] = out
    check_same_device(**tensors)
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                              **({"out": out} if out is not None else {}))
    if not (seq_lens.is_contiguous() and query_start_loc.is_contiguous()):
        raise ValueError("seq_lens and query_start_loc must be contiguous")


def _check_fp8_and_window(q, k_cache, v_cache, k_scale, v_scale, sliding_window) -> None:
    if k_cache.dtype in FP8_DTYPES:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None:
                raise ValueError(f"an fp8 KV cache needs {name} (fp32, one per KV head)")
            check_shape(name, t, (k_cache.shape[2],))
            check_dtype(name, t, (torch.float32,))
            check_same_device(q=q, **{name: t})
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale apply to an fp8 KV cache only, not {k_cache.dtype}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window!r}")


def _check_config(cfg: AttentionConfig, group: int) -> None:
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0
    if not (pow2(cfg.block_m) and cfg.block_m >= max(16, group)):
        raise ValueError(f"config.block_m must be a power of two >= max(16, group={group}), got {cfg.block_m}")
    if not (pow2(cfg.tile_size) and cfg.tile_size >= 16):
        raise ValueError(f"config.tile_size must be a power of two >= 16, got {cfg.tile_size}")
    if not (pow2(cfg.num_segments) and cfg.num_segments >= 2):
        raise ValueError(f"config.num_segments must be a power of two >= 2, got {cfg.num_segments}")


__all__ = ["AttentionConfig", "FP8_DTYPES", "default_config", "paged_attention", "sm_count", "use_split_kv"]
