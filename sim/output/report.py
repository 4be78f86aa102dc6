"""Plots, the one-page HTML report and the Chrome/Perfetto trace of one or more runs.

Every function takes {label: RunView}, so the same code draws one run, scenario variants
overlaid, and predicted vs measured side by side. Figures use matplotlib's Agg canvas
without pyplot, so importing this module changes no global backend and figures never pile
up in pyplot's registry. Step series are reduced onto a fixed number of time buckets
(keeping each bucket's maximum where peaks matter), so a 200k-step run plots as fast as a
small one. Data are in seconds; tables and axes show milliseconds.
"""
from __future__ import annotations

import base64
import gzip
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from sim.output import units
from sim.output.io import atomic_path, write_bytes, write_text
from sim.output.setup import rejection_line, setup_fields, vllm_startup_lines
from sim.output.units import EMPTY, format_value  # noqa: F401  (format_value: the one number formatter)
from sim.records import STEP_COLUMNS, RunRecords, requests_frame

TIMELINE_BUCKETS = 1500        # about a plot's width in pixels: finer buckets show nothing more
CDF_POINTS = 2000
TRACE_MAX_REQUESTS = 5000      # request slices per run in the trace; steps are never capped
DPI = 110


@dataclass(eq=False)           # frames do not compare with ==
class RunView:
    """One run as the report sees it: a prediction, an engine measurement or a variant."""

    label: str
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    kv_blocks_total: int           # usable blocks per replica
    replicas: int = 1
    scenario: Any = None           # the validated scenario when known: SLO lines, titles

    @property
    def slo(self) -> dict[str, float]:
        """{'ttft_s': limit, ...} for the SLOs the scenario sets."""
        slo = getattr(self.scenario, "slo", None)
        return {k: getattr(slo, k) for k in ("ttft_s", "tpot_s", "e2e_s") if getattr(slo, k, None) is not None}

    def __post_init__(self) -> None:
        if self.steps.empty:       # a run without steps yields object columns; keep them numeric
            self.steps = pd.DataFrame({c: np.zeros(0) for c in ("replica", *STEP_COLUMNS)})

    @classmethod
    def from_records(cls, label: str, records: RunRecords, summary: dict,
                     requests: Optional[pd.DataFrame] = None,
                     steps: Optional[pd.DataFrame] = None) -> "RunView":
        return cls(label, summary,
                   requests if requests is not None else requests_frame(records),
                   steps if steps is not None else records.steps_frame(),
                   records.kv_blocks_total, max(1, len(records.recorders)))

    @property
    def measured(self) -> pd.DataFrame:
        """Finished, non-warm-up requests: what every latency figure is over (as in metrics)."""
        r = self.requests
        return r[(r["status"] == "finished") & ~r["is_warmup"].astype(bool)]


# ----------------------------------------------------------------------------- downsampling

def timeline(steps: pd.DataFrame, agg: Mapping[str, str], buckets: int = TIMELINE_BUCKETS,
             combine: str = "sum") -> tuple[np.ndarray, pd.DataFrame]:
    """Step series on equal time buckets: (bucket edges in s, one row per bucket).

    Each column is reduced per replica and bucket with its `agg` ('max' keeps peaks such as
    KV blocks used; 'mean' for per-step sizes). A bucket in which a replica starts no step
    holds that replica's previous value, as the records' step function does. Replicas are
    then combined with `combine` ('sum' for cluster-wide states such as blocks used).
    """
    cols = list(agg)
    if steps.empty:
        return np.zeros(0), pd.DataFrame(columns=cols, dtype=float)
    t0, t1 = float(steps["start_s"].min()), float(steps["end_s"].max())
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    bucket = np.minimum(((steps["start_s"].to_numpy() - t0) / width).astype(np.int64), buckets - 1)
    per = steps.groupby([steps["replica"].to_numpy(), bucket])[cols].agg(dict(agg))
    wide = per.unstack(0).reindex(range(buckets)).ffill().fillna(0.0)
    combined = wide.T.groupby(level=0).agg(combine).T
    return t0 + width * np.arange(buckets + 1), combined[cols]


