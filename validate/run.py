"""Predict a scenario, measure it on the engine, and write the two side by side.

    out/predicted/   summary.json, requests.csv, steps.csv, manifest.json   (the simulator)
    out/measured/    the same files from the engine replay
    out/comparison.csv       predicted vs measured with relative errors (and tolerances)
    out/step_times.csv       the cost model on every measured step next to its measured time
    out/*.png, out/report.html   side-by-side plots and one page holding all of it
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pandas as pd

from sim import stop
from sim.output.io import write_csv, write_json
from sim.output.run_files import view_of, write_run
from sim.predict import RunResult, predict
from validate.compare import comparison_table, step_time_comparison, step_time_errors
from validate.plots import plot_relative_errors, plot_step_scatter


@dataclass
class Validation:
    predicted: RunResult
    measured: RunResult
    table: pd.DataFrame
    steps: pd.DataFrame
    step_errors: dict
    files: dict[str, Path] = field(default_factory=dict)


def with_profile(scenario, profile: Optional[Path]):
    if profile is None:
        return scenario
    copy = scenario.model_copy(deep=True)
    copy.device.profile = Path(profile)
    return copy


def synchronous(scenario):
    """kvtwin's engine schedules each step after the previous one, and the replay hands it requests
    in-process, through no HTTP server: predict it without vLLM's overlap and without vLLM's
    API-server front end (engine.front_end_s 0, sim/front_end.py)."""
    if not scenario.async_scheduling and scenario.engine.front_end_s == 0:
        return scenario
    copy = scenario.model_copy(deep=True)
    copy.engine.async_scheduling = False
    copy.engine.front_end_s = 0.0
    return copy


def validate(scenario, device: str = "cpu", profile: Optional[Path] = None, online: bool = True,
             cold: bool = False, tolerances: Optional[dict[str, float]] = None,
             progress: Optional[Callable[[str], None]] = None) -> Validation:
    from engine.replay import replay

    scenario = synchronous(with_profile(scenario, profile))
    if progress:
        progress("predicting")
    predicted = predict(scenario, "predicted")
    if progress:
        progress("replaying on the engine")
    # polled: a signal's stop ends the replay at its next finished step (sim/stop.py)
    measured = replay(scenario, device=device, online=online, cold=cold, name="measured",
                      progress=stop.polling(None))
    table = comparison_table(predicted.summary, measured.summary, tolerances)
    steps = step_time_comparison(predicted.cost_model, measured.steps)
    return Validation(predicted, measured, table, steps, step_time_errors(steps))


def write_validation(v: Validation, out: Path, title: Optional[str] = None) -> dict[str, Path]:
    from sim.output.report import plot_run_figures

    out = Path(out)
    files = {f"predicted_{k}": p for k, p in write_run(v.predicted, out / "predicted", report=False, steps="aggregated").items()}
    files.update({f"measured_{k}": p for k, p in write_run(v.measured, out / "measured", report=False, steps="aggregated").items()})
    files["comparison"] = write_csv(out / "comparison.csv", v.table.reset_index())
    files["step_times"] = write_csv(out / "step_times.csv", v.steps)
    files["step_errors"] = write_json(out / "step_errors.json", v.step_errors)
    views = {"predicted": view_of(v.predicted, "predicted"), "measured": view_of(v.measured, "measured")}
    from sim.output.run_files import setup_title

    figures = plot_run_figures(views, out, setup_title(v.predicted))
    figures["step_scatter"] = plot_step_scatter(v.steps, out / "step_scatter.png")
    figures["errors"] = plot_relative_errors(v.table, out / "errors.png")
    files.update(figures)
    files["report"] = write_validation_page(
        out / "report.html", title or f"kvtwin validation: {v.predicted.scenario.name}", views, figures,
        v.table, v.step_errors, v.predicted.manifest, v.measured.manifest)
    v.files = files
    return files


def write_validation_page(path: Path, title: str, views: dict, figures: dict[str, Path], table: pd.DataFrame,
                          step_errors: dict, predicted_manifest: dict, measured_manifest: dict) -> Path:
    """report.html of a validation: the two runs' summaries, the comparison, the step-time errors,
    the figures already drawn. scripts/make_report_pages.py rebuilds committed ones from their files."""
    from sim.output.pages import write_html_report

    return write_html_report(
        path, title, views, figures, {"predicted": predicted_manifest, "measured": measured_manifest},
        setup=predicted_manifest,
        extra_tables=[("Predicted vs measured", table),
                      ("Step time: cost model vs measured steps", pd.DataFrame(step_errors).T)])
