"""Attention backends over the paged KV cache, and the per-step metadata they read.

Layouts and semantics are those of engine/kernels/reference.py. Every backend writes the
step's K/V for the whole batch before attending, so a request that hit blocks another
request registered in this same step reads them already filled.

  torch  : the CPU path. Decode rows (one query each) share one SDPA over a padded gather
           of their blocks; each longer query (a prefill chunk) gets its own SDPA. Batched
           gather + SDPA beats a per-sequence loop on CPU (docs/engine.md, "The CPU path").
  triton : engine.kernels, imported on first use (the CUDA path).
  dense  : no KV cache at all (slot_mapping is None): each sequence attends causally to its
           own new tokens. The profiling forward and the tests' unpaged oracle use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernels.reference import dequantize, write_kv_reference
from sim.core.memory import cdiv


@dataclass(frozen=True)
class LayerKV:
    """What differs between layers: the scales of an fp8 cache (fp32, one per KV head) and
    the sliding window (None: the whole context)."""
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    window: Optional[int] = None


FULL = LayerKV()


@dataclass
class AttentionMetadata:
    slot_mapping: Optional[torch.Tensor]    # [num_tokens] int64; None: no KV cache (dense)
    block_tables: Optional[torch.Tensor]    # [num_seqs, max_blocks_per_seq] int32, 0-padded
    seq_lens: torch.Tensor                  # [num_seqs] int32, context after this step
    query_start_loc: torch.Tensor           # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so the torch backend plans its gathers without reading the device.
    host_query_start_loc: list[int]
    host_seq_lens: list[int]

    @classmethod
    def dense(cls, query_lens: list[int], device: torch.device) -> "AttentionMetadata":
        """Sequences with no cached context and no cache to write: attention within the step."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        return cls(None, None, as_tensor(query_lens), as_tensor(starts), max(query_lens),
                   max(query_lens), 0, starts, list(query_lens))


class DenseAttention:
    def __init__(self, meta: AttentionMetadata):
        starts = meta.host_query_start_loc
        self.spans = list(zip(starts[:-1], starts[1:]))

    def __call__(self, q, k, v, k_cache, v_cache, scale: float, layer: LayerKV = FULL) -> torch.Tensor:
        out = torch.empty_like(q)
        for lo, hi in self.spans:
            mask = None if layer.window is None else _visible(hi - lo, hi - lo, layer.window, q.device)
            out[lo:hi] = _sdpa(q[lo:hi], k[lo:hi], v[lo:hi], mask, scale)
        return out


