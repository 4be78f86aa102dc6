"""`simrun plan SCENARIO --autoscale`: what autoscaling saves against a static fleet sized for the peak.

    simrun plan scenarios/whatif_autoscaling.yaml --autoscale [--static-replicas N] [--cost l4=0.7] [--bucket-s 3600]

Runs the scenario twice on the same requests: with its `cluster.autoscaling`, and as a static fleet
(no autoscaling) of --static-replicas, by default the largest fleet the autoscaled run's HPA
counted (the fleet that covers its peak; replicas still draining are not counted). For each: GPU-hours (every replica from its scale-up
decision, start-up included, to its stop once drained, or to the run's end), cost at the
device's $/GPU-hour, SLO attainment overall and per --bucket-s window of arrival time (the share
of the requests arriving then that were served within every target of the scenario's `slo`;
a rejected request misses), and replicas over time. Files, each written whole or not at all:
autoscale.csv (the comparison), autoscale_slo.csv (per window), autoscale_replicas.csv (replicas
over time, both fleets), autoscale.png and autoscale.html.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sim.autoscale import gpu_seconds, replicas_over_time, run_end
from sim.core.lazy import lazy_import
from sim.scenario import MAX_REPLICAS

pd = lazy_import("pandas")

MAX_BUCKETS = 10_000


@dataclass
class FleetRun:
    """One fleet's answer."""
    name: str                  # autoscaled | static
    gpus_per_replica: int
    end_s: float               # the run's end: the last request's finish (or rejection)
    lives: list[dict]          # each replica's requested/ready/draining/stopped times
    requests: "pd.DataFrame"
    summary: dict

    @property
    def gpu_hours(self) -> float:
        return gpu_seconds(self.lives, self.end_s, self.gpus_per_replica) / 3600

    @property
    def peak_replicas(self) -> int:
        """The largest fleet the HPA counted (started or starting; draining ones are leaving)."""
        return max(row["counted"] for row in replicas_over_time(self.lives, self.end_s))

    @property
    def peak_held(self) -> int:
        """The most replicas holding GPUs at once, draining ones included."""
        return max(row["replicas"] for row in replicas_over_time(self.lives, self.end_s))


def run_fleet(scenario, name: str) -> FleetRun:
    from sim.predict import predict

    result = predict(scenario, f"{scenario.name} ({name})", manifest=False)
    frame = result.requests
    end_s = run_end(frame)
    timeline = result.records.meta.get("autoscaling")
    lives = timeline["replicas"] if timeline else [
        {"replica": i, "requested_s": 0.0, "ready_s": 0.0, "draining_s": None, "stopped_s": None}
        for i in range(scenario.cluster.replicas)]
    return FleetRun(name, scenario.parallelism.gpus, end_s, lives, frame, result.summary)


def static_twin(task, replicas: int):
    """The same scenario on a fixed fleet of `replicas` (no autoscaling), validated again."""
    from sim.whatif.plan import with_settings

    return with_settings(task, {"cluster.autoscaling": None, "cluster.replicas": replicas}).scenario()