def cdf_points(values: np.ndarray, points: int = CDF_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, cumulative fraction), thinned to `points` evenly spaced ranks (min and max kept)."""
    v = np.sort(np.asarray(values, dtype=float))
    rank = np.unique(np.linspace(0, len(v) - 1, min(points, len(v))).round().astype(np.int64))
    return v[rank], (rank + 1) / len(v)


# ----------------------------------------------------------------------------- plots

def new_figure(ncols: int = 1, nrows: int = 1, **subplot_kw: Any) -> tuple[Figure, list]:
    width, height = (10 if ncols == 1 else 14), (4 if nrows == 1 else 7)
    fig = Figure(figsize=(width, height))
    # Fixed margins (in inches): a layout engine would double the time to save a figure.
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.2 / width, bottom=0.5 / height, top=1 - 0.35 / height,
                        wspace=0.22, hspace=0.35)
    return fig, list(fig.subplots(nrows, ncols, squeeze=False, **subplot_kw).ravel())


def _colours(views: Mapping[str, RunView]) -> list[str]:
    return [f"C{i % 10}" for i in range(len(views))]


def _stairs(ax, edges: np.ndarray, values, baseline=None, **kw) -> None:
    """A step function over bucket edges (Line2D: Axes.stairs' patch is slow for long series)."""
    hi = np.append(values, np.asarray(values)[-1])
    if baseline is None:
        ax.plot(edges, hi, drawstyle="steps-post", **kw)
    else:
        ax.fill_between(edges, np.append(baseline, np.asarray(baseline)[-1]), hi, step="post", lw=0, **kw)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.45")


def finish_axes(ax, title: str, ylabel: str, xlabel: str = "run time (s)", counts: bool = False) -> None:
    ax.set_title(title)
    if counts:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.get_yscale() == "linear":
        ax.yaxis.set_major_formatter(_short_number)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


@FuncFormatter
def _short_number(x: float, _pos: int) -> str:
    return f"{x / 1000:g}k" if abs(x) >= 10_000 else f"{x:g}"


def _across_replicas(views: Mapping[str, RunView]) -> str:
    return " (sum over replicas)" if any(v.replicas > 1 for v in views.values()) else ""


def _has_cached_blocks(views: Mapping[str, RunView]) -> bool:
    """Cached-free blocks exist only with prefix caching on: without, their panel means nothing."""
    return any(len(v.steps) and v.steps["kv_blocks_cached"].max() > 0 for v in views.values())


def _kv_lines(views: Mapping[str, RunView]) -> dict:
    return {label: timeline(v.steps, {"kv_blocks_used": "max", "kv_blocks_cached": "max"})
            for label, v in views.items()}


def plot_kv_blocks(views: Mapping[str, RunView]) -> Figure:
    """Used and cached-free blocks in two panels (a prefix cache can fill the whole pool with
    cached blocks, which would flatten the used series on a shared axis); used only when no run
    caches anything."""
    panels = (("kv_blocks_used", "used", "-"), ("kv_blocks_cached", "cached-free", ":"))
    if not _has_cached_blocks(views):
        panels = panels[:1]
    fig, axes = new_figure(nrows=len(panels), sharex=True)
    lines = _kv_lines(views)
    for ax, (column, what, ls) in zip(axes, panels):
        _kv_panel(ax, views, lines, column, what, ls)
    if len(axes) > 1:
        axes[0].set_xlabel("")
    return fig


def _kv_panel(ax, views: Mapping[str, RunView], lines: dict, column: str, what: str, ls: str) -> None:
    top = max((tl[column].max() for _, tl in lines.values() if len(tl)), default=0.0)
    totals = {label: v.kv_blocks_total * v.replicas for label, v in views.items()}
    # A pool far above the series would flatten them: stop the axis short and say so.
    ceiling = 1.1 * max([top, *(t for t in totals.values() if t <= 3 * top)])
    for (label, (edges, tl)), colour in zip(lines.items(), _colours(views)):
        if len(tl):
            _stairs(ax, edges, tl[column], color=colour, ls=ls, label=f"{label}: {what}")
        above = " (above the axis)" if top and totals[label] > ceiling else ""
        ax.axhline(totals[label], color=colour, ls="--", lw=1,
                   label=f"{label}: total {totals[label]:,}{above}")
    if top:
        ax.set_ylim(0, ceiling)
    elif not any(len(tl) for _, tl in lines.values()):
        ax.set_ylim(0, 1.1 * max(totals.values(), default=1))
        _note(ax, "no steps recorded")
    finish_axes(ax, f"KV cache blocks {what} (bucket max)", "blocks" + _across_replicas(views), counts=True)


def draw_queue(ax, views: Mapping[str, RunView]) -> None:
    for (label, v), colour in zip(views.items(), _colours(views)):
        edges, tl = timeline(v.steps, {"running": "max", "waiting": "max"})
        if len(tl):
            _stairs(ax, edges, tl["running"], color=colour, label=f"{label}: running")
            _stairs(ax, edges, tl["waiting"], color=colour, ls="--", label=f"{label}: waiting")
    if not any(len(v.steps) for v in views.values()):
        _note(ax, "no steps recorded")
    finish_axes(ax, "Running and waiting requests (bucket max)", "requests" + _across_replicas(views),
                counts=True)


def plot_queue(views: Mapping[str, RunView]) -> Figure:
    fig, (ax,) = new_figure()
    draw_queue(ax, views)
    return fig


def draw_batch_tokens(ax, views: Mapping[str, RunView]) -> None:
    if len(views) == 1:            # one run: split each step's tokens into decode and prefill
        (label, v), = views.items()
        edges, tl = timeline(v.steps, {"decode_seqs": "mean", "prefill_tokens": "mean"}, combine="mean")
        if len(tl):
            decode = tl["decode_seqs"].to_numpy()
            _stairs(ax, edges, decode, baseline=np.zeros_like(decode), alpha=0.7, color="C0",
                    label=f"{label}: decode")
            _stairs(ax, edges, decode + tl["prefill_tokens"].to_numpy(), baseline=decode, alpha=0.7,
                    color="C1", label=f"{label}: prefill")
    else:
        for (label, v), colour in zip(views.items(), _colours(views)):
            edges, tl = timeline(v.steps, {"batch_tokens": "mean"}, combine="mean")
            if len(tl):
                _stairs(ax, edges, tl["batch_tokens"], color=colour, label=label)
    if not any(len(v.steps) for v in views.values()):
        _note(ax, "no steps recorded")
    finish_axes(ax, "Tokens per step (bucket mean)", "tokens per step", counts=True)


def plot_batch_tokens(views: Mapping[str, RunView]) -> Figure:
    fig, (ax,) = new_figure()
    draw_batch_tokens(ax, views)
    return fig


LATENCY_PANELS = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s"))


def draw_latency_cdf(ax, views: Mapping[str, RunView], name: str, column: str, ylabel: str = "") -> None:
    """One latency's CDF per run, the scenario's SLO on it as a dashed vertical line."""
    samples = {label: v.measured[column].dropna().to_numpy() * 1e3 for label, v in views.items()}
    for (label, ms), colour in zip(samples.items(), _colours(views)):
        if len(ms):
            x, p = cdf_points(ms)
            ax.plot(x, p, drawstyle="steps-post", color=colour, label=f"{label} (n={len(ms):,})")
    limits = sorted({v.slo[column] for v in views.values() if column in v.slo})
    for limit in limits:
        ax.axvline(limit * 1e3, color="C3", ls="--", lw=1, label=f"SLO {units.ms_unit(limit)}")
    pooled = np.concatenate([*samples.values(), np.asarray(limits) * 1e3])
    if not any(len(s) for s in samples.values()):
        _note(ax, "no finished requests")
    elif pooled.min() > 0 and pooled.max() > 50 * pooled.min():   # wide spread: log axis
        ax.set_xscale("log")
    finish_axes(ax, f"{name} CDF", ylabel, f"{name} (ms)")


def plot_latency_cdf(views: Mapping[str, RunView]) -> Figure:
    fig, axes = new_figure(len(LATENCY_PANELS), sharey=True)
    for ax, (name, column) in zip(axes, LATENCY_PANELS):
        draw_latency_cdf(ax, views, name, column, "fraction of requests" if ax is axes[0] else "")
    return fig


def _step_ms(views: Mapping[str, RunView]) -> dict[str, np.ndarray]:
    return {label: (v.steps["end_s"] - v.steps["start_s"]).to_numpy() * 1e3 for label, v in views.items()}


def draw_step_timeline(ax, views: Mapping[str, RunView], durations: Mapping[str, np.ndarray]) -> None:
    for (label, v), colour in zip(views.items(), _colours(views)):
        ms = v.steps.assign(step_ms=durations[label])
        edges, mean = timeline(ms, {"step_ms": "mean"}, combine="mean")
        if len(mean):
            _, peak = timeline(ms, {"step_ms": "max"}, combine="max")
            _stairs(ax, edges, peak["step_ms"], color=colour, alpha=0.3, lw=0.8)
            _stairs(ax, edges, mean["step_ms"], color=colour, label=f"{label}: mean (light: max)")
    if not any(len(d) for d in durations.values()):
        _note(ax, "no steps recorded")
    finish_axes(ax, "Step time (per bucket)", "step time (ms)")


def plot_step_time(views: Mapping[str, RunView]) -> Figure:
    fig, (ax, hist) = new_figure(2, width_ratios=(3, 1))
    durations = _step_ms(views)
    draw_step_timeline(ax, views, durations)
    pooled = np.concatenate(list(durations.values()))
    if len(pooled):
        bins = np.histogram_bin_edges(pooled, bins=60)
        for (label, ms), colour in zip(durations.items(), _colours(views)):
            _stairs(hist, bins, np.histogram(ms, bins)[0], color=colour, label=label)
        hist.set_yscale("log")
    else:
        _note(hist, "no steps recorded")
    finish_axes(hist, "Step time distribution", "steps", "step time (ms)")
    return fig


def plot_overview(views: Mapping[str, RunView]) -> Figure:
    """The run on one page: KV blocks used, the queue, tokens per step, TTFT and TPOT CDFs with
    their SLOs, and step time."""
    fig = Figure(figsize=(15, 8.4))
    fig.subplots_adjust(left=0.055, right=0.99, bottom=0.07, top=0.9, wspace=0.24, hspace=0.42)
    kv, queue, tokens, ttft, tpot, step = fig.subplots(2, 3).ravel()
    _kv_panel(kv, views, _kv_lines(views), "kv_blocks_used", "used", "-")
    draw_queue(queue, views)
    draw_batch_tokens(tokens, views)
    draw_latency_cdf(ttft, views, "TTFT", "ttft_s", "fraction of requests")
    draw_latency_cdf(tpot, views, "TPOT", "tpot_s")
    draw_step_timeline(step, views, _step_ms(views))
    return fig


PLOTS: dict[str, Callable[[Mapping[str, RunView]], Figure]] = {
    "kv_blocks": plot_kv_blocks, "queue": plot_queue, "batch_tokens": plot_batch_tokens,
    "latency_cdf": plot_latency_cdf, "step_time": plot_step_time,
}
# what `simrun` draws for a run: every plot above and the one-page overview
RUN_PLOTS: dict[str, Callable[[Mapping[str, RunView]], Figure]] = {"overview": plot_overview, **PLOTS}

CAPTIONS = {
    "overview": "The run on one page: KV blocks used against the pool, running and waiting requests, "
                "tokens per step, TTFT and TPOT CDFs (dashed: the SLOs), step time.",
    "kv_blocks": "KV cache blocks used (top) and cached-free (bottom, with prefix caching); dashed: each run's pool total.",
    "queue": "Requests running (solid) and waiting (dashed).",
    "batch_tokens": "Tokens per engine step.",
    "latency_cdf": "Latency CDFs over finished, non-warm-up requests; dashed red: the scenario's SLOs.",
    "step_time": "Engine step time over the run, and its distribution.",
    # figures only a predicted-vs-measured pair has (validate/)
    "step_scatter": "The cost model on each measured step's composition against that step's measured time.",
    "errors": "Relative error of each headline figure; green within tolerance, red outside.",
    "endpoint_timeline": "KV usage and queue scraped from the endpoint's /metrics next to the prediction.",
}


def save_figure(fig: Figure, path: str | Path, dpi: int = DPI) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return Path(path)


def titled(fig: Figure, title: str) -> Figure:
    """A figure title above the panels' own (scenario, model, device), with room made for it."""
    if title:
        height = fig.get_figheight()
        fig.suptitle(title, fontsize="large", y=1 - 0.08 / height, va="top")
        top = fig.subplotpars.top
        fig.subplots_adjust(top=min(top, 1 - 0.75 / height))
    return fig


def plot_run_figures(views: Mapping[str, RunView], out_dir: str | Path, title: str = "",
                     plots: Optional[Mapping[str, Callable]] = None) -> dict[str, Path]:
    """Write every plot in `plots` (default PLOTS) as out_dir/<name>.png; returns {name: path}."""
    out_dir = Path(out_dir)
    plots = PLOTS if plots is None else plots
    return {name: save_figure(titled(plot(views), title), out_dir / f"{name}.png") for name, plot in plots.items()}


_PARALLEL_VIEWS: dict = {}


def _draw_one(job: tuple[str, str, str]) -> str:
    name, out_dir, title = job
    return str(plot_run_figures(_PARALLEL_VIEWS, out_dir, title, {name: RUN_PLOTS[name]})[name])


def plot_figures_parallel(views: Mapping[str, RunView], out_dir: str | Path, title: str = "",
                          jobs: Optional[int] = None) -> dict[str, Path]:
    """RUN_PLOTS for a run, drawn by forked worker processes when there is more than one core
    (rendering is pure CPU work; the workers inherit the views instead of receiving copies)."""
    import multiprocessing
    import os

    jobs = jobs or min(len(RUN_PLOTS), os.cpu_count() or 1)
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return plot_run_figures(views, out_dir, title, RUN_PLOTS)
    from concurrent.futures import ProcessPoolExecutor

    _PARALLEL_VIEWS.clear()
    _PARALLEL_VIEWS.update(views)
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            paths = pool.map(_draw_one, [(name, str(out_dir), title) for name in RUN_PLOTS])
            return {name: Path(p) for name, p in zip(RUN_PLOTS, paths)}
    finally:
        _PARALLEL_VIEWS.clear()


# ----------------------------------------------------------------------------- tables

def _latency_rows() -> list[tuple[str, str, str]]:
    return [(f"{name} {stat} (ms)", f"{key}.{stat}", "ms")
            for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))
            for stat in ("mean", "p50", "p90", "p99")]


