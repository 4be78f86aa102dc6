"""`simrun plan`: its flags, and which search answers (the searches are plan.py, plan_pd.py and
plan_autoscale.py; they import plan.py's pieces, this module imports them all)."""
from __future__ import annotations

import argparse

from sim.output.run_dir import out_folder_arg
from sim.scenario import scenario_args
from sim.whatif import plan, plan_autoscale, plan_pd
from sim.whatif.sweep import add_parallel_args


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
    p.add_argument("--out", type=out_folder_arg, default=None, help="output folder (default runs/<scenario>/plan "
                   "for the rate search, runs/<scenario>/plan_replicas with --target-rate)")
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
        raise plan.PlanError("--autoscale and --disaggregation are two questions: ask one at a time")
    plan_pd.check_split_flags(args)
    plan_autoscale.check_flags(args)
    if args.autoscale:
        return plan_autoscale.autoscale_main(args)
    if args.disaggregation:
        plan.check_plan_flags(args)
        return plan_pd.split_main(args)
    return plan.search_main(args)
