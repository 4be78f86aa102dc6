"""`simrun plan`'s answers for a person: the verdict sentences with their economics, the tables, the
figures, and the files (plan.csv, plan.png, plan.html) of the rate and replica searches."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from sim.core.lazy import lazy_import
from sim.whatif.plan import (LATE_FINISH_COLUMN, RateCurve, ReplicaPlan, SloTarget, band_metric,
                             dollars_per_million_output_tokens, headroom, seconds)
from sim.output.run_table import print_frame
from sim.whatif.sweep_output import save_png, write_page

np = lazy_import("numpy")
pd = lazy_import("pandas")



def answer_economics(row: dict, slos: Sequence[SloTarget]) -> str:
    """'$0.031 per 1M output tokens (...); headroom: ttft_p99 12.3 ms of 200 ms (94%), ...'"""
    from sim.output import units

    parts = []
    price = dollars_per_million_output_tokens(row)
    if price is not None:
        gpus = row.get("gpus")
        parts.append(f"{units.money(price)} per 1M output tokens ({gpus} GPU{'' if gpus == 1 else 's'} at "
                     f"{units.money(row['cost_per_hour'])}/hour, {units.format_value(row.get('output_token_throughput'))} "
                     f"output tok/s)")
    rooms = [f"{slo.name} {seconds(row[slo.column])} of {seconds(slo.limit_s)} ({units.pct(room)} left)"
             for slo in slos if (room := headroom(slo, row)) is not None]
    if rooms:
        parts.append("headroom: " + ", ".join(rooms))
    return "; ".join(parts)


CURVE_COLUMNS = (("steady.late_finish_rate", LATE_FINISH_COLUMN, 1.0), ("ttft_s.p50", "TTFT p50 (ms)", 1e3),
                 ("ttft_s.p99", "TTFT p99 (ms)", 1e3), ("tpot_s.p99", "TPOT p99 (ms)", 1e3),
                 ("e2e_s.p99", "E2E p99 (ms)", 1e3))



def curve_table(curve: RateCurve, compact: bool = False) -> pd.DataFrame:
    """The curve in display units; `compact` names the failed checks without their values (terminal)."""
    frame = curve.frame
    out = pd.DataFrame({"rate (req/s)": frame["rate"], "passes": frame["ok"].map({True: "yes", False: "no"})})
    for column, label, scale in CURVE_COLUMNS:
        if column in frame:
            out[label] = pd.to_numeric(frame[column], errors="coerce") * scale
    why = frame["failed"].fillna("")
    out["why not"] = why.map(lambda w: ", ".join(part.split(" ")[0] for part in w.split("; ") if part)) \
        if compact else why
    return out



def plot_rate_curve(curve: RateCurve, title: str = ""):
    """Latency percentiles (left) and achieved throughput (right) against the offered rate;
    the knee is the dashed vertical line, failing probes are crossed."""
    from matplotlib.figure import Figure

    frame = curve.frame
    rate = frame["rate"].to_numpy(float)
    fail = ~frame["ok"].astype(bool).to_numpy()
    fig = Figure(figsize=(10, 4), layout="constrained")
    lat, thr = fig.subplots(1, 2)
    for i, (name, column) in enumerate((("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s"))):
        for stat, style in (("p99", "-"), ("p50", ":")):
            ms = pd.to_numeric(frame.get(f"{column}.{stat}"), errors="coerce").to_numpy(float) * 1e3
            lat.plot(rate, ms, style, marker="o", ms=3, color=f"C{i}", label=f"{name} {stat}")
            lat.plot(rate[fail], ms[fail], "x", color="C3", ms=7)
        for slo in curve.slos:
            if slo.column.startswith(column + "."):
                lat.axhline(slo.limit_s * 1e3, color=f"C{i}", lw=1, ls="--", alpha=0.7)
    lat.set_yscale("log")
    _finish_axes(lat, "Latency (dashed: SLOs, x: failing probes)", "latency (ms)", curve.knee)
    served = pd.to_numeric(frame["steady.late_finish_rate"], errors="coerce").to_numpy(float)
    thr.plot(rate, served, "-o", ms=3, color="C0", label="finished/s in the 2nd half of the arrivals")
    thr.plot(rate[fail], served[fail], "x", color="C3", ms=7)
    thr.plot([0, rate.max()], [0, rate.max()], color="0.6", lw=1, label="offered")
    _finish_axes(thr, "Throughput", "requests / s", curve.knee)
    if title:
        fig.suptitle(title)
    return fig



def _finish_axes(ax, title: str, ylabel: str, knee: Optional[float]) -> None:
    if knee is not None:
        ax.axvline(knee, color="k", ls="--", lw=1)
        ax.annotate(f"knee {knee:g} req/s", (knee, 0.97), xycoords=("data", "axes fraction"),
                    ha="right", va="top", fontsize="small", rotation=90)
    ax.set_title(title)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")



def plot_replica_plan(plan: ReplicaPlan, title: str = ""):
    """Cost per hour (left) and replicas needed (right) per candidate; the cheapest in green."""
    from matplotlib.figure import Figure

    table = plan.table
    labels = [f"{d}\ntp={t}" for d, t in zip(table["device"], table["tp"])]
    cost = pd.to_numeric(table["$/hour"], errors="coerce").to_numpy(float)
    replicas = pd.to_numeric(table["replicas"], errors="coerce").to_numpy(float)
    colours = ["C2" if i == 0 and not np.isnan(cost[0]) else "C0" for i in range(len(table))]
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    for ax, values, what, fmt in zip(fig.subplots(1, 2), (cost, replicas),
                                     ("cost ($/hour)", "replicas needed"), ("${:.2f}", "{:.0f}")):
        bars = ax.bar(range(len(table)), np.nan_to_num(values), color=colours)
        ax.bar_label(bars, [fmt.format(v) if not np.isnan(v) else "none" for v in values], fontsize="small")
        ax.set_xticks(range(len(table)), labels, fontsize="small")
        ax.set_ylabel(what)
        ax.set_title(f"{what.split(' (')[0].capitalize()} at {plan.target_rate:g} req/s")
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    return fig



def print_band(band: Optional[dict], slos: Sequence[SloTarget], pessimistic: bool) -> None:
    from sim.output.console import console
    from sim.trained import band_words

    if not band:
        console.print("error band: none validated for these step times")
        return
    shown = [f"{slo.name}{band_words(band, band_metric(slo))}" for slo in slos] or \
        [f"tpot_p99{band_words(band, 'tpot_p99')}"]
    lead = ("pessimistic: SLO limits tightened to " + ", ".join(map(str, slos)) + "; "
            if pessimistic else "")
    console.print(f"{lead}step times {band['source']}: " + "; ".join(shown))



def write_rate_plan(curve: RateCurve, out: Path, name: str, setup: Optional[dict] = None) -> dict[str, Path]:
    from sim.output.io import write_csv

    title = f"kvtwin plan: highest sustainable rate for {name}{_on(setup)}"
    files = {"csv": write_csv(out / "plan.csv", curve.frame),
             "png": save_png(plot_rate_curve(curve, title), out / "plan.png")}
    files["html"] = write_page(out / "plan.html", title, [rate_verdict(curve)],
                               [("Curve", curve_table(curve))], {"curve": files["png"]}, setup)
    return files



def _model(setup: Optional[dict]) -> str:
    return (((setup or {}).get("scenario") or {}).get("model") or {}).get("name", "?")



def _on(setup: Optional[dict]) -> str:
    """' (llama-3.1-8b on l4)' for a title, from the setup manifest."""
    scenario = (setup or {}).get("scenario") or {}
    if not scenario:
        return ""
    tp = (scenario.get("parallelism") or {}).get("tp", 1)
    return f" ({_model(setup)} on {(scenario.get('device') or {}).get('name', '?')}{f', tp={tp}' if tp > 1 else ''})"



def rate_verdict(curve: RateCurve) -> str:
    slos = ", ".join(map(str, curve.slos)) or "no SLO"
    if curve.knee is None:
        return f"No rate passes ({slos}); the lowest tried fails: {curve.rows[0]['failed']}."
    limit = curve.limit()
    stop = f"; at {limit['rate']:g} req/s: {limit['failed']}" if limit else " (the highest rate tried)"
    economics = answer_economics(curve.at(curve.knee) or {}, curve.slos)
    return (f"Highest sustainable rate within {slos}: {curve.knee:g} req/s{stop}."
            + (f" At {curve.knee:g} req/s: {economics}." if economics else ""))



def print_rate_plan(curve: RateCurve, out: Path, wall_s: float) -> None:
    from sim.output.console import console

    print_frame(curve_table(curve, compact=True))
    console.print(rate_verdict(curve))
    console.print(f"{probes_counted(len(curve.rows))} in {wall_s:.1f} s; wrote {out}/ (plan.csv, plan.png, plan.html)")



def write_replica_plan(plan: ReplicaPlan, out: Path, name: str, setup: Optional[dict] = None) -> dict[str, Path]:
    from sim.output.io import write_csv

    title = f"kvtwin plan: replicas for {plan.target_rate:g} req/s of {name} ({_model(setup)})"
    files = {"csv": write_csv(out / "plan.csv", plan.table),
             "probes": write_csv(out / "plan_probes.csv", plan.probe_table),
             "png": save_png(plot_replica_plan(plan, title), out / "plan.png")}
    files["html"] = write_page(out / "plan.html", title, [replica_verdict(plan)],
                               [("Candidates", plan.display_table)], {"plan": files["png"]}, setup)
    return files



def replica_verdict(plan: ReplicaPlan) -> str:
    from sim.output import units

    best = plan.table.iloc[0]
    slos = ", ".join(map(str, plan.slos)) or "no SLO"
    if pd.isna(best["replicas"]):
        return f"No candidate serves {plan.target_rate:g} req/s within {slos}."
    gpus = int(best["gpus"])
    i = next(i for i, c in enumerate(plan.candidates) if c.device == best["device"] and c.tp == best["tp"])
    row = {**plan.answer(i), "cost_per_hour": best["$/hour"]}
    return (f"Cheapest for {plan.target_rate:g} req/s within {slos}: {int(best['replicas'])} x {best['device']} "
            f"at tp={best['tp']} ({gpus} GPU{'s' if gpus > 1 else ''}, {units.money(best['$/hour'])}/hour). "
            f"{answer_economics(row, plan.slos)}.")



def print_replica_plan(plan: ReplicaPlan, out: Path, wall_s: float) -> None:
    from sim.output.console import console

    print_frame(plan.display_table)
    console.print(replica_verdict(plan))
    probes = sum(len(p) for p in plan.probes)
    console.print(f"{probes_counted(probes)} in {wall_s:.1f} s; wrote {out}/ (plan.csv, plan_probes.csv, plan.png, "
                  "plan.html)")


def probes_counted(n: int) -> str:
    return f"{n} probe" if n == 1 else f"{n} probes"
