"""Scenario schema: one validated YAML file describes model, device, engine, workload and SLOs.

Unknown keys, wrong types and out-of-range values are errors that name the full path
(`engine.blok_size`), the value and what is allowed, with the closest valid key when a
key is misspelt. `--set path=value` overrides go through the same validation.
"""
from __future__ import annotations

import argparse

import copy
import difflib
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from sim.core.memory import parse_vllm_version, pool_block_bytes
from sim.core.files import FileFormatError, excerpt, load_yaml, read_text
from sim.names import name_problem
from sim.core.catalog import (MAX_DEVICE_MIB, DeviceSpec, ModelSpec, StrictModel, catalog_entry,
                         model_fields_from_hf_config)


class ScenarioError(ValueError):
    """A scenario that cannot be used; `problems` holds one line per offending field."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"{source}: " if source else ""
        if len(problems) == 1:
            super().__init__(f"{head}{problems[0]}")
        else:
            lines = "\n".join(f"  - {p}" for p in problems)
            super().__init__(f"{head}{len(problems)} problems:\n{lines}")


# Upper bounds on sizes: far above any real deployment, low enough that a typo (1e12) is a
# clear error rather than a MemoryError after minutes. README "Security and limits" lists them.
MAX_REQUESTS = 1_000_000
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
    tp: int = Field(default=1, ge=1, le=1024, description="tensor-parallel degree (modelled, not run)")
    # vLLM's --data-parallel-size: dp engine replicas (own scheduler and KV pool each, attention
    # sliced over tp) that share one router; a MoE model's experts span all tp x dp GPUs.
    dp: int = Field(default=1, ge=1, le=1024, description="data-parallel degree (modelled, not run)")
    # vLLM's --enable-expert-parallel: 1 = experts sliced over tp x dp GPUs (each GPU a slice of
    # every expert), tp x dp = whole experts spread over the GPUs with an all-to-all per MoE layer.
    ep: int = Field(default=1, ge=1, le=2**20, description="expert-parallel degree: 1 or tp x dp")

    @property
    def gpus(self) -> int:
        """GPUs one engine (all its data-parallel ranks) uses."""
        return self.tp * self.dp


# The first vLLM release whose `async_scheduling` default (None, "auto") resolves to on: the switch
# existed from 0.10 as an opt-in flag (--async-scheduling); vllm-project/vllm#27614, the last item of
# the tracking issue vllm-project/vllm#27679 (closed after PRs of late December 2025), made it the
# default, after 0.13 was cut. vLLM's recipes still called the flag opt-in for 0.11.1-0.12 on
# 2025-12-01 (vllm-project/recipes#131).
ASYNC_SCHEDULING_DEFAULT_FROM = (0, 14)


class EngineConfig(StrictModel):
    batching: Literal["continuous", "static"] = "continuous"
    allocation: Literal["paged", "contiguous"] = "paged"
    block_size: int = Field(default=16, ge=1, le=1024)
    # Pool size including vLLM's null block 0; derived from device memory when unset.
    num_blocks: Optional[int] = Field(default=None, ge=2, le=2**32)     # and checked against device memory
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # Defaults follow vLLM's API server: 1024 / 8192 on >= 70 GiB non-A100 GPUs, else 256 / 2048.
    max_num_seqs: Optional[int] = Field(default=None, ge=1, le=2**20)
    max_num_batched_tokens: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS)
    max_model_len: Optional[int] = Field(default=None, ge=2, le=MAX_TOKENS)
    chunked_prefill: bool = True
    prefix_caching: bool = True
    preemption: Literal["recompute"] = "recompute"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # mixed = vLLM V1 (decodes and prefill chunks share a step); prefill_first = vLLM V0 / nano-vllm.
    step_composition: Literal["mixed", "prefill_first"] = "mixed"
    # Fraction of blocks kept free when admitting a waiting request (V0: 0.01, V1: 0).
    admission_watermark: float = Field(default=0.0, ge=0, lt=1)
    # vLLM's scheduler_reserve_full_isl: admit only if the whole prompt's blocks fit now.
    reserve_full_prompt: bool = True
    # What `contiguous` reserves per request: max_model_len (the server cannot know the
    # answer's length) or the request's own prompt + max output (an oracle baseline).
    contiguous_reserve: Literal["max_model_len", "request"] = "max_model_len"
    # Activation memory reserved outside the KV pool; estimated from the shapes when unset.
    activation_mib: Optional[float] = Field(default=None, ge=0, le=MAX_DEVICE_MIB)
    # vLLM's async scheduling: step N+1 is planned while step N runs, so host work hides behind the
    # device and a finished request's blocks and seat are freed one step late. auto = vLLM's default
    # for vllm_version (on from 0.14) on a GPU device with continuous batching; kvtwin's own engine
    # on the `cpu` device is synchronous. Read the resolved value as `Scenario.async_scheduling`.
    async_scheduling: Union[bool, Literal["auto"]] = "auto"
    # vLLM's --kv-cache-dtype: auto = the model dtype; fp8 (e4m3 / e5m2) halves a 16-bit cache.
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # How the KV pool is sized when num_blocks is unset, on GPU devices: vllm = vLLM's own plan
    # (torch-visible memory, profiling-run activation peak, non-torch memory, CUDA-graph estimate);
    # simple = datasheet memory - weights - activation estimate - device.reserved_mib. The `cpu`
    # device (the engine's CPU runs) always uses simple.
    memory_plan: Literal["vllm", "simple"] = "vllm"
    # The vLLM version whose memory terms apply (non-torch memory, sampler copies, graph estimate);
    # the default is the version they were fitted on.
    # Only major.minor matter; a patch or pre-release tail (0.10.1.1, 0.11.0rc2) is allowed.
    vllm_version: str = Field(default="0.19", pattern=r"^v?\d{1,3}\.\d{1,3}([.+-][.+\w-]{0,40})?$")


# ----------------------------------------------------------------------------- workload

class LengthDist(StrictModel):
    """A token-length distribution. An integer in YAML is shorthand for {dist: fixed, value: N}."""

    dist: Literal["fixed", "uniform", "normal", "lognormal", "empirical", "sharegpt"] = "fixed"
    value: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS)
    min: Optional[int] = Field(default=None, ge=0, le=MAX_TOKENS)
    max: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS)
    mean: Optional[float] = Field(default=None, ge=1e-3, le=MAX_TOKENS)      # tokens; tinier overflows
    std: Optional[float] = Field(default=None, ge=0, le=MAX_TOKENS)
    values: Optional[list[int]] = Field(default=None, max_length=MAX_REQUESTS)
    file: Optional[Path] = None
    column: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return v
        if isinstance(v, int):
            return {"dist": "fixed", "value": v}
        return v

    @model_validator(mode="after")
    def _required(self) -> "LengthDist":
        need = {"fixed": ["value"], "uniform": ["min", "max"], "normal": ["mean", "std"],
                "lognormal": ["mean", "std"], "empirical": [], "sharegpt": []}[self.dist]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"dist '{self.dist}' needs {', '.join(missing)}")
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

    strategy: Literal["linear", "exponential"]
    start_rps: float = Field(ge=1e-6, le=1e7)
    end_rps: float = Field(ge=1e-6, le=1e7)


class Arrival(StrictModel):
    # vidur_poisson: Vidur's generator exactly (vidur/request_generator/poisson_request_interval_
    # generator.py): Python's `random` seeded with `seed` just before generating, gaps
    # -ln(1 - U) / rate capped at 3 / rate, summed from t=0 (never rescaled).
    process: Literal["poisson", "gamma", "fixed", "offline", "vidur_poisson"] = "poisson"
    rate: Optional[float] = Field(default=None, gt=0, le=1e7, description="requests per second")
    # Coefficient of variation of the inter-arrival gaps for `gamma` (1 = Poisson, >1 bursty).
    # vLLM's --burstiness b corresponds to cv = 1/sqrt(b).
    cv: float = Field(default=1.0, ge=1e-3, le=100)      # beyond these the gamma shape over/underflows
    # vLLM's benchmark rescales the gaps so the last of N requests arrives at exactly N/rate
    # (only when num_requests, not duration_s, bounds the workload).
    rescale: bool = True
    seed: int = Field(default=42, ge=0, le=2**63 - 1, description="vidur_poisson: Python random.seed value")
    ramp_up: Optional[RampUp] = None

    @model_validator(mode="after")
    def _needs_rate(self) -> "Arrival":
        if self.process == "offline" and self.ramp_up is not None:
            raise ValueError("ramp_up needs an arrival process (poisson, gamma or fixed), not offline")
        if self.process != "offline" and self.rate is None and self.ramp_up is None:
            raise ValueError(f"arrival process '{self.process}' needs a rate (requests per second)")
        return self


class SharedPrefix(StrictModel):
    """Shared system prompts: `groups` distinct prefixes; `fraction` of requests carry one."""

    groups: int = Field(default=1, ge=1, le=MAX_REQUESTS)
    length: LengthDist = Field(default_factory=lambda: LengthDist(value=512))
    fraction: float = Field(default=1.0, ge=0, le=1)
    popularity: Literal["uniform", "zipf"] = "uniform"
    zipf_s: float = Field(default=1.0, gt=0, le=100)


class DynamicSegment(StrictModel):
    """A per-request segment (a timestamp, a request id) placed before or after the shared prefix."""

    length: int = Field(default=8, ge=1, le=MAX_TOKENS)
    position: Literal["first", "last"] = "last"


class MultiTurn(StrictModel):
    """Conversations: each turn's prompt = earlier turns + previous answer + a new user message."""

    turns: LengthDist = Field(default_factory=lambda: LengthDist(value=3))
    user_len: LengthDist = Field(default_factory=lambda: LengthDist(dist="uniform", min=32, max=256))
    think_time_s: float = Field(default=5.0, ge=0, le=MAX_DURATION_S)
    think_dist: Literal["fixed", "exponential"] = "exponential"

    @field_validator("think_time_s")
    @classmethod
    def _no_negative_zero(cls, v: float) -> float:
        return v + 0.0          # -0.0 passes ge=0 but numpy's exponential refuses a negative scale


