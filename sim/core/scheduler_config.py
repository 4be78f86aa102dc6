"""The scheduling policy's settings (sim/core/scheduler.py), read from a validated scenario.

`make_scheduler` (sim/core/scheduler_variants.py) reads the variant fields (`batching`, `step_composition`,
`async_scheduling`, `speculative`, `lora`) to compose the scheduler that runs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sim.core import vllm_versions


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    batching: str = "continuous"            # continuous | static
    chunked_prefill: bool = True
    policy: str = "fcfs"                    # fcfs | priority
    step_composition: str = "mixed"         # mixed | prefill_first
    admission_watermark: float = 0.0
    reserve_full_prompt: bool = True
    # Advance steady decodes as a cohort (sim/core/fast/cohort.py); False forces the one-by-one loop.
    lazy_decode: bool = True
    # vLLM's async scheduling: finished requests leave RUNNING one step late, and requests that
    # arrive while a step runs join WAITING one pass late (sim/core/async_scheduling.py).
    async_scheduling: bool = False
    # vLLM's long_prefill_token_threshold: the most tokens one prompt chunk computes (0 = no cap).
    long_prefill_token_threshold: int = 0
    # vLLM >= 0.20 caps a sliding-window group's admission need at the window (sim/core/vllm_versions.py).
    sliding_admission_cap: bool = True
    # Speculative decoding (sim/core/speculative.py): (method, num_speculative_tokens, per-position
    # acceptance rates, seed), or None. It turns the decode cohort and leaps off (one token a step).
    speculative: Optional[tuple] = None
    # LoRA (sim/core/lora.py): (max_loras, max_cpu_loras), or None. It turns the decode cohort off
    # (every step's adapters are counted one request at a time).
    lora: Optional[tuple] = None

    @classmethod
    def from_scenario(cls, s) -> "SchedulerConfig":
        """The policy's settings from a validated scenario: every scenario field the scheduler
        consults is read here, and nowhere else."""
        e = s.engine
        return cls(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                   max_model_len=s.max_model_len, batching=e.batching, chunked_prefill=e.chunked_prefill,
                   policy=e.scheduling_policy, step_composition=e.step_composition,
                   admission_watermark=e.admission_watermark, reserve_full_prompt=e.reserve_full_prompt,
                   async_scheduling=s.async_scheduling,
                   long_prefill_token_threshold=s.long_prefill_token_threshold,
                   sliding_admission_cap=vllm_versions.has(e.vllm_version, "sliding_window_admission_cap"),
                   speculative=e.speculative.policy(s.seed) if e.speculative is not None else None,
                   lora=e.lora.policy() if e.lora is not None else None)


def variants_of(config: SchedulerConfig, offload=None) -> frozenset:
    """The scheduler variants a config (and a CPU offload tier) asks for, by their names in
    sim/core/scheduler_variants.py's VARIANTS; none is vLLM V1's scheduler alone."""
    wanted = {"async": config.async_scheduling, "static": config.batching == "static",
              "prefill_first": config.step_composition != "mixed" and config.batching != "static",
              "speculative": config.speculative is not None, "lora": config.lora is not None,
              "offload": offload is not None}
    return frozenset(name for name, on in wanted.items() if on)
