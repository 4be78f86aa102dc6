"""A run's files: summary.json, requests.csv, steps.csv, manifest.json, the plots and report.html.

`simrun` writes them in two stages so the answer is on screen first: the data files (cheap), then
the table, then the figures and the page (`write_reports`), whose figures render in parallel
processes when there are several and more than one core.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from sim.output.io import write_csv, write_json
from sim.output.step_buckets import DEFAULT_INTERVAL_S, TIMELINE_COLUMNS, timeline_columns
from sim.predict import RunResult


STEP_FILE_KINDS = ("timeline", "aggregated", "full")


def write_data_files(result: RunResult, out_dir: Path, steps: str = "timeline",
                     interval_s: float = DEFAULT_INTERVAL_S) -> dict[str, Path]:
    """summary.json, requests.csv, steps.csv, manifest.json. steps.csv (docs/outputs.md) has a row per
    replica and `interval_s` of simulated time (`timeline`, the default), a row per record (a leap of K
    decode steps is one row, with K in `steps`: `aggregated`) or a row per engine step (`full`)."""
    out_dir = Path(out_dir)
    files = {
        "summary": write_json(out_dir / "summary.json", result.summary),
        "requests": write_csv(out_dir / "requests.csv", result.request_columns),
        "steps": write_csv(out_dir / "steps.csv", step_file_columns(result, steps, interval_s)),
        "manifest": write_json(out_dir / "manifest.json", result.manifest),
    }
    result.files.update(files)
    return files


def step_file_columns(result: RunResult, steps: str, interval_s: float = DEFAULT_INTERVAL_S):
    """The columns of steps.csv of the kind `steps` (a frame of empty columns without a recorder)."""
    if steps not in STEP_FILE_KINDS:
        raise ValueError(f"steps={steps!r}: expected one of {', '.join(STEP_FILE_KINDS)}")
    if steps == "timeline":
        columns = timeline_columns(result.records, interval_s)
        return columns if columns is not None else {c: np.zeros(0) for c in TIMELINE_COLUMNS}
    full = steps == "full"
    columns = result.records.steps_columns(full)
    return columns if columns is not None else result.records.steps_frame(full)


def write_run(result: RunResult, out_dir: Path, trace: bool = False, report: bool = True,
              steps: str = "timeline", interval_s: float = DEFAULT_INTERVAL_S) -> dict[str, Path]:
    """The data files, and unless `report` is False the plots and report.html (+ trace.json when asked)."""
    files = write_data_files(result, out_dir, steps, interval_s)
    if report or trace:
        files.update(write_reports({result.name: result}, Path(out_dir), plots=report, trace=trace))
    return files


def write_reports(results: Mapping[str, RunResult], out_dir: Path, plots: bool = True,
                  trace: bool = False, workers=None) -> dict[str, Path]:
    """Figures, report.html and (with `trace`) trace.json of one run, or of variants overlaid in one
    folder. The page opens with the setup and the summary table, as the terminal does. `workers`
    (workers.FigureWorkers) draws the figures in parallel; without, they are drawn here."""
    from sim.output.pages import write_html_report
    from sim.output.trace import write_perfetto_trace
    from sim.output.workers import FigureWorkers

    out_dir = Path(out_dir)
    views = {name: view_of(r, name, all_step_columns=trace) for name, r in results.items()}
    first = next(iter(results.values()))
    files: dict[str, Path] = {}
    if plots:
        figures = (workers or FigureWorkers(0)).draw(views, out_dir, setup_title(first))
        files.update(figures)
        title = (f"kvtwin prediction: {first.scenario.name}" if len(results) == 1
                 else f"kvtwin prediction: {first.scenario.name}, variants compared")
        manifests = first.manifest if len(results) == 1 else {n: r.manifest for n, r in results.items()}
        files["report"] = write_html_report(out_dir / "report.html", title, views, figures, manifests,
                                            setup=first.manifest)
    if trace:
        files["trace"] = write_perfetto_trace(out_dir / "trace.json", views)
    for r in results.values():
        r.files.update(files)
    return files


def setup_title(result: RunResult) -> str:
    """'quickstart: llama-3.1-8b on l4' for figure titles."""
    s = result.scenario
    tp = f" tp={s.parallelism.tp}" if s.parallelism.tp > 1 else ""
    return f"{s.name}: {s.model.name} on {s.device.name}{tp}"


def view_of(result: RunResult, label: Optional[str] = None, all_step_columns: bool = True):
    """The run as the plots and pages see it. Without `all_step_columns` (no trace to write) its step
    series are reduced from the records' columns: no per-step frame of a million-request run."""
    from sim.output.views import RunView

    steps = result.steps if all_step_columns or result.has_steps_frame or not result.records.recorders else None
    requests = result.requests if all_step_columns else result.request_columns    # (the trace sorts a frame)
    view = RunView.from_records(label or result.name, result.records, result.summary, requests, steps,
                                step_frame=False)
    view.scenario = result.scenario
    return view


def nothing_finished(name: str, summary: dict) -> Optional[str]:
    """The reason a run predicts nothing (no measured request finished), or None when some did."""
    if summary.get("requests_finished"):
        return None
    reasons = summary.get("rejection_reasons") or []
    counted = "; ".join(f"{r['count']} x {r['reason']}" for r in reasons) or "none rejected"
    return (f"{name}: no request finished ({summary.get('requests_total', 0)} requests, "
            f"{summary.get('warmup_requests', 0)} of them warm-up, {summary.get('requests_rejected', 0)} "
            f"rejected, {summary.get('requests_aborted', 0)} aborted). Rejections: {counted}")
