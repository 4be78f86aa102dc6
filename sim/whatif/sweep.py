"""Sweeps: one scenario run at every point of a grid of field values, in parallel.

    simrun SCENARIO.yaml --set engine.block_size=8,16,32 --set workload.arrival.rate=20,40
                         [--zip] [--jobs N | --ray [ADDRESS]] [--out DIR] [--point-outputs]

A `--set` value with commas is a list of values to sweep, unless it is a YAML flow
collection (`[0,600]`, `{base: l4}`), which stays one value. Several multi-valued flags
form a grid (first flag outermost); `--zip` pairs them element by element instead, so
`--set device=l4,h100-sxm --set parallelism.tp=2,1 --zip` compares two L4s at tp=2 with
one H100. Every point is validated like a scenario before anything runs.

Points run on local processes (`--jobs`, default one per core) or as tasks on a Ray
cluster (`--ray`); each worker rebuilds its scenario from the raw mapping and runs
`predict`, and results are collected in point order, so sweep.csv is byte-identical
whichever backend ran it. Output: DIR/sweep.csv (swept fields, then the flattened
summary), DIR/sweep_<metric>.png per headline metric, DIR/sweep.html.
"""
from __future__ import annotations

import argparse
import html
import itertools
import math
import os
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from sim.core.lazy import lazy_import
from sim.core.memory import InsufficientMemoryError
from sim.names import folder_name
from sim.output.run_dir import owned_run_folder
from sim.output.run_table import print_frame  # noqa: F401  (plan prints through it too)
from sim.scenario import apply_overrides, load_raw, parse_override, set_path, validate_scenario

pd = lazy_import("pandas")     # on first use: `simrun -h` builds the sweep flags without pandas


class SweepError(ValueError):
    """A sweep that cannot run as asked; the message names the flag and what is allowed."""


# ----------------------------------------------------------------------------- axes and points

@dataclass(frozen=True)
class Axis:
    """One swept field: its dotted path and its values, as typed and as parsed YAML."""

    path: str
    texts: tuple[str, ...]
    values: tuple[Any, ...]


def split_values(text: str) -> list[str]:
    """'8,16,32' -> ['8', '16', '32']; a YAML flow collection ('[0,600]', '{a: 1, b: 2}') is one value."""
    stripped = text.strip()
    if stripped.startswith(("[", "{")) or "," not in stripped:
        return [text]
    return [part.strip() for part in stripped.split(",")]


def split_sets(overrides: Sequence[str]) -> tuple[list[str], list[Axis]]:
    """--set flags -> (single-valued overrides, kept as given; swept axes, in flag order)."""
    plain, axes, seen = [], [], set()
    for text in overrides:
        keys, _ = parse_override(text)           # checks PATH=VALUE and the path
        value = text.partition("=")[2]
        dotted = ".".join(keys)
        if dotted in seen:
            raise SweepError(f"--set {dotted}: given twice; give each field once "
                             f"(list several values as {dotted}=A,B,C)")
        seen.add(dotted)
        texts = split_values(value)
        if len(texts) == 1:
            plain.append(text)
            continue
        if not all(texts):
            raise SweepError(f"--set {text!r}: an empty value in the list (expected e.g. {dotted}=8,16,32)")
        axes.append(Axis(dotted, tuple(texts), tuple(parse_override(f"{dotted}={t}")[1] for t in texts)))
    return plain, axes


def is_sweep(overrides: Sequence[str]) -> bool:
    return bool(split_sets(overrides)[1])


@dataclass(frozen=True)
class Point:
    """One combination of swept values (aligned with the sweep's axes)."""

    index: int
    texts: tuple[str, ...]
    values: tuple[Any, ...]

    def label(self, axes: Sequence[Axis]) -> str:
        return ", ".join(f"{a.path}={t}" for a, t in zip(axes, self.texts))


