"""`simrun plan`: its flags, which search answers, and the rate and replica searches' command (the
P/D split is plan_pd.py's, the autoscaler plan_autoscale.py's). The searches are plan.py, their
output plan_output.py, the flags they share plan_args.py; nothing imports this module."""
from __future__ import annotations

import argparse
import time

from sim.output.run_dir import out_folder_arg, owned_run_folder
from sim.scenario import scenario_args
from sim.whatif import plan, plan_autoscale, plan_pd
from sim.whatif.plan import (PlanError, RateCurve, SloTarget, Traffic, fill_curve, parse_slo, pessimistic_slos,
                             plan_replicas, scenario_band, scenario_slos, search_rate)
from sim.whatif.plan_args import base_task, candidates, check_plan_flags, default_out, positive, scenario_device_price
from sim.whatif.plan_output import print_band, print_rate_plan, print_replica_plan, write_rate_plan, write_replica_plan
from sim.whatif.sweep import PointTask, gpu_cost
from sim.whatif.parallel import add_parallel_args, check_jobs


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simrun plan", description="Capacity searches. Without --target-rate: the highest request rate "
        "the scenario sustains within the SLOs. With it: per device and tp, the fewest replicas that serve "
        "the rate within the SLOs, ranked by cost per hour.")
    scenario_args(p)
    p.add_argument("--slo", action="append", default=[], metavar="METRIC=SECONDS",
                   help=f"a latency target, e.g. ttft_p99=0.5 (repeatable; METRIC one of "
                        f"{', '.join(plan.allowed_slos())}); default: the scenario's slo as p99 targets")
    p.add_argument("--max-rate", type=float, default=None, help="highest rate to try (default 256 x the "
                   "scenario's rate). Every probe keeps the scenario's arrival window: a higher rate "
                   "gets proportionally more requests")
    p.add_argument("--tolerance", type=float, default=None,
                   help="stop bisecting when the bracket is this fraction of the rate (default 0.05)")
    p.add_argument("--curve", type=int, default=None, metavar="N",
                   help="also probe N evenly spaced rates up to the highest tried, in parallel, to draw "
                        "the curve (the answer is the search's)")
    p.add_argument("--target-rate", type=float, default=None, metavar="REQ_PER_S",
                   help="search replicas instead: the fewest that serve this rate")
    p.add_argument("--devices", default=None, help="catalog devices to compare, e.g. h100-sxm,l4 "
                   "(default: the scenario's)")
    p.add_argument("--tp", default=None, help="tensor-parallel degrees to compare, e.g. 1,2 (default: the "
                   "scenario's parallelism.tp)")
    p.add_argument("--cost", action="append", default=[], metavar="DEVICE=PRICE",
                   help="price per GPU hour, overriding the catalog's cost_per_hour (repeatable)")
    p.add_argument("--max-replicas", type=int, default=None, help="give up above this many (default 64)")
    p.add_argument("--disaggregation", action="store_true",
                   help="with --target-rate: the cheapest split of x prefill and y decode engines "
                        "(the scenario's cluster.disaggregation pools; sim/whatif/plan_pd.py)")
    p.add_argument("--max-prefill", type=int, default=None, help="--disaggregation: at most this many "
                   "prefill engines (default 8)")
    p.add_argument("--max-decode", type=int, default=None, help="--disaggregation: at most this many "
                   "decode engines (default 8)")
    add_parallel_args(p)
    plan_autoscale.add_args(p)
    p.add_argument("--out", type=out_folder_arg, default=None, help="output folder (default runs/<stem>/plan for "
                   "the rate search, runs/<stem>/plan_replicas with --target-rate, plan_splits with "
                   "--disaggregation, plan_autoscale with --autoscale; <stem>: the scenario file's "
                   "name without .yaml)")
    p.add_argument("--force", action="store_true", help="write into --out even if it holds files kvtwin did not write")
    p.add_argument("--pessimistic", action="store_true",
                   help="answer with the bad edge of the error band: each SLO limit is divided by (1 + the "
                        "typical error of the scenario's step-time source on that metric), so the answer "
                        "still holds if the prediction is that far off")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return p


def plan_main(argv: list[str]) -> int:
    args = plan_parser().parse_args(argv)
    if args.autoscale and args.disaggregation:
        raise PlanError("--autoscale and --disaggregation are two questions: ask one at a time")
    plan_pd.check_split_flags(args)
    plan_autoscale.check_flags(args)
    if args.autoscale:
        return plan_autoscale.autoscale_main(args)
    if args.disaggregation:
        check_plan_flags(args)
        return plan_pd.split_main(args)
    return search_main(args)


def search_main(args: argparse.Namespace) -> int:
    """The rate search (no --target-rate) or the replica search (sim/whatif/plan_cli.py dispatches)."""
    from sim.output.setup import setup_manifest

    check_plan_flags(args)
    base, scenario = base_task(args)
    slos = [parse_slo(s) for s in args.slo] or scenario_slos(scenario.slo)
    band = scenario_band(scenario)
    if args.pessimistic:
        slos = pessimistic_slos(slos, band)
    out = args.out or default_out(args)
    t0 = time.monotonic()
    if args.target_rate is not None:                      # flag errors first, then the folder
        rate, targets = positive(args.target_rate, "--target-rate"), candidates(args, scenario)
    else:
        price = scenario_device_price(args, scenario, "the rate search")
    with owned_run_folder(out, force=args.force):         # checked before searching
        if args.target_rate is None:
            curve = run_rate_search(args, base, scenario, slos)
            if args.cost:                                 # the probes priced the catalog's GPU hour
                with_price(curve, gpu_cost(scenario, price))
            write_rate_plan(curve, out, scenario.name, setup_manifest(scenario))     # titled as run figures are
        else:
            plan = plan_replicas(base, Traffic.of(scenario), slos, rate, targets, args.max_replicas,
                                 check_jobs(args.jobs), args.ray, args.quiet)
            write_replica_plan(plan, out, scenario.name, setup_manifest(scenario))
    if not args.quiet and args.target_rate is None:
        print_rate_plan(curve, out, time.monotonic() - t0)
    elif not args.quiet:
        print_replica_plan(plan, out, time.monotonic() - t0)
    if not args.quiet:
        print_band(band, slos, args.pessimistic)
    return 0



def with_price(curve: RateCurve, cost: dict) -> None:
    """Every probe that ran at `cost` (gpus and cost_per_hour): its device and size are the scenario's
    at every rate, so one price holds for all; a probe that did not fit (no gpus) stays as it is."""
    for row in curve.rows:
        if "gpus" in row:
            row.update(cost)


def run_rate_search(args, base: PointTask, scenario, slos: list[SloTarget]) -> RateCurve:
    from sim.output.console import err_console
    from sim.costmodel import CostModel
    from sim.core.memory import plan_memory

    plan_memory(scenario, CostModel.for_scenario(scenario).profile.activation_scale)   # fits at all?
    traffic = Traffic.of(scenario)
    highest = positive(args.max_rate, "--max-rate") if args.max_rate is not None else 256 * traffic.rate

    def log(row: dict) -> None:
        if not args.quiet:
            verdict = "[green]passes[/]" if row["ok"] else f"[red]fails[/]: {row['failed']}"
            err_console.print(f"  {row['rate']:g} req/s: {verdict}")

    curve = search_rate(base, traffic, slos, highest / 1024, highest, args.tolerance, log)
    if args.curve > 0:
        curve = fill_curve(base, traffic, curve, args.curve, check_jobs(args.jobs), args.ray, args.quiet)
    return curve
