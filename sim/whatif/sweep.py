"""Sweeps: one scenario run at every point of a grid of field values, in parallel.

    simrun SCENARIO.yaml --set engine.block_size=8,16,32 --set workload.arrival.rate=20,40
                         [--zip] [--jobs N | --ray [ADDRESS]] [--out DIR] [--point-outputs]

A `--set` value with commas is a list of values to sweep, unless it is a YAML flow
collection (`[0,600]`, `{base: l4}`), which stays one value. Several multi-valued flags
form a grid (first flag outermost); `--zip` pairs them element by element instead, so
`--set device=l4,h100-sxm --set parallelism.tp=2,1 --zip` compares two L4s at tp=2 with
one H100. Every point is validated like a scenario before anything runs.

Points run on local processes (`--jobs`, default one per core) or as tasks on a Ray
cluster (`--ray`); each worker rebuilds its scenario from the raw mapping and runs
`predict`, and results are collected in point order, so sweep.csv is byte-identical
whichever backend ran it. Output: DIR/sweep.csv (swept fields, then the flattened
summary), DIR/sweep_<metric>.png per headline metric, DIR/sweep.html.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from sim.core.files import printable
from sim.core.lazy import lazy_import
from sim.core.memory import InsufficientMemoryError
from sim.names import folder_name
from sim.scenario import apply_overrides, load_raw, parse_override, set_path, validate_scenario
from sim.errors import SweepError
from sim.whatif.parallel import parallel_map

pd = lazy_import("pandas")     # on first use: `simrun -h` builds the sweep flags without pandas


# ----------------------------------------------------------------------------- axes and points

@dataclass(frozen=True)
class Axis:
    """One swept field: its dotted path and its values, as typed and as parsed YAML."""

    path: str
    texts: tuple[str, ...]
    values: tuple[Any, ...]


def split_values(text: str) -> list[str]:
    """'8,16,32' -> ['8', '16', '32']; a YAML flow collection ('[0,600]', '{a: 1, b: 2}') is one value."""
    stripped = text.strip()
    if stripped.startswith(("[", "{")) or "," not in stripped:
        return [text]
    return [part.strip() for part in stripped.split(",")]


def split_sets(overrides: Sequence[str]) -> tuple[list[str], list[Axis]]:
    """--set flags -> (single-valued overrides, kept as given; swept axes, in flag order)."""
    plain, axes, seen = [], [], set()
    for text in overrides:
        keys, _ = parse_override(text)           # checks PATH=VALUE and the path
        value = text.partition("=")[2]
        dotted = ".".join(keys)
        if dotted in seen:
            raise SweepError(f"--set {dotted}: given twice; give each field once "
                             f"(list several values as {dotted}=A,B,C)")
        seen.add(dotted)
        texts = split_values(value)
        if len(texts) == 1:
            plain.append(text)
            continue
        if not all(texts):
            raise SweepError(f"--set {text!r}: an empty value in the list (expected e.g. {dotted}=8,16,32)")
        axes.append(Axis(dotted, tuple(texts), tuple(parse_override(f"{dotted}={t}")[1] for t in texts)))
    return plain, axes


def is_sweep(overrides: Sequence[str]) -> bool:
    return bool(split_sets(overrides)[1])


POINT_SHOWN = 120       # characters of a point's settings an error quotes (a swept value can be long)


@dataclass(frozen=True)
class Point:
    """One combination of swept values (aligned with the sweep's axes)."""

    index: int
    texts: tuple[str, ...]
    values: tuple[Any, ...]

    def label(self, axes: Sequence[Axis]) -> str:
        return ", ".join(f"{a.path}={t}" for a, t in zip(axes, self.texts))


def sweep_points(axes: Sequence[Axis], zipped: bool = False) -> list[Point]:
    """The grid (first axis outermost), or with `zipped` the element-wise pairs."""
    if zipped:
        lengths = {a.path: len(a.values) for a in axes}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{p} has {n}" for p, n in lengths.items())
            raise SweepError(f"--zip pairs values element by element, so every swept field needs "
                             f"the same number of values ({shown})")
        index_rows = [(j,) * len(axes) for j in range(len(axes[0].values))]
    else:
        index_rows = list(itertools.product(*(range(len(a.values)) for a in axes)))
    points = [Point(i, tuple(a.texts[j] for a, j in zip(axes, row)), tuple(a.values[j] for a, j in zip(axes, row)))
              for i, row in enumerate(index_rows)]
    repeated = next((texts for texts, n in Counter(p.texts for p in points).items() if n > 1), None)
    if repeated:
        shown = printable(", ".join(f"{a.path}={t}" for a, t in zip(axes, repeated)), POINT_SHOWN)
        raise SweepError(f"the point {shown} comes more than once: give each value once"
                         + ("" if zipped else " (to repeat a value alongside others, use --zip)"))
    return points


# ----------------------------------------------------------------------------- one point

@dataclass(frozen=True)
class PointTask:
    """Everything a worker needs to run one point; plain data, so it pickles for processes and Ray."""

    raw: dict
    base_dir: str
    source: str
    settings: tuple[tuple[str, Any], ...]       # (dotted path, value) applied over `raw`
    label: str = ""
    out_dir: Optional[str] = None               # write the point's full run here (--point-outputs)
    trace: bool = False
    steps: str = "timeline"                   # steps.csv of a written point (simrun --steps)
    plots: bool = True                          # a written point's figures and report.html (not --no-plots)

    def scenario(self):
        raw = self.raw
        for dotted, value in self.settings:
            raw = set_path(raw, dotted.split("."), value)
        where = f"{self.source} (at {printable(self.label, POINT_SHOWN)})" if self.label else self.source
        return validate_scenario(raw, base_dir=Path(self.base_dir), source=where)


def run_point(task: PointTask) -> dict[str, Any]:
    """Simulate one point -> one flat row (summary metrics, GPUs and their cost).

    A point whose model does not fit the device is a row with an `error`, not a failed
    sweep: "does not fit" is one of the answers a device sweep is asked for.
    """
    from sim.predict import predict

    scenario = task.scenario()
    try:
        result = predict(scenario, task.label or scenario.name, manifest=bool(task.out_dir))
    except InsufficientMemoryError as e:
        return {"error": f"does not fit: {e}"}
    if task.out_dir:
        from sim.output.run_files import write_run
        write_run(result, Path(task.out_dir), trace=task.trace, report=task.plots, steps=task.steps)
    return {**flatten(result.summary), **gpu_cost(scenario)}


def gpu_cost(scenario, price: Optional[float] = None) -> dict[str, Any]:
    """GPUs the scenario occupies (tp x dp x replicas) and their cost per hour (catalog price unless given)."""
    if scenario.cluster.disaggregation is not None:
        from sim.disagg_config import pool_cost
        return pool_cost(scenario, price)
    gpus = scenario.parallelism.gpus * scenario.cluster.replicas
    price = scenario.device.cost_per_hour if price is None else price
    return {"gpus": gpus, "cost_per_hour": None if price is None else gpus * price}


def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'ttft_s': {'p99': x}} -> {'ttft_s.p99': x}; lists (per-replica figures) are left out."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        elif not isinstance(value, (list, tuple)):
            out[name] = value
    return out


