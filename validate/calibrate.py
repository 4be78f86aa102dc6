"""Fit the cost model to the engine: profile step times over a designed grid, least squares.

The grid covers the batch compositions a serving run produces: decode batches (batch size
x context length, at several block sizes, so the per-block term is identifiable), prefill
chunks (with and without cached context) and mixed steps. Each point is a real step of the
engine on a probe batch built straight from the policy objects (blocks allocated by the
KVCacheManager; the KV contents do not matter for timing). The cost model's device-time
coefficients are fitted on log(predicted / measured) with bounded least squares, so every
point counts by its relative error; the host-side coefficients by linear least squares,
with the scheduler's own per-step cost included. A quarter of the grid is held out and its
error reported. Nothing is tuned per scenario.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd
import torch
import yaml

from engine.runner import ModelRunner
from sim.costmodel import STEP_SHAPE, CostCoefficients, CostModel, DeviceProfile
from sim.output.io import write_text
from sim.core.kv import KVCacheManager
from sim.core.memory import activation_peak_bytes, cdiv
from sim.core.request import make_request, stable_key
from sim.core.scheduler import Batch

# Device-time coefficients the fit moves (host ones are fitted separately, linearly).
DEVICE_COEFFICIENTS = ("flops_eff", "bw_eff", "attn_flops_eff", "attn_bw_eff", "block_overhead_s",
                       "layer_overhead_s", "prefill_seq_overhead_s", "step_device_s")


@dataclass(frozen=True)
class Grid:
    """The probe compositions, clipped at run time to the engine's limits and pool."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_contexts: tuple[int, ...] = (128, 512, 2048, 8192)
    prefill_chunks: tuple[int, ...] = (16, 64, 256, 1024, 2048, 4096, 8192)
    prefill_cached: tuple[int, ...] = (0, 1024)
    # several prompts in one step: (prompts, tokens each)
    prefill_batches: tuple[tuple[int, int], ...] = ((4, 256), (8, 512), (16, 256), (4, 2048))
    # decodes and prefill chunks together: (decodes, their context, prompts, tokens each)
    mixed: tuple[tuple[int, int, int, int], ...] = ((16, 1024, 1, 256), (64, 1024, 1, 1024), (128, 2048, 1, 512),
                                                    (32, 512, 4, 256), (256, 1024, 2, 2048))
    block_sizes: tuple[int, ...] = (8, 16, 32)
    repeats: int = 5

    @classmethod
    def cpu(cls) -> "Grid":
        """Small enough for a CPU and the tiny model: seconds, not minutes."""
        return cls(decode_batches=(1, 2, 4, 8, 16, 32), decode_contexts=(32, 128, 512),
                   prefill_chunks=(8, 32, 128, 256, 512), prefill_cached=(0, 256),
                   prefill_batches=((2, 64), (4, 32), (4, 128), (8, 32)),
                   mixed=((2, 64, 1, 32), (4, 128, 1, 64), (8, 256, 1, 128), (16, 256, 1, 256),
                          (8, 128, 2, 64), (4, 64, 4, 32)),
                   block_sizes=(8, 16, 32), repeats=5)


# ----------------------------------------------------------------------------- probing

def probe_batch(kv: KVCacheManager, seqs: list[tuple[int, int, bool]], tag: int) -> Batch:
    """A Batch of sequences (context before the step, new tokens, is decode), blocks allocated."""
    batch = Batch(step=0)
    for i, (context, new, decode) in enumerate(seqs):
        prompt = context if decode else context + new
        req = make_request(i, 0.0, [(stable_key("probe", tag, i), prompt)], 2)
        if not kv.allocate_slots(req, context + new):
            raise ValueError(f"probe of {len(seqs)} sequences at context {context} does not fit the pool")
        if decode:
            req.num_output = 1                   # one token generated: this step feeds it back
        req.num_computed = context
        batch.add(req, new, kv.block_size)
    return batch


def release(kv: KVCacheManager, batch: Batch) -> None:
    for req in batch.reqs:
        kv.free(req)


