"""The prepared GPU check: one command, one shot, everything it finished kept under OUT.

    python -m validate.gpu_check --out "$OUT"                 # on the GPU machine (H200)
    python -m validate.gpu_check --out /tmp/check --dry-run   # rehearsal on a CPU (tiny model)

Steps, most valuable first, each in its own Python process (a CUDA error or a device-side
assert in one cannot poison the next), each timed; a failing step is recorded and the next
one still runs:
  environment      versions, device, nvidia-smi
  compile          the Triton kernels of every block size the later steps use, compiled in
                   parallel processes into Triton's on-disk cache, so no timed run compiles
  gate             ~10 s correctness gate: the Triton engine against the torch backend on
                   the same batch (prefills, a prefix-cached chunk, decodes at long context)
  calibration      the cost model fitted for Qwen2.5-0.5B in bf16 -> profile YAML
  validate_*       seed_static_vs_continuous, bench_steady_nocache, bench_prefix_reuse and a
                   Poisson point near the predicted saturation rate: predicted with the
                   profile, replayed on the engine, compared
  engine_bench     continuous+paged vs static+contiguous on a pool where reservation binds
  kernel_bench     decode bandwidth vs copy bandwidth and SDPA, prefill TFLOP/s
  kernels          tests/engine/test_kernels.py compiled on the GPU (no -x: every failure listed)
A global deadline (default 430 s: a 540 s call with 20% slack) bounds the run: a step starts
only if at least half its estimated time is left, runs with the time left as its timeout,
and the rest are skipped. Every scenario's device is set to the catalog entry of the GPU at
hand (`h200` on an H200). After every step OUT is rewritten, flat (3 files: gpu_check.json,
gpu_check.log, reports.tar.gz holding reports/<device>/... as committed in the repository),
so a kill keeps everything finished so far. Unpack with  tar -xzf reports.tar.gz -C <repo>.
`--dry-run` runs every step on the CPU with the tiny model and interpreted kernels and prints
each step's estimated GPU time, whose total must fit the deadline.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
CALIBRATED = "bench_steady_nocache"
VALIDATED = ("seed_static_vs_continuous", "bench_steady_nocache", "bench_prefix_reuse")
GPU_SCENARIOS = tuple(dict.fromkeys((CALIBRATED, *VALIDATED)))
DEFAULT_DEADLINE_S = 430          # a 540 s device call, with ~20% slack for start-up and transfers
DRY_RUN_DEADLINE_S = 1200         # the CPU rehearsal is slower than the GPU run it rehearses
# The rehearsal maps the GPU scenarios onto the CPU engine: the tiny model, a small pool, fewer requests.
DRY_RUN_OVERRIDES = ["model=tiny", "device=cpu", "engine.num_blocks=1024", "engine.max_model_len=2048"]
DRY_RUN_SYNTHETIC = ["engine.max_num_seqs=16", "engine.max_num_batched_tokens=512", "workload.num_requests=60",
                     "workload.warmup_requests=10", "workload.output_len={dist: uniform, min: 8, max: 64}"]
DRY_RUN_EXTRA = {"bench_prefix_reuse": ["workload.shared_prefix.length=256"]}
# The engine bench on a pool of 16 max_model_len reservations: contiguous allocation caps
# static batching at 16 requests while paging fits every running request's actual length.
ENGINE_BENCH_GPU = ["--num-requests", "128", "--output-len", "32", "256", "--max-model-len", "2048",
                    "--num-blocks", str(16 * 2048 // 16 + 1)]
# Batch x context around the target point (64 x 4096); 32k contexts would take 34 GB per row.
KERNEL_BENCH_GPU = ["--batch", "1", "8", "64", "256", "--context", "512", "4096",
                    "--prefill-tokens", "1024", "4096"]


@dataclass(frozen=True)
class Step:
    name: str
    estimate_s: float                 # GPU wall time, process start-up included (not measured yet)
    run: Callable[["Context"], dict]


class Context:
    """What a step sees: where reports go, the device, dry run or not."""

    def __init__(self, work: Path, dry_run: bool):
        self.work, self.dry_run = work, dry_run
        self.device_name = "cpu" if dry_run else _catalog_device()
        self.reports = work / "reports" / self.device_name
        self.reports.mkdir(parents=True, exist_ok=True)
        self.engine_device = "cpu" if dry_run else "cuda"

    @property
    def profile(self) -> Path | None:
        path = self.reports / "profile_qwen2.5-0.5b.yaml"
        tiny = self.reports / "profile_tiny.yaml"
        return next((p for p in (path, tiny) if p.exists()), None)

    def run(self, cmd: list[str], timeout: float | None = None) -> str:
        """A child command, its output echoed (the step's own log captures it)."""
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_child_env())
        print(proc.stdout[-6000:] + proc.stderr[-3000:], flush=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd[1:3])} exited with {proc.returncode}")
        return proc.stdout

    def scenario(self, name: str, extra: list[str] = ()):
        return gpu_scenario(name, self.dry_run, self.device_name, extra)


