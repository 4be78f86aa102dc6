"""The headline table of one or more runs and the self-contained HTML pages (report.html, the
sweep, plan, validate and bench pages), every number through sim.output.units. No matplotlib, so
the terminal table prints before any plotting library is loaded."""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from sim.core.lazy import lazy_import
from sim.output import units
from sim.output.io import write_text
from sim.output.setup import rejection_line, setup_fields, vllm_startup_lines
from sim.output.units import EMPTY, format_value
from sim.output.views import RunView

pd = lazy_import("pandas")      # imported where a frame is made (not by a drawing process)

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
    "errors": "(predicted - measured) / measured of each headline figure; where tolerances are set, "
              "green within, red outside, | marks the tolerance.",
    "endpoint_timeline": "KV usage and queue scraped from the endpoint's /metrics next to the prediction.",
}


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
# Speculative decoding's acceptance (vLLM's SpecDecodingLogging figures), shown when a run has it.
SPECULATIVE_ROWS = (
    ("spec: draft acceptance rate", "speculative.acceptance_rate", "pct"),
    ("spec: mean acceptance length", "speculative.mean_acceptance_length", "number"),
)

# Rows of runs with a CPU KV tier (engine.kv_offload): hits per tier and the bytes copied.
OFFLOAD_ROWS: tuple[tuple[str, str, str], ...] = (
    ("GPU prefix hit rate", "kv_offload.gpu_hit_rate", "pct"),
    ("CPU offload hit rate", "kv_offload.cpu_hit_rate", "pct"),
    ("CPU loads", "kv_offload.loads", "count"),
    ("GiB loaded from CPU", "kv_offload.gib_loaded", "number"),
    ("GiB stored to CPU", "kv_offload.gib_stored", "number"),
)

# LoRA adapters (sim/core/lora.py), shown when a run serves them.
LORA_ROWS = (
    ("lora: adapters per step", "lora.mean_adapters_per_step", "number"),
    ("lora: loads from CPU", "lora.loads_from_cpu", "count"),
    ("lora: loads from disk", "lora.loads_from_disk", "count"),
    ("lora: steps limited by max_loras", "lora.steps_limited_by_max_loras", "count"),
)


def _lookup(summary: Mapping, dotted: str) -> float:
    value: Any = summary
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    numeric = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    return float(value) if numeric else math.nan


def summary_rows(views: Mapping[str, RunView]) -> tuple[tuple[str, str, str], ...]:
    """SUMMARY_ROWS and the rows of the extras some run has (a CPU KV tier, speculative decoding,
    LoRA adapters)."""
    rows = SUMMARY_ROWS
    if any("kv_offload" in v.summary for v in views.values()):      # only runs with a CPU KV tier
        rows = rows + OFFLOAD_ROWS
    if any("speculative" in v.summary for v in views.values()):     # only runs with speculative decoding
        rows = rows + SPECULATIVE_ROWS
    if any("lora" in v.summary for v in views.values()):            # only runs serving LoRA adapters
        rows = rows + LORA_ROWS
    return rows


class TextTable(NamedTuple):
    """A table of display strings without pandas (the CLI and report.html print one as soon as a
    run ends; importing pandas for it cost ~0.4 s): row labels under `index_name`, {column: cells}."""

    index_name: str
    labels: list[str]
    columns: dict[str, list[str]]

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.columns, index=pd.Index(self.labels, name=self.index_name))


def summary_text(views: Mapping[str, RunView], ratios: bool = False) -> TextTable:
    """summary_table's formatted table as a TextTable (what summary_table(views, ratios=ratios)
    holds, cell for cell)."""
    rows = summary_rows(views)
    numbers = {label: [_lookup(v.summary, key) for _, key, _ in rows] for label, v in views.items()}
    kinds = [kind for _, _, kind in rows]
    columns = {label: [units.display(x, k) for x, k in zip(values, kinds)] for label, values in numbers.items()}
    if ratios and {"predicted", "measured"} <= set(numbers):     # a comparison: its one error convention
        columns["error"] = [units.signed_pct((p - m) / m) if m and not math.isnan(m) and not math.isnan(p)
                            else EMPTY for p, m in zip(numbers["predicted"], numbers["measured"])]
    elif ratios and len(views) > 1:
        base_label, base = next(iter(numbers.items()))
        for label, values in list(numbers.items())[1:]:
            columns[f"{label} / {base_label}"] = [units.ratio(x / b) if b and not math.isnan(b) and not math.isnan(x)
                                                  else EMPTY for x, b in zip(values, base)]
    return TextTable("metric", [row for row, _, _ in rows], columns)


def summary_table(views: Mapping[str, RunView], formatted: bool = True, ratios: bool = False) -> pd.DataFrame:
    """Headline metrics: one row per metric, one column per run.

    Formatted as display strings by default (what the CLI and the HTML show: ms, "47.7%",
    thousands separators); with formatted=False, floats in the display units (ms, percent),
    NaN where a figure is undefined. With `ratios` and several runs, a column per run after the
    first gives its ratio to the first ("continuous / static"); a predicted-vs-measured pair gets
    an `error` column instead, (predicted - measured) / measured, the convention of every
    comparison table and chart.
    """
    if formatted:
        return summary_text(views, ratios).frame()
    rows = summary_rows(views)
    index = pd.Index([row for row, _, _ in rows], name="metric")
    return pd.DataFrame({label: [units.display_number(_lookup(v.summary, key), kind) for _, key, kind in rows]
                         for label, v in views.items()}, index=index)


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


