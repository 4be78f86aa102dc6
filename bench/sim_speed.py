"""Simulator speed: event leaps vs the one-by-one path, side by side in one process.

  python bench/sim_speed.py [--vidur 100000] [--quick 10000 100000 1000000] [--sweep 10]
                            [--sweep-points 100] [--sweep-jobs 2] [--unchained 1000000] [--sliding 5000]
                            [--out bench/results/sim_speed.json]
  python bench/sim_speed.py --simrun vidur-100k [bench-1m-150 bench-1m-300] [--repeat 3] [--lean]
                            [--simrun-out bench/results/simrun_speed.json]
  python bench/sim_speed.py --sweep-only [--sweep-points 100] [--sweep-jobs 2] [--repeat 3]
                            [--sweep-baseline DIR] [--out bench/results/sim_speed.json]

Four workloads, each predicted by both paths of the same code in the same process, so a
change in the shared machine's load hits both (read the ratios, not the absolute seconds):
  vidur  scenarios/vidur_llama2_70b.yaml (Vidur's own comparison run: Llama-2-70B, A100, tp 2,
         prefill-first, Vidur's exact arrivals at 2 req/s). Vidur takes 146 s for it (quoted
         below, with its source); its predictions are printed next to kvtwin's.
  quick  scenarios/bench_sim_speed.yaml (the former quickstart: Qwen2.5-0.5B on an H100) at 300 req/s (~75% of the simulated H100's capacity, batch
         ~61 under async scheduling): CPU per request at each size (flat = linear cost) and the peak RSS of a fresh
         process per size. The one-by-one path runs only up to 100k. The 1M run once more
         with SimPy delivering every arrival and ending every step or leap (Simulation.chain
         off: by default a one-replica open-loop run runs ahead of SimPy's clock).
  sliding sliding-window models: scenarios/whatif_sliding_window.yaml (Mistral-7B-v0.1, a 4096
         window on every layer, 8-12k-token prompts) and gpt-oss-20b (alternate 128-token windows)
         on bench_sim_speed.yaml's ShareGPT-like traffic at 40 req/s: the fast path (the decode
         cohort; leaps only while nobody waits) against one by one, and each as full attention.
  sweep  points of 10k quickstart requests at different rates, run one after the other in
         this process, each phase timed (build, simulate, summary); the 100-point time is
         projected from them (2 cores: two at a time). Then the real thing, measured: a fresh
         process runs `simrun bench_sim_speed.yaml --set workload.num_requests=10000 --set
         workload.arrival.rate=100,125,..,325 --set seed=0,..,9 --jobs 2` (100 points, their
         CSV, plots and page written), its wall clock and the CPU of its main process
         (imports, validation, gathering, files) and of its workers (the points) apart.
With --sweep-only, the measured sweep alone, --repeat times (the run of median wall clock kept, every
run's figures beside it, the machine's `uptime` before and after each), optionally alternating with
another checkout's code (--sweep-baseline: a before/after at the same load); its row replaces
`sweep_measured` in --out and the other rows stay.
With --simrun (and nothing else run), the user's command instead: each case as a fresh
`python -m sim.cli SCENARIO --set ... --quiet` process with plots and with --no-plots, and once
with its progress bar drawn on a terminal (a pty), beside a fresh process that runs `simulate()`
alone on the same scenario; the CPU of each process tree (getrusage of the reaped children, the
figure processes included) and its peak RSS, medians of --repeat runs, each also as a ratio to
`simulate()` alone, and one in-process run timed phase by phase (simulate, predict's
summary and manifest, the data files, the plots drawn in one process).
Times are CPU seconds of the simulation proper (time.process_time around `simulate`);
building the workload and the summary are reported apart (a streamed workload's making, which
happens inside `simulate`, is measured on an identical stream read alone and taken off). A wall clock on a shared machine
counts other programs' load too: the sweep's CPU over its workers is quoted beside it.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._util import machine, write_json  # noqa: E402

# Vidur's figures for the same run, as measured with Vidur and quoted in the project's brief:
# Vidur 0.0.26 simulating this workload, and its predictions.
VIDUR_REFERENCE = {
    "source": "Vidur 0.0.26 (github.com/microsoft/vidur), measured on its Llama-2-70B / A100 / tp2 "
              "vLLM comparison workload: 100k requests, 512/128 tokens, Poisson 2 req/s; figures as quoted in the project brief)",
    "simulate_cpu_s_100k": 146.0,
    "ttft_p50_s": 0.25, "tpot_p50_s": 0.109, "e2e_p50_s": 14.2, "kv_blocks": 3328,
}
KVTWIN_BEFORE = {"ttft_p50_s": 0.254, "tpot_p50_s": 0.084, "e2e_p50_s": 11.0, "kv_blocks": 2750,
                 "simulate_cpu_s_100k": 138.0}


# workload label -> scenario file ("quickstart" is this benchmark's name for the light H100 load,
# kept in bench_sim_speed.yaml since scenarios/quickstart.yaml became a memory-bound L4 example)
SCENARIO_FILES = {"quickstart": "bench_sim_speed"}


# Sliding-window models: the decode cohort on a grouped KV cache, leaps only while nobody waits.
# (scenario file, label, overrides); each also run as full attention.
# absolute: a --set path resolves against the working folder (it used to be the scenario file's)
GPT_OSS = f"model={{hf_config: {ROOT / 'tests/data/hf_configs/openai__gpt-oss-20b.json'}}}"
SLIDING_WORKLOADS = (("whatif_sliding_window", "mistral-7b-v0.1, 8-12k-token prompts", ()),
                     ("bench_sim_speed", "gpt-oss-20b, ShareGPT-like at 40 req/s", (GPT_OSS, "workload.arrival.rate=40")))
AS_FULL_ATTENTION = ("model.sliding_window=null", "model.layer_types=null")


def _making_cpu_s(scenario) -> float:
    """CPU seconds to make a streamed workload's requests, read alone (a second, identical
    stream): timing each request inside the run instead would add two reads of the CPU clock
    (~0.6 us each here, a system call) per request to the run."""
    from sim.workload import stream_requests
    t = time.process_time()
    for _ in stream_requests(scenario).requests:
        pass
    return time.process_time() - t


def run_one(name: str, size: int, fast: bool, overrides: tuple = (), stream: bool = False) -> dict:
    """One prediction through the library path; CPU seconds by phase and the headline figures.
    `stream`: the workload made as the run reaches it (what `simulate(scenario)` and simrun do),
    its making still counted as build time (measured on an identical stream read alone, and
    taken off the run's time); else built whole first (and let go as it ends)."""
    from sim.metrics import summarise
    from sim.records import request_columns
    from sim.scenario import load_scenario
    from sim.simulator import simulate
    from sim.workload import build_requests, stream_requests

    scenario = load_scenario(ROOT / "scenarios" / f"{SCENARIO_FILES.get(name, name)}.yaml",
                             [f"workload.num_requests={size}", *overrides])
    making_s = _making_cpu_s(scenario) if stream else 0.0
    t0 = time.process_time()
    requests = stream_requests(scenario) if stream else build_requests(scenario)
    t1 = time.process_time()
    records, plan, _ = simulate(scenario, requests, fast=fast, release=True)   # each request let go once recorded
    t2 = time.process_time()
    # making the requests is building, wherever it happens (any cache misses it causes the run stay in the run)
    t1 += making_s
    summary = summarise(records, scenario.slo, request_columns(records))   # as predict does (no pandas)
    t3 = time.process_time()
    return {"scenario": name, "requests": size, "path": "leap" if fast else "one-by-one",
            "steps": summary["num_steps"], "build_cpu_s": round(t1 - t0, 3),
            "simulate_cpu_s": round(t2 - t1, 3), "summarise_cpu_s": round(t3 - t2, 3),
            "us_per_request": round((t2 - t1) / size * 1e6, 2),
            "ttft_p50_s": summary["ttft_s"]["p50"], "tpot_p50_s": summary["tpot_s"]["p50"],
            "e2e_p50_s": summary["e2e_s"]["p50"], "kv_blocks": summary["kv_blocks_total"],
            "mean_batch_seqs": round(summary["mean_batch_seqs"], 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def pair(name: str, size: int, overrides: tuple = ()) -> dict:
    """Leap and one-by-one on the same workload in this process, alternating which goes first."""
    leap, one = run_one(name, size, True, overrides), run_one(name, size, False, overrides)
    same = all(leap[k] == one[k] for k in ("steps", "ttft_p50_s", "tpot_p50_s", "e2e_p50_s"))
    return {"leap": leap, "one_by_one": one, "identical_predictions": same,
            "speedup": round(one["simulate_cpu_s"] / leap["simulate_cpu_s"], 2)}


def cost_vs_full_attention(sliding: dict, full: dict) -> dict:
    """The sliding-window run's simulate CPU over the same workload's as full attention (issue
    26's target: <= 1.5x per request). Per step too: full attention changes the predictions (the
    window no longer frees blocks), so the two runs need not take the same number of steps."""
    per_request = sliding["simulate_cpu_s"] / full["simulate_cpu_s"]
    return {"per_request": round(per_request, 2),
            "per_step": round(per_request * full["steps"] / sliding["steps"], 2)}


def child(size: int, chained: bool = True) -> dict:
    """A fresh process for one quickstart size (its max RSS is its own). `chained=False`: SimPy's
    arrival process delivers every request, with a SimPy event per step or leap (Simulation.chain
    off: a one-replica open-loop run otherwise runs ahead of SimPy's clock; the same predictions)."""
    argv = [sys.executable, __file__, "--child", str(size)] + ([] if chained else ["--unchained-child"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


SWEEP_RATES = tuple(range(100, 326, 25))        # req/s: light to ~80% of the simulated H100's capacity


def sweep_argv(points: int, jobs: int, requests: int, out: Path) -> list[str]:
    """`simrun` arguments of a sweep of `points` points: the ten rates, times points / 10 seeds
    (fewer than ten points: the first rates)."""
    seeds = max(1, points // len(SWEEP_RATES))
    rates = SWEEP_RATES[:points] if points < len(SWEEP_RATES) else SWEEP_RATES
    argv = [str(ROOT / "scenarios" / "bench_sim_speed.yaml"), "--set", f"workload.num_requests={requests}",
            "--set", "workload.arrival.rate=" + ",".join(map(str, rates))]
    if seeds > 1:
        argv += ["--set", "seed=" + ",".join(map(str, range(seeds)))]
    return argv + ["--jobs", str(jobs), "--quiet", "--out", str(out)]


def _cpu(who: int) -> float:
    use = resource.getrusage(who)
    return use.ru_utime + use.ru_stime


def sweep_child(points: int, jobs: int, requests: int, out: Path) -> dict:
    """In a fresh process: `simrun`'s own entry point on the sweep; the CPU of this process (the
    sweep's main process) and of its workers (reaped when the sweep ends) apart."""
    t0, self0, workers0 = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    from sim.cli import main as simrun

    code = simrun(sweep_argv(points, jobs, requests, out))
    wall = time.perf_counter() - t0
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {"exit_code": code, "points_written": len(rows),
            "points_failed": sum(1 for r in rows if r.get("error")),
            "wall_in_process_s": round(wall, 2),
            "main_process_cpu_s": round(_cpu(resource.RUSAGE_SELF) - self0, 2),
            "workers_cpu_s": round(_cpu(resource.RUSAGE_CHILDREN) - workers0, 2)}


def measured_sweep(points: int, jobs: int, requests: int = 10_000, tree: Path = ROOT) -> dict:
    """A real sweep in a fresh process (not forked from this one, which holds big runs); its
    wall clock from here, interpreter start-up included. `ideal_wall_s`: its main process's CPU
    plus its workers' CPU shared by `jobs` cores: what idle cores would take. `tree`: the
    checkout whose code runs it (its own bench/sim_speed.py's --sweep-child)."""
    with tempfile.TemporaryDirectory(prefix="sim_speed_sweep_") as tmp:
        load, uptime = os.getloadavg()[0], _uptime()
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, str(tree / "bench" / "sim_speed.py"), "--sweep-child", str(points),
                              str(jobs), str(requests), str(Path(tmp) / "sweep")],
                             capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"points": points, "jobs": jobs, "requests_per_point": requests,
            "command": "simrun " + " ".join(sweep_argv(points, jobs, requests, Path("OUT"))).replace(str(ROOT) + "/", ""),
            "wall_s": round(wall, 2), **row,
            "workers_cpu_s_per_point": round(row["workers_cpu_s"] / points, 3),
            "ideal_wall_s": round(row["main_process_cpu_s"] + row["workers_cpu_s"] / jobs, 1),
            "load_average_before": round(load, 2), "load_average_after": round(os.getloadavg()[0], 2),
            "uptime_before": uptime, "uptime_after": _uptime()}


def sweep_only_main(points: int, jobs: int, repeat: int, out: str, baseline: Optional[Path]) -> None:
    """--sweep-only: the measured sweep `repeat` times (with `baseline`, that checkout's code too,
    the two alternating: the same machine and load for both), the run of median wall clock as
    `sweep_measured` (and `sweep_measured_baseline`) in `out`, whose other rows are kept."""
    trees = {"sweep_measured": ROOT, **({"sweep_measured_baseline": baseline} if baseline else {})}
    for tree in trees.values():
        compile_bytecode(tree)
    try:
        result = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        result = {"bench": "sim_speed", "machine": machine()}
    runs: dict[str, list[dict]] = {key: [] for key in trees}
    for _ in range(repeat):
        for key, tree in trees.items():
            runs[key].append(measured_sweep(points, jobs, tree=tree))
            r = runs[key][-1]
            print(f"{key} ({tree}): {r['wall_s']} s wall, ideal {r['ideal_wall_s']} s, main process "
                  f"{r['main_process_cpu_s']} s CPU, workers {r['workers_cpu_s']} s; {r['uptime_before']}", flush=True)
            result[key] = median_run(runs[key]) | {"tree_commit": _commit(tree), "measured_at": machine()["when"]}
            write_json(out, result)          # after each run: a long run keeps what it measured


def median_run(runs: list[dict]) -> dict:
    """The run of median wall clock, with every run's wall and ideal wall beside it."""
    middle = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]
    return {**middle, "runs": len(runs), "runs_wall_s": [r["wall_s"] for r in runs],
            "runs_ideal_wall_s": [r["ideal_wall_s"] for r in runs],
            "runs_main_process_cpu_s": [r["main_process_cpu_s"] for r in runs]}


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "not a git checkout"


# ----------------------------------------------------------------------------- the user's command

# case -> (scenario file, overrides): what `simrun` is timed on
SIMRUN_CASES = {
    "vidur-100k": ("vidur_llama2_70b", ("workload.num_requests=100000",)),
    "bench-1m-150": ("bench_sim_speed", ("workload.num_requests=1000000",)),          # its own 150 req/s
    "bench-1m-300": ("bench_sim_speed", ("workload.num_requests=1000000", "workload.arrival.rate=300")),
    "bench-100k-150": ("bench_sim_speed", ("workload.num_requests=100000",)),
}


def simrun_argv(case: str, out: str, plots: bool, quiet: bool = True) -> list[str]:
    name, overrides = SIMRUN_CASES[case]
    argv = ["-m", "sim.cli", f"scenarios/{name}.yaml"]
    for o in overrides:
        argv += ["--set", o]
    return argv + ([] if plots else ["--no-plots"]) + (["--quiet"] if quiet else []) + ["--out", out]


def measure_tree(argv: list[str], pty: bool = False) -> dict:
    """Run `python ARGV` from a fresh measuring process: the CPU (user + system) of the whole
    process tree, its biggest process's peak RSS, and the wall clock. `pty`: its output on a
    terminal (so the progress bar is drawn), read and dropped here."""
    out = subprocess.run([sys.executable, __file__, "--measure-tree", json.dumps(argv), "1" if pty else "0"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_tree_child(argv: list[str], pty: bool) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, *argv]
    if pty:
        import pty as ptys

        master, slave = ptys.openpty()
        proc = subprocess.Popen(cmd, stdout=slave, stderr=slave, cwd=ROOT)
        os.close(slave)
        while True:
            try:
                if not os.read(master, 65536):
                    break
            except OSError:                 # EIO: the child closed the terminal
                break
        code = proc.wait()
        os.close(master)
    else:
        code = subprocess.run(cmd, stdout=subprocess.DEVNULL, cwd=ROOT).returncode
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"exit_code": code, "cpu_s": round(use.ru_utime + use.ru_stime, 2),
            "peak_rss_mb": round(use.ru_maxrss / 1024, 1), "wall_s": round(time.perf_counter() - t0, 2)}


def simulate_only_child(case: str) -> dict:
    """simulate() alone on the case's scenario, its workload streamed as simrun's is."""
    name, overrides = SIMRUN_CASES[case]
    size = int(next(o for o in overrides if o.startswith("workload.num_requests=")).split("=")[1])
    rest = tuple(o for o in overrides if not o.startswith("workload.num_requests="))
    return run_one(name, size, True, rest, stream=True)


def phases_child(case: str, out: str) -> dict:
    """One `simrun` run in this process, phase by phase (CPU seconds): predict (simulate, the
    summary and the manifest; the summary timed again apart), the data files (steps.csv as
    simrun writes it by default), the plots and report.html drawn here, one process."""
    from sim.output.run_files import write_data_files, write_reports
    from sim.output.workers import figure_process_start
    from sim.predict import predict
    from sim.scenario import load_scenario

    name, overrides = SIMRUN_CASES[case]
    scenario = load_scenario(ROOT / "scenarios" / f"{name}.yaml", list(overrides))
    t0 = time.process_time()
    result = predict(scenario, name)
    t1 = time.process_time()
    summary_s = _summary_cpu_s(result)           # (made a second time, to time it apart)
    t2 = time.process_time()
    write_data_files(result, Path(out))
    t3 = time.process_time()
    figure_process_start()                       # (simrun's figure process does this while simulating)
    t4 = time.process_time()
    write_reports({name: result}, Path(out), plots=True, workers=None)
    t5 = time.process_time()
    sizes = {f.name: f.stat().st_size for f in Path(out).iterdir() if f.suffix in (".csv", ".json")}
    return {"predict_cpu_s": round(t1 - t0, 2), "simulate_wall_s": round(result.records.meta.get("wall_s", 0), 2),
            "of_which_summary_cpu_s": round(summary_s, 2),
            "data_files_cpu_s": round(t3 - t2, 2), "matplotlib_import_and_warm_up_cpu_s": round(t4 - t3, 2),
            "plots_and_page_cpu_s": round(t5 - t4, 2), "file_bytes": sizes,
            "steps_rows": int(sum(r.num_rows for r in result.records.recorders)),
            "steps": int(sum(len(r) for r in result.records.recorders))}


def _summary_cpu_s(result) -> float:
    """CPU seconds of predict's summary (the request columns and summarise), made again."""
    from sim.metrics import summarise
    from sim.records import request_columns

    t = time.process_time()
    summarise(result.records, result.scenario.slo, request_columns(result.records))
    return time.process_time() - t


def _in_fresh_process(flag: str, *values: str) -> dict:
    out = subprocess.run([sys.executable, __file__, flag, *values], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    return round(sorted(values)[len(values) // 2], 2)


def simrun_case(case: str, repeat: int, lean: bool = False) -> dict:
    """The user's command on `case`, plots on and off, beside simulate() alone; medians of `repeat`
    (runs interleaved, so a change in the machine's load hits each kind alike). Unless `lean`, once
    more on a terminal (the progress display) and phase by phase in one process."""
    runs: dict[str, list[dict]] = {"simulate_only": [], "no_plots": [], "plots": []}
    with tempfile.TemporaryDirectory(prefix="simrun_speed_") as tmp:
        for _ in range(repeat):
            runs["simulate_only"].append(_in_fresh_process("--simulate-only-child", case))
            runs["no_plots"].append(measure_tree(simrun_argv(case, f"{tmp}/a", plots=False)))
            runs["plots"].append(measure_tree(simrun_argv(case, f"{tmp}/b", plots=True)))
        if not lean:
            progress = measure_tree(simrun_argv(case, f"{tmp}/c", plots=False, quiet=False), pty=True)
            phases = _in_fresh_process("--phases-child", case, f"{tmp}/d")
    simulate_s = _median([r["simulate_cpu_s"] for r in runs["simulate_only"]])
    row = {"case": case, "scenario": SIMRUN_CASES[case][0], "overrides": list(SIMRUN_CASES[case][1]),
           "repeat": repeat, "simulate_only_cpu_s": simulate_s,
           "simulate_only_peak_rss_mb": _median([r["peak_rss_mb"] for r in runs["simulate_only"]])}
    for kind in ("no_plots", "plots"):
        cpu = _median([r["cpu_s"] for r in runs[kind]])
        row[kind] = {"command": "python " + " ".join(simrun_argv(case, "OUT", plots=kind == "plots")),
                     "cpu_s": cpu, "ratio_to_simulate": round(cpu / simulate_s, 2),
                     "peak_rss_mb": _median([r["peak_rss_mb"] for r in runs[kind]]),
                     "wall_s": _median([r["wall_s"] for r in runs[kind]]),
                     "runs_cpu_s": [r["cpu_s"] for r in runs[kind]],
                     "exit_codes": sorted({r["exit_code"] for r in runs[kind]})}
    row["simulate_only_runs_cpu_s"] = [r["simulate_cpu_s"] for r in runs["simulate_only"]]
    if not lean:
        row["progress_on_a_terminal"] = {
            "command": "python " + " ".join(simrun_argv(case, "OUT", plots=False, quiet=False)), **progress,
            "over_quiet": round(progress["cpu_s"] / row["no_plots"]["cpu_s"] - 1, 3)}
        row["phases_in_one_process"] = phases
    return row


def simrun_main(cases: list[str], repeat: int, out: str, lean: bool = False) -> None:
    """Measure each case and write `out`: a case measured here replaces its row, the rows of other
    cases (measured by an earlier invocation: a million requests take minutes) are kept. Each row
    carries the machine's `uptime` before and after it."""
    compile_bytecode()
    result = {"bench": "simrun_speed", "machine": machine(),
              "load_note": "CPU seconds of each process tree; the machine is shared, so read each figure "
                           "beside simulate() alone measured in the same run (ratio_to_simulate)",
              "vidur_reference": VIDUR_REFERENCE, "cases": _earlier_rows(out, cases)}
    for case in cases:
        before = _uptime()
        row = simrun_case(case, repeat, lean)
        row["uptime_before"], row["uptime_after"] = before, _uptime()
        result["cases"].append(row)
        extras = "" if lean else (f"; progress bar +{100 * row['progress_on_a_terminal']['over_quiet']:.1f}%; "
                                  f"phases {row['phases_in_one_process']}")
        print(f"{case}: simulate() alone {row['simulate_only_cpu_s']} s CPU; simrun --no-plots "
              f"{row['no_plots']['cpu_s']} s ({row['no_plots']['ratio_to_simulate']}x, "
              f"{row['no_plots']['peak_rss_mb']} MB), with plots {row['plots']['cpu_s']} s "
              f"({row['plots']['ratio_to_simulate']}x, {row['plots']['peak_rss_mb']} MB){extras}", flush=True)
        write_json(out, result)               # after each case: a long run keeps what it measured


def compile_bytecode(tree: Path = ROOT) -> None:
    """Write this tree's bytecode (__pycache__, git-ignored) before timing, as an installed package
    has it: with PYTHONDONTWRITEBYTECODE set (this project's VMs set it) every fresh simrun process
    would otherwise compile ~100 of kvtwin's modules from source, ~0.8 G instructions (~0.25 s CPU)
    that a user's command never spends and that `simulate()` alone, timed without its start-up,
    does not count (docs/performance.md)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "sim", "validate", "engine"], cwd=tree,
                   stdout=subprocess.DEVNULL, check=True)


def _earlier_rows(out: str, cases: list[str]) -> list[dict]:
    """The rows of `out` for cases not measured now."""
    try:
        earlier = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        return []
    return [row for row in earlier.get("cases", []) if row.get("case") not in cases]


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average {os.getloadavg()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vidur", type=int, default=100_000, help="requests of the Vidur workload (0: skip)")
    ap.add_argument("--quick", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--pair-up-to", type=int, default=100_000,
                    help="run the one-by-one path beside the leap path up to this size")
    ap.add_argument("--sweep", type=int, default=10,
                    help="sweep points of 10k requests to time one by one in this process (0: skip)")
    ap.add_argument("--sweep-points", type=int, default=100,
                    help="points of the measured `simrun` sweep, 10k requests each (0: skip; above ten, "
                         "a multiple of ten: ten rates times points/10 seeds)")
    ap.add_argument("--sweep-jobs", type=int, default=2, help="worker processes of the measured sweep")
    ap.add_argument("--sweep-only", action="store_true",
                    help="measure only the `simrun` sweep (--sweep-points, --sweep-jobs), --repeat times, and "
                         "replace its row in --out, keeping the others (nothing else runs)")
    ap.add_argument("--sweep-baseline", type=Path, metavar="DIR",
                    help="--sweep-only: also time the sweep with the checkout at DIR, alternating with this "
                         "one (its row: sweep_measured_baseline)")
    ap.add_argument("--unchained", type=int, default=1_000_000,
                    help="quick requests to run once more with every arrival and step through SimPy's "
                         "events (Simulation.chain off; 0: skip)")
    ap.add_argument("--sliding", type=int, default=5000,
                    help="requests of each sliding-window workload (Mistral v0.1 with long prompts, gpt-oss-20b "
                         "chat): the fast path vs one by one, and each as full attention (0: skip)")
    ap.add_argument("--out", default="bench/results/sim_speed.json")
    ap.add_argument("--simrun", nargs="+", choices=sorted(SIMRUN_CASES),
                    help="time the user's command on these cases instead (nothing else runs)")
    ap.add_argument("--repeat", type=int, default=3, help="--simrun, --sweep-only: runs of each kind (medians)")
    ap.add_argument("--simrun-out", default="bench/results/simrun_speed.json")
    ap.add_argument("--lean", action="store_true",
                    help="--simrun: only simulate() alone and the command with and without plots (no "
                         "progress-bar run, no phase-by-phase run): for the million-request cases")
    ap.add_argument("--measure-tree", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--simulate-only-child", help=argparse.SUPPRESS)
    ap.add_argument("--phases-child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sweep-child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--unchained-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_tree:
        print(json.dumps(measure_tree_child(json.loads(args.measure_tree[0]), args.measure_tree[1] == "1")))
        return
    if args.simulate_only_child:
        print(json.dumps(simulate_only_child(args.simulate_only_child)))
        return
    if args.phases_child:
        print(json.dumps(phases_child(*args.phases_child)))
        return
    if args.simrun:
        simrun_main(args.simrun, args.repeat, args.simrun_out, args.lean)
        return
    if args.sweep_child:
        points, jobs, requests, out = args.sweep_child
        print(json.dumps(sweep_child(int(points), int(jobs), int(requests), Path(out))))
        return
    if args.sweep_points > len(SWEEP_RATES) and args.sweep_points % len(SWEEP_RATES):
        ap.error(f"--sweep-points {args.sweep_points}: above {len(SWEEP_RATES)}, a multiple of {len(SWEEP_RATES)}")
    if args.sweep_only:
        sweep_only_main(args.sweep_points, args.sweep_jobs, args.repeat, args.out, args.sweep_baseline)
        return
    quick = ("workload.arrival.rate=300",)
    if args.child:
        if args.unchained_child:
            from sim.simulator import Simulation
            Simulation.chain = False
        print(json.dumps(run_one("quickstart", args.child, True, quick, stream=True)))
        return
    result: dict = {"bench": "sim_speed", "machine": machine(),
                    "load_average_at_start": round(os.getloadavg()[0], 2),
                    "load_note": "other programs on the machine inflate the absolute seconds; compare the "
                                 "paths by their ratio, measured in one process",
                    "vidur_reference": VIDUR_REFERENCE, "kvtwin_before": KVTWIN_BEFORE}
    # Fresh processes first: a child forked from this process once it holds big runs would count
    # the parent's pages in its peak RSS. A warm-up child before them, discarded: on this VM the
    # first second of work after an idle spell runs ~1.5x slower (CPU time, not wall: measured
    # 101 us/request for 10k requests after 25 s idle, then 63-64), which hit the 10k figure only.
    if args.quick:
        result["warm_up_child_us_per_request"] = child(min(args.quick))["us_per_request"]
    fresh = {size: child(size) for size in args.quick}
    unchained = child(args.unchained, chained=False) if args.unchained else None
    if args.vidur:
        v = pair("vidur_llama2_70b", args.vidur)
        result["vidur"] = v
        leap = v["leap"]
        print(f"vidur {args.vidur}: leap {leap['simulate_cpu_s']} s CPU, one-by-one "
              f"{v['one_by_one']['simulate_cpu_s']} s ({v['speedup']}x), identical: {v['identical_predictions']}; "
              f"Vidur {VIDUR_REFERENCE['simulate_cpu_s_100k']} s per 100k", flush=True)
        for key in ("ttft_p50_s", "tpot_p50_s", "e2e_p50_s", "kv_blocks"):
            print(f"  {key:12} kvtwin {leap[key]:>10.4g}   Vidur {VIDUR_REFERENCE[key]:>8}")
    rows = []
    for size in args.quick:
        row = {"fresh_process": fresh[size]}
        if size <= args.pair_up_to:
            row.update(pair("quickstart", size, quick))
        rows.append(row)
        own = row["fresh_process"]
        line = (f"quickstart {size:>8}: leap {own['simulate_cpu_s']:7.2f} s CPU "
                f"({own['us_per_request']} us/request, {own['steps']} steps, batch {own['mean_batch_seqs']}), "
                f"peak RSS {own['peak_rss_mb']} MB")
        if "speedup" in row:
            line += f"; one-by-one {row['one_by_one']['simulate_cpu_s']} s in the same process ({row['speedup']}x)"
        print(line, flush=True)
    result["quickstart"] = rows
    if unchained is not None:
        result["quickstart_unchained"] = unchained
        same = fresh.get(args.unchained)
        ratio = f" ({unchained['simulate_cpu_s'] / same['simulate_cpu_s']:.2f}x the chained run)" if same else ""
        print(f"quickstart {args.unchained:>8}, every arrival and step a SimPy event: leap "
              f"{unchained['simulate_cpu_s']:7.2f} s CPU{ratio}, identical: "
              f"{bool(same) and all(unchained[k] == same[k] for k in ('steps', 'ttft_p50_s', 'e2e_p50_s'))}", flush=True)
    if args.sliding:
        result["sliding_window"] = {}
        for name, label, overrides in SLIDING_WORKLOADS:
            w = result["sliding_window"][label] = pair(name, args.sliding, overrides)
            full = w["as_full_attention"] = run_one(name, args.sliding, True, (*overrides, *AS_FULL_ATTENTION))
            ratio = w["cost_vs_full_attention"] = cost_vs_full_attention(w["leap"], full)
            print(f"{label} {args.sliding}: fast path {w['leap']['simulate_cpu_s']} s CPU, one-by-one "
                  f"{w['one_by_one']['simulate_cpu_s']} s ({w['speedup']}x), identical: {w['identical_predictions']}; "
                  f"as full attention {full['simulate_cpu_s']} s: {ratio['per_request']}x per request, "
                  f"{ratio['per_step']}x per step", flush=True)
    if args.sweep:
        t0 = time.process_time()
        points = [run_one("quickstart", 10_000, True, (f"workload.arrival.rate={SWEEP_RATES[i % 10]}",), stream=True)
                  for i in range(args.sweep)]
        per_point = (time.process_time() - t0) / args.sweep
        phases = {f"{phase}_cpu_s_per_point": round(sum(p[f"{phase}_cpu_s"] for p in points) / args.sweep, 3)
                  for phase in ("build", "simulate", "summarise")}
        result["sweep"] = {"points_timed": args.sweep, "cpu_s_per_point": round(per_point, 3), **phases,
                           "projected_100_points_on_2_cores_s": round(per_point * 100 / 2, 1)}
        print(f"sweep: {per_point:.2f} s CPU per 10k-request point (simulate {phases['simulate_cpu_s_per_point']}, "
              f"workload {phases['build_cpu_s_per_point']}, summary {phases['summarise_cpu_s_per_point']}); "
              f"100 points on 2 cores ~ {per_point * 50:.0f} s", flush=True)
    if args.sweep_points:
        m = result["sweep_measured"] = measured_sweep(args.sweep_points, args.sweep_jobs)
        print(f"sweep measured: {m['points']} points of 10k requests on {m['jobs']} processes in {m['wall_s']} s "
              f"wall (load average {m['load_average_before']} before); workers {m['workers_cpu_s']} s CPU "
              f"({m['workers_cpu_s_per_point']} s per point), main process {m['main_process_cpu_s']} s CPU: "
              f"{m['ideal_wall_s']} s on {m['jobs']} idle cores")
    result["targets"] = {"vidur_100k_cpu_s": 7, "quickstart_1m_s": 60, "quickstart_1m_rss_mb": 2048,
                         "sweep_100x10k_s": 60}
    result["load_average_at_end"] = round(os.getloadavg()[0], 2)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