def gpu_scenario(name: str, dry_run: bool = False, device: str = "h200", extra: list[str] = ()):
    """A GPU scenario as the check runs it: on `device`, or mapped onto the CPU engine."""
    from sim.scenario import load_scenario

    path = ROOT / "scenarios" / f"{name}.yaml"
    if dry_run:
        synthetic = load_scenario(path).workload.requests is None
        overrides = DRY_RUN_OVERRIDES + (DRY_RUN_SYNTHETIC if synthetic else []) + DRY_RUN_EXTRA.get(name, [])
    else:
        overrides = [f"device={device}"]
    return load_scenario(path, overrides + list(extra))


def _catalog_device() -> str:
    from engine.hardware import catalog_device_for_cuda

    return catalog_device_for_cuda()


def _child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


# ----------------------------------------------------------------------------- steps

def environment(ctx: Context) -> dict:
    from engine.replay import environment as env

    info = env()
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        info["nvidia_smi"] = None
    (ctx.reports / "environment.json").write_text(json.dumps(info, indent=2, default=str))
    return {k: v for k, v in info.items() if k != "nvidia_smi"}


def compile_kernels(ctx: Context) -> dict:
    """One process per block size the later steps use (the scenario's and the calibration's
    extra pools), in parallel: each warms the engine's every kernel variant at that block size."""
    from validate.calibrate import Grid

    scenario = ctx.scenario(CALIBRATED)
    sizes = sorted({scenario.engine.block_size, *Grid().block_sizes})
    procs = {bs: subprocess.Popen([sys.executable, "-m", "validate.gpu_check", "--warm-block-size", str(bs),
                                   *(["--dry-run"] if ctx.dry_run else [])],
                                  cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for bs in sizes}
    seconds = {}
    for bs, proc in procs.items():
        out, _ = proc.communicate()
        print(f"-- block size {bs}:\n{out[-3000:]}", flush=True)
        if proc.returncode:
            raise RuntimeError(f"warming block size {bs} exited with {proc.returncode}")
        seconds[bs] = json.loads(out.strip().splitlines()[-1])["seconds"]
    return {"warm_seconds_by_block_size": seconds}


def warm_block_size(block_size: int, dry_run: bool) -> dict:
    """Build the calibrated scenario's engine with a small pool of `block_size` and warm it."""
    from engine.replay import warm_up
    from engine.runner import ModelRunner

    scenario = gpu_scenario(CALIBRATED, dry_run, "cpu" if dry_run else _catalog_device(),
                            [f"engine.block_size={block_size}", f"engine.num_blocks={8192 // block_size + 64}"])
    t0 = time.perf_counter()
    runner = ModelRunner.from_scenario(scenario, "cpu" if dry_run else "cuda")
    warm_up(scenario, runner)
    return {"block_size": block_size, "seconds": round(time.perf_counter() - t0, 2)}


def gate(ctx: Context) -> dict:
    from validate.gate import correctness_gate

    return correctness_gate(ctx.scenario(CALIBRATED), ctx.engine_device)


def calibration(ctx: Context) -> dict:
    from validate.calibrate import calibrate, write_profile

    scenario = ctx.scenario(CALIBRATED)
    cal = calibrate(scenario, ctx.engine_device, progress=lambda m: print(m, flush=True))
    path = write_profile(ctx.reports / f"profile_{scenario.model.name}.yaml", cal)
    cal.samples.to_csv(ctx.reports / "calibration_probes.csv", index=False)
    return {"profile": str(path.relative_to(ctx.work)), "fit": cal.profile.fit}


def validation(ctx: Context, name: str, extra: list[str] = (), label: str | None = None) -> dict:
    from sim.scenario import expand_variants
    from validate.compare import GPU_TARGETS
    from validate.run import validate, write_validation

    scenario = ctx.scenario(name, extra)
    if ctx.profile is None:
        print("no calibrated profile: predicting with the default coefficients", flush=True)
    out = {"profile": str(ctx.profile) if ctx.profile else None}
    for variant, s in expand_variants(scenario, ROOT / "scenarios").items():
        folder = ctx.reports / (label or name) / (variant if variant != s.name else "")
        v = validate(s, ctx.engine_device, ctx.profile, tolerances=GPU_TARGETS)
        write_validation(v, folder)
        write_tolerances(folder, v.table)
        out[variant] = {row: {"error": v.table.loc[row, "relative_error"], "within": v.table.loc[row, "within"]}
                        for row in GPU_TARGETS}
        out[variant]["step_time_median_rel_error"] = v.step_errors["all"]["median_rel_error"]
    return out


def write_tolerances(folder: Path, table) -> None:
    """The band the regression test holds future predictions to: the GPU target (GPU_TARGETS), or the
    error achieved here widened by half and 2 points if that is larger (it is then a miss)."""
    import pandas as pd
    import yaml

    from validate.compare import GPU_TARGETS

    bands = {row: round(max(target, abs(float(table.loc[row, "relative_error"])) * 1.5 + 0.02), 3)
             for row, target in GPU_TARGETS.items() if not pd.isna(table.loc[row, "relative_error"])}
    header = ("# Written by validate/gpu_check.py: tests/validate/test_reports.py re-predicts this measurement\n"
              "# with today's simulator and fails if an error leaves its band.\n")
    (folder / "tolerances.yaml").write_text(header + yaml.safe_dump(bands, sort_keys=True))


def saturation_point(ctx: Context) -> dict:
    """Validate a Poisson rate at 85% of the highest rate the calibrated simulator says one
    replica sustains (`simrun plan`'s steady-state search, no SLOs)."""
    from sim.whatif.plan import Traffic, search_rate
    from sim.whatif.sweep import PointTask

    scenario = ctx.scenario(CALIBRATED)
    raw = scenario.model_dump(mode="json", exclude={"variants"}, exclude_none=True)
    raw["device"]["profile"] = str(ctx.profile) if ctx.profile else None
    base = PointTask(raw, str(ROOT / "scenarios"), CALIBRATED, ())
    curve = search_rate(base, Traffic.of(scenario), [], lowest=0.05, highest=1e5, tolerance=0.05)
    if curve.knee is None:
        raise RuntimeError("the simulator sustains no rate at all for this scenario")
    point = float(f"{0.85 * curve.knee:.3g}")
    result = validation(ctx, CALIBRATED, [f"workload.arrival.rate={point}"], label="poisson_near_saturation")
    return {"rate": point, "predicted_knee": curve.knee, **result}


def engine_bench(ctx: Context) -> dict:
    out = ctx.reports / "engine_throughput.json"
    ctx.run([sys.executable, "bench/engine_throughput.py", "--out", str(out),
             *([] if ctx.dry_run else ENGINE_BENCH_GPU)])
    data = json.loads(out.read_text())
    return {"file": str(out.relative_to(ctx.work)), "speedup": data["speedup_output_tok_per_s"]}


def kernel_bench(ctx: Context) -> dict:
    out = ctx.reports / "kernels.json"
    ctx.run([sys.executable, "bench/kernels.py", "--out", str(out), *([] if ctx.dry_run else KERNEL_BENCH_GPU)])
    return {"file": str(out.relative_to(ctx.work))}


def kernels(ctx: Context) -> dict:
    """The kernel tests compiled on the GPU, every failure listed (no -x), plus the served
    models' attention shapes at long context against the reference."""
    args = [sys.executable, "-m", "pytest", "tests/engine/test_kernels.py", "-q", "-p", "no:cacheprovider", "-rf"]
    if ctx.dry_run:
        args += ["-k", "decode and fp32"]
    try:
        tail = ctx.run(args)
        summary = tail.strip().splitlines()[-1] if tail.strip() else ""
        ok = True
    except RuntimeError as e:
        summary, ok = str(e), False
    shapes = _model_shapes(ctx)
    if not ok:
        raise RuntimeError(f"kernel tests failed ({summary}); model shapes: {shapes}")
    return {"pytest": summary, **shapes}


def _model_shapes(ctx: Context) -> dict:
    import torch

    from engine.kernels import paged_attention, paged_attention_reference
    from engine.kernels.testing import make_attention_inputs

    device = ctx.engine_device
    shapes = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}
    contexts = ([1, 1, 1], [40, 17, 33]) if ctx.dry_run else ([1] * 8 + [512], [4096] * 8 + [2048])
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


