"""`simrun plan`: capacity searches on the simulator.

    simrun plan SCENARIO.yaml --slo ttft_p99=0.5 --slo tpot_p99=0.05 [--max-rate R] [--tolerance 0.05] [--curve N]
        The highest request rate the scenario sustains within the SLOs (the knee of its curve).
    simrun plan SCENARIO.yaml --target-rate 40 --devices h100-sxm,l4 [--tp 1,2] [--cost l4=0.7] --slo ...
        Per device (and tp), the fewest replicas serving the rate within the SLOs, ranked by cost.
    simrun plan SCENARIO.yaml --autoscale [--static-replicas N] [--cost l4=0.7] [--bucket-s 3600]
        The scenario's cluster.autoscaling against a static fleet sized for the peak: GPU-hours, cost,
        SLO attainment per hour, replicas over time (sim/whatif/plan_autoscale.py).

A probe (one simulated rate, device, tp and replica count) passes when it is sustainable
and meets every SLO. SLOs are percentiles of the run's summary in seconds (ttft_p99=0.5);
without --slo the scenario's `slo` targets are used as p99 targets.

Sustainable means the queue does not grow without bound. Over the measured requests (warm-up
excluded) in arrival order, the median TTFT of the last third is compared with the first
third's: a probe is overloaded when TTFT grows by more than GROWTH_LIMIT (0.05) seconds per
second of arrivals and the late median is at least TTFT_RATIO (2) times the early one. A FCFS
queue fed at rate r and served at rate mu delays each arrival by r/mu - 1 s more per second,
so 0.05 means "the engine keeps up with less than ~95% of the offered rate"; the ratio keeps
millisecond jitter in short runs from counting as growth. TTFT hardly moves while a stable
system fills up after its start, unlike the number of requests in flight or the throughput
over a short run, which is why the rule reads TTFT. A batch that keeps growing with no queue
in front of it (no admission limit reached yet) shows as rising TPOT: a TPOT SLO catches it,
and the queue does once the batch reaches max_num_seqs or fills the KV pool.

Searches: rate = double (or halve) from the scenario's rate until the answer is bracketed,
then bisect to --tolerance; replicas = double from one until a count passes, then bisect.
Both assume passing is monotone in the searched value (same seed, so arrivals at every rate
are one gap sequence rescaled). Every probe keeps the scenario's arrival window
(num_requests / rate seconds, see Traffic), so a verdict at a high rate rests on as long a
run as one at the scenario's rate. Candidates of a replica search run in parallel (--jobs/--ray).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from sim.core.lazy import lazy_import
from sim.core.memory import InsufficientMemoryError
from sim.output.run_dir import owned_run_folder
from sim.scenario import MAX_REPLICAS, ScenarioError
from sim.whatif.sweep import (PointTask, base_raw, check_jobs, flatten, gpu_cost, parallel_map,
                       print_frame, save_png, split_sets, write_page)

np = lazy_import("numpy")      # on first use: `simrun plan -h` stays light
pd = lazy_import("pandas")

RATE = "workload.arrival.rate"
GROWTH_LIMIT = 0.05       # s/s, see the module docstring: falling behind by more than ~5% of the offered rate
TTFT_RATIO = 2.0
MIN_MEASURED = 30
SLO_FAMILIES = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s"}
SLO_STATS = ("p50", "p90", "p99", "mean")


class PlanError(ValueError):
    """A search that cannot run as asked; the message names the flag or field."""


# ----------------------------------------------------------------------------- SLOs

@dataclass(frozen=True)
class SloTarget:
    name: str           # ttft_p99
    column: str         # the flattened summary key, ttft_s.p99
    limit_s: float

    def check(self, row: dict) -> Optional[str]:
        """None when met, else why not."""
        value = row.get(self.column)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return f"{self.name} undefined (no request measured it)"
        if value > self.limit_s:
            return f"{self.name} {seconds(value)} > {seconds(self.limit_s)}"
        return None

    def __str__(self) -> str:
        return f"{self.name} <= {seconds(self.limit_s)}"


def allowed_slos() -> list[str]:
    return [f"{f}_{s}" for f in SLO_FAMILIES for s in SLO_STATS]


def parse_slo(text: str) -> SloTarget:
    name, sep, value = text.partition("=")
    family, _, stat = name.strip().partition("_")
    if not sep or family not in SLO_FAMILIES or stat not in SLO_STATS:
        raise PlanError(f"--slo {text!r}: expected METRIC=SECONDS with METRIC one of "
                        f"{', '.join(allowed_slos())}, e.g. --slo ttft_p99=0.5")
    try:
        limit = float(value)
    except ValueError:
        limit = math.nan
    if not limit > 0:
        raise PlanError(f"--slo {text!r}: the limit must be a positive number of seconds")
    return SloTarget(name.strip(), f"{SLO_FAMILIES[family]}.{stat}", limit)


def scenario_slos(slo) -> list[SloTarget]:
    """The scenario's per-request targets (slo.ttft_s, ...) read as p99 targets."""
    return [SloTarget(f"{family}_p99", f"{column}.p99", getattr(slo, column))
            for family, column in SLO_FAMILIES.items() if getattr(slo, column, None) is not None]


def seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


# ----------------------------------------------------------------------------- the answer's economics

def dollars_per_million_output_tokens(row: dict) -> Optional[float]:
    """What a million generated tokens cost at this probe: GPUs' $/hour over output tokens per hour."""
    cost, tokens = row.get("cost_per_hour"), row.get("output_token_throughput")
    if cost is None or not tokens or (isinstance(tokens, float) and math.isnan(tokens)):
        return None
    return cost / (tokens * 3600) * 1e6


def headroom(slo: SloTarget, row: dict) -> Optional[float]:
    """The fraction of the SLO left unused at this probe: 1 - value / limit (negative: missed)."""
    value = row.get(slo.column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return 1 - value / slo.limit_s


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


# ----------------------------------------------------------------------------- steady state

@dataclass(frozen=True)
class SteadyState:
    ttft_growth: float      # seconds of median TTFT gained per second of arrivals, first to last third
    ttft_ratio: float       # median TTFT of the last third / of the first third
    served_rate: float      # requests/s finished in the second half of the measured arrival window

    @property
    def sustainable(self) -> bool:
        return not (self.ttft_growth > GROWTH_LIMIT and self.ttft_ratio >= TTFT_RATIO)

    def problems(self) -> list[str]:
        return [] if self.sustainable else [f"queue grows (TTFT +{self.ttft_growth:.2f} s/s)"]


def steady_state(requests: pd.DataFrame) -> SteadyState:
    """The module docstring's rule over a requests frame (sim.records.requests_frame)."""
    measured = requests[(requests["status"] == "finished") & ~requests["is_warmup"].astype(bool)]
    if len(measured) < MIN_MEASURED:
        raise PlanError(f"only {len(measured)} measured requests; judging steady state needs at least "
                        f"{MIN_MEASURED}: raise workload.num_requests")
    ordered = measured.sort_values("arrival_s", kind="stable")
    third = len(ordered) // 3
    early, late = ordered.iloc[:third], ordered.iloc[-third:]
    span = float(late["arrival_s"].median() - early["arrival_s"].median())
    ttft_early, ttft_late = float(early["ttft_s"].median()), float(late["ttft_s"].median())
    growth = (ttft_late - ttft_early) / span if span > 0 else 0.0
    ratio = ttft_late / ttft_early if ttft_early > 0 else math.inf
    first, last = float(ordered["arrival_s"].iloc[0]), float(ordered["arrival_s"].iloc[-1])
    middle = (first + last) / 2          # past the fill-up at the start, for runs much longer than E2E
    done = requests["finish_s"].between(middle, last).sum()
    return SteadyState(growth, ratio, float(done / (last - middle)) if last > middle else math.nan)


# ----------------------------------------------------------------------------- probes

def run_probe(item: tuple[PointTask, tuple[SloTarget, ...]]) -> dict[str, Any]:
    """Simulate one point -> a flat row: ok, why not, steady state, then every summary metric."""
    from sim.predict import predict

    task, slos = item
    scenario = task.scenario()
    try:
        result = predict(scenario, task.label or scenario.name)
    except InsufficientMemoryError as e:
        return {"ok": False, "failed": f"does not fit: {e}"}
    row = flatten(result.summary)
    state = steady_state(result.requests)
    failed = state.problems() + [why for why in (slo.check(row) for slo in slos) if why]
    return {"ok": not failed, "failed": "; ".join(failed), "sustainable": state.sustainable,
            **{f"steady.{k}": v for k, v in dataclasses.asdict(state).items()}, **row, **gpu_cost(scenario)}


def with_settings(task: PointTask, settings: dict[str, Any]) -> PointTask:
    """The task with more fields set (dotted path -> value), labelled by them for error messages."""
    label = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in settings.items())
    return dataclasses.replace(task, settings=task.settings + tuple(settings.items()), label=label)


MIN_PROBE_REQUESTS = 100    # a low-rate probe keeps at least this many (or the scenario's count if lower)


