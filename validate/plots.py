"""Plots that only a predicted-vs-measured pair has; the run plots come from sim/output/report.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sim.output.pages import row_kind
from sim.output.report import finish_axes, new_figure, save_figure

KIND_COLOURS = {"decode": "C0", "prefill": "C1", "mixed": "C2"}


def plot_step_scatter(steps: pd.DataFrame, path: str | Path) -> Path:
    """Predicted vs measured time of every measured step, coloured by step kind, with y = x (square,
    equal axes, so distance from the diagonal reads the same everywhere)."""
    fig, (ax,) = new_figure()
    fig.set_size_inches(6.5, 6.5)
    fig.subplots_adjust(left=0.13, right=0.97, bottom=0.1, top=0.9)
    for kind, part in steps.groupby("kind"):
        ax.scatter(part["measured_s"] * 1e3, part["predicted_s"] * 1e3, s=8, alpha=0.6,
                   color=KIND_COLOURS.get(kind, "C3"), label=f"{kind} ({len(part)} steps)")
    lo = max(min(steps["measured_s"].min(), steps["predicted_s"].min()) * 1e3 * 0.8, 1e-3)
    hi = max(steps["measured_s"].max(), steps["predicted_s"].max()) * 1e3 * 1.25
    ax.plot([lo, hi], [lo, hi], color="0.3", lw=1, ls="--", label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    finish_axes(ax, "Step time: cost model on each\nmeasured step's composition", "predicted (ms)",
                xlabel="measured (ms)")
    return save_figure(fig, path)


def error_chart_title(rows: pd.DataFrame) -> str:
    """The title says what is drawn: colours and tolerance marks only where tolerances were set."""
    judged = rows["within"].isin([True, False]).any()
    marks = rows["tolerance"].notna().any()
    legend = ", ".join([*(["green within tolerance, red outside"] if judged else []),
                        *(["| = tolerance"] if marks else [])])
    return f"Prediction error by metric ({legend or 'no tolerances set'})"


def plot_relative_errors(table: pd.DataFrame, path: str | Path) -> Path:
    """Horizontal bars of (predicted - measured) / measured per metric; tolerance band where set."""
    rows = table.dropna(subset=["relative_error"])
    fig, (ax,) = new_figure()
    height = 0.28 * len(rows) + 1.2
    fig.set_size_inches(10, height)
    fig.subplots_adjust(left=0.28, top=1 - 0.4 / height, bottom=0.6 / height)
    y = np.arange(len(rows))
    colours = ["C2" if w is True else "C3" if w is False else "C0" for w in rows["within"]]
    ax.barh(y, rows["relative_error"] * 100, color=colours)
    for yi, tol in zip(y, rows["tolerance"]):
        if tol is not None and not pd.isna(tol):
            ax.plot([-tol * 100, tol * 100], [yi, yi], color="0.2", lw=0, marker="|", ms=10)
    ax.set_yticks(y, [row_kind(str(label))[0] for label in rows.index])
    ax.invert_yaxis()
    ax.axvline(0, color="0.3", lw=1)
    finish_axes(ax, error_chart_title(rows), "", xlabel="(predicted - measured) / measured (%)")
    return save_figure(fig, path)
