"""KV-cache memory arithmetic: bytes per token and per block, blocks from a memory budget.

Follows vLLM's sizing (docs/vllm_semantics.md section 1): the KV pool gets
device memory x gpu_memory_utilization minus weights, the activation peak of a profiling
forward at max_num_batched_tokens, and non-framework memory; whole blocks only; block 0
is the null block, so usable blocks = num_blocks - 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from sim.core import vllm_versions
from sim.core.catalog import MIB, ModelSpec, catalog_entry
from sim.core.lora import reserved_bytes as lora_reserved_bytes


class InsufficientMemoryError(ValueError):
    """The engine could not start: one max_model_len request does not fit in the KV pool."""


class BlockPoolUnsupportedError(ValueError):
    """A KV layout the simulated block pool cannot hold (sliding-window groups with contiguous allocation)."""


def check_block_pool_supports(model: ModelSpec, allocation: str = "paged") -> None:
    """Sliding-window and hybrid models run on the paged pool with one block table per KV cache group
    (sim/core/kv/coordinator.py HybridCoordinator); the contiguous (max-length reservation) baseline
    has no notion of freeing the blocks behind a window, so that pairing is refused by name."""
    if model.num_sliding_layers and allocation == "contiguous":
        raise BlockPoolUnsupportedError(
            f"model '{model.name}' has {model.num_sliding_layers} sliding-window layers "
            f"(sliding_window={model.sliding_window}) and engine.allocation is 'contiguous': a max-length "
            "reservation cannot free the blocks behind the window as vLLM's hybrid KV cache manager does. "
            "Use engine.allocation: paged, or set model.sliding_window: null to reserve as full attention.")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_heads_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """KV heads split across ranks; replicated (one per rank) when tp exceeds the KV heads."""
    return max(1, model.num_kv_heads // tp)


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_dtype_bytes(model: ModelSpec, kv_cache_dtype: str = "auto") -> int:
    """Bytes per cached K or V element: the model dtype (`auto`) or one byte (fp8).

    vLLM's fp8 KV cache keeps one fp32 scale for K and one for V per layer (per-tensor), a few
    bytes per layer in all, so the page is exactly half of bf16's.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype '{kv_cache_dtype}' is not one of {', '.join(KV_CACHE_DTYPES)}")
    return model.dtype_bytes if kv_cache_dtype == "auto" else 1