class Tenant(StrictModel):
    name: str = Field(max_length=200)
    share: float = Field(default=1.0, gt=0, le=1e9)
    # A cache salt isolates this tenant's prefix-cache blocks (vLLM's cache_salt).
    salt: bool = True


class Priorities(StrictModel):
    values: list[int] = Field(default_factory=lambda: [0], min_length=1, max_length=MAX_LIST)
    weights: Optional[list[float]] = Field(default=None, max_length=MAX_LIST)

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

    segment: str = Field(max_length=200)
    len: int = Field(ge=1, le=MAX_TOKENS)


class ExplicitRequest(StrictModel):
    arrival_s: float = Field(default=0.0, ge=0, le=MAX_DURATION_S)
    prompt_len: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS)
    prompt: Optional[list[PromptSegment]] = Field(default=None, max_length=MAX_LIST)
    output_len: int = Field(ge=1, le=MAX_TOKENS)
    tenant: Optional[str] = Field(default=None, max_length=200)
    priority: int = Field(default=0, ge=-2**31, le=2**31 - 1)

    @model_validator(mode="after")
    def _one_prompt(self) -> "ExplicitRequest":
        if (self.prompt_len is None) == (self.prompt is None):
            raise ValueError("give exactly one of prompt_len or prompt (a list of segments)")
        return self


