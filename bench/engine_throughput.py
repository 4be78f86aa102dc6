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
from engine.pipeline import StepPipeline  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from sim.core.catalog import MIB  # noqa: E402
from sim.core.kv import KVCacheManager  # noqa: E402
from sim.core.request import Request, make_request, stable_key  # noqa: E402
from sim.scenario import validate_scenario  # noqa: E402
from sim.core.scheduler import SchedulerConfig  # noqa: E402
from sim.core.scheduler_variants import make_scheduler  # noqa: E402

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
                   help="also time the host side of decode steps of this many sequences, with and "
                        "without overlap (0: skip)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="run the throughput comparison with synchronous steps (engine/pipeline.py)")
    p.add_argument("--repeats", type=int, default=1 if CUDA else 3,
                   help="run each comparison this many times in turn and report medians (a loaded CPU drifts)")
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
    scheduler = make_scheduler(config, kv)
    for r in requests:
        r.reset()
        if not scheduler.add(r):
            raise SystemExit(f"{batching}/{allocation}: request {r.id} rejected: {r.reject_reason}")
    steps = host_s = device_s = running = peak_blocks = 0
    if CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for done in StepPipeline(scheduler, runner, overlap=args.overlap).drain():
        steps += 1
        host_s += done.result.host_s
        device_s += done.result.device_s
        running += len(done.batch)
        peak_blocks = max(peak_blocks, kv.num_used_blocks)
    wall = time.perf_counter() - t0
    output_tokens = sum(r.num_output for r in requests)
    return {"batching": batching, "allocation": allocation, "requests": len(requests), "wall_s": wall,
            "output_tokens": output_tokens, "output_tok_per_s": output_tokens / wall,
            "total_tok_per_s": (output_tokens + sum(r.prompt_len for r in requests)) / wall,
            "steps": steps, "mean_batch_seqs": running / steps, "peak_kv_blocks": peak_blocks,
            "preemptions": scheduler.num_preemptions, "host_s": host_s, "device_s": device_s}


def host_loops(model, block_size: int, batch_size: int = 256, context: int = 128, steps: int = 20,
               repeats: int = 1) -> list[dict]:
    """Host time per decode step at `batch_size` in the whole engine loop (scheduler, runner,
    StepPipeline), synchronous and overlapped in turn `repeats` times on one runner (built
    after the throughput runs have freed their pool, graphs captured once): per mode, the
    median over the repeats of the median over `steps` decode steps after two warm ones.

    exposed_host_ms_per_step is the wall time between two completed steps minus the device's
    busy time in it: the time per step the device does not compute. Synchronous, it is all
    the host work of a step. Overlapped, on a GPU it is only what the host work exceeds the
    device step by; on a CPU the forward runs on the host, so it stays all the host work (the
    CPU shows that overlapping costs no extra host work, not the overlap itself)."""
    from statistics import median

    from sim.core.memory import cdiv

    max_len = context + steps + 6
    runner = ModelRunner(model, batch_size * cdiv(max_len, block_size) + 1, block_size, max_len)
    graphs = runner.capture_graphs(batch_size)
    runs = {False: [], True: []}
    for _ in range(repeats):
        for overlap in runs:
            runs[overlap].append(time_decode_steps(runner, batch_size, context, steps, overlap))
    return [{"batch": batch_size, "context": context, "cuda_graphs": graphs > 0, "overlap": overlap,
             **{k: median(r[k] for r in results) for k in results[0]}} for overlap, results in runs.items()]


def time_decode_steps(runner: ModelRunner, batch_size: int, context: int, steps: int, overlap: bool) -> dict:
    from statistics import median

    bs, max_len = runner.block_size, runner.max_model_len
    kv = KVCacheManager(runner.num_blocks, bs, enable_caching=False, max_model_len=max_len)
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=batch_size * context,
                                          max_model_len=max_len), kv)
    for i in range(batch_size):
        scheduler.add(make_request(i, 0.0, [(stable_key("host", i), context)], steps + 5))
    pipeline = StepPipeline(scheduler, runner, overlap=overlap)
    samples, last = [], None
    for done in pipeline.drain():
        now = time.perf_counter()
        full_decode = len(done.batch.decodes) == batch_size
        if last is not None and full_decode:
            # the device's time in this interval: on a GPU step N's (it runs while the host works);
            # on a CPU the forwards this call ran on the host (step N+1's when overlapped)
            busy = done.result.device_s if CUDA else sum(p.timer.wall for p in pipeline.launched)
            samples.append((now - last - busy, done.result.host_s, done.result.device_s))
            if len(samples) == steps + 2:
                break
        last = now if full_decode else None
    samples = samples[2:]
    if len(samples) < steps:
        raise RuntimeError(f"only {len(samples)} full decode steps of {batch_size} were timed")
    return {"exposed_host_ms_per_step": 1e3 * median(max(e, 0.0) for e, _, _ in samples),
            "runner_host_ms_per_step": 1e3 * median(h for _, h, _ in samples),
            "device_ms_per_step": 1e3 * median(d for _, _, d in samples)}


def throughput_rows(runner: ModelRunner, args, requests: list[Request]) -> tuple[list[dict], float]:
    """Both modes in turn `args.repeats` times: per mode the run of median throughput, and the
    median of the ratios of adjacent pairs (each pair sees about the same machine load)."""
    from statistics import median

    runs = [[run(runner, args, batching, allocation, requests) for batching, allocation in MODES]
            for _ in range(args.repeats)]
    rows = []
    for mode in range(len(MODES)):
        ranked = sorted((r[mode] for r in runs), key=lambda row: row["output_tok_per_s"])
        rows.append({**ranked[len(ranked) // 2], "repeats": len(runs)})
    speedup = median(r[0]["output_tok_per_s"] / r[1]["output_tok_per_s"] for r in runs)
    return rows, speedup


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
    rows, speedup = throughput_rows(runner, args, requests)
    per_request = -(-args.max_model_len // args.block_size)
    plan = runner.plan.to_dict() if runner.plan else None
    print(f"{args.model} ({runner.model.spec.dtype}, {args.backend}, {graphs} decode CUDA graphs) on "
          f"{torch.cuda.get_device_name() if CUDA else platform.processor() or 'cpu'}: "
          f"{args.num_requests} requests, pool {runner.num_blocks} blocks of {args.block_size} "
          f"(contiguous fits {(runner.num_blocks - 1) // per_request} max_model_len requests at once)")
    print_table(rows)
    print(f"continuous+paged / static+contiguous output throughput: {speedup:.2f}x")
    memory = runner.memory_report()
    host = []
    if args.host_batch:
        model, runner = runner.model, None              # free the throughput pool first
        if CUDA:
            torch.cuda.empty_cache()
        host = host_loops(model, args.block_size, args.host_batch, repeats=args.repeats)
    for h in host:
        print(f"decode steps at batch {h['batch']} (context {h['context']}, CUDA graphs "
              f"{'on' if h['cuda_graphs'] else 'off'}, {'overlapped' if h['overlap'] else 'synchronous'}): "
              f"host exposed {h['exposed_host_ms_per_step']:.2f} ms/step (runner's own "
              f"{h['runner_host_ms_per_step']:.2f} ms), device {h['device_ms_per_step']:.2f} ms")
    write_json(args.out, {
        "bench": "engine_throughput", "machine": machine(), "args": vars(args),
        "device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
        "memory": memory, "plan": plan,
        "results": rows, "speedup_output_tok_per_s": speedup, "host_loop": host})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
