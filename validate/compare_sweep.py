"""`simrun compare` on a rate sweep: a `vllm bench serve --append-result` file (one run per
line) against the scenario predicted at each run's rate.

Each run is predicted with the scenario's engine and lengths and the run's own arrival
settings (request_rate: "inf" = every request at t=0, else Poisson, or gamma with cv =
1/sqrt(burstiness); max_concurrency when the scenario schema has it), or with
--use-file-workload on the run's own requests. Measured figures are vLLM's own summary keys
(mean/median/p99 of TTFT, TPOT, ITL, E2E in ms; throughputs), so files without
--save-detailed compare too. Writes sweep_comparison.csv (one row per rate and metric),
latency_vs_rate.png and report.html.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from sim.output.console import console, err_console
from sim.output.io import write_csv
from validate.comparison_output import print_banner
from validate.vllm_result import file_workload_scenario, model_mismatches, workload_mismatches

# (label, summary section, statistic, vLLM key); latencies in ms in vLLM's file, s in ours
LATENCIES = (("TTFT mean", "ttft_s", "mean", "mean_ttft_ms"), ("TTFT p50", "ttft_s", "p50", "median_ttft_ms"),
             ("TTFT p99", "ttft_s", "p99", "p99_ttft_ms"), ("TPOT mean", "tpot_s", "mean", "mean_tpot_ms"),
             ("TPOT p99", "tpot_s", "p99", "p99_tpot_ms"), ("ITL mean", "itl_s", "mean", "mean_itl_ms"),
             ("E2E mean", "e2e_s", "mean", "mean_e2el_ms"), ("E2E p99", "e2e_s", "p99", "p99_e2el_ms"))
THROUGHPUTS = (("requests/s", "request_throughput", "request_throughput"),
               ("output tokens/s", "output_token_throughput", "output_throughput"))
PLOTTED = ("TTFT mean", "TTFT p99", "TPOT mean", "E2E mean")


def scenario_at_run(scenario, run, use_file_workload: bool):
    """The scenario with the run's arrivals (or its own requests), and notes on what differs."""
    if use_file_workload:
        return file_workload_scenario(scenario, run)[0], []
    w = scenario.workload
    if w.requests is not None or w.trace is not None:
        return scenario, [f"{run.source}: the scenario's workload is explicit requests or a trace; its arrivals "
                          f"are kept, not the run's rate {run.rate:g}/s"]
    if math.isinf(run.rate):
        arrival = w.arrival.model_copy(update={"process": "offline", "rate": None})
    else:
        b = run.burstiness
        arrival = w.arrival.model_copy(update={"process": "poisson" if b == 1 else "gamma", "rate": run.rate,
                                               "cv": 1 / math.sqrt(b)})
    update = {"arrival": arrival}
    if run.max_concurrency is not None and "max_concurrency" in type(w).model_fields:
        update["max_concurrency"] = run.max_concurrency
    at_rate = scenario.model_copy(update={"workload": w.model_copy(update=update)})
    data = {**run.config, **run.metrics, **run.per_request}
    mismatches = model_mismatches(data, at_rate) + workload_mismatches(data, at_rate, run.detailed)
    notes = [f"{run.source}: {n}" for n in mismatches]
    if run.max_concurrency is not None and "max_concurrency" not in update:
        notes.append(f"{run.source}: the run capped concurrency at {run.max_concurrency}; the prediction does not")
    return at_rate, notes


def sweep_rows(rate: float, summary: dict, metrics: dict) -> list[dict]:
    rows = []
    for label, section, stat, key in LATENCIES:
        measured = metrics.get(key)
        predicted = (summary.get(section) or {}).get(stat)
        rows.append(_row(rate, label, "s", predicted, None if measured is None else measured / 1e3))
    for label, ours, theirs in THROUGHPUTS:
        rows.append(_row(rate, label, "1/s", summary.get(ours), metrics.get(theirs)))
    return rows


def _row(rate, metric, unit, predicted, measured) -> dict:
    p = math.nan if predicted is None else float(predicted)
    m = math.nan if measured is None else float(measured)
    error = (p - m) / m if m and not math.isnan(p) and not math.isnan(m) else math.nan
    return {"request_rate": rate, "metric": metric, "unit": unit, "predicted": p, "measured": m,
            "relative_error": error}


