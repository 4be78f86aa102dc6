"""Speculative decoding's scenario section (`engine.speculative`, vLLM's --speculative-config names)
and its draft cost. The policy (drafts in the token budget, lookahead slots, verification) is
sim/core/speculative.py; docs/whatif/speculative.md describes both.

Default acceptance, per method, from public measurements (each fitted to the geometric per-position
form rate[i] = a^(i+1) of Leviathan et al. 2023, arXiv:2211.17192):
- eagle3: a = 0.743, fitted to vLLM's own count for Llama-3.1-8B-Instruct + EAGLE3-LLaMA3.1-Instruct-8B
  on MT-bench, k = 7, temperature 0: 12,208 accepted tokens over 4,816 drafts (mean acceptance length
  3.53), https://github.com/vllm-project/vllm/issues/26191
- eagle: a = 0.585, fitted to vLLM's count for Llama-3-8B-Instruct + EAGLE-LLaMA3-Instruct-8B on
  MT-bench, k = 2: mean acceptance length 1.89, https://github.com/vllm-project/vllm/pull/16035
- mtp: a = 0.85, DeepSeek-V3's second-token acceptance of 85-90 % (DeepSeek-V3 Technical Report,
  arXiv:2412.19437, section 5.4.3), with its one MTP module (k = 1 by default)
- ngram and draft_model: no default; their acceptance depends on the workload (how much of the
  answer repeats the prompt) and on the draft model, so the scenario must give it.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from sim.core.catalog import ModelSpec, StrictModel, catalog_entry
from sim.core.vllm_versions import dp_ranks_in_lockstep
from sim.errors import ScenarioError

# Geometric per-token acceptance by method (module docstring: sources).
DEFAULT_ACCEPTANCE = {"eagle3": 0.743, "eagle": 0.585, "mtp": 0.85}
DEFAULT_NUM_SPEC_TOKENS = {"mtp": 1}
MAX_SPEC_TOKENS = 64
# The draft forwards a drafter runs per step: EAGLE-type heads and MTP modules are one decoder layer
# (plus the LM head) of the target's shapes; a draft model is its own model; ngram runs on the host.
HEAD_METHODS = ("eagle", "eagle3", "mtp")


class SpeculativeConfig(StrictModel):
    """vLLM's --speculative-config: the method, how many tokens it drafts per step and how often
    they are accepted (docs/whatif/speculative.md)."""

    method: Literal["ngram", "eagle", "eagle3", "mtp", "draft_model"] = Field(
        description="vLLM's method: ngram (prompt lookup, on the host) | eagle | eagle3 | mtp (a draft "
                    "head of one decoder layer) | draft_model (a smaller model, `model`)")
    num_speculative_tokens: Optional[int] = Field(
        default=None, ge=1, le=MAX_SPEC_TOKENS,
        description="draft tokens per step (k); required except for mtp (1, DeepSeek-V3's one MTP module)")
    model: Optional[str] = Field(
        default=None, max_length=200,
        description="the draft model: a catalog name (qwen3-0.6b) for draft_model; for eagle/eagle3/mtp "
                    "the head's name, kept for the record (its cost is one layer of the target's shapes)")
    acceptance_rates: Optional[list[float]] = Field(
        default=None, max_length=MAX_SPEC_TOKENS,
        description="vLLM's per-position acceptance rates (spec_decode/metrics.py: the share of drafts "
                    "whose position i was accepted), one per draft token, none increasing")
    acceptance_rate: Optional[float] = Field(
        default=None, gt=0, lt=1,
        description="one per-token acceptance a instead: position i is accepted at rate a^(i+1); default "
                    "for eagle3 0.743, eagle 0.585, mtp 0.85 (cited in docs/whatif/speculative.md)")

    @model_validator(mode="after")
    def _complete(self) -> "SpeculativeConfig":
        k = self.num_speculative_tokens or DEFAULT_NUM_SPEC_TOKENS.get(self.method)
        if k is None:
            raise ValueError(f"num_speculative_tokens is required for method {self.method!r} "
                             f"(vLLM needs it unless the draft model's config has one)")
        self.__dict__["num_speculative_tokens"] = k
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("method draft_model needs `model`: the draft model's catalog name")
            try:
                catalog_entry("models", self.model)
            except KeyError as e:
                raise ValueError(f"model: {e.args[0]}") from None
        rates = self.acceptance_rates
        if rates is not None and self.acceptance_rate is not None:
            raise ValueError("give acceptance_rates or acceptance_rate, not both")
        if rates is not None:
            if len(rates) != k:
                raise ValueError(f"acceptance_rates has {len(rates)} entries for num_speculative_tokens {k}")
            if any(not 0 <= r <= 1 for r in rates):
                raise ValueError(f"acceptance_rates {rates}: each must lie in [0, 1]")
            if any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError(f"acceptance_rates {rates} increase; a draft position is accepted only if "
                                 f"every earlier one was, so the per-position rates cannot increase")
        elif self.acceptance_rate is None and self.method not in DEFAULT_ACCEPTANCE:
            raise ValueError(f"method {self.method!r} has no published default acceptance (it depends on "
                             f"the workload): set acceptance_rates or acceptance_rate")
        return self

    @property
    def rates(self) -> tuple[float, ...]:
        """The per-position acceptance rates in use."""
        if self.acceptance_rates is not None:
            return tuple(self.acceptance_rates)
        a = self.acceptance_rate if self.acceptance_rate is not None else DEFAULT_ACCEPTANCE[self.method]
        return tuple(a ** (i + 1) for i in range(self.num_speculative_tokens))

    def policy(self, seed: int) -> tuple:
        """The scheduler's settings (SchedulerConfig.speculative)."""
        return self.method, self.num_speculative_tokens, self.rates, seed

    @property
    def expected_acceptance_length(self) -> float:
        """1 + the expected accepted drafts per step (vLLM's mean acceptance length)."""
        return 1 + sum(self.rates)