STEPS = (
    Step("environment", 5, environment),
    Step("compile", 35, compile_kernels),
    Step("gate", 15, gate),
    Step("calibration", 100, calibration),
    *[Step(f"validate_{n}", 25 if n == "seed_static_vs_continuous" else 45, (lambda ctx, n=n: validation(ctx, n)))
      for n in VALIDATED],
    Step("validate_saturation", 45, saturation_point),
    Step("engine_bench", 40, engine_bench),
    Step("kernel_bench", 25, kernel_bench),
    Step("kernels", 40, kernels),
)
STEP_NAMES = tuple(s.name for s in STEPS)


# ----------------------------------------------------------------------------- orchestration

class Outbox:
    """OUT, kept flat and current: the summary, the log and the reports archive, each
    rewritten atomically after every step."""

    FILES = ("gpu_check.json", "gpu_check.log", "reports.tar.gz")

    def __init__(self, out: Path, work: Path):
        self.out, self.work = out, work
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "gpu_check.log", "a", buffering=1)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self, summary: dict) -> None:
        _atomic_bytes(self.out / "gpu_check.json", json.dumps(summary, indent=2, default=str).encode())
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            if (self.work / "reports").exists():
                tar.add(self.work / "reports", arcname="reports")
        _atomic_bytes(self.out / "reports.tar.gz", buffer.getvalue())


