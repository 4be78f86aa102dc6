"""vLLM's behaviour by release, in one table (engine.vllm_version picks the row).

Each entry names the first release (major, minor) with the behaviour and, where it went away,
the first release without it; docs/vllm_semantics.md says where in vLLM's code each one lives.
Everything that depends on the version asks `has(version, NAME)` (or a helper below), so a new
release is one edit here.
"""
from __future__ import annotations

from typing import Optional

Version = tuple[int, int]

# The version a scenario assumes when it names none (engine.vllm_version's default).
DEFAULT_VERSION = "0.19"

# name: (first release with it, first release without it or None)
BEHAVIOURS: dict[str, tuple[Version, Optional[Version]]] = {
    # config/scheduler.py: async_scheduling defaults to None ("auto", resolved on) instead of False.
    "async_scheduling_default": ((0, 14), None),
    # config/vllm.py: under auto, pipeline_parallel_size > 1 turns async scheduling off (0.14 only).
    "async_off_with_pipeline_parallel": ((0, 14), (0, 15)),
    # config/vllm.py: NGram-GPU speculative decoding keeps async scheduling on under auto.
    "async_with_ngram_gpu": ((0, 18), None),
    # envs.py: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1 (the graph estimate comes off
    # the KV budget, v1/worker/gpu_worker.py determine_available_memory).
    "cudagraph_estimate_in_plan": ((0, 20), None),
    # envs.py: the switch itself (v1/worker/gpu_worker.py profile_cudagraph_memory); absent before 0.18.
    "cudagraph_estimate_switch": ((0, 18), None),
    # config/cache.py: gpu_memory_utilization defaults to 0.92 (0.9 before).
    "utilization_default_092": ((0, 20), None),
    # config/scheduler.py scheduler_reserve_full_isl: a waiting request is admitted only when blocks
    # for its whole prompt are free (v1/core/kv_cache_manager.py can_fit_full_sequence).
    "reserve_full_prompt": ((0, 19), None),
    # v1/core/single_type_kv_cache_manager.py get_num_blocks_to_allocate: a sliding-window group's
    # admission need is capped at the window's blocks (_max_admission_blocks_per_request); 0.19
    # asks cdiv(prompt, block_size) blocks of every sliding group too.
    "sliding_window_admission_cap": ((0, 20), None),
    # Data parallel (docs/vllm_semantics.md "Data parallel"). v1/engine/core.py run_engine_core: a
    # dense model's dp ranks run plain, independent EngineCoreProcs ("Non-MoE DP ranks are completely
    # independent", 0.14 on); before, every dp rank ran DPEngineCoreProc's lockstep loop (checked
    # on 0.12 and 0.13). MoE models' ranks always do.
    "dense_dp_independent": ((0, 14), None),
    # entrypoints/cli/serve.py: --api-server-count defaults to the ranks the API servers balance
    # (dp, dp_local for hybrid, 1 for external LB); 0.12-0.14's entrypoints/openai/cli_args.py: 1.
    "api_servers_default_dp": ((0, 15), None),
    # v1/worker/dp_utils.py _synchronize_dp_ranks: ranks are padded to the most tokens of any rank
    # only when every rank's batch runs a CUDA graph (`should_dp_pad = synced_cudagraph_mode != 0`);
    # 0.12-0.16 padded whenever CUDA graphs were configured (gpu_model_runner.py allow_dp_padding).
    "dp_pad_only_under_graphs": ((0, 17), None),
    # v1/sample/ops/topk_topp_sampler.py: FlashInfer's sampler became opt-in (0.11 used it whenever
    # installed), so apply_top_k_top_p sorts every logits row (logits.sort) when top-p is set; from
    # 0.17 rows >= 8 go to the in-place Triton kernel (v1/sample/ops/topk_topp_triton.py).
    "sampler_sorts_top_k_top_p": ((0, 12), (0, 17)),
    # engine/arg_utils.py --performance-mode (balanced | interactivity | throughput); throughput
    # doubles the max_num_seqs and max_num_batched_tokens defaults.
    "performance_mode": ((0, 17), None),
    # V0's async output processing (0.6.0 to the V0 engine's last release kvtwin models, 0.7.x):
    # engine/llm_engine.py LLMEngine.step passes the previous step's output processing as
    # `async_callback`, which worker/model_runner.py ModelRunner.execute_model calls after it
    # launches the next step's forward; engine/async_llm_engine.py puts the outputs on the request
    # streams from that processing (`process_request_outputs_callback`). A token reaches
    # engine.generate's caller once the next step's host work is done, or at once when no request is
    # left unfinished (the engine drains the queue). Off under --enforce-eager
    # (platforms/cuda.py is_async_output_supported), with speculative decoding and with pipeline
    # parallel > 1 (config.py ModelConfig.verify_async_output_proc, 0.7.3).
    "v0_async_output_processing": ((0, 6), (0, 8)),
}

