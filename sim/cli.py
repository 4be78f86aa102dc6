"""`simrun`: predict a scenario (the default command) and the other entry points.

    simrun SCENARIO.yaml [--out DIR] [--set PATH=VALUE ...] [--seed N] [--no-plots] [--trace] [--steps full]
    simrun SCENARIO.yaml --set PATH=A,B,C [--set PATH2=X,Y] [--zip] [--jobs N | --ray [ADDRESS]]  (a sweep)
    simrun COMMAND ...       plan | validate | calibrate | serve | bench | compare | from-vllm
    simrun help [COMMAND] | simrun --version

Startup stays light: this module imports nothing heavy at the top, each command's module is
imported only when that command runs, and those modules import pandas, matplotlib and torch
lazily, so `simrun -h` and `simrun COMMAND -h` load none of them (tests/output/test_cli_startup.py).
Importing `sim` checks that `sim`, `engine` and `validate` are kvtwin's own (sim/ownership.py).
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional


class Command(NamedTuple):
    target: str          # "module:function", the function taking argv and returning the exit status
    summary: str         # one line for `simrun -h`
    examples: str        # printed after the command's own help


# The dispatch table: one line per command. Modules are imported only when their command runs.
COMMANDS: dict[str, Command] = {
    "run": Command("sim.cli:run_main", "predict a scenario: KV memory, throughput, latency (the default)",
                   "simrun scenarios/quickstart.yaml\n"
                   "simrun scenarios/quickstart.yaml --set workload.arrival.rate=3 --no-plots\n"
                   "simrun scenarios/quickstart.yaml --set engine.batching=static --set engine.allocation=contiguous\n"
                   "simrun scenarios/whatif_block_size.yaml --set engine.block_size=8,16,32   # a sweep"),
    "plan": Command("sim.whatif.plan_cli:plan_main", "capacity searches: highest rate within SLOs, fewest replicas",
                    "simrun plan scenarios/whatif_rate_slo.yaml --slo ttft_p99=1 --slo tpot_p99=0.1 --curve 6\n"
                    "simrun plan scenarios/whatif_replicas.yaml --target-rate 20 --devices l4,h100-sxm --tp 1,2"),
    "validate": Command("validate.cli:validate_main", "replay a scenario on the engine and compare with the prediction",
                        "simrun validate scenarios/cpu_smoke.yaml --device cpu\n"
                        "simrun validate scenarios/bench_steady_nocache.yaml --profile profiles/h200.yaml"),
    "calibrate": Command("validate.cli:calibrate_main", "profile the engine and fit the cost model",
                         "simrun calibrate --model tiny --device cpu --out profiles/cpu_tiny.yaml\n"
                         "simrun calibrate --scenario scenarios/cpu_smoke.yaml --device cpu"),
    "serve": Command("engine.serve.cli:serve_main", "the paged engine behind an OpenAI-compatible HTTP API",
                     "simrun serve --model tiny --device cpu\n"
                     "simrun serve --scenario scenarios/serve_smoke.yaml --device cpu --port 8000"),
    "bench": Command("validate.bench_cli:bench_main", "replay a scenario against a live endpoint and compare",
                     "simrun bench scenarios/serve_smoke.yaml --endpoint http://127.0.0.1:8000"),
    "compare": Command("validate.bench_cli:compare_main", "compare a `vllm bench serve` result file with the prediction",
                       "simrun compare my_workload.yaml --vllm-result result.json"),
    "from-vllm": Command("sim.vllm.serve_flags:from_vllm_main", "turn `vllm serve` flags into a scenario",
                         "simrun from-vllm \"vllm serve Qwen/Qwen2.5-7B-Instruct --max-num-seqs 64\" --device h100-sxm "
                         "--out qwen.yaml\n"
                         "simrun from-vllm --device l4 -- vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 4096"),
}
DEFAULT_COMMAND = "run"
HELP_FLAGS = ("-h", "--help")
PERFETTO_HINT = "https://ui.perfetto.dev, 'Open trace file'"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command, rest = split_command(argv)
        if command is None:
            return 0
        return run_command(command, rest)
    except BrokenPipeError:                    # the reader went away (`simrun ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (no second error at exit)
        return 1                               # (as rich does for the tables)
    except Exception as e:                     # noqa: BLE001 - only the known user errors are caught below
        if _terminated():                      # an error caused by the stop a signal asked for
            print("interrupted", file=sys.stderr)
            return 130
        if not is_user_error(e):
            raise
        from sim.output.console import print_error

        print_error(str(e))
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _terminated() -> bool:
    """A signal asked this run to stop (sim/stop.py): an error after that (a worker process
    ended by the stop, say) is part of the interruption, not a crash."""
    stop = sys.modules.get("sim.stop")
    return bool(stop and stop.asked())


def split_command(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """(command, its arguments); (None, []) when the answer was printed here (help, version)."""
    if not argv or argv[0] in HELP_FLAGS:
        print(top_help())
        return None, []
    first = argv[0]
    if first == "--version":
        print(f"simrun (kvtwin) {version()}")
        return None, []
    if first == "help":
        if len(argv) == 1:
            print(top_help())
            return None, []
        return command_named(argv[1]), ["-h"]
    if first in COMMANDS:
        return first, argv[1:]
    if first.startswith("-") or looks_like_a_file(first):
        return DEFAULT_COMMAND, argv
    command_named(first)                       # raises: a word that is neither a command nor a file
    raise AssertionError("unreachable")


def looks_like_a_file(text: str) -> bool:
    return Path(text).exists() or any(c in text for c in "./\\")


def command_named(word: str) -> str:
    if word in COMMANDS:
        return word
    from sim.errors import UserError

    close = difflib.get_close_matches(word, list(COMMANDS), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UserError(f"unknown command '{word}': {hint}Commands: {', '.join(COMMANDS)}; "
                    f"to predict a scenario, give its YAML file (simrun SCENARIO.yaml)")


def run_command(name: str, argv: list[str]) -> int:
    command = COMMANDS[name]
    module_name, func = command.target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None:
            raise
        from sim.errors import UserError
        from sim.extras import install_hint

        if module_name.startswith(e.name):
            raise UserError(f"`simrun {name}` is not available in this installation ({module_name} is missing)") \
                from None
        raise UserError(f"`simrun {name}` needs the Python package '{e.name}', which is not installed: "
                        f"{install_hint([e.name])}") from None
    handler: Callable[[list[str]], int] = getattr(module, func)
    if not any(a in HELP_FLAGS for a in argv):
        return handler(argv)
    try:
        return handler(argv)
    except SystemExit as done:                 # argparse printed the command's help: add examples
        if done.code in (0, None):
            print("\nexamples:\n" + "\n".join("  " + line for line in command.examples.splitlines()))
        raise


def top_help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: simrun SCENARIO.yaml [options]      predict a scenario (same as `simrun run`)",
             "       simrun COMMAND [options]            (simrun help COMMAND, or simrun COMMAND -h)",
             "",
             "kvtwin: predict the KV-cache memory, throughput and latency of an LLM-serving setup",
             "(vLLM's scheduler and paged KV cache, simulated; no GPU needed), then measure them.",
             "",
             "commands:"]
    lines += [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help   this help", "  --version    print the version", "", "examples:"]
    lines += ["  simrun scenarios/quickstart.yaml",
              "  simrun scenarios/quickstart.yaml --set engine.batching=static --set engine.allocation=contiguous",
              "  simrun scenarios/quickstart.yaml --set workload.arrival.rate=2,3,4   # a sweep",
              "  simrun plan scenarios/quickstart.yaml                               # highest rate within the SLOs",
              "  simrun compare my_workload.yaml --vllm-result result.json"]
    return "\n".join(lines)


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvtwin")
    except metadata.PackageNotFoundError:
        return "unknown (not installed; running from a source tree)"


def step_time_line(cost_model) -> str:
    """Where a run's step times came from, in words (the setup header's line; sim/output/setup.py)."""
    from sim.output.setup import step_time_source

    return step_time_source({"cost_model": cost_model.describe()})


def is_user_error(e: BaseException) -> bool:
    """Errors that are the input's fault: printed as one line, exit status 2."""
    from sim.errors import UserError

    kinds: tuple[type, ...] = (UserError, ValueError, OSError)
    return isinstance(e, kinds)