# (row label, with the unit where the cell does not carry it; dotted summary key; kind in sim.output.units)
SUMMARY_ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests finished", "requests_finished", "count"),
    ("requests rejected", "requests_rejected", "count"),
    ("duration (s)", "duration_s", "s"),
    ("request throughput (req/s)", "request_throughput", "number"),
    ("output throughput (tok/s)", "output_token_throughput", "number"),
    ("total throughput (tok/s)", "total_token_throughput", "number"),
    ("goodput (req/s)", "goodput", "number"),
    ("SLO attainment", "slo_attainment", "pct"),
    *_latency_rows(),
    ("KV blocks total", "kv_blocks_total", "count"),
    ("KV blocks peak", "kv_blocks_peak", "count"),
    ("KV usage peak", "kv_usage_peak", "pct"),
    ("KV usage mean", "kv_usage_mean", "pct"),
    ("KV slack peak (tokens)", "kv_slack_tokens_peak", "count"),
    ("prefix hit rate", "prefix_hit_rate", "pct"),
    ("preemptions", "preemptions", "count"),
    ("latency split: queue", "latency_split.queue", "pct"),
    ("latency split: host", "latency_split.host", "pct"),
    ("latency split: device", "latency_split.device", "pct"),
    ("steps", "num_steps", "count"),
    ("mean batch (seqs)", "mean_batch_seqs", "number"),
)


