"""Scenario schema: one validated YAML file describes model, device, engine, workload and SLOs.

Unknown keys, wrong types and out-of-range values are errors that name the full path
(`engine.blok_size`), the value and what is allowed, with the closest valid key when a
key is misspelt. `--set path=value` overrides go through the same validation.
"""
from __future__ import annotations

import argparse

import copy
import difflib
import functools
import re
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from sim.core import vllm_versions
from sim.core.memory import draft_model_problem, parse_vllm_version, pool_block_bytes, weight_bytes_per_gpu
from sim.core.offload import KvOffload, scenario_problem as offload_problem
from sim.errors import MAX_PROBLEMS_SHOWN, ScenarioError
from sim.core.files import FileFormatError, excerpt, load_yaml, read_text
from sim.names import name_problem
from sim.routers.config import DEPLOYED_ROUTERS, DynamoRouter, LlmDRouter, SglangRouter
from sim.disagg_config import SIDES, Disaggregation
from sim.speculative import SpeculativeConfig
from sim.lora import LoraConfig, WorkloadLora, scenario_problems as lora_problems
from sim.lora import scenario_reserved_bytes as lora_reserved_bytes
from sim.autoscale import Autoscaling, autoscaling_problems
from sim.arrival_shape import MAX_STEPS, Diurnal, RateStep, check_shape, shape_of
from sim.core.strict import refuse_unread
from sim.core.catalog import (MAX_DEVICE_MIB, DeviceSpec, ModelSpec, StrictModel, catalog_entry,
                         model_fields_from_hf_config)




# Upper bounds on sizes: far above any real deployment, low enough that a typo (1e12) is a
# clear error rather than a MemoryError after minutes. docs/security.md lists them.
MAX_REQUESTS = 1_000_000
# A synthetic workload is made as the run reaches it, and with --spill-records its records go to
# disk (sim/output/streamed.py): its request count is bounded by time, not memory (10M: bench/fleet_scale.py).
MAX_SYNTHETIC_REQUESTS = 100_000_000
MAX_TOKENS = 2**27            # a prompt, an answer, a context (134M tokens)
MAX_DURATION_S = 30 * 86400.0
MAX_REPLICAS = 1024
MAX_VARIANTS = 64
MAX_LIST = 10_000             # tenants, priorities, prompt segments
MAX_POOL_BLOCKS = 2**24       # KV blocks over all replicas (~120 bytes of bookkeeping each)


# ----------------------------------------------------------------------------- model/device

def _resolve_catalog(kind: str, value: Any, base_dir: Path | None) -> Any:
    """`name` or {base: name, ...overrides} or {hf_config: path, ...} -> a plain field dict."""
    if isinstance(value, (ModelSpec, DeviceSpec)):
        return value
    if isinstance(value, str):
        return catalog_entry(kind, value)
    if not isinstance(value, dict):
        return value  # let pydantic report the type error
    value = dict(value)
    fields: dict[str, Any] = {}
    if "base" in value:
        fields.update(catalog_entry(kind, value.pop("base")))
    if kind == "models" and "hf_config" in value:
        fields.update(model_fields_from_hf_config(_resolve_path(value.pop("hf_config"), base_dir)))
    fields.update(value)
    return fields


def _resolve_path(p: Any, base_dir: Path | None) -> Path:
    path = Path(p).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return path


# ----------------------------------------------------------------------------- engine

class Parallelism(StrictModel):
    tp: int = Field(default=1, ge=1, le=1024,
                    description="tensor-parallel degree: weights and KV heads split per GPU, two all-reduces "
                                "per layer (modelled, not run)")
    # vLLM's --data-parallel-size: dp ranks, each a whole engine (own scheduler with the full limits
    # and own KV pool, attention sliced over tp) behind vLLM's DP load balancer (sim/dp.py); a MoE
    # model's experts span all tp x dp GPUs and its ranks step in lockstep.
    dp: int = Field(default=1, ge=1, le=1024,
                    description="data-parallel degree, vLLM's --data-parallel-size: ranks that are whole engines "
                                "(full max_num_seqs, own KV pool each) behind vLLM's DP load balancer; a MoE "
                                "model's ranks step in lockstep (modelled, not run)")
    # vLLM's --enable-expert-parallel: 1 = experts sliced over tp x dp GPUs (each GPU a slice of
    # every expert), tp x dp = whole experts spread over the GPUs with an all-to-all per MoE layer.
    ep: int = Field(default=1, ge=1, le=2**20,
                    description="expert-parallel degree: 1, or tp x dp to spread whole MoE experts over the "
                                "GPUs (--enable-expert-parallel)")
    # How vLLM spreads requests over the dp ranks and runs their MoE exchange (sim/dp.py,
    # docs/vllm_semantics.md "Data parallel").
    dp_local: Optional[int] = Field(
        default=None, ge=1, le=1024,
        description="data-parallel ranks per node, vLLM's --data-parallel-size-local (unset: all dp ranks on "
                    "one node); with dp_load_balancing hybrid each node balances its own ranks")
    dp_load_balancing: Literal["internal", "hybrid", "external"] = Field(
        default="internal",
        description="internal (vLLM's API servers pick a rank by waiting x 4 + running, from counts the DP "
                    "coordinator publishes every 100 ms) | hybrid (--data-parallel-hybrid-lb: the same per "
                    "node, cluster.router across nodes) | external (--data-parallel-external-lb: "
                    "cluster.router picks the rank)")
    api_servers: Optional[int] = Field(
        default=None, ge=1, le=1024,
        description="vLLM's --api-server-count: front-end processes, each balancing with its own view of "
                    "the ranks and each one server of engine.front_end_s's queue (unset: vLLM's default for "
                    "vllm_version, the ranks balanced from 0.15, else 1)")
    all2all_backend: Literal[
        "allgather_reducescatter", "naive", "pplx", "deepep_high_throughput", "deepep_low_latency",
        "flashinfer_all2allv", "mori", "nixl_ep", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided",
    ] = Field(
        default="allgather_reducescatter",
        description="vLLM's --all2all-backend, the MoE token exchange between dp ranks: allgather_reducescatter "
                    "(default) | naive (broadcasts, an all-reduce back) | the all-to-all kernels (deepep_*, "
                    "pplx, mori, nixl_ep, flashinfer_*: each token to the ranks of its experts); "
                    "deepep_high_throughput turns CUDA graphs off")
    dp_backend: Literal["mp", "ray"] = Field(
        default="mp",
        description="vLLM's --data-parallel-backend: how the dp engines are launched (processes or Ray "
                    "actors); both run the same engine loop, so it does not change the prediction")

    @property
    def gpus(self) -> int:
        """GPUs one engine (all its data-parallel ranks) uses."""
        return self.tp * self.dp


