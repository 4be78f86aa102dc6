"""`simrun calibrate --from-vllm`: fit the cost model to measured vLLM runs of one deployment.

Each `vllm bench serve --save-result --save-detailed` file is replayed through the simulator
with the deployment's engine settings (its own requests: start times or rate, input and
output lengths). The coefficients below are fitted by bounded least squares on
log(predicted / measured) per request, for TTFT, TPOT and E2E, each metric weighted equally
and each run equally whatever its size:

    compute_scale   x flops_eff and attn_flops_eff   (GEMM and attention compute efficiency)
    memory_scale    x bw_eff and attn_bw_eff         (weight and KV streaming efficiency)
    step_host_s     host time per step               (scheduling, input preparation)
    seq_host_s      host time per sequence per step  (the scheduler's and runner's per-row work)
    link_eff        tp all-reduce link efficiency    (tp > 1 only)
  and the named per-step terms of a CUDA-graph engine (sim/costmodel.py):
    graph_launch_s  the graph replay launch, per step, never hidden
    sample_seq_s    sampling per sequence, device time
    detok_token_s   detokenization per sequence per step, in the API server's process
    api_token_s     the API server's streaming per sequence per step

Only the terms these runs can tell apart are fitted (`identifiable_terms`): before the fit, each
host term's effect on the residuals (turned on at a typical value) is compared with the scales'
sensitivities and the terms already kept; a term with no visible effect (host work hidden behind
the device under async scheduling, output processing faster than the engine) or whose effect is
nearly a combination of the kept ones (detok_token_s and api_token_s only ever act as their sum;
seq_host_s and sample_seq_s as one per-sequence cost with synchronous scheduling) keeps the
profile's value and is listed in the profile's `fit.unidentifiable` with the reason.

Held out: with two or more runs the last one (or --hold-out) is not fitted and its errors are
reported per metric; with one run only TPOT is fitted and TTFT/E2E are reported as checks.
The profile written is the fitted one, with its provenance and quality; it is marked, and the
command warns, when the fit is poor or a coefficient leaves its physical range (an efficiency
above 1 is not a fit: it is a missing term).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd

from sim.core.memory import plan_memory
from sim.costmodel import CostCoefficients, CostModel, DeviceProfile
from sim.records import requests_frame
from sim.simulator import Simulation
from sim.vllm.results import VllmResult, to_requests

METRICS = ("ttft_s", "tpot_s", "e2e_s")
# (name, lower, upper, physical upper): the fit's bounds are wider than the physical range
# so that a coefficient pushed outside it shows up instead of sticking to a bound silently.
PARAMETERS = {
    "compute_scale": (0.05, 3.0, None),      # bound on the resulting efficiencies checked below
    "memory_scale": (0.05, 3.0, None),
    "step_host_s": (1e-6, 0.2, 0.05),
    "seq_host_s": (1e-8, 2e-3, 5e-4),
    "link_eff": (0.01, 3.0, 1.0),
    "graph_launch_s": (1e-7, 0.02, 2e-3),    # a CUDA-graph replay: ~10-100 us
    "sample_seq_s": (1e-9, 1e-3, 1e-4),      # a sampled row on the device: ~1-10 us
    "detok_token_s": (1e-8, 5e-3, 5e-4),     # incremental detokenization of one token: ~5-50 us
    "api_token_s": (1e-8, 5e-3, 1e-3),       # one streamed chunk through the OpenAI server: ~10-100 us
}
SCALES = ("compute_scale", "memory_scale", "link_eff")
# in the order they are kept: a term that acts like one before it is left out (api_token_s first of
# the two output terms: the API server is the usual bottleneck, and only their sum acts)
HOST_TERMS = ("step_host_s", "seq_host_s", "graph_launch_s", "sample_seq_s", "api_token_s", "detok_token_s")
# A typical value of each host term, at which its effect is probed (and its fit starts when kept).
PROBE = {"step_host_s": 200e-6, "seq_host_s": 10e-6, "graph_launch_s": 50e-6, "sample_seq_s": 5e-6,
         "detok_token_s": 30e-6, "api_token_s": 30e-6}
NO_EFFECT = 2e-3       # RMS change of log latency below which a term does not show in these runs
COLLINEAR = 0.15       # share of a term's effect outside the kept terms' span below which it is not told apart
EFFICIENCIES = ("flops_eff", "attn_flops_eff", "bw_eff", "attn_bw_eff", "link_eff")
POOR_FIT = 0.10       # mean relative error of a metric's per-request mean beyond which a fit is poor


@dataclass
class Replay:
    """One run ready to simulate: its requests and measured latencies, in arrival order.

    `summary`: only the run's means are known (a pasted benchmark printout); predictions are
    then reduced to means too. `scenario`: the run's own deployment settings where they differ
    from the shared one (e.g. its KV pool from its startup log)."""

    run: Optional[VllmResult]
    requests: list
    measured: dict[str, np.ndarray]
    notes: list[str]
    summary: bool = False
    scenario: object = None
    label: str = ""
    series: Optional[pd.DataFrame] = None      # sim.vllm.timeseries.load_series: running, waiting, KV %
    series_offset: Optional[float] = None      # run time = series t_s + offset (aligned on first replay)
    series_how: str = ""

    @classmethod
    def of(cls, run: VllmResult, seed: int = 0, scenario=None) -> "Replay":
        """Per request with --save-detailed data, else from the run's summary (a printout)."""
        if not run.detailed:
            return cls.from_summary(run, seed, scenario)
        requests, notes = to_requests(run, seed)
        return cls(run, requests, run.latencies(), notes, scenario=scenario, label=run.source)

    @classmethod
    def from_summary(cls, run: VllmResult, seed: int = 0, scenario=None) -> "Replay":
        """`completed` requests of the mean input and output length, sent at the run's rate (all
        at t=0 for rate inf); measured: mean TTFT, mean TPOT and the duration."""
        from sim.core.request import make_request, stable_key
        from sim.vllm.results import VllmResultError, arrival_times

        m = run.metrics
        missing = [k for k in ("completed", "total_input_tokens", "total_output_tokens", "duration",
                               "mean_ttft_ms", "mean_tpot_ms") if not m.get(k)]
        if missing:
            raise VllmResultError(f"{run.source}: a summary-only run needs {', '.join(missing)} to be replayed")
        n = int(m["completed"])
        prompt, output = max(1, round(m["total_input_tokens"] / n)), max(1, round(m["total_output_tokens"] / n))
        times, notes = arrival_times(run, n, seed)
        key = stable_key("public-run", run.source)
        requests = [make_request(i, float(times[i]), [(stable_key(key, i), prompt)], output) for i in range(n)]
        measured = {"ttft_s": np.array([m["mean_ttft_ms"] / 1e3]), "tpot_s": np.array([m["mean_tpot_ms"] / 1e3]),
                    "duration_s": np.array([float(m["duration"])])}
        notes = notes + [f"{run.source}: summary only: {n} requests of the mean lengths {prompt}/{output}"]
        return cls(run, requests, measured, notes, summary=True, scenario=scenario, label=run.source)


