"""Step time from a batch's composition: host overhead plus a roofline per layer group.

    step = host + device
    host   = graph_launch_s + exposed scheduler host time + exposed output time (+ wake_s on the
             first step after the engine sat idle: cold caches and clocks; calibration measures it)
      scheduler host = step_host_s + seq_host_s x sequences + prefill_seq_host_s x prefill sequences
                       + token_host_s x tokens; all of it synchronously, only its excess over the
                       device time with async scheduling (vLLM >= 0.14 on a GPU: Scenario.async_scheduling)
      eager launches = layers x eager_layer_host_s on a step vLLM V0 runs without its CUDA graphs
                       (one with a prefill; any under --enforce-eager; a decode batch above the
                       largest captured size, or with a context past max_seq_len_to_capture:
                       CostModel.runs_eagerly), only its excess over the device time
      output         = (detok_token_s + api_token_s) x sequences, in the API server's process:
                       only its excess over the engine's step shows
    device = step_device_s + layers x (layer_overhead_s
                 + max(linear FLOPs / (peak x flops_eff), weight bytes / (bw x bw_eff))
                 + max(attention FLOPs / (peak x attn_flops_eff), KV bytes / (bw x attn_bw_eff))
                 + blocks walked x block_overhead_s
                 + prefill sequences x prefill_seq_overhead_s
                 + tp all-reduce)
             + max(LM-head FLOPs, LM-head bytes) + sampling bytes + sample_seq_s x sequences

Quantized weights change the bytes read and the GEMM peak (gemm_peak_flops), weight-only ones add
their dequantization per tile of batch rows (weight_only); an MoE layer adds
max(routed FLOPs, bytes of the experts the batch touches) (plus expert_serial_share x the smaller),
scaled for the busiest GPU under expert parallelism (expert_imbalance), and the dp token exchange
(moe_layer_time); data-parallel MoE
ranks step together (lockstep_times); sliding-window layers read at most the window; PCIe
collectives follow NCCL's ring model (pcie_collective). docs/cost_model.md walks through it all.

Linear layers read their weights once per step whatever the batch, so small batches are
bandwidth-bound and large ones compute-bound. Attention reads each sequence's KV (decode)
or computes causal scores over new tokens against their context (prefill); the per-block
term is the cost of walking block tables, which is what makes a small block size slower.
Coefficients are datasheet peaks times default efficiencies, or a calibrated profile
(validate/calibrate.py fits them against the real engine and writes the YAML loaded here).
"""
from __future__ import annotations

import ast
import copy
import functools
import linecache
import statistics
import textwrap
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import math

import numpy as np

from sim.core.catalog import DeviceSpec, ModelSpec
from sim.core.files import excerpt, read_yaml
from sim.core.memory import cdiv, kv_bytes_per_token, kv_heads_per_rank
from sim.dp import DPPadding, remote_ranks
from sim.lora import LoraCost
from sim.speculative import DraftCost

# Weight-only quantized GEMMs (AWQ/GPTQ int4, mxfp4, fp8 or int8 without matching tensor cores) run
# Marlin-style kernels: the weights stream in quantized (their bytes: the memory-bound side) and are
# dequantized to 16 bits in the main loop, once per tile of at most 64 batch rows (vLLM's
# csrc/quantization/gptq_marlin/gptq_marlin.cu: max_thread_m_blocks = 4 blocks of 16 rows; a larger
# batch runs as `par` such problems side by side, each dequantizing the weights again). The tensor
# cores then run at the 16-bit rate, and the dequantization adds CostCoefficients.dequant_overhead
# x a full tile's tensor-core work per tile: so small batches stay bound by the quantized bytes,
# and a batch of whole tiles runs at 1 / (1 + dequant_overhead) of the 16-bit rate.
WEIGHT_ONLY_TILE_ROWS = 64


def weight_only(device: DeviceSpec, model: ModelSpec, part: str) -> bool:
    """Are this part's GEMMs weight-only quantized on this device (dequantized to 16 bits)?"""
    if not model.quantized(part):
        return False
    q = model.quantization
    low_precision = {"fp8": device.fp8_tflops, "int8": device.int8_tops}.get(q.method)
    return not (q.quantized_activations and low_precision)


def gemm_peak_flops(device: DeviceSpec, model: ModelSpec, part: str = "attention") -> float:
    """Peak FLOP/s of one part's GEMMs: fp8 / int8 tensor cores for W8A8 checkpoints on parts that
    have them, else the 16-bit peak (weight-only quantized weights too: their dequantization is a
    term of its own, `weight_only`)."""
    peak = device.bf16_tflops * 1e12
    if model.dtype == "float32":
        peak /= 8       # no bf16 tensor-core rate for fp32 (TF32 at best); a rough cut
    if not model.quantized(part) or weight_only(device, model, part):
        return peak
    return {"fp8": device.fp8_tflops, "int8": device.int8_tops}[model.quantization.method] * 1e12


def part_params(model: ModelSpec, part: str) -> int:
    """Weights of one part's matrices over all layers (linear_shapes)."""
    return sum(fan_in * fan_out * count for p, fan_in, fan_out, count in model.linear_shapes() if p == part)


def expert_imbalance(experts: int, top_k: int, ep: int, load_cv: float) -> tuple[float, float, float]:
    """(noise, skew, z) of the expert-parallel load imbalance: with whole experts on each of `ep`
    GPUs (E / ep apiece), a step's T tokens x k routed pairs land unevenly and the MoE layer waits
    for the busiest GPU, whose expected load is the mean x (1 + z sqrt(noise / T + skew)), at most
    ep times it (the experts it reads likewise: CostModel._moe_time). Uniform top-k routing puts a hypergeometric share of each token's k distinct
    experts on a GPU: relative variance (ep - 1)(E - k) / (T k (E - 1)) of its load ('noise / T');
    experts unequally popular (coefficient of variation `load_cv` across experts, 0: as uniform as
    the router's load-balancing loss aims for) add (ep - 1) / (E - 1) x cv^2 ('skew'); z is the
    expected largest of ep standard normal draws (Blom's approximation). z = 0: no imbalance (one
    GPU, or experts sliced over the GPUs, each holding a slice of every expert)."""
    if ep <= 1:
        return 0.0, 0.0, 0.0
    noise = (ep - 1) * (experts - top_k) / (top_k * (experts - 1))
    skew = load_cv ** 2 * (ep - 1) / (experts - 1)
    z = statistics.NormalDist().inv_cdf((ep - 0.375) / (ep + 0.25))
    return noise, skew, z


# Collectives over PCIe (cards without NVLink), after NCCL's own tuning model (NVIDIA/nccl
# src/graph/tuning.cc, ncclTopoTuneModel): on one server a collective over n ranks runs as a ring,
#   time = baseLat + steps x hwLat + bytes / algorithm bandwidth,
# steps = 2 (n - 1) for an all-reduce, n - 1 for an all-gather or a reduce-scatter, and NCCL takes
# the faster protocol per call: LL (low latency; a quarter of the bus bandwidth for an all-reduce,
# a third otherwise) or Simple (LL128 stays off on PCIe). NCCL's tree has the same 2 (n - 1) hops
# inside one server and half the bandwidth, so its tuner never prefers it there. (base, per step)
# latencies in microseconds, PCI rows of the Ring algorithm:
NCCL_PCIE_RING_US = {"LL": (6.6, 1.0), "Simple": (8.4, 5.7)}
# NCCL's PCIe link bandwidth (src/graph/topo.cc): lanes x speed / 80, i.e. 12 / 24 / 48 GB/s for
# Gen3 / 4 / 5 x16: three quarters of the nominal figure.
NCCL_PCIE_EFF = 0.75
# vLLM's custom all-reduce handles messages below this (custom_all_reduce.py max_size, 0.7.3 and 0.19)
# on 2, 4, 6 or 8 GPUs (_SUPPORTED_WORLD_SIZES) with peer-to-peer access, all pairs on NVLink beyond two
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 1024 * 1024
CUSTOM_ALLREDUCE_WORLD_SIZES = (2, 4, 6, 8)


