"""Simulator speed: wall time, requests/s and steps/s for 1k / 10k / 100k Poisson requests.

  python bench/sim_speed.py [--sizes 1000 10000 100000] [--out bench/results/sim_speed.json]

The scenario is scenarios/bench_sim_speed.yaml (Qwen2.5-0.5B on an H100, ShareGPT-like
lengths, prefix caching) at 300 requests/s, about 75% of the ~390 req/s the simulated
engine saturates at, so it is in the same busy steady state (batch ~120) at every size
and the cost should grow linearly with the request count. (At a light load the simulator
takes many small steps per request: steps/s is the figure to read there.)
Each size runs in a fresh subprocess so its peak memory (max RSS) is its own.
Targets (issue 3): 100k requests in under 15 s and 1.5 GB on the reference machine.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._util import machine, write_json  # noqa: E402


def measure(size: int, rate: float) -> dict:
    """Runs in the child process: one prediction through the library's own path, timed by phase."""
    from sim.metrics import summarise
    from sim.records import requests_frame
    from sim.scenario import load_scenario
    from sim.simulator import simulate
    from sim.workload import build_requests

    scenario = load_scenario(ROOT / "scenarios" / "bench_sim_speed.yaml",
                             [f"workload.num_requests={size}", f"workload.arrival.rate={rate}"])
    t0 = time.perf_counter()
    requests = build_requests(scenario)
    t1 = time.perf_counter()
    records, _, _ = simulate(scenario, requests)
    t2 = time.perf_counter()
    summary = summarise(records, scenario.slo, requests_frame(records))
    t3 = time.perf_counter()
    steps = summary["num_steps"]
    return {"requests": size, "rate": rate, "steps": steps,
            "build_s": round(t1 - t0, 3), "simulate_s": round(t2 - t1, 3), "summarise_s": round(t3 - t2, 3),
            "total_s": round(t3 - t0, 3),
            "requests_per_s": round(size / (t3 - t0), 1), "steps_per_s": round(steps / (t2 - t1), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "mean_batch_seqs": round(summary["mean_batch_seqs"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--rate", type=float, default=300.0,
                    help="Poisson arrival rate (requests/s); 300 keeps the simulated H100 ~75%% busy")
    ap.add_argument("--out", default="bench/results/sim_speed.json")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.rate)))
        return
    rows = []
    for size in args.sizes:
        out = subprocess.run([sys.executable, __file__, "--child", str(size), "--rate", str(args.rate)],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{size:>7} requests: {row['total_s']:6.2f} s total (build {row['build_s']}, simulate "
              f"{row['simulate_s']}, summarise {row['summarise_s']}), {row['requests_per_s']:>8} req/s, "
              f"{row['steps']:>8} steps at {row['steps_per_s']:>8} steps/s, batch {row['mean_batch_seqs']}, "
              f"peak {row['peak_rss_mb']} MB")
    if len(rows) > 1:
        per_request = [r["total_s"] / r["requests"] * 1e6 for r in rows]
        print("cost per request (us): " + ", ".join(f"{p:.0f}" for p in per_request))
    write_json(args.out, {"bench": "sim_speed", "machine": machine(), "rows": rows,
                          "targets": {"100k_total_s": 15, "100k_peak_mb": 1536}})


if __name__ == "__main__":
    main()
