"""A fleet at scale (issue 30 part 4): scenarios/fleet_64.yaml (64 replicas behind a router) at 1M,
3M and 10M requests, each a fresh `simrun` process, with its records kept in memory and spilled to
disk (--spill-records) where memory allows; and a sweep of >= 1,000 small points through --ray.

  python bench/fleet_scale.py [--sizes 1000000 3000000 10000000] [--memory-up-to 3000000]
                              [--ray-points 1000] [--only runs|ray] [--out bench/results/fleet_scale.json]

Per run: its command line, the CPU seconds of its process tree (getrusage of the reaped child,
which counts the descendants it reaped), its peak RSS (the kernel's maximum for the tree, and the
largest sum over the live tree sampled every 0.5 s), wall seconds, the load average before and
after and sampled during it (a shared 2-core machine: read CPU seconds, not wall), its files'
sizes and headline figures. Where a size ran both ways, whether the two wrote the same
summary.json, requests.csv and steps.csv (sha256). Results are merged into --out as each run
ends (a later run of this script adds to them), so a long 10M run can follow the others.
Run it under `nice`: the machine is shared.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._util import machine, write_json  # noqa: E402

SCENARIO = "scenarios/fleet_64.yaml"
HEADLINE = ("requests_finished", "num_steps", "request_throughput", "output_token_throughput",
            "duration_s", "kv_usage_peak")


def timed_child(command: list[str]):
    """Run `command` as a child: (wall s, its rusage, the sampler of its process tree); exit on failure."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    sampler.stop()
    if status != 0:
        raise SystemExit(f"{' '.join(command)}: exit status {status}")
    return wall, usage, sampler


def run_once(n: int, spilled: bool, scratch: Path) -> dict:
    out = scratch / f"fleet-{n}-{'spilled' if spilled else 'memory'}"
    command = [sys.executable, "-m", "sim.cli", SCENARIO, "--set", f"workload.num_requests={n}",
               "--out", str(out), "--no-plots", "--quiet", "--force"] + (["--spill-records"] if spilled else [])
    load_before, commit = os.getloadavg(), git_commit()
    wall, usage, sampler = timed_child(command)
    summary = json.loads((out / "summary.json").read_text())
    result = {
        "requests": n, "records": "spilled" if spilled else "memory", "git_commit": commit,
        "command": " ".join(["python", *command[1:]]),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "wall_s": round(wall, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024), "peak_tree_rss_sampled_mb": round(sampler.peak_kb / 1024),
        "cpu_us_per_request": round(1e6 * (usage.ru_utime + usage.ru_stime) / n, 1),
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        "load_sampled_mean": round(sum(sampler.loads) / max(1, len(sampler.loads)), 2),
        "file_mb": {name: round((out / name).stat().st_size / 2**20, 1)
                    for name in ("summary.json", "requests.csv", "steps.csv")},
        "sha256": {name: sha256(out / name) for name in ("summary.json", "requests.csv", "steps.csv")},
        **{key: summary.get(key) for key in HEADLINE},
        "ttft_p99_s": summary["ttft_s"]["p99"], "tpot_p99_s": summary["tpot_s"]["p99"],
    }
    if spilled:
        result["records_folder_mb"] = round(folder_bytes(out / "records") / 2**20, 1)
    shutil.rmtree(out, ignore_errors=True)          # (10M requests' files: ~4 GB)
    return result