def _atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def run_step_in_child(step: Step, args, work: Path, timeout: float, outbox: Outbox) -> dict:
    """Run one step in a fresh process; its result JSON comes back through a file in `work`."""
    result_file = work / "results" / f"{step.name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "validate.gpu_check", "--step", step.name, "--work", str(work),
           "--result-file", str(result_file), *(["--dry-run"] if args.dry_run else [])]
    if step.name in args.inject_failure:
        cmd.append("--crash")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_child_env())
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output, code = output + f"\n(killed after {timeout:.0f} s)", None
    outbox.log.write(output[-20000:] + "\n")
    print(output[-4000:], flush=True)
    if result_file.exists():
        return json.loads(result_file.read_text())
    if code is None:
        return {"ok": False, "error": f"timeout: killed after {timeout:.0f} s (the deadline)"}
    return {"ok": False, "error": f"the step's process exited with {code} without a result",
            "output_tail": output[-2000:]}


def child_main(args) -> int:
    """One step, in this process; the result (ok or the error) goes to --result-file."""
    if args.crash:                     # rehearses a process lost mid-step (a CUDA fault, say)
        os._exit(134)
    step = {s.name: s for s in STEPS}[args.step]
    ctx = Context(args.work, args.dry_run)
    try:
        result = {"ok": True, **(step.run(ctx) or {})}
    except Exception as e:  # recorded: the orchestrator carries on with the next step
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
    _atomic_bytes(Path(args.result_file), json.dumps(result, default=str).encode())
    return 0


