"""vLLM's behaviour by release (sim/core/vllm_versions.py), each row pinned against the released
wheel's code it comes from (vllm 0.12.0-0.21.0 from PyPI; paths inside the `vllm` package)."""
from __future__ import annotations

import pytest

from sim.core.kv import KVCacheManager
from sim.core.memory import KVCacheGroups
from sim.core.request import Status, make_request
from sim.core.scheduler import SchedulerConfig
from sim.core.scheduler_variants import make_scheduler
from sim.core.vllm_versions import async_scheduling_auto, has
from sim.scenario import validate_scenario


def scenario(**engine):
    return validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm", "engine": engine})


def test_what_auto_async_scheduling_resolves_to_by_release():
    """config/vllm.py VllmConfig.__post_init__: 0.12-0.13 default False (config/scheduler.py);
    0.14 turns it off with pipeline_parallel_size > 1, 0.15 no longer; speculative methods other
    than EagleModelTypes (eagle, eagle3, extract_hidden_states, the *_mtp family renamed mtp) turn it
    off, NgramGPUTypes ("ngram_gpu") keeps it on from 0.18; executors other than mp / uni /
    external_launcher (0.14-0.18 tuple; 0.19+ supports_async_scheduling(), False for ray) turn it
    off; platforms/cpu.py sets it False."""
    assert not async_scheduling_auto("0.13.0")[0] and async_scheduling_auto("0.14.0")[0]
    assert not async_scheduling_auto("0.14.1", pipeline_parallel=2)[0]
    assert async_scheduling_auto("0.15.0", pipeline_parallel=2)[0]
    assert not async_scheduling_auto("0.17", speculative_method="ngram_gpu")[0]
    assert async_scheduling_auto("0.18", speculative_method="ngram_gpu")[0]
    for method, on in (("ngram", False), ("draft_model", False), ("medusa", False), ("eagle", True),
                       ("eagle3", True), ("mtp", True), ("deepseek_mtp", True)):
        assert async_scheduling_auto("0.19", speculative_method=method)[0] is on, method
    on, why = async_scheduling_auto("0.19", executor="ray")
    assert not on and "ray" in why
    assert async_scheduling_auto("0.19", executor="mp")[0]
    assert not async_scheduling_auto("0.21", platform="cpu")[0]
    # through a scenario: the fields from-vllm writes
    assert scenario().async_scheduling
    assert not scenario(distributed_executor_backend="ray").async_scheduling
    assert not scenario(speculative_method="ngram").async_scheduling
    assert scenario(speculative_method="ngram", async_scheduling=True).async_scheduling


def test_reserve_full_prompt_exists_from_0_19():
    """config/scheduler.py scheduler_reserve_full_isl (default True) first appears in 0.19.0 (absent
    from 0.18.0's config and v1/core/sched/scheduler.py); an explicit setting wins."""
    assert not scenario(vllm_version="0.18.0").engine.reserve_full_prompt
    assert scenario(vllm_version="0.19.0").engine.reserve_full_prompt
    assert scenario(vllm_version="0.18", reserve_full_prompt=True).engine.reserve_full_prompt
    assert not SchedulerConfig.from_scenario(scenario(vllm_version="0.17")).reserve_full_prompt


def chunks(threshold, prompt=100):
    """The tokens request 0 (a lone prompt) computes per step until its first token."""
    sched = make_scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                                      long_prefill_token_threshold=threshold),
                      KVCacheManager(64, 16, enable_caching=False))
    req = make_request(0, 0.0, [(1, prompt)], 2)
    sched.add(req)
    sizes = []
    while req.num_output == 0:
        batch = sched.schedule()
        sizes.append(batch.num_prefill_tokens)
        sched.finish_step(batch)
    return sizes


def test_long_prefill_token_threshold_caps_every_chunk():
    """v1/core/sched/scheduler.py (0.19.0): `if 0 < long_prefill_token_threshold < num_new_tokens`
    caps a running request's chunk and a waiting request's first chunk alike; config/scheduler.py
    __post_init__ sets the threshold to int(max_model_len * 0.04) when max_num_partial_prefills > 1
    leaves it at 0."""
    assert chunks(0) == [64, 36]
    assert chunks(30) == [30, 30, 30, 10]
    s = scenario(max_model_len=10_000, long_prefill_token_threshold=1000)
    assert SchedulerConfig.from_scenario(s).long_prefill_token_threshold == 1000
    assert scenario(max_model_len=10_000, max_num_partial_prefills=2).long_prefill_token_threshold == 400
    assert scenario(max_model_len=10_000).long_prefill_token_threshold == 0