class TreeSampler(threading.Thread):
    """The summed VmRSS of a process and its descendants, every 0.5 s; the CPU seconds each of them
    had used when last seen (for processes the tree's root never reaps: Ray's); the 1-minute load."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_kb, self.loads, self.done = pid, 0, [], threading.Event()
        self.cpu_s: dict[int, float] = {}

    def run(self) -> None:
        while not self.done.wait(0.5):
            pids = tree(self.pid)
            self.peak_kb = max(self.peak_kb, sum(map(rss_kb, pids)))
            for pid in pids[1:]:
                self.cpu_s[pid] = max(self.cpu_s.get(pid, 0.0), cpu_seconds(pid))
            self.loads.append(os.getloadavg()[0])

    def stop(self) -> None:
        self.done.set()
        self.join()


def tree(pid: int) -> list[int]:
    pids, i = [pid], 0
    while i < len(pids):
        try:
            for task in os.listdir(f"/proc/{pids[i]}/task"):
                with open(f"/proc/{pids[i]}/task/{task}/children") as f:
                    pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
        i += 1
    return pids


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (its own, not its children's)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()[:16]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def ray_sweep(points: int, scratch: Path) -> dict:
    """`simrun fleet_64 --set ... --ray`: `points` points of 200 requests on 4 replicas (rate x seed),
    a local Ray instance started by the sweep itself."""
    rates = [f"{r:g}" for r in range(50, 50 + 10 * 40, 10)]                 # 40 rates
    seeds = [str(s) for s in range(-(-points // len(rates)))]
    out = scratch / "fleet-ray-sweep"
    command = [sys.executable, "-m", "sim.cli", SCENARIO, "--set", "cluster.replicas=4",
               "--set", "workload.num_requests=200", "--set", f"workload.arrival.rate={','.join(rates)}",
               "--set", f"seed={','.join(seeds)}", "--out", str(out), "--no-plots", "--quiet", "--force",
               "--ray"]
    load_before = os.getloadavg()
    wall, usage, sampler = timed_child(command)
    rows = sweep_rows(out)
    result = {"points": rows, "requests_per_point": 200, "replicas_per_point": 4,
              "command": " ".join(["python", *command[1:]]), "wall_s": round(wall, 1),
              "cpu_s_sweep_process": round(usage.ru_utime + usage.ru_stime, 1),
              "cpu_s_descendants_sampled": round(sum(sampler.cpu_s.values()), 1),
              "peak_tree_rss_sampled_mb": round(sampler.peak_kb / 1024),
              "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
              "load_sampled_mean": round(sum(sampler.loads) / max(1, len(sampler.loads)), 2),
              "note": "cpu_s_sweep_process: getrusage of the reaped sweep process (with the children it "
                      "reaped); cpu_s_descendants_sampled: the CPU seconds of every process under it "
                      "(Ray's GCS, raylet, workers) when last seen, sampled every 0.5 s (a lower bound); "
                      "the sampled RSS sums the tree's VmRSS, which counts Ray's shared object store once "
                      "per process that maps it"}
    shutil.rmtree(out, ignore_errors=True)
    return result


def sweep_rows(out: Path) -> int:
    csvs = sorted(out.glob("*.csv"))
    if not csvs:
        return 0
    with open(csvs[0]) as f:
        return sum(1 for _ in f) - 1


def merge(path: Path, key: str, entry) -> None:
    """Add `entry` to the results file, under a lock (two of these scripts may run side by side)."""
    import fcntl

    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _merge(path, key, entry)
    path.with_suffix(".lock").unlink(missing_ok=True)


def _merge(path: Path, key: str, entry) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("runs", [])
    data["machine"] = machine()
    data["scenario"] = SCENARIO
    data["git_commit"] = git_commit()
    if key == "runs":
        data["runs"] = [r for r in data["runs"]
                        if (r["requests"], r["records"]) != (entry["requests"], entry["records"])] + [entry]
        data["runs"].sort(key=lambda r: (r["requests"], r["records"]))
        data["same_files"] = same_files(data["runs"])
    else:
        data[key] = entry
    write_json(path, data)


def same_files(runs: list[dict]) -> dict:
    """Per size that ran both ways: did memory and spilled write the same files?"""
    by_size: dict = {}
    for r in runs:
        by_size.setdefault(r["requests"], {})[r["records"]] = r["sha256"]
    return {str(n): both["memory"] == both["spilled"] for n, both in by_size.items() if len(both) == 2}


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000])
    p.add_argument("--memory-up-to", type=int, default=3_000_000,
                   help="largest size also run with its records in memory")
    p.add_argument("--ray-points", type=int, default=1000)
    p.add_argument("--only", choices=("runs", "ray"))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fleet_scale.json")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="fleet_scale_"))
    try:
        if args.only != "ray":
            for n in args.sizes:
                for spilled in ((False, True) if n <= args.memory_up_to else (True,)):
                    result = run_once(n, spilled, scratch)
                    print(json.dumps(result), flush=True)
                    merge(args.out, "runs", result)
        if args.only != "runs":
            result = ray_sweep(args.ray_points, scratch)
            print(json.dumps(result), flush=True)
            merge(args.out, "ray_sweep", result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