def sweep_points(axes: Sequence[Axis], zipped: bool = False) -> list[Point]:
    """The grid (first axis outermost), or with `zipped` the element-wise pairs."""
    if zipped:
        lengths = {a.path: len(a.values) for a in axes}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{p} has {n}" for p, n in lengths.items())
            raise SweepError(f"--zip pairs values element by element, so every swept field needs "
                             f"the same number of values ({shown})")
        index_rows = [(j,) * len(axes) for j in range(len(axes[0].values))]
    else:
        index_rows = list(itertools.product(*(range(len(a.values)) for a in axes)))
    points = [Point(i, tuple(a.texts[j] for a, j in zip(axes, row)), tuple(a.values[j] for a, j in zip(axes, row)))
              for i, row in enumerate(index_rows)]
    repeated = next((texts for texts, n in Counter(p.texts for p in points).items() if n > 1), None)
    if repeated:
        shown = ", ".join(f"{a.path}={t}" for a, t in zip(axes, repeated))
        raise SweepError(f"the point {shown} comes more than once: give each value once"
                         + ("" if zipped else " (to repeat a value alongside others, use --zip)"))
    return points


# ----------------------------------------------------------------------------- one point

@dataclass(frozen=True)
class PointTask:
    """Everything a worker needs to run one point; plain data, so it pickles for processes and Ray."""

    raw: dict
    base_dir: str
    source: str
    settings: tuple[tuple[str, Any], ...]       # (dotted path, value) applied over `raw`
    label: str = ""
    out_dir: Optional[str] = None               # write the point's full run here (--point-outputs)
    trace: bool = False
    steps: str = "aggregated"                   # steps.csv of a written point (simrun --steps)
    plots: bool = True                          # a written point's figures and report.html (not --no-plots)

    def scenario(self):
        raw = self.raw
        for dotted, value in self.settings:
            raw = set_path(raw, dotted.split("."), value)
        where = f"{self.source} (at {self.label})" if self.label else self.source
        return validate_scenario(raw, base_dir=Path(self.base_dir), source=where)


def run_point(task: PointTask) -> dict[str, Any]:
    """Simulate one point -> one flat row (summary metrics, GPUs and their cost).

    A point whose model does not fit the device is a row with an `error`, not a failed
    sweep: "does not fit" is one of the answers a device sweep is asked for.
    """
    from sim.output.run_files import write_run
    from sim.predict import predict

    scenario = task.scenario()
    try:
        result = predict(scenario, task.label or scenario.name, manifest=bool(task.out_dir))
    except InsufficientMemoryError as e:
        return {"error": f"does not fit: {e}"}
    if task.out_dir:
        write_run(result, Path(task.out_dir), trace=task.trace, report=task.plots, steps=task.steps)
    return {**flatten(result.summary), **gpu_cost(scenario)}


def gpu_cost(scenario, price: Optional[float] = None) -> dict[str, Any]:
    """GPUs the scenario occupies (tp x dp x replicas) and their cost per hour (catalog price unless given)."""
    if scenario.cluster.disaggregation is not None:
        from sim.disagg_config import pool_cost
        return pool_cost(scenario, price)
    gpus = scenario.parallelism.gpus * scenario.cluster.replicas
    price = scenario.device.cost_per_hour if price is None else price
    return {"gpus": gpus, "cost_per_hour": None if price is None else gpus * price}


def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'ttft_s': {'p99': x}} -> {'ttft_s.p99': x}; lists (per-replica figures) are left out."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        elif not isinstance(value, (list, tuple)):
            out[name] = value
    return out


# ----------------------------------------------------------------------------- running many