class DraftCost:
    """The drafter's device time per step. EAGLE/MTP: k forwards of a one-layer head of the target's
    shapes (the first over every token of the step, as vLLM's EagleProposer runs it on the target's
    hidden states, then one token per sequence), each with the LM head; a draft model: the same
    k forwards of the draft model; ngram: none (prompt lookup runs on the host, in numba)."""

    def __init__(self, spec: SpeculativeConfig, draft_model):
        self.k = spec.num_speculative_tokens
        self.model = draft_model            # a CostModel of the drafter, None for ngram

    @classmethod
    def for_scenario(cls, scenario, target) -> Optional["DraftCost"]:
        """The scenario's drafter, priced with the target's cost model class and device profile."""
        spec = scenario.engine.speculative
        if spec is None:
            return None
        if scenario.parallelism.dp > 1 and dp_ranks_in_lockstep(scenario.engine.vllm_version, scenario.model.is_moe):
            raise ScenarioError(["engine.speculative: not modelled for a data-parallel engine whose ranks step "
                                 "in lockstep (MoE, or dense before vLLM 0.14); set parallelism.dp: 1 or "
                                 "engine.speculative: null"])
        if spec.method == "ngram":
            return cls(spec, None)
        if spec.method in HEAD_METHODS:
            m = scenario.model
            head = m.model_copy(update={"num_layers": 1, "layer_types": m.layer_types[:1] if m.layer_types else None})
        else:
            head = ModelSpec(**catalog_entry("models", spec.model))
        e = scenario.engine
        drafter = type(target)(head, scenario.device, scenario.parallelism.tp, target.profile,
                               kv_cache_dtype=e.kv_cache_dtype, block_size=e.block_size)
        return cls(spec, drafter)

    def device_s(self, batch) -> float:
        """Seconds the drafter adds to a step's device time."""
        if self.model is None or not (batch.num_decode or batch.prefills):
            return 0.0
        rows = batch.num_decode + len(batch.prefills)
        price = self.model.price
        first = price(rows, batch.num_decode, batch.num_prefill_tokens + batch.spec_tokens, batch.decode_ctx,
                      batch.prefill_ctx, batch.prefill_attn + batch.spec_attn, batch.blocks_read)[1]
        if self.k == 1:
            return first
        later = price(rows, rows, 0, batch.decode_ctx + batch.prefill_ctx, 0, 0, batch.blocks_read)[1]
        return first + (self.k - 1) * later