def test_max_num_seqs_defaults_to_at_most_max_num_batched_tokens():
    """engine/arg_utils.py (0.12.0-0.21.0) _set_default_max_num_seqs_and_batched_tokens_args:
    an unset max_num_seqs becomes min(the usage-context default, max_num_batched_tokens)."""
    assert scenario().max_num_seqs == 1024
    assert scenario(max_num_batched_tokens=512).max_num_seqs == 512
    assert scenario(max_num_batched_tokens=512, max_num_seqs=8).max_num_seqs == 8


# Gemma-3-27B's KV cache groups: 62 layers, 52 sliding (window 1024) and 10 full, in groups of 10:
# 1 full group and 6 sliding ones, sliding first.
GEMMA3 = KVCacheGroups(group_size=10, full_groups=1, sliding_groups=6, sliding_window=1024, sliding_first=True)


def admit_32k_prompt(version, num_blocks, held_tokens=0):
    """A 32,768-token prompt behind a running request of `held_tokens` prompt tokens; returns (the
    prompt's request after up to 3 steps, the blocks the running request held)."""
    kv = KVCacheManager(num_blocks, 16, False, max_model_len=40_000, groups=GEMMA3, max_num_batched_tokens=8192)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8192, max_model_len=40_000,
                             sliding_admission_cap=has(version, "sliding_window_admission_cap"))
    sched = make_scheduler(config, kv)
    if held_tokens:
        sched.add(make_request(0, 0.0, [(1, held_tokens)], 50))
        sched.finish_step(sched.schedule())
    held = kv.pool.usable_blocks - kv.pool.num_free
    long = make_request(1, 0.0, [(2, 32_768)], 4)
    sched.add(long)
    for _ in range(3):
        batch = sched.schedule()
        if batch is None:
            break
        sched.finish_step(batch)
    return long, held


def test_the_sliding_window_admission_cap_exists_from_0_20():
    """v1/core/single_type_kv_cache_manager.py get_num_blocks_to_allocate: 0.20.0 caps
    num_required_blocks at _max_admission_blocks_per_request for a sliding-window group; 0.19.0
    has no cap, so kv_cache_manager.py can_fit_full_sequence (the reserve-full-prompt gate) asks
    cdiv(32768, 16) = 2,048 blocks of each of Gemma-3-27B's 7 groups: 14,336 free blocks (0.20:
    2,048 + 6 x 577, the window's 1,023 tokens plus an 8,192-token chunk, in blocks, plus one: 5,510)."""
    assert has("0.20.0", "sliding_window_admission_cap") and not has("0.19.2", "sliding_window_admission_cap")
    _, held = admit_32k_prompt("0.19", 20_001, held_tokens=800)
    assert held > 0
    for free, admitted_019 in ((14_000, False), (14_400, True)):
        long, _ = admit_32k_prompt("0.19", free + held + 1, held_tokens=800)
        assert (long.admit_step == 1) is admitted_019, free
        assert long.status is (Status.RUNNING if admitted_019 else Status.WAITING)
    long, _ = admit_32k_prompt("0.20", 5_600 + held + 1, held_tokens=800)
    assert long.admit_step == 1
    long, _ = admit_32k_prompt("0.20", 5_400 + held + 1, held_tokens=800)
    assert long.admit_step == -1 and long.status is Status.WAITING
    # a pool that can never meet 0.19's gate rejects the prompt instead of waiting forever
    never, _ = admit_32k_prompt("0.19", 10_001)
    assert never.status is Status.REJECTED and "14336" in never.reject_reason.replace(",", "")
    assert admit_32k_prompt("0.20", 10_001)[0].admit_step == 0


def test_default_token_budget_is_capped_at_max_num_seqs_times_max_model_len():
    """engine/arg_utils.py _set_default_max_num_seqs_and_batched_tokens_args (0.12.0-0.21.0): a
    defaulted max_num_batched_tokens becomes min(max_num_seqs x max_model_len, default), max_num_seqs
    being the one set or defaulted; a set budget is kept as given."""
    assert scenario(max_num_seqs=2, max_model_len=2048).max_num_batched_tokens == 4096
    assert scenario(max_num_seqs=2, max_model_len=2048, max_num_batched_tokens=8192).max_num_batched_tokens == 8192
    assert scenario(max_model_len=2).max_num_batched_tokens == 2048        # 1024 seqs x 2 tokens
    assert scenario(max_model_len=4096).max_num_batched_tokens == 8192
    # without chunked prefill the default first rises to max_model_len, then the cap applies
    assert scenario(chunked_prefill=False, max_model_len=16384, max_num_seqs=1).max_num_batched_tokens == 16384