def row_kind(label: str) -> tuple[str, str]:
    """(display label, kind) of a table row labelled with machine units: "TTFT p50 (s)" is shown in
    ms, "(bytes)" in GiB, a "... rate" or "... share" without a unit as a percentage."""
    if label.endswith("(s)") and not label.startswith("duration"):
        return label[:-3] + "(ms)", "ms"
    if label.endswith("(bytes)"):
        return label[:-7] + "(GiB)", "gib"
    if label.endswith(("hit rate", "usage", "share", "attainment")):
        return label, "pct"
    return label, "number"


def display_comparison(table: pd.DataFrame) -> pd.DataFrame:
    """A predicted-vs-measured table (validate.compare.comparison_table: machine units, relative
    errors as fractions) in display units: ms, GiB, %, signed errors, ±tolerances."""
    rows = {}
    for label, row in table.iterrows():
        shown, kind = row_kind(str(label))
        cells = {"predicted": units.display(row.get("predicted"), kind),
                 "measured": units.display(row.get("measured"), kind),
                 "error": units.signed_pct(row.get("relative_error"))}
        if "tolerance" in table:
            tol = row.get("tolerance")
            cells["tolerance"] = EMPTY if tol is None or pd.isna(tol) else "±" + units.pct(tol)
        if "within" in table:
            cells["within"] = {True: "yes", False: "NO"}.get(row.get("within"), EMPTY)
        rows[shown] = cells
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis(table.index.name or "metric")


def _latencies_in_ms(frame: pd.DataFrame) -> pd.DataFrame:
    """A long comparison table (one row per metric and point, a `unit` column): rows in seconds
    shown in ms."""
    if "unit" not in frame:
        return frame
    seconds = frame["unit"] == "s"
    shown = frame.copy()
    for column in ("predicted", "measured"):
        shown[column] = shown[column].astype(float).where(~seconds, shown[column].astype(float) * 1e3)
    shown["unit"] = shown["unit"].where(~seconds, "ms")
    return shown


def _cell(column: Any, value: Any) -> str:
    """A numeric cell by its column: relative errors as signed percentages, else format_value."""
    name = str(column)
    if "rel_error" in name or name == "relative_error":
        return units.signed_pct(value) if is_number_like(value) else format_value(value)
    return format_value(value)


def is_number_like(value: Any) -> bool:
    return units.is_number(value) and not pd.isna(value)


def html_table(frame: pd.DataFrame) -> str:
    """An escaped HTML table in display units: a predicted-vs-measured table through
    display_comparison, relative-error columns as signed %, other numbers with format_value
    (strings, already in display units, as they are); a default index is left out."""
    if {"predicted", "measured", "relative_error"} <= set(frame.columns):
        frame = (display_comparison(frame) if not isinstance(frame.index, pd.RangeIndex)
                 else _latencies_in_ms(frame))
    show_index = not isinstance(frame.index, pd.RangeIndex)
    head = ([_esc(frame.index.name or "")] if show_index else []) + [_esc(c) for c in frame.columns]
    rows = []
    for key, row in frame.iterrows():
        cells = [f'<td class="label">{_esc(key)}</td>'] if show_index else []
        cells += [f"<td>{_esc(_cell(c, v))}</td>" for c, v in zip(frame.columns, row)]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return _html_grid(head, rows)


def html_text_table(table: TextTable) -> str:
    """html_table(table.frame()), made without pandas: every cell is a display string already."""
    head = [_esc(table.index_name), *map(_esc, table.columns)]
    cells = list(zip(*table.columns.values())) or [()] * len(table.labels)
    rows = [f'<tr><td class="label">{_esc(label)}</td>' + "".join(f"<td>{_esc(v)}</td>" for v in row) + "</tr>"
            for label, row in zip(table.labels, cells)]
    return _html_grid(head, rows)


def _html_grid(head: Sequence[str], rows: Sequence[str]) -> str:
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


def band_line(label: str, band: Optional[Mapping]) -> str:
    """How far this run's answer is typically off (sim/trained.py), in one sentence; '' without a band."""
    from sim.trained import band_words

    if not band:
        return ""
    parts = [f"{name}{band_words(band, key)}" for name, key in (("TTFT p99", "ttft_p99"), ("TPOT p99", "tpot_p99"),
                                                                ("throughput", "throughput")) if band.get(key)]
    return f"Error band ({label}, step times {band['source']}): " + "; ".join(parts) + "." if parts else ""


def _warnings(views: Mapping[str, RunView]) -> list[str]:
    uncalibrated = [label for label, v in views.items() if v.summary.get("calibrated") is False
                    and v.summary.get("step_time_source", "datasheet") == "datasheet"]
    sources = {label: v.summary.get("step_time_source") for label, v in views.items()
               if v.summary.get("step_time_source") not in (None, "datasheet")}
    out = [f'<p>Step times: {_esc(", ".join(f"{label}: {src}" for label, src in sources.items()))}.</p>'] \
        if sources else []
    out += [f"<p>{_esc(line)}</p>" for label, v in views.items() if (line := band_line(label, v.summary.get("error_band")))]
    if not uncalibrated:
        return out
    return out + [f'<p class="warning">Uncalibrated cost model ({_esc(", ".join(uncalibrated))}): '
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
    body = [*header, *_warnings(views), "<h2>Summary</h2>", html_text_table(summary_text(views, ratios=True))]
    for table_title, frame in extra_tables:
        body += [f"<h2>{_esc(table_title)}</h2>", html_table(frame)]
    body += ["<h2>Figures</h2>", *(html_figure(name, p) for name, p in figures.items())]
    manifest_json = json.dumps(manifest, indent=2, default=str)
    body.append(f"<details><summary>Manifest</summary><pre>{_esc(manifest_json)}</pre></details>")
    return write_html_page(path, title, body)