TRACE_FIELDS = ("arrival", "prompt", "prompt_len", "output_len", "tenant", "priority")


class Trace(StrictModel):
    format: Literal["azure", "mooncake", "burstgpt", "jsonl", "csv"]
    path: Path
    # jsonl/csv: our field -> the file's key or column, e.g. {arrival: arrival_time_ns, prompt_len: input_toks}
    fields: Optional[dict[str, str]] = Field(default=None, max_length=16)
    # Unit of the arrival times (jsonl, csv, burstgpt: s by default; mooncake: ms; azure has dates).
    time_unit: Optional[Literal["s", "ms", "us", "ns"]] = None
    time_scale: float = Field(default=1.0, ge=1e-6, le=1e9, description="replay at k x speed")
    window_s: Optional[tuple[float, float]] = None
    sample: Optional[float] = Field(default=None, gt=0, le=1, description="keep this fraction")
    max_requests: Optional[int] = Field(default=None, ge=1, le=MAX_REQUESTS)
    # Mooncake: tokens per hash id block.
    hash_block_tokens: int = Field(default=512, ge=1, le=MAX_TOKENS)

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

    format: Literal["sharegpt", "text", "random", "sonnet"]
    path: Optional[Path] = None
    # tokenizer.json (the `tokenizers` package) or a transformers folder; sharegpt/text/sonnet need one
    tokenizer: Optional[Path] = None
    turns: Literal["first", "all"] = "first"
    filter: bool = True                       # sharegpt: vLLM's length filter (drops <4, >1024, sum >2048)
    think_time_s: float = Field(default=0.0, ge=0)     # sharegpt all turns: pause before a follow-up
    input_len: int = Field(default=1024, ge=1)         # random / sonnet
    output_len: Optional[int] = Field(default=None, ge=1)   # random (128) / sonnet (150); sharegpt override
    range_ratio: float = Field(default=0.0, ge=0, lt=1)
    prefix_len: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _needs(self) -> "Dataset":
        if self.format != "random" and (self.path is None or self.tokenizer is None):
            raise ValueError(f"dataset format '{self.format}' needs path and tokenizer")
        if self.format == "random" and (self.path is not None or self.tokenizer is not None):
            raise ValueError("the random dataset reads no file: remove path and tokenizer")
        return self


