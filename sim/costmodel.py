"""Step time from a batch's composition: host overhead plus a roofline per layer group.

    step = host + device
    host   = graph_launch_s + exposed scheduler host time + exposed output time (+ wake_s on the
             first step after the engine sat idle: cold caches and clocks; calibration measures it)
      scheduler host = step_host_s + seq_host_s x sequences + prefill_seq_host_s x prefill sequences
                       + token_host_s x tokens; all of it synchronously, only its excess over the
                       device time with async scheduling (vLLM >= 0.14 on a GPU: Scenario.async_scheduling)
      output         = (detok_token_s + api_token_s) x sequences, in the API server's process:
                       only its excess over the engine's step shows
    device = step_device_s + layers x (layer_overhead_s
                 + max(linear FLOPs / (peak x flops_eff), weight bytes / (bw x bw_eff))
                 + max(attention FLOPs / (peak x attn_flops_eff), KV bytes / (bw x attn_bw_eff))
                 + blocks walked x block_overhead_s
                 + prefill sequences x prefill_seq_overhead_s
                 + tp all-reduce)
             + max(LM-head FLOPs, LM-head bytes) + sampling bytes + sample_seq_s x sequences

Quantized weights change the bytes read and the GEMM peak (gemm_peak_flops); an MoE layer adds
max(routed FLOPs, bytes of the experts the batch touches) and the dp / ep token exchange
(moe_layer_time); sliding-window layers read at most the window (attention_time).

Linear layers read their weights once per step whatever the batch, so small batches are
bandwidth-bound and large ones compute-bound. Attention reads each sequence's KV (decode)
or computes causal scores over new tokens against their context (prefill); the per-block
term is the cost of walking block tables, which is what makes a small block size slower.
Coefficients are datasheet peaks times default efficiencies, or a calibrated profile
(validate/calibrate.py fits them against the real engine and writes the YAML loaded here).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import math

import numpy as np

from sim.core.catalog import DeviceSpec, ModelSpec
from sim.core.files import excerpt, read_yaml
from sim.core.memory import cdiv, kv_bytes_per_token, kv_heads_per_rank

# Weight-only quantized GEMMs (AWQ/GPTQ int4, mxfp4, fp8 or int8 without matching tensor cores)
# dequantize in the main loop: at compute-bound batch sizes they reach this fraction of the
# 16-bit GEMM's rate (an assumption until calibrated; memory-bound steps are not affected).
WEIGHT_ONLY_GEMM_EFF = 0.8


def gemm_peak_flops(device: DeviceSpec, model: ModelSpec, part: str = "attention") -> float:
    """Peak FLOP/s of one part's GEMMs: fp8 / int8 tensor cores for W8A8 checkpoints on parts that
    have them, else the 16-bit peak (x WEIGHT_ONLY_GEMM_EFF for weight-only quantized weights)."""
    peak = device.bf16_tflops * 1e12
    if model.dtype == "float32":
        peak /= 8       # no bf16 tensor-core rate for fp32 (TF32 at best); a rough cut
    if not model.quantized(part):
        return peak
    q = model.quantization
    low_precision = {"fp8": device.fp8_tflops, "int8": device.int8_tops}.get(q.method)
    if q.quantized_activations and low_precision:
        return low_precision * 1e12
    return peak * WEIGHT_ONLY_GEMM_EFF


def expected_experts_touched(num_experts: int, top_k: int, tokens):
    """Distinct experts a step's `tokens` reach with uniform top-k routing: E (1 - (1 - k/E)^T).
    One token reads k experts, a large batch reads them all: what keeps MoE decode bandwidth-bound
    on expert weights well past the batch at which a dense model turns compute-bound."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


# The batch composition a step's time depends on (columns of the step records).
STEP_SHAPE = ("num_seqs", "decode_seqs", "prefill_tokens", "decode_ctx", "prefill_ctx", "prefill_attn",
              "blocks_read")


