"""Random paged-attention inputs for tests, the AOT check and the benchmark (torch only)."""
from __future__ import annotations

import torch


def make_attention_inputs(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                          head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu", seed: int = 0, spare_blocks: int = 3,
                          shuffle: bool = True) -> dict:
    """Keyword arguments for `paged_attention` (and its reference, minus the two max_* hints).

    Each sequence s has seq_lens[s] context tokens of which the last q_lens[s] are queries.
    Physical blocks are a random permutation (shuffle) of a cache with `spare_blocks`
    unused blocks, and block tables have a spare column, so nothing relies on order or size.
    """
    if len(q_lens) != len(seq_lens) or any(q > s for q, s in zip(q_lens, seq_lens)):
        raise ValueError(f"need q_len <= seq_len per sequence, got {q_lens} / {seq_lens}")
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=g) if shuffle else torch.arange(num_blocks)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq, default=0) + 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = order[used:used + n]
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype)
    v_cache = torch.randn(cache_shape, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                   seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=query_start_loc)
    return {**{k: v.to(device) for k, v in tensors.items()}, "scale": head_dim ** -0.5,
            "max_query_len": max(q_lens, default=0), "max_seq_len": max(seq_lens, default=0)}