SYNTHETIC_ONLY = {"num_requests", "duration_s", "arrival", "prompt_len", "output_len",
                  "length_correlation", "shared_prefix", "dynamic_segment", "multi_turn", "priorities"}


# What a dataset supplies itself (its prompts); arrivals, num_requests and, for text, output_len stay.
DATASET_REPLACES = {"prompt_len", "length_correlation", "shared_prefix", "dynamic_segment", "multi_turn"}


class Workload(StrictModel):
    num_requests: Optional[int] = Field(default=None, ge=1, le=MAX_REQUESTS)
    duration_s: Optional[float] = Field(default=None, gt=0, le=MAX_DURATION_S)
    # The first N requests warm the engine; steady-state figures exclude them.
    warmup_requests: int = Field(default=0, ge=0, le=MAX_REQUESTS)
    # A closed-loop client (vLLM bench's --max-concurrency): at most this many requests in
    # flight; a request due while the client is full is sent when one finishes (its TTFT
    # counts from then, as vLLM's does).
    max_concurrency: Optional[int] = Field(default=None, ge=1, le=MAX_REQUESTS)
    arrival: Arrival = Field(default_factory=lambda: Arrival(process="offline"))
    prompt_len: LengthDist = Field(default_factory=lambda: LengthDist(dist="sharegpt"))
    output_len: LengthDist = Field(default_factory=lambda: LengthDist(dist="sharegpt"))
    # Rank correlation between prompt and output lengths (Gaussian copula); 0 = independent.
    length_correlation: float = Field(default=0.0, ge=-1, le=1)
    shared_prefix: Optional[SharedPrefix] = None
    dynamic_segment: Optional[DynamicSegment] = None
    multi_turn: Optional[MultiTurn] = None
    tenants: Optional[list[Tenant]] = Field(default=None, max_length=MAX_LIST)
    priorities: Optional[Priorities] = None
    requests: Optional[list[ExplicitRequest]] = Field(default=None, max_length=MAX_REQUESTS)
    trace: Optional[Trace] = None
    dataset: Optional[Dataset] = None

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
        if synthetic and self.num_requests is None and self.duration_s is None:
            self.num_requests = 100
        if synthetic and self.arrival.process == "offline" and self.num_requests is None:
            raise ValueError("offline arrivals need num_requests (duration_s means nothing at t=0)")
        if synthetic and self.arrival.ramp_up is not None and (self.num_requests is None or self.duration_s):
            raise ValueError("arrival.ramp_up needs num_requests without duration_s (the ramp runs over "
                             "the N requests, as vLLM's benchmark does)")
        rate = self.arrival.rate
        if synthetic and rate and self.num_requests and self.num_requests / rate > MAX_DURATION_S:
            raise ValueError(f"arrival.rate {rate:g}/s spreads {self.num_requests} requests over "
                             f"{self.num_requests / rate:.3g} s, more than the {MAX_DURATION_S:g} s (30 days) allowed")
        expected = (self.arrival.rate or 0) * (self.duration_s or 0)
        if synthetic and self.num_requests is None and expected > MAX_REQUESTS:
            raise ValueError(f"arrival.rate x duration_s = {expected:.3g} requests, more than the "
                             f"{MAX_REQUESTS:,} allowed; shorten duration_s or set num_requests")
        return self