class EngineConfig(StrictModel):
    batching: Literal["continuous", "static"] = Field(
        default="continuous",
        description="continuous (vLLM) | static (HF generate: a batch runs until its last member ends)")
    allocation: Literal["paged", "contiguous"] = Field(
        default="paged",
        description="paged (vLLM) | contiguous (reserve per request up front)")
    block_size: int = Field(
        default=16, ge=1, le=1024,
        description="tokens per KV block (vLLM's --block-size); with a paged pool and continuous batching, "
                    "one vllm_version accepts: 8, 16, 32 before 0.6.4; 64 and 128 too from 0.6.4; 1 too from "
                    "0.8.5; 256 too from 0.11.1; any size from 0.18")
    num_blocks: Optional[int] = Field(
        default=None, ge=2, le=2**32,
        description="the pool size including vLLM's null block 0 (--num-gpu-blocks-override); sized from "
                    "memory when unset, and checked against it")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1,
        description="the fraction of device memory vLLM may use (--gpu-memory-utilization); unset: vLLM's "
                    "default for vllm_version (0.9, 0.92 from 0.20)")
    max_num_seqs: Optional[int] = Field(
        default=None, ge=1, le=2**20,
        description="sequences per step; default as vLLM's API server for vllm_version: from 0.9 1024 on >= "
                    "70 GiB non-A100 GPUs, else 256 (docs/vllm_semantics.md: earlier V1; V0: 256); "
                    "at most max_num_batched_tokens")
    max_num_batched_tokens: Optional[int] = Field(
        default=None, ge=1, le=MAX_TOKENS,
        description="the token budget per step; default as vLLM's API server for vllm_version: from 0.9 8192 "
                    "on >= 70 GiB non-A100 GPUs, else 2048 (docs/vllm_semantics.md: earlier V1; V0: 2048); "
                    "at least max_model_len without chunked prefill")
    max_model_len: Optional[int] = Field(
        default=None, ge=2, le=MAX_TOKENS,
        description="the longest request (prompt + output); default: the model's max_position_embeddings")
    chunked_prefill: bool = Field(
        default=True,
        description="split long prompts over steps (vLLM V1's default; unset under V0: only for a context "
                    "over 32K tokens without a sliding window, speculative decoding or LoRA)")
    prefix_caching: bool = Field(
        default=True,
        description="reuse cached blocks of identical prefixes (vLLM V1's default; unset under V0: off)")
    preemption: Literal["recompute"] = Field(
        default="recompute",
        description="what a preempted request loses: recompute (the only mode vLLM V1 supports)")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="fcfs | priority (workload.priorities; lower values first)")
    step_composition: Literal["mixed", "prefill_first"] = Field(
        default="mixed",
        description="mixed (vLLM V1: decodes and prefill chunks share a step) | prefill_first (vLLM V0, "
                    "nano-vllm, Vidur); unset: the engine generation's (vllm_engine; V0 with chunked prefill "
                    "mixes)")
    admission_watermark: float = Field(
        default=0.0, ge=0, lt=1,
        description="fraction of blocks kept free when admitting a waiting request; unset: the engine "
                    "generation's (V0: 0.01, V1: 0)")
    reserve_full_prompt: bool = Field(
        default=True,
        description="admit only if the blocks of the whole prompt are free now (vLLM's "
                    "scheduler_reserve_full_isl, from 0.19); unset: vLLM's default for vllm_version (on from 0.19, "
                    "absent before)")
    long_prefill_token_threshold: int = Field(
        default=0, ge=0, le=MAX_TOKENS,
        description="vLLM's --long-prefill-token-threshold: no chunk of a prompt computes more tokens in one step "
                    "(0 = off); max_num_partial_prefills > 1 sets it to 4 % of max_model_len when left at 0")
    max_num_partial_prefills: int = Field(
        default=1, ge=1, le=2**20,
        description="vLLM's --max-num-partial-prefills (vLLM V1 serves only 1; a larger value here applies "
                    "the threshold rule above)")
    contiguous_reserve: Literal["max_model_len", "request"] = Field(
        default="max_model_len",
        description="what contiguous allocation reserves per request: max_model_len (the server cannot know"
                    " the answer's length) | request (its own prompt + output: an oracle baseline)")
    activation_mib: Optional[float] = Field(
        default=None, ge=0, le=MAX_DEVICE_MIB,
        description="activation memory outside the KV pool, MiB; estimated from the shapes when unset (the "
                    "engine sets it from its profiling forward)")
    # kvtwin's own engine on the `cpu` device is synchronous; read the resolved value as
    # `Scenario.async_scheduling`.
    async_scheduling: Union[bool, Literal["auto"]] = Field(
        default="auto",
        description="auto | true | false: vLLM plans step N+1 while step N runs, so host work hides and a "
                    "finished request frees its blocks one step late; auto = vLLM's default for "
                    "vllm_version (on from 0.14) on a GPU with continuous batching")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto",
        description="vLLM's --kv-cache-dtype: auto (the model dtype) | fp8 | fp8_e4m3 | fp8_e5m2 (half the "
                    "bytes of a 16-bit cache)")
    memory_plan: Literal["vllm", "simple"] = Field(
        default="vllm",
        description="how the pool is sized without num_blocks: vllm (vLLM's own plan: torch-visible memory,"
                    " profiling peak, non-torch memory, CUDA-graph estimate) | simple (datasheet memory - "
                    "weights - activations - device.reserved_mib); the cpu device always uses simple")
    vllm_version: str = Field(
        default="0.19", pattern=r"^v?\d{1,3}\.\d{1,3}([.+-][.+\w-]{0,40})?$",
        description="the vLLM release whose version-dependent behaviour applies (memory terms, async "
                    "default; the default is the release the memory terms were fitted on); major.minor "
                    "count, a patch or pre-release tail (0.10.1.1, 0.11.0rc2) is allowed")
    vllm_engine: Literal["auto", "v0", "v1"] = Field(
        default="auto",
        description="vLLM's engine generation, as VLLM_USE_V1 picks it: auto (the release's default: V0 "
                    "before 0.8.0; V1 from it, unless a feature V1 lacks in 0.8-0.10 makes vLLM fall back to "
                    "V0) | v0 (VLLM_USE_V1=0; releases before 0.11.0) | v1 (VLLM_USE_V1=1; from 0.6.4). It "
                    "decides the scheduler's defaults (V0: prefill-first steps, 1 % watermark, no prefix "
                    "caching), the trained step-time entry and the error band (docs/vllm_semantics.md)")
    front_end_s: Optional[float] = Field(
        default=None, ge=0, le=1.0,
        description="vLLM's API-server time per request before it reaches the engine (HTTP, chat template, "
                    "tokenization, the asyncio loop: sim/front_end.py), seconds; the requests queue first "
                    "come, first served over parallelism.api_servers processes (--api-server-count); 0 = no "
                    "front end; unset: on a vLLM server (continuous, paged) without a device profile the trained family's "
                    "fitted value for the engine generation (vllm_engine), whatever step_times is, else 0 "
                    "(docs/fidelity.md)")
    front_end_token_s: Optional[float] = Field(
        default=None, ge=0, le=0.01,
        description="vLLM's API-server time per streamed token on the same loop (the output handler's "
                    "detokenization and one SSE chunk per request per step: sim/front_end.py), seconds; each "
                    "step's outputs hold the loop for (requests in the step) x this (steps already due when "
                    "the loop reaches them: one chunk per request, as vLLM's collectors merge them), delaying "
                    "the intake after them and the tokens' delivery; only with a front end (front_end_s above "
                    "0); unset: as front_end_s, the trained family's fitted value on a vLLM server (none adopted "
                    "yet), else 0")
    front_end_step_s: Optional[float] = Field(
        default=None, ge=0, le=0.01,
        description="vLLM's API-server time per engine step's outputs on the same loop (the output handler's "
                    "pass over one step's message: sim/front_end.py), seconds, added to each step's streaming "
                    "job; a replica's steps already due when the loop reaches them stream as one job (one "
                    "chunk per request, this per step); only with a front end (front_end_s above 0); unset: "
                    "as front_end_s, the trained family's fitted value on a vLLM server (none adopted yet), else 0")
    client_in_process: bool = Field(
        default=False,
        description="the client awaits vLLM's AsyncLLMEngine.generate on its own asyncio loop, in the engine's "
                    "process (a benchmark that embeds vLLM), not over HTTP: under V0's async output processing "
                    "a token then reaches it when that loop next wakes, at the end of the next step or at a "
                    "request's send, not once the next step's host work is done (docs/vllm_semantics.md); "
                    "no effect on V1")
    enforce_eager: bool = Field(
        default=False,
        description="vLLM's --enforce-eager: no CUDA graphs, so none of their memory comes off the KV budget")
    estimate_cudagraph_memory: Optional[bool] = Field(
        default=None,
        description="vLLM's VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: take the CUDA-graph estimate off the KV "
                    "budget; unset: the release's default (off up to 0.19, on from 0.20)")
    performance_mode: Literal["balanced", "interactivity", "throughput"] = Field(
        default="balanced",
        description="vLLM's --performance-mode (from 0.17): throughput doubles the default max_num_seqs and "
                    "max_num_batched_tokens; interactivity changes only CUDA-graph sizes (not modelled)")
    pipeline_parallel_size: int = Field(
        default=1, ge=1, le=1024,
        description="vLLM's --pipeline-parallel-size, for its effect on auto async scheduling alone (vLLM 0.14 "
                    "turns it off with pp > 1); kvtwin runs the model on tp GPUs without pipeline stages")
    kv_cache_memory_bytes: Optional[int] = Field(
        default=None, ge=1, le=2**50,
        description="vLLM's --kv-cache-memory-bytes: the KV pool's bytes per GPU, replacing the memory plan "
                    "(vLLM skips its profile then and ignores gpu_memory_utilization)")
    distributed_executor_backend: Optional[Literal["mp", "uni", "ray", "external_launcher"]] = Field(
        default=None,
        description="vLLM's --distributed-executor-backend (unset: uni on one GPU, mp on several); ray turns "
                    "auto async scheduling off")
    speculative_method: Optional[str] = Field(
        default=None, pattern=r"^[a-z0-9_]{1,40}$",
        description="vLLM's --speculative-config method for its effect on auto async scheduling alone (off "
                    "for methods other than EAGLE/MTP and NGram-GPU); set from `speculative` when that is set")
    speculative: Optional[SpeculativeConfig] = Field(
        default=None,
        description="speculative decoding (vLLM's --speculative-config: method, num_speculative_tokens, "
                    "model, acceptance); off when unset (see `SpeculativeConfig`, docs/whatif/speculative.md)")
    lora: Optional[LoraConfig] = Field(
        default=None,
        description="LoRA adapters (vLLM's --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras); off "
                    "when unset (see `LoraConfig`, docs/whatif/lora.md)")
    kv_offload: Optional[KvOffload] = Field(
        default=None,
        description="vLLM's KV offloading to CPU (--kv-offloading-size / --kv-offloading-backend, or "
                    "--kv-transfer-config with OffloadingConnector / LMCacheConnectorV1): a CPU tier below "
                    "the prefix cache (docs/kv_offload.md); unset: off")

    @model_validator(mode="after")
    def _version_defaults(self) -> "EngineConfig":
        """Fields left unset take vLLM's default for vllm_version (sim/core/vllm_versions.py)."""
        unset = self.model_fields_set      # (set through __dict__: an assignment would re-validate)
        if "gpu_memory_utilization" not in unset:
            self.__dict__["gpu_memory_utilization"] = vllm_versions.default_gpu_memory_utilization(self.vllm_version)
        if "reserve_full_prompt" not in unset:
            self.__dict__["reserve_full_prompt"] = vllm_versions.has(self.vllm_version, "reserve_full_prompt")
        problem = vllm_versions.generation_problem(self.vllm_version, self.vllm_engine)
        if problem:
            raise ValueError(f"vllm_engine {self.vllm_engine}: {problem}")
        if self.estimate_cudagraph_memory and not vllm_versions.has(self.vllm_version, "cudagraph_estimate_switch"):
            raise ValueError(f"estimate_cudagraph_memory: vLLM {self.vllm_version} has no "
                             f"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS (from 0.18); leave it unset")
        if self.performance_mode != "balanced" and not vllm_versions.has(self.vllm_version, "performance_mode"):
            raise ValueError(f"performance_mode {self.performance_mode!r}: vLLM {self.vllm_version} has no "
                             f"--performance-mode (from 0.17); use balanced")
        if (self.async_scheduling is True and self.pipeline_parallel_size > 1
                and vllm_versions.has(self.vllm_version, "async_off_with_pipeline_parallel")):
            raise ValueError(f"async_scheduling true with pipeline_parallel_size {self.pipeline_parallel_size}: vLLM "
                             f"{self.vllm_version} refuses it (\"Async scheduling is not yet compatible with "
                             f"pipeline_parallel_size > 1\", config/vllm.py)")
        if self.speculative is not None and self.batching == "static":
            raise ValueError("speculative decoding needs continuous batching (batching: static pads every "
                             "row to one token a step)")
        if self.speculative is not None:       # one method: the section's decides auto async scheduling
            if self.speculative_method not in (None, self.speculative.method):
                raise ValueError(f"speculative_method {self.speculative_method!r} differs from "
                                 f"speculative.method {self.speculative.method!r}; set only speculative")
            self.__dict__["speculative_method"] = self.speculative.method
        return self


# ----------------------------------------------------------------------------- workload