def kv_bytes_per_token_per_layer(model: ModelSpec, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """2 (K and V) x KV heads per rank x head_dim x KV dtype bytes: one layer's page per token."""
    return 2 * kv_heads_per_rank(model, tp) * model.head_dim * kv_dtype_bytes(model, kv_cache_dtype)


def kv_bytes_per_token(model: ModelSpec, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """2 (K and V) x layers x KV heads per rank x head_dim x dtype bytes, per GPU (every layer kept)."""
    return model.num_layers * kv_bytes_per_token_per_layer(model, tp, kv_cache_dtype)


def kv_bytes_per_block(model: ModelSpec, block_size: int, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    return kv_bytes_per_token(model, tp, kv_cache_dtype) * block_size


@dataclass(frozen=True)
class KVCacheGroups:
    """vLLM's hybrid KV cache manager: layers in equal-size groups, one block table per group.

    A uniform model is one group of all layers. A hybrid one (Gemma-2/3, gpt-oss) is split into
    groups of `group_size` layers of one attention type (the smaller type's layer count, or the
    larger one's when they are within 1.5x; the last group of a type padded), as vLLM's
    `_get_kv_cache_groups_uniform_page_size` does. Every group draws blocks from one shared pool,
    and a pool block holds one block of `group_size` layers, so a token costs one block slot per
    full-attention group, while a sliding group keeps only the blocks its window still reaches.
    """

    group_size: int
    full_groups: int
    sliding_groups: int
    sliding_window: int | None
    # vLLM orders the groups by each attention type's first layer: sliding ones first when layer
    # 0 is sliding (Gemma-2/3, gpt-oss). Sets which group allocates first and frees first.
    sliding_first: bool = False

    @property
    def is_hybrid(self) -> bool:
        return self.sliding_groups > 0

    @property
    def num_groups(self) -> int:
        return self.full_groups + self.sliding_groups

    def sliding_blocks_cap(self, block_size: int, max_new_tokens: int) -> int:
        """Most blocks a sliding group holds for one request (vLLM's SlidingWindowSpec
        max_memory_usage): the window minus one, the step's new tokens, and one more because the
        window need not start on a block boundary."""
        return blocks_for_tokens(self.sliding_window - 1 + max_new_tokens, block_size) + 1

    def blocks_per_request(self, num_tokens: int, block_size: int, max_new_tokens: int) -> int:
        """Blocks one request of `num_tokens` can hold at most (vLLM's max_memory_usage_bytes):
        full groups every block; sliding groups `sliding_blocks_cap`, as vLLM sizes it at startup."""
        full = blocks_for_tokens(num_tokens, block_size)
        if not self.sliding_groups:
            return self.full_groups * full
        window_tokens = min(self.sliding_window - 1 + max_new_tokens, num_tokens)
        sliding = blocks_for_tokens(window_tokens, block_size) + 1
        return self.full_groups * full + self.sliding_groups * sliding


def kv_cache_groups(model: ModelSpec) -> KVCacheGroups:
    sliding, full = model.num_sliding_layers, model.num_full_layers
    if not sliding or not full:    # one attention type: one group of every layer
        return KVCacheGroups(model.num_layers, int(full > 0), int(sliding > 0), model.sliding_window)
    size = min(sliding, full)
    if max(sliding, full) < 1.5 * size:
        size = max(sliding, full)
    sliding_first = model.layer_types is not None and model.layer_types[0] == "sliding_attention"
    return KVCacheGroups(size, cdiv(full, size), cdiv(sliding, size), model.sliding_window, sliding_first)


def pool_block_bytes(model: ModelSpec, block_size: int, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one pool block: block_size tokens of one KV cache group's layers (every layer for
    a uniform model; group_size layers for a hybrid one). vLLM's num_gpu_blocks = KV memory // this."""
    return kv_bytes_per_token_per_layer(model, tp, kv_cache_dtype) * kv_cache_groups(model).group_size * block_size


def sliding_window_skipped_blocks(num_computed: int, block_size: int, window: int) -> int:
    """Leading blocks a sliding-window layer no longer needs once `num_computed` tokens are computed:
    every block whose tokens all lie before num_computed - window + 1, the first token the next
    query can see (vLLM's SlidingWindowManager frees them: back to the pool, null in the table)."""
    return max(num_computed - window + 1, 0) // block_size


def sliding_window_blocks_kept(num_computed: int, block_size: int, window: int) -> int:
    """Blocks a sliding-window layer still holds for a request with `num_computed` tokens."""
    return blocks_for_tokens(num_computed, block_size) - sliding_window_skipped_blocks(num_computed, block_size,
                                                                                       window)


def sliding_window_hit_run(cached: list[bool], block_size: int, window: int) -> tuple[int, int]:
    """The prompt blocks [first, end) a sliding-window group takes from the prefix cache.

    `cached[i]`: is the prompt's i-th full block still cached for this group. A sliding layer
    needs only the last cdiv(window - 1, block_size) blocks before the first recomputed token, so
    vLLM's SlidingWindowManager.find_longest_cache_hit scans from the end for such a run of cached
    blocks (earlier blocks may have been freed as the window moved on; the hit's blocks before
    `first` are null); a run reaching block 0 counts even when shorter. (The scan is a search of
    the flags as bytes, at C speed: the last `need` cached blocks in a row, else the leading run.)
    """
    need = blocks_for_tokens(window - 1, block_size) or 1     # (a window of one token: the last cached block)
    flags = bytes(cached)
    first = flags.rfind(b"\x01" * need)
    if first >= 0:
        return first, first + need
    leading = flags.find(b"\x00")
    return 0, len(flags) if leading < 0 else leading     # a run from block 0 shorter than the window


def sliding_window_hit_blocks(cached: list[bool], block_size: int, window: int) -> int:
    """Leading blocks of a prompt a sliding-window group can take from the prefix cache
    (`sliding_window_hit_run`'s end). In a hybrid model the hit is the shorter of the
    full-attention hit and this one."""
    return sliding_window_hit_run(cached, block_size, window)[1]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return cdiv(num_tokens, block_size)


def unused_slots(num_tokens: int, block_size: int) -> int:
    """Slots allocated but not holding a token: the tail of the last block."""
    return blocks_for_tokens(num_tokens, block_size) * block_size - num_tokens


def slack_tokens(lengths: list[int], block_size: int) -> int:
    return sum(unused_slots(n, block_size) for n in lengths)


def weight_bytes_per_gpu(model: ModelSpec, tp: int = 1, dp: int = 1) -> int:
    """Attention, embeddings and dense parts split over tp; MoE experts over all tp x dp GPUs
    (vLLM's data parallel MoE: the experts form one tp x dp group, sliced or, with expert
    parallelism, spread whole; the bytes per GPU are the same)."""
    experts = model.part_bytes("experts") if model.is_moe else 0
    return cdiv(model.weight_bytes() - experts, tp) + cdiv(experts, tp * dp)


# vLLM's Marlin MoE kernel for mxfp4 experts needs n % 256 == 0 and k % 128 == 0, so the expert
# tensors are allocated padded: hidden size up to a multiple of 256, the intermediate size per
# partition up to a multiple of 128 (vllm/model_executor/layers/quantization/mxfp4.py, 0.11.0,
# Mxfp4MoEMethod.create_weights). Marlin is the backend wherever the GPU's compute capability is
# below 9 (get_mxfp4_backend); the catalog marks those parts by their lack of fp8 tensor cores
# (Ampere and older; Ada, capability 8.9, also runs Marlin but has fp8 and is not caught here).
# gpt-oss-120b: 2880 -> 3072 x 2880 -> 2944, 5.1 GiB more than the checkpoint on one GPU, as the
# Marlin load on an H100 logged it (vllm-project/vllm#23278: "Model loading took 65.9651 GiB"); at
# tp 4 on A100s, 17.15 GiB per GPU against the 17.22 dennislee22's log printed (startup_logs.yaml).
MARLIN_MXFP4_HIDDEN_MULTIPLE = 256
MARLIN_MXFP4_INTERMEDIATE_MULTIPLE = 128


def marlin_mxfp4_padding_bytes(model: ModelSpec, device, tp: int = 1, dp: int = 1) -> int:
    """Bytes per GPU that Marlin's padding adds to mxfp4 experts (0 where another backend runs).
    The experts are taken as sliced over tp x dp (whole under expert parallelism, where the
    intermediate size pads less: not told apart here, the plan does not know of it)."""
    q = model.quantization
    if not (model.is_moe and q is not None and q.method == "mxfp4") or getattr(device, "fp8_tflops", None):
        return 0
    hidden, inter = model.hidden_size, max(1, model.moe_intermediate_size // (tp * dp))
    padded = (cdiv(hidden, MARLIN_MXFP4_HIDDEN_MULTIPLE) * MARLIN_MXFP4_HIDDEN_MULTIPLE
              * cdiv(inter, MARLIN_MXFP4_INTERMEDIATE_MULTIPLE) * MARLIN_MXFP4_INTERMEDIATE_MULTIPLE)
    experts = cdiv(model.part_bytes("experts"), tp * dp)
    return experts * padded // (hidden * inter) - experts


def mlp_width_per_token(model: ModelSpec) -> int:
    """Intermediate activations one token computes: the dense MLP, or its top-k experts plus shared ones."""
    if not model.is_moe:
        return model.intermediate_size
    return model.num_experts_per_tok * model.moe_intermediate_size + model.shared_expert_intermediate_size


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
    inter = mlp_width_per_token(model) // tp
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
    # Hybrid KV cache groups (one group of every layer for full attention; see KVCacheGroups):
    # a pool block holds one block of group_size layers.
    kv_groups: KVCacheGroups | None = None
    max_num_batched_tokens: int = 0
    kv_cache_dtype: str = "auto"
    # vLLM's plan (memory_plan "vllm"): the budget is utilization x the torch-visible memory, and
    # non-torch memory and the CUDA-graph estimate come off it too (reserved_bytes is their sum).
    # The simple plan: visible = the datasheet memory, reserved = device.reserved_mib, both terms 0.
    memory_plan: str = "simple"
    vllm_version: str | None = None
    visible_bytes: int = 0
    non_torch_bytes: int = 0
    cudagraph_bytes: int = 0
    # LoRA (engine.lora): the stacked adapter buffers vLLM allocates with the weights (included in
    # weight_bytes, shown apart), 0 without LoRA.
    lora_bytes: int = 0

    @property
    def usable_blocks(self) -> int:
        return max(self.num_blocks - 1, 0)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def max_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens": num_blocks // KV cache groups x block_size, the
        null block counted (v1/core/kv_cache_utils.py _report_kv_cache_config; one slot fewer
        than that is usable)."""
        groups = self.kv_groups
        num_groups = 1 if groups is None else max(groups.full_groups + groups.sliding_groups, 1)
        return self.num_blocks // num_groups * self.block_size

    def longest_request_that_fits(self) -> int:
        """The largest request length whose blocks fit in the pool (vLLM's estimated max_model_len)."""
        lo, hi = 0, max(self.usable_blocks, 1) * self.block_size * 64
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_per_request(mid) <= self.usable_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def blocks_per_request(self, tokens_per_request: int) -> int:
        """Pool blocks one request of that many tokens can hold (over every KV cache group)."""
        if self.kv_groups is None:
            return blocks_for_tokens(tokens_per_request, self.block_size)
        return self.kv_groups.blocks_per_request(tokens_per_request, self.block_size,
                                                 self.max_num_batched_tokens)

    def max_concurrency(self, tokens_per_request: int) -> float:
        """vLLM's "Maximum concurrency for M tokens per request": worst case, every request at M."""
        return self.num_blocks / self.blocks_per_request(tokens_per_request)

    @property
    def predicted_peak_bytes(self) -> int:
        """Weights + activation peak + KV pool: what the framework allocator will hold."""
        return self.weight_bytes + self.activation_bytes + self.kv_pool_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.lora_bytes:            # (a plan without LoRA lists what it always listed)
            del d["lora_bytes"]
        d.update(usable_blocks=self.usable_blocks, max_tokens=self.max_tokens,
                 kv_pool_bytes=self.kv_pool_bytes, predicted_peak_bytes=self.predicted_peak_bytes)
        return d


def plan_memory(scenario, activation_scale: float | None = None) -> MemoryPlan:
    """The KV pool for a scenario's model, device, tp and engine settings.

    On GPU devices (engine.memory_plan "vllm", the default) vLLM's own plan (vllm_memory_plan);
    on the `cpu` device or with memory_plan "simple", the datasheet memory less weights, kvtwin's
    activation estimate and device.reserved_mib. A measured activation peak replaces either plan's
    estimate: engine.activation_mib, else kvtwin's estimate x `activation_scale` (a profile
    calibrated on kvtwin's own engine, which measured that peak and sized its pool with it).
    engine.num_blocks overrides the result.
    Raises InsufficientMemoryError, like an engine refusing to start, when not even one
    max_model_len request fits.
    """
    scenario = with_draft_head(scenario)
    eng = scenario.engine
    activation = _measured_activation(scenario, activation_scale)
    plan = _vllm_plan(scenario, activation) if uses_vllm_plan(scenario) else _simple_plan(scenario, activation)
    plan = _with_draft_model(plan, scenario)
    lora = getattr(eng, "lora", None)
    if lora is not None:
        plan = with_lora_buffers(plan, lora_reserved_bytes(scenario.model, lora.max_loras, lora.max_lora_rank,
                                                           scenario.parallelism.tp))
    if eng.kv_cache_memory_bytes is not None and eng.num_blocks is None:
        plan = _given_kv_memory(plan, eng.kv_cache_memory_bytes)
    if eng.num_blocks is not None:
        plan = replace(plan, num_blocks=eng.num_blocks, from_override=True)
    _check_one_request_fits(plan, scenario.max_model_len)
    return plan


def with_lora_buffers(plan: MemoryPlan, lora_bytes: int) -> MemoryPlan:
    """The plan with vLLM's LoRA buffers loaded beside the weights (LoRA-wrapped layers allocate
    them at model load, so the profile counts them as weights): they come off the KV budget."""
    budget = plan.kv_budget_bytes - lora_bytes
    return replace(plan, weight_bytes=plan.weight_bytes + lora_bytes, kv_budget_bytes=budget,
                   num_blocks=max(budget, 0) // plan.block_bytes, lora_bytes=lora_bytes)


# Speculative methods whose drafter is one decoder layer of the target's shapes (sim/speculative.py).
DRAFT_HEAD_METHODS = ("eagle", "eagle3", "mtp")


def with_draft_head(scenario):
    """The scenario as its memory plan sees it: with an EAGLE / EAGLE-3 / MTP drafter, one more
    full-attention decoder layer, whose weights load beside the target's (sharing its embedding and
    LM head) and whose KV shares the target's pool, as vLLM adds the drafter's attention layers to
    its KV cache config. (A draft model: `_with_draft_model`.)"""
    spec = getattr(scenario.engine, "speculative", None)
    if spec is None or spec.method not in DRAFT_HEAD_METHODS:
        return scenario
    m = scenario.model
    types = [*m.layer_types, "full_attention"] if m.layer_types else None
    return scenario.model_copy(update={"model": m.model_copy(update={"num_layers": m.num_layers + 1,
                                                                      "layer_types": types})})


def draft_model_spec(scenario) -> ModelSpec | None:
    """The draft model of `engine.speculative.method: draft_model` (a catalog entry), else None."""
    spec = getattr(scenario.engine, "speculative", None)
    if spec is None or spec.method != "draft_model":
        return None
    return ModelSpec(**catalog_entry("models", spec.model))


def _with_draft_model(plan: MemoryPlan, scenario) -> MemoryPlan:
    """A draft model loads beside the target on the same GPUs, at the target's tp by default
    (vLLM 0.19: DraftModelProposer.load_model in v1/spec_decode/draft_model.py, and
    config/speculative.py _verify_and_get_draft_tp): its weights come off the KV budget, and its
    attention layers join the target's in the KV cache config. Both being full attention of
    different hidden sizes, vLLM makes them one KV cache group whose block holds block_size tokens
    of every layer of both (v1/core/kv_cache_utils.py _get_kv_cache_groups_uniform_type,
    v1/kv_cache_interface.py UniformTypeKVCacheSpecs), so a block grows by the draft's bytes per
    token. (The drafter's profiling forward runs after the target's; its smaller peak is not added.)"""
    draft = draft_model_spec(scenario)
    if draft is None:
        return plan
    tp, dtype = scenario.parallelism.tp, scenario.engine.kv_cache_dtype
    weights = weight_bytes_per_gpu(draft, tp, scenario.parallelism.dp)
    per_token = kv_bytes_per_token(draft, tp, dtype)
    kv_budget = plan.kv_budget_bytes - weights
    block_bytes = plan.block_bytes + per_token * plan.block_size
    return replace(plan, weight_bytes=plan.weight_bytes + weights, kv_budget_bytes=kv_budget,
                   kv_bytes_per_token=plan.kv_bytes_per_token + per_token, block_bytes=block_bytes,
                   num_blocks=max(kv_budget, 0) // block_bytes)


def draft_model_problem(scenario) -> str | None:
    """Why the pool above does not describe the scenario's draft model, else None: the one-group
    block needs full attention in both models."""
    draft = draft_model_spec(scenario)
    if draft is None:
        return None
    hybrid = [m.name for m in (scenario.model, draft) if m.num_sliding_layers]
    if hybrid:
        return (f"engine.speculative.model: a draft model beside '{hybrid[0]}', which has sliding-window "
                f"layers, is not modelled (its KV cache groups would differ); use a full-attention "
                f"target and draft, or method eagle/eagle3/mtp")
    return None


def uses_vllm_plan(scenario) -> bool:
    """vLLM's plan sizes GPU pools; the `cpu` device (the engine's torch reference runs) keeps the simple one."""
    return scenario.engine.memory_plan == "vllm" and scenario.device.name != "cpu"


def _measured_activation(scenario, activation_scale: float | None) -> int | None:
    """The activation peak given or calibrated for the scenario; None leaves the plan's own estimate."""
    if scenario.engine.activation_mib is not None:
        return int(scenario.engine.activation_mib * MIB)
    if activation_scale is None:
        return None
    return kvtwin_activation_bytes(scenario, activation_scale)


def kvtwin_activation_bytes(scenario, scale: float = 1.0) -> int:
    """kvtwin's estimate of its own engine's profiling forward (max_num_batched_tokens tokens)."""
    tokens = scenario.max_num_batched_tokens
    rows = min(tokens, scenario.max_num_seqs)
    return activation_peak_bytes(scenario.model, tokens, rows, scenario.parallelism.tp, scale)


def _given_kv_memory(plan: MemoryPlan, kv_bytes: int) -> MemoryPlan:
    """--kv-cache-memory-bytes: vLLM skips its memory profile (the profile run still compiles) and
    sizes the pool from the given bytes alone, ignoring gpu_memory_utilization
    (v1/worker/gpu_worker.py determine_available_memory, 0.12-0.21)."""
    return replace(plan, kv_budget_bytes=kv_bytes, num_blocks=kv_bytes // plan.block_bytes, from_override=True)


def _simple_plan(scenario, activation: int | None) -> MemoryPlan:
    model, device, eng = scenario.model, scenario.device, scenario.engine
    tp, dp = scenario.parallelism.tp, scenario.parallelism.dp
    budget = int(device.memory_bytes * eng.gpu_memory_utilization)
    weights = weight_bytes_per_gpu(model, tp, dp)
    if activation is None:
        activation = kvtwin_activation_bytes(scenario)
    reserved = device.reserved_bytes
    kv_budget = budget - weights - activation - reserved
    block_bytes = pool_block_bytes(model, eng.block_size, tp, eng.kv_cache_dtype)
    return MemoryPlan(device.memory_bytes, eng.gpu_memory_utilization, budget, weights, activation,
                      reserved, kv_budget, kv_bytes_per_token(model, tp, eng.kv_cache_dtype),
                      eng.block_size, block_bytes, max(kv_budget, 0) // block_bytes, False,
                      kv_cache_groups(model), scenario.max_num_batched_tokens, eng.kv_cache_dtype,
                      visible_bytes=device.memory_bytes)


def _vllm_plan(scenario, activation: int | None) -> MemoryPlan:
    model, device, eng = scenario.model, scenario.device, scenario.engine
    tp = scenario.parallelism.tp
    v = vllm_memory_plan(model, device, tp, eng.gpu_memory_utilization, scenario.max_num_batched_tokens,
                         scenario.max_num_seqs, eng.block_size, eng.vllm_version, eng.kv_cache_dtype,
                         dp=scenario.parallelism.dp, activation_bytes=activation,
                         enforce_eager=eng.enforce_eager, estimate_cudagraphs=eng.estimate_cudagraph_memory)
    return MemoryPlan(device.memory_bytes, eng.gpu_memory_utilization, v.requested_bytes, v.weight_bytes,
                      v.activation_bytes, v.non_torch_bytes + v.cudagraph_bytes, v.kv_budget_bytes,
                      kv_bytes_per_token(model, tp, eng.kv_cache_dtype), eng.block_size, v.block_bytes,
                      v.num_blocks, False, kv_cache_groups(model), scenario.max_num_batched_tokens,
                      eng.kv_cache_dtype, memory_plan="vllm", vllm_version=eng.vllm_version,
                      visible_bytes=v.visible_bytes, non_torch_bytes=v.non_torch_bytes,
                      cudagraph_bytes=v.cudagraph_bytes)


def _check_one_request_fits(plan: MemoryPlan, max_model_len: int) -> None:
    need_blocks = plan.blocks_per_request(max_model_len)
    if need_blocks <= plan.usable_blocks:
        return
    mib = lambda b: f"{b / MIB:,.1f} MiB"  # noqa: E731
    have = plan.usable_blocks * plan.block_bytes
    if not plan.from_override:                 # a negative KV budget is part of the shortfall
        have = min(have, plan.kv_budget_bytes)
    short = need_blocks * plan.block_bytes - have
    fits = plan.longest_request_that_fits()
    if plan.from_override:
        cause = f"engine.num_blocks (or kv_cache_memory_bytes) gives {plan.usable_blocks} usable blocks"
    elif plan.memory_plan == "vllm":
        cause = (f"vLLM {plan.vllm_version}'s plan per GPU: {mib(plan.budget_bytes)} budget ({plan.utilization:g} x "
                 f"{mib(plan.visible_bytes)} torch-visible) - {mib(plan.weight_bytes)} weights "
                 f"- {mib(plan.activation_bytes)} profiling-run activation peak - {mib(plan.non_torch_bytes)} "
                 f"non-torch - {mib(plan.cudagraph_bytes)} CUDA graphs leaves "
                 f"{mib(plan.kv_budget_bytes)} for KV = {plan.usable_blocks} usable blocks")
    else:
        cause = (f"per GPU: {mib(plan.budget_bytes)} budget ({plan.utilization:g} x {mib(plan.device_bytes)}) "
                 f"- {mib(plan.weight_bytes)} weights - {mib(plan.activation_bytes)} activations "
                 f"- {mib(plan.reserved_bytes)} reserved leaves {mib(plan.kv_budget_bytes)} "
                 f"for KV = {plan.usable_blocks} usable blocks")
    raise InsufficientMemoryError(
        f"max_model_len {max_model_len} needs {need_blocks} blocks of {plan.block_size} tokens "
        f"({mib(need_blocks * plan.block_bytes)}) but {cause}: short by {mib(short)} per GPU. "
        + _memory_advice(plan, fits))


def _memory_advice(plan: MemoryPlan, fits: int) -> str:
    """What could work, first: with the weights (nearly) filling the budget, only more GPUs help."""
    more_gpus = "raise parallelism.tp (more GPUs share the weights; `simrun plan --tp`)"
    if not plan.from_override and plan.kv_budget_bytes <= 0:
        over = plan.weight_bytes - plan.budget_bytes
        what = (f"The weights alone exceed the per-GPU budget by {over / MIB:,.1f} MiB" if over > 0
                else "The weights and activations leave no memory for KV")
        return f"{what}: {more_gpus}, or use a quantized model (fp8 weights)."
    head = f"The largest max_model_len that fits is {fits}" if fits else "Not even one block fits"
    return (f"{head}; lower engine.max_model_len, raise engine.gpu_memory_utilization, shrink "
            f"max_num_batched_tokens, or {more_gpus}.")


# ----------------------------------------------------------------------------- vLLM's own plan

GIB = 1024 ** 3
# What torch.cuda.mem_get_info reports as total (vLLM's "Free memory on device (free/total GiB)")
# is below the datasheet figure: the driver's own reservation. The device catalog's `visible_mib`
# holds it where a public startup log printed it; other parts lose what an H100 80GB loses.
DRIVER_RESERVE_GIB = 0.46       # datasheet - visible on an H100 80GB; used for parts without visible_mib


@dataclass(frozen=True)
class VllmMemory:
    """vLLM's KV sizing for one GPU, term by term, in bytes (docs/vllm_semantics.md section 1)."""

    visible_bytes: int          # torch-visible total, below the datasheet figure
    requested_bytes: int        # gpu_memory_utilization x visible
    weight_bytes: int
    activation_bytes: int       # torch peak of the profiling forward + dummy sampler
    non_torch_bytes: int        # CUDA context, cuBLAS workspaces, NCCL / custom all-reduce buffers
    cudagraph_bytes: int        # subtracted from the budget only from vLLM 0.20 on (and not eager)
    kv_budget_bytes: int
    block_bytes: int
    num_blocks: int             # vLLM's num_gpu_blocks (the null block included)
    block_size: int

    @property
    def kv_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens" for full-attention models."""
        return self.num_blocks * self.block_size


# '0.19.0' -> (0, 19); None -> the default version (sim/core/vllm_versions.py)
parse_vllm_version = vllm_versions.parse_version


def vllm_visible_bytes(device) -> int:
    if device.visible_mib is not None:
        return int(device.visible_mib * MIB)
    return int((device.memory_bytes / GIB - DRIVER_RESERVE_GIB) * GIB)


def vllm_activation_bytes(model: ModelSpec, num_tokens: int, num_rows: int, tp: int = 1,
                          version: tuple[int, int] = (0, 19)) -> int:
    """Torch peak of vLLM's profiling run: a forward over max_num_batched_tokens, then the dummy
    sampler over one fp32 logits row per sequence (max_num_seqs rows).

    V1 with torch.compile and CUDA graphs: the live set is small and does not shrink with tp:
    ~19.5 K elements of workspace and ~1.3 hidden states per token, and the sampler's fp32 logits
    rows, as many copies as the release's top-k/top-p path keeps alive (sampler_logits_copies).
    Least-squares fit to the printed `peak activation` of the H100 0.19 sweep (CodeLlama-7B,
    Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B, Qwen2.5-72B: within 0.03 GiB each) and checked on the A100
    0.10 runs' budgets."""
    s = model.dtype_bytes
    copies = sampler_logits_copies(version)
    return int(num_tokens * s * (19_500 + 1.33 * model.hidden_size)
               + copies * num_rows * model.vocab_size * 4
               + num_tokens * s * moe_workspace_per_token(model, tp))


# fp32 logits rows (rows x vocab x 4 bytes) alive at the dummy sampler's peak, by the top-k/top-p path
# vLLM's TopKTopPSampler takes (v1/sample/ops/topk_topp_sampler.py) with the dummy run's top_k and
# top_p both set (v1/worker/gpu_model_runner.py _dummy_sampler_run):
SAMPLER_COPIES_V010 = 1.0      # before 0.11 (fit to the A100 0.10 logs; FlashInfer sampled when installed)
SAMPLER_COPIES = 3.15          # 0.11 (FlashInfer) and from 0.17 the in-place Triton kernel (fit to H100 0.19)
# 0.12-0.16: apply_top_k_top_p sorts the rows (logits.sort): alive at the sort are the model's bf16
# logits (0.5), the fp32 copy (1), the sorted values (1) and int64 indices (2), and the sort's own
# buffers (the int64 source indices and CUB's alternate key and value buffers: 2 + 1 + 2 = 5).
SAMPLER_COPIES_SORT = 9.5


def sampler_logits_copies(version: tuple[int, int]) -> float:
    if version < (0, 11):
        return SAMPLER_COPIES_V010
    if vllm_versions.has(f"{version[0]}.{version[1]}", "sampler_sorts_top_k_top_p"):
        return SAMPLER_COPIES_SORT
    return SAMPLER_COPIES


def moe_workspace_per_token(model: ModelSpec, tp: int = 1) -> int:
    """vLLM's fused-MoE kernel keeps one workspace of top_k x max(w1 outputs, hidden) elements per
    token (w1 = gate and up: 2 x the expert width, split over tp). 0 for a dense model.
    Matches the printed peaks of Qwen3-30B-A3B (tp 1) and Mixtral-8x7B (tp 2) in the 0.19 logs."""
    if not getattr(model, "num_experts", 0):
        return 0
    width = getattr(model, "moe_intermediate_size", None) or model.intermediate_size
    return model.num_experts_per_tok * max(2 * width // tp, model.hidden_size)


def vllm_non_torch_bytes(tp: int, version: tuple[int, int] = (0, 19)) -> int:
    """Memory outside torch's allocator that grew since startup: ~0.25 GiB on one GPU; with tp,
    NCCL and (from 0.11 on) the custom all-reduce's IPC buffers add ~1.8 GiB (0.19 logs: 2.06-2.21
    GiB at tp 2-4; 0.10 logs: ~0.38 GiB at tp 2)."""
    if tp == 1:
        return int(0.25 * GIB)
    if version < (0, 11):
        return int(0.38 * GIB)
    return int((1.98 + 0.0475 * tp) * GIB)


def vllm_cudagraph_bytes(model: ModelSpec, version: tuple[int, int] = (0, 19), enforce_eager: bool = False,
                         estimate: bool | None = None) -> int:
    """The graph pool vLLM estimates (profile_cudagraph_memory) and subtracts before sizing the KV
    cache when VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is on (`estimate`; None: the release's
    default, "0" up to 0.19 and "1" from 0.20 in envs.py). Off, graphs are captured afterwards, in
    the (1 - utilization) slack, and do not change num_blocks. --enforce-eager captures none
    (cudagraph_mode NONE): nothing to subtract. ~26 MiB per layer for the default 51 PIECEWISE +
    51 FULL captures (0.19 logs print the estimate: 0.84 GiB for a 32-layer 7B)."""
    if estimate is None:
        estimate = vllm_versions.has(f"{version[0]}.{version[1]}", "cudagraph_estimate_in_plan")
    if enforce_eager or not estimate:
        return 0
    return int(0.84 / 32 * model.num_layers * GIB)


def vllm_memory_plan(model: ModelSpec, device, tp: int, gpu_memory_utilization: float,
                     max_num_batched_tokens: int, max_num_seqs: int, block_size: int = 16,
                     vllm_version: str | None = None, kv_cache_dtype: str = "auto", dp: int = 1,
                     activation_bytes: int | None = None, enforce_eager: bool = False,
                     estimate_cudagraphs: bool | None = None) -> VllmMemory:
    """num_gpu_blocks as vLLM's V1 worker derives it:
    floor((util x visible - weights - activation peak - non-torch - graph estimate) / block bytes),
    the block being one KV cache group's layers (pool_block_bytes: fp8 KV, hybrid groups).
    `activation_bytes`, when given, replaces the estimated profiling-run peak (a measured one);
    `estimate_cudagraphs` is VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS (None: the release's default)."""
    version = parse_vllm_version(vllm_version)
    visible = vllm_visible_bytes(device)
    requested = int(visible * gpu_memory_utilization)
    weights = weight_bytes_per_gpu(model, tp, dp) + marlin_mxfp4_padding_bytes(model, device, tp, dp)
    activation = activation_bytes
    if activation is None:
        rows = min(max_num_batched_tokens, max_num_seqs)
        activation = vllm_activation_bytes(model, max_num_batched_tokens, rows, tp, version)
    non_torch = vllm_non_torch_bytes(tp, version)
    graphs = vllm_cudagraph_bytes(model, version, enforce_eager, estimate_cudagraphs)
    budget = requested - weights - activation - non_torch - graphs
    block = pool_block_bytes(model, block_size, tp, kv_cache_dtype)
    return VllmMemory(visible, requested, weights, activation, non_torch, graphs, budget, block,
                      max(budget, 0) // block, block_size)
