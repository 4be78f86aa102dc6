"""A run's files: summary.json, requests.csv, steps.csv, manifest.json, the plots and report.html."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from sim.output.io import write_csv, write_json
from sim.output.report import RunView, plot_run_figures, write_html_report, write_perfetto_trace
from sim.predict import RunResult


def write_run(result: RunResult, out_dir: Path, trace: bool = False, report: bool = True) -> dict[str, Path]:
    """summary.json, requests.csv, steps.csv, manifest.json, and unless `report` is False the
    plots and report.html (+ trace.json when asked)."""
    out_dir = Path(out_dir)
    files = {
        "summary": write_json(out_dir / "summary.json", result.summary),
        "requests": write_csv(out_dir / "requests.csv", result.requests),
        "steps": write_csv(out_dir / "steps.csv", result.steps),
        "manifest": write_json(out_dir / "manifest.json", result.manifest),
    }
    if not report:
        result.files = files
        return files
    views = {result.name: view_of(result)}
    figures = plot_run_figures(views, out_dir)
    files.update(figures)
    files["report"] = write_html_report(out_dir / "report.html", f"kvtwin prediction: {result.name}",
                                        views, figures, result.manifest)
    if trace:
        files["trace"] = write_perfetto_trace(out_dir / "trace.json", views)
    result.files = files
    return files


def view_of(result: RunResult, label: Optional[str] = None):
    return RunView.from_records(label or result.name, result.records, result.summary,
                                result.requests, result.steps)


def nothing_finished(name: str, summary: dict) -> Optional[str]:
    """The reason a run predicts nothing (no measured request finished), or None when some did."""
    if summary.get("requests_finished"):
        return None
    reasons = summary.get("rejection_reasons") or []
    counted = "; ".join(f"{r['count']} x {r['reason']}" for r in reasons) or "none rejected"
    return (f"{name}: no request finished ({summary.get('requests_total', 0)} requests, "
            f"{summary.get('warmup_requests', 0)} of them warm-up, {summary.get('requests_rejected', 0)} "
            f"rejected, {summary.get('requests_aborted', 0)} aborted). Rejections: {counted}")