# ----------------------------------------------------------------------------- simrun run

def run_parser() -> argparse.ArgumentParser:
    from sim.output.run_dir import out_folder_arg
    from sim.scenario import scenario_args
    from sim.whatif.sweep_cli import add_sweep_args

    p = argparse.ArgumentParser(
        prog="simrun", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Predict KV-cache memory, throughput and latency of an LLM-serving scenario. The table "
                    "prints as soon as the simulation ends; plots and report.html follow.",
        epilog=f"other commands: {', '.join(c for c in COMMANDS if c != 'run')} (simrun COMMAND -h)")
    scenario_args(p)
    p.add_argument("--out", type=out_folder_arg, default=None, help="output folder (default runs/<stem>, <stem> being "
                   "the scenario file's name without .yaml; a sweep: runs/<stem>/sweep)")
    p.add_argument("--force", action="store_true", help="write into --out even if it holds files kvtwin did not write")
    p.add_argument("--no-plots", action="store_true",
                   help="write the data files (summary.json, CSVs, manifest) but no plots or report.html")
    p.add_argument("--trace", action="store_true", help="also write a Chrome/Perfetto trace.json (open it at "
                   f"{PERFETTO_HINT})")
    p.add_argument("--steps", choices=("timeline", "aggregated", "full"), default="timeline",
                   help="steps.csv: a row per replica per --steps-interval of simulated time (timeline, the "
                        "default), a row per record, a leap of K decode steps being one row (aggregated), or "
                        "a row per engine step (full)")
    p.add_argument("--steps-interval", type=positive_seconds, default=1.0, metavar="S",
                   help="seconds of simulated time per row of the timeline steps.csv (default 1)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.add_argument("--spill-records", action="store_true",
                   help="stream the per-request and per-step records to OUT/records/ in chunks as the run makes "
                        "them and write the data files from there: bounded memory for millions of requests "
                        "(data files only: with --no-plots; docs/performance.md)")
    add_sweep_args(p)
    return p


