"""`simrun SCENARIO --set A=1,2 ...`: the sweep's flags, their checks, and the command."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

from sim.output.run_dir import owned_run_folder
from sim.scenario import validate_scenario
from sim.whatif.parallel import add_parallel_args, check_jobs
from sim.whatif.sweep import SweepError, base_raw, plan_sweep, run_planned_sweep, split_sets



def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `simrun SCENARIO --set a=1,2 ...`; they apply only when a --set has several values."""
    add_parallel_args(parser)
    parser.add_argument("--zip", action="store_true",
                        help="pair the swept fields' values element by element instead of a grid")
    parser.add_argument("--point-outputs", action="store_true",
                        help="also write each point's full run (summary, CSVs, plots, report) "
                             "under OUT/points/ (with --no-plots: its data files only)")


def sweep_main(args: argparse.Namespace) -> int:
    """`simrun SCENARIO --set PATH=A,B ...`: run the sweep, write and print its results."""
    # (imported here: a single run, which builds this module's parser, needs none of the sweep's
    # tables and pages, nor rich behind them when --quiet)
    from sim.whatif.sweep_output import print_sweep, write_sweep

    steps = getattr(args, "steps", "timeline")
    for flag, given in (("--trace", args.trace), (f"--steps {steps}", steps != "timeline")):
        if given and not args.point_outputs:
            raise SweepError(f"{flag} applies to each point's own run files: add --point-outputs")
    plain, axes = split_sets(args.overrides)
    raw = base_raw(args.scenario, plain, args.seed)
    out = args.out or Path("runs") / args.scenario.stem / "sweep"
    t0 = time.monotonic()
    plots = not getattr(args, "no_plots", False)
    # every point validated before the folder is made: a bad point leaves no INCOMPLETE behind
    plan = plan_sweep(raw, args.scenario.parent.resolve(), str(args.scenario), axes, args.zip,
                      out / "points" if args.point_outputs else None, args.trace, steps, plots)
    jobs = check_jobs(args.jobs)
    with owned_run_folder(out, force=getattr(args, "force", False)):
        sweep = run_planned_sweep(plan, jobs, args.ray, args.quiet, plots)
        # titled by the scenario's name, as its run figures are (the folder keeps the file's stem)
        write_sweep(sweep, out, f"kvtwin sweep: {raw.get('name') or 'scenario'}", sweep_setup(raw, args.scenario),
                    plots)
    if not args.quiet:
        print_sweep(sweep, out, time.monotonic() - t0, plots)
    return 0


def sweep_setup(raw: dict, path: Path) -> Optional[dict]:
    """The base scenario's setup header (the swept fields vary around it), or None if the base
    alone is not a valid scenario (a sweep may supply a required field)."""
    from sim.output.setup import setup_manifest
    from sim.scenario import ScenarioError

    try:
        return setup_manifest(validate_scenario(raw, base_dir=path.parent.resolve(), source=str(path)))
    except (ScenarioError, ValueError):
        return None


def check_sweep_flags(args: argparse.Namespace) -> None:
    """Sweep-only flags on a single run are a mistake worth naming."""
    for flag, given in (("--zip", args.zip), ("--point-outputs", args.point_outputs),
                        ("--ray", args.ray is not None), ("--jobs", args.jobs is not None)):
        if given:
            raise SweepError(f"{flag} applies to sweeps: give a --set with several values, "
                             f"e.g. --set engine.block_size=8,16,32")