@dataclass
class VllmFit:
    profile: DeviceProfile
    parameters: dict[str, float]
    errors: pd.DataFrame                 # per run and metric: measured, predicted, error, role
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unidentifiable: dict[str, str] = field(default_factory=dict)   # host term -> why it was not fitted


def coefficients_from(params: dict[str, float], base: CostCoefficients) -> CostCoefficients:
    return replace(base,
                   flops_eff=base.flops_eff * params.get("compute_scale", 1.0),
                   attn_flops_eff=base.attn_flops_eff * params.get("compute_scale", 1.0),
                   bw_eff=base.bw_eff * params.get("memory_scale", 1.0),
                   attn_bw_eff=base.attn_bw_eff * params.get("memory_scale", 1.0),
                   link_eff=params.get("link_eff", base.link_eff),
                   **{term: params.get(term, getattr(base, term)) for term in HOST_TERMS})


def simulate_replay(scenario, replay: Replay, coefficients: CostCoefficients, plan=None) -> dict[str, np.ndarray]:
    """Predicted per-request latencies of one run under `coefficients`, in arrival order (means
    for a summary-only run), and the run's duration (first send to last token)."""
    scenario = replay.scenario or scenario
    cost = CostModel.for_scenario(scenario, DeviceProfile(coefficients))
    plan = plan_memory(scenario) if replay.scenario is not None or plan is None else plan
    for r in replay.requests:
        r.reset()
    records = Simulation(scenario, replay.requests, plan, cost).run()
    frame = requests_frame(records)
    out = {m: frame[m].to_numpy(dtype=float) for m in METRICS}
    if replay.summary:
        out = {m: np.array([np.nanmean(v)]) for m, v in out.items()}
    out["duration_s"] = np.array([float((frame["arrival_s"] + frame["e2e_s"]).max() - frame["arrival_s"].min())])
    if replay.series is not None:
        out.update(_series_predicted(replay, records.steps_frame(), plan.usable_blocks))
    return out


SERIES_METRICS = ("series_load", "series_kv")    # running + waiting, and KV %, at each measured sample


def _series_predicted(replay: Replay, steps: pd.DataFrame, kv_blocks: int) -> dict[str, np.ndarray]:
    """The predicted load and KV % at the measured samples. Time stamps (request lines, wall clocks)
    align the curve once; without them the best-fitting offset is searched again at every replay,
    since it moves with the step times being fitted (sim.vllm.timeseries.align_offset)."""
    from sim.vllm.timeseries import align_offset, predicted_at

    if replay.series_offset is None or replay.series_how.startswith("fitted"):
        arrivals = np.array([r.arrival for r in replay.requests], dtype=float)
        replay.series_offset, replay.series_how = align_offset(replay.series, steps, kv_blocks, arrivals_s=arrivals)
    predicted = predicted_at(steps, kv_blocks, replay.series["t_s"].to_numpy(float) + replay.series_offset)
    return {"series_load": (predicted["running"] + predicted["waiting"]).to_numpy(float),
            "series_kv": predicted["kv_usage_pct"].to_numpy(float)}


