"""A sweep for a person: the metrics a swept field moves, their figures (sweep_<metric>.png), the
tables, sweep.csv and sweep.html, and the terminal summary."""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from sim.core.lazy import lazy_import
from sim.output.run_table import print_frame
from sim.whatif.sweep import Axis, Point, Sweep

pd = lazy_import("pandas")


@dataclass(frozen=True)
class Metric:
    name: str          # file stem: sweep_<name>.png
    column: str        # flattened summary key
    label: str         # axis label, with the display unit
    scale: float = 1.0


HEADLINE_METRICS = (
    Metric("request_throughput", "request_throughput", "request throughput (req/s)"),
    Metric("output_throughput", "output_token_throughput", "output throughput (tok/s)"),
    Metric("ttft_p99", "ttft_s.p99", "TTFT p99 (ms)", 1e3),
    Metric("tpot_p99", "tpot_s.p99", "TPOT p99 (ms)", 1e3),
    Metric("e2e_p99", "e2e_s.p99", "E2E p99 (ms)", 1e3),
    Metric("goodput", "goodput", "goodput (req/s)"),
    Metric("kv_usage_peak", "kv_usage_peak", "KV usage peak (%)", 100.0),
    Metric("preemptions", "preemptions", "preemptions"),
    Metric("prefix_hit_rate", "prefix_hit_rate", "prefix hit rate (%)", 100.0),
)


# Shown beside the standard columns when a swept field moves them (plots stay the headline's).
POOL_METRICS = (
    Metric("kv_pool_tokens", "memory.max_tokens", "KV pool (tokens)"),
    Metric("max_concurrency", "memory.max_concurrency_at_max_model_len", "max concurrency (x)"),
)


METRICS_BY_NAME = {m.name: m for m in HEADLINE_METRICS + POOL_METRICS}


# swept field (a path or its leading part) -> the metrics it moves
MOVED_BY = (
    (("engine.kv_cache_dtype", "engine.gpu_memory_utilization", "engine.block_size", "engine.num_blocks",
      "engine.max_model_len", "engine.memory_plan", "engine.max_num_batched_tokens", "engine.max_num_seqs",
      "engine.activation_mib", "model", "device", "parallelism"), ("kv_pool_tokens", "max_concurrency")),
    (("engine.prefix_caching", "workload.dynamic_segment", "workload.shared_prefix", "workload.prompt_len",
      "workload.multi_turn", "workload.dataset", "workload.tenants", "engine.block_size"), ("prefix_hit_rate",)),
)


SHORT_COLUMNS = ("request_throughput", "goodput", "ttft_p99", "tpot_p99", "e2e_p99", "kv_usage_peak", "preemptions")


def moved_metrics(axes: Sequence[Axis]) -> list[Metric]:
    """The metrics the swept fields move (KV pool and concurrency for memory fields, prefix hit
    rate for prompt and cache fields), so the table answers the question the sweep asks."""
    names: dict[str, None] = {}
    for axis in axes:
        for fields, metrics in MOVED_BY:
            if any(axis.path == f or axis.path.startswith(f + ".") for f in fields):
                names.update(dict.fromkeys(metrics))
    return [METRICS_BY_NAME[n] for n in names]


def table_metrics(axes: Sequence[Axis], standard: Sequence[str]) -> list[Metric]:
    """The standard metrics, then those the swept fields move (each once)."""
    names = dict.fromkeys([*standard, *(m.name for m in moved_metrics(axes))])
    return [METRICS_BY_NAME[n] for n in names]


PLOT_DPI = 100


def metric_values(frame: pd.DataFrame, metric: Metric) -> Optional[pd.Series]:
    """The metric in display units, or None when no point has it (goodput without an SLO)."""
    if metric.column not in frame:
        return None
    values = pd.to_numeric(frame[metric.column], errors="coerce") * metric.scale
    return None if values.isna().all() else values


@dataclass(frozen=True)
class Layout:
    """Where each point goes on a sweep plot."""

    xlabel: str
    xticks: list[str]                          # one per x position
    numeric_x: Optional[list[float]]           # x values when the first field is numeric, else None
    series: list[tuple[str, list[int]]]        # (legend label, point indices in x order)

    @property
    def xs(self) -> list[float]:
        return self.numeric_x or list(range(len(self.xticks)))