def positive_seconds(text: str) -> float:
    """argparse `type=` for a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of seconds")
    return value


def run_main(argv: list[str]) -> int:
    from sim.core.collector import gc_paused

    # Start-up (numpy, pydantic and the scenario's models imported and built, the scenario read)
    # makes ~40k long-lived containers and little garbage: the ~110 collections it triggered were
    # ~25 ms of a 10-request run. Paused around it only: a sweep's points run outside.
    with gc_paused():
        args = run_parser().parse_args(argv)
    from sim.scenario import expand_variants, load_scenario
    from sim.whatif.sweep import is_sweep
    from sim.whatif.sweep_cli import check_sweep_flags, sweep_main

    if is_sweep(args.overrides):          # a --set with several values: one run per point
        if args.spill_records:
            from sim.errors import UserError
            raise UserError("--spill-records applies to one run (a sweep keeps only each point's summary)")
        return sweep_main(args)
    check_sweep_flags(args)
    with gc_paused():
        scenario = load_scenario(args.scenario, args.overrides, args.seed)
        variants = expand_variants(scenario, base_dir=args.scenario.parent.resolve(), source=str(args.scenario))
        import sim.predict  # noqa: F401  (imported before the workers fork, so they inherit it)
    out = args.out or Path("runs") / args.scenario.stem
    if args.spill_records:
        return run_spilled(args, variants, out)
    from sim.output.run_dir import owned_run_folder
    from sim.output.workers import FigureWorkers

    # the folder is checked before simulating; the figure workers import matplotlib meanwhile
    with owned_run_folder(out, force=args.force), FigureWorkers(0 if args.no_plots else None) as workers:
        results = {name: predict_with_progress(variant, name, quiet=args.quiet)
                   for name, variant in variants.items()}
        write_outputs(results, out, args, workers)
    return exit_code_of(results)


def exit_code_of(results: dict) -> int:
    """1 when a run finished no request (every figure would be empty), with the reasons counted."""
    from sim.output.run_files import nothing_finished

    empty = [msg for name, r in results.items() if (msg := nothing_finished(name, r.summary))]
    if empty:
        from sim.output.console import print_error     # (rich: not loaded by a --quiet run that went well)

        for msg in empty:
            print_error(msg)
    return 1 if empty else 0


def write_outputs(results: dict, out: Path, args: argparse.Namespace, workers) -> None:
    """The answer on screen first, then the data files, then figures, report.html and the trace."""
    from sim.output.run_files import write_data_files, write_reports

    if not args.quiet:
        from sim.output.run_table import print_results

        print_results(results, out)
    for name, result in results.items():
        write_data_files(result, out / name if len(results) > 1 else out, args.steps, args.steps_interval)
    if not args.no_plots or args.trace:
        with StatusLine("writing plots and report.html", quiet=args.quiet) as done:
            files = write_reports(results, out, plots=not args.no_plots, trace=args.trace, workers=workers)
            hint = f"; open trace.json at {PERFETTO_HINT}" if args.trace else ""   # inside (): " in 1.2 s" follows
            done(f"wrote {out}/ ({', '.join(sorted({Path(f).name for f in files.values()}))}{hint})")
    elif not args.quiet:
        print(f"wrote {out}/ (summary.json, requests.csv, steps.csv, manifest.json; no plots: --no-plots)")


def run_spilled(args, variants: dict, out: Path) -> int:
    """`simrun SCENARIO --spill-records`: each variant simulated with its records spilled under its
    folder's records/, then its data files written from them; a line per variant on screen."""
    from sim.errors import UserError
    from sim.output.console import console
    from sim.output.run_dir import owned_run_folder
    from sim.output.run_table import answer_line
    from sim.output.streamed import FOLDER, RecordSpill, check_spillable, write_spilled_files

    if not args.no_plots or args.trace:
        raise UserError("--spill-records writes the data files only (summary.json, requests.csv, steps.csv, "
                        "manifest.json): add --no-plots, and leave out --trace")
    for variant in variants.values():
        check_spillable(variant)
    results = {}
    with owned_run_folder(out, force=args.force):
        for name, variant in variants.items():
            folder = out / name if len(variants) > 1 else out
            spill = RecordSpill(folder / FOLDER)
            results[name] = predict_with_progress(variant, name, quiet=args.quiet, spill=spill)
            write_spilled_files(results[name], spill, folder, args.steps, args.steps_interval)
            if not args.quiet:
                console.print(answer_line(name if len(variants) > 1 else variant.name, results[name].summary),
                              soft_wrap=True)
    if not args.quiet:
        print(f"wrote {out}/ (summary.json, requests.csv, steps.csv, manifest.json; the records' chunks "
              f"in {FOLDER}/)")
    return exit_code_of(results)


