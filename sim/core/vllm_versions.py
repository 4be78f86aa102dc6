"""vLLM's behaviour by release, in one table (engine.vllm_version picks the row).

Each entry names the first release (major, minor) with the behaviour and, where it went away,
the first release without it; docs/vllm_semantics.md says where in vLLM's code each one lives.
Everything that depends on the version asks `has(version, NAME)` (or a helper below), so a new
release is one edit here.
"""
from __future__ import annotations

from typing import Optional

Version = tuple[int, int]
Release = tuple[int, int, int]

# The version a scenario assumes when it names none (engine.vllm_version's default).
DEFAULT_VERSION = "0.19"

# vLLM's engine generations (engine.vllm_engine; docs/vllm_semantics.md "Engine generation"):
V1_OPT_IN: Release = (0, 6, 4)       # vllm/envs.py VLLM_USE_V1 appears, default "0": V1 only with VLLM_USE_V1=1
V1_DEFAULT: Release = (0, 8, 0)      # envs.py default "1": unset runs V1 unless engine/arg_utils.py's
                                     # _is_v1_supported_oracle falls back to V0; VLLM_USE_V1=0 runs V0
V0_REMOVED: Release = (0, 11, 0)     # engine/llm_engine.py is V1's; the API server asserts VLLM_USE_V1
USE_V1_REMOVED: Release = (0, 11, 1)  # envs.py no longer has VLLM_USE_V1: setting it changes nothing
ENGINE_SETTINGS = ("auto", "v0", "v1")

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
    # V0's async output processing (0.6.0 on, on the V0 engine: Scenario.tokens_after_next_host
    # asks for the generation too, so 0.8-0.10 under VLLM_USE_V1=0 have it):
    # engine/llm_engine.py LLMEngine.step passes the previous step's output processing as
    # `async_callback`, which worker/model_runner.py ModelRunner.execute_model calls after it
    # launches the next step's forward; engine/async_llm_engine.py puts the outputs on the request
    # streams from that processing (`process_request_outputs_callback`). A token reaches
    # engine.generate's caller once the next step's host work is done, or at once when no request is
    # left unfinished (the engine drains the queue). Off under --enforce-eager
    # (platforms/cuda.py is_async_output_supported), with speculative decoding and with pipeline
    # parallel > 1 (config.py ModelConfig.verify_async_output_proc, 0.7.3).
    "v0_async_output_processing": ((0, 6), None),
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


def parse_release(version: Optional[str]) -> Release:
    """'0.10.1.1' -> (0, 10, 1); '0.11.0rc2' -> (0, 11, 0); '0.8' -> (0, 8, 0); None -> DEFAULT_VERSION.
    Only the engine generations need the patch: V1 came in a patch release (0.6.4), VLLM_USE_V1 left
    in one (0.11.1)."""
    parts = []
    for word in str(version or DEFAULT_VERSION).lstrip("v").split(".")[:3]:
        digits = len(word) - len(word.lstrip("0123456789"))
        if not digits:
            break
        parts.append(int(word[:digits]))
        if digits < len(word):              # '0rc2': a pre-release tail ends the number
            break
    return tuple((parts + [0, 0, 0])[:3])


def generation_problem(version: Optional[str], setting: str) -> Optional[str]:
    """Why vLLM `version` cannot run engine generation `setting` (engine.vllm_engine: v0 | v1), or None."""
    release = parse_release(version)
    if setting == "v1" and release < V1_OPT_IN:
        return (f"vLLM {version} has no V1 engine (VLLM_USE_V1 selects it from 0.6.4, vllm/envs.py); "
                f"use auto or v0")
    if setting == "v0" and release >= V0_REMOVED:
        return (f"vLLM {version} has no V0 engine (removed in 0.11.0: 0.11.0's API server refuses "
                f"VLLM_USE_V1=0, and from 0.11.1 the variable is not read); use auto or v1")
    return None


def reads_use_v1(version: Optional[str]) -> bool:
    """Does vLLM `version` read the VLLM_USE_V1 environment variable (vllm/envs.py, 0.6.4 - 0.11.0)?"""
    return V1_OPT_IN <= parse_release(version) < USE_V1_REMOVED


