"""Cost of the shared policy per engine step: Scheduler.schedule + finish_step.

  python bench/policy_speed.py [--out bench/results/policy_speed.json]

Decode-only steady state at batch 64 / 256 / 1024 with prefix caching on (every 16th
step per sequence crosses a block boundary and registers a hash), plus a mixed step
(decodes + one prefill chunk), each with the decode cohort and, as the baseline in the
same run, with it off (every sequence visited every step). Target: a decode-only step at
batch 256 under 100 us.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import machine, write_json  # noqa: E402
from sim.core.kv import KVCacheManager  # noqa: E402
from sim.core.request import make_request  # noqa: E402
from sim.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from sim.core.scheduler_variants import make_scheduler  # noqa: E402


def steady_scheduler(batch: int, prompt: int = 200, mixed: bool = False, cohort: bool = True) -> Scheduler:
    """`batch` requests in decode (and, if mixed, a stream of long prompts to chunk)."""
    kv = KVCacheManager(num_blocks=batch * 200 + 10_000, block_size=16, enable_caching=True)
    cfg = SchedulerConfig(max_num_seqs=batch + 1, max_num_batched_tokens=batch + 512, max_model_len=65_536,
                          lazy_decode=cohort)
    sched = make_scheduler(cfg, kv)
    for i in range(batch):
        sched.add(make_request(i, 0.0, [(7, 64), (10_000 + i, prompt - 64)], 60_000))
    while sched.num_waiting:             # admit and prefill everyone
        sched.finish_step(sched.schedule())
    if mixed:
        sched.add(make_request(batch, 0.0, [(99, 60_000)], 1))
    return sched


def time_steps(sched: Scheduler, steps: int) -> list[float]:
    out = []
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        batch = sched.schedule()
        sched.finish_step(batch)
        out.append(clock() - t0)
    return out


def run(batches: list[int], steps: int) -> list[dict]:
    rows = []
    for batch in batches:
        for mixed in (False, True):
            row = {"batch": batch, "step": "mixed" if mixed else "decode"}
            for cohort in (True, False):      # the decode cohort vs the one-by-one baseline
                sched = steady_scheduler(batch, mixed=mixed, cohort=cohort)
                time_steps(sched, 32)         # warm up
                samples = time_steps(sched, steps)
                key = "" if cohort else "baseline_"
                row[f"{key}median_us"] = round(statistics.median(samples) * 1e6, 1)
                row[f"{key}p90_us"] = round(sorted(samples)[int(0.9 * len(samples))] * 1e6, 1)
            row["speedup"] = round(row["baseline_median_us"] / row["median_us"], 2)
            rows.append(row)
            print(f"batch {batch:>5} {row['step']:>6}: median {row['median_us']:>7.1f} us/step "
                  f"(p90 {row['p90_us']:.1f}); one by one {row['baseline_median_us']:.1f} us: "
                  f"{row['speedup']:.1f}x")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/policy_speed.json")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    rows = run([64, 256, 1024], args.steps)
    target = next(r for r in rows if r["batch"] == 256 and r["step"] == "decode")["median_us"]
    verdict = "meets" if target < 100 else "misses"
    print(f"decode step at batch 256: {target:.1f} us ({verdict} the 100 us target)")
    write_json(args.out, {"bench": "policy_speed", "machine": machine(), "rows": rows,
                          "target": {"decode_batch_256_us": 100, "measured_us": target}})


if __name__ == "__main__":
    main()