def test_performance_mode_throughput_doubles_the_defaults_from_0_17():
    """engine/arg_utils.py (0.17.0-0.21.0): --performance-mode throughput doubles a defaulted
    max_num_batched_tokens and max_num_seqs (16384 and 2048 on an H100 API server); 0.16.0 has no
    such flag (config/vllm.py PerformanceMode appears in 0.17.0)."""
    throughput = scenario(vllm_version="0.19", performance_mode="throughput")
    assert (throughput.max_num_batched_tokens, throughput.max_num_seqs) == (16384, 2048)
    assert scenario(vllm_version="0.19", performance_mode="throughput", max_num_seqs=64).max_num_seqs == 64
    assert scenario(vllm_version="0.19", performance_mode="interactivity").max_num_seqs == 1024
    with pytest.raises(ValueError, match="performance_mode 'throughput': vLLM 0.16 has no --performance-mode"):
        scenario(vllm_version="0.16", performance_mode="throughput")


def test_pipeline_parallel_turns_auto_async_off_in_0_14_only():
    """config/vllm.py VllmConfig.__post_init__: 0.14.0 turns auto async scheduling off with
    pipeline_parallel_size > 1 and refuses it when set explicitly ("Async scheduling is not yet
    compatible with pipeline_parallel_size > 1"); 0.15.0 has neither rule."""
    assert not scenario(vllm_version="0.14", pipeline_parallel_size=2).async_scheduling
    assert scenario(vllm_version="0.15", pipeline_parallel_size=2).async_scheduling
    assert scenario(vllm_version="0.15", pipeline_parallel_size=2, async_scheduling=True).async_scheduling
    with pytest.raises(ValueError, match="not yet compatible with pipeline_parallel_size"):
        scenario(vllm_version="0.14", pipeline_parallel_size=2, async_scheduling=True)


def test_the_cuda_graph_estimate_follows_the_environment_switch():
    """envs.py VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: default "0" in 0.19.0, "1" in 0.20.0;
    v1/worker/gpu_worker.py determine_available_memory (0.19.0) subtracts
    cudagraph_memory_estimate_applied, the estimate when the switch is on, else 0; and takes no
    estimate at all under --enforce-eager."""
    from sim.core.memory import plan_memory

    default_019, on_019 = plan_memory(scenario()), plan_memory(scenario(estimate_cudagraph_memory=True))
    assert default_019.cudagraph_bytes == 0 < on_019.cudagraph_bytes
    assert on_019.kv_budget_bytes == default_019.kv_budget_bytes - on_019.cudagraph_bytes
    assert plan_memory(scenario(vllm_version="0.20")).cudagraph_bytes == on_019.cudagraph_bytes
    assert plan_memory(scenario(vllm_version="0.20", estimate_cudagraph_memory=False)).cudagraph_bytes == 0
    assert plan_memory(scenario(estimate_cudagraph_memory=True, enforce_eager=True)).cudagraph_bytes == 0


def test_the_dummy_samplers_peak_follows_the_top_k_top_p_path_of_the_release():
    """v1/sample/ops/topk_topp_sampler.py: 0.12.0-0.16.0 apply_top_k_top_p sorts the fp32 logits
    rows (logits.sort: sorted values and int64 indices, plus the sort's source indices and CUB's
    alternate buffers); 0.17.0 sends rows >= 8 to the in-place Triton kernel
    (v1/sample/ops/topk_topp_triton.py); 0.11.0 sampled with FlashInfer when installed (the
    VLLM_USE_FLASHINFER_SAMPLER None-means-on rule, opt-in from 0.12.0). The dummy sampler runs
    max_num_seqs rows with top_k and top_p set (v1/worker/gpu_model_runner.py _dummy_sampler_run)."""
    from sim.core.memory import (SAMPLER_COPIES, SAMPLER_COPIES_SORT, plan_memory, sampler_logits_copies)

    assert [sampler_logits_copies(v) for v in ((0, 11), (0, 12), (0, 16), (0, 17), (0, 19))] == \
        [SAMPLER_COPIES, SAMPLER_COPIES_SORT, SAMPLER_COPIES_SORT, SAMPLER_COPIES, SAMPLER_COPIES]
    sort, triton = (plan_memory(validate_scenario({"model": "llama-3.1-8b", "device": "rtx-4090",
                                                   "engine": {"vllm_version": v, "max_model_len": 32768}}))
                     for v in ("0.16", "0.17"))
    rows_bytes = 256 * 128_256 * 4            # 256 rows (max_num_seqs) of Llama-3.1-8B's vocabulary
    assert sort.activation_bytes - triton.activation_bytes == pytest.approx(
        (SAMPLER_COPIES_SORT - SAMPLER_COPIES) * rows_bytes, abs=2)
    assert sort.num_blocks < triton.num_blocks