def engine_generation(version: Optional[str], setting: str = "auto", falls_back: bool = False) -> str:
    """The engine generation ('v0' | 'v1') vLLM `version` runs: `setting` v0 or v1 as VLLM_USE_V1=0 or 1
    chose it (check generation_problem first), else the release's default: V0 before 0.8.0, V1 from it,
    unless `falls_back` (the engine-args oracle found a feature V1 lacks in that release: v1_fallbacks)
    while V0 still exists. A version not stated reads as DEFAULT_VERSION, a V1 release."""
    if setting in ("v0", "v1"):
        return setting
    release = parse_release(version)
    if release < V1_DEFAULT or (falls_back and release < V0_REMOVED):
        return "v0"
    return "v1"


# Compute capability by catalog device, where vLLM 0.8-0.10's V1 oracle asks it: below 8.0 (no
# FlashAttention) V1 is refused up to 0.10.1; an fp8 KV cache needs FlashAttention 3 (major 9) or, from
# 0.10.0, a Blackwell data-center part (is_device_capability(100)). A device not named here counts as 8.x.
COMPUTE_CAPABILITY_MAJOR = {"t4": 7, "h100-sxm": 9, "h100-pcie": 9, "h100-nvl": 9, "h200": 9, "h20": 9,
                            "b200": 10, "gb200": 10}
# Speculative methods 0.8.x-0.9.x's V1 ran (engine/arg_utils.py _is_v1_supported_oracle); kvtwin's `mtp`
# is vLLM 0.9's deepseek_mtp. True: experimental there (VLLM_USE_V1 unset still falls back).
_V1_SPEC_METHODS: dict[Release, dict[str, bool]] = {
    (0, 8, 0): {"ngram": True},
    (0, 8, 3): {"ngram": True, "eagle": True, "eagle3": True},
    (0, 9, 0): {m: False for m in ("ngram", "medusa", "eagle", "eagle3", "mtp", "deepseek_mtp")},
}


def v1_fallbacks(version: Optional[str], *, device: str = "", scheduling_policy: str = "fcfs",
                 kv_cache_dtype: str = "auto", model_dtype: str = "bfloat16", partial_prefills: int = 1,
                 long_prefill_threshold: int = 0, lora: bool = False, pipeline_parallel: int = 1,
                 executor: Optional[str] = None, speculative_method: Optional[str] = None,
                 ) -> list[tuple[str, bool]]:
    """The features of a scenario that vLLM `version`'s V1 lacks, as engine/arg_utils.py
    _is_v1_supported_oracle (0.8.0 - 0.11.0) finds them: (feature, experimental). With VLLM_USE_V1 unset
    any of them makes vLLM run V0 (0.8 - 0.10; 0.11.0 has no V0 and refuses); with VLLM_USE_V1=1 an
    unsupported one is refused ("VLLM_USE_V1=1 is not supported with ..."), an experimental one runs
    on V1. Only the features kvtwin has fields for (docs/vllm_semantics.md lists the others)."""
    r = parse_release(version)
    if not V1_DEFAULT <= r < USE_V1_REMOVED:
        return []
    out: list[tuple[str, bool]] = []
    if scheduling_policy != "fcfs" and r < (0, 9, 2):
        out.append(("--scheduling-policy priority (engine.scheduling_policy)", False))
    if partial_prefills > 1 or (long_prefill_threshold and r < (0, 8, 3)):
        out.append(("Concurrent Partial Prefill (engine.max_num_partial_prefills, "
                    "long_prefill_token_threshold before 0.8.3)", False))
    major = COMPUTE_CAPABILITY_MAJOR.get(device, 8)
    if major < 8 and r < (0, 10, 2):
        out.append((f"Compute Capability < 8.0 (device {device})", False))
    if kv_cache_dtype != "auto" and r < V0_REMOVED and not (
            r >= (0, 8, 3) and (major == 9 or (major == 10 and r >= (0, 10, 0)))):
        out.append((f"--kv-cache-dtype {kv_cache_dtype} (engine.kv_cache_dtype) on device {device or 'custom'}",
                    False))
    if model_dtype == "float32" and r < (0, 9, 2):
        out.append(("--dtype float32 (model.dtype)", False))
    if lora and r < (0, 8, 3):
        out.append(("LoRA (engine.lora)", True))
    if pipeline_parallel > 1:
        if r < (0, 8, 3):
            out.append(("pipeline parallel (engine.pipeline_parallel_size)", True))
        elif (r < (0, 9, 0) and executor != "ray") or \
                (r < (0, 9, 2) and executor not in ("ray", "mp", "external_launcher")) or executor == "uni":
            out.append((f"pipeline parallel with executor {executor or 'unset'} "
                        f"(engine.distributed_executor_backend)", False))
    if speculative_method is not None and r < (0, 10, 0):
        methods = next(m for first, m in sorted(_V1_SPEC_METHODS.items(), reverse=True) if r >= first)
        if speculative_method not in methods or methods[speculative_method]:
            out.append((f"speculative method {speculative_method} (engine.speculative)",
                        methods.get(speculative_method, False)))
    return out


