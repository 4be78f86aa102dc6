"""Record predictions of a fixed set of scenarios, or re-run them and diff against a record.

  python scripts/check_predictions.py record DIR [--only NAME ...]
  python scripts/check_predictions.py check DIR [--only NAME ...]

For each case (a scenario file plus `--set` overrides) `simrun` runs with --no-plots into a
temporary folder; `record` keeps its summary.json files and any sweep.csv as DIR/NAME.summary.json and the SHA-256 of
every CSV it wrote (requests.csv, steps.csv, ...) in DIR/NAME.files.json; `check` runs the same
cases and compares the summary field by field (exactly: floats equal bit for bit) and the digests.
Exit 0 when everything matches, 1 on any difference (each one printed), 2 on bad usage.
A refactoring of the policy core must leave every prediction unchanged: run `check` after each move.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QUICK = "scenarios/quickstart.yaml"
# absolute: a --set path resolves against the working folder (it used to be the scenario file's)
GPT_OSS = f"model={{hf_config: {ROOT / 'tests/data/hf_configs/openai__gpt-oss-20b.json'}}}"   # alternate 128-token windows
# (name, scenario, overrides). The scenario files that run in under ~20 s (not trace_azure_conv: its
# trace is not in the repository), then variants that reach
# the policy's other paths: static batching, contiguous allocation, prefill_first, priority, a small
# pool (preemption heavy), synchronous scheduling, sliding-window and hybrid models.
CASES: list[tuple[str, str, list[str]]] = [
    ("bench_cold", "scenarios/bench_cold.yaml", []),
    ("bench_prefix_reuse", "scenarios/bench_prefix_reuse.yaml", []),
    ("bench_steady_nocache", "scenarios/bench_steady_nocache.yaml", []),
    ("cpu_smoke", "scenarios/cpu_smoke.yaml", []),
    ("cpu_static_vs_continuous", "scenarios/cpu_static_vs_continuous.yaml", []),
    ("quickstart", QUICK, []),
    ("seed_block_size", "scenarios/seed_block_size.yaml", []),
    ("seed_paging", "scenarios/seed_paging.yaml", []),
    ("seed_prefix_timestamp", "scenarios/seed_prefix_timestamp.yaml", []),
    ("seed_static_vs_continuous", "scenarios/seed_static_vs_continuous.yaml", []),
    ("seed_tenant_isolation", "scenarios/seed_tenant_isolation.yaml", []),
    ("serve_smoke", "scenarios/serve_smoke.yaml", []),
    ("whatif_block_size", "scenarios/whatif_block_size.yaml", []),
    ("whatif_moe", "scenarios/whatif_moe.yaml", []),
    ("whatif_prefix_caching", "scenarios/whatif_prefix_caching.yaml", []),
    ("whatif_quantization", "scenarios/whatif_quantization.yaml", []),
    ("whatif_rate_slo", "scenarios/whatif_rate_slo.yaml", []),
    ("whatif_replicas", "scenarios/whatif_replicas.yaml", []),
    ("whatif_router", "scenarios/whatif_router.yaml", []),
    ("whatif_sliding_window", "scenarios/whatif_sliding_window.yaml", []),
    ("whatif_tp", "scenarios/whatif_tp.yaml", []),
    ("q_static", QUICK, ["engine.batching=static", "engine.allocation=contiguous"]),
    ("q_contiguous", QUICK, ["engine.allocation=contiguous"]),
    ("q_prefill_first", QUICK, ["engine.step_composition=prefill_first"]),
    ("q_priority", QUICK, ["engine.scheduling_policy=priority", "workload.priorities={values: [0, 1, 2]}"]),
    ("q_preempt_heavy", QUICK, ["engine.num_blocks=400", "workload.arrival.rate=8"]),
    ("q_sync", QUICK, ["engine.async_scheduling=false"]),
    ("q_nocache_nochunk", QUICK, ["engine.prefix_caching=false", "engine.chunked_prefill=false"]),
    ("q_watermark_v0", QUICK, ["engine.admission_watermark=0.05", "engine.step_composition=prefill_first",
                               "engine.reserve_full_prompt=false"]),
    ("sliding_small_pool", "scenarios/whatif_sliding_window.yaml",
     ["workload.num_requests=80", "engine.num_blocks=1200", "workload.arrival.rate=2"]),
    ("gpt_oss", QUICK, [GPT_OSS, "device=h100-sxm", "workload.arrival.rate=20"]),
    ("gpt_oss_preempt", QUICK, [GPT_OSS, "device=h100-sxm", "engine.num_blocks=900",
                                "workload.arrival.rate=20"]),
]


def run_case(scenario: str, sets: list[str], out: Path) -> float:
    cmd = [sys.executable, "-m", "sim.cli", scenario, "--no-plots", "--quiet", "--force", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return time.perf_counter() - t0


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "missing"


def read_summary(out: Path) -> dict:
    """Every summary.json a run wrote (a comparison writes one per arm, in sub-folders) and any
    sweep.csv, keyed by their path in the run folder."""
    found = {str(p.relative_to(out)): json.loads(p.read_text()) for p in sorted(out.rglob("summary.json"))}
    found.update({str(p.relative_to(out)): p.read_text().splitlines() for p in sorted(out.rglob("sweep.csv"))})
    if not found:
        raise RuntimeError(f"{out} holds no summary.json nor sweep.csv: {sorted(p.name for p in out.iterdir())}")
    return found


def diff(a, b, where: str = "") -> list[str]:
    """Every leaf where two JSON values differ (exact equality, types included)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'baseline' if k in a else 'new'}")
            else:
                out += diff(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{where}[{i}]")]
    return [] if (type(a) is type(b) and a == b) else [f"{where}: {a!r} -> {b!r}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("record", "check"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.only or c[0] in args.only]
    if args.only and len(cases) != len(set(args.only)):
        print(f"unknown case among {args.only}; known: {[c[0] for c in CASES]}", file=sys.stderr)
        return 2
    args.folder.mkdir(parents=True, exist_ok=True)
    failures = 0
    for name, scenario, sets in cases:
        with tempfile.TemporaryDirectory(prefix="kvtwin_check_") as tmp:
            out = Path(tmp) / "run"
            seconds = run_case(scenario, sets, out)
            summary = read_summary(out)
            files = {str(f.relative_to(out)): digest(f) for f in sorted(out.rglob("*.csv"))}
        summary_path, files_path = args.folder / f"{name}.summary.json", args.folder / f"{name}.files.json"
        if args.mode == "record":
            summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True))
            files_path.write_text(json.dumps(files, indent=1, sort_keys=True))
            print(f"recorded {name:28s} {seconds:6.1f} s")
            continue
        if not summary_path.exists():
            print(f"MISSING  {name}: no baseline in {args.folder}")
            failures += 1
            continue
        problems = diff(json.loads(summary_path.read_text()), summary, "summary")
        problems += diff(json.loads(files_path.read_text()), files, "files")
        failures += bool(problems)
        print(f"{'ok' if not problems else 'DIFFERS':8s} {name:28s} {seconds:6.1f} s")
        for p in problems[:12]:
            print(f"    {p}")
    if args.mode == "check":
        print(f"{len(cases) - failures}/{len(cases)} cases identical")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