def pcie_collective(device: DeviceSpec, ranks: int, kind: str, c: "CostCoefficients") -> tuple:
    """((fixed s, s per byte) of NCCL's LL ring, the same of its Simple ring) for one collective
    over `ranks` PCIe GPUs. Bytes: the whole tensor of an all-reduce, one rank's share of an
    all-gather or reduce-scatter. Without peer-to-peer access (GeForce) every transfer and every
    ready flag goes through host memory, two PCIe crossings for one: each ring step runs at
    `host_staging_eff` of the direct path's speed (bandwidth and hop latency). `link_eff` and
    `pcie_latency_scale` are the fit's handles on bandwidth and latency."""
    staging = 1.0 if device.peer_to_peer else c.host_staging_eff
    bus = device.link_gbps * 1e9 * NCCL_PCIE_EFF * c.link_eff * staging
    if kind == "all_reduce":
        steps, bytes_per_bus_byte, ll_share = 2 * (ranks - 1), 2 * (ranks - 1) / ranks, 1 / 4
    else:
        steps, bytes_per_bus_byte, ll_share = ranks - 1, ranks - 1, 1 / 3
    ll_base, ll_hop = NCCL_PCIE_RING_US["LL"]
    simple_base, simple_hop = NCCL_PCIE_RING_US["Simple"]
    scale = 1e-6 * c.pcie_latency_scale
    return (((ll_base + steps * ll_hop / staging) * scale, bytes_per_bus_byte / (bus * ll_share)),
            ((simple_base + steps * simple_hop / staging) * scale, bytes_per_bus_byte / bus))


def expert_kernel_share(columns: float, n_half: float) -> float:
    """The share of the dense GEMMs' compute efficiency the fused-MoE kernel reaches on an expert
    slice of `columns` columns per GPU: columns / (columns + n_half) (1 for n_half 0). Experts sliced
    by tp get narrow (Qwen3-235B's 1536 over 8 GPUs: 192), and a grouped GEMM over many small
    per-expert tiles keeps the tensor cores further from their peak than one large dense GEMM."""
    return 1.0 if n_half <= 0 else columns / (columns + n_half)


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
    # per layer of a step vLLM V0 runs eagerly, without a CUDA graph (CostModel.runs_eagerly): the
    # host launching its kernels one by one; the GPU runs each as it comes, so only its excess over the step's
    # device time shows (0: fitted for V0 only, validate/lodo.py V0_HOST)
    eager_layer_host_s: float = 0.0
    wake_s: float = 0.0               # extra time of the first step after the engine sat idle
    link_eff: float = 1.0             # fraction of the datasheet link bandwidth tp all-reduces reach
    # seconds of one tp all-reduce's fixed latency on an NVLink / generic link (not PCIe: NCCL's
    # table, pcie_latency_scale), apart from its bandwidth: a decode step's all-reduces are small
    # and latency-bound, a prefill's large and bandwidth-bound. 0: the device's link_latency_s over
    # link_eff (one efficiency pricing both)
    allreduce_latency_s: float = 0.0
    # vLLM's custom all-reduce on an NVLink / generic link (messages under CUSTOM_ALLREDUCE_MAX_BYTES:
    # a decode step's, not a long prefill's): the share of the datasheet link bandwidth its one- or
    # two-shot kernel reaches, apart from NCCL's ring (link_eff, the larger messages). 0: every message
    # at link_eff (one efficiency for both)
    custom_allreduce_eff: float = 0.0
    # PCIe collectives (a DeviceSpec with interconnect: pcie): NCCL's latency table x this, and the
    # speed of a ring step staged through host memory (GPUs without peer-to-peer access) relative to
    # a direct one: two PCIe crossings for one, so half (an assumption for the fit to learn)
    pcie_latency_scale: float = 1.0
    host_staging_eff: float = 0.5
    # expert parallelism: coefficient of variation of the experts' popularity (0 = uniform routing,
    # what the models' load-balancing losses train for; the statistical imbalance is modelled anyway)
    expert_load_cv: float = 0.0
    # the fused-MoE kernel on a GPU's slice of each expert (moe_intermediate_size / the GPUs the
    # experts are sliced over; whole experts under expert parallelism): the slice width, in columns,
    # at which the routed experts' GEMMs reach half the dense GEMMs' compute efficiency, n / (n +
    # expert_n_half) of it (Hockney's half-performance length; 0 = the dense efficiency). Streaming
    # the touched experts' weights (decode) stays at bw_eff: bound by their bytes, not tile shapes
    expert_n_half: float = 0.0
    # the fused-MoE kernel's overlap of its expert GEMMs' compute with their weight reads: this share
    # of the smaller of the two is added to the larger (0: the roofline's maximum, full overlap; 1:
    # their sum). vLLM's Triton fused_moe runs each expert's rows in tiles of BLOCK_SIZE_M (16-64 at
    # decode sizes), streaming the expert's whole weight slice through every tile's K loop
    expert_serial_share: float = 0.0
    # weight-only quantized GEMMs: dequantizing a weight for one tile of 64 batch rows costs this
    # share of the tile's 16-bit tensor-core work (0.25: whole tiles at 0.8 x the 16-bit rate, the
    # figure assumed before this term; small batches stay bound by the quantized bytes)
    dequant_overhead: float = 0.25
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


def trained_coefficients(params: dict) -> CostCoefficients:
    """CostCoefficients with the trained family's parameters (sim/trained.py) applied to the defaults."""
    from dataclasses import replace

    from sim.trained import SCALED, TERMS

    base = CostCoefficients()
    # an efficiency never exceeds 1 (a fit at its bound, stored to 5 digits, may land a hair above)
    scaled = {eff: min(1.0, getattr(base, eff) * params.get(name, 1.0)) for name, effs in SCALED.items()
              for eff in effs}
    return replace(base, **scaled, **{t: params[t] for t in TERMS if t in params})


def trained_profile(device_name: str, engine: str = "v1") -> DeviceProfile:
    """The trained family's profile for a catalog device under a vLLM engine generation
    (Scenario.engine_generation): the coefficients fitted on that generation's runs of
    the device's class, else the generation's generic entry."""
    from sim.trained import class_entry, family, family_entry

    fam = family()
    params, entry = family_entry(device_name, engine)
    gen = engine.upper()
    single = class_entry(device_name, engine)
    generic = f"the {gen} generic entry (geometric mean of the classes of two deployments or more)"
    how = (f"fitted on {entry['runs']} public vLLM {gen} runs of {len(entry['deployments'])} {device_name} "
           "deployments" if entry else
           f"one public vLLM {gen} deployment on {device_name}, a fit no held-out run tested: {generic}" if single
           else f"no public vLLM {gen} run on {device_name}: {generic}")
    return DeviceProfile(trained_coefficients(params), calibrated=False,
                         source=f"trained v{fam['version']}: {how}", device_name=device_name,
                         fit={"method": "trained", "version": fam["version"], "engine": engine,
                              "class": device_name if entry else "generic", "parameters": dict(params)})


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


