"""The prepared GPU check: one command, about 8 minutes on an H200, everything under OUT.

    python -m validate.gpu_check --out "$OUT"                 # on the GPU machine
    python -m validate.gpu_check --out /tmp/check --dry-run   # rehearsal on a CPU (tiny model)

Steps, each timed; a failing step is recorded and the next one still runs:
  1. environment       versions, device, nvidia-smi
  2. kernels           tests/test_kernels.py compiled on the GPU, plus the model shapes at long context
  3. kernel bench      bench/kernels.py on a reduced grid
  4. engine bench      bench/engine_throughput.py (continuous + paging vs static + contiguous)
  5. calibration       the cost model fitted for Qwen2.5-0.5B in bf16 -> profile YAML
  6. validation        seed_static_vs_continuous, bench_steady_nocache, bench_prefix_reuse, and a
                       Poisson point near the predicted saturation rate, each predicted with the
                       profile, replayed on the engine and compared
Output: OUT/reports.tar.gz holds reports/<device>/... exactly as committed in the repository
(the device tool returns few files and only two folders deep, hence the archive), and
OUT/gpu_check.json / OUT/gpu_check.log summarise the run. Unpack with
    tar -xzf reports.tar.gz -C <repo>
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
VALIDATED = ("seed_static_vs_continuous", "bench_steady_nocache", "bench_prefix_reuse")
# The rehearsal maps the GPU scenarios onto the CPU engine: the tiny model, a small pool, fewer requests.
DRY_RUN_OVERRIDES = ["model=tiny", "device=cpu", "engine.num_blocks=1024", "engine.max_model_len=2048"]
DRY_RUN_SYNTHETIC = ["engine.max_num_seqs=16", "engine.max_num_batched_tokens=512", "workload.num_requests=60",
                     "workload.warmup_requests=10", "workload.output_len={dist: uniform, min: 8, max: 64}"]
DRY_RUN_EXTRA = {"bench_prefix_reuse": ["workload.shared_prefix.length=256"]}


class Check:
    """Runs the steps, logs them, and writes the summary after each one."""

    def __init__(self, out: Path, dry_run: bool):
        self.out, self.dry_run = out, dry_run
        self.device_name = "cpu" if dry_run else _catalog_device()
        self.reports = out / "reports" / self.device_name
        self.reports.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}
        self.log = open(out / "gpu_check.log", "a", buffering=1)

    def step(self, name: str, fn: Callable[[], dict]) -> dict:
        self.say(f"== {name}")
        t0 = time.perf_counter()
        try:
            result = {"ok": True, **(fn() or {})}
        except Exception as e:  # a failed step must not stop the others: record it
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            self.say(result["traceback"])
        result["seconds"] = round(time.perf_counter() - t0, 1)
        self.results[name] = result
        self.say(f"-- {name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s")
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str))
        return result

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def run(self, cmd: list[str], timeout: int) -> str:
        self.say("$ " + " ".join(cmd))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        self.say(proc.stdout[-6000:] + proc.stderr[-3000:])
        if proc.returncode:
            raise RuntimeError(f"{cmd[1] if len(cmd) > 1 else cmd[0]} exited with {proc.returncode}")
        return proc.stdout

    def scenario(self, name: str, extra: list[str] = ()):
        from sim.scenario import load_scenario

        path = ROOT / "scenarios" / f"{name}.yaml"
        overrides = list(extra)
        if self.dry_run:
            synthetic = load_scenario(path).workload.requests is None
            overrides = (DRY_RUN_OVERRIDES + (DRY_RUN_SYNTHETIC if synthetic else [])
                         + DRY_RUN_EXTRA.get(name, []) + overrides)
        return load_scenario(path, overrides)


def _catalog_device() -> str:
    from engine.hardware import catalog_device_for_cuda

    return catalog_device_for_cuda()


# ----------------------------------------------------------------------------- steps

def environment(check: Check) -> dict:
    from engine.replay import environment as env

    info = env()
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        info["nvidia_smi"] = None
    (check.reports / "environment.json").write_text(json.dumps(info, indent=2, default=str))
    return {k: v for k, v in info.items() if k != "nvidia_smi"}


def kernels(check: Check) -> dict:
    args = [sys.executable, "-m", "pytest", "tests/test_kernels.py", "-q", "-x", "-p", "no:cacheprovider"]
    if check.dry_run:
        args += ["-k", "decode and fp32"]
    tail = check.run(args, timeout=400)
    return {"pytest": tail.strip().splitlines()[-1] if tail.strip() else "", **_model_shapes(check)}


def _model_shapes(check: Check) -> dict:
    """The served models' attention shapes at long context, compiled, against the reference."""
    import torch

    from engine.kernels import paged_attention, paged_attention_reference
    from engine.kernels.testing import make_attention_inputs

    device = "cpu" if check.dry_run else "cuda"
    shapes = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}
    contexts = ([1, 1, 1], [40, 17, 33]) if check.dry_run else ([1] * 8 + [512], [4096] * 8 + [2048])
    errors = {}
    for name, (heads, kv_heads, d) in shapes.items():
        inputs = make_attention_inputs(*contexts, heads, kv_heads, d, 16, torch.bfloat16, device=device)
        out = paged_attention(**inputs).float()
        del inputs["max_query_len"], inputs["max_seq_len"]
        ref = paged_attention_reference(**inputs, out=torch.empty(out.shape, device=device))
        errors[name] = float((out - ref).abs().max())
        if errors[name] > 5e-2:
            raise AssertionError(f"{name}: max abs error {errors[name]:.3g} > 5e-2 (bf16)")
    return {"model_shape_max_abs_error": errors}


