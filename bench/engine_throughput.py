#!/usr/bin/env python3
"""Offline throughput of the real engine: continuous batching + paged KV against static
batching + contiguous max_model_len reservation, on one model, one KV pool and the same
requests, in one run. Random weights (throughput does not depend on their values).

  python bench/engine_throughput.py                     # CUDA: qwen2.5-0.5b bf16, Triton, 256 requests
  python bench/engine_throughput.py --num-requests 32   # CPU: the tiny model, the torch backend

Prints a table and writes JSON (atomically, sim.output.io.write_json) to --out.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import machine, write_json  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from sim.core.catalog import MIB  # noqa: E402
from sim.core.kvcache import KVCacheManager  # noqa: E402
from sim.core.request import Request, make_request, stable_key  # noqa: E402
from sim.scenario import validate_scenario  # noqa: E402
from sim.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402

MODES = [("continuous", "paged"), ("static", "contiguous")]
CUDA = torch.cuda.is_available()


def parse_args() -> argparse.Namespace:
    # Defaults: a realistic serving shape on CUDA; on CPU a run of well under 30 s.
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b" if CUDA else "tiny")
    p.add_argument("--backend", default="triton" if CUDA else "torch", choices=["torch", "triton"])
    p.add_argument("--num-requests", type=int, default=256 if CUDA else 48)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[128, 1024] if CUDA else [16, 96],
                   metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 512] if CUDA else [4, 48],
                   metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=256 if CUDA else 16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192 if CUDA else 256)
    p.add_argument("--max-model-len", type=int, default=2048 if CUDA else 256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    # CPU: 129 blocks = the null block + 8 max_model_len reservations, so contiguous allocation
    # limits concurrency as it does on a loaded GPU (and no 15 GB pool is allocated).
    p.add_argument("--num-blocks", type=int, default=None if CUDA else 129,
                   help="KV pool size in blocks; planned from device memory when unset")
    p.add_argument("--host-batch", type=int, default=256,
                   help="also time the host side of one decode step of this many sequences (0: skip)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 suits tiny models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/engine_throughput.json"))
    return p.parse_args()


def device_entry() -> dict | str:
    """The catalog CPU, or the GPU at hand with the memory the driver reports."""
    if not CUDA:
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_mib": props.total_memory / MIB, "bf16_tflops": 1.0,
            "hbm_gbps": 1.0, "reserved_mib": 600}


def make_runner(args) -> ModelRunner:
    engine = {"block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
              "gpu_memory_utilization": args.gpu_memory_utilization, "num_blocks": args.num_blocks}
    scenario = validate_scenario({"model": args.model, "device": device_entry(), "seed": args.seed,
                                  "engine": {k: v for k, v in engine.items() if v is not None},
                                  "workload": {"num_requests": args.num_requests}})
    return ModelRunner.from_scenario(scenario, attention_backend=args.backend)


def make_requests(args, n: int, tag: str) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, n)
    outputs = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
    return [make_request(i, 0.0, [(stable_key(tag, args.seed, i), int(p))], int(o), seed=args.seed)
            for i, (p, o) in enumerate(zip(prompts, outputs))]


def run(runner: ModelRunner, args, batching: str, allocation: str, requests: list[Request]) -> dict:
    kv = KVCacheManager(runner.num_blocks, args.block_size, enable_caching=False, allocation=allocation,
                        max_model_len=args.max_model_len, contiguous_reserve="max_model_len")
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len, batching=batching)
    scheduler = Scheduler(config, kv)
    for r in requests:
        r.reset()
        if not scheduler.add(r):
            raise SystemExit(f"{batching}/{allocation}: request {r.id} rejected: {r.reject_reason}")
    steps = host_s = device_s = running = peak_blocks = 0
    if CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        if batch is None:
            raise RuntimeError(f"{batching}/{allocation}: the scheduler stalled with work left")
        result = runner.execute(batch)
        scheduler.finish_step(batch)
        steps += 1
        host_s += result.host_s
        device_s += result.device_s
        running += len(batch)
        peak_blocks = max(peak_blocks, kv.num_used_blocks)
    wall = time.perf_counter() - t0
    output_tokens = sum(r.num_output for r in requests)
    return {"batching": batching, "allocation": allocation, "requests": len(requests), "wall_s": wall,
            "output_tokens": output_tokens, "output_tok_per_s": output_tokens / wall,
            "total_tok_per_s": (output_tokens + sum(r.prompt_len for r in requests)) / wall,
            "steps": steps, "mean_batch_seqs": running / steps, "peak_kv_blocks": peak_blocks,
            "preemptions": scheduler.num_preemptions, "host_s": host_s, "device_s": device_s}


def host_step(model, block_size: int, batch_size: int = 256, context: int = 128, steps: int = 20) -> dict:
    """Host time of one decode step at `batch_size` (inputs, metadata, outputs around the
    forward; the runner's host_s), median over `steps` repeated steps of one batch, on a pool
    of its own sized for the batch (build it after the throughput runs have freed theirs)."""
    from statistics import median

    from validate.calibrate import probe_batch, release

    bs = block_size
    runner = ModelRunner(model, batch_size * -(-(context + 1) // bs) + 1, bs)
    graphs = runner.capture_graphs(batch_size)
    kv = KVCacheManager(runner.num_blocks, bs, enable_caching=False)
    batch = probe_batch(kv, [(context, 1, True)] * batch_size, tag=0)
    samples = []
    for i in range(steps + 2):
        for req in batch.reqs:                  # the same step again: its state as before the step
            req.num_computed = context + 1
        result = runner.execute(batch)
        if i >= 2:
            samples.append((result.host_s, result.device_s))
    release(kv, batch)
    return {"batch": batch_size, "context": context, "cuda_graphs": graphs > 0,
            "host_ms_per_step": 1e3 * median(h for h, _ in samples),
            "device_ms_per_step": 1e3 * median(d for _, d in samples)}


def print_table(rows: list[dict]) -> None:
    cols = [("batching", "{}"), ("allocation", "{}"), ("output_tok_per_s", "{:.1f}"), ("wall_s", "{:.2f}"),
            ("steps", "{}"), ("mean_batch_seqs", "{:.1f}"), ("peak_kv_blocks", "{}"),
            ("preemptions", "{}"), ("host_s", "{:.2f}"), ("device_s", "{:.2f}")]
    cells = [[c for c, _ in cols]] + [[f.format(r[c]) for c, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    runner = make_runner(args)
    run(runner, args, "continuous", "paged", make_requests(args, 4, "warmup"))   # JIT, allocator
    graphs = runner.capture_graphs(args.max_num_seqs)                         # CUDA: decode graphs
    requests = make_requests(args, args.num_requests, "bench")
    rows = [run(runner, args, batching, allocation, requests) for batching, allocation in MODES]
    per_request = -(-args.max_model_len // args.block_size)
    plan = runner.plan.to_dict() if runner.plan else None
    print(f"{args.model} ({runner.model.spec.dtype}, {args.backend}, {graphs} decode CUDA graphs) on "
          f"{torch.cuda.get_device_name() if CUDA else platform.processor() or 'cpu'}: "
          f"{args.num_requests} requests, pool {runner.num_blocks} blocks of {args.block_size} "
          f"(contiguous fits {(runner.num_blocks - 1) // per_request} max_model_len requests at once)")
    print_table(rows)
    speedup = rows[0]["output_tok_per_s"] / rows[1]["output_tok_per_s"]
    print(f"continuous+paged / static+contiguous output throughput: {speedup:.2f}x")
    memory = runner.memory_report()
    host = None
    if args.host_batch:
        model, runner = runner.model, None              # free the throughput pool first
        if CUDA:
            torch.cuda.empty_cache()
        host = host_step(model, args.block_size, args.host_batch)
    if host:
        print(f"decode step at batch {host['batch']} (context {host['context']}, CUDA graphs "
              f"{'on' if host['cuda_graphs'] else 'off'}): host {host['host_ms_per_step']:.2f} ms, "
              f"device {host['device_ms_per_step']:.2f} ms")
    write_json(args.out, {
        "bench": "engine_throughput", "machine": machine(), "args": vars(args),
        "device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
        "memory": memory, "plan": plan,
        "results": rows, "speedup_output_tok_per_s": speedup, "host_step": host})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
