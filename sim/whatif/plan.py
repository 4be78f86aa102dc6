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

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from sim.core.lazy import lazy_import
from sim.core.memory import InsufficientMemoryError
from sim.scenario import ScenarioError
from sim.whatif.sweep import PointTask, flatten, gpu_cost
from sim.whatif.parallel import parallel_map

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


# ----------------------------------------------------------------------------- steady state

# The column of SteadyState.late_finish_rate in plan's tables: not a "served" rate, which it can exceed.
LATE_FINISH_COLUMN = "finished/s, 2nd half (req/s)"


@dataclass(frozen=True)
class SteadyState:
    ttft_growth: float      # seconds of median TTFT gained per second of arrivals, first to last third
    ttft_ratio: float       # median TTFT of the last third / of the first third
    # Requests/s that finished (any request) while the second half of the measured arrivals came in:
    # a backlog from the first half drains into that window, so it can exceed the offered rate.
    late_finish_rate: float

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
                         LATE_FINISH_COLUMN: best and best["steady.late_finish_rate"],
                         "TTFT p99 (s)": best and best["ttft_s.p99"],
                         "TPOT p99 (s)": best and best["tpot_s.p99"],
                         **{f"{slo.name} headroom": best and headroom(slo, best) for slo in self.slos},
                         "why none": reason})
        frame = pd.DataFrame(rows)
        frame["$/hour"] = pd.to_numeric(frame["$/hour"], errors="coerce")
        return frame.sort_values(["$/hour", "gpus"], na_position="last", kind="stable").reset_index(drop=True)

    @property
    def display_table(self) -> pd.DataFrame:
        return readable(self.table, fractions=lambda column: column.endswith(" headroom"))

    @property
    def probe_table(self) -> pd.DataFrame:
        rows = [{"device": c.device, "tp": c.tp, **row} for c, probes in zip(self.candidates, self.probes)
                for row in probes]
        return probe_frame(rows, ["device", "tp", "replicas"])


def readable(table: pd.DataFrame, fractions: Callable[[str], bool]) -> pd.DataFrame:
    """A plan's table for reading: money as $0.80, latencies in ms, the `fractions` columns in percent
    (the files keep dollars, seconds and fractions)."""
    from sim.output import units

    frame, names = table.copy(), {}
    for column in frame.columns:
        if column.startswith("$/") or column.endswith(" ($)"):
            frame[column] = [units.money(v) for v in frame[column]]
            names[column] = column.replace(" ($)", "")
        elif column.endswith(" (s)") and column.split()[0] in ("TTFT", "TPOT", "ITL", "E2E"):
            frame[column] = pd.to_numeric(frame[column], errors="coerce") * 1e3
            names[column] = column.replace(" (s)", " (ms)")
        elif fractions(column):
            frame[column] = [None if v is None or pd.isna(v) else units.pct(v) for v in frame[column]]
    return frame.rename(columns=names)


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


def scenario_band(scenario) -> Optional[dict]:
    """The typical error of the scenario's step-time source (sim/trained.py)."""
    from sim.costmodel import CostModel
    from sim.trained import error_band

    cost = CostModel.for_scenario(scenario)
    return error_band(cost.step_time_source, cost.profile, scenario.engine_generation)


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