def kernel_bench(check: Check) -> dict:
    out = check.reports / "kernels.json"
    grid = [] if check.dry_run else ["--batch", "1", "8", "64", "256", "--context", "512", "4096", "32768",
                                      "--prefill-tokens", "1024", "4096"]
    check.run([sys.executable, "bench/kernels.py", "--out", str(out), *grid], timeout=300)
    return {"file": str(out.relative_to(check.out))}


def engine_bench(check: Check) -> dict:
    out = check.reports / "engine_throughput.json"
    check.run([sys.executable, "bench/engine_throughput.py", "--out", str(out)], timeout=300)
    return {"file": str(out.relative_to(check.out))}


def calibration(check: Check) -> dict:
    from validate.calibrate import calibrate, write_profile

    scenario = check.scenario("bench_steady_nocache")
    cal = calibrate(scenario, "cpu" if check.dry_run else "cuda")
    path = write_profile(check.reports / f"profile_{scenario.model.name}.yaml", cal)
    check.profile = path
    return {"profile": str(path.relative_to(check.out)), "fit": cal.profile.fit}


def validation(check: Check, name: str, extra: list[str] = (), label: str | None = None) -> dict:
    from validate.compare import GPU_TARGETS
    from validate.run import validate, write_validation
    from sim.scenario import expand_variants

    scenario = check.scenario(name, extra)
    profile = getattr(check, "profile", None)
    out = {}
    for variant, s in expand_variants(scenario, ROOT / "scenarios").items():
        folder = check.reports / (label or name) / (variant if variant != s.name else "")
        v = validate(s, "cpu" if check.dry_run else "cuda", profile, tolerances=GPU_TARGETS)
        write_validation(v, folder)
        write_tolerances(folder, v.table)
        out[variant] = {row: {"error": v.table.loc[row, "relative_error"], "within": v.table.loc[row, "within"]}
                        for row in GPU_TARGETS}
        out[variant]["step_time_median_rel_error"] = v.step_errors["all"]["median_rel_error"]
    return out


def write_tolerances(folder: Path, table) -> None:
    """The band the regression test holds future predictions to: the issue's target, or the
    error achieved here widened by half and 2 points if that is larger (it is then a miss)."""
    import pandas as pd
    import yaml

    from validate.compare import GPU_TARGETS

    bands = {row: round(max(target, abs(float(table.loc[row, "relative_error"])) * 1.5 + 0.02), 3)
             for row, target in GPU_TARGETS.items() if not pd.isna(table.loc[row, "relative_error"])}
    header = ("# Written by validate/gpu_check.py: tests/test_reports.py re-predicts this measurement\n"
              "# with today's simulator and fails if an error leaves its band.\n")
    (folder / "tolerances.yaml").write_text(header + yaml.safe_dump(bands, sort_keys=True))


def saturation_point(check: Check) -> dict:
    """Validate a Poisson rate at 85% of the highest rate the calibrated simulator says one
    replica sustains (`simrun plan`'s steady-state search, no SLOs)."""
    from sim.whatif.plan import Traffic, search_rate
    from sim.whatif.sweep import PointTask

    scenario = check.scenario("bench_steady_nocache")
    raw = scenario.model_dump(mode="json", exclude={"variants"}, exclude_none=True)
    raw["device"]["profile"] = str(getattr(check, "profile", "")) or None
    base = PointTask(raw, str(ROOT / "scenarios"), "bench_steady_nocache", ())
    curve = search_rate(base, Traffic.of(scenario), [], lowest=0.05, highest=1e5, tolerance=0.05)
    if curve.knee is None:
        raise RuntimeError("the simulator sustains no rate at all for this scenario")
    point = float(f"{0.85 * curve.knee:.3g}")
    result = validation(check, "bench_steady_nocache", [f"workload.arrival.rate={point}"],
                        label="poisson_near_saturation")
    return {"rate": point, "predicted_knee": curve.knee, **result}


def archive(check: Check) -> Path:
    path = check.out / "reports.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(check.out / "reports", arcname="reports")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    ap.add_argument("--dry-run", action="store_true", help="rehearse on a CPU with the tiny model")
    ap.add_argument("--skip", nargs="*", default=[], help="steps to skip (names as printed)")
    args = ap.parse_args(argv)
    if args.dry_run:       # interpreted kernels; must precede the first import of engine.kernels
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import torch

        torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, args.dry_run)
    steps = [("environment", lambda: environment(check)), ("kernels", lambda: kernels(check)),
             ("kernel_bench", lambda: kernel_bench(check)), ("engine_bench", lambda: engine_bench(check)),
             ("calibration", lambda: calibration(check)),
             *[(f"validate_{n}", (lambda n=n: validation(check, n))) for n in VALIDATED],
             ("validate_saturation", lambda: saturation_point(check))]
    try:
        for name, fn in steps:
            if name not in args.skip:
                check.step(name, fn)
    finally:
        check.say(f"archive: {archive(check)}")
    failed = [n for n, r in check.results.items() if not r["ok"]]
    check.say("FAILED steps: " + ", ".join(failed) if failed else "all steps passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