class LengthDist(StrictModel):
    """A token-length distribution. An integer in YAML is shorthand for {dist: fixed, value: N}."""

    dist: Literal["fixed", "uniform", "normal", "lognormal", "empirical", "sharegpt"] = Field(
        default="fixed",
        description="fixed (an integer is shorthand) | uniform | normal | lognormal | empirical (values or "
                    "a file) | sharegpt (an approximation of ShareGPT after vLLM's filter)")
    value: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS, description="fixed: the length")
    min: Optional[int] = Field(
        default=None, ge=0, le=MAX_TOKENS,
        description="uniform: lowest length; others: a lower clip")
    max: Optional[int] = Field(
        default=None, ge=1, le=MAX_TOKENS,
        description="uniform: highest length; others: an upper clip")
    # a tinier mean overflows
    mean: Optional[float] = Field(
        default=None, ge=1e-3, le=MAX_TOKENS,
        description="normal / lognormal: mean length in tokens")
    std: Optional[float] = Field(
        default=None, ge=0, le=MAX_TOKENS,
        description="normal / lognormal: standard deviation in tokens")
    values: Optional[list[int]] = Field(
        default=None, max_length=MAX_REQUESTS,
        description="empirical: lengths drawn from with replacement")
    file: Optional[Path] = Field(
        default=None,
        description="empirical: a file of lengths (one a line, or a CSV with `column`)")
    column: Optional[str] = Field(default=None, description="empirical: the CSV column holding the lengths")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return v
        if isinstance(v, int):
            return {"dist": "fixed", "value": v}
        return v

    # each distribution's parameters; min and max clip the others' lengths (sim/workload.py)
    PARAMETERS: ClassVar[dict[str, tuple[str, ...]]] = {
        "fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std", "min", "max"),
        "lognormal": ("mean", "std", "min", "max"), "empirical": ("values", "file", "column", "min", "max"),
        "sharegpt": ("min", "max")}

    @model_validator(mode="after")
    def _required(self) -> "LengthDist":
        need = {"fixed": ["value"], "uniform": ["min", "max"], "normal": ["mean", "std"],
                "lognormal": ["mean", "std"], "empirical": [], "sharegpt": []}[self.dist]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"dist '{self.dist}' needs {', '.join(missing)}")
        unused = [k for k in ("value", "min", "max", "mean", "std", "values", "file", "column")
                  if getattr(self, k) is not None and k not in self.PARAMETERS[self.dist]]
        if unused:      # a silently ignored parameter would leave the workload unchanged
            hint = ("; for a mean and spread of your own, set dist: lognormal (or normal) with mean and std"
                    if {"mean", "std"} & set(unused) else "")
            raise ValueError(f"dist '{self.dist}' does not use {', '.join(unused)} (its parameters: "
                             f"{', '.join(self.PARAMETERS[self.dist])}){hint}")
        if self.column is not None and self.file is None:
            raise ValueError("column names a column of `file`: give file too (or drop column)")
        if self.dist == "empirical" and (self.values is None) == (self.file is None):
            raise ValueError("dist 'empirical' needs exactly one of 'values' or 'file'")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        if self.values is not None and (not self.values or min(self.values) < 1 or max(self.values) > MAX_TOKENS):
            raise ValueError(f"values must be a non-empty list of lengths from 1 to {MAX_TOKENS}")
        return self


class RampUp(StrictModel):
    """vLLM bench's --ramp-up-strategy: request i of N arrives at rate start + (end - start) i/(N-1)
    (linear) or start (end/start)^(i/(N-1)) (exponential) instead of `rate`; gaps are not rescaled."""

    strategy: Literal["linear", "exponential"] = Field(description="linear | exponential")
    start_rps: float = Field(ge=1e-6, le=1e7, description="the rate of the first request, req/s")
    end_rps: float = Field(ge=1e-6, le=1e7, description="the rate of the last request, req/s")


class Arrival(StrictModel):
    # vidur_poisson: Vidur's generator exactly (vidur/request_generator/poisson_request_interval_
    # generator.py): Python's `random` seeded with `seed` just before generating, gaps
    # -ln(1 - U) / rate capped at 3 / rate, summed from t=0 (never rescaled).
    process: Literal["poisson", "gamma", "fixed", "offline", "vidur_poisson"] = Field(
        default="poisson",
        description="poisson | gamma (bursty, with cv) | fixed (equal gaps) | offline (all at t=0) | "
                    "vidur_poisson (Vidur's generator exactly)")
    rate: Optional[float] = Field(
        default=None, gt=0, le=1e7,
        description="requests per second")
    # beyond these bounds the gamma shape over/underflows
    cv: float = Field(
        default=1.0, ge=1e-3, le=100,
        description="gamma: coefficient of variation of the gaps (1 = Poisson, > 1 bursty); vLLM's "
                    "--burstiness b is cv = 1/sqrt(b)")
    rescale: bool = Field(
        default=True,
        description="rescale the gaps so the last of N requests arrives at N/rate, as vLLM's benchmark does"
                    " (with num_requests, not duration_s)")
    seed: int = Field(
        default=42, ge=0, le=2**63 - 1,
        description="vidur_poisson: the Python random.seed value")
    ramp_up: Optional[RampUp] = Field(
        default=None,
        description="vLLM bench's --ramp-up-strategy instead of a constant rate (see `RampUp`)")
    rate_schedule: Optional[list[RateStep]] = Field(
        default=None, max_length=MAX_STEPS,
        description="a piecewise-constant rate instead of `rate`, repeating: [{duration_s: 3600, rate: 2}, "
                    "...] (sim/arrival_shape.py)")
    diurnal: Optional[Diurnal] = Field(
        default=None,
        description="a daily cosine rate instead of `rate` (see `Diurnal`), repeating every period_s")

    @property
    def mean_rate(self) -> Optional[float]:
        """`rate`, or a time-varying shape's mean rate over its period (None for ramp_up, offline)."""
        shape = shape_of(self)
        return self.rate if shape is None else shape.mean_rate

    @model_validator(mode="after")
    def _needs_rate(self) -> "Arrival":
        check_shape(self)
        refuse_unread(self, "process", {"cv": ("gamma",), "seed": ("vidur_poisson",)})
        if self.rate_schedule is not None or self.diurnal is not None:
            return self
        if self.process in ("offline", "vidur_poisson") and self.ramp_up is not None:
            # (vidur_poisson is Vidur's constant-rate stream; a ramp drew numpy's exponential gaps instead)
            raise ValueError(f"ramp_up needs an arrival process (poisson, gamma or fixed), not {self.process}")
        if self.process != "offline" and self.rate is None and self.ramp_up is None:
            raise ValueError(f"arrival process '{self.process}' needs a rate (requests per second)")
        return self


class SharedPrefix(StrictModel):
    """Shared system prompts: `groups` distinct prefixes; `fraction` of requests carry one."""

    groups: int = Field(
        default=1, ge=1, le=MAX_REQUESTS,
        description="distinct shared prefixes (system prompts)")
    length: LengthDist = Field(
        default_factory=lambda: LengthDist(value=512),
        description="each prefix's length")
    fraction: float = Field(default=1.0, ge=0, le=1, description="share of requests that open with a prefix")
    popularity: Literal["uniform", "zipf"] = Field(
        default="uniform",
        description="which prefix a request gets: uniform | zipf")
    zipf_s: float = Field(default=1.0, gt=0, le=100, description="zipf: the exponent")

    @model_validator(mode="after")
    def _zipf_s_read(self) -> "SharedPrefix":
        refuse_unread(self, "popularity", {"zipf_s": ("zipf",)})
        return self


class DynamicSegment(StrictModel):
    """A per-request segment (a timestamp, a request id) placed before or after the shared prefix."""

    length: int = Field(
        default=8, ge=1, le=MAX_TOKENS,
        description="the segment's tokens (different in every request)")
    position: Literal["first", "last"] = Field(
        default="last",
        description="first (before the shared prefix: it breaks the prefix cache) | last (after it)")


class MultiTurn(StrictModel):
    """Conversations: each turn's prompt = earlier turns + previous answer + a new user message."""

    turns: LengthDist = Field(
        default_factory=lambda: LengthDist(value=3),
        description="turns per conversation")
    user_len: LengthDist = Field(
        default_factory=lambda: LengthDist(dist="uniform", min=32, max=256),
        description="tokens of each new user message")
    think_time_s: float = Field(
        default=5.0, ge=0, le=MAX_DURATION_S,
        description="mean pause between an answer and the next turn, s")
    think_dist: Literal["fixed", "exponential"] = Field(
        default="exponential",
        description="fixed | exponential pauses")

    @field_validator("think_time_s")
    @classmethod
    def _no_negative_zero(cls, v: float) -> float:
        return v + 0.0          # -0.0 passes ge=0 but numpy's exponential refuses a negative scale


class Tenant(StrictModel):
    name: str = Field(max_length=200, description="the tenant's name (unique)")
    share: float = Field(default=1.0, gt=0, le=1e9, description="relative share of the requests")
    salt: bool = Field(
        default=True,
        description="a cache salt isolates this tenant's prefix-cache blocks (vLLM's cache_salt)")


class Priorities(StrictModel):
    values: list[int] = Field(
        default_factory=lambda: [0], min_length=1, max_length=MAX_LIST,
        description="priorities drawn per request (engine.scheduling_policy: priority; lower first)")
    weights: Optional[list[float]] = Field(
        default=None, max_length=MAX_LIST,
        description="their relative weights (default: equal)")

    @model_validator(mode="after")
    def _same_length(self) -> "Priorities":
        if self.weights is not None:
            if len(self.weights) != len(self.values):
                raise ValueError(f"weights has {len(self.weights)} entries, values has {len(self.values)}")
            if min(self.weights) < 0 or sum(self.weights) <= 0:
                raise ValueError(f"weights must be >= 0 with a positive sum, got {self.weights}")
        return self


class PromptSegment(StrictModel):
    """Part of an explicit prompt: equal `segment` names mean equal tokens."""

    segment: str = Field(max_length=200, description="the segment's name: equal names are equal tokens")
    len: int = Field(ge=1, le=MAX_TOKENS, description="its tokens")


class ExplicitRequest(StrictModel):
    arrival_s: float = Field(default=0.0, ge=0, le=MAX_DURATION_S, description="arrival time, s")
    prompt_len: Optional[int] = Field(
        default=None, ge=1, le=MAX_TOKENS,
        description="prompt tokens (unique content); or give `prompt`")
    prompt: Optional[list[PromptSegment]] = Field(
        default=None, max_length=MAX_LIST,
        description="the prompt as named segments (see `PromptSegment`)")
    output_len: int = Field(ge=1, le=MAX_TOKENS, description="tokens to generate")
    tenant: Optional[str] = Field(default=None, max_length=200, description="a tenant of workload.tenants")
    priority: int = Field(
        default=0, ge=-2**31, le=2**31 - 1,
        description="priority (engine.scheduling_policy: priority)")

    @model_validator(mode="after")
    def _one_prompt(self) -> "ExplicitRequest":
        if (self.prompt_len is None) == (self.prompt is None):
            raise ValueError("give exactly one of prompt_len or prompt (a list of segments)")
        return self


TRACE_FIELDS = ("arrival", "prompt", "prompt_len", "output_len", "tenant", "priority")