def slo_by_window(run: FleetRun, slo, bucket_s: float) -> "pd.DataFrame":
    """Per window of arrival time: requests, served within the SLOs, attainment, TTFT p99."""
    from sim.metrics import meets_slo

    frame = run.requests[~run.requests["is_warmup"].astype(bool)]
    window = (frame["arrival_s"] // bucket_s).astype(int)
    finished = frame["status"] == "finished"
    ok = meets_slo(frame, slo) & finished
    rows = []
    for w in range(int(window.max()) + 1 if len(frame) else 0):
        mine = window == w
        n = int(mine.sum())
        rows.append({"fleet": run.name, "window_start_s": w * bucket_s, "requests": n,
                     "within_slo": int(ok[mine].sum()), "slo_attainment": ok[mine].sum() / n if n else math.nan,
                     "ttft_p99_s": float(frame.loc[mine & finished, "ttft_s"].quantile(0.99)) if n else math.nan})
    return pd.DataFrame(rows)


def comparison(runs: list[FleetRun], slo, price: Optional[float]) -> "pd.DataFrame":
    from sim.metrics import meets_slo

    rows = []
    for run in runs:
        frame = run.requests[~run.requests["is_warmup"].astype(bool)]
        ok = meets_slo(frame, slo) & (frame["status"] == "finished")
        rows.append({"fleet": run.name, "peak replicas": run.peak_replicas, "peak holding GPUs": run.peak_held,
                     "mean replicas": gpu_seconds(run.lives, run.end_s, 1) / run.end_s,
                     "GPU-hours": run.gpu_hours, "$/GPU-hour": price,
                     "cost ($)": None if price is None else run.gpu_hours * price,
                     "requests": len(frame), "rejected": int((frame["status"] == "rejected").sum()),
                     "SLO attainment": ok.sum() / len(frame) if len(frame) else math.nan,
                     "TTFT p99 (s)": run.summary["ttft_s"]["p99"], "TPOT p99 (s)": run.summary["tpot_s"]["p99"],
                     "run length (s)": run.end_s})
    return pd.DataFrame(rows)


def readable_comparison(table: "pd.DataFrame") -> "pd.DataFrame":
    """comparison() for the screen and the page: $0.80, milliseconds, 99.96% (autoscale.csv keeps fractions)."""
    from sim.whatif.plan import readable

    return readable(table, fractions=lambda column: column == "SLO attainment")


def replica_series(runs: list[FleetRun]) -> "pd.DataFrame":
    return pd.DataFrame([{"fleet": run.name, **row} for run in runs
                         for row in replicas_over_time(run.lives, run.end_s)])


def plot(runs: list[FleetRun], windows: "pd.DataFrame", shape, bucket_s: float, title: str):
    """Offered rate and replicas over time (top); SLO attainment per window (bottom)."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    end = max(run.end_s for run in runs)
    arrivals = runs[0].requests["arrival_s"].to_numpy(float)
    edges = np.linspace(0, end, 97)
    counts, _ = np.histogram(arrivals, edges)
    rate_ax = top.twinx()
    rate_ax.stairs(counts / np.diff(edges), edges, color="0.7", fill=True, alpha=0.4, label="offered (req/s)")
    if shape is not None:
        t = np.linspace(0, end, 500)
        rate_ax.plot(t, shape.rate(t), color="0.4", lw=1, ls=":", label="arrival rate")
    rate_ax.set_ylabel("requests / s")
    series = replica_series(runs)
    for i, run in enumerate(runs):
        rows = series[series["fleet"] == run.name]
        top.step(rows["time_s"], rows["replicas"], where="post", color=f"C{i}", lw=2,
                 label=f"{run.name}: {run.gpu_hours:.3g} GPU-h")
    top.set_zorder(rate_ax.get_zorder() + 1)
    top.patch.set_visible(False)
    top.set_ylabel("replicas holding GPUs")
    top.set_ylim(bottom=0)
    top.legend(loc="upper left", fontsize="small")
    rate_ax.legend(loc="upper right", fontsize="small")
    top.grid(alpha=0.3)
    for i, run in enumerate(runs):
        rows = windows[windows["fleet"] == run.name]
        edges = np.append(rows["window_start_s"].to_numpy(float), rows["window_start_s"].max() + bucket_s)
        bottom.stairs(rows["slo_attainment"].to_numpy(float) * 100, edges, baseline=None, color=f"C{i}", lw=2,
                      label=run.name)
    bottom.set_ylabel(f"SLO attainment per {bucket_s:g} s (%)")
    bottom.set_xlabel("time (s)")
    bottom.set_ylim(0, 102)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize="small")
    fig.suptitle(title)
    return fig


def verdict(table: "pd.DataFrame") -> str:
    from sim.output import units

    auto, static = table.iloc[0], table.iloc[1]
    saved = 1 - auto["GPU-hours"] / static["GPU-hours"]
    cost = (f" ({units.money(auto['cost ($)'])} vs {units.money(static['cost ($)'])})"
            if auto["cost ($)"] is not None and not pd.isna(auto["cost ($)"]) else "")
    return (f"Autoscaled: {auto['GPU-hours']:.3g} GPU-hours{cost}, SLO attainment {units.pct(auto['SLO attainment'])}; "
            f"static fleet of {int(static['peak replicas'])}: {static['GPU-hours']:.3g} GPU-hours, SLO "
            f"attainment {units.pct(static['SLO attainment'])}. Autoscaling uses {units.pct(abs(saved))} "
            f"{'fewer' if saved >= 0 else 'more'} GPU-hours.")


def write_files(out: Path, runs: list[FleetRun], table, windows, shape, bucket_s: float, title: str,
                setup: Optional[dict]) -> dict[str, Path]:
    from sim.output.io import write_csv
    from sim.whatif.sweep_output import save_png, write_page

    files = {"csv": write_csv(out / "autoscale.csv", table),
             "slo": write_csv(out / "autoscale_slo.csv", windows),
             "replicas": write_csv(out / "autoscale_replicas.csv", replica_series(runs)),
             "png": save_png(plot(runs, windows, shape, bucket_s, title), out / "autoscale.png")}
    files["html"] = write_page(out / "autoscale.html", title, [verdict(table)],
                               [("Fleets", readable_comparison(table)), ("SLO attainment per window", windows)],
                               {"fleets": files["png"]},
                               setup)
    return files


# ----------------------------------------------------------------------------- CLI

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--autoscale", action="store_true",
                   help="compare the scenario's cluster.autoscaling with a static fleet sized for the peak: "
                        "GPU-hours, cost, SLO attainment per window, replicas over time")
    p.add_argument("--static-replicas", type=int, default=None, metavar="N",
                   help="--autoscale: the static fleet's size (default: the most replicas the autoscaled run held)")
    # (--jobs is accepted and changes nothing: the static fleet's size comes from the autoscaled run,
    # so the two run in turn)
    p.add_argument("--bucket-s", type=float, default=None, metavar="SECONDS",
                   help="--autoscale: the window of SLO attainment (default 3600, an hour)")


# flags of the other searches: refused with --autoscale rather than ignored
OTHER_FLAGS = (("--target-rate", "target_rate"), ("--devices", "devices"), ("--tp", "tp"),
               ("--max-replicas", "max_replicas"), ("--max-rate", "max_rate"), ("--tolerance", "tolerance"),
               ("--curve", "curve"), ("--ray", "ray"))


def check_flags(args: argparse.Namespace) -> None:
    from sim.whatif.plan import PlanError

    if not args.autoscale:
        for flag, value in (("--static-replicas", args.static_replicas), ("--bucket-s", args.bucket_s)):
            if value is not None:
                raise PlanError(f"{flag} applies to --autoscale")
        return
    for flag, dest in OTHER_FLAGS:
        if getattr(args, dest) is not None:
            raise PlanError(f"{flag} does not apply to --autoscale (it runs the scenario's autoscaled fleet and "
                            f"a static one, in turn)")
    if args.slo or args.pessimistic:
        raise PlanError("--autoscale judges each request by the scenario's slo section (ttft_s, tpot_s, e2e_s); "
                        "set those instead of --slo / --pessimistic")
    if args.static_replicas is not None and not 1 <= args.static_replicas <= MAX_REPLICAS:
        raise PlanError(f"--static-replicas {args.static_replicas}: expected a whole number from 1 to {MAX_REPLICAS}")
    args.bucket_s = 3600.0 if args.bucket_s is None else args.bucket_s
    if not 0 < args.bucket_s < math.inf:
        raise PlanError(f"--bucket-s {args.bucket_s}: expected a positive number of seconds")


def autoscale_main(args: argparse.Namespace) -> int:
    from sim.output.console import console, err_console
    from sim.output.run_dir import owned_run_folder
    from sim.output.setup import setup_manifest
    from sim.arrival_shape import shape_of
    from sim.whatif.plan import PlanError
    from sim.whatif.plan_args import scenario_device_price, scenario_task

    task, scenario = scenario_task(args)
    if scenario.cluster.autoscaling is None:
        raise PlanError(f"{args.scenario}: --autoscale needs cluster.autoscaling in the scenario (see "
                        f"docs/whatif/autoscaling.md)")
    price = scenario_device_price(args, scenario, "--autoscale")
    out = args.out or Path("runs") / args.scenario.stem / "plan_autoscale"
    t0 = time.monotonic()
    with owned_run_folder(out, force=args.force):
        auto = run_fleet(scenario, "autoscaled")
        size = args.static_replicas or auto.peak_replicas
        if not args.quiet:
            err_console.print(f"  autoscaled: {auto.gpu_hours:.3g} GPU-hours, peak {auto.peak_replicas} replicas; "
                              f"now the static fleet of {size}")
        static = run_fleet(static_twin(task, size), "static")
        runs = [auto, static]
        table = comparison(runs, scenario.slo, price)
        windows = pd.concat([slo_by_window(run, scenario.slo, args.bucket_s) for run in runs], ignore_index=True)
        if len(windows) > MAX_BUCKETS:
            raise PlanError(f"--bucket-s {args.bucket_s:g} cuts the run into {len(windows)} windows; "
                            f"expected at most {MAX_BUCKETS}")
        title = f"kvtwin plan: autoscaling vs a static fleet for {scenario.name} ({scenario.model.name} on " \
                f"{scenario.device.name})"
        write_files(out, runs, table, windows, shape_of(scenario.workload.arrival), args.bucket_s, title,
                    setup_manifest(scenario))
    if not args.quiet:
        from sim.output.run_table import print_frame
        print_frame(readable_comparison(table))
        console.print(verdict(table))
        console.print(f"2 runs in {time.monotonic() - t0:.1f} s; wrote {out}/ (autoscale.csv, autoscale_slo.csv, "
                      f"autoscale_replicas.csv, autoscale.png, autoscale.html)")
    return 0
