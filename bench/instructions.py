"""Instructions per bench line: the simulator's cost where a shared machine's load cannot blur it.

  python bench/instructions.py [--tree LABEL=DIR ...] [--lines vidur-leap ...]
                               [--out bench/results/instructions.json]

On a loaded 2-core VM a CPU-time A/B moves by 10-60 % from run to run, so it cannot tell a 5 %
change apart (docs/performance.md). The number of instructions a run executes does not depend on
the load: each line's `simulate()` runs under valgrind (cachegrind, no cache simulation,
`PYTHONHASHSEED=0` so set and dict orders repeat), once in full and once stopping after the
workload is built, and the difference is the simulation's own count. Each `--tree` is a checkout
of this project (default: this one), run with its own code (the driver runs with the tree as its
working directory, which comes first on `sys.path`); the first tree is the baseline the ratios
are taken against. Sizes are small (valgrind runs ~50x slower), so fixed per-run costs weigh more
than in `bench/sim_speed.py`. Needs `valgrind` on PATH.

Two lines count the user's path instead, on vidur-leap's scenario and size, against the same
build-only run: `vidur-predict` (`sim.predict.predict`, which makes its workload as a stream and
describes it for the manifest, then summarises) and `vidur-simrun` (simrun's entry point with
`--no-plots --quiet`: also its imports and the data files). Their excess over vidur-leap is what
that path adds to `simulate()` alone (issue 26's simrun ratio); each tree's bytecode is written
first, as an installed package has it. At 3000 requests fixed costs (imports) weigh heavily.
`vidur-simrun-plots` is simrun with its plots and report.html drawn in its own process
(KVTWIN_PLOT_WORKERS=0): the plots' work, not the time the user waits. Not with figure processes:
valgrind's count in a forked process starts from its parent's count at the fork (a child that
does nothing reports ~98 % of its parent's), so summing the processes' counts counts the parent's
work before each fork again. Until 7 December this line ran each tree's default figure processes
and summed them, so its figures then (12,280M with two, 9,503M with one) over-count by about the
parent's count at each fork and are not comparable; a tree without KVTWIN_PLOT_WORKERS (before
7 December) still forks, and its count here is inflated the same way.
`vidur-simrun-terminal` is `vidur-simrun` without `--quiet`, its stdout and stderr on a
pseudo-terminal (drained by a thread, as a terminal reads it): its excess over
`vidur-simrun` is what the progress bar, the status lines and the results table cost (issue 26's
progress-display target), a fixed cost beside a run that grows with its requests.
`sweep-task` is one sweep point as a worker process runs it (`sim.whatif.sweep.run_point`: the
point's scenario validated from the raw mapping, `predict` without a manifest, which makes the
workload as a stream, simulates and summarises, the row flattened; the task and the row pickled as
the process pool sends them), on sweep-point's scenario and size: its set-up run also makes the
sweep's task, warms up as `run_sweep` does before its workers fork, and runs one small point at
another seed (a worker's first-use work, made once for its ~50 points), so its excess over
sweep-point is what a point adds to `simulate()` alone. The worker's page faults (its memory
between points, sim.whatif.parallel.keep_freed_memory) are kernel work, which no count here sees.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._util import machine, write_json  # noqa: E402

# absolute: a --set path resolves against the working folder (it used to be the scenario file's)
GPT_OSS = f"model={{hf_config: {ROOT / 'tests/data/hf_configs/openai__gpt-oss-20b.json'}}}"
AS_FULL_ATTENTION = ("model.sliding_window=null", "model.layer_types=null")

# line -> (scenario file, requests, fast path?, overrides): the lines of bench/sim_speed.py, smaller
LINES = {
    "vidur-leap": ("vidur_llama2_70b", 3000, True, ()),
    "vidur-one-by-one": ("vidur_llama2_70b", 1000, False, ()),
    "bench-leap": ("bench_sim_speed", 3000, True, ("workload.arrival.rate=300",)),
    "bench-one-by-one": ("bench_sim_speed", 1000, False, ("workload.arrival.rate=300",)),
    "sweep-point": ("bench_sim_speed", 3000, True, ("workload.arrival.rate=200",)),
    # one sweep point as a worker runs it (sim.whatif.sweep.run_point), beside sweep-point's simulate()
    "sweep-task": ("bench_sim_speed", 3000, True, ("workload.arrival.rate=200",)),
    "bench-150": ("bench_sim_speed", 3000, True, ()),       # its own 150 req/s: arrivals cut most leaps
    "mistral-sliding": ("whatif_sliding_window", 200, True, ()),
    "gpt-oss-sliding": ("bench_sim_speed", 500, True, (GPT_OSS, "workload.arrival.rate=40")),
    "gpt-oss-full": ("bench_sim_speed", 500, True, (GPT_OSS, "workload.arrival.rate=40", *AS_FULL_ATTENTION)),
    # The user's path on vidur-leap's scenario and size, beside simulate() alone: the same set-up
    # run subtracted, so each line's excess over vidur-leap is what the path adds to the simulation
    # (making the streamed workload, the manifest's watcher, the summary; for simrun also its own
    # imports and the data files of `--no-plots --quiet`).
    "vidur-predict": ("vidur_llama2_70b", 3000, True, ()),
    "vidur-simrun": ("vidur_llama2_70b", 3000, True, ()),
    "vidur-simrun-plots": ("vidur_llama2_70b", 3000, True, ()),     # the plots drawn in-process
    "vidur-simrun-terminal": ("vidur_llama2_70b", 3000, True, ()),  # vidur-simrun on a terminal
    # predict() on bench-150's scenario and size (issue 26's 1M case: sampled lengths, shared
    # prefixes): its excess over bench-150 is what predict adds there
    "bench-predict": ("bench_sim_speed", 3000, True, ()),
}
# line -> the entry point its full run calls (the others: simulate() on the built workload)
ENTRY = {"vidur-predict": "predict", "bench-predict": "predict", "vidur-simrun": "simrun",
         "vidur-simrun-plots": "simrun-plots",
         "vidur-simrun-terminal": "simrun-terminal", "sweep-task": "sweep-task"}
# lines whose set-up run does more than the common one (the DRIVER's `sweep-task` set-up)
OWN_SET_UP = {"sweep-task"}

# Run inside the measured tree: load the scenario, build the workload whole and a cost model (what a
# process sets up once: trees from 6a78cb1 on generate the cost model's scalar forms on first use),
# then simulate it unless told to stop there. Only public entry points every tree has. The user's
# lines (ENTRY) run after the same set-up: `predict(scenario)`, which makes its own streamed
# workload, or simrun's entry point (`sim.cli.main`) with --quiet (and --no-plots: "simrun") into a
# scratch folder.
DRIVER = """
import sys
from sim.costmodel import CostModel
from sim.scenario import load_scenario
from sim.simulator import simulate
from sim.workload import build_requests
path, size, fast, build_only, entry, *overrides = sys.argv[1:]
scenario = load_scenario(path, [f"workload.num_requests={size}", *overrides])
requests = build_requests(scenario)
CostModel.for_scenario(scenario)    # a process's one-off set-up (the cost model's generated forms) in both runs
if entry == "sweep-task":
    # a worker's state when a point reaches it: the sweep's tasks made, sim.predict.warm_up before
    # the fork, and a first point run (a small one at another seed: what a worker makes on first
    # use is made once for its ~50 points), in both runs; the full run adds one point's task, its
    # pickled trip to the worker and its row's back
    import pickle
    from pathlib import Path
    from sim.predict import warm_up
    from sim.scenario import parse_override
    from sim.whatif.sweep import PointTask, base_raw, run_point
    del requests
    raw = base_raw(Path(path), [f"workload.num_requests={size}"], None)
    settings = tuple((".".join(keys), value) for keys, value in map(parse_override, overrides))
    task = PointTask(raw, str(Path(path).parent), path, settings, label="point")
    warm_up(task.scenario())
    run_point(PointTask(raw, task.base_dir, path, settings + (("seed", 1), ("workload.num_requests", 50)), "warm"))
