"""Memory of a LODO refit's repeated evaluations: the process's RSS over N evaluations of one
class fit's residuals (validate/lodo.py fit_class: every fit run predicted under new coefficients).

  python bench/lodo_memory.py [--group v0/h200] [--evaluations 40] [--out bench/results/lodo_memory.json]

A refit runs thousands of such evaluations in one process; the RSS must stay flat over them. (It
grew by the simulations' KV pools and records, kept in reference cycles that sim.core.collector.gc_paused
left to rare full collections: 13.7 GB in a refit before the cycles were broken.) The automatic
collector runs as in a refit: no gc.collect() here.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import machine, write_json  # noqa: E402
from sim.costmodel import trained_coefficients  # noqa: E402
from validate import lodo  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", default="v0/h200", help="ENGINE/GPU class whose fit runs are evaluated")
    p.add_argument("--evaluations", type=int, default=40)
    p.add_argument("--out", type=Path, default=Path("bench/results/lodo_memory.json"))
    args = p.parse_args()
    engine, gpu = args.group.split("/")
    runs, _ = lodo.all_runs(lodo.LATEST_DATA_PASS)
    train = lodo.fit_runs([r for r in runs if r.group == (engine, gpu)])
    names = [n for n in lodo.FIT_NAMES[engine] if lodo.parameter_acts(n, train)]
    x0 = np.log([lodo.START[engine][n] for n in names])
    rng = np.random.default_rng(0)          # coefficients move as in a fit's Jacobian probes
    start, t0, rss = rss_mb(), time.perf_counter(), []
    for i in range(args.evaluations):
        coeffs = trained_coefficients(dict(zip(names, np.exp(x0 + rng.normal(0, 0.1, len(x0))))))
        for run in train:
            lodo.predict(run, coeffs)
        rss.append(round(rss_mb(), 1))
        print(f"evaluation {i + 1}: RSS {rss[-1]:.0f} MB", flush=True)
    result = {"group": args.group, "fit_runs": len(train), "evaluations": args.evaluations,
              "rss_mb_after_loading": round(start, 1), "rss_mb_per_evaluation": rss,
              "growth_mb_per_evaluation": round((rss[-1] - rss[0]) / max(1, len(rss) - 1), 2),
              "seconds": round(time.perf_counter() - t0, 1), "machine": machine()}
    write_json(args.out, result)
    print(f"{args.group}: {len(train)} runs x {args.evaluations} evaluations: RSS {rss[0]:.0f} -> {rss[-1]:.0f} MB "
          f"({result['growth_mb_per_evaluation']:+.2f} MB per evaluation); wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