class Trace(StrictModel):
    format: Literal["azure", "mooncake", "burstgpt", "jsonl", "csv"] = Field(
        description="azure (Azure LLM inference CSV) | mooncake (JSONL with hash_ids) | burstgpt (CSV) | "
                    "jsonl | csv (your own log, with `fields`)")
    path: Path = Field(description="the trace file, plain or gzip'd; relative to the scenario file")
    fields: Optional[dict[str, str]] = Field(
        default=None, max_length=16,
        description="jsonl / csv: kvtwin's field -> your key or column, e.g. {arrival: arrival_time_ns, "
                    "prompt_len: input_toks}")
    time_unit: Optional[Literal["s", "ms", "us", "ns"]] = Field(
        default=None,
        description="unit of the arrival numbers: s | ms | us | ns (jsonl, csv, burstgpt: s; mooncake: ms; "
                    "azure has dates)")
    time_scale: float = Field(
        default=1.0, ge=1e-6, le=1e9,
        description="replay at k x speed")
    window_s: Optional[tuple[float, float]] = Field(
        default=None,
        description="[start, end] of the trace to replay, s from its first arrival")
    sample: Optional[float] = Field(
        default=None, gt=0, le=1,
        description="keep this fraction of the requests")
    max_requests: Optional[int] = Field(
        default=None, ge=1, le=MAX_REQUESTS,
        description="replay at most this many requests")
    hash_block_tokens: int = Field(
        default=512, ge=1, le=MAX_TOKENS,
        description="mooncake: tokens per hash id block")

    @model_validator(mode="after")
    def _fields_and_unit(self) -> "Trace":
        if self.fields is not None:
            if self.format not in ("jsonl", "csv"):
                raise ValueError(f"fields applies to the jsonl and csv formats, not {self.format}")
            unknown = sorted(set(self.fields) - set(TRACE_FIELDS))
            if unknown:
                raise ValueError(f"fields: unknown field(s) {', '.join(unknown)} (allowed: {', '.join(TRACE_FIELDS)})")
            if self.format == "csv" and "prompt" in self.fields:
                raise ValueError("fields.prompt (token ids) needs the jsonl format; a csv gives prompt_len")
        if self.time_unit is not None and self.format == "azure":
            raise ValueError("time_unit does not apply to azure traces (their times are dates)")
        return self

    @field_validator("window_s")
    @classmethod
    def _window(cls, w: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
        if w is not None and not (0 <= w[0] < w[1]):
            raise ValueError(f"window_s must be [start, end] with 0 <= start < end, got {list(w)}")
        return w


class Dataset(StrictModel):
    """Prompts from a data set, as `vllm bench serve --dataset-name` builds them; arrivals come from
    `workload.arrival` and `num_requests` prompts are drawn (seeded).

    sharegpt  ShareGPT-format JSON: [{conversations: [{from: human|gpt|system, value}]}]; `turns: first`
              is vLLM's (the first human message, its answer's token count as output length, vLLM's
              length filter), `all` replays whole conversations as multi-turn requests.
    text      a plain text file, one prompt per line; output lengths from `workload.output_len`.
    random    vLLM's random set: input_len and output_len uniform in [L(1-r), L(1+r)], after a
              shared prefix of prefix_len tokens (no file, no tokenizer).
    sonnet    vLLM's sonnet set: lines of `path` (a poem) drawn until input_len tokens, the first
              lines making a prefix of about prefix_len tokens shared by every request.
    """

    format: Literal["sharegpt", "text", "random", "sonnet"] = Field(
        description="sharegpt | text (one prompt a line) | random | sonnet, as vllm bench serve builds them")
    path: Optional[Path] = Field(default=None, description="the data set's file (not for random)")
    tokenizer: Optional[Path] = Field(
        default=None,
        description="a tokenizer.json (the `tokenizers` package) or a transformers folder (sharegpt, text "
                    "and sonnet need one)")
    turns: Literal["first", "all"] = Field(
        default="first",
        description="sharegpt: first (vLLM's: the first message and its answer's length) | all (whole "
                    "conversations, turn by turn)")
    filter: bool = Field(
        default=True,
        description="sharegpt: vLLM's length filter (drops prompts or outputs < 4 tokens, prompts > 1024, "
                    "pairs > 2048)")
    think_time_s: float = Field(
        default=0.0, ge=0, le=MAX_DURATION_S,
        description="sharegpt with turns: all: the pause before a follow-up, s")
    input_len: int = Field(default=1024, ge=1, le=MAX_TOKENS, description="random / sonnet (550): input tokens")
    output_len: Optional[int] = Field(
        default=None, ge=1, le=MAX_TOKENS,
        description="random (default 128) / sonnet (150): output tokens; sharegpt: overrides the answers' "
                    "lengths")
    range_ratio: float = Field(
        default=0.0, ge=0, lt=1,
        description="random: lengths uniform in [L(1 - r), L(1 + r)]")
    prefix_len: int = Field(
        default=0, ge=0, le=MAX_TOKENS,
        description="random / sonnet (200): tokens every request shares at its start")

    @model_validator(mode="before")
    @classmethod
    def _sonnet_defaults(cls, data: Any) -> Any:
        """vLLM's sonnet set defaults to 550 input and 200 shared tokens, not random's 1024 and 0:
        written into the model, so a resolved dump (the manifest's) reads back the same prompts."""
        if isinstance(data, dict) and data.get("format") == "sonnet":
            data = {"input_len": SONNET_INPUT_LEN, "prefix_len": SONNET_PREFIX_LEN, **data}
        return data

    @model_validator(mode="after")
    def _needs(self) -> "Dataset":
        if self.format != "random" and (self.path is None or self.tokenizer is None):
            raise ValueError(f"dataset format '{self.format}' needs path and tokenizer")
        if self.format == "random" and (self.path is not None or self.tokenizer is not None):
            raise ValueError("the random dataset reads no file: remove path and tokenizer")
        refuse_unread(self, "format", DATASET_FIELD_FORMATS)
        if self.turns == "first" and self.think_time_s:
            raise ValueError("think_time_s is the pause before a conversation's follow-up: it needs turns: all")
        return self


SONNET_INPUT_LEN, SONNET_PREFIX_LEN = 550, 200     # vLLM 0.19 vllm/benchmarks/datasets.py: --sonnet-input-len, --sonnet-prefix-len
# The dataset fields that only some formats read (output_len is read by every format).
DATASET_FIELD_FORMATS = {"turns": ("sharegpt",), "filter": ("sharegpt",), "think_time_s": ("sharegpt",),
                         "input_len": ("random", "sonnet"), "prefix_len": ("random", "sonnet"),
                         "range_ratio": ("random",)}


SYNTHETIC_ONLY = {"num_requests", "duration_s", "arrival", "prompt_len", "output_len",
                  "length_correlation", "shared_prefix", "dynamic_segment", "multi_turn", "priorities"}


# What a dataset supplies itself (its prompts); arrivals, num_requests and, for text, output_len stay.
DATASET_REPLACES = {"prompt_len", "length_correlation", "shared_prefix", "dynamic_segment", "multi_turn"}


class Workload(StrictModel):
    num_requests: Optional[int] = Field(
        default=None, ge=1, le=MAX_SYNTHETIC_REQUESTS,
        description="requests to send (default 100 when neither this nor duration_s is set)")
    duration_s: Optional[float] = Field(
        default=None, gt=0, le=MAX_DURATION_S,
        description="or: send for this long, s")
    warmup_requests: int = Field(
        default=0, ge=0, le=MAX_SYNTHETIC_REQUESTS,
        description="the first N requests warm the engine and are left out of every figure")
    max_concurrency: Optional[int] = Field(
        default=None, ge=1, le=MAX_REQUESTS,
        description="a closed-loop client (vLLM bench's --max-concurrency): at most this many in flight; a "
                    "request due while it is full is sent when one finishes, its TTFT counted from then")
    arrival: Arrival = Field(
        default_factory=lambda: Arrival(process="offline"),
        description="the arrival process (see `Arrival`)")
    prompt_len: LengthDist = Field(
        default_factory=lambda: LengthDist(dist="sharegpt"),
        description="each request's own prompt tokens (a shared prefix and a dynamic segment come on top)")
    output_len: LengthDist = Field(
        default_factory=lambda: LengthDist(dist="sharegpt"),
        description="tokens to generate per request (scripted, as a benchmark with ignore_eos)")
    length_correlation: float = Field(
        default=0.0, ge=-1, le=1,
        description="rank correlation of prompt and output lengths (Gaussian copula); 0 = independent")
    shared_prefix: Optional[SharedPrefix] = Field(
        default=None,
        description="shared system prompts (see `SharedPrefix`)")
    dynamic_segment: Optional[DynamicSegment] = Field(
        default=None,
        description="a per-request segment (a timestamp) before or after the shared prefix")
    multi_turn: Optional[MultiTurn] = Field(
        default=None,
        description="conversations: each turn's prompt is the conversation so far plus a new message")
    tenants: Optional[list[Tenant]] = Field(
        default=None, max_length=MAX_LIST,
        description="tenants sharing the traffic, e.g. [{name: a, share: 0.5, salt: true}]")
    priorities: Optional[Priorities] = Field(
        default=None,
        description="request priorities (see `Priorities`)")
    requests: Optional[list[ExplicitRequest]] = Field(
        default=None, max_length=MAX_REQUESTS,
        description="explicit requests instead of a synthetic workload")
    lora: Optional[WorkloadLora] = Field(
        default=None,
        description="the LoRA adapter each request asks for (see `WorkloadLora`); needs engine.lora")
    trace: Optional[Trace] = Field(default=None, description="replay a recorded trace instead (see `Trace`)")
    dataset: Optional[Dataset] = Field(
        default=None,
        description="prompts from a data set instead, as vllm bench serve --dataset-name builds them")

    @model_validator(mode="after")
    def _sources(self) -> "Workload":
        given = [k for k in ("requests", "trace", "dataset") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of 'requests', 'trace' and 'dataset' (got {', '.join(given)})")
        if self.dataset is not None:
            prompt_side = sorted(f for f in self.model_fields_set & DATASET_REPLACES
                                 if getattr(self, f) != type(self).model_fields[f].get_default(call_default_factory=True))
            if prompt_side:
                raise ValueError(f"{', '.join(prompt_side)} describe synthetic prompts and would be ignored with "
                                 f"'dataset'; remove them")
        source = "requests" if self.requests is not None else "trace" if self.trace is not None else None
        # Set and not at its default: a resolved scenario (a manifest's dump) lists every field.
        synthetic_only = sorted(f for f in self.model_fields_set & SYNTHETIC_ONLY
                                if getattr(self, f) != type(self).model_fields[f].get_default(call_default_factory=True))
        if source and synthetic_only:
            raise ValueError(f"{', '.join(synthetic_only)} describe a synthetic workload and "
                             f"would be ignored with '{source}'; remove them")
        if self.tenants is not None and len({t.name for t in self.tenants}) != len(self.tenants):
            raise ValueError("tenant names must be unique")
        if self.multi_turn is not None and self.multi_turn.turns.dist == "sharegpt":
            raise ValueError("multi_turn.turns cannot use the sharegpt preset (it describes token lengths)")
        synthetic = self.requests is None and self.trace is None
        built_whole = self.dataset is not None or not synthetic
        if built_whole and max(self.num_requests or 0, self.warmup_requests) > MAX_REQUESTS:
            raise ValueError(f"num_requests: at most {MAX_REQUESTS:,} from a data set, trace or explicit requests "
                             f"(built whole in memory); up to {MAX_SYNTHETIC_REQUESTS:,} for a synthetic workload")
        if synthetic and self.num_requests is None and self.duration_s is None:
            self.num_requests = 100
        if synthetic and self.arrival.process == "offline" and self.num_requests is None:
            raise ValueError("offline arrivals need num_requests (duration_s means nothing at t=0)")
        if synthetic and self.arrival.ramp_up is not None and (self.num_requests is None or self.duration_s):
            raise ValueError("arrival.ramp_up needs num_requests without duration_s (the ramp runs over "
                             "the N requests, as vLLM's benchmark does)")
        rate = self.arrival.mean_rate
        if synthetic and rate and self.num_requests and self.num_requests / rate > MAX_DURATION_S:
            raise ValueError(f"arrival.rate {rate:g}/s spreads {self.num_requests} requests over "
                             f"{self.num_requests / rate:.3g} s, more than the {MAX_DURATION_S:g} s (30 days) allowed")
        expected = (self.arrival.mean_rate or 0) * (self.duration_s or 0)
        if synthetic and self.num_requests is None and expected > MAX_REQUESTS:
            raise ValueError(f"arrival.rate x duration_s = {expected:.3g} requests, more than the "
                             f"{MAX_REQUESTS:,} allowed; shorten duration_s or set num_requests")
        return self


# ----------------------------------------------------------------------------- the rest

class Slo(StrictModel):
    """Per-request targets; goodput counts requests meeting every target that is set."""

    ttft_s: Optional[float] = Field(
        default=None, gt=0,
        description="time to first token target per request, s")
    tpot_s: Optional[float] = Field(
        default=None, gt=0,
        description="time per output token target per request, s")
    e2e_s: Optional[float] = Field(default=None, gt=0, description="end-to-end latency target per request, s")


class Cluster(StrictModel):
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS, description="engine replicas behind the router")
    disaggregation: Optional[Disaggregation] = Field(
        default=None,
        description="prefill and decode pools with a KV link between them, as vLLM's NixlConnector "
                    "deployments (docs/whatif/disaggregation.md); unset: every engine does both")
    router: Literal["round_robin", "least_outstanding_tokens", "prefix_aware", "llm_d", "dynamo", "sglang"] = Field(
        default="round_robin",
        description="round_robin | least_outstanding_tokens | prefix_aware | llm_d (llm-d's endpoint picker) | "
                    "dynamo (NVIDIA Dynamo's KV router) | sglang (SGLang's cache-aware router); "
                    "docs/whatif/routers.md")
    load_bound: float = Field(
        default=1.5, ge=1.0,
        description="prefix_aware: a replica may take at most this many times the mean outstanding tokens")
    llm_d: LlmDRouter = Field(default_factory=LlmDRouter, description="router llm_d: its scorers and weights")
    dynamo: DynamoRouter = Field(default_factory=DynamoRouter, description="router dynamo: its cost and sampling")
    sglang: SglangRouter = Field(default_factory=SglangRouter, description="router sglang: its thresholds and tree")
    routing_regret: Optional[bool] = Field(
        default=None,
        description="report prefix-aware routing regret (hits lost vs an oracle) in summary.json; unset: on "
                    "for llm_d, dynamo and sglang, off for the others")

    autoscaling: Optional[Autoscaling] = Field(
        default=None,
        description="add and drain replicas with load, as KEDA + the HPA on a vLLM metric (see `Autoscaling`); "
                    "`replicas` is then the starting fleet")


    @model_validator(mode="after")
    def _router_section_used(self):
        refuse_unread(self, "router", {"load_bound": ("prefix_aware",)})
        for section in DEPLOYED_ROUTERS:
            settings = getattr(self, section)
            # (a section at its defaults, as a manifest dump writes every one, changes nothing)
            if self.router != section and settings != type(settings)():
                raise ValueError(f"cluster.{section} configures the {section} router, but cluster.router is "
                                 f"{self.router!r}; set cluster.router: {section} or remove cluster.{section}")
        return self

    @property
    def most_replicas(self) -> int:
        """The most replicas the run can hold at once."""
        return self.replicas if self.autoscaling is None else max(self.replicas, self.autoscaling.max_replicas)


class Scenario(StrictModel):
    name: str = Field(
        default="scenario", max_length=200,
        description="the scenario's name (the default output folder is runs/<file name>)")
    description: str = Field(default="", max_length=10_000, description="free text, kept in the manifest")
    seed: int = Field(
        default=0, ge=0, le=2**63 - 1,
        description="same scenario + seed = identical predictions, bit for bit")
    model: ModelSpec = Field(
        description="a catalog name (llama-3.1-8b), {base: NAME, field: value, ...}, {hf_config: "
                    "path/to/config.json}, or every shape field (see `ModelSpec`)")
    device: DeviceSpec = Field(
        description="a catalog name (l4), {base: NAME, memory_mib: ..., profile: calibrated.yaml}, or every"
                    " figure (see `DeviceSpec`)")
    parallelism: Parallelism = Field(
        default_factory=Parallelism,
        description="tensor, data and expert parallelism (modelled, not run)")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="the serving engine's settings, as vLLM's flags (see `EngineConfig`)")
    workload: Workload = Field(default_factory=Workload, description="the traffic (see `Workload`)")
    slo: Slo = Field(
        default_factory=Slo,
        description="per-request targets; goodput and SLO attainment count requests meeting every one set")
    cluster: Cluster = Field(default_factory=Cluster, description="replicas and the router")
    step_times: Literal["datasheet", "tables", "trained"] = Field(
        default="trained",
        description="where device step times come from: datasheet (the roofline over catalog peaks) | "
                    "tables (measured operator latencies, the `tables` extra) | trained (the roofline with "
                    "coefficients fitted on public vLLM runs, docs/fidelity.md); a calibrated device.profile "
                    "tunes datasheet or tables")
    variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict, max_length=MAX_VARIANTS,
        description="name -> a partial scenario merged over this one (nested keys, e.g. {engine: "
                    "{batching: static}}); each runs, with one comparison table and overlaid plots")

    @field_validator("name", "description")
    @classmethod
    def _printable(cls, text: str, info) -> str:
        # printed on the terminal and into reports: no escape sequences, bells or stray line breaks
        allowed = "\n\t" if info.field_name == "description" else ""
        bad = next((c for c in text if not c.isprintable() and c not in allowed), None)
        if bad is not None:
            raise ValueError(f"{excerpt(text)} holds the control character {bad!r}; expected printable text")
        return text

    @field_validator("variants")
    @classmethod
    def _variant_names(cls, variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # A variant's name becomes its output folder: refuse anything that is not a plain name.
        for name in variants:
            problem = name_problem(name)
            if problem:
                raise ValueError(f"variant name {excerpt(name)}: {problem}")
        return variants

    @model_validator(mode="after")
    def _engine_generation(self) -> "Scenario":
        """engine.vllm_engine against what the release does (vllm_versions.v1_fallbacks); a V0 engine's
        scheduler fields left unset take V0's defaults (v0_scheduler_defaults)."""
        e = self.engine
        fallbacks = self.v1_fallbacks()
        unsupported = [feature for feature, experimental in fallbacks if not experimental]
        if e.vllm_engine == "v1" and unsupported:
            raise ValueError(f"engine.vllm_engine v1: vLLM {e.vllm_version} refuses VLLM_USE_V1=1 with "
                             f"{unsupported[0]} (engine/arg_utils.py _is_v1_supported_oracle: \"VLLM_USE_V1=1 is "
                             f"not supported with ...\"); use auto or v0")
        if e.vllm_engine == "auto" and fallbacks and vllm_versions.parse_release(e.vllm_version) >= \
                vllm_versions.V0_REMOVED:
            raise ValueError(f"{fallbacks[0][0]}: vLLM {e.vllm_version}'s V1 lacks it and its fallback, V0, is gone "
                             f"(the API server refuses to start)")
        if self.engine_generation == "v0":
            if e.async_scheduling is True:
                raise ValueError("engine.async_scheduling true: vLLM's V0 engine has no async scheduling "
                                 f"(engine generation v0: {self.engine_generation_why()})")
            v1_only = next((name for name, on in (
                ("engine.speculative", e.speculative is not None), ("engine.lora", e.lora is not None),
                ("engine.kv_offload", e.kv_offload is not None),
                ("cluster.disaggregation", self.cluster.disaggregation is not None)) if on), None)
            if v1_only:
                raise ValueError(f"{v1_only}: modelled on vLLM's V1 engine only, and this scenario runs V0 "
                                 f"({self.engine_generation_why()}); set engine.vllm_engine: v1 where the "
                                 f"release has V1, or leave {v1_only} out")
            unset = e.model_fields_set
            for name, value in self.v0_scheduler_defaults().items():
                if name not in unset:
                    e.__dict__[name] = value     # (not assigned: an assignment would re-validate)
        return self

    def v1_fallbacks(self) -> list[tuple[str, bool]]:
        """The scenario's features vLLM's V1 lacks in engine.vllm_version (vllm_versions.v1_fallbacks)."""
        e = self.engine
        return vllm_versions.v1_fallbacks(
            e.vllm_version, device=self.device.name, scheduling_policy=e.scheduling_policy,
            kv_cache_dtype=e.kv_cache_dtype, model_dtype=self.model.dtype,
            partial_prefills=e.max_num_partial_prefills, long_prefill_threshold=e.long_prefill_token_threshold,
            lora=e.lora is not None, pipeline_parallel=e.pipeline_parallel_size,
            executor=e.distributed_executor_backend, speculative_method=e.speculative_method)

    @property
    def engine_generation(self) -> str:
        """The vLLM engine generation the scenario runs ('v0' | 'v1'): engine.vllm_engine, or under auto
        the release's default and the V0 fallback of 0.8-0.10 (sim/core/vllm_versions.py). Every
        V0/V1-keyed rule reads this: the scheduler defaults, the trained step-time entry, the error band,
        the front end's default."""
        e = self.engine
        falls_back = e.vllm_engine == "auto" and bool(self.v1_fallbacks())
        return vllm_versions.engine_generation(e.vllm_version, e.vllm_engine, falls_back)

    def engine_generation_why(self) -> str:
        """Why the scenario runs its engine generation, in words (printed with the engine line)."""
        e = self.engine
        if e.vllm_engine != "auto":
            return f"engine.vllm_engine {e.vllm_engine}, as VLLM_USE_V1={'1' if e.vllm_engine == 'v1' else '0'} picks it"
        fallbacks = self.v1_fallbacks()
        if fallbacks and self.engine_generation == "v0":
            return f"vLLM {e.vllm_version} falls back to V0 for {fallbacks[0][0]}"
        return f"vLLM {e.vllm_version}'s default"

    def v0_scheduler_defaults(self) -> dict[str, Any]:
        """vLLM V0's defaults for the scheduler fields, on a vLLM engine (continuous batching, paged
        blocks): steps all prefills or all decodes, a 1 % block watermark on admission, no prefix
        caching, and chunked prefill only for a context over 32K tokens without a sliding window,
        speculative decoding or LoRA (then V0's chunked schedule mixes decodes and prefill chunks)
        (vLLM 0.7.3 engine/arg_utils.py create_engine_config, 0.8-0.10 _set_default_args_v0;
        core/scheduler.py; config.py CacheConfig). max_num_seqs and max_num_batched_tokens follow in
        _default_limits."""
        e = self.engine
        if e.batching != "continuous" or e.allocation != "paged":
            return {}
        chunked = e.chunked_prefill if "chunked_prefill" in e.model_fields_set else (
            self.max_model_len > 32768 and self.model.sliding_window is None and e.speculative is None
            and e.speculative_method is None and e.lora is None)
        return {"step_composition": "mixed" if chunked else "prefill_first", "admission_watermark": 0.01,
                "prefix_caching": False, "chunked_prefill": chunked}

    @model_validator(mode="after")
    def _kv_offload_fits(self) -> "Scenario":
        problem = offload_problem(self) if self.engine.kv_offload is not None else None
        if problem:
            raise ValueError(f"engine.kv_offload: {problem}")
        return self

    @property
    def max_model_len(self) -> int:
        """The effective limit: the engine setting, else the model's context length."""
        return self.engine.max_model_len or self.model.max_position_embeddings

    @property
    def max_num_seqs(self) -> int:
        """The setting, else vLLM's API-server default capped at max_num_batched_tokens (vLLM's
        engine/arg_utils.py: min(default, max_num_batched_tokens) when max_num_seqs is unset)."""
        if self.engine.max_num_seqs:
            return self.engine.max_num_seqs
        return min(self._default_limits()[1], self.max_num_batched_tokens)

    @property
    def max_num_batched_tokens(self) -> int:
        """The setting, else vLLM's API-server default (engine/arg_utils.py
        _set_default_max_num_seqs_and_batched_tokens_args, 0.12-0.21): at least max_model_len without
        chunked prefill, and at most max_num_seqs x max_model_len (max_num_seqs as set or defaulted,
        before its own cap)."""
        if self.engine.max_num_batched_tokens is not None:
            return self.engine.max_num_batched_tokens
        budget, seqs = self._default_limits()
        if not self.engine.chunked_prefill:
            budget = max(budget, self.max_model_len)  # vLLM: must hold a whole prompt then
        return min(budget, (self.engine.max_num_seqs or seqs) * self.max_model_len)

    def _default_limits(self) -> tuple[int, int]:
        """vLLM's API-server defaults (max_num_batched_tokens, max_num_seqs) for engine.vllm_version:
        V1's by release (sim/core/vllm_versions.py v1_default_limits: from 0.9 8192 and 1024 on GPUs
        of at least 70 GiB (NVML's total) that are not A100s, else 2048 and 256; earlier releases
        tested the name or the memory alone, and up to 0.8.3 took 1024 sequences on every GPU), both
        doubled by --performance-mode throughput (from 0.17). V0: 2048 and 256 (0.7.3 config.py
        SchedulerConfig, engine/arg_utils.py; 0.8-0.10 _set_default_args_v0), raised to
        max_model_len without chunked prefill."""
        if self.engine_generation == "v0":
            return 2048, 256
        tokens, seqs = vllm_versions.v1_default_limits(
            self.engine.vllm_version, memory_mib=self.device.memory_mib,
            device_names=f"{self.device.name} {self.device.full_name or ''}")
        if self.engine.performance_mode == "throughput":
            tokens, seqs = 2 * tokens, 2 * seqs
        return tokens, seqs

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one request computes in one step: the token budget, or a whole sequence
        in a static batch (its prefill ignores the budget). Bounds what a sliding window holds."""
        return self.max_model_len if self.engine.batching == "static" else self.max_num_batched_tokens

    @property
    def async_scheduling(self) -> bool:
        """engine.async_scheduling resolved: `auto` is what vLLM's auto resolves to for vllm_version,
        the executor and speculative method (sim/core/vllm_versions.py async_scheduling_auto), on a
        vLLM-like engine (a GPU device, continuous batching)."""
        setting = self.engine.async_scheduling
        if setting != "auto":
            return bool(setting)
        e = self.engine
        on, _ = vllm_versions.async_scheduling_auto(
            e.vllm_version, platform="cpu" if self.device.name == "cpu" else "cuda",
            pipeline_parallel=e.pipeline_parallel_size, speculative_method=e.speculative_method,
            executor=e.distributed_executor_backend)
        return on and e.batching == "continuous"

    @property
    def tokens_after_next_host(self) -> bool:
        """Does a token reach the client only when the engine's next step has done its host work
        (vLLM V0's async output processing, sim/core/vllm_versions.py v0_async_output_processing)?
        Then a step's tokens are delivered at its end plus the host time of the step that follows
        at once (none: at its end); the steps themselves are priced as before (sim/records.py
        StepRecorder.token_times)."""
        e = self.engine
        return (self.engine_generation == "v0" and vllm_versions.has(e.vllm_version, "v0_async_output_processing")
                and not e.enforce_eager
                and e.speculative_method is None and e.pipeline_parallel_size == 1
                and self.device.name != "cpu" and e.batching == "continuous")

    @property
    def tokens_at_loop_wake(self) -> bool:
        """Under `tokens_after_next_host`, does a token wait further, for the client's asyncio loop to
        wake (engine.client_in_process)? vLLM 0.7.3's AsyncLLMEngine runs each step in an executor
        thread (vllm/executor/executor_base.py execute_model_async: make_async, run_in_executor), and
        the previous step's outputs go on the request streams from that thread
        (vllm/engine/async_llm_engine.py AsyncStream.put: asyncio.Queue.put_nowait, which schedules the
        waiting generator without waking a loop blocked in select); the loop wakes when the step ends
        (the executor future's call_soon_threadsafe) or at a timer (a load generator's next send).
        `vllm serve`'s engine process sends them on its ZMQ socket from the callback instead
        (vllm/engine/multiprocessing/engine.py _async_socket_engine_callback): the next step's host."""
        return self.tokens_after_next_host and self.engine.client_in_process

    @property
    def long_prefill_token_threshold(self) -> int:
        """vLLM's cap on one step's chunk of a prompt (0 = none): the setting, or 4 % of
        max_model_len when max_num_partial_prefills > 1 leaves it at 0 (config/scheduler.py)."""
        e = self.engine
        if e.max_num_partial_prefills > 1 and e.long_prefill_token_threshold == 0:
            return int(self.max_model_len * 0.04)
        return e.long_prefill_token_threshold


# ----------------------------------------------------------------------------- loading

def _resolve_sections(raw: dict[str, Any], base_dir: Path | None) -> dict[str, Any]:
    raw = dict(raw)
    for key, kind in (("model", "models"), ("device", "devices")):
        if key in raw:
            try:
                raw[key] = _resolve_catalog(kind, raw[key], base_dir)
            except (KeyError, ValueError) as e:
                raise ScenarioError([f"{key}: {e.args[0]}"]) from None
    _resolve_pool_devices(raw, base_dir)
    for key in ("model", "device"):
        for field in ("weights", "profile"):
            if isinstance(raw.get(key), dict) and raw[key].get(field) is not None:
                raw[key] = {**raw[key], field: _resolve_path(raw[key][field], base_dir)}
    return raw


def _resolve_pool_devices(raw: dict[str, Any], base_dir: Path | None) -> None:
    """cluster.disaggregation.<side>.device: a catalog name like the top-level device."""
    pools = (raw.get("cluster") or {}).get("disaggregation") if isinstance(raw.get("cluster"), dict) else None
    if not isinstance(pools, dict):
        return
    raw["cluster"] = cluster = dict(raw["cluster"])
    cluster["disaggregation"] = pools = dict(pools)
    for side in ("prefill", "decode"):
        pool = pools.get(side)
        if isinstance(pool, dict) and pool.get("device") is not None:
            try:
                pools[side] = {**pool, "device": _resolve_catalog("devices", pool["device"], base_dir)}
            except (KeyError, ValueError) as e:
                raise ScenarioError([f"cluster.disaggregation.{side}.device: {e.args[0]}"]) from None


def _resolve_workload_paths(workload: Workload, base_dir: Path | None) -> None:
    if workload.trace is not None:
        workload.trace.path = _resolve_path(workload.trace.path, base_dir)
    if workload.dataset is not None:
        for key in ("path", "tokenizer"):
            if getattr(workload.dataset, key) is not None:
                setattr(workload.dataset, key, _resolve_path(getattr(workload.dataset, key), base_dir))
    for dist in _length_dists(workload):
        if dist.file is not None:
            dist.file = _resolve_path(dist.file, base_dir)


def _length_dists(w: Workload) -> list[LengthDist]:
    dists = [w.prompt_len, w.output_len]
    if w.shared_prefix:
        dists.append(w.shared_prefix.length)
    if w.multi_turn:
        dists += [w.multi_turn.turns, w.multi_turn.user_len]
    return dists


def _cross_checks(s: Scenario) -> list[str]:
    problems = []
    tp, m = s.parallelism.tp, s.model
    if m.num_heads % tp:
        problems.append(f"parallelism.tp: {tp} does not divide the model's {m.num_heads} attention "
                        f"heads (allowed: a divisor of {m.num_heads})")
    elif m.num_kv_heads % tp and tp % m.num_kv_heads:
        problems.append(f"parallelism.tp: {tp} neither divides nor is a multiple of the model's "
                        f"{m.num_kv_heads} KV heads")
    problems += _parallelism_checks(s)
    problems += _data_parallel_checks(s)
    if s.max_model_len > m.max_position_embeddings:
        problems.append(f"engine.max_model_len: {s.max_model_len} is beyond the model's "
                        f"max_position_embeddings ({m.max_position_embeddings})")
    if s.max_num_batched_tokens < s.max_num_seqs and s.engine.max_num_batched_tokens is not None:
        problems.append(f"engine.max_num_batched_tokens: {s.max_num_batched_tokens} is below "
                        f"max_num_seqs ({s.max_num_seqs}); vLLM requires at least one token per sequence")
    if not s.engine.chunked_prefill and s.max_num_batched_tokens < s.max_model_len:
        problems.append(f"engine.max_num_batched_tokens: {s.max_num_batched_tokens} is below "
                        f"max_model_len ({s.max_model_len}), so without chunked_prefill a long prompt "
                        f"could never be scheduled")
    problems += _pool_size_checks(s)
    problems += [p for p in [_block_size_problem(s.engine)] if p]
    problems += lora_problems(s)
    if s.cluster.disaggregation is not None:
        problems += disaggregation_problems(s)
    problems += autoscaling_problems(s)
    problems += [p for p in [draft_model_problem(s)] if p]
    if s.cluster.autoscaling is not None and (s.cluster.disaggregation is not None
                                              or s.cluster.router in DEPLOYED_ROUTERS):
        problems.append(f"cluster.autoscaling: not modelled with "
                        f"{'cluster.disaggregation' if s.cluster.disaggregation is not None else 'cluster.router ' + s.cluster.router}"
                        f" (their per-replica state assumes a fixed fleet); use round_robin, "
                        f"least_outstanding_tokens or prefix_aware on co-located replicas")
    if s.engine.batching == "static" and s.engine.step_composition != "mixed":
        problems.append("engine.step_composition: only 'mixed' applies to static batching")
    return problems


def _block_size_problem(e: EngineConfig) -> Optional[str]:
    """A block size vLLM's --block-size refuses at e.vllm_version (when the engine models vLLM:
    continuous batching over a paged pool; static batching and contiguous allocation are kvtwin's)."""
    choices = vllm_versions.block_size_choices(e.vllm_version)
    if choices is None or e.block_size in choices or e.batching != "continuous" or e.allocation != "paged":
        return None
    return (f"engine.block_size: {e.block_size} is not a block size vLLM {e.vllm_version} accepts "
            f"(--block-size: {', '.join(map(str, choices))}); any size >= 1 from vLLM 0.18")


def _pool_size_checks(s: Scenario) -> list[str]:
    """num_blocks must fit the device; every replica's pool together must stay simulable."""
    block_bytes = pool_block_bytes(s.model, s.engine.block_size, s.parallelism.tp, s.engine.kv_cache_dtype)
    if s.engine.num_blocks is not None:
        # a fixed pool skips the memory plan, not the weights: they and the pool share the GPU
        # (vLLM's --num-gpu-blocks-override allocates the pool after loading them)
        pool = s.engine.num_blocks * block_bytes
        weights = weight_bytes_per_gpu(s.model, s.parallelism.tp, s.parallelism.dp) + lora_reserved_bytes(s)
        if pool + weights > s.device.memory_bytes:
            gib = lambda b: f"{b / 2**30:.4g} GiB"  # noqa: E731
            alone = "; the weights alone do not fit" if weights > s.device.memory_bytes else ""
            return [f"engine.num_blocks: {s.engine.num_blocks} blocks of {s.engine.block_size} tokens need "
                    f"{gib(pool)} of KV cache per GPU, which with {gib(weights)} of weights per GPU is more "
                    f"than the device's {gib(s.device.memory_bytes)}{alone} (device {s.device.name}, tp "
                    f"{s.parallelism.tp})"]
    # at most this many blocks per replica (the whole memory budget, before weights)
    per_replica = s.engine.num_blocks or int(s.device.memory_bytes * s.engine.gpu_memory_utilization) // block_bytes
    engines = s.cluster.most_replicas * s.parallelism.dp      # each data-parallel rank has its own pool
    total = per_replica * engines
    if total > MAX_POOL_BLOCKS:
        return [f"cluster.replicas: {engines} engine(s) (replicas x dp) of up to {per_replica:,} KV blocks each is "
                f"{total:,} blocks, more than the {MAX_POOL_BLOCKS:,} kvtwin tracks (about 2 GB of "
                f"bookkeeping); use fewer replicas, a larger engine.block_size or a smaller engine.num_blocks"]
    return []


def _parallelism_checks(s: Scenario) -> list[str]:
    par, m = s.parallelism, s.model
    problems = []
    if par.ep > 1:
        if not m.is_moe:
            problems.append(f"parallelism.ep: {par.ep} needs a mixture-of-experts model "
                            f"(model '{m.name}' has no experts)")
        elif par.ep != par.gpus:
            problems.append(f"parallelism.ep: {par.ep} must be 1 or tp x dp = {par.gpus} "
                            "(vLLM spreads the experts over every GPU of the engine)")
        elif m.num_experts % par.ep:
            problems.append(f"parallelism.ep: {par.ep} does not divide the model's {m.num_experts} experts")
    elif m.is_moe and m.moe_intermediate_size % par.gpus:
        problems.append(f"parallelism: tp x dp = {par.gpus} does not divide moe_intermediate_size "
                        f"({m.moe_intermediate_size}); use parallelism.ep = {par.gpus}")
    return problems


def _data_parallel_checks(s: Scenario) -> list[str]:
    """The dp fields as vLLM accepts them (engine/arg_utils.py, config/parallel.py, 0.19), and what
    kvtwin does not model with ranks stepping in lockstep."""
    from sim.dp import check_router

    par, version = s.parallelism, s.engine.vllm_version
    problems = []
    if par.dp_local is not None and par.dp % par.dp_local:
        problems.append(f"parallelism.dp_local: {par.dp_local} ranks per node do not divide dp {par.dp}")
    if par.dp_load_balancing == "hybrid" and par.dp_local is None:
        problems.append("parallelism.dp_load_balancing: hybrid needs parallelism.dp_local (vLLM: "
                        "\"data_parallel_size_local must be set to use data_parallel_hybrid_lb\")")
    backends = vllm_versions.all2all_backends(version)
    # (the table covers 0.12 on, the first release with --all2all-backend: older ones are not checked)
    if backends and par.all2all_backend not in backends:
        problems.append(f"parallelism.all2all_backend: {par.all2all_backend} is not in vLLM {version}'s "
                        f"--all2all-backend choices ({', '.join(backends)})")
    problems += [p for p in [check_router(s)] if p]
    if par.dp > 1 and s.engine.lora is not None and vllm_versions.dp_ranks_in_lockstep(version, s.model.is_moe):
        problems.append("engine.lora: not modelled for data-parallel ranks stepping in lockstep (their steps "
                        "are priced together without the adapters' kernels); set parallelism.dp: 1 or "
                        "engine.lora: null")
    return problems


def validate_scenario(raw: dict[str, Any], base_dir: Path | None = None,
                      source: str | None = None) -> Scenario:
    """Validate a raw scenario mapping (already merged with overrides) into a Scenario."""
    if not isinstance(raw, dict):
        raise ScenarioError([f"top level: expected a mapping of sections, got {type(raw).__name__}"], source)
    for required in ("model", "device"):
        if required not in raw:
            raise ScenarioError([f"{required}: missing (a catalog name or a mapping of fields)"], source)
    try:
        resolved = _resolve_sections(raw, base_dir)
        scenario = Scenario.model_validate(resolved)
    except ScenarioError as e:
        raise ScenarioError(e.problems, source) from None
    except ValidationError as e:
        raise ScenarioError(_describe(e, Scenario), source) from None
    _resolve_workload_paths(scenario.workload, base_dir)
    problems = _cross_checks(scenario)
    if problems:
        raise ScenarioError(problems, source)
    return scenario


def load_raw(path: str | Path) -> dict[str, Any]:
    """The scenario file as a mapping: UTF-8 YAML, no duplicate keys, bounded size and nesting."""
    path = Path(path)
    try:
        raw = load_yaml(read_text(path, "scenario YAML file"), path)
    except FileFormatError as e:
        raise ScenarioError([str(e)]) from None     # the message starts with path[:line]
    if raw is None:
        raise ScenarioError(["the file is empty"], str(path))
    return raw


def load_scenario(path: str | Path, overrides: list[str] | None = None,
                  seed: int | None = None) -> Scenario:
    """Load, apply `--set` overrides and validate. Relative paths in the file resolve against the file,
    those given with --set against the working folder (parse_override)."""
    path = Path(path)
    raw = load_raw(path)
    if overrides:
        raw = apply_overrides(raw, overrides, source=str(path))
    if seed is not None:
        raw["seed"] = seed
    try:
        return validate_scenario(raw, base_dir=path.parent.resolve(), source=str(path))
    except ScenarioError as e:
        if not overrides:
            raise
        raise ScenarioError(blame_overrides(e.problems, overrides), e.source) from None


def blame_overrides(problems: list[str], overrides: list[str]) -> list[str]:
    """Each problem about a field that a --set wrote (or the section it wrote into) says so: the
    file named before it does not hold that value, and a search of it would find nothing."""
    keys = [text.partition("=")[0].strip() for text in overrides]

    def wrote(key: str, problem: str) -> bool:
        field, _, text = problem.partition(": ")
        if field == key or field.startswith((key + ".", key + "[")):
            return True
        # a section's own check ("engine: max_num_seqs: true is ...") names the field in its text
        return key.startswith(field + ".") and re.search(rf"\b{re.escape(key.rpartition('.')[2])}\b", text) is not None

    out = []
    for problem in problems:
        blamed = next((key for key in reversed(keys) if wrote(key, problem)), None)    # the last --set wins
        out.append(problem if blamed is None else f"{problem} (given by --set {blamed})")
    return out


def expand_variants(scenario: Scenario, base_dir: Path | None = None,
                    source: str | None = None) -> dict[str, Scenario]:
    """{variant name: full scenario}; a scenario without variants maps its own name to itself.
    `source` (the scenario file) heads an error, as load_scenario's do."""
    if not scenario.variants:
        return {scenario.name: scenario}
    base = scenario.model_dump(exclude={"variants"}, exclude_unset=True)
    out = {}
    for name, patch in scenario.variants.items():
        if not isinstance(patch, dict):
            raise ScenarioError([f"variants.{name}: expected a mapping of overrides, got {excerpt(patch)}"], source)
        merged = deep_merge(base, patch)
        merged["name"] = f"{scenario.name}/{name}"
        try:
            out[name] = validate_scenario(merged, base_dir=base_dir)
        except ScenarioError as e:
            raise ScenarioError([f"variants.{name}.{p}" for p in e.problems], source) from None
    return out


def deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in ("model", "device"):
            out[key] = deep_merge(out[key], value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            # model/device: a patch with `base` replaces the entry; otherwise it overrides fields.
            out[key] = copy.deepcopy(value) if "base" in value or "hf_config" in value else {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


# ----------------------------------------------------------------------------- --set

# The fields that hold a file path, from the scenario's top. A relative path in the file resolves against
# the file; one given with --set against the working folder, where the user typed it.
PATH_FIELDS: tuple[tuple[str, ...], ...] = (
    ("model", "hf_config"), ("model", "weights"), ("device", "profile"), ("workload", "trace", "path"),
    ("workload", "dataset", "path"), ("workload", "dataset", "tokenizer"),
    *(("workload", *dist, "file") for dist in (("prompt_len",), ("output_len",), ("shared_prefix", "length"),
                                              ("multi_turn", "turns"), ("multi_turn", "user_len"))))


def _paths_from_working_folder(keys: list[str], value: Any) -> Any:
    """An override's value with the relative paths of PATH_FIELDS made absolute against the working
    folder: at the field itself (--set device.profile=p.yaml) or inside a section set whole (--set
    'model={hf_config: c.json}')."""
    for field in PATH_FIELDS:
        if tuple(keys) == field[:len(keys)]:
            value = _absolute_at(value, field[len(keys):])
    return value


def _absolute_at(value: Any, rest: tuple[str, ...]) -> Any:
    if rest:
        if isinstance(value, dict) and rest[0] in value:
            return {**value, rest[0]: _absolute_at(value[rest[0]], rest[1:])}
        return value
    if isinstance(value, str) and value.strip():
        path = Path(value).expanduser()
        return value if path.is_absolute() else str(Path.cwd() / path)
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """'engine.block_size=32' -> (['engine', 'block_size'], 32); values parse as YAML scalars, and a
    relative file path (PATH_FIELDS) resolves against the working folder."""
    if "=" not in text:
        raise ScenarioError([f"--set {text!r}: expected PATH=VALUE, e.g. engine.block_size=32"])
    path, _, value = text.partition("=")
    keys = [k for k in path.strip().split(".")]
    if not all(keys):
        raise ScenarioError([f"--set {text!r}: the path {path!r} has an empty part"])
    try:
        parsed = load_yaml(value, f"--set {path}") if value.strip() else None
    except FileFormatError as e:
        if "not valid YAML" not in str(e):
            raise ScenarioError([str(e)]) from None   # duplicate keys, an alias bomb, deep nesting
        parsed = value                                 # plain text that only looks like YAML
    return keys, _paths_from_working_folder(keys, parsed)


def set_path(raw: dict[str, Any], keys: list[str], value: Any) -> dict[str, Any]:
    """A copy of `raw` with the nested key set; a catalog name is expanded so a field can be set."""
    out = copy.deepcopy(raw)
    node = out
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if isinstance(child, str) and i == 0 and key in ("model", "device"):
            child = {"base": child}
        elif child is None:
            child = {}
        elif not isinstance(child, dict):
            raise ScenarioError([f"{'.'.join(keys[: i + 1])}: is {excerpt(child)}, not a mapping, "
                                 f"so '{'.'.join(keys)}' cannot be set"])
        node[key] = child
        node = child
    old = node.get(keys[-1])
    if len(keys) == 1 and keys[0] in ("model", "device") and isinstance(old, str):
        old = {"base": old}     # --set 'model={max_position_embeddings: 8192}' overrides the entry
    # A mapping merges into the mapping it replaces (--set 'engine={block_size: 8}' keeps the
    # other engine fields); an empty mapping {} clears it.
    merge = isinstance(value, dict) and value and isinstance(old, dict)
    key = keys[-1]
    node[key] = deep_merge({key: old}, {key: value})[key] if merge else value
    return out


def apply_overrides(raw: dict[str, Any], overrides: list[str], source: str | None = None) -> dict[str, Any]:
    for text in overrides:
        keys, value = parse_override(text)
        raw = set_path(raw, keys, value)
    return raw


# ----------------------------------------------------------------------------- error text

def _loc_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "top level"


def _unwrap(annotation: Any) -> Any:
    """Optional[X] / list[X] / dict[str, X] -> X, for walking the schema by path."""
    while True:
        args = typing.get_args(annotation)
        origin = typing.get_origin(annotation)
        if origin in (list, tuple, dict) and args:
            annotation = args[-1]
        elif origin is typing.Union or str(origin) == "types.UnionType":
            non_none = [a for a in args if a is not type(None)]
            annotation = non_none[0] if len(non_none) == 1 else annotation
            if len(non_none) != 1:
                return annotation
        else:
            return annotation


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    node: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(node, type) and issubclass(node, BaseModel)):
            return None
        field = node.model_fields.get(part)
        if field is None:
            return None
        node = _unwrap(field.annotation)
    return node if isinstance(node, type) and issubclass(node, BaseModel) else None


def _paths_ending_in(model: type[BaseModel], key: str) -> list[str]:
    """Dotted paths below `model` whose last part is `key` (rate -> workload.arrival.rate): a key
    given at the wrong level is better answered by where it lives than by a similar spelling.
    A path through a field named `key` itself does not count."""
    paths = [p for p in _paths_by_leaf(model).get(key, ()) if key not in p.split(".")[:-1]]
    return paths[:3]


@functools.lru_cache(maxsize=None)
def _paths_by_leaf(model: type[BaseModel], depth: int = 3) -> dict[str, tuple[str, ...]]:
    """Every dotted path of two or three parts below `model`, sorted, by its last part (built once
    per schema class: 20,000 unknown keys must not walk the schema 20,000 times)."""
    index: dict[str, set[str]] = {}
    for name, field in model.model_fields.items():
        node = _unwrap(field.annotation)
        if depth > 1 and isinstance(node, type) and issubclass(node, BaseModel):
            for leaf in node.model_fields:
                index.setdefault(leaf, set()).add(f"{name}.{leaf}")
            for leaf, paths in _paths_by_leaf(node, depth - 1).items():
                index.setdefault(leaf, set()).update(f"{name}.{p}" for p in paths)
    return {leaf: tuple(sorted(paths)) for leaf, paths in index.items()}


def describe_validation_error(error: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per problem of a pydantic error on `root`, each naming the field's path (never
    pydantic's own multi-line text with its documentation links)."""
    return _describe(error, root)


def _describe(error: ValidationError, root: type[BaseModel]) -> list[str]:
    problems = []
    for err in error.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        path = _loc_str(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            valid = sorted(parent.model_fields) if parent else []
            nested = _paths_ending_in(parent, str(loc[-1])) if parent else []
            close = nested or difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            prefix = _loc_str(loc[:-1]) + "." if nested and loc[:-1] else ""
            hint = f"; did you mean {' or '.join(repr(prefix + c) for c in close)}?" if close else ""
            known = f" (valid keys: {', '.join(valid)})" if valid else ""
            problems.append(f"{path}: unknown key{hint}{known}")
        elif kind == "missing":
            problems.append(f"{path}: missing (required)")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = "" if isinstance(got, (dict, list)) else f" (got {excerpt(got)})"
            problems.append(f"{path}: {msg}{shown}")
    return problems


def seed_arg(text: str) -> int:
    """--seed's type: an integer, quoted back short when it is not one (or has 5,000 digits)."""
    if len(text) > 30 or not text.strip().lstrip("+-").isdigit():
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not an integer seed (0 to 2^63 - 1)")
    return int(text)


def scenario_args(parser: argparse.ArgumentParser) -> None:
    """The arguments every scenario-taking command shares."""
    parser.add_argument("scenario", type=Path, help="scenario YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="override a scenario field, e.g. --set engine.block_size=32 (repeatable); "
                             "with several values (A,B,C) `simrun SCENARIO` sweeps them")
    parser.add_argument("--seed", type=seed_arg, default=None, help="override the scenario's seed")


def pool_scenario(scenario, side: str):
    """The scenario one engine of `side` serves: the pool's device, tp and engine patch applied, one
    replica, no disaggregation (a plain scenario every existing piece can size and price)."""
    pool = scenario.cluster.disaggregation.pool(side)
    engine = EngineConfig.model_validate({**scenario.engine.model_dump(exclude_unset=True), **pool.engine})
    tp = pool.tp or scenario.parallelism.tp
    parallelism = Parallelism(tp=tp, ep=tp if scenario.parallelism.ep > 1 else 1)     # (dp is 1: checked)
    cluster = Cluster(router=scenario.cluster.router, load_bound=scenario.cluster.load_bound)
    return scenario.model_copy(update={"engine": engine, "parallelism": parallelism, "cluster": cluster,
                                       "device": pool.device or scenario.device})


def disaggregation_problems(scenario) -> list[str]:
    """What a P/D scenario cannot be (checked with the scenario's other cross-field checks)."""
    d = scenario.cluster.disaggregation
    where = "cluster.disaggregation"
    problems = []
    if scenario.cluster.replicas != 1:
        problems.append(f"cluster.replicas: {scenario.cluster.replicas}; set {where}.prefill.replicas and "
                        f"{where}.decode.replicas instead (with disaggregation the pools hold the engines)")
    if scenario.parallelism.dp != 1:
        problems.append(f"parallelism.dp: {scenario.parallelism.dp}; a disaggregated cluster's engines are its "
                        f"pools' replicas (dp must be 1)")
    if scenario.engine.batching != "continuous" or scenario.engine.allocation != "paged":
        problems.append(f"engine.batching/allocation: {where} needs vLLM's continuous batching with paged "
                        f"allocation (NixlConnector reads paged blocks)")
    if scenario.engine.kv_offload is not None:
        problems.append(f"engine.kv_offload: a CPU tier with {where} is not modelled (vLLM runs one KV "
                        f"connector per engine: OffloadingConnector or NixlConnector); remove one of them")
    if scenario.model.num_sliding_layers:
        problems.append(f"model: {where} supports full-attention models with one KV cache group; "
                        f"'{scenario.model.name}' has sliding-window or hybrid layers")
    for side in SIDES:
        pool = d.pool(side)
        try:
            EngineConfig.model_validate({**scenario.engine.model_dump(exclude_unset=True), **pool.engine})
        except ValueError as e:
            problems.append(f"{where}.{side}.engine: {str(e).splitlines()[-1].strip()} "
                            f"(expected engine fields, see `EngineConfig`)")
            continue
        problems += [f"{where}.{side}: {p}" for p in pool_problems(scenario, side)]
    return problems


def pool_problems(scenario, side: str) -> list[str]:
    """The scenario checks (tp vs heads, experts, memory, ...) on one pool's engine, as a scenario of its own."""
    try:
        validate_scenario(pool_scenario(scenario, side).model_dump(mode="json"))
    except ScenarioError as e:
        return e.problems
    return []