def plot_layout(sweep: Sweep) -> Layout:
    """x = the first swept field; one line per combination of the others (zipped: one line)."""
    axes, points = sweep.axes, sweep.points
    first = axes[0]
    everything = [("", [p.index for p in points])]
    if sweep.zipped and len(set(first.texts)) < len(first.texts):
        # device=l4,l4,h100 paired with tp=1,2,1: only all the fields together tell points apart
        return Layout(" / ".join(a.path for a in axes), [" / ".join(p.texts) for p in points], None, everything)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in first.values)
    xs = [float(v) for v in first.values] if numeric else None
    if sweep.zipped:
        paired = f"  (paired with {', '.join(a.path for a in axes[1:])})" if len(axes) > 1 else ""
        return Layout(first.path + paired, list(first.texts), xs, everything)
    return Layout(first.path, list(first.texts), xs, _grid_series(axes, points))


def _grid_series(axes: Sequence[Axis], points: Sequence[Point]) -> list[tuple[str, list[int]]]:
    groups: dict[tuple[str, ...], list[int]] = {}
    for p in points:                     # grid order: the first field varies slowest
        groups.setdefault(p.texts[1:], []).append(p.index)
    return [(", ".join(f"{a.path.rsplit('.', 1)[-1]}={t}" for a, t in zip(axes[1:], key)), idx)
            for key, idx in groups.items()]


def draw_metric(ax, sweep: Sweep, metric: Metric, layout: Optional[Layout] = None) -> bool:
    """One metric against the first swept field: lines over a numeric field, grouped bars over
    named values (devices, routers); False (nothing drawn) when no point has the metric."""
    values = metric_values(sweep.frame, metric)
    if values is None:
        return False
    layout = layout or plot_layout(sweep)
    width = 0.8 / len(layout.series)
    for i, (name, idx) in enumerate(layout.series):
        y = values.iloc[idx].to_numpy()
        if layout.numeric_x:
            ax.plot(layout.xs, y, marker="o", color=f"C{i % 10}", label=name or None)
        else:
            offset = (i - (len(layout.series) - 1) / 2) * width
            ax.bar([x + offset for x in layout.xs], y, width, color=f"C{i % 10}", label=name or None)
    _x_axis(ax, layout)
    shown = values[values > 0]
    if len(shown) == len(values.dropna()) and len(shown) and shown.max() / shown.min() > 30:
        ax.set_yscale("log")                     # e.g. TTFT from 0.1 s below the knee to minutes above it
    ax.set_title(metric.label.split(" (")[0])
    ax.set_ylabel(metric.label)
    ax.grid(alpha=0.3)
    if any(name for name, _ in layout.series):
        ax.legend(fontsize="small")
    return True


def _x_axis(ax, layout: Layout) -> None:
    xs = layout.xs
    if layout.numeric_x and min(xs) > 0 and max(xs) / min(xs) >= 16:     # block sizes 1..64 and the like
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, layout.xticks, fontsize="small")
    ax.minorticks_off()
    ax.set_xlabel(layout.xlabel)