if build_only == "1":
    pass
elif entry == "simulate":
    records, _, _ = simulate(scenario, requests, fast=fast == "1", release=True)
elif entry == "sweep-task":
    pickle.dumps(run_point(pickle.loads(pickle.dumps(task))))
elif entry == "predict":
    from sim.predict import predict
    del requests
    predict(scenario)
else:
    import tempfile
    del requests
    if entry == "simrun-terminal":      # stdout and stderr on a pseudo-terminal, read by a thread
        import os, pty, threading
        master, slave = pty.openpty()
        def drain():                    # what a terminal does: read, so writes never block
            while os.read(master, 65536):
                pass
        threading.Thread(target=drain, daemon=True).start()
        sys.stdout = sys.stderr = open(slave, "w", buffering=1)
    from sim.cli import main
    sets = [a for o in ["workload.num_requests=" + size, *overrides] for a in ("--set", o)]
    with tempfile.TemporaryDirectory() as out:
        plots = [] if entry == "simrun-plots" else ["--no-plots"]
        quiet = [] if entry == "simrun-terminal" else ["--quiet"]
        code = main([path, *sets, *plots, *quiet, "--out", out + "/run"])
    if code != 0:
        raise SystemExit(f"simrun exited {code}")
"""


# Hash seeds fixed (set and dict orders repeat) and one thread per library: an idle BLAS or OpenMP
# worker spins while waiting, and valgrind counts a spinning thread's instructions by its luck.
# The figures are drawn in the measured process (no figure process: see vidur-simrun-plots).
QUIET_ENV = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
             "KVTWIN_PLOT_WORKERS": "0"}


def count(tree: Path, line: str, build_only: bool) -> int:
    """Instructions of one driver run in `tree` (valgrind's `I refs`)."""
    name, size, fast, overrides = LINES[line]
    argv = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
            sys.executable, "-c", DRIVER, str(tree / "scenarios" / f"{name}.yaml"), str(size),
            "1" if fast else "0", "1" if build_only else "0", ENTRY.get(line, "simulate"), *overrides]
    out = subprocess.run(argv, cwd=tree, capture_output=True, text=True,
                         env={**os.environ, **QUIET_ENV})
    # one count per process: a tree that still forks figure processes reports each, summed here
    # (over-counted: a forked process's count starts from its parent's at the fork)
    found = re.findall(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if out.returncode != 0 or not found:
        raise SystemExit(f"{tree} {line}: the run failed:\n{out.stderr[-2000:]}")
    return sum(int(n.replace(",", "")) for n in found)


_set_up_counts: dict[tuple, int] = {}


def set_up_count(tree: Path, line: str) -> int:
    """The build-only run's count, shared by the lines whose set-up is the same (vidur-leap and
    the user's lines on its scenario)."""
    name, size, _, overrides = LINES[line]
    key = (tree, name, size, overrides, line if line in OWN_SET_UP else None)
    if key not in _set_up_counts:
        _set_up_counts[key] = count(tree, line, build_only=True)
    return _set_up_counts[key]


def simulation_count(tree: Path, line: str) -> int:
    return count(tree, line, build_only=False) - set_up_count(tree, line)


def compile_bytecode(tree: Path) -> None:
    """Write the tree's bytecode (__pycache__, git-ignored) first, as an installed package has it:
    with PYTHONDONTWRITEBYTECODE set (this project's VMs set it) the user's lines would count the
    compiling of every module simrun imports beyond the set-up run's (bench/sim_speed.py does the same)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "sim", "validate", "engine"], cwd=tree,
                   stdout=subprocess.DEVNULL, check=True)


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "not a git checkout"


def _tree(arg: str) -> tuple[str, Path]:
    label, sep, path = arg.partition("=")
    if not sep or not Path(path, "sim").is_dir():
        raise argparse.ArgumentTypeError(f"--tree wants LABEL=DIR with DIR a kvtwin checkout, got {arg!r}")
    return label, Path(path).resolve()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=_tree, action="append",
                    help="LABEL=DIR, a checkout to measure (repeatable; the first is the baseline; default: this one)")
    ap.add_argument("--lines", nargs="+", choices=list(LINES), default=list(LINES))
    ap.add_argument("--out", default="bench/results/instructions.json")
    args = ap.parse_args()
    trees = args.tree or [("this", ROOT)]
    rows = []
    if any(line in ENTRY for line in args.lines):
        for _, tree in trees:
            compile_bytecode(tree)
    for line in args.lines:
        counts = {label: simulation_count(tree, line) for label, tree in trees}
        base = counts[trees[0][0]]
        row = {"line": line, "requests": LINES[line][1],
               "million_instructions": {k: round(v / 1e6, 1) for k, v in counts.items()},
               "ratio_to_" + trees[0][0]: {k: round(v / base, 3) for k, v in counts.items()}}
        rows.append(row)
        print(line, "  ".join(f"{k} {v / 1e6:,.0f}M ({v / base:.3f})" for k, v in counts.items()), flush=True)
    write_json(Path(args.out), {"machine": machine(), "method": __doc__.split("\n\n")[2],
                                "trees": {label: {"path": str(tree), "commit": _commit(tree)} for label, tree in trees},
                                "lines": rows})


if __name__ == "__main__":
    main()
