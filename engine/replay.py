"""Replay a scenario's workload on the real engine, in wall-clock time, through the shared policy.

The very requests the simulator predicts (same seed, same scripted outputs) are released
at their arrival times (online) or all at t=0 (offline) into the same Scheduler and
KVCacheManager, and each step runs on the model. The records and summary come from the
same code as `simrun`'s, so the two runs can be put side by side.

Before the measured run: a smoke request (fixed prompt, fixed short output, greedy, run
twice and checked identical), then, unless the run is `cold`, a warm-up that compiles the
kernels. The measured run always starts with a fresh prefix cache: nothing the smoke or
warm-up requests computed can flatter it.
"""
from __future__ import annotations

import heapq
import platform
import subprocess
import time
from collections import deque
from dataclasses import asdict
from typing import Callable, Optional

import torch

from engine.runner import InconsistentBatchError, ModelRunner
from sim.core.kv import new_kv_manager
from sim.core.memory import check_block_pool_supports, kv_cache_groups
from sim.metrics import summarise
from sim.predict import RunResult, git_commit, kvtwin_version, length_stats, memory_summary, workload_digest
from sim.records import RunRecords, StepRecorder, requests_frame
from sim.core.request import Request, Status, make_request, stable_key
from sim.router import reject_follow_ups
from sim.core.scheduler import Scheduler, SchedulerConfig
from sim.core.scheduler_variants import make_scheduler
from sim.workload import build_workload

SMOKE_PROMPT_TOKENS = 16
SMOKE_OUTPUT_TOKENS = 8


class SmokeCheckError(RuntimeError):
    """The engine failed its smoke request; no measurement is worth taking."""


class EngineUnsupportedError(ValueError):
    """The scenario asks for something the engine cannot replay faithfully."""


def check_engine_supports(scenario) -> None:
    """Refuse speculative decoding (the engine implements none), and a hybrid model (sliding-window
    and full-attention layers): the shared policy (sim/core/kv/coordinator.py HybridCoordinator)
    keeps one block table per KV cache group, while the runner keeps one KV tensor of every layer and one block table per sequence. A model whose every layer has the
    same window (Mistral v0.1) is one group: the runner reads its table, the blocks behind the
    window null, and the kernels mask the window."""
    model = scenario.model
    if scenario.cluster.disaggregation is not None:
        raise EngineUnsupportedError(
            "cluster.disaggregation: the engine replays one engine, and a prefill/decode deployment is two "
            "pools of them with a KV link between; simulate it with `simrun run`, or replay one side with "
            "its engine settings (drop cluster.disaggregation and set that pool's device, tp and engine "
            "fields at the top level).")
    check_block_pool_supports(model, scenario.engine.allocation)
    if scenario.engine.kv_offload is not None:
        raise EngineUnsupportedError(
            "engine.kv_offload is set, but the engine (engine/) has no CPU KV tier: it would replay without "
            "offloading and measure a different deployment. Simulate it with `simrun run`, or remove "
            "engine.kv_offload to replay the GPU prefix cache alone.")
    lora = scenario.engine.lora
    if lora is not None:
        raise EngineUnsupportedError(
            f"engine.lora (max_loras {lora.max_loras}, max_lora_rank {lora.max_lora_rank}): the Triton engine has "
            "no LoRA layers or punica kernels, so it cannot replay LoRA serving. Simulate it with `simrun run`, or "
            "replay without it (engine.lora: null, and no workload.lora).")
    spec = scenario.engine.speculative
    if spec is not None:
        raise EngineUnsupportedError(
            f"engine.speculative (method {spec.method}, {spec.num_speculative_tokens} speculative tokens): the "
            "engine has no drafter and no rejection sampler, so it cannot replay speculative decoding. Simulate "
            "it with `simrun run`, or replay without it (engine.speculative: null).")
    if model.num_sliding_layers and model.num_full_layers:
        raise EngineUnsupportedError(
            f"model '{model.name}' mixes {model.num_sliding_layers} sliding-window layers "
            f"(sliding_window={model.sliding_window}) with {model.num_full_layers} full-attention ones: "
            "the engine's runner keeps one block table for every layer, so it cannot replay vLLM's hybrid "
            "KV cache manager (one table per KV cache group) that `simrun run` simulates. Simulate it "
            "with `simrun run`, or replay the full-attention variant with model.sliding_window: null "
            "and model.layer_types: null.")


def new_scheduler(scenario, num_blocks: int) -> Scheduler:
    check_engine_supports(scenario)
    e = scenario.engine
    kv = new_kv_manager(num_blocks, e.block_size, e.prefix_caching, e.allocation, scenario.max_model_len,
                        e.contiguous_reserve, kv_cache_groups(scenario.model), scenario.max_step_tokens)
    return make_scheduler(SchedulerConfig.from_scenario(scenario), kv)