@dataclass(frozen=True)
class Traffic:
    """The scenario's traffic, moved to another rate over the same arrival window.

    A probe at twice the rate gets twice the requests (and warm-up requests), at half the rate
    half of them, so every probe covers the scenario's num_requests / rate seconds and is as far
    from its start-up transient. Below MIN_PROBE_REQUESTS the count stops shrinking (the window
    then grows): the steady-state rule needs enough measured requests to compare thirds.
    """

    rate: float
    num_requests: Optional[int]          # None when duration_s alone bounds the workload
    warmup_requests: int

    @classmethod
    def of(cls, scenario) -> "Traffic":
        w = scenario.workload
        return cls(w.arrival.rate, w.num_requests, w.warmup_requests)

    def at(self, rate: float) -> dict[str, Any]:
        settings: dict[str, Any] = {RATE: rate}
        if self.num_requests is not None:
            scale = rate / self.rate
            count = max(round(self.num_requests * scale), min(self.num_requests, MIN_PROBE_REQUESTS))
            settings["workload.num_requests"] = count
            settings["workload.warmup_requests"] = min(round(self.warmup_requests * scale), count - MIN_MEASURED)
        return settings


# ----------------------------------------------------------------------------- search algorithms

def highest_passing(passes: Callable[[float], bool], start: float, lowest: float, highest: float,
                    tolerance: float) -> Optional[float]:
    """The highest x in [lowest, highest] with passes(x), to a relative `tolerance`, or None.

    Doubles (or halves) from `start` to bracket the change, then bisects; assumes passes()
    is true below some threshold and false above it.
    """
    x = min(max(start, lowest), highest)
    if passes(x):
        lo = x
        while lo < highest:
            hi = min(2 * lo, highest)
            if not passes(hi):
                break
            lo = hi
        else:
            return lo                                # passes all the way up to `highest`
    else:
        hi = x
        while True:
            lo = hi / 2
            if lo < lowest:
                return None
            if passes(lo):
                break
            hi = lo
    while hi - lo > tolerance * lo:
        mid = float(f"{(lo + hi) / 2:.4g}")         # tidy rates in the curve
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return lo


def fewest_passing(passes: Callable[[int], bool], most: int) -> Optional[int]:
    """The smallest n in [1, most] with passes(n), or None; doubles from 1, then bisects."""
    fail, n = 0, 1
    while not passes(n):
        if n >= most:
            return None
        fail, n = n, min(2 * n, most)
    while n - fail > 1:
        mid = (fail + n) // 2
        fail, n = (fail, mid) if passes(mid) else (mid, n)
    return n


# ----------------------------------------------------------------------------- rate search

@dataclass
class RateCurve:
    slos: list[SloTarget]
    rows: list[dict]                 # every probe, by rate
    knee: Optional[float]            # the highest passing rate

    @property
    def frame(self) -> pd.DataFrame:
        return probe_frame(self.rows, ["rate"])

    def at(self, rate: Optional[float]) -> Optional[dict]:
        return next((r for r in self.rows if r["rate"] == rate), None)

    def limit(self) -> Optional[dict]:
        """The first failing probe above the knee: what stopped it."""
        return next((r for r in self.rows if not r["ok"] and (self.knee is None or r["rate"] > self.knee)), None)


def search_rate(base: PointTask, traffic: Traffic, slos: Sequence[SloTarget], lowest: float, highest: float,
                tolerance: float, log: Callable[[dict], None] = lambda row: None) -> RateCurve:
    """Bracket and bisect from the scenario's rate (see highest_passing)."""
    rows: dict[float, dict] = {}

    def passes(rate: float) -> bool:
        if rate not in rows:
            rows[rate] = {"rate": rate, **run_probe((with_settings(base, traffic.at(rate)), tuple(slos)))}
            log(rows[rate])
        return rows[rate]["ok"]

    knee = highest_passing(passes, min(traffic.rate, highest), lowest, highest, tolerance)
    return RateCurve(list(slos), [rows[r] for r in sorted(rows)], knee)


def fill_curve(base: PointTask, traffic: Traffic, curve: RateCurve, points: int, jobs: int,
               ray: Optional[str], quiet: bool) -> RateCurve:
    """`points` evenly spaced rates up to the highest probed, run in parallel: a fuller plot
    around the same answer (the knee stays the search's)."""
    top = max(row["rate"] for row in curve.rows)
    rates = [r for r in (float(f"{top * k / points:.4g}") for k in range(1, points + 1)) if curve.at(r) is None]
    items = [(with_settings(base, traffic.at(r)), tuple(curve.slos)) for r in rates]
    rows = parallel_map(run_probe, items, jobs, ray, label=f"curve ({len(items)} rates)", quiet=quiet)
    merged = curve.rows + [{"rate": r, **row} for r, row in zip(rates, rows)]
    return RateCurve(curve.slos, sorted(merged, key=lambda row: row["rate"]), curve.knee)