# ----------------------------------------------------------------------------- the sweep

@dataclass
class Sweep:
    axes: list[Axis]
    points: list[Point]
    zipped: bool
    frame: pd.DataFrame          # one row per point: swept fields, then metrics


def point_tasks(raw: dict, base_dir: Path, source: str, axes: Sequence[Axis], points: Sequence[Point],
                outputs: Optional[Path] = None, trace: bool = False, steps: str = "timeline",
                plots: bool = True) -> list[PointTask]:
    """One task per point, each validated here so a bad value fails before anything runs."""
    tasks = []
    for p in points:
        out_dir = str(outputs / point_folder(p, axes)) if outputs else None
        task = PointTask(raw, str(base_dir), source, tuple(zip((a.path for a in axes), p.values)),
                         p.label(axes), out_dir, trace, steps, plots)
        task.scenario()
        tasks.append(task)
    return tasks


def point_folder(point: Point, axes: Sequence[Axis]) -> str:
    """'003_block_size=16,rate=20': index first so folders sort in point order."""
    parts = ",".join(f"{a.path.rsplit('.', 1)[-1]}={t}" for a, t in zip(axes, point.texts))
    return f"{point.index:03d}_" + folder_name(parts)


@dataclass(frozen=True)
class SweepPlan:
    """A sweep's points, each validated: what runs, known before any output folder is made."""
    axes: list[Axis]
    points: list[Point]
    tasks: list[PointTask]
    zipped: bool