def replay(scenario, runner: Optional[ModelRunner] = None, device: Optional[str] = None,
           online: bool = True, cold: bool = False, name: Optional[str] = None,
           progress: Optional[Callable[[int], None]] = None) -> RunResult:
    """Measure a scenario on the engine. Returns the same kind of result as sim.predict.predict."""
    check_engine_supports(scenario)
    startup: dict[str, float] = {}
    t0 = time.perf_counter()
    if runner is None:
        runner = ModelRunner.from_scenario(scenario, device)
    startup["model_and_pool_s"] = time.perf_counter() - t0
    startup.update(smoke_check(scenario, runner))
    if not cold:
        startup["warmup_s"] = warm_up(scenario, runner)
    workload = build_workload(scenario)
    requests = workload.requests
    if not online:
        for r in requests:
            if r.arrival is not None:
                r.arrival = 0.0
    scheduler = new_scheduler(scenario, runner.num_blocks)
    records = run_in_wall_clock(scheduler, runner, requests, progress)
    req_df, steps_df = requests_frame(records), records.steps_frame()
    summary = summarise(records, scenario.slo, req_df, steps_df)
    memory = runner.memory_report()
    summary["memory"] = {**memory_summary(runner.plan, scenario.max_model_len), **memory} if runner.plan else memory
    # The CPU has no allocator statistics: its "peak" would only restate the pool and weights.
    summary["peak_device_memory_bytes"] = memory["peak_bytes"] if runner.device.type == "cuda" else None
    manifest = measurement_manifest(scenario, runner, requests, workload.notes, online, cold, startup)
    return RunResult(name or scenario.name, scenario, records, runner.plan, None, summary, req_df, steps_df,
                     manifest)


def run_in_wall_clock(scheduler: Scheduler, runner: ModelRunner, requests: list[Request],
                      progress: Optional[Callable[[int], None]] = None) -> RunRecords:
    """The engine loop: release arrivals, schedule, execute, finish; idle until the next arrival."""
    recorder = StepRecorder(0)
    kv = scheduler.kv
    arrivals = deque(sorted((r for r in requests if r.arrival is not None), key=lambda r: (r.arrival, r.id)))
    follow_ups: list[tuple[float, int, Request]] = []
    clock = time.perf_counter
    t0 = clock()
    done = 0
    while arrivals or follow_ups or scheduler.has_unfinished():
        now = clock() - t0
        _release(scheduler, arrivals, follow_ups, now)
        start = clock() - t0
        batch = scheduler.schedule()
        if batch is None:
            _idle_until_next(arrivals, follow_ups, clock, t0, scheduler)
            continue
        kv_used, kv_cached, slack = kv.pool.num_used, kv.pool.num_cached_free, scheduler.slack_tokens
        result = runner.execute(batch)
        if (result.rows, result.tokens) != (batch.num_seqs, batch.num_tokens):     # what steps.csv records
            raise InconsistentBatchError(
                f"step {batch.step}: the engine computed {result.rows} rows and {result.tokens} tokens, "
                f"the scheduler priced {batch.num_seqs} and {batch.num_tokens}")
        finished = scheduler.finish_step(batch)
        end = clock() - t0
        recorder.record(batch, scheduler, start, end, max(end - start - result.device_s, 0.0), result.device_s,
                        kv_used, kv_cached, slack)
        for req in finished:
            if req.next_turn is not None:
                heapq.heappush(follow_ups, (end + req.think_time, req.next_turn.id, req.next_turn))
        done += len(finished)
        if progress is not None and finished:
            progress(done)
    scheduler.check_accounting()
    stuck = [r for r in requests if not r.is_finished]
    if stuck:
        raise AssertionError(f"{len(stuck)} requests never ended, e.g. {stuck[0]!r}")
    return RunRecords(requests, [recorder], kv_blocks_total=kv.pool.usable_blocks, block_size=kv.block_size,
                      meta={"kv_evictions": kv.pool.evictions})


def _release(scheduler: Scheduler, arrivals: deque, follow_ups: list, now: float) -> None:
    while arrivals and arrivals[0].arrival <= now:
        _admit(scheduler, arrivals.popleft())
    while follow_ups and follow_ups[0][0] <= now:
        release_at, _, req = heapq.heappop(follow_ups)
        req.arrival = release_at
        _admit(scheduler, req)


def _admit(scheduler: Scheduler, req: Request) -> None:
    if not scheduler.add(req) and req.status is Status.REJECTED:
        reject_follow_ups(req)


def _idle_until_next(arrivals: deque, follow_ups: list, clock, t0: float, scheduler: Scheduler) -> None:
    times = ([arrivals[0].arrival] if arrivals else []) + ([follow_ups[0][0]] if follow_ups else [])
    if not times:
        if scheduler.has_unfinished():
            raise AssertionError("requests are waiting but none can ever be scheduled")
        return
    wait = min(times) - (clock() - t0)
    if wait > 0:
        time.sleep(wait)


# ----------------------------------------------------------------------------- before the run