def compare_sweep(scenario, runs, out: Path, use_file_workload: bool, allow_mismatch: bool) -> int:
    from sim.predict import predict

    rows, notes, summaries = [], [], {}
    for run in sorted(runs, key=lambda r: r.rate):
        at_rate, run_notes = scenario_at_run(scenario, run, use_file_workload)
        notes += run_notes
        result = predict(at_rate, f"rate {run.rate:g}")
        summaries[run.rate] = result.summary
        rows += sweep_rows(run.rate, result.summary, run.metrics)
    table = pd.DataFrame(rows)
    print_banner(notes, workload=True)
    out = Path(out)
    files = {"table": write_csv(out / "sweep_comparison.csv", table),
             "plot": plot_latency_vs_rate(table, out / "latency_vs_rate.png")}
    files["report"] = _report(out, scenario, table, notes, files["plot"])
    print_sweep(table)
    console.print(f"wrote {out}/ (sweep_comparison.csv, latency_vs_rate.png, report.html)")
    if notes and not allow_mismatch:
        err_console.print("[bold red]workload mismatch[/]: exit status 1 (--allow-mismatch to accept it, "
                          "--use-file-workload to replay each run's own requests)")
        return 1
    return 0


def _x(rates: np.ndarray) -> tuple[np.ndarray, float]:
    """Plot positions: an infinite rate (all at t=0) sits one step beyond the largest finite one."""
    finite = rates[np.isfinite(rates)]
    inf_at = (finite.max() * 1.25) if len(finite) else 1.0
    return np.where(np.isfinite(rates), rates, inf_at), inf_at


def plot_latency_vs_rate(table: pd.DataFrame, path: Path) -> Path:
    from sim.output.report import finish_axes, new_figure, save_figure

    fig, axes = new_figure(ncols=2, nrows=2)
    for ax, metric in zip(axes, PLOTTED):
        part = table[table["metric"] == metric]
        x, inf_at = _x(part["request_rate"].to_numpy(float))
        ax.plot(x, part["measured"] * 1e3, marker="o", color="C1", label="measured (vLLM)")
        ax.plot(x, part["predicted"] * 1e3, marker="x", ls="--", color="C0", label="predicted (kvtwin)")
        finish_axes(ax, f"{metric} vs request rate", "ms", xlabel="request rate (req/s)")
        if not np.isfinite(part["request_rate"]).all():
            ax.annotate("inf", (inf_at, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom")
    return save_figure(fig, path)


def _report(out: Path, scenario, table: pd.DataFrame, notes: list[str], plot: Path) -> Path:
    from sim.output.report import html_figure, html_table, write_html_page

    body = []
    if notes:
        body += ["<h2>Workload mismatches</h2>", html_table(pd.DataFrame({"note": notes}))]
    body += ["<h2>Predicted vs measured, per request rate</h2>", html_table(table),
             "<h2>Figures</h2>", html_figure("latency_vs_rate", plot)]
    from sim.output.setup import setup_manifest

    return write_html_page(out / "report.html", f"kvtwin vs a vLLM rate sweep: {scenario.name}", body,
                           setup=setup_manifest(scenario))


def print_sweep(table: pd.DataFrame) -> None:
    from rich.table import Table

    from sim.output.units import signed_pct

    shown = ("TTFT mean", "TTFT p99", "TPOT mean", "E2E mean", "requests/s")
    view = Table(title="predicted / measured per request rate (latencies in ms)", header_style="bold")
    view.add_column("rate (req/s)", justify="right")
    for metric in shown:
        view.add_column(metric, justify="right")
    for rate, part in table.groupby("request_rate", sort=True):
        cells = []
        for metric in shown:
            row = part[part["metric"] == metric].iloc[0]
            scale = 1e3 if row["unit"] == "s" else 1.0
            err = "" if math.isnan(row["relative_error"]) else f" ({signed_pct(row['relative_error'])})"
            cells.append(f"{_fmt(row['predicted'] * scale)} / {_fmt(row['measured'] * scale)}{err}")
        view.add_row("inf" if math.isinf(rate) else f"{rate:g}", *cells)
    console.print(view)


def _fmt(value: float) -> str:
    from sim.output.units import format_value

    return "n/a" if math.isnan(value) else format_value(value)