# The values `vllm serve --block-size` accepts, by the first release with each set (argparse
# `choices`; None: any integer). 0.6.0-0.8.4: engine/arg_utils.py `choices=[...]` (8, 16, 32 until
# 0.6.3; 64 and 128 from 0.6.4); 0.8.5-0.17.x: config.py (0.10: config/cache.py) `BlockSize =
# Literal[...]`, which get_kwargs turns into the flag's choices (1 from 0.8.5, 256 from 0.11.1);
# 0.18 types block_size `int`, and only the attention backend chosen at start-up refuses a size.
BLOCK_SIZE_CHOICES: dict[Release, Optional[tuple[int, ...]]] = {
    (0, 0, 0): (8, 16, 32),
    (0, 6, 4): (8, 16, 32, 64, 128),
    (0, 8, 5): (1, 8, 16, 32, 64, 128),
    (0, 11, 1): (1, 8, 16, 32, 64, 128, 256),
    (0, 18, 0): None,
}


def block_size_choices(version: Optional[str]) -> Optional[tuple[int, ...]]:
    """The block sizes vLLM `version`'s --block-size accepts (None: any)."""
    release = parse_release(version)
    return next(c for first, c in sorted(BLOCK_SIZE_CHOICES.items(), reverse=True) if release >= first)


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


# V1's API-server defaults for max_num_batched_tokens and max_num_seqs, by release (engine/arg_utils.py;
# docs/vllm_semantics.md "Scheduler limits" has the table with the LLM class's values). A "big" GPU
# gets 8192 tokens and 1024 sequences, another 2048 and 256; releases differ in what counts as big
# and in whether max_num_seqs follows the GPU at all.
V1_LIMITS_OVERRIDE: Release = (0, 6, 5)    # _override_v1_engine_args appears (before: V0's EngineArgs
                                           # and SchedulerConfig defaults, 2048 and 256)
V1_BIG_GPU_BY_NAME: Release = (0, 7, 0)    # "h100" or "h200" in the device name (0.6.5-0.6.6: none is big)
V1_SEQS_FOLLOW_GPU: Release = (0, 8, 4)    # before: max_num_seqs 1024 on every device (EngineArgs
                                           # __post_init__ 0.6.5-0.7.x, _set_default_args_v1 0.8.0-0.8.3)
V1_BIG_GPU_BY_MEMORY: Release = (0, 8, 5)  # device total memory >= 70 GiB instead of the name
V1_A100_NOT_BIG: Release = (0, 9, 0)       # ... and "a100" not in the device name (to 0.21)


def v1_default_limits(version: Optional[str], *, memory_mib: float, device_names: str) -> tuple[int, int]:
    """vLLM `version`'s V1 API-server defaults (max_num_batched_tokens, max_num_seqs) on a GPU with
    `memory_mib` in total (NVML's) and `device_names` (its names, any case), before the caps the
    scenario applies (engine/arg_utils.py _override_v1_engine_args 0.6.5-0.7.x, _set_default_args_v1
    0.8.0-0.10.x, _set_default_args 0.11.0, get_batch_defaults 0.11.1-0.21)."""
    release = parse_release(version)
    if release < V1_LIMITS_OVERRIDE:
        return 2048, 256
    names = device_names.lower()
    if release < V1_BIG_GPU_BY_NAME:
        big = False
    elif release < V1_BIG_GPU_BY_MEMORY:
        big = "h100" in names or "h200" in names
    else:
        big = memory_mib >= 70 * 1024 and (release < V1_A100_NOT_BIG or "a100" not in names)
    tokens, seqs = (8192, 1024) if big else (2048, 256)
    return tokens, (seqs if release >= V1_SEQS_FOLLOW_GPU else 1024)
