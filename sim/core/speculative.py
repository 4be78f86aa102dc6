"""Speculative decoding as vLLM V1's scheduler runs it (vllm/v1/core/sched/scheduler.py, main @00024d31,
the same rules in 0.19): no clock here, only tokens and draws.

- A running request that decodes carries the `k` draft tokens proposed after its last step, so it
  schedules 1 + k tokens (`num_tokens_with_spec - num_computed_tokens`), counted in the token
  budget and kept below max_model_len (`max_model_len - 1 - num_computed_tokens`); a budget that
  cuts it short drops the drafts that do not fit.
- Every running request it schedules also gets `num_lookahead_tokens` KV slots past its tokens
  (allocate_slots(..., num_lookahead_tokens)): k for EAGLE-type and draft-model methods, 0 for ngram
  (the Scheduler's __init__); the lookahead never passes max_model_len.
- After the step (update_from_output), `accepted` of the `drafted` tokens were accepted and the
  rest rejected: num_computed_tokens goes back by the rejected count (their slots stay allocated
  and are overwritten by the next step's tokens) and the request gains accepted + 1 output tokens,
  cut at its max tokens.

The accepted length is drawn from vLLM's per-position acceptance rates (spec_decode/metrics.py:
rate[i] = the share of drafts whose position i was accepted, so rates never increase): one uniform
number u per draft, position i accepted while u < rate[i]. u is a hash of (seed, request, output
position): a dedicated stream, so no other draw moves, and a request's acceptance at a given output
position does not depend on what else runs with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sim.core.request import stable_key

# Methods whose drafter needs KV slots for its own lookahead (Scheduler.__init__: use_eagle() or
# uses_draft_model(); vllm/config/speculative.py EagleModelTypes: eagle, eagle3, the MTP family).
LOOKAHEAD_METHODS = ("eagle", "eagle3", "mtp", "draft_model")
_UNIT = float(1 << 63)


@dataclass
class SpecStats:
    """vLLM's spec-decode counters (SpecDecodingStats): drafts, draft tokens, accepted tokens,
    accepted per position."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def add(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]

    def summary(self) -> dict:
        """vLLM's figures (SpecDecodingLogging.log): draft acceptance rate = accepted / drafted,
        mean acceptance length = 1 + accepted / drafts (the bonus token included), per-position
        rates = accepted at position i / drafts."""
        drafts = self.num_drafts
        return {
            "num_drafts": drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
            "mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else None,
            "per_position_acceptance": [n / drafts for n in self.accepted_per_pos] if drafts else None,
        }


class SpecDecoder:
    """One replica's speculative decoding: how many drafts a decode carries, its lookahead slots,
    and the verification of a step's drafts."""

    def __init__(self, method: str, num_spec_tokens: int, rates: tuple, seed: int):
        if not rates or len(rates) != num_spec_tokens:
            raise ValueError(f"{len(rates)} acceptance rates for {num_spec_tokens} speculative tokens")
        if any(b > a for a, b in zip(rates, rates[1:])):
            raise ValueError(f"acceptance rates {list(rates)} increase; vLLM's per-position rates cannot")
        self.method = method
        self.k = num_spec_tokens
        self.rates = tuple(float(r) for r in rates)
        self.lookahead = num_spec_tokens if method in LOOKAHEAD_METHODS else 0
        self.seed = seed
        self.stats = SpecStats(num_spec_tokens)

    def accepted(self, req_id: int, position: int, drafted: int) -> int:
        """Drafts accepted of `drafted`, for the draft verified at output position `position`."""
        u = stable_key("speculative", self.seed, req_id, position) / _UNIT
        n = 0
        rates = self.rates
        while n < drafted and u < rates[n]:
            n += 1
        return n

    def settle(self, batch) -> int:
        """Verify the step's drafts (before its tokens are emitted): each request's rejected tokens
        leave num_computed, and its accepted ones are added to its output (the bonus token is the
        one `Request.emit` adds), cut at its max tokens. Returns the tokens rolled back."""
        rolled_back = 0
        stats = self.stats
        for req, drafted in batch.spec_drafts.items():
            accepted = self.accepted(req.id, req.num_output, drafted)
            stats.observe(drafted, accepted)
            rejected = drafted - accepted
            req.num_computed -= rejected
            rolled_back += rejected
            req.num_output += min(accepted, req.output_len - req.num_output - 1)
        return rolled_back


def speculative_meta(schedulers) -> dict:
    """{"speculative": vLLM's spec-decode figures over the replicas} for a run's records, or {} without
    speculative decoding (so a run without it records nothing new)."""
    decoders = [s.spec for s in schedulers if s.spec is not None]
    if not decoders:
        return {}
    total = SpecStats(decoders[0].k)
    for d in decoders:
        total.add(d.stats)
    return {"speculative": {"method": decoders[0].method, "num_speculative_tokens": decoders[0].k,
                            **total.summary()}}


class SpecScheduling:
    """The scheduler's part (a mixin `make_scheduler` puts in front of the reference
    Scheduler): a decode asks for its drafts too, its slots come with the lookahead, and the step's
    drafts are verified before its tokens are emitted. The fast paths assume one token a step, so
    the decode cohort (and with it leaps) is off."""

    __slots__ = ()
    state = ()

    def __init__(self, config, kv, offload=None):
        super().__init__(config, kv, offload)
        self.spec = SpecDecoder(*config.speculative)
        self.lazy = False

    def num_new_tokens(self, req, budget: int):
        n = req.num_tokens - req.num_computed
        if n == 1 and req.num_output:      # a decode carries its drafts
            n = min(1 + self.spec.k, self.config.max_model_len - 1 - req.num_computed)
        return self._chunk(req, n, budget)

    def _schedule_tokens(self, req, n: int, batch, budget: int) -> int:
        """The slots come with the lookahead (never past max_model_len), and a decode carrying
        drafts goes in as one (Batch.add_spec)."""
        lookahead = min(self.spec.lookahead, self.config.max_model_len - req.num_computed - n)
        if not self.kv.append_slots(req, n, lookahead):
            fits = self._preempt_until_fits(req, n, batch, lookahead)
            budget += self._take_returned()
            if not fits:
                return budget              # it preempted itself
        if n > 1 and req.num_output and req.num_computed + 1 == req.num_tokens:
            batch.add_spec(req, n, self.block_size)                # a decode verifying n - 1 drafts
        else:
            batch.add(req, n, self.block_size)
        return budget - n

    def finish_step(self, batch):
        if batch.spec_drafts:              # rejected drafts roll back, accepted ones count
            self.tokens_held -= self.spec.settle(batch)
        return super().finish_step(batch)