class TorchPagedAttention:
    def __init__(self, meta: AttentionMetadata):
        self.slot_mapping = meta.slot_mapping
        bs = meta.block_size
        starts, seq_lens = meta.host_query_start_loc, meta.host_seq_lens
        device = meta.block_tables.device
        q_lens = [hi - lo for lo, hi in zip(starts[:-1], starts[1:])]
        single = [s for s, n in enumerate(q_lens) if n == 1]
        self.single_rows = None
        if single:
            host_lens = [seq_lens[s] for s in single]
            lens = torch.tensor(host_lens, device=device)
            width = cdiv(max(host_lens), bs)
            self.single_rows = torch.tensor([starts[s] for s in single], device=device)
            self.single_tables = meta.block_tables[torch.tensor(single, device=device), :width]
            self.single_keys = torch.arange(width * bs, device=device)
            self.single_lens = lens[:, None]
            self.single_masks = {}              # sliding window -> [seqs, 1, 1, keys]
        # (query span, its blocks, context length, new tokens): causal masks offset by the cached
        # context, made per sliding window on first use
        self.chunks = []
        for s, n in enumerate(q_lens):
            if n < 2:
                continue
            ctx = seq_lens[s]
            self.chunks.append((starts[s], starts[s + 1], meta.block_tables[s, :cdiv(ctx, bs)], ctx, n))
        self.chunk_masks = {}

    def _single_mask(self, window: Optional[int]) -> torch.Tensor:
        if window not in self.single_masks:
            keys, lens = self.single_keys, self.single_lens
            visible = keys < lens
            if window is not None:
                visible &= keys >= lens - window          # the query sits at position len - 1
            self.single_masks[window] = visible[:, None, None, :]
        return self.single_masks[window]

    def _chunk_mask(self, i: int, window: Optional[int]) -> Optional[torch.Tensor]:
        _, _, blocks, ctx, n = self.chunks[i]
        if n == ctx and window is None:
            return None                                     # plain causal
        if (i, window) not in self.chunk_masks:
            self.chunk_masks[i, window] = _visible(n, ctx, window, blocks.device)
        return self.chunk_masks[i, window]

    def __call__(self, q, k, v, k_cache, v_cache, scale: float, layer: LayerKV = FULL) -> torch.Tensor:
        write_kv_reference(k, v, k_cache, v_cache, self.slot_mapping, layer.k_scale, layer.v_scale)
        out = torch.empty_like(q)
        if self.single_rows is not None:
            keys = _read(k_cache[self.single_tables], layer.k_scale, q.dtype).flatten(1, 2).transpose(1, 2)
            values = _read(v_cache[self.single_tables], layer.v_scale, q.dtype).flatten(1, 2).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[self.single_rows].unsqueeze(2), keys, values,
                                               attn_mask=self._single_mask(layer.window), scale=scale,
                                               enable_gqa=True)
            out[self.single_rows] = o.squeeze(2)
        for i, (lo, hi, blocks, ctx, _) in enumerate(self.chunks):
            keys = _read(k_cache[blocks], layer.k_scale, q.dtype).flatten(0, 1)[:ctx]
            values = _read(v_cache[blocks], layer.v_scale, q.dtype).flatten(0, 1)[:ctx]
            out[lo:hi] = _sdpa(q[lo:hi], keys, values, self._chunk_mask(i, layer.window), scale)
        return out


def _read(rows: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., kv_heads, d] in the query's dtype (an fp8 cache dequantized)."""
    return rows if rows.dtype == dtype else dequantize(rows, scale).to(dtype)


def _visible(n: int, ctx: int, window: Optional[int], device) -> torch.Tensor:
    """[n, ctx] bool: the last n of ctx positions see earlier ones causally, within the window."""
    keys = torch.arange(ctx, device=device)[None, :]
    queries = torch.arange(ctx - n, ctx, device=device)[:, None]
    visible = keys <= queries
    if window is not None:
        visible &= keys > queries - window
    return visible


class TritonPagedAttention:
    """The kernels' argument checks run on the first layer of a step only: every layer gets
    tensors of the same shapes, dtypes and devices (~65 us of Python per call saved)."""

    def __init__(self, meta: AttentionMetadata):
        self.meta = meta
        self.write_kv, self.paged_attention = _triton_kernels()
        self.checked = False

    def __call__(self, q, k, v, k_cache, v_cache, scale: float, layer: LayerKV = FULL) -> torch.Tensor:
        m, check = self.meta, not self.checked
        self.checked = True
        self.write_kv(k, v, k_cache, v_cache, m.slot_mapping, check=check, k_scale=layer.k_scale,
                      v_scale=layer.v_scale)
        return self.paged_attention(q, k_cache, v_cache, m.block_tables, m.seq_lens, m.query_start_loc,
                                    scale, m.max_query_len, m.max_seq_len, check=check, k_scale=layer.k_scale,
                                    v_scale=layer.v_scale, sliding_window=layer.window)


@lru_cache(maxsize=None)
def _triton_kernels():
    from engine.kernels.kv_write import write_kv
    from engine.kernels.paged_attention import paged_attention
    return write_kv, paged_attention


def _sdpa(q, k, v, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """One sequence: q [n, heads, d], k/v [ctx, kv_heads, d]; causal when no mask is given."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=True)
    return o.transpose(0, 1)


BACKENDS = {"torch": TorchPagedAttention, "triton": TritonPagedAttention}


def make_attention(backend: str, meta: AttentionMetadata):
    """The step's attention callable: built once per forward, shared by every layer."""
    if meta.slot_mapping is None:
        return DenseAttention(meta)
    return BACKENDS[backend](meta)
