"""What `simrun bench` and `simrun compare` write and print: measured/, predicted/,
comparison.csv, the figures and report.html (validate's tables and plots), the measured time
series against the prediction's, and the terminal tables with any warning banner first."""
from __future__ import annotations

from pathlib import Path

from sim.core.lazy import lazy_import
from sim.output.console import console, err_console
from sim.output.io import write_csv, write_json
from validate.measured import Measured

np = lazy_import("numpy")
pd = lazy_import("pandas")

TIMELINE_FIGURE = "endpoint_timeline"


def write_comparison(predicted, measured: Measured, out: Path, title: str) -> tuple[pd.DataFrame, dict]:
    """measured/, predicted/, comparison.csv, plots and report.html (validate's tables and plots)."""
    from sim.output.run_files import view_of, write_run
    from sim.output.report import plot_run_figures, write_html_report
    from validate.compare import comparison_table
    from validate.plots import plot_relative_errors

    out = Path(out)
    files = {f"predicted_{k}": p for k, p in write_run(predicted, out / "predicted", report=False, steps="aggregated").items()}
    table = comparison_table(predicted.summary, measured.summary)
    files["comparison"] = write_csv(out / "comparison.csv", table.reset_index())
    views = {"predicted": view_of(predicted, "predicted"), "measured": measured.view()}
    from sim.output.run_files import setup_title

    figures = plot_run_figures(views, out, setup_title(predicted))
    figures["errors"] = plot_relative_errors(table, out / "errors.png")
    extra = [("Predicted vs measured", table)]
    if measured.series is not None:
        series_table, aligned = series_comparison(views["predicted"], measured)
        measured.manifest["series_table"] = series_table.to_dict("records")
        files["series"] = write_csv(out / "series_comparison.csv", aligned)
        figures[TIMELINE_FIGURE] = plot_series(views["predicted"], aligned, measured.manifest["series"],
                                               out / f"{TIMELINE_FIGURE}.png")
        extra.append(("Running, waiting, KV %: mean absolute difference over time", series_table))
    files.update(write_measured(measured, out / "measured"))
    files.update(figures)
    notes = measured.manifest.get("notes") or []
    if notes:
        extra.insert(0, ("Warnings", pd.DataFrame({"warning": notes})))
    files["report"] = write_html_report(out / "report.html", title, views, figures,
                                        {"predicted": predicted.manifest, "measured": measured.manifest},
                                        extra_tables=extra, setup=predicted.manifest)
    return table, files


