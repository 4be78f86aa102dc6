"""CUDA graphs for decode steps: one captured forward per padded batch size, replayed.

A decode step of n sequences (every sequence one new token, every one emitting) runs as the
graph of the smallest captured size N >= n: the inputs are copied into static buffers, rows
n..N padded (token 0 at position 0, slot -1 so nothing is written, context 1), the graph
replayed, and the first n rows of its logits and greedy samples read. Sizes follow vLLM's
capture list: 1, 2, 4, then multiples of 8 up to 248, then multiples of 16 up to 512, capped
at max_num_seqs. Larger batches, prefills, mixed steps and sampling at temperature > 0 run
eagerly. The split-KV choice of the attention kernel depends on the context length, so each
size that can split is captured twice (split and not).

Only on CUDA with the Triton backend; the CPU never builds this class (the padding and
bucketing below are plain functions, tested on CPU). KVTWIN_CUDA_GRAPHS=0 turns it off.
"""
from __future__ import annotations

import bisect
import os
from typing import Optional

import numpy as np
import torch

from engine.attention import AttentionMetadata

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, largest: int = MAX_CAPTURE_SIZE) -> list[int]:
    """vLLM's decode capture sizes up to min(max_num_seqs, largest), plus that cap itself."""
    cap = min(max_num_seqs, largest)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, largest + 1, 16))
    sizes = [s for s in sizes if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_size(n: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size holding n sequences; None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def pad_decode_inputs(input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                      seq_lens: np.ndarray, size: int) -> dict[str, np.ndarray]:
    """The step's per-sequence arrays padded to `size` rows: padding rows read one token of
    context and write nothing (slot -1), so they cannot disturb the real sequences."""
    n = len(input_ids)
    if n > size:
        raise ValueError(f"{n} sequences do not fit a graph of {size}")

    def pad(a, value, dtype):
        out = np.full(size, value, dtype=dtype)
        out[:n] = a
        return out
    return {"input_ids": pad(input_ids, 0, np.int64), "positions": pad(positions, 0, np.int64),
            "slot_mapping": pad(slot_mapping, -1, np.int64), "seq_lens": pad(seq_lens, 1, np.int32)}


def graphs_wanted(device: torch.device, backend: str, temperature: float) -> bool:
    return (device.type == "cuda" and backend == "triton" and temperature == 0
            and os.environ.get("KVTWIN_CUDA_GRAPHS", "1") != "0")


class DecodeGraphs:
    """The captured graphs of one runner (its pool, its block table), keyed (size, split)."""

    def __init__(self, runner, max_num_seqs: int):
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        largest = self.sizes[-1]
        device = runner.device
        runner.block_table.reserve(largest)
        self.table = runner.block_table.device_table
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.pool = None                        # the graphs' shared memory pool, made at first capture
        self.graphs: dict[tuple[int, bool], tuple] = {}

    def split_for(self, size: int, max_seq_len: int) -> bool:
        from engine.kernels.paged_attention import default_config, sm_count, use_split_kv

        spec, dtype = self.runner.model.spec, self.runner.model.dtype
        cfg = default_config(True, spec.num_heads // spec.num_kv_heads, spec.head_dim, dtype)
        return use_split_kv(1, size, spec.num_kv_heads, max_seq_len, cfg, sm_count(self.runner.device))

    def capture_all(self) -> int:
        """Capture every (size, split) variant, largest first (vLLM's order: the memory pool
        the largest one takes serves the rest)."""
        long_ctx = self.runner.max_model_len
        for size in reversed(self.sizes):
            for max_seq_len in {1, long_ctx}:
                key = (size, self.split_for(size, max_seq_len))
                if key not in self.graphs:
                    self.graphs[key] = self._capture(size, max_seq_len)
        return len(self.graphs)

    def _forward(self, size: int, max_seq_len: int):
        model, bs = self.runner.model, self.runner.block_size
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.table[:size], seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[:size + 1], max_query_len=1, max_seq_len=max_seq_len,
            block_size=bs, host_query_start_loc=list(range(size + 1)), host_seq_lens=[1] * size)
        hidden = model(self.input_ids[:size], self.positions[:size], meta)
        logits = model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    def _capture(self, size: int, max_seq_len: int):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.slot_mapping.fill_(-1)             # warm-up and capture write nothing into the pool
        self.seq_lens.fill_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(size, max_seq_len)     # compiles and allocates outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, sampled = self._forward(size, max_seq_len)
        return graph, logits, sampled

    def key(self, num_seqs: int, max_seq_len: int) -> Optional[tuple[int, bool]]:
        size = padded_size(num_seqs, self.sizes)
        if size is None or self.runner.block_table.device_table is not self.table:
            return None
        key = (size, self.split_for(size, max_seq_len))
        return key if key in self.graphs else None

    def run(self, key: tuple[int, bool], arrays: dict[str, np.ndarray], num_seqs: int):
        """Copy the padded inputs in, replay, return (logits, samples) of the real rows."""
        size = key[0]
        padded = pad_decode_inputs(arrays["input_ids"], arrays["positions"], arrays["slot_mapping"],
                                   arrays["seq_lens"], size)
        for name, values in padded.items():
            getattr(self, name)[:size].copy_(torch.from_numpy(values), non_blocking=True)
        graph, logits, sampled = self.graphs[key]
        graph.replay()
        # the outputs live in the graph's static memory: copies, so the next replay cannot
        # change a step result a caller still holds
        return logits[:num_seqs].clone(), sampled[:num_seqs].clone()