class StatusLine:
    """A one-line status on stderr while a slow step runs, replaced by its outcome on stdout."""

    def __init__(self, what: str, quiet: bool = False):
        self.what, self.quiet, self.message, self.status = what, quiet, None, None

    def __enter__(self) -> Callable[[str], None]:
        if not self.quiet:
            from sim.output.console import err_console

            self.t0 = time.monotonic()
            self.status = err_console.status(f"{self.what} ...")
            self.status.start()
        return self._done

    def _done(self, message: str) -> None:
        self.message = message

    def __exit__(self, *exc) -> None:
        if self.status is not None:
            self.status.stop()
        if not self.quiet and self.message and exc[0] is None:
            from sim.output.console import console

            console.print(f"{self.message} in {time.monotonic() - self.t0:.1f} s", soft_wrap=True)


PROGRESS_AFTER_S = 1.0        # a run shorter than this shows no bar
PROGRESS_EVERY_S = 0.5        # the bar is redrawn at most this often


def predict_with_progress(scenario, name: str, quiet: bool = False, spill=None):
    """Run a prediction, showing a progress bar on a terminal once it has taken more than a second."""
    from sim.predict import predict

    total = scenario.workload.num_requests
    if quiet or total is None or not sys.stderr.isatty():
        return predict(scenario, name, spill=spill)
    bar = ProgressBar(f"simulating {name}", total)
    try:
        return predict(scenario, name, progress=bar.update, spill=spill)
    finally:
        bar.stop()


class ProgressBar:
    """One line on stderr, redrawn from the run's own progress calls (every 256 finished requests)
    at most every PROGRESS_EVERY_S, and erased at the end. No refresh thread (a second Python
    thread takes the interpreter lock from the simulation every few milliseconds) and no rich
    (whose redraw of a progress bar cost ~10 ms)."""

    WIDTH = 30

    def __init__(self, what: str, total: int, stream=None) -> None:
        self.what, self.total, self.stream = what, max(1, total), stream or sys.stderr
        self.t0 = time.monotonic()
        self.next_draw = self.t0 + PROGRESS_AFTER_S
        self.drawn = False

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now < self.next_draw:
            return
        self.next_draw = now + PROGRESS_EVERY_S
        filled = min(self.WIDTH, self.WIDTH * done // self.total)
        elapsed = int(now - self.t0)
        self.stream.write(f"\r{self.what} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done:,}/{self.total:,} "
                          f"{elapsed // 60}:{elapsed % 60:02d}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def stop(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


if __name__ == "__main__":
    sys.exit(main())