@dataclass
class CostCoefficients:
    flops_eff: float = 0.55           # fraction of peak FLOP/s reached by the GEMMs
    bw_eff: float = 0.80              # fraction of peak bandwidth reached streaming weights
    attn_flops_eff: float = 0.35      # fraction of peak reached by prefill attention
    attn_bw_eff: float = 0.70         # fraction of peak bandwidth reached reading KV
    block_overhead_s: float = 2e-9    # per KV block walked, per layer
    layer_overhead_s: float = 8e-6    # kernel launches and small ops, per layer
    prefill_seq_overhead_s: float = 1e-6  # per prefill sequence per layer (its own attention setup)
    step_device_s: float = 50e-6      # per step on the device (embedding, sampling launches)
    step_host_s: float = 150e-6       # per step on the host (scheduling, input preparation)
    seq_host_s: float = 3e-6          # per sequence per step on the host
    prefill_seq_host_s: float = 20e-6  # per prefill sequence (admission: prefix lookup, allocation)
    token_host_s: float = 0.1e-6      # per scheduled token (input ids, positions, slot mapping)
    wake_s: float = 0.0               # extra time of the first step after the engine sat idle
    link_eff: float = 1.0             # fraction of the datasheet link bandwidth tp all-reduces reach
    # Named per-step host costs of a CUDA-graph serving engine (0 = folded into the terms above):
    graph_launch_s: float = 0.0       # per step: launching the captured graph; the device waits for it
    sample_seq_s: float = 0.0         # per sequence per step: the sampler (on the device)
    detok_token_s: float = 0.0        # per emitted token: detokenization (output process, overlapped)
    api_token_s: float = 0.0          # per emitted token: the API server streaming it (overlapped)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class DeviceProfile:
    """A cost-model profile: coefficients plus where they came from."""

    coefficients: CostCoefficients = field(default_factory=CostCoefficients)
    calibrated: bool = False
    source: str = "datasheet peaks x default efficiencies"
    device_name: Optional[str] = None
    model_name: Optional[str] = None
    activation_scale: Optional[float] = None     # measured/estimated activation peak
    fit: dict = field(default_factory=dict)      # fit quality, as calibrate reported it

    def to_dict(self) -> dict:
        d = asdict(self)
        d["coefficients"] = asdict(self.coefficients)
        return d

    @classmethod
    def load(cls, path: Path) -> "DeviceProfile":
        raw = read_yaml(path, "device profile (YAML)")
        if not isinstance(raw, dict) or not isinstance(raw.get("coefficients"), dict):
            raise ValueError(f"{path}: a device profile needs a 'coefficients' mapping")
        unknown = set(map(str, raw["coefficients"])) - set(CostCoefficients.names())
        if unknown:
            raise ValueError(f"{path}: unknown coefficients {excerpt(sorted(unknown), 200)} "
                             f"(known: {', '.join(CostCoefficients.names())})")
        bad = [k for k, v in raw["coefficients"].items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise ValueError(f"{path}: coefficients.{bad[0]} is {excerpt(raw['coefficients'][bad[0]])}, "
                             f"expected a finite number")
        known = {f.name for f in fields(cls)} - {"coefficients"}
        extra = {k: v for k, v in raw.items() if k in known}
        scale = extra.get("activation_scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"{path}: activation_scale is {excerpt(scale)}, expected a finite number > 0")
        if not isinstance(extra.get("fit", {}), dict):
            raise ValueError(f"{path}: fit is {excerpt(extra['fit'])}, expected a mapping")
        return cls(coefficients=CostCoefficients(**raw["coefficients"]), **extra)


IDLE_GAP_S = 5e-4    # a step starting this long after the previous one ended follows an idle engine


def after_idle(steps) -> np.ndarray:
    """Per recorded step: did the engine sit idle before it? (The first step always did;
    calibration probes, which carry no times, run back to back.)"""
    if "start_s" not in steps:
        return np.zeros(len(steps[STEP_SHAPE[0]]), dtype=bool)
    start = np.asarray(steps["start_s"], dtype=float)
    end = np.asarray(steps["end_s"], dtype=float)
    gap = start - np.concatenate([[-np.inf], end[:-1]])
    if "replica" in getattr(steps, "columns", ()):
        replica = np.asarray(steps["replica"])
        gap[1:][replica[1:] != replica[:-1]] = np.inf
    return gap > IDLE_GAP_S


class CostModel:
    """Turns a Batch's composition into (host seconds, device seconds)."""

    def __init__(self, model: ModelSpec, device: DeviceSpec, tp: int = 1,
                 profile: Optional[DeviceProfile] = None, dp: int = 1, ep: int = 1,
                 kv_cache_dtype: str = "auto", async_scheduling: bool = False, tables=None,
                 block_size: int = 16):
        self.model, self.device, self.tp = model, device, tp
        self.block_size = block_size  # for the blocks a sliding-window layer walks
        self.dp, self.ep, self.kv_cache_dtype = dp, ep, kv_cache_dtype
        self.profile = profile or DeviceProfile()
        self.coefficients = self.profile.coefficients
        self.async_scheduling = async_scheduling
        self.tables = tables          # sim.optables.OperatorTables, or None for the roofline
        self._precompute()

    @classmethod
    def for_scenario(cls, scenario, profile: Optional[DeviceProfile] = None) -> "CostModel":
        """The scenario's cost model: its device profile (or `profile`), parallelism, KV dtype,
        step-time source and overlap rules."""
        if profile is None and scenario.device.profile:
            profile = DeviceProfile.load(scenario.device.profile)
        if profile is None and getattr(scenario, "step_times", "datasheet") == "trained":
            from sim.trained import trained_profile

            profile = trained_profile(scenario.device.name)
        par = scenario.parallelism
        overlap = scenario.async_scheduling and scenario.device.name != "cpu"
        tables = None
        if getattr(scenario, "step_times", "datasheet") == "tables":
            from sim.optables import tables_for

            tables = tables_for(scenario.device.name, scenario.model, par.tp,
                                scenario.max_num_batched_tokens, scenario.max_num_seqs, scenario.max_model_len)
        return cls(scenario.model, scenario.device, par.tp, profile, dp=par.dp, ep=par.ep,
                   kv_cache_dtype=scenario.engine.kv_cache_dtype, async_scheduling=overlap, tables=tables,
                   block_size=scenario.engine.block_size)

    @property
    def calibrated(self) -> bool:
        return self.profile.calibrated

    @property
    def step_time_source(self) -> str:
        """Where step times come from, for every output: 'datasheet', 'tables', 'trained' or
        'calibrated' ('calibrated tables' when a calibrated profile tunes the table-priced steps)."""
        base = "tables" if self.tables is not None else "datasheet"
        if self.profile.fit.get("method") == "trained":
            return "trained"
        if self.profile.calibrated:
            return "calibrated" if base == "datasheet" else "calibrated tables"
        return base

    def _precompute(self) -> None:
        m, tp, c = self.model, self.tp, self.coefficients
        peak_flops = gemm_peak_flops(self.device, m.model_copy(update={"quantization": None}))
        bw = self.device.hbm_gbps * 1e9
        d, h = m.head_dim, m.hidden_size
        q = m.num_heads // tp * d
        kv = kv_heads_per_rank(m, tp) * d
        inter = (m.shared_expert_intermediate_size if m.is_moe else m.intermediate_size) // tp
        s = m.dtype_bytes
        # seconds per unit, so step_time is a few multiply-adds
        self._linear_flop_s = 2 * (h * (q + 2 * kv) + q * h) / (gemm_peak_flops(self.device, m, "attention")
                                                               * c.flops_eff)
        if inter:
            self._linear_flop_s += 6 * h * inter / (gemm_peak_flops(self.device, m, "mlp" if not m.is_moe
                                                                    else "shared_experts") * c.flops_eff)
        self._linear_weight_s = self._dense_weight_bytes_per_layer() / (bw * c.bw_eff)
        self._linear_act_s = 2 * (h + q + 2 * kv + 2 * inter) * s / (bw * c.bw_eff)
        self._attn_pair_s = 4 * (m.num_heads // tp) * d / (peak_flops * c.attn_flops_eff)
        self._kv_token_s = (kv_bytes_per_token(m, tp, self.kv_cache_dtype) / m.num_layers
                            / (bw * c.attn_bw_eff))
        self._precompute_moe(bw)
        self._head_flop_s = 2 * h * m.vocab_size / tp / (peak_flops * c.flops_eff)
        self._head_weight_s = h * m.vocab_size / tp * s / (bw * c.bw_eff)
        self._sample_row_s = m.vocab_size * 4 * 2 / (bw * c.bw_eff)
        if tp > 1:
            link = self.device.link_gbps * 1e9
            ring = 2 * (tp - 1) / tp
            self._allreduce_token_s = 2 * ring * h * s / (link * c.link_eff)   # two all-reduces per layer
            self._allreduce_fixed_s = 2 * self.device.link_latency_us * 1e-6 / c.link_eff
        else:
            self._allreduce_token_s = self._allreduce_fixed_s = 0.0
        self._price_step = self._step_pricer()

    def _dense_weight_bytes_per_layer(self) -> float:
        """Weights every step reads in one layer on one GPU: attention and the dense MLP (or the
        shared experts), quantized where the checkpoint is, split over tp."""
        m = self.model
        parts = ("attention", "shared_experts") if m.is_moe else ("attention", "mlp")
        return sum(m.part_bytes(p) for p in parts) / m.num_layers / self.tp

    def _precompute_moe(self, bw: float) -> None:
        """Per-GPU rates of one MoE layer: the experts span all tp x dp GPUs (sliced, or whole
        with expert parallelism), so a GPU computes 1/(tp x dp) of every routed token-expert pair
        and reads 1/(tp x dp) of each touched expert's weights."""
        m, c = self.model, self.coefficients
        self._moe = m.is_moe
        if not m.is_moe:
            return
        gpus = self.tp * self.dp
        h, mi = m.hidden_size, m.moe_intermediate_size
        self._expert_pair_flop_s = 6 * h * mi / gpus / (gemm_peak_flops(self.device, m, "experts") * c.flops_eff)
        self._expert_read_s = m.expert_bytes() / gpus / (bw * c.bw_eff)
        link = self.device.link_gbps * 1e9
        s = m.dtype_bytes
        if self.ep > 1:
            # all-to-all dispatch and combine: a token travels once to each other rank holding one of
            # its k experts, (ep - 1)(1 - (1 - 1/ep)^k) ranks on average (DeepEP-style, deduplicated)
            remote = (self.ep - 1) * (1 - (1 - 1 / self.ep) ** m.num_experts_per_tok)
            self._moe_comm_token_s = 2 * remote * h * s / self.tp / link
        elif self.dp > 1:
            # vLLM's naive DP dispatch: all-gather the dp ranks' tokens, reduce-scatter the outputs
            self._moe_comm_token_s = 2 * (self.dp - 1) * h * s / link
        else:
            self._moe_comm_token_s = 0.0    # tp only: the MLP's all-reduce, counted with attention's
        self._moe_comm_fixed_s = (2 * self.device.link_latency_us * 1e-6) if gpus > 1 and (self.dp > 1 or self.ep > 1) else 0.0

    def moe_layer_time(self, tokens, maximum=max):
        """Seconds of one MoE layer on one GPU for a data-parallel rank's `tokens` (the other dp
        ranks assumed as busy): routed FLOPs vs touched experts' bytes, plus the token exchange."""
        m = self.model
        global_tokens = tokens * self.dp
        touched = expected_experts_touched(m.num_experts, m.num_experts_per_tok, global_tokens)
        compute = global_tokens * m.num_experts_per_tok * self._expert_pair_flop_s
        fixed = self._moe_comm_fixed_s * (tokens > 0)
        return maximum(compute, touched * self._expert_read_s) + tokens * self._moe_comm_token_s + fixed

    def attention_time(self, seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, prefill_attn, maximum):
        """One layer's attention, averaged over the layer types: full layers read every cached
        token; sliding layers at most `sliding_window` per sequence (bounds from the step's sums:
        exact when every context is on one side of the window)."""
        m = self.model
        kv_tokens = decode_ctx + prefill_ctx + prefill_tokens
        full = maximum(prefill_attn * self._attn_pair_s, kv_tokens * self._kv_token_s)
        sliding_layers = m.num_sliding_layers
        if not sliding_layers:
            return full
        minimum = min if maximum is max else np.minimum
        w = m.sliding_window
        window_pairs = minimum(prefill_attn, prefill_tokens * w)
        window_kv = (minimum(decode_ctx, decodes * w) + minimum(prefill_ctx, (seqs - decodes) * w)
                     + prefill_tokens)
        sliding = maximum(window_pairs * self._attn_pair_s, window_kv * self._kv_token_s)
        return (m.num_full_layers * full + sliding_layers * sliding) / m.num_layers

    def blocks_per_layer(self, seqs, blocks_read, maximum=max, block_size=None):
        """KV blocks one layer's kernel walks, averaged over the layer types: `blocks_read` for a
        full layer; for a sliding layer at most the blocks its window still holds per sequence
        (vLLM nulls the rest: cdiv(window - 1, block_size) + 1), bounded from the step's sums like
        attention_time. `block_size`: per recorded step where the steps came from several pools."""
        m = self.model
        sliding_layers = m.num_sliding_layers
        if not sliding_layers:
            return blocks_read
        minimum = min if maximum is max else np.minimum
        bs = self.block_size if block_size is None else block_size
        window = minimum(blocks_read, seqs * (cdiv(m.sliding_window - 1, bs) + 1))
        return (m.num_full_layers * blocks_read + sliding_layers * window) / m.num_layers

    def step_time(self, batch, after_idle: bool = False) -> tuple[float, float]:
        """(host_s, device_s) for one step over `batch` (a scheduler Batch)."""
        decodes = batch.num_decode          # includes a static batch's padding rows
        host, device = self._price_step(decodes + len(batch.prefills), decodes, batch.num_prefill_tokens,
                                        batch.decode_ctx, batch.prefill_ctx, batch.prefill_attn, batch.blocks_read)
        if after_idle:
            host += self.coefficients.wake_s
        return host, device

    def _price_by_parts(self, seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, prefill_attn,
                        blocks_read) -> tuple[float, float]:
        """One step's (host_s, device_s) before any wake-up: host, device and their overlap."""
        host = self._host_time(seqs, decodes, prefill_tokens)
        device = self._device_time(seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, prefill_attn,
                                   blocks_read, max)
        return self._exposed_host(host, device, seqs, max), device

    def _step_pricer(self):
        """`_price_by_parts` as one function, for the simulator's every step: the same float
        operations in the same order (the coefficients read once, `max(a, b)` written as
        `b if b > a else a`: the very same value), one call a step instead of five. Where
        attention is not one roofline term (sliding-window layers, operator tables), the parts."""
        if self.tables is not None or self.model.num_sliding_layers:
            return self._price_by_parts
        c = self.coefficients
        step_host, seq_host, prefill_seq_host, token_host = (c.step_host_s, c.seq_host_s, c.prefill_seq_host_s,
                                                             c.token_host_s)
        linear_flop, linear_weight, linear_act = self._linear_flop_s, self._linear_weight_s, self._linear_act_s
        moe_time = self.moe_layer_time if self._moe else None
        attn_pair, kv_token = self._attn_pair_s, self._kv_token_s
        layer_overhead, block_s, prefill_seq_overhead = c.layer_overhead_s, c.block_overhead_s, c.prefill_seq_overhead_s
        allreduce_token, allreduce_fixed = self._allreduce_token_s, self._allreduce_fixed_s
        head_flop, head_weight, sample_row, sample_seq = (self._head_flop_s, self._head_weight_s, self._sample_row_s,
                                                          c.sample_seq_s)
        step_device, layers = c.step_device_s, self.model.num_layers
        output_token, launch, overlap = c.detok_token_s + c.api_token_s, c.graph_launch_s, self.async_scheduling

        def price(seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, prefill_attn, blocks_read):
            host = (step_host + seq_host * seqs + prefill_seq_host * (seqs - decodes)
                    + token_host * (prefill_tokens + decodes))                         # _host_time
            tokens = prefill_tokens + decodes                                          # _device_time
            gemm, weights = tokens * linear_flop, linear_weight + tokens * linear_act
            linear = weights if weights > gemm else gemm
            if moe_time is not None:
                linear = linear + moe_time(tokens, max)
            pairs, kv_read = prefill_attn * attn_pair, (decode_ctx + prefill_ctx + prefill_tokens) * kv_token
            attention = kv_read if kv_read > pairs else pairs                          # attention_time
            per_layer = (layer_overhead + linear + attention + blocks_read * block_s
                         + (seqs - decodes) * prefill_seq_overhead + tokens * allreduce_token + allreduce_fixed)
            head_gemm = seqs * head_flop
            head = (head_weight if head_weight > head_gemm else head_gemm) + seqs * sample_row + seqs * sample_seq
            device = step_device + layers * per_layer + head
            output = output_token * seqs                                               # _exposed_host
            if overlap:
                hidden = host - device
                engine = launch + (0.0 if 0.0 > hidden else hidden)
            else:
                engine = launch + host
            shown = output - (engine + device)
            return engine + (0.0 if 0.0 > shown else shown), device
        return price

    def decode_pricer(self, rows: int):
        """`step_time` of a decode-only step of `rows` sequences as a function of (decode context,
        blocks read), for a leap's steps (sim/simulator.py): the same float operations in the
        same order, the terms that depend on `rows` alone done once. None where attention is not
        one roofline term (sliding-window layers, operator tables): the caller uses step_time."""
        if self.tables is not None or self.model.num_sliding_layers:
            return None
        c = self.coefficients
        # step_time's terms with no prefill, written as it computes them (0 + rows, 0 * x, (rows - rows) * x)
        # rather than folded away, so every price is step_time's to the last bit
        tokens = 0 + rows
        linear = max(tokens * self._linear_flop_s, self._linear_weight_s + tokens * self._linear_act_s)
        if self._moe:
            linear = linear + self.moe_layer_time(tokens, max)
        base = c.layer_overhead_s + linear
        no_pairs = 0 * self._attn_pair_s
        kv_token_s, block_s = self._kv_token_s, c.block_overhead_s
        no_prefill = (rows - rows) * c.prefill_seq_overhead_s
        allreduce, allreduce_fixed = tokens * self._allreduce_token_s, self._allreduce_fixed_s
        head = max(rows * self._head_flop_s, self._head_weight_s) + rows * self._sample_row_s + rows * c.sample_seq_s
        step_device, layers = c.step_device_s, self.model.num_layers
        host = self._host_time(rows, rows, 0)
        # _exposed_host inlined, its device-independent terms done once
        output = (c.detok_token_s + c.api_token_s) * rows
        launch = c.graph_launch_s
        # (max(a, b) written as `b if b > a else a`: the very same value, without a call per step)
        if self.async_scheduling:
            def price(decode_ctx: int, blocks_read: int) -> tuple[float, float]:
                kv_read = decode_ctx * kv_token_s
                attention = kv_read if kv_read > no_pairs else no_pairs
                per_layer = base + attention + blocks_read * block_s + no_prefill + allreduce + allreduce_fixed
                device = step_device + layers * per_layer + head
                hidden = host - device
                engine = launch + (0.0 if 0.0 > hidden else hidden)
                shown = output - (engine + device)
                return engine + (0.0 if 0.0 > shown else shown), device
            return price
        engine = launch + host

        def price_sync(decode_ctx: int, blocks_read: int) -> tuple[float, float]:
            kv_read = decode_ctx * kv_token_s
            attention = kv_read if kv_read > no_pairs else no_pairs
            per_layer = base + attention + blocks_read * block_s + no_prefill + allreduce + allreduce_fixed
            device = step_device + layers * per_layer + head
            shown = output - (engine + device)
            return engine + (0.0 if 0.0 > shown else shown), device
        return price_sync

    def step_times(self, steps) -> tuple[np.ndarray, np.ndarray]:
        """(host_s, device_s) arrays for recorded steps (a steps frame, or a dict of columns)."""
        col = [np.asarray(steps[name], dtype=float) for name in STEP_SHAPE]
        block_size = np.asarray(steps["block_size"]) if "block_size" in steps else None
        device = self._device_time(*col, np.maximum, block_size=block_size)
        host = self._exposed_host(self._host_time(*col[:3]), device, col[0], np.maximum)
        return host + self.coefficients.wake_s * after_idle(steps), device

    def _exposed_host(self, host, device, seqs, maximum):
        """The host time a step adds to the device's, by the engine's overlap rules.

        Output processing (detokenization, API streaming) runs in the API server's process and
        only shows when it is slower than the engine's own step. Synchronous scheduling puts the
        scheduler's host work before each launch; async scheduling plans step N+1 while step N
        runs, so only what exceeds the device time shows. The graph launch is always serial."""
        c = self.coefficients
        output = (c.detok_token_s + c.api_token_s) * seqs
        engine = c.graph_launch_s + (maximum(host - device, 0.0) if self.async_scheduling else host)
        return engine + maximum(output - (engine + device), 0.0)

    def _host_time(self, seqs, decodes, prefill_tokens):
        c = self.coefficients
        return (c.step_host_s + c.seq_host_s * seqs + c.prefill_seq_host_s * (seqs - decodes)
                + c.token_host_s * (prefill_tokens + decodes))

    def _device_time(self, seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, prefill_attn,
                     blocks_read, maximum, block_size=None):
        """The roofline sum of the module docstring; `maximum` is max for one step, np.maximum for
        arrays (then `block_size` may be an array: each step's pool)."""
        if self.tables is not None:
            if maximum is max:
                return self._table_time(seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, blocks_read)
            sizes = np.broadcast_to(self.block_size if block_size is None else block_size, np.shape(seqs))
            return np.array([self._table_time(*row) for row in zip(
                seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, blocks_read, sizes)], dtype=float)
        c = self.coefficients
        tokens = prefill_tokens + decodes
        linear = maximum(tokens * self._linear_flop_s, self._linear_weight_s + tokens * self._linear_act_s)
        if self._moe:
            linear = linear + self.moe_layer_time(tokens, maximum)
        attention = self.attention_time(seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, prefill_attn,
                                        maximum)
        blocks = self.blocks_per_layer(seqs, blocks_read, maximum, block_size)
        per_layer = (c.layer_overhead_s + linear + attention + blocks * c.block_overhead_s
                     + (seqs - decodes) * c.prefill_seq_overhead_s
                     + tokens * self._allreduce_token_s + self._allreduce_fixed_s)
        rows = seqs   # one sampled row per sequence (chunks that emit nothing are few)
        head = (maximum(rows * self._head_flop_s, self._head_weight_s) + rows * self._sample_row_s
                + rows * c.sample_seq_s)
        return c.step_device_s + self.model.num_layers * per_layer + head

    def _table_time(self, seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, blocks_read,
                    block_size=None) -> float:
        """Device time from the operator tables (sim/optables.py) on this step's composition."""
        from sim.optables import bucket

        t, c = self.tables, self.coefficients
        seqs, decodes, prefill_tokens = int(seqs), int(decodes), int(prefill_tokens)
        prefills = seqs - decodes
        tokens = prefill_tokens + decodes
        blocks = self.blocks_per_layer(seqs, blocks_read, block_size=block_size)
        per_layer = (t.linear_s(tokens) if tokens else 0.0) + c.layer_overhead_s + blocks * c.block_overhead_s
        if prefills:
            chunk = max(1, round(prefill_tokens / prefills))
            per_layer += prefills * t.context_s(chunk, bucket(prefill_ctx / prefills) if prefill_ctx else 0)
        if decodes:
            per_layer += t.generation_s(decodes, bucket(decode_ctx / decodes))
        per_layer += tokens * self._allreduce_token_s + self._allreduce_fixed_s
        rows = seqs
        return (c.step_device_s + self.model.num_layers * per_layer + t.head_s(rows)
                + rows * (self._sample_row_s + c.sample_seq_s))

    def describe(self) -> dict:
        return {"calibrated": self.calibrated, "step_time_source": self.step_time_source,
                "async_scheduling": self.async_scheduling,
                "tables": self.tables.describe() if self.tables is not None else None,
                "source": self.profile.source, "quality": self.profile.fit.get("quality"),
                "coefficients": asdict(self.coefficients), "tp": self.tp}