class _ScalarForm(ast.NodeTransformer):
    """Rewrites `maximum(a, b)` / `minimum(a, b)` calls as the conditional expressions Python's
    max / min evaluate (`b if b > a else a`, `b if b < a else a`: the very same value, each
    operand evaluated once: an expression is held in a temporary, a name or a constant is read
    again), and `self.NAME(...)` calls of the generated methods as calls of their scalar forms."""

    def __init__(self, generated: set[str]):
        self.generated, self.temporaries = generated, 0

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("maximum", "minimum") and len(node.args) == 2 \
                and not node.keywords:
            tested, chosen = [], []
            for value in node.args:
                if isinstance(value, (ast.Name, ast.Constant)):
                    tested.append(value)
                    chosen.append(copy.copy(value))
                else:
                    name = f"_operand{self.temporaries}"
                    self.temporaries += 1
                    tested.append(ast.NamedExpr(target=ast.Name(id=name, ctx=ast.Store()), value=value))
                    chosen.append(ast.Name(id=name, ctx=ast.Load()))
            op = ast.Gt() if func.id == "maximum" else ast.Lt()
            # (the second operand first: pure expressions, so the order cannot change a value)
            return _located(ast.IfExp(test=ast.Compare(left=tested[1], ops=[op], comparators=[tested[0]]),
                                      body=chosen[1], orelse=chosen[0]), node)
        if (isinstance(func, ast.Attribute) and func.attr in self.generated and isinstance(func.value, ast.Name)
                and func.value.id == "self"):
            func.attr += "_scalar"
        return node


class _Known(ast.NodeTransformer):
    """Reads of the names in `known` become their values, and the `if`s those decide keep only
    the branch taken (no test of them per step, and a closure holds none of the names the
    branches not taken read)."""

    def __init__(self, known: dict):
        self.known = known

    def visit_Name(self, node: ast.Name):
        if isinstance(node.ctx, ast.Load) and node.id in self.known:
            return ast.copy_location(ast.Constant(self.known[node.id]), node)
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and isinstance(node.operand, ast.Constant):
            return ast.copy_location(ast.Constant(not node.operand.value), node)
        return node

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return (node.body if node.test.value else node.orelse) or [ast.copy_location(ast.Pass(), node)]
        return node

    def visit_IfExp(self, node: ast.IfExp):
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return node.body if node.test.value else node.orelse
        return node


class _VanishingTerms(ast.NodeTransformer):
    """For the decode-only form (`CostModel.decode_pricer`, `_Known` having fixed the terms a
    decode-only step has at zero): `x + 0` becomes `x`, and `maximum(0, a * b)` becomes `a * b`.
    Both are the very same float: adding +0.0 (or -0.0) changes no value but -0.0, and every sum
    here is of nonnegative costs with a positive base; a product of nonnegative counts and costs
    is at least +0.0, and where it is +0.0 max returns the other zero, +0.0 too. One addition and
    one comparison fewer per term, at every leap step."""

    def visit_BinOp(self, node: ast.BinOp):
        self.generic_visit(node)
        if isinstance(node.op, ast.Add) and _is_zero(node.right):
            return node.left
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id == "maximum" and len(node.args) == 2
                and _is_zero(node.args[0]) and isinstance(node.args[1], ast.BinOp)
                and isinstance(node.args[1].op, ast.Mult)):
            return node.args[1]
        return node


def _located(new: ast.AST, old: ast.AST) -> ast.AST:
    """`new`, replacing `old`, at its place in the source (and the nodes made with it), so that the
    generated tree needs no walk of its own before it compiles (ast.fix_missing_locations)."""
    return ast.fix_missing_locations(ast.copy_location(new, old))


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 0


