"""Plots of one or more runs; the HTML pages, tables and trace live in pages.py and trace.py and
are re-exported here.

Every function takes {label: RunView}, so the same code draws one run, scenario variants
overlaid, and predicted vs measured side by side. Figures use matplotlib's Agg canvas
without pyplot, so importing this module changes no global backend and figures never pile
up in pyplot's registry. Step series are reduced onto a fixed number of time buckets
(keeping each bucket's maximum where peaks matter), so a 200k-step run plots as fast as a
small one. Data are in seconds; axes show milliseconds.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

import numpy as np
import matplotlib
from matplotlib.artist import Artist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import (FuncFormatter, Locator, LogFormatterSciNotation, MaxNLocator, NullLocator,
                               ScalarFormatter)

from sim.output import units
from sim.output.png import copy_channels, read_png, write_png
from sim.output.pages import (CAPTIONS, CSS, SUMMARY_ROWS, html_figure, html_setup, html_table,  # noqa: F401
                              summary_table, write_html_page, write_html_report)
from sim.output.trace import TRACE_MAX_REQUESTS, write_perfetto_trace  # noqa: F401
from sim.output.units import EMPTY, format_value  # noqa: F401
from sim.output.views import (CDF_POINTS, KV_SERIES, QUEUE_SERIES, SPLIT_SERIES, STEP_MS_MAX,  # noqa: F401
                              STEP_MS_MEAN, TIMELINE_BUCKETS, TOKENS_SERIES, RunView, cdf_points, step_ms_bins,
                              timeline)

DPI = 110
SOFTWARE = f"Matplotlib version{matplotlib.__version__}, https://matplotlib.org/"     # (as savefig writes it)

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


def finish_axes(ax, title: str, ylabel: str, xlabel: str = "run time (s)", counts: bool = False,
                legend_columns: int = 0) -> None:
    """Title, labels, tick formats and the legend: inside the axes where it hides least
    (`loc="best"`), or with `legend_columns` under the x label in that many columns (legend_under)."""
    # y given: matplotlib then skips measuring every tick label to lift the title above an x axis
    # drawn on top, which no figure here has (the same place, ~3% of the drawing)
    ax.set_title(title, y=1.0)
    # at most 6 intervals on a linear y axis (matplotlib's own default took up to 9 on these
    # panels: 0, 6, ..., 54); round steps, whole numbers for counts. Each tick is made and drawn
    # as two marks, a grid line and two labels (~3 % of drawing the figures for the ticks left out).
    # Ticks placed by hand (a FixedLocator: metric names) are kept.
    if ax.yaxis.get_scale() == "linear" and (counts or isinstance(ax.yaxis.get_major_locator(), MaxNLocator)):
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10], integer=counts))
    # shorten big numbers on a numeric axis (600000 ms side by side ran together on a CDF's x axis),
    # but never replace tick labels set by hand (metric names)
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "linear" and isinstance(axis.get_major_formatter(), ScalarFormatter):
            axis.set_major_formatter(_short_number)
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log" and type(axis.get_major_formatter()) is LogFormatterSciNotation:
            axis.set_major_formatter(PlainLogFormatter())
            axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
    for axis in (ax.xaxis, ax.yaxis):
        for get, put in ((axis.get_major_locator, axis.set_major_locator),
                         (axis.get_minor_locator, axis.set_minor_locator)):
            if not isinstance(get(), InView):          # (axes sharing an axis share its locators)
                put(InView(get()))
        if axis.get_scale() == "log":
            MinorMarks.add_to(axis)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend_columns:
        legend_under(ax, legend_columns)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


LEGEND_ROW = 0.18        # inches a row of a "small" legend takes
LEGEND_ROOM = 0.2        # inches the legend's frame and the gap above it take


def legend_under(ax, columns: int) -> None:
    """The axes' legend under its x label, `columns` entries a row, the figure made taller by the
    rows (its axes keep their size): for a panel whose series and marks fill it, where the legend
    would hide data anywhere inside (the queue's preemption marks run along its top)."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    fig = ax.figure
    room = LEGEND_ROOM + LEGEND_ROW * -(-len(handles) // columns)
    width, height = fig.get_size_inches()
    bottom, top = fig.subplotpars.bottom * height, (1 - fig.subplotpars.top) * height     # (inches)
    fig.set_size_inches(width, height + room)
    fig.subplots_adjust(bottom=(bottom + room) / (height + room), top=1 - top / (height + room))
    spot = ax.get_position()
    ax.legend(handles, labels, fontsize="small", ncol=columns, loc="upper center",
              bbox_to_anchor=((spot.x0 + spot.x1) / 2, room / (height + room)), bbox_transform=fig.transFigure)


class InView(Locator):
    """Another locator's ticks inside the view only. matplotlib makes a tick (two marks, a grid
    line, two labels) for every location a locator gives, drawn or not, and locators give one or
    more beyond each end of the view: ~20 % of the figures' ticks, made and never drawn."""

    def __init__(self, locator: Locator):
        self.locator = locator

    def set_axis(self, axis) -> None:
        super().set_axis(axis)
        self.locator.set_axis(axis)

    def __call__(self):
        ticks = np.asarray(self.locator())
        low, high = sorted(self.axis.get_view_interval())
        slack = 1e-9 * max(abs(low), abs(high), high - low)      # a tick on the view's edge is drawn
        return ticks[(ticks >= low - slack) & (ticks <= high + slack)]

    def tick_values(self, vmin, vmax):
        return self.locator.tick_values(vmin, vmax)

    def nonsingular(self, v0, v1):
        return self.locator.nonsingular(v0, v1)

    def view_limits(self, vmin, vmax):
        return self.locator.view_limits(vmin, vmax)


class MinorMarks(Artist):
    """A log axis' minor ticks, where none is labelled, drawn as one line of tick marks in their
    look. matplotlib makes a Tick for every minor location (two marks, a grid line and two labels,
    each mark's style deep-copied) to draw one mark: the step-time histogram's log axis has ~50,
    ~25 % of drawing that figure. The locations are worked out when drawn (they depend on the
    axes' size) as the axis would (Axis.get_minorticklocs, then the view); drawn just before the
    axis (the same zorder, added earlier), this sets the axis' minor locator to none for that draw,
    or where some minor tick would be labelled leaves the axis to draw them all itself."""

    @classmethod
    def add_to(cls, axis) -> None:
        ax = axis.axes
        shared = (ax.get_shared_x_axes() if axis is ax.xaxis else ax.get_shared_y_axes()).get_siblings(ax)
        tick = axis.get_minor_ticks(1)[0]
        if (len(shared) > 1 or tick.tick2line.get_visible() or tick.gridline.get_visible()
                or any(isinstance(a, cls) and a.axis is axis for a in ax.artists)):
            return                       # (a shared axis shares its locator; marks of one kind only)
        ax.add_artist(cls(axis, tick.tick1line))

    def __init__(self, axis, look: Line2D):
        super().__init__()
        self.marks = Line2D([], [])
        self.marks.update_from(look)     # marker, size, width, colour, the tick1 transform
        self.marks.set_clip_on(False)    # (ticks lie outside the axes)
        self.marks.set_figure(axis.axes.figure)
        self.set_zorder(axis.get_zorder())
        self.axis, self.locator = axis, axis.get_minor_locator()

    def draw(self, renderer) -> None:
        axis = self.axis
        axis.set_minor_locator(self.locator)
        locs = axis.get_minorticklocs()
        if not self.get_visible() or any(axis.get_minor_formatter().format_ticks(locs)):
            return                       # a label to draw: the axis draws its minor ticks itself
        axis.set_minor_locator(NullLocator())
        low, high = sorted(axis.get_transform().transform(axis.get_view_interval()))
        slack = (high - low) * 1e-10     # (the axis' own test of a tick inside the view)
        placed = axis.get_transform().transform(locs) if len(locs) else locs
        locs = locs[(placed >= low - slack) & (placed <= high + slack)]
        zeros = np.zeros(len(locs))
        self.marks.set_data((locs, zeros) if axis is axis.axes.xaxis else (zeros, locs))
        self.marks.draw(renderer)


class PlainLogFormatter(LogFormatterSciNotation):
    """A log axis' labels as matplotlib's default formatter picks them (10⁵, 2×10³), in plain
    text: mathtext's parser, built on a process's first log axis, was ~7% of drawing the figures."""

    MATHTEXT = re.compile(r"\$\\mathdefault\{(.*)\}\$")
    POWER = re.compile(r"\^\{(-?\d+)\}")
    SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")

    def __call__(self, x: float, pos: Optional[int] = None) -> str:
        text = super().__call__(x, pos)
        shown = self.MATHTEXT.fullmatch(text)
        if shown is None:
            return text
        plain = shown.group(1).replace("\\times", "×")
        return self.POWER.sub(lambda power: power.group(1).translate(self.SUPERSCRIPT), plain)


@FuncFormatter
def _short_number(x: float, _pos: int) -> str:
    return f"{x / 1000:g}k" if abs(x) >= 10_000 else f"{x:g}"


def _across_replicas(views: Mapping[str, RunView]) -> str:
    return " (sum over replicas)" if any(v.replicas > 1 for v in views.values()) else ""


def _has_cached_blocks(views: Mapping[str, RunView]) -> bool:
    """Cached-free blocks exist only with prefix caching on: without, their panel means nothing."""
    return any(v.num_steps and v.max_cached_blocks > 0 for v in views.values())


def _kv_lines(views: Mapping[str, RunView]) -> dict:
    return {label: v.series(*KV_SERIES) for label, v in views.items()}


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
    if len(axes) > 1:                # the top panel keeps its time labels: the overview shows it alone
        axes[0].set_xlabel("")
        axes[0].tick_params(labelbottom=True)
    return fig


def _kv_panel(ax, views: Mapping[str, RunView], lines: dict, column: str, what: str, ls: str) -> None:
    top = max((tl[column].max() for _, tl in lines.values() if len(tl)), default=0.0)
    totals = {label: v.kv_blocks_total * v.replicas for label, v in views.items()}
    # A pool far above the series would flatten them: stop the axis short and say so.
    ceiling = 1.1 * max([top, *(t for t in totals.values() if t <= 3 * top)])
    for (label, (edges, tl)), colour in zip(lines.items(), _colours(views)):
        if len(tl):
            _stairs(ax, edges, tl[column], color=colour, ls=ls, label=f"{label}: {what}")
        if totals[label] <= 0:           # a measurement that does not know its pool (a vLLM result file)
            continue
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
        edges, tl = v.series(*QUEUE_SERIES)
        if len(tl):
            _stairs(ax, edges, tl["running"], color=colour, label=f"{label}: running")
            _stairs(ax, edges, tl["waiting"], color=colour, ls="--", label=f"{label}: waiting")
        mark_preemptions(ax, v, colour, label)
    if not any(v.num_steps for v in views.values()):
        _note(ax, "no steps recorded")
    # the legend under the panel (a run's entries a row, or a column each): inside, it hid the
    # preemption marks along the top or the series, which fill the panel
    finish_axes(ax, "Running and waiting requests (bucket max)", "requests" + _across_replicas(views),
                counts=True, legend_columns=len(views) if len(views) > 1 else 3)




def mark_preemptions(ax, view: RunView, colour: str, label: str) -> None:
    """A triangle along the panel's top at each step that preempted, so the queue's jumps can be
    read against them (the summary's count says how many, not when)."""
    times, total = view.preemption_marks()
    if not total:
        return
    ax.plot(times, np.full(len(times), 0.97), "v", transform=ax.get_xaxis_transform(), color=colour, ms=5,
            markeredgecolor="C3", label=f"{label}: preemptions ({total:,})")


def plot_queue(views: Mapping[str, RunView]) -> Figure:
    fig, (ax,) = new_figure()
    draw_queue(ax, views)
    return fig


def draw_batch_tokens(ax, views: Mapping[str, RunView]) -> None:
    if len(views) == 1:            # one run: split each step's tokens into decode and prefill
        (label, v), = views.items()
        edges, tl = v.series(*SPLIT_SERIES)
        if len(tl):
            decode = np.asarray(tl["decode_seqs"])
            _stairs(ax, edges, decode, baseline=np.zeros_like(decode), alpha=0.7, color="C0",
                    label=f"{label}: decode")
            _stairs(ax, edges, decode + tl["prefill_tokens"], baseline=decode, alpha=0.7,
                    color="C1", label=f"{label}: prefill")
    else:
        for (label, v), colour in zip(views.items(), _colours(views)):
            edges, tl = v.series(*TOKENS_SERIES)
            if len(tl):
                _stairs(ax, edges, tl["batch_tokens"], color=colour, label=label)
    if not any(v.num_steps for v in views.values()):
        _note(ax, "no steps recorded")
    finish_axes(ax, "Tokens per step (bucket mean)", "tokens per step", counts=True)


def plot_batch_tokens(views: Mapping[str, RunView]) -> Figure:
    fig, (ax,) = new_figure()
    draw_batch_tokens(ax, views)
    return fig


LATENCY_PANELS = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s"))


def draw_latency_cdf(ax, views: Mapping[str, RunView], name: str, column: str, ylabel: str = "") -> None:
    """One latency's CDF per run, the scenario's SLO on it as a dashed vertical line."""
    samples = {label: v.latency_cdf(column) for label, v in views.items()}     # thinned: min and max kept
    for (label, (x, p, n)), colour in zip(samples.items(), _colours(views)):
        if n:
            ax.plot(x, p, drawstyle="steps-post", color=colour, label=f"{label} (n={n:,})")
    limits = sorted({v.slo[column] for v in views.values() if column in v.slo})
    for limit in limits:
        ax.axvline(limit * 1e3, color="C3", ls="--", lw=1, label=f"SLO {units.ms_unit(limit)}")
    pooled = np.concatenate([*(x for x, _, _ in samples.values()), np.asarray(limits) * 1e3])
    if not any(n for _, _, n in samples.values()):
        _note(ax, "no finished requests")
    elif pooled.min() > 0 and pooled.max() > 50 * pooled.min():   # wide spread: log axis
        ax.set_xscale("log")
    finish_axes(ax, f"{name} CDF", ylabel, f"{name} (ms)")


def plot_latency_cdf(views: Mapping[str, RunView]) -> Figure:
    fig, axes = new_figure(len(LATENCY_PANELS), sharey=True)
    for ax, (name, column) in zip(axes, LATENCY_PANELS):
        draw_latency_cdf(ax, views, name, column, "fraction of requests" if ax is axes[0] else "")
    return fig


def draw_step_timeline(ax, views: Mapping[str, RunView]) -> None:
    for (label, v), colour in zip(views.items(), _colours(views)):
        edges, mean = v.series(*STEP_MS_MEAN)
        if len(mean):
            _, peak = v.series(*STEP_MS_MAX)
            _stairs(ax, edges, peak["step_ms"], color=colour, alpha=0.3, lw=0.8)
            _stairs(ax, edges, mean["step_ms"], color=colour, label=f"{label}: mean (light: max)")
    if not any(v.num_steps for v in views.values()):
        _note(ax, "no steps recorded")
    finish_axes(ax, "Step time (per bucket)", "step time (ms)")


def plot_step_time(views: Mapping[str, RunView]) -> Figure:
    fig, (ax, hist) = new_figure(2, width_ratios=(3, 1))
    draw_step_timeline(ax, views)
    bins = step_ms_bins(views)
    if bins is not None:
        for (label, v), colour in zip(views.items(), _colours(views)):
            if v.step_ms_range() is not None:      # a run without steps gets no empty legend entry
                _stairs(hist, bins, v.step_ms_histogram(bins), color=colour, label=label)
        hist.set_yscale("log")
    else:
        _note(hist, "no steps recorded")
    finish_axes(hist, "Step time distribution", "steps", "step time (ms)")
    return fig


PLOTS: dict[str, Callable[[Mapping[str, RunView]], Figure]] = {
    "kv_blocks": plot_kv_blocks, "queue": plot_queue, "batch_tokens": plot_batch_tokens,
    "latency_cdf": plot_latency_cdf, "step_time": plot_step_time,
}
# The run on one page: KV blocks used, the queue, tokens per step, TTFT and TPOT CDFs with their
# SLOs, step time. Not drawn again: it is made of those panels of the figures above as they were
# drawn (drawing its six axes a second time was ~30 % of the figures' CPU). Rows of (figure, axes).
OVERVIEW = "overview"
OVERVIEW_GRID = ((("kv_blocks", 0), ("queue", 0)),
                 (("batch_tokens", 0), ("step_time", 0)),
                 (("latency_cdf", 0), ("latency_cdf", 1)))
# what `simrun` writes for a run: the overview and every plot above
RUN_FIGURES = (OVERVIEW, *PLOTS)
PANELS_TEXT = "kvtwin panels"    # a PNG text: each axes' region in the image (the overview's crops)
TITLE_ROOM = 0.4                 # inches above a top axes that hold its own title (the figure's is above)


class Drawn(NamedTuple):
    """A figure drawn: its pixels, and where each axes is in them (panel_boxes)."""

    pixels: np.ndarray
    boxes: list


def draw_figure(fig: Figure, dpi: float = DPI) -> Drawn:
    pixels = figure_pixels(fig, dpi)
    return Drawn(pixels, panel_boxes(fig, *pixels.shape[:2]))


def save_drawn(drawn: Drawn, path: str | Path, dpi: float = DPI) -> Path:
    """The pixels written by sim/output/png.py, the panels' boxes as a PNG text (read_drawn)."""
    return write_png(path, drawn.pixels, dpi, SOFTWARE, {PANELS_TEXT: json.dumps(drawn.boxes, separators=(",", ":"))})


def read_drawn(path: str | Path) -> Drawn:
    """A figure save_drawn wrote (by this process or another)."""
    pixels, texts = read_png(path)
    return Drawn(pixels, json.loads(texts[PANELS_TEXT]))


def save_figure(fig: Figure, path: str | Path, dpi: int = DPI) -> Path:
    """The figure drawn on matplotlib's Agg canvas at `dpi`, as fig.savefig(path, dpi=dpi) would,
    and written by sim/output/png.py (Pillow's PNG encoder cost as much as the drawing), with
    where each axes is in it."""
    return save_drawn(draw_figure(fig, dpi), path, dpi)


def panel_boxes(fig: Figure, height: int, width: int) -> list[list[int]]:
    """Each axes' region in the figure's (height, width) pixels, [left, top, right, bottom] from
    the top-left: its place in the grid and the labels around it (half the gap to a neighbour, the
    margin at the figure's edge), and above a top axes its title but not the figure's."""
    spots = [ax.get_position() for ax in fig.axes]
    room = TITLE_ROOM / fig.get_figheight()
    boxes = []
    for spot in spots:
        before = max((o.x1 for o in spots if o.x1 <= spot.x0), default=None)
        after = min((o.x0 for o in spots if o.x0 >= spot.x1), default=None)
        below = max((o.y1 for o in spots if o.y1 <= spot.y0), default=None)
        above = min((o.y0 for o in spots if o.y0 >= spot.y1), default=None)
        left = 0.0 if before is None else (before + spot.x0) / 2
        right = 1.0 if after is None else (spot.x1 + after) / 2
        bottom = 0.0 if below is None else (below + spot.y0) / 2
        top = min(1.0, spot.y1 + room) if above is None else (spot.y1 + above) / 2
        boxes.append([round(left * width), round((1 - top) * height), round(right * width),
                      round((1 - bottom) * height)])
    return boxes


def overview_pixels(figures: Mapping[str, Drawn]) -> np.ndarray:
    """The overview's RGB pixels from its figures as drawn: OVERVIEW_GRID's panels cut out, a
    row's side by side from the left, under its first figure's title."""
    rows = [[figures[name].pixels[top:bottom, left:right, :3] for name, index in row
             for left, top, right, bottom in [figures[name].boxes[index]]] for row in OVERVIEW_GRID]
    first, index = OVERVIEW_GRID[0][0]
    band = figures[first].pixels[:figures[first].boxes[index][1], :, :3]     # the figure title, centred in its figure
    heights = [max(cell.shape[0] for cell in row) for row in rows]
    width = max(sum(cell.shape[1] for cell in row) for row in rows)
    canvas = np.full((len(band) + sum(heights), width, 3), 255, dtype=np.uint8)
    offset = max(0, (width - band.shape[1]) // 2)
    copy_channels(canvas[:len(band), offset:offset + band.shape[1]], band[:, :width])
    y = len(band)
    for row, height in zip(rows, heights):       # each row's panels side by side from the left
        x = 0
        for cell in row:
            copy_channels(canvas[y:y + cell.shape[0], x:x + cell.shape[1]], cell)
            x += cell.shape[1]
        y += height
    return canvas


# Text set without the font's hinting: for every glyph laid out or drawn, FreeType ran the font's
# TrueType hinting program (a bytecode interpreter: ~9 % of drawing simrun's figures); unhinted,
# each glyph is its outline at its exact place: a little softer at this size.
DRAWING_RC = {"text.hinting": "no_hinting"}


def figure_pixels(fig: Figure, dpi: float = DPI) -> np.ndarray:
    """The figure drawn on matplotlib's Agg canvas at `dpi` (with DRAWING_RC): (height, width, 4)
    uint8 RGBA."""
    shown_dpi = fig.dpi
    fig.dpi = dpi
    try:
        canvas = FigureCanvasAgg(fig)
        with matplotlib.rc_context(DRAWING_RC):
            canvas.draw()
        return np.asarray(canvas.buffer_rgba())
    finally:
        fig.dpi = shown_dpi


def titled(fig: Figure, title: str) -> Figure:
    """A figure title above the panels' own (scenario, model, device), with room made for it."""
    if title:
        height = fig.get_figheight()
        fig.suptitle(title, fontsize="large", y=1 - 0.08 / height, va="top")
        top = fig.subplotpars.top
        fig.subplots_adjust(top=min(top, 1 - 0.75 / height))
    return fig


def plot_run_figures(views: Mapping[str, RunView], out_dir: str | Path, title: str = "",
                     names: Optional[Iterable[str]] = None) -> dict[str, Path]:
    """Write each figure in `names` (default PLOTS'; RUN_FIGURES adds the overview) as
    out_dir/<name>.png; returns {name: path}. The overview is made last, from its figures as drawn
    here or, drawn by another process, as written in out_dir."""
    out_dir = Path(out_dir)
    names = list(PLOTS if names is None else names)
    drawn, paths = {}, {}
    for name in names:
        if name != OVERVIEW:
            drawn[name] = draw_figure(titled(PLOTS[name](views), title))
            paths[name] = save_drawn(drawn[name], out_dir / f"{name}.png")
    if OVERVIEW in names:
        sources = {name: drawn[name] if name in drawn else read_drawn(out_dir / f"{name}.png")
                   for row in OVERVIEW_GRID for name, _ in row}
        paths[OVERVIEW] = write_png(out_dir / f"{OVERVIEW}.png", overview_pixels(sources), DPI, SOFTWARE)
    return {name: paths[name] for name in names}