# --all2all-backend's choices (config/parallel.py All2AllBackend): the release each came with.
# allgather_reducescatter is the default throughout 0.12-0.21.
ALL2ALL_BACKENDS: dict[str, Version] = {
    "allgather_reducescatter": (0, 12), "naive": (0, 12), "pplx": (0, 12), "deepep_high_throughput": (0, 12),
    "deepep_low_latency": (0, 12), "flashinfer_all2allv": (0, 12), "mori": (0, 15), "nixl_ep": (0, 18),
    "flashinfer_nvlink_two_sided": (0, 18), "flashinfer_nvlink_one_sided": (0, 18),
}

# Speculative methods that keep async scheduling on under auto (config/speculative.py
# EagleModelTypes: eagle, eagle3, extract_hidden_states and the MTP family, every `*_mtp` method
# being renamed `mtp`; NgramGPUTypes); `None` = no speculative decoding.
EAGLE_METHODS = ("eagle", "eagle3", "extract_hidden_states", "mtp")
NGRAM_GPU_METHODS = ("ngram_gpu",)
# Executors whose supports_async_scheduling() is True (v1/executor/multiproc_executor.py,
# uniproc_executor.py; 0.14-0.18: the tuple ("mp", "uni", "external_launcher") in config/vllm.py).
ASYNC_EXECUTORS = ("mp", "uni", "external_launcher")


def parse_version(version: Optional[str]) -> Version:
    """'0.19.0' -> (0, 19); None -> DEFAULT_VERSION."""
    parts = [int(p) for p in str(version or DEFAULT_VERSION).lstrip("v").split(".")[:2] if p.isdigit()]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def engine_generation(version: Optional[str]) -> str:
    """'v0' for releases before 0.8.0 (where V1 became vLLM's default engine), else 'v1'; a version not
    stated reads as DEFAULT_VERSION, a V1 release."""
    return "v0" if parse_version(version) < (0, 8) else "v1"


def has(version: Optional[str], name: str) -> bool:
    """Does vLLM `version` have behaviour `name` (a key of BEHAVIOURS)?"""
    first, gone = BEHAVIOURS[name]
    v = parse_version(version)
    return v >= first and (gone is None or v < gone)


def default_gpu_memory_utilization(version: Optional[str]) -> float:
    return 0.92 if has(version, "utilization_default_092") else 0.9


def async_scheduling_auto(version: Optional[str], *, platform: str = "cuda", pipeline_parallel: int = 1,
                          speculative_method: Optional[str] = None, executor: Optional[str] = None,
                          ) -> tuple[bool, str]:
    """What vLLM's `auto` (async_scheduling=None) resolves to, and why (config/vllm.py
    VllmConfig.__post_init__; platforms/cpu.py check_and_update_config forces it off on CPU)."""
    if not has(version, "async_scheduling_default"):
        return False, f"vLLM {version}: async scheduling is opt-in before 0.14"
    if platform == "cpu":
        return False, "the CPU platform turns async scheduling off"
    if pipeline_parallel > 1 and has(version, "async_off_with_pipeline_parallel"):
        return False, "vLLM 0.14 turns async scheduling off with pipeline parallel"
    if speculative_method is not None:
        keeps = EAGLE_METHODS + (NGRAM_GPU_METHODS if has(version, "async_with_ngram_gpu") else ())
        if speculative_method not in keeps and not speculative_method.endswith("_mtp"):
            return False, f"{speculative_method} speculative decoding turns async scheduling off"
    if executor is not None and executor not in ASYNC_EXECUTORS:
        return False, f"the {executor} executor does not support async scheduling"
    return True, "on by default"


def all2all_backends(version: Optional[str]) -> list[str]:
    """The --all2all-backend values vLLM `version` accepts (none before 0.12, which had no such flag)."""
    v = parse_version(version)
    return [name for name, first in ALL2ALL_BACKENDS.items() if v >= first]


def dp_ranks_in_lockstep(version: Optional[str], is_moe: bool) -> bool:
    """Do the data-parallel ranks of this model step together (DPEngineCoreProc: dummy batches on
    idle ranks, collectives every step)? MoE models always; dense ones before 0.14."""
    return is_moe or not has(version, "dense_dp_independent")


def default_api_servers(version: Optional[str], balanced_ranks: int) -> int:
    """--api-server-count unset: one API server per rank the servers balance (from 0.15), else 1."""
    return balanced_ranks if has(version, "api_servers_default_dp") else 1