@dataclass(frozen=True)
class ProbeLimits:
    """What one engine can execute: the scheduler's caps and the pool it probes on."""

    max_tokens: int          # max_num_batched_tokens
    max_seqs: int            # max_num_seqs
    max_model_len: int       # no sequence's context + new tokens may exceed it
    num_blocks: int          # the pool, null block included
    block_size: int

    @classmethod
    def of(cls, scenario, num_blocks: int, block_size: Optional[int] = None) -> "ProbeLimits":
        return cls(scenario.max_num_batched_tokens, scenario.max_num_seqs, scenario.max_model_len,
                   num_blocks, block_size or scenario.engine.block_size)

    def blocks_needed(self, seqs: list) -> int:
        return sum(cdiv(ctx + new, self.block_size) for ctx, new, _ in seqs)

    def admits(self, seqs: list) -> bool:
        return (len(seqs) <= self.max_seqs and sum(new for _, new, _ in seqs) <= self.max_tokens
                and all(ctx + new <= self.max_model_len for ctx, new, _ in seqs)
                and self.blocks_needed(seqs) <= self.num_blocks - 1)


def grid_points(grid: Grid, limits: ProbeLimits) -> list[tuple[str, list]]:
    """(kind, seqs) for every probe the engine can run: within the token budget, the sequence
    cap, max_model_len per sequence (decode contexts beyond it are clipped to it), and the pool."""
    # Contexts past max_model_len are probed at its limit instead: long-context decode stays covered.
    contexts = sorted({min(c, limits.max_model_len - 1) for c in grid.decode_contexts})
    candidates = [("decode", [(c, 1, True)] * b) for b in grid.decode_batches for c in contexts]
    candidates += [("prefill", [(k, p, False)]) for p in grid.prefill_chunks for k in grid.prefill_cached]
    candidates += [("prefill", [(0, p, False)] * n) for n, p in grid.prefill_batches]
    candidates += [("mixed", [(c, 1, True)] * b + [(0, p, False)] * n) for b, c, n, p in grid.mixed]
    return [(kind, seqs) for kind, seqs in candidates if limits.admits(seqs)]


@dataclass(frozen=True)
class ProbePool:
    """One pool the calibration probes on: its block size, size in blocks, and its probes."""

    block_size: int
    num_blocks: int
    points: list