@contextmanager
def progress_bar(label: str, total: int, quiet: bool = False) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields advance(n)."""
    if quiet:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda n=1: bar.advance(task, n)


def default_jobs() -> int:
    return os.cpu_count() or 1


def parallel_map(func: Callable[[Any], Any], items: Sequence[Any], jobs: int = 1, ray: Optional[str] = None,
                 label: str = "running", quiet: bool = False) -> list[Any]:
    """[func(item) for item in items], on `jobs` local processes or, when `ray` is not None,
    as Ray tasks ('' starts a local Ray instance, else the cluster address). Results come
    back in item order whatever order they finish in."""
    items = list(items)
    if ray is not None:
        return _map_on_ray(func, items, ray or None, label, quiet)
    if jobs <= 1 or len(items) <= 1:
        with progress_bar(label, len(items), quiet) as advance:
            return [_advanced(func(item), advance) for item in items]
    return _map_on_processes(func, items, min(jobs, len(items)), label, quiet)


def _advanced(result: Any, advance: Callable[[int], None]) -> Any:
    advance(1)
    return result


def _map_on_processes(func, items: list, jobs: int, label: str, quiet: bool) -> list:
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from sim import stop

    # A stop a signal asks for goes on to the workers (each stops at its next check, sim/stop.py);
    # the points not started are cancelled, and leaving `with` waits for the workers to end.
    with ProcessPoolExecutor(max_workers=jobs, initializer=stop.in_worker) as pool, \
            stop.forwarding(stop.forward_to_pool(pool)):
        # Submit before the progress bar starts its refresh thread: forked workers then
        # never inherit a lock that thread holds.
        futures = {pool.submit(func, item): i for i, item in enumerate(items)}
        results: list = [None] * len(items)
        try:
            with progress_bar(label, len(items), quiet) as advance:
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    advance(1)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return results


def _map_on_ray(func, items: list, address: Optional[str], label: str, quiet: bool) -> list:
    from sim import stop

    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray: pip install 'kvtwin[ray]' (or run without --ray "
                         "to use local processes)") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    refs: list = []
    try:
        remote = ray.remote(func)
        refs = [remote.remote(item) for item in items]
        pending = list(refs)
        with progress_bar(f"{label} (ray)", len(items), quiet) as advance:
            while pending:
                stop.check()               # a signal asked to stop (sim/stop.py): cancel what is left
                done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                advance(len(done))
        return ray.get(refs)
    except KeyboardInterrupt:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise
    finally:
        if started:
            ray.shutdown()


# ----------------------------------------------------------------------------- the sweep

@dataclass
class Sweep:
    axes: list[Axis]
    points: list[Point]
    zipped: bool
    frame: pd.DataFrame          # one row per point: swept fields, then metrics


def point_tasks(raw: dict, base_dir: Path, source: str, axes: Sequence[Axis], points: Sequence[Point],
                outputs: Optional[Path] = None, trace: bool = False, steps: str = "aggregated",
                plots: bool = True) -> list[PointTask]:
    """One task per point, each validated here so a bad value fails before anything runs."""
    tasks = []
    for p in points:
        out_dir = str(outputs / point_folder(p, axes)) if outputs else None
        task = PointTask(raw, str(base_dir), source, tuple(zip((a.path for a in axes), p.values)),
                         p.label(axes), out_dir, trace, steps, plots)
        task.scenario()
        tasks.append(task)
    return tasks


def point_folder(point: Point, axes: Sequence[Axis]) -> str:
    """'003_block_size=16,rate=20': index first so folders sort in point order."""
    parts = ",".join(f"{a.path.rsplit('.', 1)[-1]}={t}" for a, t in zip(axes, point.texts))
    return f"{point.index:03d}_" + folder_name(parts)


def run_sweep(raw: dict, base_dir: Path, source: str, axes: list[Axis], zipped: bool = False,
              jobs: int = 1, ray: Optional[str] = None, outputs: Optional[Path] = None,
              trace: bool = False, quiet: bool = False, steps: str = "aggregated", plots: bool = True) -> Sweep:
    if raw.get("variants"):
        raise SweepError(f"{source} has variants ({', '.join(raw['variants'])}); a sweep runs one "
                         f"scenario: sweep the field the variants change instead, or drop them "
                         f"with --set 'variants={{}}'")
    points = sweep_points(axes, zipped)
    tasks = point_tasks(raw, base_dir, source, axes, points, outputs, trace, steps, plots)
    import sim.predict  # noqa: F401  (imported once here, so forked workers inherit it, not import it each)
    rows = parallel_map(run_point, tasks, jobs, ray, label=f"sweep ({len(points)} points)", quiet=quiet)
    return Sweep(axes, points, zipped, sweep_frame(axes, points, rows))


def sweep_frame(axes: Sequence[Axis], points: Sequence[Point], rows: Sequence[dict]) -> pd.DataFrame:
    """Swept fields first (scalars as parsed, collections as typed), then metrics, `error` last."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(k for k in row if k != "error"))
    if any("error" in row for row in rows):
        columns["error"] = None
    records = []
    for p, row in zip(points, rows):
        swept = {a.path: v if _is_scalar(v) else t for a, t, v in zip(axes, p.texts, p.values)}
        records.append({**swept, **{c: row.get(c) for c in columns}})
    return pd.DataFrame.from_records(records, columns=[a.path for a in axes] + list(columns))


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


# ----------------------------------------------------------------------------- plots

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