def test_the_graph_estimate_switch_exists_from_0_18():
    """envs.py gains VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS in 0.18.0 (absent from 0.17.0's envs.py
    and v1/worker/gpu_worker.py): setting it for an earlier release is refused, not dropped."""
    assert scenario(vllm_version="0.18", estimate_cudagraph_memory=True).engine.estimate_cudagraph_memory
    with pytest.raises(ValueError, match="vLLM 0.17 has no VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"):
        scenario(vllm_version="0.17", estimate_cudagraph_memory=True)
    assert scenario(vllm_version="0.17", estimate_cudagraph_memory=False).engine.estimate_cudagraph_memory is False


def test_the_big_gpu_defaults_follow_vllms_name_and_memory_test():
    """engine/arg_utils.py get_batch_defaults (0.12.0-0.21.0): NVML's total >= 70 GiB and "a100" not in
    the device name give 8192 tokens / 1024 sequences; an A100 80GB, an L40S get 2048 / 256."""
    big = {"h100-sxm": True, "h200": True, "a100-80g": False, "l40s": False, "rtx-pro-6000-server": True}
    for device, is_big in big.items():
        s = validate_scenario({"model": "qwen3-0.6b", "device": device, "engine": {"max_model_len": 4096}})
        assert (s.max_num_batched_tokens, s.max_num_seqs) == ((8192, 1024) if is_big else (2048, 256)), device


@pytest.mark.parametrize("version, engine, device, limits", [
    ("0.6.4", "v1", "h100-sxm", (2048, 256)),    # no V1 override: EngineArgs 256, SchedulerConfig 2048
    ("0.6.5", "v1", "h100-sxm", (2048, 1024)),   # _override_v1_engine_args: 2048 on any GPU
    ("0.7.3", "v1", "h100-sxm", (8192, 1024)),   # "h100" or "h200" in the device name
    ("0.7.3", "v1", "a100-40g", (2048, 1024)),   # max_num_seqs 1024 on every GPU (EngineArgs __post_init__)
    ("0.8.3", "auto", "a100-40g", (2048, 1024)),  # _set_default_args_v1: default_max_num_seqs = 1024
    ("0.8.3", "auto", "h20", (2048, 1024)),      # 96 GiB but named H20
    ("0.8.4", "auto", "h20", (2048, 256)),       # max_num_seqs follows the name test too
    ("0.8.4", "auto", "h200", (8192, 1024)),
    ("0.8.5", "auto", "h20", (8192, 1024)),      # device total memory >= 70 GiB
    ("0.8.5", "auto", "a100-80g", (8192, 1024)),  # ... an A100 80GB included
    ("0.8.5", "auto", "mi300x", (8192, 1024)),
    ("0.9.0", "auto", "a100-80g", (2048, 256)),  # "a100" not in the name, from 0.9.0 on
    ("0.11.0", "auto", "h100-sxm", (8192, 1024)),
    ("0.11.0", "auto", "l40s", (2048, 256)),
])
def test_v1_default_limits_follow_the_release(version, engine, device, limits):
    """engine/arg_utils.py, V1's API-server (UsageContext.OPENAI_API_SERVER) defaults
    (max_num_batched_tokens, max_num_seqs): 0.6.4 has no V1 override; 0.6.5-0.6.6
    _override_v1_engine_args sets 2048 tokens and __post_init__ 1024 sequences; 0.7.0-0.7.3 tests
    "h100"/"h200" in current_platform.get_device_name(); 0.8.0-0.8.3 _set_default_args_v1 the same
    name test with default_max_num_seqs = 1024 on every GPU; 0.8.4 the name test for both; 0.8.5
    get_device_total_memory() >= 70 * GiB_bytes; 0.9.0-0.21 also "a100" not in the name."""
    s = validate_scenario({"model": "qwen3-0.6b", "device": device,
                           "engine": {"max_model_len": 4096, "vllm_version": version, "vllm_engine": engine}})
    assert s.engine_generation == "v1"
    assert (s.max_num_batched_tokens, s.max_num_seqs) == limits
