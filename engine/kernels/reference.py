"""Torch reference implementations of the paged-KV kernels (the CPU path and the test oracle).

Layouts (shared with the Triton kernels):
  k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping     : [num_tokens] int, slot = block_id * block_size + offset; -1 = skip
  q                : [num_tokens, num_heads, head_dim], sequences packed back to back
  query_start_loc  : [num_seqs + 1] int32, cumulative query lengths (q of seq s is
                     q[query_start_loc[s]:query_start_loc[s + 1]])
  seq_lens         : [num_seqs] int32, context length of each sequence after this step
                     (cached tokens + its new query tokens)
  block_tables     : [num_seqs, max_blocks_per_seq] int32, physical block of each logical block
Query token i of a sequence with q_len new tokens sits at position seq_len - q_len + i and
attends causally to positions 0..its own (the last `sliding_window` of them, with a window).
fp8 caches (float8_e4m3fn, float8_e5m2) hold K / k_scale and V / v_scale, scales fp32 with one
value per KV head; values are clamped to the format's largest finite value when written.
"""
from __future__ import annotations

import torch


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [..., kv_heads, d] as stored in a cache of `dtype`: divided by its head's scale and
    clamped for fp8, unchanged (but cast) otherwise."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale[:, None]).clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of cache rows x [..., kv_heads, d] (scale: one per KV head, fp8 only)."""
    return x.float() * scale[:, None] if x.dtype in FP8_DTYPES else x.float()


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatter each token's K/V ([num_tokens, num_kv_heads, head_dim]) into its cache slot."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize(key[keep], k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = quantize(value[keep], v_scale, v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first `seq_len` K (or V) rows, in order, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    rows = cache[block_table[:num_blocks].long()]              # [blocks, bs, kv_heads, d]
    return rows.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start_loc: torch.Tensor, scale: float,
                              out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None,
                              sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    Computed in fp32 with an explicit mask, one sequence at a time: slow and obvious.
    """
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        k = dequantize(gather_kv(k_cache, block_tables[s], seq_len), k_scale).repeat_interleave(group, dim=1)
        v = dequantize(gather_kv(v_cache, block_tables[s], seq_len), v_scale).repeat_interleave(group, dim=1)
        qs = q[lo:hi].float()                                   # [q_len, heads, d]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale    # [heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