# ----------------------------------------------------------------------------- output

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


# ----------------------------------------------------------------------------- CLI

def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="local processes for the points (default: one per core)")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="run the points as tasks on a Ray cluster at ADDRESS (no address: "
                             "start a local Ray instance); needs the ray extra")


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `simrun SCENARIO --set a=1,2 ...`; they apply only when a --set has several values."""
    add_parallel_args(parser)
    parser.add_argument("--zip", action="store_true",
                        help="pair the swept fields' values element by element instead of a grid")
    parser.add_argument("--point-outputs", action="store_true",
                        help="also write each point's full run (summary, CSVs, plots, report) "
                             "under OUT/points/ (with --no-plots: its data files only)")


def check_jobs(jobs: Optional[int]) -> int:
    if jobs is not None and jobs < 1:
        raise SweepError(f"--jobs {jobs}: expected at least 1")
    return jobs or default_jobs()


def base_raw(path: Path, overrides: Sequence[str], seed: Optional[int]) -> dict:
    """The scenario file as a mapping with the single-valued --set and --seed applied."""
    raw = apply_overrides(load_raw(path), list(overrides))
    if seed is not None:
        raw["seed"] = seed
    return raw


def sweep_main(args: argparse.Namespace) -> int:
    """`simrun SCENARIO --set PATH=A,B ...`: run the sweep, write and print its results."""
    for flag, given in (("--trace", args.trace), ("--steps full", getattr(args, "steps", "aggregated") == "full")):
        if given and not args.point_outputs:
            raise SweepError(f"{flag} applies to each point's own run files: add --point-outputs")
    plain, axes = split_sets(args.overrides)
    raw = base_raw(args.scenario, plain, args.seed)
    out = args.out or Path("runs") / args.scenario.stem / "sweep"
    t0 = time.monotonic()
    with owned_run_folder(out, force=getattr(args, "force", False)):
        plots = not getattr(args, "no_plots", False)
        sweep = run_sweep(raw, args.scenario.parent.resolve(), str(args.scenario), axes, args.zip,
                          check_jobs(args.jobs), args.ray, out / "points" if args.point_outputs else None,
                          args.trace, args.quiet, getattr(args, "steps", "aggregated"), plots)
        # titled by the scenario's name, as its run figures are (the folder keeps the file's stem)
        write_sweep(sweep, out, f"kvtwin sweep: {raw.get('name') or 'scenario'}", sweep_setup(raw, args.scenario),
                    plots)
    if not args.quiet:
        print_sweep(sweep, out, time.monotonic() - t0, plots)
    return 0


def sweep_setup(raw: dict, path: Path) -> Optional[dict]:
    """The base scenario's setup header (the swept fields vary around it), or None if the base
    alone is not a valid scenario (a sweep may supply a required field)."""
    from sim.output.setup import setup_manifest
    from sim.scenario import ScenarioError

    try:
        return setup_manifest(validate_scenario(raw, base_dir=path.parent.resolve(), source=str(path)))
    except (ScenarioError, ValueError):
        return None


def print_sweep(sweep: Sweep, out: Path, wall_s: float, plots: bool = True) -> None:
    from sim.output.console import console

    table = display_table(sweep.frame, [a.path for a in sweep.axes], table_metrics(sweep.axes, SHORT_COLUMNS))
    print_frame(table.rename(columns={a.path: a.path.rsplit(".", 1)[-1] for a in sweep.axes}))
    failed = sweep.frame["error"].notna().sum() if "error" in sweep.frame else 0
    if failed:
        console.print(f"[yellow]{failed} point(s) did not run[/]: see the error column")
    written = "sweep.csv, sweep_*.png, sweep.html" if plots else "sweep.csv; no plots: --no-plots"
    console.print(f"{len(sweep.points)} points in {wall_s:.1f} s; wrote {out}/ ({written})")


def check_sweep_flags(args: argparse.Namespace) -> None:
    """Sweep-only flags on a single run are a mistake worth naming."""
    for flag, given in (("--zip", args.zip), ("--point-outputs", args.point_outputs),
                        ("--ray", args.ray is not None), ("--jobs", args.jobs is not None)):
        if given:
            raise SweepError(f"{flag} applies to sweeps: give a --set with several values, "
                             f"e.g. --set engine.block_size=8,16,32")