def plot_metrics(sweep: Sweep, metrics: Sequence[Metric | str], ncols: int = 2, title: str = ""):
    """Several metrics (or headline metric names) in one figure; those no point has are skipped."""
    from matplotlib.figure import Figure

    chosen = [METRICS_BY_NAME[m] if isinstance(m, str) else m for m in metrics]
    chosen = [m for m in chosen if metric_values(sweep.frame, m) is not None]
    nrows = max(1, math.ceil(len(chosen) / ncols))
    fig = Figure(figsize=(4.6 * ncols, 3.2 * nrows + (0.4 if title else 0)), layout="constrained")
    axs = fig.subplots(nrows, ncols, squeeze=False).ravel()
    layout = plot_layout(sweep)
    for ax, metric in zip(axs, chosen):
        draw_metric(ax, sweep, metric, layout)
    for ax in axs[len(chosen):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return fig


def save_png(fig, path: Path, dpi: int = PLOT_DPI) -> Path:
    from sim.output.report import save_figure

    return save_figure(fig, path, dpi)


SLO_OF_METRIC = {"ttft_p99": "ttft_s", "tpot_p99": "tpot_s", "e2e_p99": "e2e_s"}


def write_metric_plots(sweep: Sweep, out: Path, title: str = "", slo: Optional[Mapping] = None,
                       ways: Optional[int] = None) -> dict[str, Path]:
    """DIR/sweep_<metric>.png for every headline metric some point has, titled with the scenario,
    the scenario's SLO as a dashed line on the latency it limits. Drawn `ways` ways at once
    (default: sim.output.workers.plot_ways) by forked copies of this process, which inherit
    matplotlib: the nine plots are most of the time a sweep spends after its points."""
    from sim.output import workers

    names = [m.name for m in HEADLINE_METRICS if metric_values(sweep.frame, m) is not None]
    ways = workers.plot_ways() if ways is None else ways
    draw = (lambda share: _write_metric_plots(sweep, out, title, slo, share))     # noqa: E731
    if ways < 2 or len(names) < 2 or not workers.can_fork_here():
        return draw(names)
    workers.warm_up()                     # matplotlib and its fonts, once, before the copies
    return workers.in_forked_shares(names, ways, draw, lambda name: out / f"sweep_{name}.png")


def _write_metric_plots(sweep: Sweep, out: Path, title: str, slo: Optional[Mapping],
                        names: Sequence[str]) -> dict[str, Path]:
    from matplotlib.figure import Figure

    layout = plot_layout(sweep)
    files = {}
    for metric in (METRICS_BY_NAME[name] for name in names):
        fig = Figure(figsize=(6.4, 4.3), layout="constrained")
        ax = fig.subplots()
        if draw_metric(ax, sweep, metric, layout):
            limit = (slo or {}).get(SLO_OF_METRIC.get(metric.name, ""))
            if limit is not None:
                ax.axhline(limit * metric.scale, color="C3", ls="--", lw=1, label=f"SLO {limit * metric.scale:g} ms")
                ax.legend(fontsize="small")
            if title:
                fig.suptitle(title, fontsize="medium")
            files[metric.name] = save_png(fig, out / f"sweep_{metric.name}.png")
    return files


def display_table(frame: pd.DataFrame, key_columns: Sequence[str],
                  metrics: Sequence[Metric] = HEADLINE_METRICS) -> pd.DataFrame:
    """Key columns plus the headline metrics in display units (the printed and HTML table)."""
    from sim.output import units

    out = frame[list(key_columns)].copy()
    for metric in metrics:
        values = metric_values(frame, metric)
        if values is None:
            continue
        if metric.scale == 100.0:            # a share: shown with its % sign (sim.output.units)
            out[metric.label.replace(" (%)", "")] = [units.pct(v / 100) for v in values]
        else:
            out[metric.label] = values
    if "error" in frame:
        out["error"] = frame["error"].fillna("")
    return out


def write_page(path: Path, title: str, notes: Sequence[str], tables: Sequence[tuple[str, pd.DataFrame]],
               figures: Mapping[str, Path], setup: Optional[Mapping] = None) -> Path:
    """A self-contained HTML page (images inlined) in the run report's style."""
    from sim.output.report import html_figure, html_table, write_html_page

    body = [f"<p>{html.escape(n)}</p>" for n in notes]
    for heading, frame in tables:
        body += [f"<h2>{html.escape(heading)}</h2>", html_table(frame)]
    body += ["<h2>Figures</h2>", *(html_figure(name, file) for name, file in figures.items())]
    return write_html_page(path, title, body, setup=setup)


def write_sweep(sweep: Sweep, out: Path, title: str, setup: Optional[Mapping] = None,
                plots: bool = True) -> dict[str, Path]:
    """sweep.csv, and unless `plots` is False the metric plots and sweep.html."""
    from sim.output.io import write_csv

    files = {"csv": write_csv(out / "sweep.csv", sweep.frame)}
    if not plots:
        return files
    scenario = (setup or {}).get("scenario") or {}
    swept = {a.path.split(".")[0] for a in sweep.axes}
    figure_title = scenario.get("name", "") if {"model", "device"} & swept else (
        f"{scenario.get('name')}: {(scenario.get('model') or {}).get('name')} on "
        f"{(scenario.get('device') or {}).get('name')}" if scenario else "")
    figures = write_metric_plots(sweep, out, figure_title, scenario.get("slo"))
    files.update(figures)
    keys = [a.path for a in sweep.axes]
    notes = [f"{len(sweep.points)} points, {'paired (--zip)' if sweep.zipped else 'grid'} over "
             + ", ".join(keys) + ". Every metric is in sweep.csv."]
    files["html"] = write_page(out / "sweep.html", title, notes,
                               [("Points", display_table(sweep.frame, keys, table_metrics(
                                   sweep.axes, [m.name for m in HEADLINE_METRICS])))], figures, setup)
    return files


def print_sweep(sweep: Sweep, out: Path, wall_s: float, plots: bool = True) -> None:
    from sim.output.console import console

    table = display_table(sweep.frame, [a.path for a in sweep.axes], table_metrics(sweep.axes, SHORT_COLUMNS))
    print_frame(table.rename(columns={a.path: a.path.rsplit(".", 1)[-1] for a in sweep.axes}))
    failed = sweep.frame["error"].notna().sum() if "error" in sweep.frame else 0
    if failed:
        console.print(f"[yellow]{failed} point(s) did not run[/]: see the error column")
    written = "sweep.csv, sweep_*.png, sweep.html" if plots else "sweep.csv; no plots: --no-plots"
    console.print(f"{len(sweep.points)} points in {wall_s:.1f} s; wrote {out}/ ({written})")