def series_measured(series: pd.DataFrame) -> dict[str, np.ndarray]:
    return {"series_load": (series["running"] + series["waiting"]).to_numpy(float),
            "series_kv": series["kv_usage_pct"].to_numpy(float)}


def _residuals(predicted: dict, measured: dict, metrics: tuple[str, ...]) -> np.ndarray:
    """Per metric: log(predicted / measured) per request, the block scaled to count once, plus
    the log ratio of the means. A single request's TTFT jumps by a whole step when its arrival
    crosses a step boundary; the mean moves smoothly and keeps the fit on its trend."""
    parts = []
    for m in metrics:
        if m not in measured or m not in predicted:
            continue
        p, q = predicted[m], measured[m]
        if m.startswith("series_"):          # curves: differences over the measured peak, per sample
            ok = np.isfinite(p) & np.isfinite(q)
            if ok.any():
                scale = max(float(np.abs(q[ok]).max()), 1e-9)
                parts.append((p[ok] - q[ok]) / scale / np.sqrt(ok.sum()))
            continue
        ok = np.isfinite(p) & np.isfinite(q) & (p > 0) & (q > 0)
        if ok.any():
            parts.append(np.log(p[ok] / q[ok]) / np.sqrt(ok.sum()))
            parts.append([np.log(p[ok].mean() / q[ok].mean())])
    return np.concatenate(parts) if parts else np.zeros(1)