def _one_call(tree: ast.Module) -> ast.Module:
    """`_stages` with its second stage folded into the first: `sizes(seqs, decodes, prefill_tokens,
    prefill_ctx, prefill_attn, decode_ctx, blocks_read, padded=None)` returns the price itself
    (the inner `price`'s body in place of its definition and `return price`), for a step priced
    once: no closure made per step."""
    sizes = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "sizes")
    at = next(i for i, node in enumerate(sizes.body) if isinstance(node, ast.FunctionDef) and node.name == "price")
    price = sizes.body[at]
    outer = {a.arg for a in sizes.args.args} | {n.id for stmt in sizes.body[:at] for n in ast.walk(stmt)
                                                 if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    inner = {a.arg for a in price.args.args} | {n.id for stmt in price.body for n in ast.walk(stmt)
                                                 if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    assert not outer & inner, f"_one_call: price would overwrite {sorted(outer & inner)}"
    assert isinstance(sizes.body[-1], ast.Return) and sizes.body[at + 1:] == sizes.body[-1:]
    sizes.body = sizes.body[:at] + price.body
    args = sizes.args.args
    sizes.args.args = args[:len(args) - len(sizes.args.defaults)] + price.args.args + args[len(args)
                                                                                          - len(sizes.args.defaults):]
    return tree


def scalar_form(method, generated: set[str], one_call: bool = False, known: tuple = (), vanishing: bool = False):
    """`method` (written once for Python numbers and numpy columns alike, over its `maximum` /
    `minimum` arguments) generated again for Python numbers only, without a call per max / min
    (Python 3.11's builtin max costs several times a comparison, and a leap prices every step):
    its source rewritten by _ScalarForm (and `_one_call`, and `_Known` with the (name, value)
    pairs `known` fixes, then `_VanishingTerms` with `vanishing`) and compiled against the same
    globals and line numbers (the source is parsed where it stands in its file, and every node a
    rewrite makes takes the place of the one it replaces: no walk of the whole tree to number it).
    tests/sim/test_costmodel.py proves every form prices alike to the last bit."""
    source, filename = _method_source(method)
    tree = ast.parse(source)
    if known:
        tree = _Known(dict(known)).visit(tree)
    if vanishing:
        tree = _VanishingTerms().visit(tree)
    if one_call:
        tree = _one_call(tree)
    tree = _ScalarForm(generated).visit(tree)
    namespace: dict = {}
    exec(compile(tree, filename, "exec"), method.__globals__, namespace)
    return namespace[method.__name__]


@functools.cache
def _method_source(method) -> tuple[str, str]:
    """A method's source text (dedented, after as many empty lines as precede it in its file, so
    that a parse numbers its lines as the file does) and file, read once per process: its lines
    from its first (its decorators') to the last its code, or a function nested in it, spans.
    `inspect.getsource` finds the same lines by tokenizing the module from there (~4 ms for the
    three methods, its regexes compiled first: more than parsing and compiling a form). Cached:
    `_stages` is generated in up to three forms."""
    code = method.__code__
    lines = linecache.getlines(code.co_filename, method.__globals__)    # (as inspect reads it)
    first = code.co_firstlineno
    return "\n" * (first - 1) + textwrap.dedent("".join(lines[first - 1:_last_line(code)])), code.co_filename


def _last_line(code) -> int:
    """The last source line `code` or a code object nested in it (a function, a comprehension) spans."""
    ends = [end for _, end, _, _ in code.co_positions() if end is not None]
    ends += [_last_line(c) for c in code.co_consts if hasattr(c, "co_positions")]
    return max(ends, default=code.co_firstlineno)


# vLLM V0's CUDA graph batch sizes (vllm/config.py VllmConfig._set_cudagraph_sizes, 0.7.3)
V0_GRAPH_BATCH_SIZES = (1, 2, 4) + tuple(8 * i for i in range(1, 1025))


def v0_graph_max_batch(max_num_seqs: int, enforce_eager: bool) -> int:
    """vLLM V0's largest captured CUDA graph batch (model_runner.py max_batchsize_to_capture, 0.7.3):
    the smallest of V0_GRAPH_BATCH_SIZES at least max_num_seqs, else the largest; none (0) under
    --enforce-eager (vllm/config.py VllmConfig._set_cudagraph_sizes)."""
    if enforce_eager:
        return 0
    return next((size for size in V0_GRAPH_BATCH_SIZES if size >= max_num_seqs), V0_GRAPH_BATCH_SIZES[-1])


# vLLM V0's default --max-seq-len-to-capture (engine/arg_utils.py EngineArgs, 0.7.3), capped at
# max_model_len (config.py ModelConfig._verify_cuda_graph)
V0_MAX_SEQ_LEN_TO_CAPTURE = 8192


class CostModel:
    """Turns a Batch's composition into (host seconds, device seconds)."""

    def __init__(self, model: ModelSpec, device: DeviceSpec, tp: int = 1,
                 profile: Optional[DeviceProfile] = None, dp: int = 1, ep: int = 1,
                 kv_cache_dtype: str = "auto", async_scheduling: bool = False, tables=None,
                 block_size: int = 16, all2all_backend: str = "allgather_reducescatter",
                 dp_padding: Optional[DPPadding] = None, v0_graph_max_batch: Optional[int] = None,
                 v0_graph_max_context: Optional[int] = None):
        self.model, self.device, self.tp = model, device, tp
        # vLLM V0's largest decode batch that runs a captured CUDA graph (v0_graph_max_batch); None: not
        # a V0 engine, whose steps never pay eager_layer_host_s
        self.v0_graph_max_batch = v0_graph_max_batch
        # and its longest decode context (max_seq_len_to_capture); None: no context is too long
        self.v0_graph_max_context = v0_graph_max_context
        self.block_size = block_size  # for the blocks a sliding-window layer walks
        self.dp, self.ep, self.kv_cache_dtype = dp, ep, kv_cache_dtype
        self.all2all_backend = all2all_backend
        # the tokens each rank of a lockstep step runs (sim/dp.py; vLLM 0.19's rule by default)
        self.dp_padding = dp_padding or DPPadding()
        self.profile = profile or DeviceProfile()
        self.coefficients = self.profile.coefficients
        self.async_scheduling = async_scheduling
        self.tables = tables          # sim.optables.OperatorTables, or None for the roofline
        self.draft: Optional[DraftCost] = None      # speculative decoding's drafter (for_scenario sets it)
        self.lora: Optional[LoraCost] = None        # LoRA adapters' loads and kernels (for_scenario sets it)
        self._precompute()

    @classmethod
    def for_scenario(cls, scenario, profile: Optional[DeviceProfile] = None) -> "CostModel":
        """The scenario's cost model: its device profile (or `profile`), parallelism, KV dtype,
        step-time source and overlap rules."""
        if profile is None and scenario.device.profile:
            profile = DeviceProfile.load(scenario.device.profile)
        if profile is None and getattr(scenario, "step_times", "datasheet") == "trained":
            profile = trained_profile(scenario.device.name, scenario.engine_generation)
        par = scenario.parallelism
        overlap = scenario.async_scheduling and scenario.device.name != "cpu"
        tables = None
        if getattr(scenario, "step_times", "datasheet") == "tables":
            from sim.optables import tables_for

            tables = tables_for(scenario.device.name, scenario.model, par.tp,
                                scenario.max_num_batched_tokens, scenario.max_num_seqs, scenario.max_model_len)
        model = cls(scenario.model, scenario.device, par.tp, profile, dp=par.dp, ep=par.ep,
                    kv_cache_dtype=scenario.engine.kv_cache_dtype, async_scheduling=overlap, tables=tables,
                    block_size=scenario.engine.block_size, all2all_backend=par.all2all_backend,
                    dp_padding=DPPadding.for_scenario(scenario),
                    **cls._v0_graphs(scenario))
        model.draft = DraftCost.for_scenario(scenario, model)
        c = model.coefficients
        model.lora = LoraCost.for_scenario(scenario, gemm_peak_flops(scenario.device, scenario.model.model_copy(
            update={"quantization": None})), c.flops_eff, c.bw_eff)
        return model

    @staticmethod
    def _v0_graphs(scenario) -> dict:
        """A V0 scenario's CUDA graph limits (`runs_eagerly`); none for a V1 one."""
        if scenario.engine_generation != "v0":
            return {}
        longest = min(V0_MAX_SEQ_LEN_TO_CAPTURE, scenario.max_model_len)
        m, block = scenario.model, scenario.engine.block_size
        # an all-sliding model's decode lengths are cut to its block-aligned window plus the last block's
        # tokens first (worker/model_runner.py _compute_for_sliding_window, 0.7.3): none may pass
        windowed = m.sliding_window and not m.num_full_layers and cdiv(m.sliding_window, block) * block + block - 1
        passes = longest < scenario.max_model_len and not (windowed and windowed <= longest)
        return {"v0_graph_max_batch": v0_graph_max_batch(scenario.max_num_seqs, scenario.engine.enforce_eager),
                "v0_graph_max_context": longest if passes else None}

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
        dense_parts = ("attention", "shared_experts") if m.is_moe else ("attention", "mlp")
        dequantized = sum(part_params(m, p) for p in dense_parts if weight_only(self.device, m, p)) / m.num_layers / tp
        self._dequant_tile_s = (c.dequant_overhead * dequantized * 2 * WEIGHT_ONLY_TILE_ROWS
                                / (gemm_peak_flops(self.device, m, "attention") * c.flops_eff)) if dequantized else 0.0
        self._linear_act_s = 2 * (h + q + 2 * kv + 2 * inter) * s / (bw * c.bw_eff)
        self._attn_pair_s = 4 * (m.num_heads // tp) * d / (peak_flops * c.attn_flops_eff)
        self._kv_token_s = (kv_bytes_per_token(m, tp, self.kv_cache_dtype) / m.num_layers
                            / (bw * c.attn_bw_eff))
        self._precompute_moe(bw)
        self._head_flop_s = 2 * h * m.vocab_size / tp / (peak_flops * c.flops_eff)
        self._head_weight_s = h * m.vocab_size / tp * s / (bw * c.bw_eff)
        self._sample_row_s = m.vocab_size * 4 * 2 / (bw * c.bw_eff)
        self._allreduce_token_s = self._allreduce_fixed_s = 0.0     # tp 1, or PCIe (_tp_allreduce)
        self._allreduce_per_token = tp == 1 or self.device.interconnect != "pcie"
        self._custom_allreduce_token_s = 0.0      # (an NVLink custom all-reduce priced apart: _tp_allreduce)
        if tp > 1 and self.device.interconnect != "pcie":
            link = self.device.link_gbps * 1e9
            ring = 2 * (tp - 1) / tp
            self._allreduce_token_s = 2 * ring * h * s / (link * c.link_eff)   # two all-reduces per layer
            if c.custom_allreduce_eff and tp in CUSTOM_ALLREDUCE_WORLD_SIZES:
                self._allreduce_per_token = False
                self._custom_allreduce_token_s = 2 * ring * h * s / (link * c.custom_allreduce_eff)
            self._allreduce_fixed_s = (2 * c.allreduce_latency_s if c.allreduce_latency_s
                                       else 2 * self.device.link_latency_s / c.link_eff)
        # the scalar forms, with the branches the roofline fixes taken (operator tables: none fixed)
        known = () if self.tables is not None else \
            _ROOFLINE_SLIDING if self.model.num_sliding_layers else _ROOFLINE_FULL_ATTENTION
        self._known = known
        self._price_step = _stages_scalar(known, one_call=True)(self, max, min, self.block_size)
        # vLLM V0 runs a step without its CUDA graphs unless it is decode-only and within the captured
        # batch sizes (`runs_eagerly`); a V1 engine captures its own graphs, and never pays the term
        self._eager_launch_s = c.eager_layer_host_s * m.num_layers if self.v0_graph_max_batch is not None else 0.0
        self._graph_max_batch = self.v0_graph_max_batch or 0
        # the context past which a decode step pays the launches; None where none can (sim/simulator.py
        # then prices every step with step_time, and ends a leap before its longest context passes it)
        self.eager_context = self.v0_graph_max_context if self._eager_launch_s else None
        # A leap's decode steps (`decode_pricer`): the two stages with the terms a decode-only step
        # has at zero taken out (no prompt tokens; on one GPU, or a per-token link with no latency,
        # no all-reduce). The general two stages, which only lockstep_times asks for (and operator
        # tables, which fix nothing), are made where asked (`_sizes`): a run generates two forms.
        self._general_sizes = None
        self._decode_sizes = None if self.tables is not None else \
            _stages_scalar(known + self._decode_zeros(), vanishing=True)(self, max, min, self.block_size)

    def _sizes(self, *shape):
        """`_stages`' two stages for any step's `shape` (its first stage's arguments), generated for
        Python numbers on first use."""
        sizes = self._general_sizes
        if sizes is None:
            sizes = self._general_sizes = _stages_scalar(self._known)(self, max, min, self.block_size)
        return sizes(*shape)

    def _decode_zeros(self) -> tuple:
        """The names of `_stages` whose value is zero in a decode-only step of this model (seqs
        equal to decodes, no prompt tokens), as `_Known` pairs."""
        zeros = (("prefill_tokens", 0), ("prefill_ctx", 0), ("prefill_attn", 0), ("pairs", 0.0),
                 ("other_kv", 0), ("prefill_setup", 0.0))
        if self.model.num_sliding_layers:  # (the sliding layers' prompt terms: no prompt, no pair)
            zeros += (("window_pairs", 0.0), ("window_other_kv", 0))
        if self._allreduce_per_token and self._allreduce_token_s == 0.0:
            zeros += (("allreduce", 0.0),)
        if self._allreduce_fixed_s == 0.0:
            zeros += (("allreduce_fixed", 0.0),)
        return zeros

    def _tp_allreduce(self, minimum):
        """Seconds of one layer's two tensor-parallel all-reduces as a function of the step's
        tokens (`_allreduce_fixed_s` comes on top: a generic link's latency). On PCIe, NCCL's ring
        with the faster of its LL and Simple protocols (`pcie_collective`), or vLLM's custom
        all-reduce (custom_all_reduce.py, 0.19), which runs on PCIe for exactly two GPUs with
        peer-to-peer access and messages under 8 MiB: one kernel reading the peer's data directly,
        priced at LL's handshake latency and the full bandwidth. On NVLink with custom_allreduce_eff
        set, messages under 8 MiB at that efficiency and larger ones at link_eff (NCCL's ring)."""
        token_s = self._allreduce_token_s
        if self._allreduce_per_token:
            return lambda tokens: tokens * token_s
        token_bytes = self.model.hidden_size * self.model.dtype_bytes
        if self.device.interconnect != "pcie":       # NVLink: custom_allreduce_eff below the custom kernel's size
            custom_s, custom_below = self._custom_allreduce_token_s, CUSTOM_ALLREDUCE_MAX_BYTES / token_bytes

            def custom_or_ring(tokens):
                small = tokens < custom_below
                return tokens * (small * custom_s + (1 - small) * token_s)
            return custom_or_ring
        (ll_fixed, ll_byte), (simple_fixed, simple_byte) = pcie_collective(self.device, self.tp, "all_reduce",
                                                                         self.coefficients)
        ll_fixed, ll_token = 2 * ll_fixed, 2 * ll_byte * token_bytes          # two per layer
        simple_fixed, simple_token = 2 * simple_fixed, 2 * simple_byte * token_bytes

        def nccl(tokens):
            return minimum(ll_fixed + tokens * ll_token, simple_fixed + tokens * simple_token)
        if self.tp != 2 or not self.device.peer_to_peer:
            return nccl
        custom_below = CUSTOM_ALLREDUCE_MAX_BYTES / token_bytes             # tokens

        def custom_or_nccl(tokens):
            small = tokens < custom_below
            return small * (ll_fixed + tokens * simple_token) + (1 - small) * nccl(tokens)
        return custom_or_nccl

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
        kernel = expert_kernel_share(mi if self.ep > 1 else mi / gpus, c.expert_n_half)
        self._expert_pair_flop_s = 6 * h * mi / gpus / (gemm_peak_flops(self.device, m, "experts") * c.flops_eff
                                                       * kernel)
        self._expert_read_s = m.expert_bytes() / gpus / (bw * c.bw_eff)
        # weight-only experts: each touched expert's weights dequantized once, and again per further
        # WEIGHT_ONLY_TILE_ROWS of its tokens (about touched + pairs / tile tiles in all)
        expert_weights = part_params(m, "experts") / (m.num_layers * m.num_experts) / gpus
        self._expert_dequant_s = (c.dequant_overhead * expert_weights * 2 * WEIGHT_ONLY_TILE_ROWS
                                  / (gemm_peak_flops(self.device, m, "experts") * c.flops_eff * kernel)
                                  if weight_only(self.device, m, "experts") else 0.0)
        self._expert_imbalance = expert_imbalance(m.num_experts, m.num_experts_per_tok, self.ep, c.expert_load_cv)
        # The dp ranks' token exchange around the experts, by --all2all-backend (vllm/distributed/
        # device_communicators/all2all.py, 0.19), with or without expert parallelism (tp only: the
        # MLP's all-reduce, counted with attention's). Per token of a rank's share:
        #   allgather_reducescatter (the default, 0.12-0.21): all-gather before, reduce-scatter after
        #   naive: each rank's tokens broadcast (an all-gather's bytes), an all-reduce of them all after
        #   all-to-all kernels (DeepEP, pplx, mori, NIXL-EP, FlashInfer): each token to the ranks of
        #     its experts and back, a share remote_ranks / (ep - 1) of an all-gather's bytes each way
        self._moe_comm_token_s = self._moe_comm_fixed_s = 0.0
        self._moe_exchange_pcie = None
        token_bytes = h * m.dtype_bytes
        backend = self.all2all_backend
        if self.dp > 1 and backend not in ("allgather_reducescatter", "naive"):
            share = remote_ranks(m.num_experts, m.num_experts_per_tok, self.ep) / (self.ep - 1) if self.ep > 1 else 1.0
            dispatch, combine = share, share
        else:
            dispatch, combine = 1.0, 1.0       # (naive's all-reduce: below)
        if self.dp > 1 and self.device.interconnect == "pcie":
            (ll_fixed, ll_byte), (simple_fixed, simple_byte) = pcie_collective(self.device, self.dp, "all_gather", c)
            if backend == "allgather_reducescatter":
                self._moe_exchange_pcie = ((2 * ll_fixed, 2 * ll_byte * token_bytes),
                                           (2 * simple_fixed, 2 * simple_byte * token_bytes))
            elif backend == "naive":         # the all-reduce's tensor: every rank's tokens
                (ar_ll_fixed, ar_ll_byte), (ar_simple_fixed, ar_simple_byte) = pcie_collective(
                    self.device, self.dp, "all_reduce", c)
                self._moe_exchange_pcie = (
                    (ll_fixed + ar_ll_fixed, (ll_byte + ar_ll_byte * self.dp) * token_bytes),
                    (simple_fixed + ar_simple_fixed, (simple_byte + ar_simple_byte * self.dp) * token_bytes))
            else:
                self._moe_exchange_pcie = ((2 * ll_fixed, (dispatch + combine) * ll_byte * token_bytes),
                                           (2 * simple_fixed, (dispatch + combine) * simple_byte * token_bytes))
        elif self.dp > 1:
            link = self.device.link_gbps * 1e9
            if backend == "allgather_reducescatter":
                self._moe_comm_token_s = 2 * (self.dp - 1) * token_bytes / link
            elif backend == "naive":         # ring all-reduce of dp shares: 2 (dp - 1) shares on the wire
                self._moe_comm_token_s = 3 * (self.dp - 1) * token_bytes / link
            else:
                self._moe_comm_token_s = (dispatch + combine) * (self.dp - 1) * token_bytes / link
            self._moe_comm_fixed_s = 2 * self.device.link_latency_s

    def moe_layer_time(self, tokens, maximum=max, gathered=None):
        """Seconds of one MoE layer on one GPU for a data-parallel rank's `tokens`, the ranks'
        together being `gathered` (unset: every dp rank with as many, as when vLLM pads them alike,
        `lockstep_times`): routed FLOPs vs touched experts' bytes, plus the token exchange."""
        return self._moe_time(maximum, min if maximum is max else np.minimum)(tokens, gathered)

    def _moe_time(self, maximum, minimum):
        """`moe_layer_time` as a function of the tokens, for the roofline."""
        m = self.model
        experts, top_k, dp, ep = m.num_experts, m.num_experts_per_tok, self.dp, self.ep
        pair_flop, expert_read, dequant = self._expert_pair_flop_s, self._expert_read_s, self._expert_dequant_s
        comm_token, comm_fixed, pcie = self._moe_comm_token_s, self._moe_comm_fixed_s, self._moe_exchange_pcie

        noise, skew, z = self._expert_imbalance
        serial = self.coefficients.expert_serial_share

        def moe(tokens, gathered=None):
            # every rank's tokens reach the experts: with unequal ranks (no padding) the exchange
            # moves their mean share per rank
            if gathered is None:
                global_tokens, share = tokens * dp, tokens
            else:
                global_tokens, share = gathered, gathered / dp
            touched = expected_experts_touched(experts, top_k, global_tokens)
            compute = global_tokens * top_k * pair_flop
            if dequant:
                compute = compute + (touched + global_tokens * top_k / WEIGHT_ONLY_TILE_ROWS) * dequant
            read = touched * expert_read
            if z:                       # whole experts per GPU: the busiest GPU sets the pace
                compute = compute * minimum(1 + z * (noise / maximum(global_tokens, 1) + skew) ** 0.5, ep)
                # the experts a GPU must read: Binomial(E / ep, q) of its own, q = touched / E
                hit = maximum(touched, top_k) / experts
                read = read * minimum(1 + z * ((1 - hit) * ep / (experts * hit)) ** 0.5, 1 / hit)
            experts_s = maximum(compute, read)
            if serial:                  # the part of the smaller the kernel does not hide
                experts_s = experts_s + serial * minimum(compute, read)
            if pcie is not None:        # the exchange's collectives, NCCL's faster protocol
                (ll_fixed, ll_token), (simple_fixed, simple_token) = pcie
                return experts_s + minimum(ll_fixed + share * ll_token, simple_fixed + share * simple_token)
            fixed = comm_fixed * (share > 0)
            return experts_s + share * comm_token + fixed
        return moe

    def lockstep_times(self, batches, after_idle: bool = False) -> list[tuple[float, float]]:
        """(host_s, device_s) of each rank's part of one step of a data-parallel engine whose ranks
        step together (sim/simulator.py); None for a rank with nothing scheduled, which runs vLLM's
        dummy batch of one token (gpu_worker.execute_dummy_batch, 0.19). The ranks agree on the
        tokens each runs (`dp_padding`, sim/dp.py: the largest rank's when every rank runs a CUDA
        graph, else its own), the GEMMs and the MoE layer's exchange run at those, the experts at
        all ranks' tokens together; attention, sampling and host work are each rank's own. The step
        lasts as long as the slowest rank's part (the MoE collectives join the ranks every layer)."""
        if self.draft is not None:       # (DraftCost.for_scenario refuses it first; a guard for direct use)
            raise ValueError("engine.speculative is not modelled for a data-parallel MoE engine (lockstep steps)")
        shapes = [(0, 0, 0, 0, 0, 0, 0) if b is None else
                  (b.num_decode + len(b.prefills), b.num_decode, b.num_prefill_tokens, b.prefill_ctx,
                   b.prefill_attn, b.decode_ctx, b.blocks_read) for b in batches]
        run = self.dp_padding.run_tokens([max(1, decodes + prefill_tokens)
                                          for _, decodes, prefill_tokens, *_ in shapes])
        gathered = sum(run)
        times = []
        for (seqs, decodes, prefill_tokens, prefill_ctx, prefill_attn, decode_ctx, blocks_read), own in zip(shapes, run):
            host, device = self._sizes(seqs, decodes, prefill_tokens, prefill_ctx, prefill_attn, own, gathered)(
                decode_ctx, blocks_read)
            if after_idle:
                host = self.woken(host)
            times.append((host, device))
        return times

    def woken(self, host, after_idle=True):
        """Host time of a step that follows an idle engine (`IDLE_GAP_S`): `wake_s` more. The one
        place the rule lives: step_time, lockstep_times, step_times (numpy columns, `after_idle` a
        bool array per step: `host + 0.0` where it is False, the same float) and the simulator's
        decode steps priced by a leap pricer. (A step's callers call it for idle steps alone: one
        call fewer on every other step.)"""
        return host + self.coefficients.wake_s * after_idle

    def step_time(self, batch, after_idle: bool = False) -> tuple[float, float]:
        """(host_s, device_s) for one step over `batch` (a scheduler Batch)."""
        if self.lora is not None:           # LoRA (no leaps then: every step is a Batch)
            host, device = self._lora_step_time(batch)
        elif self.draft is not None:        # speculative decoding (no leaps then: every step is a Batch)
            host, device = self._speculative_step_time(batch)
        else:
            decodes = batch.num_decode      # includes a static batch's padding rows
            host, device = self._price_step(decodes + len(batch.prefills), decodes, batch.num_prefill_tokens,
                                            batch.prefill_ctx, batch.prefill_attn, batch.decode_ctx,
                                            batch.blocks_read)
        if self._eager_launch_s and (self.runs_eagerly(len(batch.prefills), batch.num_decode)
                                     or self.eager_context is not None and batch.decodes
                                     and max(r.num_computed for r in batch.decodes) > self.eager_context):
            host += max(self._eager_launch_s - device, 0.0)
        if after_idle:
            host = self.woken(host)
        return host, device

    def _lora_step_time(self, batch) -> tuple[float, float]:
        """A step with LoRA serving on (sim/lora.py), before any wake-up: the step's price (with
        speculation's when it is on too), plus the adapters it copies into GPU slots and the punica
        kernels of every layer."""
        if self.draft is not None:
            host, device = self._speculative_step_time(batch)
        else:
            decodes = batch.num_decode
            host, device = self._price_step(decodes + len(batch.prefills), decodes, batch.num_prefill_tokens,
                                            batch.prefill_ctx, batch.prefill_attn, batch.decode_ctx,
                                            batch.blocks_read)
        if batch.lora is not None:
            device += self.lora.device_s(batch.lora)
        return host, device

    def _speculative_step_time(self, batch) -> tuple[float, float]:
        """A step with speculative decoding (sim/speculative.py): the target verifies each decode's
        drafts in the same forward, priced as that many more tokens (GEMMs, KV written and read)
        with their causal attention pairs, plus their rows of the LM head and the sampler; the
        drafter's forwards follow on the device. Before any wake-up."""
        decodes, spec = batch.num_decode, batch.spec_tokens
        seqs = decodes + len(batch.prefills)
        host, device = self._price_step(seqs, decodes, batch.num_prefill_tokens + spec, batch.prefill_ctx,
                                        batch.prefill_attn + batch.spec_attn, batch.decode_ctx, batch.blocks_read)
        if spec:
            head = max((seqs + spec) * self._head_flop_s, self._head_weight_s) - max(seqs * self._head_flop_s,
                                                                                      self._head_weight_s)
            device += head + spec * (self._sample_row_s + self.coefficients.sample_seq_s)
        if self.draft is not None:
            device += self.draft.device_s(batch)
        return host, device

    def price(self, seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, prefill_attn, blocks_read):
        """(host_s, device_s) of one step of this composition (STEP_SHAPE's order), before any wake-up."""
        return self._price_step(seqs, decodes, prefill_tokens, prefill_ctx, prefill_attn, decode_ctx, blocks_read)

    def runs_eagerly(self, prefills, decodes):
        """Does vLLM V0 run this step without its CUDA graphs (with numpy columns: per step)? Only a
        decode-only batch of at most the largest captured size runs one, and none under --enforce-eager
        (vllm/worker/model_runner.py ModelInputForGPUBuilder._use_captured_graph, 0.7.3; enforce_eager
        captures no size: `_graph_max_batch` 0). Its third condition, a decode context longer than
        max_seq_len_to_capture, needs the batch's longest context: step_time checks it
        (`eager_context`), and the leaps stop short of it."""
        return (prefills > 0) | (decodes > self._graph_max_batch)

    def decode_pricer(self, rows: int):
        """`price` of a decode-only step of `rows` sequences as a function of (decode context,
        blocks read), for a leap's steps (sim/simulator.py): the very same pricer with the
        terms that depend on the batch's sizes alone worked out once; with step_time's eager
        launches where `rows` runs eagerly (a property of the batch size alone)."""
        sizes = self._decode_sizes      # (None with operator tables: they fix no term)
        price = sizes(rows, rows, 0, 0, 0) if sizes is not None else self._sizes(rows, rows, 0, 0, 0)
        if not (self._eager_launch_s and self.runs_eagerly(0, rows)):
            return price
        launches = self._eager_launch_s

        def eager_price(decode_ctx, blocks_read):
            host, device = price(decode_ctx, blocks_read)
            return host + max(launches - device, 0.0), device
        return eager_price

    def step_times(self, steps) -> tuple[np.ndarray, np.ndarray]:
        """(host_s, device_s) arrays for recorded steps (a steps frame, or a dict of columns): the
        same pricer over numpy columns (each step with its own pool's block size, if recorded)."""
        seqs, decodes, prefill_tokens, decode_ctx, prefill_ctx, prefill_attn, blocks_read = (
            np.asarray(steps[name], dtype=float) for name in STEP_SHAPE)
        if self.tables is not None:       # table lookups are per step
            priced = np.array([self.price(*row) for row in zip(seqs, decodes, prefill_tokens, decode_ctx,
                                                               prefill_ctx, prefill_attn, blocks_read)],
                              dtype=float).reshape(-1, 2)
            host, device = priced[:, 0], priced[:, 1]
        else:
            block_size = np.asarray(steps["block_size"]) if "block_size" in steps else self.block_size
            sizes = self._stages(np.maximum, np.minimum, block_size)
            host, device = sizes(seqs, decodes, prefill_tokens, prefill_ctx, prefill_attn)(decode_ctx, blocks_read)
        if self._eager_launch_s:           # (step_time's eager launches)
            host = host + np.where(self.runs_eagerly(seqs - decodes, decodes),
                                   np.maximum(self._eager_launch_s - device, 0.0), 0.0)
        return self.woken(host, after_idle(steps)), device

    def _stages(self, maximum, minimum, block_size):
        """The step price of the module docstring, written once, in two stages: `sizes(seqs,
        decodes, prefill_tokens, prefill_ctx, prefill_attn)` works out what depends on the batch
        alone and returns `price(decode_ctx, blocks_read)`, which adds what depends on the decode
        contexts and returns (host_s, device_s) (a leap's decode steps differ in those only). `maximum` / `minimum`: max / min for one step (scalar_form
        generates that form), np.maximum / np.minimum for numpy columns (then `block_size` may be
        a column too: each recorded step's pool). Operator tables replace the roofline's device
        time (`_table_time`); host time and its overlap are the same.

        Attention is averaged over the layer types: full layers read every cached token and walk
        every block; sliding layers at most `sliding_window` tokens per sequence and the blocks the
        window still holds (vLLM nulls the rest: cdiv(window - 1, block_size) + 1), bounded from the
        step's sums (exact when every context is on one side of the window)."""
        c, m = self.coefficients, self.model
        step_host, seq_host, prefill_seq_host, token_host = (c.step_host_s, c.seq_host_s, c.prefill_seq_host_s,
                                                             c.token_host_s)
        output_token, launch, overlap = c.detok_token_s + c.api_token_s, c.graph_launch_s, self.async_scheduling
        tables = self.tables is not None
        # (a bound method only where tables price the step: a closure holding `self` would make a
        # cycle, cost model -> its pricer -> cost model, which only a full collection frees)
        table_time = self._table_time if tables else None
        linear_flop, linear_weight, linear_act = self._linear_flop_s, self._linear_weight_s, self._linear_act_s
        dequant_tile = self._dequant_tile_s
        moe = self._moe_time(maximum, minimum) if self._moe else None
        attn_pair, kv_token = self._attn_pair_s, self._kv_token_s
        layer_overhead, block_s, prefill_seq_overhead = c.layer_overhead_s, c.block_overhead_s, c.prefill_seq_overhead_s
        tp_allreduce, allreduce_fixed = self._tp_allreduce(minimum), self._allreduce_fixed_s
        # (a link priced per token, _tp_allreduce's usual form, is written out: no call per step)
        allreduce_token = self._allreduce_token_s if self._allreduce_per_token else None
        head_flop, head_weight, sample_row, sample_seq = (self._head_flop_s, self._head_weight_s, self._sample_row_s,
                                                          c.sample_seq_s)
        # (the layer count as a float: the same products, but a float by a float, which CPython 3.11
        # specialises, where an int by a float takes the generic path, at every priced step)
        step_device, layers = c.step_device_s, float(m.num_layers)
        full_layers, sliding_layers, window = m.num_full_layers, m.num_sliding_layers, m.sliding_window
        window_blocks = cdiv(window - 1, block_size) + 1 if sliding_layers else None

        def sizes(seqs, decodes, prefill_tokens, prefill_ctx, prefill_attn, padded=None, gathered=None):
            # (`padded`: the tokens the GEMMs run at, where vLLM pads the batch; `gathered`: every
            # dp rank's together, what the experts see: lockstep_times)
            host = (step_host + seq_host * seqs + prefill_seq_host * (seqs - decodes)
                    + token_host * (prefill_tokens + decodes))
            output = output_token * seqs
            serial_engine = launch + host          # (synchronous scheduling's engine time, below)
            if not tables:
                tokens = prefill_tokens + decodes if padded is None else padded
                gemm = tokens * linear_flop
                if dequant_tile:        # weight-only quantized: per tile of batch rows (WEIGHT_ONLY_TILE_ROWS)
                    gemm = gemm + -(-tokens // WEIGHT_ONLY_TILE_ROWS) * dequant_tile
                linear = maximum(gemm, linear_weight + tokens * linear_act)
                if moe is not None:
                    linear = linear + moe(tokens, gathered)
                base, prefill_setup = layer_overhead + linear, (seqs - decodes) * prefill_seq_overhead
                allreduce = tokens * allreduce_token if allreduce_token is not None else tp_allreduce(tokens)
                head = maximum(seqs * head_flop, head_weight) + seqs * sample_row + seqs * sample_seq
                pairs, other_kv = prefill_attn * attn_pair, prefill_ctx + prefill_tokens     # (integers: exact)
                if sliding_layers:      # (the sliding layers' terms the batch's sizes decide: integers, exact)
                    window_pairs = minimum(prefill_attn, prefill_tokens * window) * attn_pair
                    window_other_kv = minimum(prefill_ctx, (seqs - decodes) * window) + prefill_tokens
                    window_decode_kv, window_walk = decodes * window, seqs * window_blocks

            def price(decode_ctx, blocks_read):
                if tables:
                    device = table_time(seqs, decodes, prefill_tokens, prefill_ctx, decode_ctx, blocks_read)
                else:
                    attention = maximum(pairs, (decode_ctx + other_kv) * kv_token)
                    if sliding_layers:
                        window_kv = minimum(decode_ctx, window_decode_kv) + window_other_kv
                        sliding = maximum(window_pairs, window_kv * kv_token)
                        attention = (full_layers * attention + sliding_layers * sliding) / layers
                        window_walked = minimum(blocks_read, window_walk)
                        blocks_read = (full_layers * blocks_read + sliding_layers * window_walked) / layers
                    per_layer = base + attention + blocks_read * block_s + prefill_setup + allreduce + allreduce_fixed
                    device = step_device + layers * per_layer + head
                # the host time a step adds to the device's, by the engine's overlap rules: output
                # processing (detokenization, API streaming) runs in the API server's process and
                # only shows when slower than the engine's own step; synchronous scheduling puts the
                # scheduler's host work before each launch, async scheduling plans step N+1 while
                # step N runs (only its excess over the device time shows); the graph launch is serial
                engine = launch + maximum(host - device, 0.0) if overlap else serial_engine
                return engine + maximum(output - (engine + device), 0.0), device
            return price
        return sizes

    def _table_time(self, seqs, decodes, prefill_tokens, prefill_ctx, decode_ctx, blocks_read) -> float:
        """Device time from the operator tables (sim/optables.py) on this step's composition
        (dense full-attention models only)."""
        from sim.optables import bucket

        t, c = self.tables, self.coefficients
        seqs, decodes, prefill_tokens = int(seqs), int(decodes), int(prefill_tokens)
        prefills = seqs - decodes
        tokens = prefill_tokens + decodes
        per_layer = (t.linear_s(tokens) if tokens else 0.0) + c.layer_overhead_s + blocks_read * c.block_overhead_s
        if prefills:
            chunk = max(1, round(prefill_tokens / prefills))
            per_layer += prefills * t.context_s(chunk, bucket(prefill_ctx / prefills) if prefill_ctx else 0)
        if decodes:
            per_layer += t.generation_s(decodes, bucket(decode_ctx / decodes))
        per_layer += self._tp_allreduce(min)(tokens) + self._allreduce_fixed_s
        rows = seqs
        return (c.step_device_s + self.model.num_layers * per_layer + t.head_s(rows)
                + rows * (self._sample_row_s + c.sample_seq_s))

    def describe(self) -> dict:
        return {"calibrated": self.calibrated, "step_time_source": self.step_time_source,
                "async_scheduling": self.async_scheduling,
                "tables": self.tables.describe() if self.tables is not None else None,
                "source": self.profile.source, "quality": self.profile.fit.get("quality"),
                "coefficients": asdict(self.coefficients), "tp": self.tp}


# The one roofline's scalar forms (CostModel._moe_time_scalar, ...): what a single step is priced with.
_GENERATED = {"_stages", "_moe_time", "_tp_allreduce"}
for _name in ("_moe_time", "_tp_allreduce"):
    setattr(CostModel, _name + "_scalar", scalar_form(getattr(CostModel, _name), _GENERATED))
# `_stages`' scalar forms (one call, for a step; two stages for a leap's decode steps, with the
# terms such a step has at zero taken out; the general two stages where lockstep_times asks),
# made once per process for each kind a cost model asks for: any cost model (operator tables,
# known=()), and the roofline with what it fixes folded in (no sliding layer: the usual model; or
# some: a sliding-window model, whose steps a leap prices one by one). Made on first use, not at
# import: a run needs two forms of one kind, and each costs a parse, its rewrites and a compile
# (~10 ms, ~40M instructions).
_ROOFLINE_FULL_ATTENTION = (("sliding_layers", 0), ("tables", False))
_ROOFLINE_SLIDING = (("tables", False),)


@functools.cache
def _stages_scalar(known: tuple, one_call: bool = False, vanishing: bool = False) -> Callable:
    """A scalar form of `_stages` (see scalar_form): the two stages, or `one_call`, with what `known`
    fixes folded in, and with `vanishing` the terms it fixes at zero taken out (the decode-only form)."""
    return scalar_form(CostModel._stages, _GENERATED, one_call=one_call, known=known, vanishing=vanishing)
