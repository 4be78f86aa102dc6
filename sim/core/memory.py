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


# ----------------------------------------------------------------------------- vLLM's own plan

GIB = 1024 ** 3
# What torch.cuda.mem_get_info reports as total (vLLM's "Free memory on device (free/total GiB)"),
# below the datasheet figure: the driver's own reservation. From public startup logs
# (tests/data/vllm_public/startup_logs.yaml) where printed, else the parts' well-known totals.
VISIBLE_GIB = {"h100-sxm": 79.19, "a100-80g": 79.15, "a100-40g": 39.39, "rtx-4090": 23.64, "rtx-3090": 23.58}
DRIVER_RESERVE_GIB = 0.46       # datasheet - visible on an H100 80GB; used for parts not listed


@dataclass(frozen=True)
class VllmMemory:
    """vLLM's KV sizing for one GPU, term by term, in bytes (research/VLLM_SEMANTICS.md section 1)."""

    visible_bytes: int          # torch-visible total, below the datasheet figure
    requested_bytes: int        # gpu_memory_utilization x visible
    weight_bytes: int
    activation_bytes: int       # torch peak of the profiling forward + dummy sampler
    non_torch_bytes: int        # CUDA context, cuBLAS workspaces, NCCL / custom all-reduce buffers
    cudagraph_bytes: int        # subtracted from the budget only from vLLM 0.21 on
    kv_budget_bytes: int
    block_bytes: int
    num_blocks: int             # vLLM's num_gpu_blocks (the null block included)
    block_size: int

    @property
    def kv_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens" for full-attention models."""
        return self.num_blocks * self.block_size


def parse_vllm_version(version: str | None) -> tuple[int, int]:
    """'0.19.0' -> (0, 19); None -> the version these terms were last checked against."""
    if not version:
        return (0, 19)
    parts = [int(p) for p in str(version).lstrip("v").split(".")[:2] if p.isdigit()]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def vllm_visible_bytes(device) -> int:
    gib = VISIBLE_GIB.get(device.name)
    if gib is None:
        gib = device.memory_bytes / GIB - DRIVER_RESERVE_GIB
    return int(gib * GIB)


def vllm_activation_bytes(model: ModelSpec, num_tokens: int, num_rows: int, tp: int = 1,
                          version: tuple[int, int] = (0, 19)) -> int:
    """Torch peak of vLLM's profiling run: a forward over max_num_batched_tokens, then the dummy
    sampler over one fp32 logits row per sequence (max_num_seqs rows).

    V1 with torch.compile and CUDA graphs: the live set is small and does not shrink with tp:
    ~19.5 K elements of workspace and ~1.3 hidden states per token, and the sampler's fp32 logits
    (~3 copies: logits, probabilities, temporaries, in 0.19; one in 0.10). Least-squares fit to
    the printed `peak activation` of the H100 0.19 sweep (CodeLlama-7B, Llama-3.1-8B, Qwen2.5-7B,
    Qwen3-8B, Qwen2.5-72B: within 0.03 GiB each) and checked on the A100 0.10 runs' budgets."""
    s = model.dtype_bytes
    logits_copies = 1.0 if version < (0, 11) else 3.15
    return int(num_tokens * s * (19_500 + 1.33 * model.hidden_size)
               + logits_copies * num_rows * model.vocab_size * 4)


def vllm_non_torch_bytes(tp: int, version: tuple[int, int] = (0, 19)) -> int:
    """Memory outside torch's allocator that grew since startup: ~0.25 GiB on one GPU; with tp,
    NCCL and (from 0.11 on) the custom all-reduce's IPC buffers add ~1.8 GiB (0.19 logs: 2.06-2.21
    GiB at tp 2-4; 0.10 logs: ~0.38 GiB at tp 2)."""
    if tp == 1:
        return int(0.25 * GIB)
    if version < (0, 11):
        return int(0.38 * GIB)
    return int((1.98 + 0.0475 * tp) * GIB)


def vllm_cudagraph_bytes(model: ModelSpec, version: tuple[int, int] = (0, 19)) -> int:
    """The graph pool vLLM >= 0.21 estimates and subtracts before sizing the KV cache (before, graphs
    were captured afterwards, in the (1 - utilization) slack, and did not change num_blocks).
    ~26 MiB per layer for the default 51 PIECEWISE + 51 FULL captures (0.19 logs print the
    estimate: 0.84 GiB for a 32-layer 7B)."""
    if version < (0, 21):
        return 0
    return int(0.84 / 32 * model.num_layers * GIB)


def vllm_memory_plan(model: ModelSpec, device, tp: int, gpu_memory_utilization: float,
                     max_num_batched_tokens: int, max_num_seqs: int, block_size: int = 16,
                     vllm_version: str | None = None, kv_bytes_per_token_override: int | None = None) -> VllmMemory:
    """num_gpu_blocks as vLLM's V1 worker derives it:
    floor((util x visible - weights - activation peak - non-torch - graph estimate) / block bytes)."""
    version = parse_vllm_version(vllm_version)
    visible = vllm_visible_bytes(device)
    requested = int(visible * gpu_memory_utilization)
    weights = weight_bytes_per_gpu(model, tp)
    rows = min(max_num_batched_tokens, max_num_seqs)
    activation = vllm_activation_bytes(model, max_num_batched_tokens, rows, tp, version)
    non_torch = vllm_non_torch_bytes(tp, version)
    graphs = vllm_cudagraph_bytes(model, version)
    budget = requested - weights - activation - non_torch - graphs
    per_token = kv_bytes_per_token_override or kv_bytes_per_token(model, tp)
    block = per_token * block_size
    return VllmMemory(visible, requested, weights, activation, non_torch, graphs, budget, block,
                      max(budget, 0) // block, block_size)