def _lookup(summary: Mapping, dotted: str) -> float:
    value: Any = summary
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    numeric = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    return float(value) if numeric else math.nan


def summary_table(views: Mapping[str, RunView], formatted: bool = True, ratios: bool = False) -> pd.DataFrame:
    """Headline metrics: one row per metric, one column per run.

    Formatted as display strings by default (what the CLI and the HTML show: ms, "47.7%",
    thousands separators); with formatted=False, floats in the display units (ms, percent),
    NaN where a figure is undefined. With `ratios` and several runs, a column per run after the
    first gives its ratio to the first ("continuous / static").
    """
    numbers = {label: [_lookup(v.summary, key) for _, key, _ in SUMMARY_ROWS] for label, v in views.items()}
    index = pd.Index([row for row, _, _ in SUMMARY_ROWS], name="metric")
    kinds = [kind for _, _, kind in SUMMARY_ROWS]
    if not formatted:
        return pd.DataFrame({label: [units.display_number(x, k) for x, k in zip(values, kinds)]
                             for label, values in numbers.items()}, index=index)
    table = pd.DataFrame({label: [units.display(x, k) for x, k in zip(values, kinds)]
                          for label, values in numbers.items()}, index=index)
    if ratios and len(views) > 1:
        base_label, base = next(iter(numbers.items()))
        for label, values in list(numbers.items())[1:]:
            table[f"{label} / {base_label}"] = [units.ratio(x / b) if b and not math.isnan(b) and not math.isnan(x)
                                                else EMPTY for x, b in zip(values, base)]
    return table