def probe_pools(grid: Grid, limits: ProbeLimits, extra_pool_tokens: int) -> list[ProbePool]:
    """The scenario's own pool with the whole grid, then one small pool per other block size
    holding the decode probes (they make the per-block term identifiable) whose KV fits in
    `extra_pool_tokens`; each extra pool is sized to its largest probe, not to the main pool."""
    points = grid_points(grid, limits)
    pools = [ProbePool(limits.block_size, limits.num_blocks, points)]
    decode = [p for p in points if p[0] == "decode"]
    for bs in grid.block_sizes:
        if bs == limits.block_size:
            continue
        cap = replace(limits, block_size=bs, num_blocks=extra_pool_tokens // bs + 1)
        fitting = [p for p in decode if cap.admits(p[1])]
        if fitting:
            need = max(cap.blocks_needed(seqs) for _, seqs in fitting) + 1
            pools.append(ProbePool(bs, need, fitting))
    return pools


def planned_extra_pool_tokens(plan) -> int:
    """extra_pool_tokens as a memory plan foresees it (no device needed): half of what the
    weights, activations, pool and reserve leave of the torch-visible memory."""
    left = plan.visible_bytes - plan.predicted_peak_bytes - plan.reserved_bytes
    return max(int(0.5 * left), 0) // plan.kv_bytes_per_token


def extra_pool_tokens(runner: ModelRunner) -> int:
    """Token capacity the extra block-size pools may use, each allocated (and freed) in turn:
    half the device memory still free on a GPU; on CPU as many tokens as the main pool."""
    per_token = runner.kv_cache[:, :, 0, 0].numel() * runner.kv_cache.element_size()
    if runner.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(runner.device)
        return int(0.5 * free) // per_token
    return (runner.num_blocks - 1) * runner.block_size


def measure_points(runner: ModelRunner, points: list[tuple[str, list]], repeats: int,
                   progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Median host and device time of each probe (after one warm-up execution; with
    repeats=0 the single execution is the sample, which only proves the probe runs)."""
    rows = []
    kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_caching=False)
    for tag, (kind, seqs) in enumerate(points):
        samples = []
        for attempt in range(repeats + 1):
            batch = probe_batch(kv, seqs, tag)
            result = runner.execute(batch)
            if attempt or not repeats:          # the first run compiles and warms; repeats=0 keeps it
                samples.append((result.host_s, result.device_s))
            shape = _shape(batch)
            release(kv, batch)
        rows.append({"kind": kind, "block_size": runner.block_size, **shape,
                     "host_s": statistics.median(s[0] for s in samples),
                     "device_s": statistics.median(s[1] for s in samples),
                     "device_spread": _spread([s[1] for s in samples])})
        if progress:
            progress(f"{kind} {len(seqs)} seqs")
    return rows


def _shape(batch: Batch) -> dict:
    return {"num_seqs": batch.num_seqs, "decode_seqs": batch.num_decode, "prefill_tokens": batch.num_prefill_tokens,
            "decode_ctx": batch.decode_ctx, "prefill_ctx": batch.prefill_ctx, "prefill_attn": batch.prefill_attn,
            "blocks_read": batch.blocks_read}


def _spread(values: list[float]) -> float:
    """(max - min) / median: how repeatable one probe is."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else 0.0


# ----------------------------------------------------------------------------- fitting

def fit_device(samples: pd.DataFrame, model, device, tp: int = 1,
               start: Optional[CostCoefficients] = None) -> CostCoefficients:
    """Bounded least squares on log(predicted/measured) device time over the samples."""
    from scipy.optimize import least_squares

    start = start or CostCoefficients()
    x0 = np.log([getattr(start, n) for n in DEVICE_COEFFICIENTS])
    measured = samples["device_s"].to_numpy()

    def residuals(x: np.ndarray) -> np.ndarray:
        coeffs = replace(start, **dict(zip(DEVICE_COEFFICIENTS, np.exp(x))))
        _, predicted = CostModel(model, device, tp, DeviceProfile(coeffs)).step_times(samples)
        return np.log(predicted / measured)

    lower = np.log([1e-6] * 4 + [1e-12, 1e-9, 1e-10, 1e-9])
    upper = np.log([1e3] * 4 + [1e-3, 1e-1, 1e-2, 1e-1])
    fit = least_squares(residuals, np.clip(x0, lower + 1e-9, upper - 1e-9), bounds=(lower, upper),
                        loss="soft_l1", f_scale=0.1, x_scale="jac", max_nfev=2000)
    return replace(start, **dict(zip(DEVICE_COEFFICIENTS, np.exp(fit.x))))


HOST_TERMS = ("step_host_s", "seq_host_s", "prefill_seq_host_s", "token_host_s")


def fit_host(steps: pd.DataFrame) -> dict[str, float]:
    """Non-negative least squares of the host coefficients on replayed steps' host time."""
    from scipy.optimize import nnls

    decodes = steps["decode_seqs"].to_numpy(dtype=float)
    seqs = steps["num_seqs"].to_numpy(dtype=float)
    tokens = steps["prefill_tokens"].to_numpy(dtype=float) + decodes
    a = np.column_stack([np.ones(len(steps)), seqs, seqs - decodes, tokens])
    coeffs, _ = nnls(a, steps["host_s"].to_numpy(dtype=float))
    return dict(zip(HOST_TERMS, map(float, coeffs)))


def fit_quality(samples: pd.DataFrame, cost: CostModel) -> dict:
    """R^2 of device time, and median / p90 relative error per step kind."""
    _, predicted = cost.step_times(samples)
    measured = samples["device_s"].to_numpy()
    rel = np.abs(predicted - measured) / measured
    ss_res = float(((predicted - measured) ** 2).sum())
    ss_tot = float(((measured - measured.mean()) ** 2).sum())
    out = {"points": int(len(samples)), "r2": 1 - ss_res / ss_tot if ss_tot else None,
           "median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.percentile(rel, 90))}
    for kind, idx in samples.groupby("kind").groups.items():
        r = rel[samples.index.get_indexer(idx)]
        out[kind] = {"points": int(len(r)), "median_rel_error": float(np.median(r)),
                     "p90_rel_error": float(np.percentile(r, 90))}
    return out


def held_out(samples: pd.DataFrame, fraction: float = 0.25, seed: int = 0) -> np.ndarray:
    """A deterministic mask selecting ~fraction of the points (stratified by kind) for testing."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(samples), dtype=bool)
    for _, idx in samples.groupby("kind").groups.items():
        pos = samples.index.get_indexer(idx)
        n_test = max(1, int(round(fraction * len(pos)))) if len(pos) > 3 else 0
        mask[rng.choice(pos, size=n_test, replace=False)] = True
    return mask


# ----------------------------------------------------------------------------- end to end

@dataclass
class Calibration:
    profile: DeviceProfile
    samples: pd.DataFrame          # probe grid points (+ replayed steps), with the fit's prediction
    train_quality: dict
    test_quality: dict


def calibration_scenario(scenario, isolated: bool = False):
    """The scenario with a fixed synthetic workload. The default replay exercises the whole
    engine loop (admissions, prefix hits, chunked prefills, decodes) to fit the host terms;
    the `isolated` one sends short requests far apart, so each starts on an idle engine."""
    from sim.scenario import validate_scenario

    raw = scenario.model_dump(mode="json", exclude={"variants", "workload", "name"}, exclude_none=True)
    budget = scenario.max_num_batched_tokens
    if isolated:
        raw["workload"] = {"num_requests": 12, "arrival": {"process": "fixed", "rate": 8},
                           "prompt_len": 32, "output_len": 4}
    else:
        raw["workload"] = {
            "num_requests": 6 * min(scenario.max_num_seqs, 32), "arrival": {"process": "offline"},
            "prompt_len": {"dist": "uniform", "min": 8, "max": max(16, min(budget, scenario.max_model_len // 2))},
            "output_len": {"dist": "uniform", "min": 2, "max": 48},
            "shared_prefix": {"groups": 2, "length": 32, "fraction": 0.5}}
    raw["name"] = f"calibration-{scenario.model.name}{'-isolated' if isolated else ''}"
    return validate_scenario(raw)


def fit_wake(steps: pd.DataFrame, cost: CostModel) -> float:
    """Median extra time of steps that follow an idle engine, beyond what the fit predicts."""
    from sim.costmodel import after_idle

    idle = after_idle(steps)
    host, device = cost.step_times(steps)
    extra = (steps["end_s"] - steps["start_s"]).to_numpy() - (host + device)
    return max(float(np.median(extra[idle])), 0.0) if idle.any() else 0.0


def calibrate(scenario, device: str = "cpu", grid: Optional[Grid] = None,
              progress: Optional[Callable[[str], None]] = None) -> Calibration:
    """Profile the engine for the scenario's model on `device` and fit a DeviceProfile."""
    from engine.replay import replay

    grid = grid or (Grid.cpu() if device == "cpu" else Grid())
    base = ModelRunner.from_scenario(scenario, device)
    probes = pd.DataFrame(_measure_grid(scenario, base, grid, progress))
    if progress:
        progress("replaying the calibration workload")
    loop = replay(calibration_scenario(scenario), runner=base, online=False).steps
    loop = loop.assign(kind=_step_kinds(loop), block_size=base.block_size, device_spread=np.nan)
    test = held_out(probes)
    device_train = pd.concat([probes[~test], _subsample(loop, 200)], ignore_index=True)
    coeffs = fit_device(device_train, scenario.model, scenario.device, scenario.parallelism.tp)
    coeffs = replace(coeffs, **fit_host(loop))
    isolated = replay(calibration_scenario(scenario, isolated=True), runner=base).steps
    coeffs = replace(coeffs, wake_s=fit_wake(isolated, CostModel(
        scenario.model, scenario.device, scenario.parallelism.tp, DeviceProfile(coeffs), block_size=base.block_size)))
    profile = DeviceProfile(coeffs, calibrated=True, device_name=scenario.device.name,
                            model_name=scenario.model.name,
                            source=f"calibrated on {device} with {scenario.model.name} "
                                   f"({scenario.model.dtype}), {datetime.now(timezone.utc):%Y-%m-%d}",
                            activation_scale=_activation_scale(scenario, base))
    cost = CostModel(scenario.model, scenario.device, scenario.parallelism.tp, profile, block_size=base.block_size)
    train_q = fit_quality(device_train, cost)
    test_q = fit_quality(probes[test].reset_index(drop=True), cost) if test.any() else {}
    host_rel = np.abs(cost.step_times(loop)[0] - loop["host_s"]) / loop["host_s"]
    profile.fit = {"device_train": train_q, "device_held_out": test_q,
                   "host_median_rel_error": float(np.median(host_rel)),
                   "grid_points": int(len(probes)), "replayed_steps": int(len(loop)),
                   "probe_repeatability_median": float(probes["device_spread"].median())}
    probes["held_out"] = test
    probes["predicted_device_s"] = cost.step_times(probes)[1]
    return Calibration(profile, probes, train_q, test_q)


def _measure_grid(scenario, base: ModelRunner, grid: Grid, progress) -> list[dict]:
    limits = ProbeLimits.of(scenario, base.num_blocks, base.block_size)
    pools = probe_pools(grid, limits, extra_pool_tokens(base))
    # Decode probes run as the served steps will: through CUDA graphs where the engine uses them.
    base.capture_graphs(scenario.max_num_seqs)
    rows = measure_points(base, pools[0].points, grid.repeats, progress)
    for pool in pools[1:]:
        runner = ModelRunner(base.model, pool.num_blocks, pool.block_size, scenario.max_model_len)
        runner.capture_graphs(max(len(seqs) for _, seqs in pool.points))
        rows += measure_points(runner, pool.points, grid.repeats, progress)
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base.bind()                                 # each ModelRunner binds the model to its own pool
    return rows


def _step_kinds(steps: pd.DataFrame) -> np.ndarray:
    return np.where(steps["prefill_tokens"] == 0, "decode", np.where(steps["decode_seqs"] == 0, "prefill", "mixed"))


def _subsample(steps: pd.DataFrame, n: int) -> pd.DataFrame:
    """At most n steps, every kind kept in proportion (deterministic)."""
    if len(steps) <= n:
        return steps
    return steps.iloc[np.linspace(0, len(steps) - 1, n).astype(int)]


def _activation_scale(scenario, runner: ModelRunner) -> Optional[float]:
    """Measured activation peak / sim.core.memory's estimate (GPU only; None keeps the estimate)."""
    plan = runner.plan
    if plan is None or runner.device.type != "cuda" or scenario.engine.activation_mib is not None:
        return None
    tokens = scenario.max_num_batched_tokens
    rows = min(tokens, scenario.max_num_seqs)
    logits = activation_peak_bytes(scenario.model, 0, rows, scenario.parallelism.tp)
    unscaled = activation_peak_bytes(scenario.model, tokens, rows, scenario.parallelism.tp) - logits
    return max(plan.activation_bytes - logits, 0) / unscaled if unscaled else None


def write_profile(path: str | Path, calibration: Calibration) -> Path:
    data = calibration.profile.to_dict()
    header = ("# kvtwin device profile, written by `simrun calibrate`. Load it with\n"
              "#   simrun SCENARIO --set device.profile=THIS_FILE\n")
    return write_text(path, header + yaml.safe_dump(_plain(data), sort_keys=False))


def _plain(value):
    """numpy scalars and nested containers -> plain Python for YAML."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def coefficients_table(profile: DeviceProfile) -> pd.DataFrame:
    default = CostCoefficients()
    return pd.DataFrame({"fitted": asdict(profile.coefficients), "default": asdict(default)})


__all__ = ["Grid", "Calibration", "calibrate", "write_profile", "fit_device", "fit_host", "fit_quality",
           "probe_batch", "grid_points", "ProbeLimits", "ProbePool", "probe_pools", "measure_points", "held_out", "coefficients_table", "STEP_SHAPE"]
