"""`simrun plan`'s flags as the three searches (plan_cli.py, plan_pd.py, plan_autoscale.py) read them:
the scenario to search, its checks, prices, devices and tp degrees."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Optional

from sim.scenario import MAX_REPLICAS
from sim.whatif.plan import RATE, Candidate, PlanError
from sim.whatif.sweep import PointTask, base_raw, split_sets


# (flag, dest, default) of each search; a flag of the other search would change nothing
RATE_SEARCH_FLAGS = (("--max-rate", "max_rate", None), ("--tolerance", "tolerance", 0.05), ("--curve", "curve", 0))


REPLICA_SEARCH_FLAGS = (("--devices", "devices", None), ("--tp", "tp", None), ("--max-replicas", "max_replicas", 64))



def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuse a flag of the search not asked for (it would be silently ignored), then fill in the defaults."""
    replicas = args.target_rate is not None
    for flag, dest, _ in RATE_SEARCH_FLAGS if replicas else REPLICA_SEARCH_FLAGS:
        if getattr(args, dest) is not None:
            raise PlanError(f"{flag} applies to the rate search (plan without --target-rate)" if replicas else
                            f"{flag} applies to the replica search: give --target-rate REQ_PER_S (without it "
                            f"plan finds the highest rate on the scenario's own device)")
    for _, dest, default in (*RATE_SEARCH_FLAGS, *REPLICA_SEARCH_FLAGS):
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if not 1 <= args.max_replicas <= MAX_REPLICAS:      # 0 would search nothing and answer "No candidate"
        raise PlanError(f"--max-replicas {args.max_replicas}: expected a whole number from 1 to {MAX_REPLICAS}")
    if not 0 <= args.curve <= MAX_CURVE_POINTS:          # named here, before it turns into a scenario field
        raise PlanError(f"--curve {args.curve}: expected a number of extra rates from 0 (none) to {MAX_CURVE_POINTS}")
    if not 0 < args.tolerance < 1:                       # NaN fails this too
        raise PlanError(f"--tolerance {args.tolerance}: expected a fraction between 0 and 1, e.g. 0.05")


MAX_CURVE_POINTS = 1000



def default_out(args: argparse.Namespace) -> Path:
    """A folder per search: the replica search must not replace the rate search's files."""
    search = ("plan" if args.target_rate is None else "plan_splits" if getattr(args, "disaggregation", False)
              else "plan_replicas")
    return Path("runs") / args.scenario.stem / search



def base_task(args: argparse.Namespace):
    """The scenario with --set/--seed applied, as a task, and validated; its arrivals have a rate."""
    task, scenario = scenario_task(args)
    other = rateless_source(scenario.workload)
    if other:
        raise PlanError(f"{args.scenario}: plan varies {RATE}, so the workload needs synthetic arrivals "
                        f"with a rate (process poisson, gamma or fixed), not {other}")
    return task, scenario



def rateless_source(w) -> Optional[str]:
    """What the workload's arrivals come from when it is not one rate to vary, else None."""
    if w.trace is not None:
        return "a trace"
    if w.requests is not None:
        return "explicit requests"
    if w.arrival.process == "offline":
        return "offline arrivals"
    if w.arrival.rate_schedule is not None or w.arrival.diurnal is not None:
        return "a time-varying rate (plan it with --autoscale)"
    return None



def scenario_task(args: argparse.Namespace):
    """The scenario with --set/--seed applied, as a task, and validated."""
    plain, axes = split_sets(args.overrides)
    if axes:
        raise PlanError(f"--set {axes[0].path}={','.join(axes[0].texts)}: plan searches one scenario; "
                        f"sweep several values with `simrun {args.scenario} --set ...` instead")
    raw = base_raw(args.scenario, plain, args.seed)
    if raw.get("variants"):
        raise PlanError(f"{args.scenario} has variants ({', '.join(raw['variants'])}); plan searches one "
                        f"scenario: drop them with --set 'variants={{}}' or plan a file without them")
    task = PointTask(raw, str(args.scenario.parent.resolve()), str(args.scenario), ())
    return task, task.scenario()



def positive(value: float, flag: str) -> float:
    if not 0 < value < math.inf:
        raise PlanError(f"{flag} {value}: expected a positive number")
    return value



def catalog_device(flag: str, name: str) -> dict:
    """The device's catalog entry, or an error naming the flag and the closest devices (as `--set device=`)."""
    from sim.core.catalog import catalog_entry

    try:
        return catalog_entry("devices", name)
    except KeyError as e:
        raise PlanError(f"{flag}: {e.args[0]}") from None


def candidates(args, scenario) -> list[Candidate]:
    names = [d.strip() for d in args.devices.split(",")] if args.devices else [scenario.device.name]
    prices = dict(parse_cost(c) for c in args.cost)
    for name in prices:                  # a misspelt --cost device would leave the catalog price in use
        catalog_device("--cost", name)
    out = []
    for name in names:
        price = prices.get(name, catalog_device("--devices", name).get("cost_per_hour"))
        if price is None:
            raise PlanError(f"device '{name}' has no cost_per_hour in the catalog: pass --cost {name}=PRICE")
        out += [Candidate(name, tp, float(price)) for tp in tp_degrees(args.tp, scenario)]
    return out



def scenario_device_price(args, scenario, search: str) -> Optional[float]:
    """$/GPU-hour of the scenario's own device, the one the rate search and --autoscale run on: its
    --cost, else the catalog's. A --cost for another device would be ignored, so it is an error."""
    prices = dict(parse_cost(c) for c in args.cost)
    other = sorted(set(prices) - {scenario.device.name})
    if other:
        raise PlanError(f"--cost {other[0]}: {search} runs on the scenario's device ({scenario.device.name})")
    return prices.get(scenario.device.name, scenario.device.cost_per_hour)


def parse_cost(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        price = float(value) if sep else -1.0
    except ValueError:
        price = -1.0
    if not 0 <= price < math.inf:        # nan and inf too: a price of nan printed as '—/hour'
        raise PlanError(f"--cost {text!r}: expected DEVICE=PRICE_PER_GPU_HOUR, e.g. --cost l4=0.7")
    return name.strip(), price



def tp_degrees(text: Optional[str], scenario) -> list[int]:
    """--tp's degrees; without it the scenario's own (as --devices defaults to its device)."""
    return parse_tp(text) if text is not None else [scenario.parallelism.tp]



def parse_tp(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise PlanError(f"--tp {text!r}: expected tensor-parallel degrees >= 1, e.g. --tp 1,2")
    return values