def fit_runs(scenario, replays: list[Replay], metrics: tuple[str, ...], names: list[str],
             base: CostCoefficients, progress: Optional[Callable[[str], None]] = None,
             max_iterations: int = 20, polish_evaluations: int = 80,
             start: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Bounded least squares in log space over the named parameters (see `levenberg_marquardt`),
    from `start` where given, else from the best uniform slow-down of the profile's values."""
    residuals = residual_function(scenario, replays, metrics, names, base)
    lower, upper = _bounds(names)
    x0 = np.clip(np.log([(start or {}).get(n) or _start(n, base) for n in names]), lower, upper)
    if start is None:
        x0 = _best_common_scale(residuals, x0, names, lower, upper)
    if any(n in HOST_TERMS for n in names):
        # the means first: smooth in every parameter, so small host terms are not lost in the
        # step jumps of single requests' latencies; then a few steps on every request
        means = residual_function(scenario, replays, metrics, names, base, means_only=True)
        x0 = levenberg_marquardt(means, x0, lower, upper, min(max_iterations, 8), progress)
        max_iterations = min(max_iterations, 4)
    x = levenberg_marquardt(residuals, x0, lower, upper, max_iterations, progress)
    x = _polish(residuals, x, lower, upper, progress, polish_evaluations)
    return dict(zip(names, map(float, np.exp(x))))


def residual_function(scenario, replays: list[Replay], metrics: tuple[str, ...], names: list[str],
                      base: CostCoefficients, means_only: bool = False) -> Callable[[np.ndarray], np.ndarray]:
    """x (the log of each named parameter) -> the stacked residuals of every run (`means_only`:
    `_mean_residuals`, free of the per-request step jumps)."""
    plan = plan_memory(scenario)
    halves = [_prompt_halves(r) for r in replays]

    def residuals(x: np.ndarray) -> np.ndarray:
        coeffs = coefficients_from(dict(zip(names, np.exp(x))), base)
        runs = [simulate_replay(scenario, r, coeffs, plan) for r in replays]
        if means_only:
            return np.concatenate([_mean_residuals(p, r.measured, metrics, h) for p, r, h in zip(runs, replays, halves)])
        return np.concatenate([_residuals(p, r.measured, metrics) for p, r in zip(runs, replays)])
    return residuals


def _prompt_halves(replay: Replay) -> Optional[np.ndarray]:
    """Which requests have a prompt longer than the run's median (None for a summary-only run or
    equal prompts): the two halves' means keep how latency grows with the prompt."""
    if replay.summary:
        return None
    prompts = np.array([r.prompt_len for r in replay.requests])
    longer = prompts > np.median(prompts)
    return longer if longer.any() and not longer.all() else None


def _mean_residuals(predicted: dict, measured: dict, metrics: tuple[str, ...],
                    longer: Optional[np.ndarray]) -> np.ndarray:
    """Per metric: the log ratio of predicted to measured mean, over the shorter and the longer
    half of the prompts separately where the run has both (smooth in every parameter)."""
    out = []
    for m in metrics:
        if m not in measured or m not in predicted or m.startswith("series_"):
            continue
        p, q = predicted[m], measured[m]
        ok = np.isfinite(p) & np.isfinite(q) & (p > 0) & (q > 0)
        groups = [ok] if longer is None or len(p) != len(longer) else [ok & longer, ok & ~longer]
        out += [np.log(p[g].mean() / q[g].mean()) for g in groups if g.any()]
    return np.array(out if out else [0.0])


def _bounds(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return np.log([PARAMETERS[n][0] for n in names]), np.log([PARAMETERS[n][1] for n in names])


def _start(name: str, base: CostCoefficients) -> float:
    """Where a parameter's fit starts: the scales at 1 (link_eff at the profile's), a host term at
    the profile's value or, where that is ~0, at a typical value (log space cannot start at 0)."""
    if name in ("compute_scale", "memory_scale"):
        return 1.0
    value = getattr(base, name)
    return max(value, PROBE[name]) if name in PROBE and value < PARAMETERS[name][0] * 10 else value


def identifiable_terms(scenario, replays: list[Replay], metrics: tuple[str, ...], names: list[str],
                       base: CostCoefficients) -> tuple[list[str], dict[str, str], dict[str, float]]:
    """The parameters among `names` these runs can tell apart, why each other one is left out, and
    where the fit should start (the scales' best uniform slow-down, a kept term at the value where
    its effect showed: below it a term that only shows beyond a threshold has no gradient).

    The scales are always kept. Each host term's effect is the change of the residuals when it goes
    from ~0 to twice its typical value (the others at ~0, the scales at the best uniform slow-down);
    kept in HOST_TERMS order when the effect shows (above NO_EFFECT in RMS log latency) and more than
    COLLINEAR of it lies outside the span of the scales' sensitivities and the terms kept before."""
    scales = [n for n in names if n not in HOST_TERMS]
    terms = [n for n in HOST_TERMS if n in names]
    if not terms:
        return names, {}, {}
    lows = {t: PARAMETERS[t][0] for t in terms}
    residuals = residual_function(scenario, replays, metrics, scales + terms, base, means_only=True)
    lower, upper = _bounds(scales + terms)
    x0 = np.log([_start(n, base) for n in scales] + [lows[t] for t in terms])
    x0 = _best_common_scale(residuals, x0, scales + terms, lower, upper)
    r0 = residuals(x0)
    columns, kept_names = [], []
    for k, n in enumerate(scales):                 # sensitivities of the scales (a 10% step)
        probe = x0.copy()
        probe[k] += 0.1
        columns.append((residuals(probe) - r0) / 0.1)
        kept_names.append(n)
    left_out = {}
    start = {n: float(np.exp(x0[k])) for k, n in enumerate(scales)}
    for j, t in enumerate(terms):
        probe = x0.copy()
        probe_value = 2 * max(PROBE[t], getattr(base, t))
        probe[len(scales) + j] = np.log(probe_value)
        effect = residuals(probe) - r0
        size = float(np.sqrt(np.mean(effect ** 2)))
        if size < NO_EFFECT:
            left_out[t] = (f"no visible effect on these runs (at {probe_value * 1e6:.0f} us it moves mean "
                           f"latencies by {size:.2%} RMS): hidden behind the device or the engine's step")
            continue
        basis = np.column_stack(columns)
        coef, *_ = np.linalg.lstsq(basis, effect, rcond=None)
        outside = float(np.linalg.norm(effect - basis @ coef) / np.linalg.norm(effect))
        if outside < COLLINEAR:
            share = np.abs(coef) * np.linalg.norm(basis, axis=0)
            like = kept_names[int(np.argmax(share))]
            left_out[t] = (f"not told apart from {like} on these runs (only {outside:.0%} of its effect "
                           f"is its own)")
            continue
        columns.append(effect)
        kept_names.append(t)
        start[t] = probe_value
    return [n for n in names if n not in left_out], left_out, start


PINNED = np.log(2)     # a fitted host term known within a factor 2 (one standard error) is kept


def unpinned_terms(scenario, replays: list[Replay], metrics: tuple[str, ...], params: dict[str, float],
                   base: CostCoefficients) -> dict[str, str]:
    """The fitted host terms these runs do not pin down, and why: the standard error of each
    log-parameter from the means' residuals at the fit (Jacobian J, residual variance s2 over
    the degrees of freedom, covariance s2 (J'J)^-1). A term whose effect trades off against
    another parameter (a per-step launch against the weight-streaming bandwidth in decode-only
    runs, say) has a large one; a term that went to ~0 shows no effect at all."""
    names = list(params)
    terms = [n for n in names if n in HOST_TERMS]
    if not terms:
        return {}
    residuals = residual_function(scenario, replays, metrics, names, base, means_only=True)
    lower, upper = _bounds(names)
    x = np.clip(np.log([params[n] for n in names]), lower, upper)
    r = residuals(x)
    jac = np.empty((len(r), len(x)))
    for k in range(len(x)):
        h = 0.1 if x[k] + 0.1 <= upper[k] else -0.1
        probe = x.copy()
        probe[k] += h
        jac[:, k] = (residuals(probe) - r) / h
    s2 = float(r @ r) / max(len(r) - len(x), 1)
    cov = s2 * np.linalg.pinv(jac.T @ jac)
    out = {}
    for k, n in enumerate(names):
        if n not in terms:
            continue
        if np.linalg.norm(jac[:, k]) < 1e-9:
            out[n] = f"fitted to {params[n]:.3g} s, where it has no visible effect: these runs do not show it"
            continue
        se = float(np.sqrt(max(cov[k, k], 0.0)))
        if se > PINNED:
            corr = [abs(cov[k, j]) / np.sqrt(max(cov[k, k] * cov[j, j], 1e-300)) if j != k else 0.0
                    for j in range(len(names))]
            out[n] = (f"fitted to {params[n]:.3g} s but these runs pin it only within a factor "
                      f"{np.exp(min(se, 7.0)):.3g} (it trades off against {names[int(np.argmax(corr))]})")
    return out


def _best_common_scale(residuals, x0: np.ndarray, names: list[str], lower, upper) -> np.ndarray:
    """Start from the best of a few uniform slow-downs of both efficiencies: datasheet defaults
    can be off by 2x, and a damped Gauss-Newton from far away can settle in a host-heavy valley."""
    scales = [k for k, n in enumerate(names) if n in ("compute_scale", "memory_scale")]
    best, best_cost = x0, np.inf
    for factor in (0.35, 0.5, 0.7, 1.0, 1.4):
        x = x0.copy()
        x[scales] = np.clip(x0[scales] + np.log(factor), lower[scales], upper[scales])
        r = residuals(x)
        if float(r @ r) < best_cost:
            best, best_cost = x, float(r @ r)
    return best


def _polish(residuals, x0: np.ndarray, lower, upper, progress, max_evaluations: int = 80) -> np.ndarray:
    """Nelder-Mead from where Gauss-Newton stopped: it needs no derivative, so the jumps of a
    discrete schedule that stall a gradient step do not stall it."""
    def cost(x: np.ndarray) -> float:
        r = residuals(np.clip(x, lower, upper))
        return float(r @ r)

    simplex = np.vstack([x0] + [x0 + 0.15 * np.eye(len(x0))[k] for k in range(len(x0))])
    best, best_cost, evaluations = nelder_mead(cost, np.clip(simplex, lower, upper), max_evaluations)
    if progress:
        progress(f"polish: cost {best_cost:.4g} after {evaluations} replays")
    return np.clip(best, lower, upper)


def nelder_mead(cost: Callable[[np.ndarray], float], simplex: np.ndarray, max_evaluations: int,
                xatol: float = 0.01, fatol: float = 1e-5) -> tuple[np.ndarray, float, int]:
    """The downhill simplex method (Nelder and Mead, 1965; standard coefficients: reflect 1,
    expand 2, contract 1/2, shrink 1/2), on numpy alone so the fit runs on the base install.
    Stops when the simplex is within `xatol` of its best vertex and its costs within `fatol`,
    or after `max_evaluations` costs. Returns (best point, its cost, evaluations)."""
    points = np.array(simplex, dtype=float)
    values = np.array([cost(p) for p in points])
    evaluations = len(points)
    while evaluations < max_evaluations:
        order = np.argsort(values, kind="stable")
        points, values = points[order], values[order]
        if (np.abs(points[1:] - points[0]).max() <= xatol and np.abs(values[1:] - values[0]).max() <= fatol):
            break
        centroid = points[:-1].mean(axis=0)
        worst = points[-1]
        reflected = centroid + (centroid - worst)
        f_reflected = cost(reflected)
        evaluations += 1
        if f_reflected < values[0]:
            expanded = centroid + 2 * (centroid - worst)
            f_expanded = cost(expanded)
            evaluations += 1
            points[-1], values[-1] = (expanded, f_expanded) if f_expanded < f_reflected else (reflected, f_reflected)
            continue
        if f_reflected < values[-2]:
            points[-1], values[-1] = reflected, f_reflected
            continue
        outside = f_reflected < values[-1]            # contract towards the better of the two
        contracted = centroid + 0.5 * ((reflected if outside else worst) - centroid)
        f_contracted = cost(contracted)
        evaluations += 1
        if f_contracted <= min(f_reflected, values[-1]):
            points[-1], values[-1] = contracted, f_contracted
            continue
        points[1:] = points[0] + 0.5 * (points[1:] - points[0])     # shrink towards the best
        values[1:] = [cost(p) for p in points[1:]]
        evaluations += len(points) - 1
    best = int(np.argmin(values))
    return points[best], float(values[best]), evaluations


MAX_STEP = 0.7        # at most a factor of 2 per parameter per iteration


def levenberg_marquardt(residuals: Callable[[np.ndarray], np.ndarray], x: np.ndarray, lower: np.ndarray,
                        upper: np.ndarray, max_iterations: int = 20,
                        progress: Optional[Callable[[str], None]] = None, step: float = 0.1) -> np.ndarray:
    """Damped Gauss-Newton inside a box, with a forward-difference Jacobian of a fixed `step`.

    A simulated run is piecewise smooth: a request whose arrival crosses a step boundary jumps.
    Differences over a 5% change (in log space) see the trend through those jumps, where a
    library solver's tiny adaptive steps see only the jumps and stall."""
    r = residuals(x)
    cost, damping = float(r @ r), 1e-3
    for iteration in range(max_iterations):
        jac = np.empty((len(r), len(x)))
        for k in range(len(x)):
            h = step if x[k] + step <= upper[k] else -step
            probe = x.copy()
            probe[k] += h
            jac[:, k] = (residuals(probe) - r) / h
        gradient, normal = jac.T @ r, jac.T @ jac
        improved = False
        while damping < 1e6:
            dx = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient)
            dx *= min(1.0, MAX_STEP / max(np.abs(dx).max(), 1e-12))
            candidate = np.clip(x + dx, lower, upper)
            r_new = residuals(candidate)
            cost_new = float(r_new @ r_new)
            if cost_new < cost:
                x, r, improved = candidate, r_new, True
                done = cost - cost_new < 1e-4 * cost
                cost, damping = cost_new, max(damping / 5, 1e-8)
                break
            damping *= 4
        if progress:
            progress(f"iteration {iteration + 1}: cost {cost:.4g}")
        if not improved or done:
            break
    return x


def run_errors(scenario, replay: Replay, coefficients: CostCoefficients, role: str, label: str) -> list[dict]:
    """Per metric: measured and predicted means, their relative error, and the median
    per-request relative error."""
    predicted = simulate_replay(scenario, replay, coefficients)
    rows = []
    for m in (m for m in replay.measured if m in predicted):
        p, q = predicted[m], replay.measured[m]
        ok = np.isfinite(p) & np.isfinite(q)
        if not ok.any():
            continue
        mp, mq = float(p[ok].mean()), float(q[ok].mean())
        if m.startswith("series_"):
            rows.append({"run": label or replay.label, "role": role, "metric": m, "measured_mean_s": mq,
                         "predicted_mean_s": mp, "error": mp / mq - 1 if mq else np.nan,
                         "median_request_error": float(np.median(np.abs(p[ok] - q[ok])) / max(np.abs(q[ok]).max(), 1e-9))})
            continue
        rows.append({"run": label or replay.label, "role": role, "metric": m.removesuffix("_s"), "measured_mean_s": mq,
                     "predicted_mean_s": mp, "error": mp / mq - 1 if mq else np.nan,
                     "median_request_error": float(np.median(np.abs(p[ok] / q[ok] - 1)))})
    return rows


def without_default_front_end(scenario):
    """The scenario a calibration replays: engine.front_end_s 0 unless set. The pooled API-server
    time (sim/front_end.py) is a default of uncalibrated answers; a fit carries the server's own
    host and API-server terms instead, and a prediction with the profile it writes runs without
    the pooled time too."""
    if scenario.engine.front_end_s is not None:
        return scenario
    copy = scenario.model_copy(deep=True)
    copy.engine.front_end_s = 0.0
    return copy


def held_out_run(hold_out: Optional[int], runs: int) -> Optional[int]:
    """The index of the run kept out of the fit: `hold_out` (--hold-out, 0-based), by default the
    last of two or more runs, none of one. An index past the runs is an error (it wrapped around:
    --hold-out 5 of two runs held out run 1), as is one for a single run (it was ignored)."""
    from sim.errors import UserError

    if hold_out is None:
        return runs - 1 if runs >= 2 else None
    if runs < 2:
        raise UserError(f"--hold-out {hold_out}: one run given, and a fit keeps a run out only of two or more")
    if not 0 <= hold_out < runs:
        raise UserError(f"--hold-out {hold_out}: expected a run index from 0 to {runs - 1} "
                        f"({runs} runs, in the order given)")
    return hold_out


def calibrate_from_vllm(scenario, runs: list[VllmResult], hold_out: Optional[int] = None,
                        base: Optional[CostCoefficients] = None, seed: int = 0,
                        progress: Optional[Callable[[str], None]] = None, max_iterations: int = 20,
                        series: Optional[list] = None, polish_evaluations: int = 80) -> VllmFit:
    """Fit a profile to the runs (see the module docstring); `hold_out` indexes the run kept out
    (`held_out_run`); `series[i]` (or None) is run i's measured running/waiting/KV %
    (sim.vllm.timeseries.load_series)."""
    if not runs:
        raise ValueError("calibrate --from-vllm needs at least one result file")
    held = held_out_run(hold_out, len(runs))
    scenario = without_default_front_end(scenario)
    base = base or CostCoefficients()
    replays = [Replay.of(r, seed) for r in runs]
    for replay, curve in zip(replays, series or []):
        if curve is not None:
            replay.series = curve
            replay.measured = {**replay.measured, **series_measured(curve)}
    labels = [r.source for r in runs]
    train = [r for i, r in enumerate(replays) if i != held]
    metrics = METRICS + ("duration_s",) + SERIES_METRICS if len(runs) >= 2 else ("tpot_s",)
    names = ["compute_scale", "memory_scale"] + (["link_eff"] if scenario.parallelism.tp > 1 else [])
    names, left_out, start = identifiable_terms(scenario, train, metrics, names + list(HOST_TERMS), base)
    if progress:
        progress(f"fitting {', '.join(names)}" + (f"; left at the profile's value: {', '.join(left_out)}"
                                                   if left_out else ""))
    params = fit_runs(scenario, train, metrics, names, base, progress, max_iterations, polish_evaluations, start)
    unpinned = unpinned_terms(scenario, train, metrics, params, base)
    left_out.update(unpinned)
    names = [n for n in names if n not in unpinned]
    if any(params[n] > 10 * PARAMETERS[n][0] for n in unpinned):     # they took time: refit without them
        if progress:
            progress(f"not pinned by these runs: {', '.join(unpinned)}; refitting {', '.join(names)}")
        params = fit_runs(scenario, train, metrics, names, base, progress, min(max_iterations, 6),
                          min(polish_evaluations, 30), start={n: params[n] for n in names})
    params = {n: params[n] for n in names}      # the others keep the profile's value
    coeffs = coefficients_from(params, base)
    rows = []
    for i, replay in enumerate(replays):
        role = "held out" if i == held else "fitted"
        rows += run_errors(scenario, replay, coeffs, role, labels[i])
    errors = pd.DataFrame(rows)
    if len(runs) == 1:
        errors.loc[errors["metric"] != "tpot", "role"] = "check (not fitted)"
    errors = errors[errors["metric"].isin([m.removesuffix("_s") for m in METRICS + ("duration_s",)]
                                          + list(SERIES_METRICS))]
    warnings = fit_warnings(coeffs, params, errors)
    profile = DeviceProfile(
        coeffs, calibrated=True, device_name=scenario.device.name, model_name=scenario.model.name,
        source=(f"calibrated on {len(train)} measured vLLM run(s) of {scenario.model.name} on "
                f"{scenario.device.name} tp {scenario.parallelism.tp}, {datetime.now(timezone.utc):%Y-%m-%d}"
                + (" [POOR FIT: see fit.warnings]" if warnings else "")),
        fit={"method": "vllm-runs", "runs": labels, "held_out": None if held is None else labels[held],
             "fitted_metrics": [m.removesuffix("_s") for m in metrics], "parameters": params,
             "unidentifiable": left_out,
             "errors": errors.to_dict(orient="records"), "quality": "poor" if warnings else "ok",
             "warnings": warnings,
             "notes": [n for r in replays for n in r.notes]
             + [f"{r.label}: time series aligned by {r.series_how} (offset {r.series_offset:+.3f} s)"
                for r in replays if r.series is not None and r.series_offset is not None]})
    notes = [n for r in replays for n in r.notes] + [f"{t} not fitted: {why}" for t, why in left_out.items()]
    return VllmFit(profile, params, errors, warnings, notes, left_out)


def fit_warnings(coeffs: CostCoefficients, params: dict[str, float], errors: pd.DataFrame) -> list[str]:
    """What makes a fit untrustworthy: coefficients outside their physical range, large errors."""
    out = []
    for name in EFFICIENCIES:
        value = getattr(coeffs, name)
        if name == "link_eff" and "link_eff" not in params:
            continue
        if value > 1.0:
            out.append(f"{name} = {value:.3g} > 1: faster than the datasheet allows, so a term is "
                       f"missing from the model (or the device entry is wrong), not a fit")
        if value < 0.05:
            out.append(f"{name} = {value:.3g} < 0.05: implausibly slow; something else takes the time")
    for name, (low, high, physical) in PARAMETERS.items():
        if name in params and physical is not None and params[name] > physical:
            out.append(f"{name} = {params[name]:.3g} beyond its physical range (<= {physical:g})")
        if name in params and np.isclose(params[name], high, rtol=1e-3) or (
                name in params and np.isclose(params[name], low, rtol=1e-3)):
            out.append(f"{name} = {params[name]:.3g} stuck at its bound: not identifiable from these runs")
    for _, row in errors.iterrows():
        if abs(row["error"]) > POOR_FIT:
            out.append(f"{row['run']} ({row['role']}): mean {row['metric']} off by {row['error']:+.1%}")
    return out


def write_vllm_profile(path: str | Path, fit: VllmFit) -> Path:
    import json

    import yaml

    from sim.output.io import plain_value, write_text

    header = ("# kvtwin device profile, written by `simrun calibrate --from-vllm`. Load it with\n"
              "#   simrun SCENARIO --set device.profile=THIS_FILE\n")
    if fit.warnings:
        header += "# WARNING: POOR FIT, see fit.warnings below before trusting these step times.\n"
    return write_text(path, header + yaml.safe_dump(json.loads(json.dumps(fit.profile.to_dict(), default=plain_value)), sort_keys=False))


__all__ = ["calibrate_from_vllm", "VllmFit", "Replay", "simulate_replay", "coefficients_from",
           "write_vllm_profile", "fit_warnings", "METRICS"]


# ----------------------------------------------------------------------------- command line

def deployment_scenario(args, runs: list[VllmResult]):
    """The deployment the runs measured: --scenario, else --model (or the runs' model_id found in
    the catalog by its Hugging Face id) on --catalog-device, with --set overrides."""
    from sim.core.catalog import model_names_by_hf_id
    from sim.errors import UserError
    from sim.scenario import apply_overrides, expand_variants, load_scenario, validate_scenario

    if args.scenario:
        scenario = load_scenario(args.scenario, args.overrides)
        return next(iter(expand_variants(scenario, args.scenario.parent.resolve(), source=str(args.scenario)).values()))
    model = args.model
    if model is None:
        ids = {r.model for r in runs}
        by_hf = model_names_by_hf_id()
        found = {by_hf.get(i) for i in ids} - {None}
        if len(found) != 1:
            raise UserError(f"give --model (or --scenario): the runs' model_id {sorted(map(str, ids))} "
                            f"{'is' if len(ids) == 1 else 'are'} not one catalog model")
        model = found.pop()
    if not args.catalog_device:
        raise UserError("give --catalog-device NAME (the GPU the runs were measured on), or --scenario")
    raw = {"model": {"hf_config": model} if Path(model).exists() else model, "device": args.catalog_device}
    return validate_scenario(apply_overrides(raw, args.overrides), base_dir=Path.cwd())


def default_profile_path(scenario, suffix: str = "") -> Path:
    """profiles/<device>_<model><suffix>.yaml for both calibrations; model and device names come
    from user files (an HF config's _name_or_path may hold '/'): each becomes a plain name part."""
    from sim.names import folder_name

    return Path("profiles") / f"{folder_name(scenario.device.name)}_{folder_name(scenario.model.name)}{suffix}.yaml"


PROFILE_HEADER = "# kvtwin device profile"      # the first words of every profile calibrate writes


def profile_out(args, scenario, suffix: str = "") -> Path:
    """--out, else the default path; checked before any profiling or fitting, as from-vllm's
    --out: a file kvtwin did not write is replaced only with --force."""
    from sim.output.run_dir import check_out_file

    out = args.out or default_profile_path(scenario, suffix)
    check_out_file(out, PROFILE_HEADER, force=args.force)
    return out


def calibrate_from_vllm_main(args) -> int:
    from sim.output.console import console, err_console
    from sim.vllm.results import load_results

    runs = [run for path in args.from_vllm for run in load_results(path)]
    scenario = deployment_scenario(args, runs)
    series = load_series_args(args.series, runs) if args.series else None
    out = profile_out(args, scenario, "_vllm")
    console.print(f"fitting {scenario.model.name} on {scenario.device.name} tp {scenario.parallelism.tp} "
                  f"to {len(runs)} measured vLLM run(s)")
    fit = calibrate_from_vllm(scenario, runs, hold_out=args.hold_out, series=series,
                              progress=lambda msg: err_console.print(f"  {msg}"))
    write_vllm_profile(out, fit)
    console.print(fit_table(fit))
    for note in fit.notes:
        err_console.print(f"note: {note}")
    for warning in fit.warnings:
        err_console.print(f"[bold red]WARNING:[/] {warning}")
    if fit.warnings:
        err_console.print("[bold red]the profile is marked quality: poor; check the runs and the deployment "
                          "settings before trusting it[/]")
    # absolute: the hint works from any folder
    console.print(f"wrote {out} (use it: simrun SCENARIO --set device.profile={out.resolve()})")
    return 0


def load_series_args(paths: list[str], runs: list[VllmResult]) -> list:
    """One series file (or '-') per run, in the order the runs were loaded."""
    from sim.errors import UserError
    from sim.vllm.timeseries import load_series

    if len(paths) != len(runs):
        raise UserError(f"--series: {len(paths)} files for {len(runs)} runs; give one per run, in order "
                        f"('-' for a run without one)")
    return [None if p == "-" else load_series(p) for p in paths]


def fit_table(fit: VllmFit):
    from rich.table import Table

    table = Table(title="calibrated step times vs measured vLLM runs", header_style="bold")
    for col in ("run", "role", "metric", "measured mean", "predicted mean", "error", "median per request"):
        table.add_column(col, justify="left" if col in ("run", "role", "metric") else "right")
    for _, row in fit.errors.iterrows():
        curve = str(row["metric"]).startswith("series_")
        unit = (lambda v: f"{v:.2f}") if curve else (lambda v: f"{v * 1e3:.2f} ms")
        table.add_row(Path(str(row["run"])).name, row["role"], row["metric"], unit(row["measured_mean_s"]),
                      unit(row["predicted_mean_s"]), f"{row['error']:+.1%}",
                      f"{row['median_request_error']:.1%}",
                      style="red" if abs(row["error"]) > POOR_FIT else "")
    return table
