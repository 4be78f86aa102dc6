"""The GPU check's correctness gate (~10 s): the Triton engine against the torch backend.

One model, one KV pool filled with random values, one batch mixing fresh prefills, a
prefill chunk after cached context and decodes at long context; the batch is executed with
each attention backend and the logits compared row by row. The pool is refilled identically
before each run, so both backends read the same context. Random weights: what is checked is
that the kernels compute the same attention as the reference, not what the model says.
"""
from __future__ import annotations

import torch

from engine.runner import ModelRunner
from sim.core.kv import KVCacheManager

# Relative L2 error of a logits row: bf16 through 24 layers differs by ~1e-2 between two
# correct attention implementations; a wrong block, position or mask is off by O(1).
MAX_ROW_REL_ERROR = 5e-2


def gate_probe(max_model_len: int) -> list[tuple[int, int, bool]]:
    """(context, new tokens, is decode): decodes near max_model_len, a shorter one, a fresh
    prompt of odd length, and a chunk after 512 cached tokens."""
    long_ctx = max_model_len - 8
    return [(long_ctx, 1, True), (long_ctx - 37, 1, True), (min(1000, long_ctx // 2), 1, True),
            (0, min(300, max_model_len // 4), False), (min(512, max_model_len // 4), 64, False)]


@torch.inference_mode()
def correctness_gate(scenario, device: str) -> dict:
    from validate.calibrate import probe_batch

    seqs = gate_probe(scenario.max_model_len)
    need = sum(-(-(c + n) // scenario.engine.block_size) for c, n, _ in seqs) + 1
    runner = ModelRunner.from_scenario(scenario.model_copy(
        update={"engine": scenario.engine.model_copy(update={"num_blocks": need})}), device)
    generator = torch.Generator(device=runner.device).manual_seed(0)
    pool = torch.randn(runner.kv_cache.shape, generator=generator, device=runner.device).to(runner.kv_cache.dtype)
    logits = {}
    for backend in ("torch", "triton"):
        runner.kv_cache.copy_(pool)
        runner.model.attention_backend = backend
        kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_caching=False)
        batch = probe_batch(kv, seqs, tag=0)
        logits[backend] = runner.execute(batch).logits.float()
    ref, got = logits["torch"], logits["triton"]
    errors = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
    worst = max(errors)
    result = {"rows": len(errors), "row_rel_errors": [round(e, 5) for e in errors],
              "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
              "sequences": [list(s) for s in seqs]}
    if not worst < MAX_ROW_REL_ERROR:
        raise AssertionError(f"Triton vs torch logits differ: worst row relative error {worst:.3g} "
                             f"> {MAX_ROW_REL_ERROR} ({result})")
    result["cuda_graphs"] = graph_check(runner, pool, seqs)
    result["overlap"] = overlap_check(runner)
    return result


def graph_check(runner: ModelRunner, pool: torch.Tensor, seqs: list) -> dict | str:
    """The decode sequences of the probe replayed through a CUDA graph against eager launches."""
    from validate.calibrate import probe_batch

    decodes = [s for s in seqs if s[2]]
    if not runner.capture_graphs(len(decodes)):
        return "not used on this device"
    logits = {}
    for mode, graphs in (("eager", None), ("graph", runner.graphs)):
        runner.kv_cache.copy_(pool)
        runner.graphs = graphs
        kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_caching=False)
        logits[mode] = runner.execute(probe_batch(kv, decodes, tag=0)).logits.float()
    errors = ((logits["graph"] - logits["eager"]).norm(dim=-1) / logits["eager"].norm(dim=-1)).tolist()
    if not max(errors) < 1e-3:
        raise AssertionError(f"CUDA graph vs eager decode logits differ: row relative errors {errors}")
    return {"row_rel_errors": [round(e, 6) for e in errors]}


def overlap_check(runner: ModelRunner, num_requests: int = 3) -> dict:
    """A few scripted requests (prefills, then decodes of as many sequences as graph_check
    captured graphs for) run by StepPipeline with one step in flight against synchronous steps:
    the same steps and samples, logits within 1e-3 (the same arithmetic; on a GPU this checks
    the pinned copies, events and double buffers, which the CPU runs synchronously)."""
    from engine.pipeline import StepPipeline
    from sim.core.request import make_request, stable_key
    from sim.core.scheduler import SchedulerConfig
    from sim.core.scheduler_variants import make_scheduler

    bs = runner.block_size
    prompt = min(40, runner.max_model_len // 4)
    output = 5
    runs = {}
    for overlap in (False, True):
        kv = KVCacheManager(runner.num_blocks, bs, enable_caching=False, max_model_len=runner.max_model_len)
        scheduler = make_scheduler(SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=num_requests * prompt,
                                              max_model_len=runner.max_model_len), kv)
        for i in range(num_requests):
            scheduler.add(make_request(i, 0.0, [(stable_key("gate", i), prompt - 3 * i)], output))
        runs[overlap] = [(done.batch.step, done.result.sampled, done.result.logits.float())
                         for done in StepPipeline(scheduler, runner, overlap=overlap).drain()]
    sync, over = runs[False], runs[True]
    if [s[:2] for s in sync] != [s[:2] for s in over]:
        raise AssertionError(f"overlapped steps differ from synchronous ones: {[s[:2] for s in over]} "
                             f"vs {[s[:2] for s in sync]}")
    errors = [float(((a[2] - b[2]).norm(dim=-1) / b[2].norm(dim=-1)).max()) for a, b in zip(over, sync)]
    if not max(errors) < 1e-3:
        raise AssertionError(f"overlapped vs synchronous logits differ: per-step worst row relative errors {errors}")
    return {"steps": len(sync), "worst_row_rel_error": max(errors)}
