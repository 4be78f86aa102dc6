"""`simrun plan SCENARIO --target-rate R --disaggregation`: the cheapest xPyD split.

The scenario's cluster.disaggregation names each pool's engine (device, tp, settings); the search
varies the pools' replica counts, x prefill and y decode engines, up to --max-prefill and
--max-decode, and answers the split of least cost per hour (each pool's GPUs at its device's
price, --cost overriding the catalog) that serves the target rate within the SLOs (a probe passes
as plan's replica search judges one: sustainable and every SLO met, sim/whatif/plan.py).

Splits are probed cheapest first, --jobs at a time; a split no larger on either side than one
that failed is not probed (fewer engines of both kinds cannot serve what more could not), so the
first passing split in cost order is the answer. DistServe searches its placements the same way,
by simulation, for the best goodput per GPU (Zhong et al., OSDI 2024, https://arxiv.org/abs/2401.09670).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from sim.core.lazy import lazy_import
from sim.whatif.plan import PlanError, SloTarget, Traffic, headroom, run_probe, seconds, with_settings
from sim.whatif.plan_output import answer_economics
from sim.whatif.sweep import PointTask
from sim.whatif.parallel import parallel_map
from sim.whatif.sweep_output import save_png, write_page

np = lazy_import("numpy")
pd = lazy_import("pandas")

POOLS = "cluster.disaggregation"
MAX_POOL_REPLICAS = 64


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int
    cost_per_hour: float
    gpus: int

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D"

    def covered_by(self, other: "Split") -> bool:
        """No larger on either side than `other`."""
        return self.prefill <= other.prefill and self.decode <= other.decode


def pool_prices(scenario, costs: dict[str, float]) -> dict[str, float]:
    """$/GPU-hour of each pool's device: --cost DEVICE=PRICE, else the catalog's."""
    d = scenario.cluster.disaggregation
    out = {}
    for side in ("prefill", "decode"):
        device = d.pool(side).device or scenario.device
        price = costs.get(device.name, device.cost_per_hour)
        if price is None:
            raise PlanError(f"device '{device.name}' ({side} pool) has no cost_per_hour in the catalog: pass "
                            f"--cost {device.name}=PRICE")
        out[side] = float(price)
    return out


def splits(scenario, prices: dict[str, float], most_prefill: int, most_decode: int) -> list[Split]:
    """Every x in 1..most_prefill, y in 1..most_decode, cheapest first (then fewer GPUs, fewer prefill)."""
    d, tp = scenario.cluster.disaggregation, scenario.parallelism.tp
    gpus = {side: d.pool(side).tp or tp for side in prices}
    out = [Split(x, y, x * gpus["prefill"] * prices["prefill"] + y * gpus["decode"] * prices["decode"],
                 x * gpus["prefill"] + y * gpus["decode"])
           for x in range(1, most_prefill + 1) for y in range(1, most_decode + 1)]
    return sorted(out, key=lambda s: (s.cost_per_hour, s.gpus, s.prefill))


def _probe_split(item: tuple[PointTask, Split, tuple[SloTarget, ...]]) -> dict:
    task, split, slos = item
    settings = {f"{POOLS}.prefill.replicas": split.prefill, f"{POOLS}.decode.replicas": split.decode}
    row = run_probe((with_settings(task, settings), slos))
    return {"prefill": split.prefill, "decode": split.decode, "split": split.label, **row,
            "cost_per_hour": split.cost_per_hour, "gpus": split.gpus}


@dataclass
class SplitPlan:
    target_rate: float
    slos: list[SloTarget]
    rows: list[dict]                 # every probe, in the order probed
    skipped: int                     # splits covered by a failed one

    @property
    def answer(self) -> Optional[dict]:
        passing = [r for r in self.rows if r["ok"]]
        return min(passing, key=lambda r: (r["cost_per_hour"], r["gpus"], r["prefill"])) if passing else None

    @property
    def table(self) -> pd.DataFrame:
        keep = ["split", "prefill", "decode", "gpus", "cost_per_hour", "ok", "failed", "steady.late_finish_rate",
                "ttft_s.p99", "tpot_s.p99", "pools.prefill.utilization", "pools.decode.utilization",
                "pools.transfers.transfer_s.p99", "pools.transfers.decode_wait_s.p99"]
        frame = pd.DataFrame(self.rows)
        frame = frame[[c for c in keep if c in frame]]
        return frame.sort_values(["cost_per_hour", "gpus", "prefill"], kind="stable").reset_index(drop=True)


def plan_splits(base: PointTask, traffic: Traffic, slos: Sequence[SloTarget], target_rate: float,
                prices: dict[str, float], most_prefill: int, most_decode: int, jobs: int, ray: Optional[str],
                quiet: bool) -> SplitPlan:
    task = with_settings(base, traffic.at(target_rate))
    scenario = task.scenario()
    todo = splits(scenario, prices, most_prefill, most_decode)
    rows: list[dict] = []
    failed: list[Split] = []
    skipped = 0
    while todo:
        batch = []
        while todo and len(batch) < max(jobs, 1):
            split = todo.pop(0)
            if any(split.covered_by(f) for f in failed):
                skipped += 1
            else:
                batch.append(split)
        found = parallel_map(_probe_split, [(task, s, tuple(slos)) for s in batch], jobs, ray,
                             label=f"probing {len(batch)} splits", quiet=quiet)
        rows += found
        failed += [s for s, r in zip(batch, found) if not r["ok"]]
        if any(r["ok"] for r in found):
            break                     # every cheaper split was probed or is covered by a failed one
    return SplitPlan(target_rate, list(slos), rows, skipped)


def plot_split_plan(plan: SplitPlan, title: str = ""):
    """The probed splits on an x (prefill) by y (decode) grid: passing green, failing red, the
    answer outlined, each labelled with its $/hour."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    table = plan.table
    fig = Figure(figsize=(6.4, 5.0), layout="constrained")
    ax = fig.subplots()
    for _, row in table.iterrows():
        ax.scatter(row["prefill"], row["decode"], s=800, color="C2" if row["ok"] else "C3", alpha=0.8)
        ax.annotate(f"${row['cost_per_hour']:.2f}", (row["prefill"], row["decode"]), ha="center", va="center",
                    fontsize="x-small", color="white")
    best = plan.answer
    if best is not None:
        ax.scatter(best["prefill"], best["decode"], s=1300, facecolors="none", edgecolors="black", linewidths=2,
                   label=f"cheapest: {best['split']} (${best['cost_per_hour']:.2f}/hour)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize="small", markerscale=0.4, frameon=False)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("prefill engines (x)")
    ax.set_ylabel("decode engines (y)")
    ax.set_title(f"xPyD splits at {plan.target_rate:g} req/s (green: within the SLOs)")
    ax.grid(alpha=0.3)
    ax.margins(0.2)
    if title:
        fig.suptitle(title)
    return fig


def split_verdict(plan: SplitPlan) -> str:
    from sim.output import units

    slos = ", ".join(map(str, plan.slos)) or "no SLO"
    best = plan.answer
    if best is None:
        last = plan.rows[-1]["failed"] if plan.rows else "nothing probed"
        return f"No split serves {plan.target_rate:g} req/s within {slos} (the largest probed: {last})."
    return (f"Cheapest split for {plan.target_rate:g} req/s within {slos}: {best['split']} ({best['prefill']} "
            f"prefill + {best['decode']} decode engines, {best['gpus']} GPUs, {units.money(best['cost_per_hour'])}"
            f"/hour); TTFT p99 {seconds(best['ttft_s.p99'])}, TPOT p99 {seconds(best['tpot_s.p99'])}. "
            f"{answer_economics(best, plan.slos)}.")


def write_split_plan(plan: SplitPlan, out: Path, name: str, setup: Optional[dict] = None) -> dict[str, Path]:
    from sim.output.io import write_csv

    title = f"kvtwin plan: prefill/decode split for {plan.target_rate:g} req/s of {name}"
    files = {"csv": write_csv(out / "plan.csv", plan.table),
             "png": save_png(plot_split_plan(plan, title), out / "plan.png")}
    notes = [split_verdict(plan), f"{len(plan.rows)} splits probed; {plan.skipped} skipped (no larger on either "
             f"side than one that failed)."]
    headrooms = plan.table.assign(**{f"{s.name} headroom": [headroom(s, r) for r in plan.table.to_dict("records")]
                                     for s in plan.slos})
    files["html"] = write_page(out / "plan.html", title, notes, [("Splits", headrooms)], {"plan": files["png"]},
                               setup)
    return files


def print_split_plan(plan: SplitPlan, out: Path, wall_s: float) -> None:
    from sim.output.console import console
    from sim.output.run_table import print_frame

    print_frame(plan.table.drop(columns=["failed"]))
    console.print(split_verdict(plan))
    console.print(f"{len(plan.rows)} probes ({plan.skipped} skipped) in {wall_s:.1f} s; wrote {out}/ "
                  f"(plan.csv, plan.png, plan.html)")


def check_split_flags(args) -> None:
    for flag, dest in (("--max-prefill", "max_prefill"), ("--max-decode", "max_decode")):
        value = getattr(args, dest)
        if value is not None and not args.disaggregation:
            raise PlanError(f"{flag} applies to the split search: add --disaggregation")
        if value is None:
            setattr(args, dest, 8)
        elif not 1 <= value <= MAX_POOL_REPLICAS:
            raise PlanError(f"{flag} {value}: expected a whole number from 1 to {MAX_POOL_REPLICAS}")
    if args.disaggregation:
        if args.target_rate is None:
            raise PlanError("--disaggregation searches splits for a rate: give --target-rate REQ_PER_S")
        for flag, dest in (("--devices", "devices"), ("--tp", "tp"), ("--max-replicas", "max_replicas")):
            if getattr(args, dest) is not None:
                raise PlanError(f"{flag} applies to the replica search; with --disaggregation each pool's device "
                                f"and tp come from cluster.disaggregation (use --max-prefill/--max-decode)")


def split_main(args) -> int:
    """plan_main's --disaggregation branch (its flags checked)."""
    import time

    from sim.output.run_dir import owned_run_folder
    from sim.output.setup import setup_manifest
    from sim.whatif.plan import parse_slo, scenario_band, scenario_slos
    from sim.whatif.plan_output import print_band
    from sim.whatif.plan_args import base_task, default_out, parse_cost, positive
    from sim.whatif.parallel import check_jobs

    base, scenario = base_task(args)
    slos = [parse_slo(s) for s in args.slo] or scenario_slos(scenario.slo)
    if args.pessimistic:
        from sim.whatif.plan import pessimistic_slos
        slos = pessimistic_slos(slos, scenario_band(scenario))
    rate = positive(args.target_rate, "--target-rate")
    if scenario.cluster.disaggregation is None:
        raise PlanError(f"--disaggregation: {args.scenario} has no cluster.disaggregation section (the pools' "
                        f"engines); add one (docs/whatif/disaggregation.md)")
    prices = pool_prices(scenario, dict(parse_cost(c) for c in args.cost))
    out = args.out or default_out(args)
    t0 = time.monotonic()
    with owned_run_folder(out, force=args.force):
        plan = plan_splits(base, Traffic.of(scenario), slos, rate, prices, args.max_prefill, args.max_decode,
                           check_jobs(args.jobs), args.ray, args.quiet)
        write_split_plan(plan, out, scenario.name, setup_manifest(scenario))
    if not args.quiet:
        print_split_plan(plan, out, time.monotonic() - t0)
        print_band(scenario_band(scenario), slos, args.pessimistic)
    return 0
