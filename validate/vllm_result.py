"""`vllm bench serve --save-result` files as measured runs (sim.vllm.results reads them): the
per-request lists with --save-detailed, the aggregate mean/median/p99 fields otherwise, and
the file's workload checked against the scenario's (a comparison on another workload means
nothing), or replayed as the scenario's workload."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from sim.core.lazy import lazy_import
from sim.errors import UserError
from validate.measured import Measured, apply_timeline, complete_frame, measured_summary

np = lazy_import("numpy")
pd = lazy_import("pandas")

# A workload whose request count or mean/p90 lengths differ from the scenario's by more
# than this is flagged: its comparison with the prediction would not mean anything.
WORKLOAD_TOLERANCE = 0.10


def read_vllm_result(path: Path, scenario, run=None, file_workload: bool = False) -> Measured:
    """A `vllm bench serve --save-result` run (the file's only one, or `run`) as a measured run
    of `scenario`. With `file_workload` the scenario replays the file's own requests, so the
    workload is not checked against it."""
    if run is None:
        runs = load_vllm_runs(path)
        if len(runs) > 1:
            raise UserError(f"--vllm-result {path}: {len(runs)} runs (--append-result); compare them "
                            f"as a sweep with `simrun compare` (it does so for such files)")
        run = runs[0]
    data = {**run.config, **run.metrics, **run.per_request}
    if "duration" not in data:
        raise UserError(f"--vllm-result {run.source}: not a `vllm bench serve` result (no 'duration')")
    detailed = all(k in data for k in ("ttfts", "itls", "input_lens", "output_lens"))
    summary, frame = (_detailed_summary(data, scenario) if detailed else (_aggregate_summary(data), None))
    notes = [] if file_workload else workload_mismatches(data, scenario, detailed)
    if notes:
        notes.append("the file's workload is not the scenario's: until they match, this comparison means "
                     "nothing (--use-file-workload replays the file's own requests)")
    notes = model_mismatches(data, scenario) + notes
    meta_keys = ("date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                 "burstiness", "max_concurrency", "duration", "completed", "failed")
    manifest = {"kind": "vLLM benchmark result", "file": run.source, "per_request": detailed,
                "vllm": {k: data[k] for k in meta_keys if k in data}, "notes": notes,
                "workload_from_file": file_workload, "scenario": scenario.model_dump(mode="json")}
    return Measured(summary, frame if frame is not None else complete_frame([]), manifest,
                    run_t0_wall=_result_start_wall(data))


def load_vllm_runs(path: Path) -> list:
    """Every run of a result file (JSON, a JSON array, or --append-result JSON Lines)."""
    from sim.vllm.results import VllmResultError, load_results

    try:
        return load_results(path)
    except VllmResultError as e:
        raise UserError(f"--vllm-result {e}") from None


def file_workload_scenario(scenario, run) -> tuple[Any, list[str]]:
    """`scenario` with the run's own requests as its workload: each request's send time (start_times,
    else vLLM's arrival process drawn again), prompt and output length; failed requests left out."""
    from sim.scenario import ExplicitRequest, Workload
    from sim.vllm.results import arrival_times

    if not run.detailed:
        raise UserError(f"--use-file-workload: {run.source} has no per-request lengths; run `vllm bench "
                        f"serve` with --save-detailed")
    from pydantic import ValidationError

    from sim.scenario import describe_validation_error

    rows = run.requests()
    if not rows:
        raise UserError(f"--use-file-workload: {run.source} holds no finished request to replay")
    times, notes = arrival_times(run, len(rows), scenario.seed)
    t0 = float(times.min())
    starts_known = rows[0][0] is not None
    # Without send times the arrivals are redrawn, and the client's cap has to be simulated.
    cap = None if starts_known else run.max_concurrency
    try:          # the file's values as a workload: a bad one is a line naming the file and field
        requests = [ExplicitRequest(arrival_s=float(t - t0), prompt_len=max(inp, 1), output_len=max(out, 1))
                    for t, (_, inp, out) in zip(times.tolist(), rows)]
        workload = Workload(requests=requests, tenants=scenario.workload.tenants, max_concurrency=cap)
    except ValidationError as e:
        raise UserError(f"--use-file-workload {run.source}: {describe_validation_error(e, Workload)[0]} "
                        f"(the file's requests as workload.requests)") from None
    notes += run.excluded_notes()
    notes.append(f"workload: the {len(requests)} requests of {run.source} (their send times and lengths); "
                 f"each prompt is unique (vLLM's file records no prefix sharing)")
    return scenario.model_copy(update={"workload": workload}), notes


def _result_start_wall(data: dict) -> Optional[float]:
    """When the benchmark started, from its `date` (local time, written at the end) less its
    duration; on the log's clock (local time read as UTC). None when the file has no date."""
    import datetime as dt

    try:
        end = dt.datetime.strptime(str(data.get("date")), "%Y%m%d-%H%M%S").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return None
    return end.timestamp() - float(data["duration"])


def _detailed_summary(data: dict, scenario) -> tuple[dict, pd.DataFrame]:
    n = len(data["ttfts"])
    errors = data.get("errors") or [""] * n
    starts = data.get("start_times")
    latencies = data.get("latencies")
    rows = []
    for i in range(n):
        ok = not errors[i]
        itl = data["itls"][i] or []
        e2e = latencies[i] if latencies and latencies[i] else data["ttfts"][i] + sum(itl)
        rows.append({"id": i, "is_warmup": False, "status": "finished" if ok else "failed",
                     "reject_reason": errors[i] or None,
                     "arrival_s": starts[i] - min(starts) if starts else 0.0,
                     "prompt_tokens": data["input_lens"][i], "output_tokens": data["output_lens"][i],
                     "ttft_s": data["ttfts"][i] if ok else math.nan, "e2e_s": e2e if ok else math.nan})
    frame = complete_frame(rows)
    itl = [g for i in range(n) if not errors[i] for g in (data["itls"][i] or [])]
    summary = measured_summary(frame, np.asarray(itl), scenario.slo, 0, scenario.engine.block_size)
    _over_duration(summary, float(data["duration"]))
    apply_timeline(summary, None, 0)
    return summary, frame


def _over_duration(summary: dict, duration: float) -> None:
    """vLLM's throughputs divide by the whole send/receive phase, its `duration`."""
    old = summary["duration_s"]
    for key in ("request_throughput", "output_token_throughput", "total_token_throughput", "goodput"):
        if summary.get(key) is not None and old:
            summary[key] *= old / duration
    summary["duration_s"] = duration


def _aggregate_summary(data: dict) -> dict:
    """Without --save-detailed vLLM keeps only aggregates: mean, median and the percentiles asked."""
    def dist(metric: str) -> dict:
        out = {"mean": data.get(f"mean_{metric}_ms"), "p50": data.get(f"median_{metric}_ms"),
               "p90": data.get(f"p90_{metric}_ms"), "p99": data.get(f"p99_{metric}_ms"), "max": None}
        return {k: None if v is None else v / 1e3 for k, v in out.items()}

    completed = data.get("completed")
    failed = data.get("failed") or 0
    return {"requests_total": (completed or 0) + failed, "requests_finished": completed,
            "requests_failed": failed, "requests_measured": completed, "duration_s": data["duration"],
            "request_throughput": data.get("request_throughput"),
            "output_token_throughput": data.get("output_throughput"),
            "total_token_throughput": data.get("total_token_throughput"),
            "goodput": data.get("request_goodput"),
            "ttft_s": dist("ttft"), "tpot_s": dist("tpot"), "itl_s": dist("itl"), "e2e_s": dist("e2el"),
            "partial": bool(failed), "per_request": False}


def model_mismatches(data: dict, scenario) -> list[str]:
    """The file's model_id, when it names a catalog model (its hf_id, or the base model of it) other
    than the scenario's: the comparison would set one model's prediction against another's
    measurement. An id the catalog does not know (a fine-tune, a local path) says nothing."""
    from sim.core.catalog import get_model
    from sim.core.files import excerpt
    from sim.vllm.serve_flags import catalog_model

    model_id = data.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        return []
    try:
        theirs = catalog_model(model_id, None)
    except UserError:
        return []
    ours = scenario.model.name
    if not isinstance(theirs, str) or theirs == ours or get_model(theirs).hf_id == scenario.model.hf_id:
        return []        # (the same checkpoint under a name of the scenario's own: `model: {base: ..., name: ...}`)
    return [f"the file measured {excerpt(model_id, 80)} (catalog {theirs}), the scenario models {ours}: this "
            f"comparison means nothing until the scenario's model is the file's (model: {theirs})"]


def workload_mismatches(data: dict, scenario, detailed: bool) -> list[str]:
    """Ways the file's workload differs from the scenario's (empty when they agree)."""
    from sim.workload import build_workload

    requests = build_workload(scenario).requests
    steady = [r for r in requests if not r.is_warmup]
    notes = []
    count = len(data["input_lens"]) if detailed else data.get("num_prompts") or data.get("completed") or 0
    if count not in (len(requests), len(steady)):
        notes.append(f"the file holds {count} requests, the scenario {len(requests)}")
    if detailed:
        ok = [i for i, e in enumerate(data.get("errors") or [""] * count) if not e]
        pairs = (("prompt", data["input_lens"], [r.prompt_len for r in steady]),
                 ("output", [data["output_lens"][i] for i in ok], [r.output_len for r in steady]))
    else:
        done = data.get("completed") or 1
        pairs = (("prompt", [data.get("total_input_tokens", 0) / done], [r.prompt_len for r in steady]),
                 ("output", [data.get("total_output_tokens", 0) / done], [r.output_len for r in steady]))
    for what, theirs, ours in pairs:
        notes += _length_mismatch(what, np.asarray(theirs, dtype=float), np.asarray(ours, dtype=float), detailed)
    notes += _arrival_mismatch(data, scenario.workload.arrival)
    theirs, ours = data.get("max_concurrency"), scenario.workload.max_concurrency
    if theirs not in (None, "None", "") and int(theirs) != ours:
        notes.append(f"the file's client kept at most {theirs} requests in flight (--max-concurrency), the "
                     f"scenario {ours or 'no limit'} (workload.max_concurrency)")
    elif theirs in (None, "None", "") and ours is not None and "max_concurrency" in data:
        notes.append(f"the scenario's client keeps at most {ours} requests in flight, the file's had no limit")
    return notes


def _length_mismatch(what: str, theirs: np.ndarray, ours: np.ndarray, detailed: bool) -> list[str]:
    if not len(theirs) or not len(ours):
        return []
    stats = (("mean", np.mean), ("p90", lambda a: np.percentile(a, 90))) if detailed else (("mean", np.mean),)
    return [f"{what} lengths: {name} {fn(theirs):.1f} in the file vs {fn(ours):.1f} in the scenario"
            for name, fn in stats if abs(fn(theirs) - fn(ours)) > WORKLOAD_TOLERANCE * fn(ours)]


def _arrival_mismatch(data: dict, arrival) -> list[str]:
    rate = data.get("request_rate")
    if rate is None:
        return []
    if rate == "inf" or (isinstance(rate, (int, float)) and math.isinf(rate)):
        return [] if arrival.process == "offline" else [
            f"the file sent every request at t=0 (request_rate inf), the scenario arrives {arrival.process} "
            f"at {arrival.rate}/s"]
    if arrival.rate is None or abs(float(rate) - arrival.rate) > WORKLOAD_TOLERANCE * arrival.rate:
        return [f"request rate {rate}/s in the file vs {arrival.rate or 'offline'} in the scenario"]
    return []