def plan_sweep(raw: dict, base_dir: Path, source: str, axes: list[Axis], zipped: bool = False,
               outputs: Optional[Path] = None, trace: bool = False, steps: str = "timeline",
               plots: bool = True) -> SweepPlan:
    if raw.get("variants"):
        raise SweepError(f"{source} has variants ({', '.join(raw['variants'])}); a sweep runs one "
                         f"scenario: sweep the field the variants change instead, or drop them "
                         f"with --set 'variants={{}}'")
    points = sweep_points(axes, zipped)
    return SweepPlan(axes, points, point_tasks(raw, base_dir, source, axes, points, outputs, trace, steps, plots),
                     zipped)


def run_sweep(raw: dict, base_dir: Path, source: str, axes: list[Axis], zipped: bool = False,
              jobs: int = 1, ray: Optional[str] = None, outputs: Optional[Path] = None,
              trace: bool = False, quiet: bool = False, steps: str = "timeline", plots: bool = True) -> Sweep:
    plan = plan_sweep(raw, base_dir, source, axes, zipped, outputs, trace, steps, plots)
    return run_planned_sweep(plan, jobs, ray, quiet, plots)


def run_planned_sweep(plan: SweepPlan, jobs: int = 1, ray: Optional[str] = None, quiet: bool = False,
                      plots: bool = True) -> Sweep:
    axes, points, tasks = plan.axes, plan.points, plan.tasks
    # imported and warmed once here, so forked workers inherit them, not make them each
    from sim.predict import warm_up
    warm_up(tasks[0].scenario())
    rows = parallel_map(run_point, tasks, jobs, ray, label=f"sweep ({len(points)} points)", quiet=quiet,
                        when_idle=lambda: ready_for_outputs(plots))
    return Sweep(axes, points, plan.zipped, sweep_frame(axes, points, rows))


def ready_for_outputs(plots: bool) -> None:
    """What the sweep's files need in this process (pandas for the frame; with `plots`, matplotlib
    and its font), loaded while the last points run and a core would otherwise be idle, instead of
    after them (~1 s of one core: docs/performance.md)."""
    import pandas  # noqa: F401
    if plots:
        from sim.output.workers import warm_up
        warm_up()


def sweep_frame(axes: Sequence[Axis], points: Sequence[Point], rows: Sequence[dict]) -> pd.DataFrame:
    """Swept fields first (scalars as parsed, collections as typed), then metrics, `error` last."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(k for k in row if k != "error"))
    if any("error" in row for row in rows):
        columns["error"] = None
    records = []
    for p, row in zip(points, rows):
        swept = {a.path: v if _is_scalar(v) else t for a, t, v in zip(axes, p.texts, p.values)}
        records.append({**swept, **{c: row.get(c) for c in columns}})
    return pd.DataFrame.from_records(records, columns=[a.path for a in axes] + list(columns))


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def base_raw(path: Path, overrides: Sequence[str], seed: Optional[int]) -> dict:
    """The scenario file as a mapping with the single-valued --set and --seed applied."""
    raw = apply_overrides(load_raw(path), list(overrides))
    if seed is not None:
        raw["seed"] = seed
    return raw


