"""The fidelity table: kvtwin against public measured vLLM runs (tests/data/vllm_public/bench_runs.yaml).

For every run kvtwin can express (model shape known, dense bf16, single node or stated tp, a
`random` dataset with fixed lengths, all requests at t=0), the error of mean TTFT, mean TPOT and
the run's duration under
  - the datasheet cost model (catalog peaks x default efficiencies),
  - a profile calibrated on the *other* runs of the same deployment (same GPU, model, tp, vLLM
    version): the deployment's runs are split in two alternating halves, each half fitted on the
    other (`simrun calibrate --from-vllm`'s fit, on the runs' means).
The KV pool is vLLM's: the startup log's num_gpu_blocks where the source gives it, else
`vllm_memory_plan`. Each run replays its own workload: `completed` requests of the mean input and
output length, all sent at t=0 (`request_rate: inf`).

    python -m validate.fidelity --out reports/fidelity      # writes table.csv, profiles/, docs/validation.md rows
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import pandas as pd
import yaml

from sim.core.catalog import ModelSpec, get_device, get_model, model_fields_from_hf_config
from sim.core.memory import vllm_memory_plan
from sim.costmodel import CostCoefficients, DeviceProfile
from sim.scenario import validate_scenario
from sim.vllm.results import VllmResult
from validate.vllm_fit import Replay, coefficients_from, fit_runs, run_errors

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
RUNS_FILE = DATA / "vllm_public" / "bench_runs.yaml"
LOGS_FILE = DATA / "vllm_public" / "startup_logs.yaml"
MODELS = {"Qwen/Qwen2-7B-Instruct": "qwen2.5-7b",           # Qwen2-7B: the Qwen2.5-7B shape
          "Qwen/Qwen3-32B": "hf:Qwen__Qwen3-32B-FP8",        # the FP8 checkpoint's shape, served in bf16
          "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b"}
GPUS = {"A100-80GB": "a100-80g", "A100-SXM-80GB": "a100-80g", "A100-40GB": "a100-40g",
        "H100-SXM-80GB": "h100-sxm", "H200-SXM-141GB": "h200", "L4": "l4"}
SUMMARY_METRICS = ("ttft_s", "tpot_s", "duration_s")


@dataclass
class PublicRun:
    entry: dict
    scenario: object
    replay: Replay

    @property
    def id(self) -> str:
        return self.entry["id"]

    @property
    def deployment(self) -> str:
        e = self.entry
        return f"{e['model']} / {e['gpu']['model']} / tp {e['tp']} / vLLM {e['vllm_version']}"


def skip_reason(entry: dict) -> Optional[str]:
    m = entry["metrics"]
    if entry["model"] not in MODELS:
        return "model shape not in the catalog or tests/data/hf_configs"
    if entry.get("quantization") or entry.get("kv_cache_dtype") not in (None, "auto"):
        return "quantized weights or KV cache: this comparison maps bf16 deployments only"
    if entry["gpu"]["model"] not in GPUS:
        return "GPU not in the catalog"
    if entry.get("max_concurrency") is not None:
        return "closed-loop client (--max-concurrency): not replayable as an open workload yet"
    if entry["dataset"].get("name") != "random":
        return "dataset lengths not fixed (ShareGPT): its length distribution is not in the file"
    if str(entry.get("request_rate")) != "inf":
        return "arrival times not in the file"
    if not all(m.get(k) for k in ("completed", "total_input_tokens", "total_output_tokens", "duration_s",
                                    "mean_ttft_ms", "mean_tpot_ms")):
        return "summary metrics missing"
    return None


def model_spec(entry: dict) -> ModelSpec:
    name = MODELS[entry["model"]]
    fields = (model_fields_from_hf_config(DATA / "hf_configs" / f"{name[3:]}.json") if name.startswith("hf:")
              else get_model(name).model_dump())
    # the served checkpoint is the bf16 one (a quantized run is skipped above): drop the shape
    # donor's quantization (Qwen3-32B borrows the Qwen3-32B-FP8 config's shape)
    return ModelSpec(**{**fields, "name": entry["model"].split("/")[-1].lower(),
                        "dtype": entry.get("dtype") or "bfloat16", "quantization": None})


def startup_logs() -> dict[str, dict]:
    return {e["id"]: e for e in yaml.safe_load(LOGS_FILE.read_text())["entries"]}


def scenario_for(entry: dict, logs: dict[str, dict]):
    """The deployment as a scenario: vLLM's defaults for the GPU, the run's flags, vLLM's KV pool."""
    model, device = model_spec(entry), get_device(GPUS[entry["gpu"]["model"]])
    engine = {k: entry[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len") if entry.get(k)}
    engine["gpu_memory_utilization"] = entry.get("gpu_memory_utilization") or 0.9
    # the engine alone, for all three sources: a calibration fits no pooled API-server time
    # (vllm_fit.without_default_front_end); validate/lodo.py's table replays the front end
    engine["front_end_s"] = 0.0
    # async scheduling: as the run states, else vLLM's default for its version (Scenario.async_scheduling)
    stated = entry.get("async_scheduling")
    engine["async_scheduling"] = bool(stated) if stated is not None else "auto"
    if entry.get("vllm_version"):
        engine["vllm_version"] = str(entry["vllm_version"])
    # the longest request of the run bounds what the deployment had to admit
    m = entry["metrics"]
    longest = round((m["total_input_tokens"] + m["total_output_tokens"]) / m["completed"])
    engine.setdefault("max_model_len", min(model.max_position_embeddings, max(4096, longest + 64)))
    raw = {"name": entry["id"], "model": model.model_dump(), "device": device.model_dump(),
           "parallelism": {"tp": entry["tp"]}, "engine": engine}
    scenario = validate_scenario(raw)
    log = logs.get(entry.get("startup_log_id") or "")
    blocks = (log or {}).get("printed", {}).get("num_gpu_blocks")
    if blocks is None:
        blocks = vllm_memory_plan(model, device, entry["tp"], engine["gpu_memory_utilization"],
                                  scenario.max_num_batched_tokens, scenario.max_num_seqs,
                                  vllm_version=entry.get("vllm_version")).num_blocks
        # vLLM served the run's longest request, so its pool held at least that (our plan can be ~1% low)
        blocks = max(blocks, -(-scenario.max_model_len // scenario.engine.block_size) + 1)
    scenario.engine.num_blocks = int(blocks)
    return scenario


def replay_for(entry: dict, scenario) -> Replay:
    """The run's own workload from its summary: mean lengths, its rate (inf: all at t=0)."""
    m = entry["metrics"]
    run = VllmResult(entry["id"], {"request_rate": entry.get("request_rate", "inf"), "model_id": entry["model"]},
                     {"completed": m["completed"], "duration": m["duration_s"],
                      "total_input_tokens": m["total_input_tokens"], "total_output_tokens": m["total_output_tokens"],
                      "mean_ttft_ms": m["mean_ttft_ms"], "mean_tpot_ms": m["mean_tpot_ms"]})
    return Replay.from_summary(run, scenario=scenario)


def public_runs(max_requests: Optional[int] = None) -> tuple[list[PublicRun], dict[str, int]]:
    """Every expressible run (and the count of the others by reason)."""
    logs = startup_logs()
    runs, skipped = [], {}
    for entry in yaml.safe_load(RUNS_FILE.read_text())["runs"]:
        reason = skip_reason(entry)
        if reason is None and max_requests is not None and entry["metrics"]["completed"] > max_requests:
            reason = f"more than {max_requests} requests (kept out to keep the table cheap)"
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        scenario = scenario_for(entry, logs)
        runs.append(PublicRun(entry, scenario, replay_for(entry, scenario)))
    return runs, skipped


def deployments(runs: list[PublicRun]) -> dict[str, list[PublicRun]]:
    out: dict[str, list[PublicRun]] = {}
    for run in runs:
        out.setdefault(run.deployment, []).append(run)
    return out


TRAIN_RUNS = 4      # the cheapest runs of a half are fitted: a replay per evaluation each


def run_cost(run: PublicRun) -> float:
    m = run.entry["metrics"]
    return m["total_input_tokens"] / 2048 + m["total_output_tokens"] / max(1, min(m["completed"], 256))


def fit_profile(train: list[PublicRun], max_iterations: int = 6) -> DeviceProfile:
    train = sorted(train, key=run_cost)[:TRAIN_RUNS]
    scenario = train[0].scenario
    names = ["compute_scale", "memory_scale", "step_host_s", "seq_host_s"]
    if scenario.parallelism.tp > 1:
        names.append("link_eff")
    base = CostCoefficients()
    params = fit_runs(scenario, [r.replay for r in train], SUMMARY_METRICS, names, base,
                      max_iterations=max_iterations, polish_evaluations=30)
    return DeviceProfile(coefficients_from(params, base), calibrated=True, device_name=scenario.device.name,
                         model_name=scenario.model.name,
                         source=f"calibrated on public runs {', '.join(r.id for r in train)}",
                         fit={"method": "vllm-public-runs", "runs": [r.id for r in train], "parameters": params})


def errors_of(run: PublicRun, coefficients: CostCoefficients, source: str, step_times: str = "datasheet") -> dict[str, float]:
    replay = run.replay
    if step_times != "datasheet":
        scenario = run.scenario.model_copy(deep=True)
        scenario.step_times = step_times
        replay = replace(replay, scenario=scenario)
    rows = run_errors(run.scenario, replay, coefficients, source, run.id)
    return {f"{source} {row['metric']}": row["error"] for row in rows}


def tables_cover(run: PublicRun) -> bool:
    from sim.optables import TablesUnavailable, tables_for

    s = run.scenario
    try:
        tables_for(s.device.name, s.model, s.parallelism.tp, s.max_num_batched_tokens, s.max_num_seqs,
                   s.max_model_len)
    except TablesUnavailable:
        return False
    return True


def fidelity_table(runs: list[PublicRun], profiles: dict[str, DeviceProfile]) -> pd.DataFrame:
    """One row per run: datasheet and calibrated-on-others errors (profiles keyed by run id)."""
    rows = []
    for run in runs:
        row = {"run": run.id, "deployment": run.deployment, "requests": len(run.replay.requests),
               "source": run.entry["source"]["url"]}
        row.update(errors_of(run, CostCoefficients(), "datasheet"))
        if tables_cover(run):
            row.update(errors_of(run, CostCoefficients(), "tables", step_times="tables"))
        if run.id in profiles:
            row.update(errors_of(run, profiles[run.id].coefficients, "calibrated"))
        rows.append(row)
    return pd.DataFrame(rows)


def calibrate_on_others(runs: list[PublicRun], progress=print, on_fit=None) -> dict[str, DeviceProfile]:
    """Per deployment with >= 2 runs, two alternating halves, each fitted on the other: every run
    is predicted by a profile that never saw it."""
    profiles = {}
    for name, group in deployments(runs).items():
        if len(group) < 2:
            continue
        halves = [group[0::2], group[1::2]]
        for k, held in enumerate(halves):
            train = halves[1 - k]
            progress(f"{name}: fitting on {len(train)} runs for {len(held)} held-out runs")
            profile = fit_profile(train)
            for run in held:
                profiles[run.id] = profile
                if on_fit:
                    on_fit(run.id, profile)
    return profiles


def main(argv: Optional[list[str]] = None) -> int:
    from sim.output.io import write_csv, write_text

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("reports/fidelity"))
    p.add_argument("--max-requests", type=int, default=None)
    args = p.parse_args(argv)
    runs, skipped = public_runs(args.max_requests)

    def save(run_id: str, profile: DeviceProfile) -> None:      # as each fit ends: a crash keeps them
        data = {"coefficients": {k: float(v) for k, v in profile.to_dict()["coefficients"].items()},
                "calibrated": True, "source": profile.source, "device_name": profile.device_name,
                "model_name": profile.model_name,
                "fit": {"method": profile.fit["method"], "runs": profile.fit["runs"],
                        "parameters": {k: float(v) for k, v in profile.fit["parameters"].items()}}}
        write_text(args.out / "profiles" / f"{run_id}.yaml", yaml.safe_dump(data, sort_keys=False))

    profiles = calibrate_on_others(runs, on_fit=save)
    table = fidelity_table(runs, profiles)
    write_csv(args.out / "table.csv", table)
    write_text(args.out / "skipped.yaml", yaml.safe_dump(skipped, sort_keys=False))
    print(table.drop(columns=["source"]).to_string(float_format=lambda v: f"{v:+.1%}"))
    print(summary_markdown(table))
    print("skipped:", skipped)
    return 0



def summary_markdown(table: pd.DataFrame) -> str:
    """Per deployment: runs, and the median |error| of each source on each metric."""
    sources = [s for s in ("datasheet", "tables", "calibrated") if any(c.startswith(s) for c in table.columns)]
    metrics = ("ttft", "tpot", "duration")
    head = "| deployment | runs | " + " | ".join(f"{s} {m}" for s in sources for m in metrics) + " |"
    lines = [head, "|" + "---|" * (2 + len(sources) * len(metrics))]
    for name, group in table.groupby("deployment", sort=False):
        cells = []
        for s in sources:
            for m in metrics:
                col = f"{s} {m}"
                values = group[col].dropna().abs() if col in group else pd.Series(dtype=float)
                cells.append(f"{values.median():.0%}" if len(values) else "n/a")
        lines.append(f"| {name} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