# ----------------------------------------------------------------------------- HTML

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       max-width: 1150px; margin: 2em auto; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #eee; }
th { background: #f6f6f6; } th, td { text-align: right; }
th:first-child, td.label { text-align: left; }
figure { margin: 1.2em 0; } img { max-width: 100%; } figcaption { color: #555; font-size: 0.9em; }
.warning { background: #fff4d6; border-left: 4px solid #e0a800; padding: 0.5em 0.8em; }
.setup { border-left: 4px solid #7aa6d6; background: #f3f7fc; padding: 0.4em 0.8em; }
.setup th { background: none; text-align: left; padding-right: 1.2em; border: 0; }
.setup td { text-align: left; border: 0; } .setup pre { background: none; padding: 0.2em 0; margin: 0; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 12px; }
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def html_table(frame: pd.DataFrame) -> str:
    """An escaped HTML table; numbers formatted with format_value (strings, already in display
    units, as they are); a default index is left out."""
    show_index = not isinstance(frame.index, pd.RangeIndex)
    head = ([_esc(frame.index.name or "")] if show_index else []) + [_esc(c) for c in frame.columns]
    rows = []
    for key, row in frame.iterrows():
        cells = [f'<td class="label">{_esc(key)}</td>'] if show_index else []
        cells += [f"<td>{_esc(format_value(v))}</td>" for v in row]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    header = "".join(f"<th>{h}</th>" for h in head)
    return f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def html_figure(name: str, path: Path) -> str:
    """A PNG inlined as base64 (so a page is one file), with its caption when it has one."""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    caption = CAPTIONS.get(name)
    return (f'<figure><img alt="{_esc(name)}" src="data:image/png;base64,{data}">'
            + (f"<figcaption>{_esc(caption)}</figcaption>" if caption else "") + "</figure>")


def write_html_page(path: str | Path, title: str, body: Sequence[str],
                    setup: Optional[Mapping] = None) -> Path:
    """A self-contained page in the report's style around already-escaped body parts; with a
    run's manifest as `setup`, it opens with what produced the numbers (html_setup)."""
    head = html_setup(setup) if setup else ""
    page = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{_esc(title)}</title><style>{CSS}</style></head>\n<body>\n"
            f"<h1>{_esc(title)}</h1>\n{head}" + "\n".join(body) + "\n</body></html>\n")
    return write_text(path, page)


def html_setup(manifest: Mapping, summary: Optional[Mapping] = None, extra: Sequence[str] = ()) -> str:
    """The setup header: model, device, tp, engine, workload, SLOs, step-time source; with a summary,
    vLLM's start-up lines for the same KV pool."""
    rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in setup_fields(manifest))
    lines = [*(vllm_startup_lines(summary, manifest) if summary else []), *extra]
    log = f"<pre>{_esc(chr(10).join(lines))}</pre>" if lines else ""
    return f'<div class="setup"><table>{rows}</table>{log}</div>\n' if rows or log else ""


def _warnings(views: Mapping[str, RunView]) -> list[str]:
    uncalibrated = [label for label, v in views.items() if v.summary.get("calibrated") is False]
    if not uncalibrated:
        return []
    return [f'<p class="warning">Uncalibrated cost model ({_esc(", ".join(uncalibrated))}): '
            "step times come from datasheet peaks and default efficiencies, not a fitted profile.</p>"]


def write_html_report(path: str | Path, title: str, views: Mapping[str, RunView],
                      figures: Mapping[str, Path], manifest: Mapping,
                      extra_tables: Sequence[tuple[str, pd.DataFrame]] = (),
                      setup: Optional[Mapping] = None) -> Path:
    """One self-contained page (images inlined): setup, summary, extra tables, figures, manifest.

    `setup` is the manifest whose scenario the header describes (default: `manifest` when it is
    one run's)."""
    setup = setup if setup is not None else (manifest if "scenario" in manifest else None)
    first = next(iter(views.values()), None)
    notes = [line for v in views.values() if (line := rejection_line(v.requests, v.summary))]
    header = [html_setup(setup, first.summary if first else None, notes)] if setup else []
    body = [*header, *_warnings(views), "<h2>Summary</h2>", html_table(summary_table(views, ratios=True))]
    for table_title, frame in extra_tables:
        body += [f"<h2>{_esc(table_title)}</h2>", html_table(frame)]
    body += ["<h2>Figures</h2>", *(html_figure(name, p) for name, p in figures.items())]
    manifest_json = json.dumps(manifest, indent=2, default=str)
    body.append(f"<details><summary>Manifest</summary><pre>{_esc(manifest_json)}</pre></details>")
    return write_html_page(path, title, body)


# ----------------------------------------------------------------------------- trace

def _us(seconds: pd.Series | np.ndarray) -> list[float]:
    return np.round(np.asarray(seconds, dtype=float) * 1e6, 3).tolist()


def _metadata_events(pid: int, label: str, replicas: int) -> list[dict]:
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    return events + [{"name": "thread_name", "ph": "M", "pid": pid, "tid": r + 1,
                      "args": {"name": f"replica {r} steps"}} for r in range(replicas)]


def _step_events(pid: int, steps: pd.DataFrame) -> list[dict]:
    ints = [steps[c].to_numpy().astype(np.int64).tolist()
            for c in ("step", "replica", "decode_seqs", "prefill_tokens", "kv_blocks_used", "preemptions")]
    ts, dur = _us(steps["start_s"]), _us(steps["end_s"] - steps["start_s"])
    return [{"name": f"step {k}", "ph": "X", "pid": pid, "tid": r + 1, "ts": t, "dur": d,
             "args": {"decode_seqs": a, "prefill_tokens": b, "kv_blocks_used": c, "preemptions": e}}
            for k, r, a, b, c, e, t, d in zip(*ints, ts, dur)]


def _counter_events(pid: int, steps: pd.DataFrame, replicas: int) -> list[dict]:
    """kv_blocks_used, running, waiting per replica, emitted only when the value changes."""
    events = []
    for replica, g in steps.groupby("replica"):
        ts = _us(g["start_s"])
        for column in ("kv_blocks_used", "running", "waiting"):
            values = g[column].to_numpy().astype(np.int64)
            name = column if replicas == 1 else f"{column} r{int(replica)}"
            changed = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
            events += [{"name": name, "ph": "C", "pid": pid, "ts": ts[i],
                        "args": {"value": int(values[i])}} for i in changed]
    return events


def _async(ph: str, name: str, pid: int, rid: str, t_s: float, args: Optional[dict] = None) -> dict:
    event = {"name": name, "cat": "request", "ph": ph, "id": rid, "pid": pid, "ts": round(t_s * 1e6, 3)}
    if args:
        event["args"] = args
    return event


def _request_events(pid: int, requests: pd.DataFrame) -> list[dict]:
    """Per request one async track: 'request N' enclosing queue, prefill and decode.

    Events sharing cat and id nest, so the phases sit under their request; the id carries
    the run's pid because trace ids are global across processes.
    """
    events = []
    for r in requests.itertuples(index=False):
        rid = f"{pid}:{r.id}"
        times = (r.arrival_s, r.admitted_s, r.first_token_s, r.finish_s)
        if all(math.isfinite(t) for t in times):
            args = {"prompt_tokens": int(r.prompt_tokens), "output_tokens": int(r.output_tokens),
                    "cached_tokens": int(r.cached_tokens), "preemptions": int(r.preemptions)}
            events.append(_async("b", f"request {r.id}", pid, rid, r.arrival_s, args))
            for phase, start, end in zip(("queue", "prefill", "decode"), times, times[1:]):
                events += [_async("b", phase, pid, rid, start), _async("e", phase, pid, rid, end)]
            events.append(_async("e", f"request {r.id}", pid, rid, r.finish_s))
        elif math.isfinite(r.arrival_s):      # rejected or aborted: an instant at arrival
            events.append(_async("n", str(r.status), pid, rid, r.arrival_s,
                                 {"reason": r.reject_reason} if isinstance(r.reject_reason, str) else None))
    return events


def write_perfetto_trace(path: str | Path, views: Mapping[str, RunView],
                         max_requests: int = TRACE_MAX_REQUESTS) -> Path:
    """Chrome trace-event JSON for ui.perfetto.dev or chrome://tracing (gzipped if path ends .gz).

    One process per run; per replica a thread of step slices; counters for KV blocks used
    and running/waiting requests; async request slices for the first `max_requests`
    requests by arrival (the rest would bloat the file; otherData says how many are shown).
    """
    events: list[dict] = []
    shown: dict[str, str] = {}
    for pid, (label, v) in enumerate(views.items(), start=1):
        requests = v.requests.sort_values(["arrival_s", "id"], kind="stable").head(max_requests)
        events += _metadata_events(pid, label, v.replicas)
        events += _step_events(pid, v.steps)
        events += _counter_events(pid, v.steps, v.replicas)
        events += _request_events(pid, requests)
        shown[label] = f"first {len(requests):,} of {len(v.requests):,} requests by arrival"
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"generator": "kvtwin sim/output/report.py", "request_slices": shown}}
    text = json.dumps(trace, separators=(",", ":"))      # json.dump would use the slow Python encoder
    if Path(path).suffix == ".gz":                       # both viewers open gzipped traces
        return write_bytes(path, gzip.compress(text.encode(), compresslevel=6))
    return write_text(path, text)
