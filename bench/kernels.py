"""Triton paged-attention kernels: decode bandwidth and prefill throughput.

  python bench/kernels.py [--out bench/results/kernels.json]

On a CUDA GPU (Llama-3-8B attention shape: 32 query heads, 8 KV heads, head_dim 128, bf16):
* decode (one new token per sequence) over batch x context x block size: achieved bandwidth
  = K/V bytes read / median time, as % of the device-to-device copy bandwidth measured in
  the same run (read + write bytes / time, the practical DRAM ceiling), next to torch SDPA
  on contiguous K/V of the same shape (time ratio ours / SDPA; < 1 is faster);
* prefill of one causal prompt of 1k-8k tokens in TFLOP/s, next to SDPA.
Timings replay CUDA graphs, so launch overhead is excluded, as in a graph-captured engine;
rows with `kv_fits_in_l2` may be served partly from L2. Targets: decode at batch 64 x ctx
4096 >= 80% of copy bandwidth and <= 1.2x SDPA time.

Without CUDA it runs tiny shapes through the Triton interpreter in seconds (so the script
cannot rot) and writes the same JSON with device "cpu-interpreter"; those times mean nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the kernels' decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench._util import machine, write_json  # noqa: E402
from engine.kernels import paged_attention  # noqa: E402
from engine.kernels.paged_attention import default_config, sm_count, use_split_kv  # noqa: E402

CUDA = torch.cuda.is_available()
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
GPU_GRID = dict(batch=[1, 8, 64, 256], context=[512, 4096, 32768], block_size=[16, 32],
                prefill_tokens=[1024, 2048, 4096, 8192])
CPU_GRID = dict(batch=[1, 2], context=[40], block_size=[16, 32], prefill_tokens=[24])
TARGET = dict(batch=64, context=4096, min_pct_of_copy=80.0, max_ratio_vs_sdpa=1.2)


def time_ms(fn) -> float:
    """Median time of fn in ms: CUDA-graph replays on a GPU, one call in the interpreter."""
    if not CUDA:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench, do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except RuntimeError:  # capture failed: events around eager launches instead
        return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbs(device) -> float:
    """Device-to-device copy: bytes read + written per second."""
    n = (1 << 30) if CUDA else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / (time_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def to_paged(kv: torch.Tensor, block_size: int, generator: torch.Generator):
    """Contiguous [batch, kv_heads, ctx, d] -> (paged cache, block tables) over shuffled blocks."""
    batch, kv_heads, ctx, d = kv.shape
    per_seq = -(-ctx // block_size)
    order = torch.randperm(batch * per_seq, generator=generator).to(kv.device)
    block_tables = order.view(batch, per_seq).to(torch.int32)
    cache = torch.zeros(batch * per_seq, block_size, kv_heads, d, dtype=kv.dtype, device=kv.device)
    padded = per_seq * block_size
    for b in range(batch):  # one sequence at a time bounds the temporary copy
        rows = F.pad(kv[b], (0, 0, 0, padded - ctx)).view(kv_heads, per_seq, block_size, d)
        cache[block_tables[b].long()] = rows.permute(1, 2, 0, 3)
    return cache, block_tables


def fits(num_bytes: int) -> bool:
    if not CUDA:
        return True
    torch.cuda.empty_cache()  # earlier cases' blocks are cached, not free
    return num_bytes < 0.9 * torch.cuda.mem_get_info()[0]


def bench_decode(batch: int, ctx: int, block_size: int, dtype, device, copy_gbs: float) -> dict:
    group = HEADS // KV_HEADS
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8
    row = dict(batch=batch, context=ctx, block_size=block_size, kv_bytes=kv_bytes)
    if not fits(2 * kv_bytes):
        return {**row, "skipped": "not enough device memory"}
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, KV_HEADS, group, HEAD_DIM, dtype=dtype, device=device)
    k, v = (torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, dtype=dtype, device=device) for _ in "kv")
    k_cache, block_tables = to_paged(k, block_size, g)
    v_cache, _ = to_paged(v, block_size, g.manual_seed(0))
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q_ours, out = q.reshape(batch, HEADS, HEAD_DIM), torch.empty(batch, HEADS, HEAD_DIM, dtype=dtype, device=device)

    def ours():
        paged_attention(q_ours, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        HEAD_DIM ** -0.5, 1, ctx, out=out)

    def sdpa():  # the group's query heads as query rows of their KV head: no K/V repeat
        return F.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM ** -0.5)

    t_ours, t_sdpa = time_ms(ours), time_ms(sdpa)
    err = (out.float() - sdpa().reshape(batch, HEADS, HEAD_DIM).float()).abs().max().item()
    cfg = default_config(True, group, HEAD_DIM, dtype)
    gbs = kv_bytes / (t_ours * 1e-3) / 1e9
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if CUDA else 0
    return {**row, "split_kv": use_split_kv(1, batch, KV_HEADS, ctx, cfg, sm_count(torch.device(device))),
            "time_us": t_ours * 1e3, "sdpa_time_us": t_sdpa * 1e3, "ratio_vs_sdpa": t_ours / t_sdpa,
            "bandwidth_gbs": gbs, "pct_of_copy": 100 * gbs / copy_gbs, "kv_fits_in_l2": kv_bytes < l2,
            "max_abs_err_vs_sdpa": err}


def bench_prefill(tokens: int, dtype, device) -> dict:
    flops = 4 * HEADS * HEAD_DIM * tokens * (tokens + 1) // 2      # QK^T and PV, causal half
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=dtype, device=device)
    k, v = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, dtype=dtype, device=device) for _ in "kv")
    k_cache, block_tables = to_paged(k, 16, g)
    v_cache, _ = to_paged(v, 16, g.manual_seed(1))
    q_ours = q[0].transpose(0, 1).contiguous()                     # [tokens, heads, d]
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    out = torch.empty_like(q_ours)

    def ours():
        paged_attention(q_ours, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        HEAD_DIM ** -0.5, tokens, tokens, out=out)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=HEAD_DIM ** -0.5, enable_gqa=True)

    t_ours, t_sdpa = time_ms(ours), time_ms(sdpa)
    err = (out.float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    return dict(tokens=tokens, time_us=t_ours * 1e3, tflops=flops / (t_ours * 1e-3) / 1e12,
                sdpa_time_us=t_sdpa * 1e3, sdpa_tflops=flops / (t_sdpa * 1e-3) / 1e12,
                ratio_vs_sdpa=t_ours / t_sdpa, max_abs_err_vs_sdpa=err)


def target_check(decode_rows: list[dict]) -> dict:
    rows = [r for r in decode_rows if r["batch"] == TARGET["batch"] and r["context"] == TARGET["context"]
            and "time_us" in r]
    met = bool(rows) and all(r["pct_of_copy"] >= TARGET["min_pct_of_copy"]
                             and r["ratio_vs_sdpa"] <= TARGET["max_ratio_vs_sdpa"] for r in rows)
    return {**TARGET, "met": met if CUDA else None}


def print_tables(result: dict) -> None:
    print(f"device {result['device']}  copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s")
    print(f"{'batch':>6} {'ctx':>6} {'bs':>3} {'split':>5} {'us':>9} {'GB/s':>7} {'%copy':>6} "
          f"{'sdpa us':>9} {'x sdpa':>6} {'err':>8}")
    for r in result["decode"]:
        head = f"{r['batch']:>6} {r['context']:>6} {r['block_size']:>3}"
        if "skipped" in r:
            print(f"{head}  skipped: {r['skipped']}")
            continue
        print(f"{head} {str(r['split_kv']):>5} {r['time_us']:>9.1f} {r['bandwidth_gbs']:>7.0f} "
              f"{r['pct_of_copy']:>6.1f} {r['sdpa_time_us']:>9.1f} {r['ratio_vs_sdpa']:>6.2f} "
              f"{r['max_abs_err_vs_sdpa']:>8.1e}")
    print(f"\n{'tokens':>6} {'us':>9} {'TFLOP/s':>8} {'sdpa TFLOP/s':>12} {'x sdpa':>6} {'err':>8}")
    for r in result["prefill"]:
        print(f"{r['tokens']:>6} {r['time_us']:>9.1f} {r['tflops']:>8.1f} {r['sdpa_tflops']:>12.1f} "
              f"{r['ratio_vs_sdpa']:>6.2f} {r['max_abs_err_vs_sdpa']:>8.1e}")
    print(f"\ntarget (batch {TARGET['batch']} x ctx {TARGET['context']}): {result['target']['met']}")


def main(argv=None) -> int:
    grid = GPU_GRID if CUDA else CPU_GRID
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/kernels.json")
    for name, default in grid.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, nargs="+", default=default)
    args = ap.parse_args(argv)
    device = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16
    copy_gbs = copy_bandwidth_gbs(device)
    decode = [bench_decode(b, c, bs, dtype, device, copy_gbs)
              for bs in args.block_size for c in args.context for b in args.batch]
    prefill = [bench_prefill(n, dtype, device) for n in args.prefill_tokens]
    result = dict(
        device=torch.cuda.get_device_name() if CUDA else "cpu-interpreter",
        machine=machine(), torch=torch.__version__, triton=triton.__version__,
        shape=dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=str(dtype)[6:]),
        copy_bandwidth_gbs=copy_gbs, decode=decode, prefill=prefill)
    result["target"] = target_check(decode)
    print_tables(result)
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