# ----------------------------------------------------------------------------- the rest

class Slo(StrictModel):
    """Per-request targets; goodput counts requests meeting every target that is set."""

    ttft_s: Optional[float] = Field(default=None, gt=0)
    tpot_s: Optional[float] = Field(default=None, gt=0)
    e2e_s: Optional[float] = Field(default=None, gt=0)


class Cluster(StrictModel):
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)
    router: Literal["round_robin", "least_outstanding_tokens", "prefix_aware"] = "round_robin"
    # prefix_aware: a replica may take at most this many times the mean outstanding tokens.
    load_bound: float = Field(default=1.5, ge=1.0)


class Scenario(StrictModel):
    name: str = Field(default="scenario", max_length=200)
    description: str = Field(default="", max_length=10_000)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    model: ModelSpec
    device: DeviceSpec
    parallelism: Parallelism = Field(default_factory=Parallelism)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    workload: Workload = Field(default_factory=Workload)
    slo: Slo = Field(default_factory=Slo)
    cluster: Cluster = Field(default_factory=Cluster)
    # Where device step times come from: the roofline over datasheet peaks, or measured operator
    # tables (aiconfigurator-core, the `tables` extra), or the roofline with the coefficients trained
    # on public vLLM runs (sim/trained.py). A calibrated device.profile tunes datasheet or tables.
    step_times: Literal["datasheet", "tables", "trained"] = "datasheet"
    # name -> partial scenario merged over this one (nested keys, e.g. {engine: {batching: static}}).
    variants: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=MAX_VARIANTS)

    @field_validator("variants")
    @classmethod
    def _variant_names(cls, variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # A variant's name becomes its output folder: refuse anything that is not a plain name.
        for name in variants:
            problem = name_problem(name)
            if problem:
                raise ValueError(f"variant name {excerpt(name)}: {problem}")
        return variants

    @property
    def max_model_len(self) -> int:
        """The effective limit: the engine setting, else the model's context length."""
        return self.engine.max_model_len or self.model.max_position_embeddings

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs or (1024 if self._big_gpu() else 256)

    @property
    def max_num_batched_tokens(self) -> int:
        default = 8192 if self._big_gpu() else 2048
        budget = self.engine.max_num_batched_tokens or default
        if not self.engine.chunked_prefill and self.engine.max_num_batched_tokens is None:
            budget = max(budget, self.max_model_len)  # vLLM: must hold a whole prompt then
        return budget

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one request computes in one step: the token budget, or a whole sequence
        in a static batch (its prefill ignores the budget). Bounds what a sliding window holds."""
        return self.max_model_len if self.engine.batching == "static" else self.max_num_batched_tokens

    @property
    def async_scheduling(self) -> bool:
        """engine.async_scheduling resolved: `auto` is on where vLLM's default is (>= 0.14) and the
        engine is a vLLM-like one (a GPU device, continuous batching)."""
        setting = self.engine.async_scheduling
        if setting != "auto":
            return bool(setting)
        return (parse_vllm_version(self.engine.vllm_version) >= ASYNC_SCHEDULING_DEFAULT_FROM
                and self.device.name != "cpu" and self.engine.batching == "continuous")

    def _big_gpu(self) -> bool:
        return self.device.memory_mib >= 70 * 1024 and not self.device.name.startswith("a100")


# ----------------------------------------------------------------------------- loading

def _resolve_sections(raw: dict[str, Any], base_dir: Path | None) -> dict[str, Any]:
    raw = dict(raw)
    for key, kind in (("model", "models"), ("device", "devices")):
        if key in raw:
            try:
                raw[key] = _resolve_catalog(kind, raw[key], base_dir)
            except (KeyError, ValueError) as e:
                raise ScenarioError([f"{key}: {e.args[0]}"]) from None
    for key in ("model", "device"):
        for field in ("weights", "profile"):
            if isinstance(raw.get(key), dict) and raw[key].get(field) is not None:
                raw[key] = {**raw[key], field: _resolve_path(raw[key][field], base_dir)}
    return raw


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
    if s.engine.batching == "static" and s.engine.step_composition != "mixed":
        problems.append("engine.step_composition: only 'mixed' applies to static batching")
    return problems


def _pool_size_checks(s: Scenario) -> list[str]:
    """num_blocks must fit the device; every replica's pool together must stay simulable."""
    block_bytes = pool_block_bytes(s.model, s.engine.block_size, s.parallelism.tp, s.engine.kv_cache_dtype)
    if s.engine.num_blocks is not None and s.engine.num_blocks * block_bytes > s.device.memory_bytes:
        return [f"engine.num_blocks: {s.engine.num_blocks} blocks of {s.engine.block_size} tokens need "
                f"{s.engine.num_blocks * block_bytes / 2**30:.4g} GiB of KV cache per GPU, more than the "
                f"device's {s.device.memory_bytes / 2**30:.4g} GiB"]
    # at most this many blocks per replica (the whole memory budget, before weights)
    per_replica = s.engine.num_blocks or int(s.device.memory_bytes * s.engine.gpu_memory_utilization) // block_bytes
    engines = s.cluster.replicas * s.parallelism.dp           # each data-parallel rank has its own pool
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
    """Load, apply `--set` overrides and validate. Relative paths resolve against the file."""
    path = Path(path)
    raw = load_raw(path)
    if overrides:
        raw = apply_overrides(raw, overrides, source=str(path))
    if seed is not None:
        raw["seed"] = seed
    return validate_scenario(raw, base_dir=path.parent.resolve(), source=str(path))


def expand_variants(scenario: Scenario, base_dir: Path | None = None) -> dict[str, Scenario]:
    """{variant name: full scenario}; a scenario without variants maps its own name to itself."""
    if not scenario.variants:
        return {scenario.name: scenario}
    base = scenario.model_dump(exclude={"variants"}, exclude_unset=True)
    out = {}
    for name, patch in scenario.variants.items():
        if not isinstance(patch, dict):
            raise ScenarioError([f"variants.{name}: expected a mapping of overrides, got {excerpt(patch)}"])
        merged = deep_merge(base, patch)
        merged["name"] = f"{scenario.name}/{name}"
        try:
            out[name] = validate_scenario(merged, base_dir=base_dir)
        except ScenarioError as e:
            raise ScenarioError([f"variants.{name}.{p}" for p in e.problems]) from None
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

def parse_override(text: str) -> tuple[list[str], Any]:
    """'engine.block_size=32' -> (['engine', 'block_size'], 32); values parse as YAML scalars."""
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
    return keys, parsed


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


def _describe(error: ValidationError, root: type[BaseModel]) -> list[str]:
    problems = []
    for err in error.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        path = _loc_str(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            valid = sorted(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
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


def scenario_args(parser: argparse.ArgumentParser) -> None:
    """The arguments every scenario-taking command shares."""
    parser.add_argument("scenario", type=Path, help="scenario YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="override a scenario field, e.g. --set engine.block_size=32 (repeatable); "
                             "with several values (A,B,C) `simrun SCENARIO` sweeps them")
    parser.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