def series_comparison(predicted, measured: Measured) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The measured series on the run's clock beside the prediction, and the difference table;
    the alignment used is recorded in the manifest."""
    from sim.vllm.timeseries import align_offset, compare_series

    series = measured.series
    steps = predicted.steps
    if measured.series_offset is not None:
        offset, how = measured.series_offset, "given"
    elif series.attrs.get("on_run_clock"):
        offset, how = 0.0, "none needed (scraped by this run's client)"
    else:
        offset, how = align_offset(series, steps, predicted.kv_blocks_total, measured.run_t0_wall,
                                   predicted.requests["arrival_s"].dropna().to_numpy())
    aligned, table = compare_series(series, steps, predicted.kv_blocks_total, offset)
    measured.manifest["series"] = {"source": series.attrs.get("source", "/metrics scrapes"),
                                   "kind": series.attrs.get("kind"), "samples": len(series),
                                   "offset_s": offset, "alignment": how}
    return table, aligned


def write_measured(measured: Measured, folder: Path) -> dict[str, Path]:
    files = {"measured_summary": write_json(folder / "summary.json", measured.summary),
             "measured_requests": write_csv(folder / "requests.csv", measured.requests),
             "measured_manifest": write_json(folder / "manifest.json", measured.manifest)}
    if measured.timeline is not None:
        files["measured_timeline"] = write_csv(folder / "metrics_timeline.csv", measured.timeline)
    return files


def plot_series(predicted, aligned: pd.DataFrame, info: dict, path: Path) -> Path:
    """Running, waiting and KV usage (%): the predicted step curves against the measured samples."""
    from sim.output.report import finish_axes, new_figure, save_figure
    from sim.vllm.timeseries import predicted_at

    fig, axes = new_figure(nrows=3, sharex=True)
    end = max(float(predicted.steps["end_s"].max()) if not predicted.steps.empty else 0.0,
              float(aligned["t_s"].max()) if len(aligned) else 0.0)
    grid = np.linspace(min(0.0, float(aligned["t_s"].min()) if len(aligned) else 0.0), end, 2000)
    curve = predicted_at(predicted.steps, predicted.kv_blocks_total, grid)
    titles = {"running": "Running requests", "waiting": "Waiting requests", "kv_usage_pct": "KV cache usage (%)"}
    for ax, (q, title) in zip(axes, titles.items()):
        ax.plot(grid, curve[q], drawstyle="steps-post", color="C0", label="predicted")
        ax.plot(aligned["t_s"], aligned[f"measured_{q}"], ls="none", marker=".", color="C1",
                label=f"measured ({info.get('kind') or 'series'})")
        finish_axes(ax, title, "%" if q == "kv_usage_pct" else "requests", counts=q != "kv_usage_pct",
                    xlabel="time since the first arrival (s)" if q == "kv_usage_pct" else "")
    axes[0].set_title(f"Running requests (measured shifted by {info['offset_s']:+.1f} s: {info['alignment']})")
    return save_figure(fig, path)


def print_comparison(table: pd.DataFrame, measured: Measured, out: Path) -> None:
    from rich.table import Table

    print_banner(measured.manifest.get("notes") or [], measured.manifest.get("kind") == "vLLM benchmark result")
    view = Table(title="predicted vs measured", header_style="bold")
    for col in ("metric", "predicted", "measured", "error"):
        view.add_column(col, justify="left" if col == "metric" else "right")
    from sim.output.pages import display_comparison

    shown = display_comparison(table)
    for (metric, row), (_, raw) in zip(shown.iterrows(), table.iterrows()):
        if pd.isna(raw.predicted) and pd.isna(raw.measured):
            continue
        view.add_row(metric, row.predicted, row.measured, row.error)
    console.print(view)
    print_series_table(measured)
    s = measured.summary
    if s.get("partial"):
        err_console.print(f"[yellow]partial[/]: {s.get('requests_finished')} of {s.get('requests_total')} "
                          f"requests finished; failures: {s.get('failures') or s.get('requests_failed')}")
    console.print(f"wrote {out}/ (report.html, comparison.csv, measured/, predicted/)")


def print_banner(notes: list[str], workload: bool) -> None:
    """Differences that make the comparison doubtful, shown before any number."""
    if not notes:
        return
    from rich.panel import Panel

    title = "WORKLOAD MISMATCH" if workload else "warning"
    err_console.print(Panel("\n".join(f"- {n}" for n in notes), title=title, border_style="yellow"))


def print_series_table(measured: Measured) -> None:
    rows = measured.manifest.get("series_table")
    if not rows:
        return
    from rich.table import Table

    info = measured.manifest["series"]
    view = Table(title=f"over time: {info['samples']} samples of {info['source']}, offset {info['offset_s']:+.2f} s "
                       f"({info['alignment']})", header_style="bold")
    for col in ("quantity", "mean |predicted - measured|", "measured mean", "predicted mean", "samples"):
        view.add_column(col, justify="left" if col == "quantity" else "right")
    for row in rows:
        view.add_row(row["quantity"], _fmt(row["mean_abs_diff"]), _fmt(row["measured_mean"]),
                     _fmt(row["predicted_mean"]), str(row["samples"]))
    console.print(view)


def _fmt(value) -> str:
    from sim.output.units import format_value

    return "n/a" if pd.isna(value) else format_value(value)
