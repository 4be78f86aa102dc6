"""One prediction end to end: simulate a scenario, summarise it, write its files.

Used by `simrun` (each variant), by sweeps and searches, and by the validation harness
(the predicted side of predicted-vs-measured).
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd

from sim import stop
from sim.costmodel import CostModel
from sim.core.memory import MemoryPlan
from sim.metrics import summarise
from sim.records import RunRecords, requests_frame
from sim.core.request import Request
from sim.simulator import simulate
from sim.workload import build_workload


@dataclass
class RunResult:
    name: str
    scenario: Any
    records: RunRecords
    plan: MemoryPlan
    cost_model: Optional[CostModel]        # None for a measured run
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    manifest: dict = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)


def predict(scenario, name: Optional[str] = None,
            progress: Optional[Callable[[int], None]] = None, manifest: bool = True) -> RunResult:
    """Simulate and summarise; nothing is written. Without `manifest` (a sweep point whose files
    are not written) the manifest is left empty: hashing the workload costs a few % of a point.
    Stops with stop.StopRequested at its checks (here, and every 256 finished requests through the
    progress callback) once a signal asked."""
    stop.check()
    workload = build_workload(scenario)
    stop.check()
    described = workload_manifest(workload.requests, workload.notes) if manifest else None
    # the run takes the requests over and lets each go once its figures are recorded
    records, plan, cost_model = simulate(scenario, workload.requests, progress=stop.polling(progress), release=True)
    stop.check()
    req_df = requests_frame(records)
    steps_df = records.steps_frame()
    summary = summarise(records, scenario.slo, req_df, steps_df)
    summary["calibrated"] = cost_model.calibrated
    summary["step_time_source"] = cost_model.step_time_source
    summary["memory"] = memory_summary(plan, scenario.max_model_len)
    info = {}
    if described is not None:
        info = simulation_manifest(scenario, cost_model, plan, described)
        info["simulation_wall_s"] = records.meta.get("wall_s")
    return RunResult(name or scenario.name, scenario, records, plan, cost_model, summary,
                     req_df, steps_df, info)


def memory_summary(plan: MemoryPlan, max_model_len: Optional[int] = None) -> dict:
    """Where the memory goes; vLLM's "Maximum concurrency" is the pool over max_model_len requests.
    Under vLLM's plan reserved_bytes = non_torch_bytes + cudagraph_bytes, off a budget of
    utilization x visible_bytes (the simple plan: visible = the datasheet memory, both terms 0)."""
    return {"memory_plan": plan.memory_plan, "vllm_version": plan.vllm_version,
            "visible_bytes": plan.visible_bytes, "budget_bytes": plan.budget_bytes,
            "non_torch_bytes": plan.non_torch_bytes, "cudagraph_bytes": plan.cudagraph_bytes,
            "kv_bytes_per_token": plan.kv_bytes_per_token, "block_bytes": plan.block_bytes,
            "num_blocks": plan.num_blocks, "usable_blocks": plan.usable_blocks,
            "kv_pool_bytes": plan.kv_pool_bytes, "weight_bytes": plan.weight_bytes,
            "activation_bytes": plan.activation_bytes, "reserved_bytes": plan.reserved_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes, "max_tokens": plan.max_tokens,
            "max_concurrency_at_max_model_len": plan.max_concurrency(max_model_len) if max_model_len else None}


# ----------------------------------------------------------------------------- manifest

def kvtwin_version() -> str:
    try:
        return metadata.version("kvtwin")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_commit() -> Optional[str]:
    """HEAD (with -dirty), or KVTWIN_GIT_COMMIT where the tree travelled without .git (a GPU box)."""
    if os.environ.get("KVTWIN_GIT_COMMIT"):
        return os.environ["KVTWIN_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def workload_digest(requests: list[Request]) -> str:
    """A fingerprint of the workload: arrivals, lengths and prompt segments of every request."""
    h = hashlib.sha256()
    for r in requests:
        segs = [s if isinstance(s, tuple) else ("lit", len(s), hash(tuple(s))) for s in r.segments[:-1]]
        h.update(repr((r.id, r.arrival, r.prompt_len, r.output_len, r.tenant, r.priority, segs)).encode())
    return h.hexdigest()[:16]


def length_stats(requests: list[Request]) -> dict:
    import numpy as np

    out = {}
    for key, values in (("prompt_tokens", [r.prompt_len for r in requests]),
                        ("output_tokens", [r.output_len for r in requests])):
        a = np.asarray(values, dtype=float)
        out[key] = ({"mean": float(a.mean()), "p50": float(np.median(a)), "p90": float(np.percentile(a, 90)),
                     "p99": float(np.percentile(a, 99)), "min": int(a.min()), "max": int(a.max())}
                    if a.size else {})
    return out


def workload_manifest(requests: list[Request], notes: list[str]) -> dict:
    """The manifest's workload entry (taken before a run that releases the requests)."""
    return {"requests": len(requests), "digest": workload_digest(requests), "lengths": length_stats(requests),
            "notes": notes}


def simulation_manifest(scenario, cost_model: CostModel, plan: MemoryPlan, workload: dict) -> dict:
    return {
        "kind": "prediction",
        "kvtwin_version": kvtwin_version(),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "seed": scenario.seed,
        "calibrated": cost_model.calibrated,
        "cost_model": cost_model.describe(),
        "memory_plan": plan.to_dict(),
        "workload": workload,
        "scenario": scenario.model_dump(mode="json"),
    }
