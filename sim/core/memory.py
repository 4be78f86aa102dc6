"""KV-cache memory arithmetic: bytes per token and per block, blocks from a memory budget.

Follows vLLM's sizing (research/VLLM_SEMANTICS.md section 1): the KV pool gets
device memory x gpu_memory_utilization minus weights, the activation peak of a profiling
forward at max_num_batched_tokens, and non-framework memory; whole blocks only; block 0
is the null block, so usable blocks = num_blocks - 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from sim.core.catalog import MIB, ModelSpec


class InsufficientMemoryError(ValueError):
    """The engine could not start: one max_model_len request does not fit in the KV pool."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_heads_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """KV heads split across ranks; replicated (one per rank) when tp exceeds the KV heads."""
    return max(1, model.num_kv_heads // tp)


def kv_bytes_per_token(model: ModelSpec, tp: int = 1) -> int:
    """2 (K and V) x layers x KV heads per rank x head_dim x dtype bytes, per GPU."""
    return 2 * model.num_layers * kv_heads_per_rank(model, tp) * model.head_dim * model.dtype_bytes


def kv_bytes_per_block(model: ModelSpec, block_size: int, tp: int = 1) -> int:
    return kv_bytes_per_token(model, tp) * block_size


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return cdiv(num_tokens, block_size)


def unused_slots(num_tokens: int, block_size: int) -> int:
    """Slots allocated but not holding a token: the tail of the last block."""
    return blocks_for_tokens(num_tokens, block_size) * block_size - num_tokens


def slack_tokens(lengths: list[int], block_size: int) -> int:
    return sum(unused_slots(n, block_size) for n in lengths)


def weight_bytes_per_gpu(model: ModelSpec, tp: int = 1) -> int:
    return cdiv(model.weight_bytes(), tp)


def activation_peak_bytes(model: ModelSpec, num_tokens: int, num_rows: int, tp: int = 1,
                          scale: float = 1.0) -> int:
    """Estimated peak activation memory of one forward over `num_tokens` tokens.

    The live set at the MLP peak of an unfused torch layer: residual, normed input,
    q/k/v and attention output, gate/up (2 x intermediate) and the activated product;
    plus fp32 logits and probabilities for the `num_rows` sampled rows. `scale` is the
    calibrated correction (validate/calibrate.py measures the real peak).
    """
    d = model.head_dim
    q = model.num_heads // tp * d
    kv = kv_heads_per_rank(model, tp) * d
    inter = model.intermediate_size // tp
    per_token = (2 * model.hidden_size + q + 2 * kv + q + 3 * inter) * model.dtype_bytes
    logits = num_rows * model.vocab_size * 4 * 2
    return int(scale * num_tokens * per_token) + logits


@dataclass(frozen=True)
class MemoryPlan:
    """Where one GPU's memory goes, in bytes, and the KV pool that results."""

    device_bytes: int
    utilization: float
    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    reserved_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    block_size: int
    block_bytes: int
    num_blocks: int          # pool size, including the null block
    from_override: bool      # num_blocks given in the scenario rather than derived

    @property
    def usable_blocks(self) -> int:
        return max(self.num_blocks - 1, 0)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def max_tokens(self) -> int:
        """Tokens the pool holds at once (vLLM's "GPU KV cache size: N tokens")."""
        return self.usable_blocks * self.block_size

    def max_concurrency(self, tokens_per_request: int) -> float:
        """vLLM's "Maximum concurrency for M tokens per request": worst case, every request at M."""
        return self.num_blocks / blocks_for_tokens(tokens_per_request, self.block_size)

    @property
    def predicted_peak_bytes(self) -> int:
        """Weights + activation peak + KV pool: what the framework allocator will hold."""
        return self.weight_bytes + self.activation_bytes + self.kv_pool_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(usable_blocks=self.usable_blocks, max_tokens=self.max_tokens,
                 kv_pool_bytes=self.kv_pool_bytes, predicted_peak_bytes=self.predicted_peak_bytes)
        return d


def plan_memory(scenario, activation_scale: float | None = None) -> MemoryPlan:
    """The KV pool for a scenario's model, device, tp and engine settings.

    Raises InsufficientMemoryError, like an engine refusing to start, when not even one
    max_model_len request fits.
    """
    model, device, eng = scenario.model, scenario.device, scenario.engine
    tp = scenario.parallelism.tp
    per_token = kv_bytes_per_token(model, tp)
    block_bytes = per_token * eng.block_size
    budget = int(device.memory_bytes * eng.gpu_memory_utilization)
    weights = weight_bytes_per_gpu(model, tp)
    if eng.activation_mib is not None:
        activation = int(eng.activation_mib * MIB)
    else:
        tokens = scenario.max_num_batched_tokens
        rows = min(tokens, scenario.max_num_seqs)
        activation = activation_peak_bytes(model, tokens, rows, tp, activation_scale or 1.0)
    reserved = device.reserved_bytes
    kv_budget = budget - weights - activation - reserved
    if eng.num_blocks is not None:
        num_blocks = eng.num_blocks
    else:
        num_blocks = max(kv_budget, 0) // block_bytes
    plan = MemoryPlan(device.memory_bytes, eng.gpu_memory_utilization, budget, weights, activation,
                      reserved, kv_budget, per_token, eng.block_size, block_bytes, int(num_blocks),
                      eng.num_blocks is not None)
    _check_one_request_fits(plan, scenario.max_model_len)
    return plan


def _check_one_request_fits(plan: MemoryPlan, max_model_len: int) -> None:
    need_blocks = blocks_for_tokens(max_model_len, plan.block_size)
    if need_blocks <= plan.usable_blocks:
        return
    mib = lambda b: f"{b / MIB:,.1f} MiB"  # noqa: E731
    short = (need_blocks - plan.usable_blocks) * plan.block_bytes
    fits = plan.max_tokens
    advice = (f"The largest max_model_len that fits is {fits}" if fits else "Not even one block fits")
    if plan.from_override:
        cause = f"engine.num_blocks={plan.num_blocks} gives {plan.usable_blocks} usable blocks"
    else:
        cause = (f"{mib(plan.budget_bytes)} budget ({plan.utilization:g} x {mib(plan.device_bytes)}) "
                 f"- {mib(plan.weight_bytes)} weights - {mib(plan.activation_bytes)} activations "
                 f"- {mib(plan.reserved_bytes)} reserved leaves {mib(max(plan.kv_budget_bytes, 0))} "
                 f"for KV = {plan.usable_blocks} usable blocks")
    raise InsufficientMemoryError(
        f"max_model_len {max_model_len} needs {need_blocks} blocks of {plan.block_size} tokens "
        f"({mib(need_blocks * plan.block_bytes)}) but {cause}: short by {mib(short)}. "
        f"{advice}; lower engine.max_model_len, raise "
        f"engine.gpu_memory_utilization, shrink max_num_batched_tokens, or raise parallelism.tp.")