def estimate_table(steps: list[Step], deadline_s: float) -> str:
    lines = [f"{'step':<40} {'est. GPU s':>10}"] + [f"{s.name:<40} {s.estimate_s:>10.0f}" for s in steps]
    total = sum(s.estimate_s for s in steps)
    lines.append(f"{'total':<40} {total:>10.0f}  (deadline {deadline_s:.0f} s: "
                 f"{'fits' if total <= deadline_s else 'DOES NOT FIT'})")
    return "\n".join(lines)


def orchestrate(args) -> int:
    t_start = time.monotonic()
    deadline = args.deadline or (DRY_RUN_DEADLINE_S if args.dry_run else DEFAULT_DEADLINE_S)
    steps = [s for s in STEPS if s.name not in args.skip and (not args.only or s.name in args.only)]
    work = Path(args.work or tempfile.mkdtemp(prefix="kvtwin_gpu_check_"))
    outbox = Outbox(args.out, work)
    summary = {"deadline_s": deadline, "dry_run": args.dry_run, "work": str(work),
               "estimated_gpu_s": {s.name: s.estimate_s for s in steps},
               "estimated_gpu_total_s": sum(s.estimate_s for s in steps), "steps": {}}
    outbox.say(estimate_table(steps, DEFAULT_DEADLINE_S))
    outbox.save(summary)
    for step in steps:
        left = deadline - (time.monotonic() - t_start)
        if left < max(step.estimate_s / 2, 1.0):
            result = {"ok": False, "skipped": f"deadline: {left:.0f} s left, step estimated at {step.estimate_s:.0f} s"}
            outbox.say(f"== {step.name}: SKIPPED ({result['skipped']})")
        else:
            outbox.say(f"== {step.name} (estimated {step.estimate_s:.0f} s on the GPU, {left:.0f} s left)")
            t0 = time.monotonic()
            result = run_step_in_child(step, args, work, min(left, args.max_step_s or left), outbox)
            result["seconds"] = round(time.monotonic() - t0, 1)
            outbox.say(f"-- {step.name}: {'ok' if result['ok'] else 'FAILED: ' + result.get('error', '')[:300]}"
                       f" in {result['seconds']} s")
        summary["steps"][step.name] = result
        summary["elapsed_s"] = round(time.monotonic() - t_start, 1)
        outbox.save(summary)
    failed = [n for n, r in summary["steps"].items() if not r["ok"]]
    outbox.say("FAILED or skipped: " + ", ".join(failed) if failed else "all steps passed")
    outbox.say(f"archive: {args.out / 'reports.tar.gz'} ({summary['elapsed_s']} s)")
    return 1 if failed else 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    ap.add_argument("--dry-run", action="store_true", help="rehearse on a CPU with the tiny model")
    ap.add_argument("--deadline", type=float, default=None,
                    help=f"seconds for the whole check (default {DEFAULT_DEADLINE_S}; dry run {DRY_RUN_DEADLINE_S})")
    ap.add_argument("--skip", nargs="*", default=[], choices=STEP_NAMES, metavar="STEP", help="steps to skip")
    ap.add_argument("--only", nargs="*", default=[], choices=STEP_NAMES, metavar="STEP", help="run only these")
    ap.add_argument("--max-step-s", type=float, default=None, help="cap on any one step's time")
    ap.add_argument("--inject-failure", nargs="*", default=[], choices=STEP_NAMES, metavar="STEP",
                    help="rehearsal: these steps' processes die abruptly, as after a CUDA fault")
    ap.add_argument("--work", type=Path, default=None, help="where reports are built (default: a temp dir)")
    # internal: one step in this process (the orchestrator's children)
    ap.add_argument("--step", choices=STEP_NAMES, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    ap.add_argument("--crash", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm-block-size", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:       # interpreted kernels; must precede the first import of engine.kernels
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import torch

        torch.set_num_threads(1)
    if args.warm_block_size:
        print(json.dumps(warm_block_size(args.warm_block_size, args.dry_run)))
        return 0
    if args.step:
        return child_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