def smoke_check(scenario, runner: ModelRunner) -> dict[str, float]:
    """Run one fixed short request twice (greedy); it must finish, give finite logits and
    the same tokens both times. Returns its timings (the first includes compilation)."""
    timings, outputs = {}, []
    for attempt in ("first", "second"):
        scheduler = new_scheduler(scenario, runner.num_blocks)
        req = make_request(-1, 0.0, [(stable_key("smoke"), SMOKE_PROMPT_TOKENS)], SMOKE_OUTPUT_TOKENS)
        scheduler.add(req)
        tokens: list[int] = []
        t0 = time.perf_counter()
        while scheduler.has_unfinished():
            batch = scheduler.schedule()
            if batch is None:
                raise SmokeCheckError(f"the smoke request could not be scheduled ({req.reject_reason})")
            result = runner.execute(batch)
            if not torch.isfinite(result.logits).all():
                raise SmokeCheckError("the smoke request produced non-finite logits")
            tokens += list(result.sampled.values())
            scheduler.finish_step(batch)
        timings[f"smoke_{attempt}_s"] = time.perf_counter() - t0
        if req.num_output != SMOKE_OUTPUT_TOKENS:
            raise SmokeCheckError(f"the smoke request emitted {req.num_output} tokens, expected {SMOKE_OUTPUT_TOKENS}")
        outputs.append(tokens)
    if runner.sampler.temperature == 0 and outputs[0] != outputs[1]:
        raise SmokeCheckError(f"greedy smoke request is not deterministic: {outputs[0]} vs {outputs[1]}")
    return timings


def warm_up(scenario, runner: ModelRunner) -> float:
    """Compile and warm every kernel variant before measuring: a long prefill and chunked ones
    (the prefill configuration), decode steps at long context in small batches (the split-KV
    path and its reduce) and at short context in a larger batch (the unsplit decode path).
    Uses a throwaway scheduler (and prefix cache). Block-table widths and batch sizes are not
    specialised by the kernels, so these launches cover every later step's compiled variant."""
    t0 = time.perf_counter()
    scheduler = new_scheduler(scenario, runner.num_blocks)
    usable = scheduler.kv.pool.usable_blocks * scenario.engine.block_size
    long_prompt = max(1, min(600, scenario.max_model_len // 2, usable // 8))
    short_prompt = max(1, min(24, long_prompt))
    groups = [(n, long_prompt) for n in (1, 4) if n <= scenario.max_num_seqs]
    groups.append((min(16, scenario.max_num_seqs), short_prompt))
    for i, (n, prompt) in enumerate(groups):
        for j in range(n):
            scheduler.add(make_request(-100 - 100 * i - j, 0.0, [(stable_key("warmup", i, j), prompt)], 4))
        while scheduler.has_unfinished():
            batch = scheduler.schedule()
            if batch is None:
                break
            runner.execute(batch)
            scheduler.finish_step(batch)
    runner.capture_graphs(scenario.max_num_seqs)     # CUDA only: decode graphs, after compiling
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- manifest

def environment() -> dict:
    """Versions and the device: what a measurement needs on record to be compared or repeated."""
    env = {"kvtwin_version": kvtwin_version(), "git_commit": git_commit(), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, device_memory_bytes=props.total_memory,
                   multiprocessors=props.multi_processor_count, driver=_nvidia_driver())
    else:
        env.update(device=f"cpu ({platform.processor() or platform.machine()})", device_memory_bytes=None)
    return env


def _nvidia_driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def measurement_manifest(scenario, runner: ModelRunner, requests: list[Request], notes: list[str],
                         online: bool, cold: bool, startup: dict) -> dict:
    m = scenario.model
    weights = str(m.weights) if m.weights else f"random (seed {scenario.seed}, std 0.02)"
    return {
        "kind": "measurement",
        **environment(),
        "model": {"name": m.name, "hf_id": m.hf_id, "weights": weights, "dtype": m.dtype,
                  "attention_backend": runner.model.attention_backend},
        "block_size": scenario.engine.block_size,
        "num_blocks": runner.num_blocks,
        "scheduler": asdict(SchedulerConfig.from_scenario(scenario)),
        "engine": scenario.engine.model_dump(mode="json"),
        "parallel": {"tp": 1, "note": "the engine runs on one device; tensor parallelism is modelled, not run"},
        "workload": {"requests": len(requests), "digest": workload_digest(requests),
                     "lengths": length_stats(requests), "notes": notes},
        "sampling": {"temperature": runner.sampler.temperature, "greedy": runner.sampler.temperature == 0,
                     "outputs": "scripted: the workload's output token is appended, so lengths match the "
                                "prediction exactly (as a benchmark with ignore_eos and fixed max_tokens)"},
        "max_generation_len": max((r.output_len for r in requests), default=0),
        "stop_rule": "length: each request stops at its scripted output length; EOS is ignored",
        "mode": {"arrivals": "online (released at their arrival times)" if online else "offline (all at t=0)",
                 "start": "cold: no warm-up before the measured run; first-use compilation is inside it"
                          if cold else "warm: smoke request and kernel warm-up excluded"},
        "startup": startup,
        "memory_plan": runner.plan.to_dict() if runner.plan else None,
        "scenario": scenario.model_dump(mode="json"),
    }