def probe_frame(rows: Sequence[dict], keys: Sequence[str]) -> pd.DataFrame:
    """Key columns, the verdict, then every metric (union over rows, first-seen order)."""
    head = [*keys, "ok", "failed", "sustainable"]
    columns = dict.fromkeys(head)
    for row in rows:
        columns.update(dict.fromkeys(row))
    return pd.DataFrame.from_records([{c: row.get(c) for c in columns} for row in rows], columns=list(columns))


CURVE_COLUMNS = (("steady.served_rate", "served (req/s)", 1.0), ("ttft_s.p50", "TTFT p50 (ms)", 1e3),
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
    served = pd.to_numeric(frame["steady.served_rate"], errors="coerce").to_numpy(float)
    thr.plot(rate, served, "-o", ms=3, color="C0", label="served (2nd half of the arrivals)")
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


# ----------------------------------------------------------------------------- replica search

@dataclass(frozen=True)
class Candidate:
    device: str
    tp: int
    gpu_price: float                 # per GPU hour

    @property
    def label(self) -> str:
        return f"{self.device} tp={self.tp}"


def search_replicas(item: tuple[PointTask, tuple[SloTarget, ...], int, float]) -> list[dict]:
    """Every probe of one candidate's search (a worker: runs in a process or a Ray task)."""
    task, slos, most, gpu_price = item
    rows: dict[int, dict] = {}

    def probe(n: int) -> dict:
        if n not in rows:
            row = run_probe((with_settings(task, {"cluster.replicas": n}), slos))
            if row.get("gpus") is not None:
                row["cost_per_hour"] = row["gpus"] * gpu_price
            rows[n] = {"replicas": n, **row}
        return rows[n]

    if not probe(1)["failed"].startswith("does not fit"):     # memory is per replica: more won't help
        fewest_passing(lambda n: probe(n)["ok"], most)
    return [rows[n] for n in sorted(rows)]


@dataclass
class ReplicaPlan:
    target_rate: float
    slos: list[SloTarget]
    candidates: list[Candidate]
    probes: list[list[dict]]         # per candidate

    def answer(self, i: int) -> Optional[dict]:
        return next((r for r in self.probes[i] if r["ok"]), None)

    @property
    def table(self) -> pd.DataFrame:
        """One row per candidate, cheapest first; candidates with no answer last."""
        rows = []
        for i, c in enumerate(self.candidates):
            best = self.answer(i)
            reason = "" if best else (self.probes[i][-1]["failed"] if self.probes[i] else "")
            rows.append({"device": c.device, "tp": c.tp, "replicas": best and best["replicas"],
                         "gpus": best and best["gpus"], "$/GPU-hour": c.gpu_price,
                         "$/hour": best and best["gpus"] * c.gpu_price,
                         "$/1M output tok": best and dollars_per_million_output_tokens(
                             {**best, "cost_per_hour": best["gpus"] * c.gpu_price}),
                         "served (req/s)": best and best["steady.served_rate"],
                         "TTFT p99 (s)": best and best["ttft_s.p99"],
                         "TPOT p99 (s)": best and best["tpot_s.p99"],
                         **{f"{slo.name} headroom": best and headroom(slo, best) for slo in self.slos},
                         "why none": reason})
        frame = pd.DataFrame(rows)
        frame["$/hour"] = pd.to_numeric(frame["$/hour"], errors="coerce")
        return frame.sort_values(["$/hour", "gpus"], na_position="last", kind="stable").reset_index(drop=True)

    @property
    def display_table(self) -> pd.DataFrame:
        """The table for reading: latencies in ms, headroom in percent (files keep seconds and fractions)."""
        from sim.output import units

        frame = self.table.copy()
        for column in frame.columns:
            if column.startswith("$/"):
                frame[column] = [units.money(v) for v in frame[column]]
            elif column.endswith(" (s)"):
                frame[column] = pd.to_numeric(frame[column], errors="coerce") * 1e3
            elif column.endswith(" headroom"):
                frame[column] = [None if v is None or pd.isna(v) else units.pct(v) for v in frame[column]]
        return frame.rename(columns={c: c.replace(" (s)", " (ms)") for c in frame.columns})

    @property
    def probe_table(self) -> pd.DataFrame:
        rows = [{"device": c.device, "tp": c.tp, **row} for c, probes in zip(self.candidates, self.probes)
                for row in probes]
        return probe_frame(rows, ["device", "tp", "replicas"])


def plan_replicas(base: PointTask, traffic: Traffic, slos: Sequence[SloTarget], target_rate: float,
                  candidates: Sequence[Candidate], most: int, jobs: int, ray: Optional[str],
                  quiet: bool) -> ReplicaPlan:
    tasks = [with_settings(base, {"device": c.device, "parallelism.tp": c.tp, **traffic.at(target_rate)})
             for c in candidates]
    invalid = {i: invalid_reason(t) for i, t in enumerate(tasks)}
    runnable = [i for i, why in invalid.items() if why is None]
    found = parallel_map(search_replicas, [(tasks[i], tuple(slos), most, candidates[i].gpu_price) for i in runnable],
                         jobs, ray, label=f"searching {len(runnable)} candidates", quiet=quiet)
    probes = [[{"replicas": None, "ok": False, "failed": why}] for why in invalid.values()]
    for i, rows in zip(runnable, found):
        probes[i] = rows
    return ReplicaPlan(target_rate, list(slos), list(candidates), probes)


def invalid_reason(task: PointTask) -> Optional[str]:
    """Why a candidate cannot be a scenario at all (tp=4 on a 14-head model), else None."""
    try:
        task.scenario()
    except ScenarioError as e:
        return "invalid: " + "; ".join(e.problems)
    return None


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


# ----------------------------------------------------------------------------- CLI

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
    with owned_run_folder(out, force=args.force):         # checked before searching
        if args.target_rate is None:
            curve = run_rate_search(args, base, scenario, slos)
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


def default_out(args: argparse.Namespace) -> Path:
    """A folder per search: the replica search must not replace the rate search's files."""
    search = ("plan" if args.target_rate is None else "plan_splits" if getattr(args, "disaggregation", False)
              else "plan_replicas")
    return Path("runs") / args.scenario.stem / search


def scenario_band(scenario) -> Optional[dict]:
    """The typical error of the scenario's step-time source (sim/trained.py)."""
    from sim.costmodel import CostModel
    from sim.trained import error_band

    cost = CostModel.for_scenario(scenario)
    return error_band(cost.step_time_source, cost.profile)


def band_metric(slo: SloTarget) -> str:
    """The validated metric an SLO is judged by: the p99 band for a percentile, the mean's for a mean."""
    family = slo.name.partition("_")[0]
    return f"{'tpot' if family == 'itl' else family}_{'mean' if slo.name.endswith('_mean') else 'p99'}"


def pessimistic_slos(slos: Sequence[SloTarget], band: Optional[dict]) -> list[SloTarget]:
    """Each limit divided by (1 + the band's typical error on its metric): a point passes only if
    it would still pass were the prediction that much too optimistic."""
    out = []
    for slo in slos:
        entry = (band or {}).get(band_metric(slo))
        if entry is None:
            raise PlanError(f"--pessimistic: no validated error band for {slo.name} with step times "
                            f"'{(band or {}).get('source', 'of this scenario')}' (bands come from "
                            f"sim/core/catalog/trained-v*.yaml, or a calibrated profile's held-out run)")
        out.append(SloTarget(slo.name, slo.column, slo.limit_s / (1 + entry["typical"])))
    return out


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


def candidates(args, scenario) -> list[Candidate]:
    from sim.core.catalog import catalog_entry, device_names

    names = [d.strip() for d in args.devices.split(",")] if args.devices else [scenario.device.name]
    prices = dict(parse_cost(c) for c in args.cost)
    out = []
    for name in names:
        if name not in device_names():
            raise PlanError(f"--devices: unknown device '{name}' (known: {', '.join(device_names())})")
        price = prices.get(name, catalog_entry("devices", name).get("cost_per_hour"))
        if price is None:
            raise PlanError(f"device '{name}' has no cost_per_hour in the catalog: pass --cost {name}=PRICE")
        out += [Candidate(name, tp, float(price)) for tp in tp_degrees(args.tp, scenario)]
    return out


def parse_cost(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        price = float(value) if sep else -1.0
    except ValueError:
        price = -1.0
    if price < 0:
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


# ----------------------------------------------------------------------------- output

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
    console.print(f"{len(curve.rows)} probes in {wall_s:.1f} s; wrote {out}/ (plan.csv, plan.png, plan.html)")


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
    console.print(f"{probes} probes in {wall_s:.1f} s; wrote {out}/ (plan.csv, plan_probes.csv, plan.png, plan.html)")
