"""`simrun`: predict a scenario (the default command) and the other entry points.

    simrun SCENARIO.yaml [--out DIR] [--set PATH=VALUE ...] [--seed N] [--trace]
    simrun SCENARIO.yaml --set PATH=A,B,C [--set PATH2=X,Y] [--zip] [--jobs N | --ray [ADDRESS]]  (a sweep)
    simrun validate | calibrate | plan | serve | bench | compare ...   (see `simrun COMMAND -h`)
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from rich.table import Table

from sim.core.memory import InsufficientMemoryError
from sim.errors import UserError
from sim.output.console import console, err_console, print_error, print_note
from sim.output.run_dir import out_folder_arg, owned_run_folder
from sim.scenario import ScenarioError, expand_variants, load_scenario, scenario_args

# subcommand -> "module:function" taking argv; imported lazily so `simrun x.yaml` stays light.
SUBCOMMANDS = {
    "run": "sim.cli:run_main",
    "plan": "sim.whatif.plan:plan_main",
    "validate": "validate.cli:validate_main",
    "calibrate": "validate.cli:calibrate_main",
    "serve": "engine.server:serve_main",
    "bench": "validate.bench:bench_main",
    "compare": "validate.bench:compare_main",
    "from-vllm": "sim.vllm.serve_flags:from_vllm_main",
}

def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
    if argv and argv[0] == command:
        argv = argv[1:]
    module, func = SUBCOMMANDS[command].split(":")
    handler: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    try:
        return handler(argv)
    except (UserError, ScenarioError, InsufficientMemoryError, ValueError, OSError) as e:
        print_error(str(e))
        return 2
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130


def step_time_line(cost_model) -> str:
    """Where a run's step times came from, in words (every run's table names it)."""
    source = cost_model.step_time_source
    if source == "datasheet":
        return ("datasheet (UNCALIBRATED: datasheet peaks x default efficiencies; `simrun calibrate "
                "--from-vllm` fits them to your runs, `step_times: tables` uses measured operators)")
    words = {"tables": cost_model.tables.describe() if cost_model.tables else "operator tables",
             "calibrated": f"calibrated profile ({cost_model.profile.source})",
             "calibrated tables": f"operator tables tuned by a calibrated profile ({cost_model.profile.source})"}
    quality = cost_model.profile.fit.get("quality") if cost_model.profile.calibrated else None
    return words[source] + (" [POOR FIT: see the profile's fit.warnings]" if quality == "poor" else "")


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simrun", description="Predict KV memory, throughput and latency of an LLM-serving scenario.",
        epilog=f"other commands: {', '.join(sorted(c for c in SUBCOMMANDS if c != 'run'))} "
               f"(simrun COMMAND -h)")
    scenario_args(p)
    p.add_argument("--out", type=out_folder_arg, default=None, help="output folder (default runs/<scenario name>)")
    p.add_argument("--force", action="store_true", help="write into --out even if it holds files kvtwin did not write")
    p.add_argument("--trace", action="store_true", help="also write a Chrome/Perfetto trace.json")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    from sim.whatif.sweep import add_sweep_args

    add_sweep_args(p)
    return p


def run_main(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    from sim.whatif.sweep import check_sweep_flags, is_sweep, sweep_main

    if is_sweep(args.overrides):          # a --set with several values: one run per point
        return sweep_main(args)
    check_sweep_flags(args)
    scenario = load_scenario(args.scenario, args.overrides, args.seed)
    variants = expand_variants(scenario, base_dir=args.scenario.parent.resolve())
    out = args.out or Path("runs") / args.scenario.stem
    results = {}
    with owned_run_folder(out, force=args.force):      # checked before simulating
        for name, variant in variants.items():
            result = predict_with_progress(variant, name, quiet=args.quiet)
            folder = out / name if len(variants) > 1 else out
            from sim.output.run_files import write_run

            write_run(result, folder, trace=args.trace)
            results[name] = result
        if len(results) > 1:
            write_comparison(results, out, args.trace)
    if not args.quiet:
        print_results(results, out)
    return exit_code_of(results)


def exit_code_of(results: dict) -> int:
    """1 when a run finished no request (every figure would be empty), with the reasons counted."""
    from sim.output.run_files import nothing_finished

    empty = [msg for name, r in results.items() if (msg := nothing_finished(name, r.summary))]
    for msg in empty:
        print_error(msg)
    return 1 if empty else 0


def predict_with_progress(scenario, name: str, quiet: bool = False):
    """Run a prediction, showing a progress bar once it has taken more than a second."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from sim.predict import predict

    total = scenario.workload.num_requests
    state: dict = {"t0": time.monotonic(), "bar": None}

    def progress(done: int) -> None:
        if quiet or total is None:
            return
        if state["bar"] is None and time.monotonic() - state["t0"] > 1.0:
            bar = Progress(TextColumn(f"simulating {name}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TimeElapsedColumn(), console=err_console, transient=True)
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task(name, total=total)
        if state["bar"] is not None:
            state["bar"].update(state["task"], completed=done)

    try:
        return predict(scenario, name, progress=progress)
    finally:
        if state["bar"] is not None:
            state["bar"].stop()


def write_comparison(results: dict, out: Path, trace: bool) -> None:
    """Variants side by side: one table, overlay plots, one HTML page."""
    from sim.output.run_files import view_of
    from sim.output.report import plot_run_figures, write_html_report, write_perfetto_trace

    views = {name: view_of(r, name) for name, r in results.items()}
    figures = plot_run_figures(views, out)
    manifests = {name: r.manifest for name, r in results.items()}
    write_html_report(out / "report.html", "kvtwin prediction: variants compared", views, figures, manifests)
    if trace:
        write_perfetto_trace(out / "trace.json", views)


def print_results(results: dict, out: Path) -> None:
    from sim.output.run_files import view_of
    from sim.output.report import summary_table

    views = {name: view_of(r, name) for name, r in results.items()}
    frame = summary_table(views)
    table = Table(title=None, show_header=True, header_style="bold")
    table.add_column("metric")
    for col in frame.columns:
        table.add_column(str(col), justify="right")
    for metric, row in frame.iterrows():
        table.add_row(str(metric), *[str(v) for v in row])
    console.print(table)
    first = next(iter(results.values()))
    console.print(f"step times: {step_time_line(first.cost_model)}")
    for name, r in results.items():
        notes = r.manifest.get("workload", {}).get("notes") or []
        for note in notes:
            print_note("note", f"({name}): {note}")
        if r.summary.get("replicas"):
            from sim.metrics import replica_frame
            from sim.whatif.sweep import print_frame

            print_frame(replica_frame(r.summary), title=f"per replica ({name})")
    console.print(f"wrote {out}/ (summary.json, requests.csv, steps.csv, manifest.json, plots, report.html)")


if __name__ == "__main__":
    sys.exit(main())
