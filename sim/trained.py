"""The trained step-time profile family (`step_times: trained`) and the error band of every answer.

The family (sim/core/catalog/trained-v<N>.yaml, written by `python -m validate.lodo`) holds per vLLM
engine generation (`engines`: v0, v1) and GPU class the coefficients fitted on public measured vLLM
runs of that generation (tests/data/vllm_public), a `generic` entry per generation for a GPU no run
of it measured, and the leave-one-deployment-out validation: per step-time source
(datasheet, tables, trained) and metric, the typical error (median |error| over held-out
deployments). That validation is the band a prediction states, never a typed-in number; a
calibrated profile states the error of its own held-out run instead.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

from sim.core.files import load_package_yaml, read_yaml

FAMILY_VERSION = 1
FAMILY_FILE = Path(__file__).resolve().parent / "core" / "catalog" / f"trained-v{FAMILY_VERSION}.yaml"
# the summary's figures and the validated metric each is judged by
BAND_METRICS = {"ttft_p99": "ttft_p99", "tpot_p99": "tpot_p99", "e2e_p99": "e2e_p99", "ttft_mean": "ttft_mean",
                "tpot_mean": "tpot_mean", "e2e_mean": "e2e_mean", "throughput": "throughput"}
# a calibrated profile's held-out errors (validate/vllm_fit.py) are of means; duration stands for throughput
CALIBRATED_METRICS = {"ttft": ("ttft_mean", "ttft_p99"), "tpot": ("tpot_mean", "tpot_p99"),
                      "e2e": ("e2e_mean", "e2e_p99"), "duration": ("throughput",)}


@lru_cache(maxsize=4)
def family(path: Path = FAMILY_FILE) -> dict:
    raw = (load_package_yaml(path.read_text()) if path == FAMILY_FILE
           else read_yaml(path, "trained profile family (YAML)"))
    engines = raw.get("engines") if isinstance(raw, dict) else None
    if not isinstance(engines, dict) or not engines:
        raise ValueError(f"{path}: a trained profile family needs 'engines' (per vLLM engine generation)")
    for name, entry in engines.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("classes"), dict) or "generic" not in entry:
            raise ValueError(f"{path}: engines.{name} needs 'classes' and 'generic'")
    return raw


# A class's own fit prices its GPU only where leave-one-deployment-out could test a fit of that class
# on a deployment it never saw, i.e. the class has two deployments or more. A fit on one deployment
# was never tested (the table predicts that deployment with the generic entry), and the three V1
# ones sit on their search bounds: L4's compute scale fitted on Qwen2.5-0.5B alone, its floor 0.14,
# priced Llama-3.1-8B's prefill at ~8 % of the L4's peak (the quickstart met none of its SLOs).
# validate/lodo.py's generic applies the same rule to the classes the generic entry averages: a fit
# on its search bounds is no evidence of a typical GPU either.
MIN_CLASS_DEPLOYMENTS = 2


def tested_class(deployment_count: int) -> bool:
    """Does a class fitted on `deployment_count` deployments price its own GPU (and enter the
    generation's generic entry)? Only where leave-one-deployment-out could test it: MIN_CLASS_DEPLOYMENTS."""
    return deployment_count >= MIN_CLASS_DEPLOYMENTS


def family_entry(device_name: str, engine: str) -> tuple[dict, Optional[dict]]:
    """The parameters `step_times: trained` prices a `device_name` GPU with under vLLM engine
    generation `engine`, and the class entry they come from (None: the generation's generic
    profile, for a GPU no run of that generation measured or a class of one deployment)."""
    engines = family()["engines"]
    if engine not in engines:
        raise ValueError(f"the trained family has no fit for vLLM engine generation {engine!r} "
                         f"(it has {sorted(engines)})")
    entry = class_entry(device_name, engine)
    if entry and tested_class(len(entry["deployments"])):
        return entry["parameters"], entry
    return engines[engine]["generic"], None


def class_entry(device_name: str, engine: str) -> Optional[dict]:
    """The family's fit of `device_name`'s class under `engine`, used or not (None: no run measured it)."""
    return family()["engines"].get(engine, {}).get("classes", {}).get(device_name)


def front_end_default(engine: str, name: str = "front_end_s") -> float:
    """The API-server time the family fitted for vLLM engine generation `engine` (the default of
    engine.`name` unset on a vLLM server): per request (front_end_s), per streamed token
    (front_end_token_s) or per engine step's outputs (front_end_step_s), 0 where it has none (V0: no V0 run went through an API server). A family
    file that cannot be read raises, as it does for the step-time parameters."""
    return float(family()["engines"].get(engine, {}).get(name, 0.0))


# The trained parameters and what each scales (operator kinds; the rest are datasheet facts):
SCALED = {"compute_scale": ("flops_eff", "attn_flops_eff"),  # GEMM and prefill-attention compute
          "memory_scale": ("bw_eff", "attn_bw_eff")}           # weight and KV streaming
# host time per step; tp all-reduce link terms; (V1) the fused-MoE kernel's half-efficiency expert slice
# width; (V0) host time per sequence per step, per admitted prompt and per eagerly launched layer. A family
# may also carry an NVLink all-reduce's own latency, vLLM's custom all-reduce apart from NCCL's ring and the
# share of the expert GEMMs' time the fused-MoE kernel leaves unhidden (sim.costmodel), which validate/lodo.py
# fitted once and did not adopt (see its list after FIT_NAMES)
TERMS = ("step_host_s", "link_eff", "host_staging_eff", "expert_n_half", "seq_host_s", "prefill_seq_host_s",
         "eager_layer_host_s", "allreduce_latency_s", "custom_allreduce_eff", "expert_serial_share")
# sim.costmodel applies them (trained_coefficients, trained_profile): this module holds no cost model


def error_band(source: str, profile=None, engine: str = "v1") -> Optional[dict]:
    """How far a prediction of this step-time source is typically off, per summary metric:
    {"source", "basis", metric: {"typical", "deployments"}}; None when nothing validates it.
    `engine` (the scenario's Scenario.engine_generation): the band comes
    from the held-out deployments of that vLLM engine generation where the family validated any."""
    if source.startswith("calibrated"):
        return _calibrated_band(profile)
    try:
        validation = family()["validation"]
        per_engine = (validation.get("bands_by_engine") or {}).get(engine, {}).get(source)
        validated = per_engine or validation["bands"].get(source)
    except (OSError, ValueError, KeyError):
        return None
    if not validated:
        return None
    runs = f"public vLLM {engine.upper()} runs" if per_engine else "public vLLM runs"
    out = {"source": source, "basis": f"leave-one-deployment-out validation on {runs} (trained v{family()['version']})"}
    for metric, key in BAND_METRICS.items():
        if key in validated:
            out[metric] = {"typical": validated[key]["typical"], "deployments": validated[key]["deployments"]}
    return out


def _calibrated_band(profile) -> Optional[dict]:
    rows = [r for r in ((profile.fit or {}).get("errors") or []) if r.get("role") == "held out"] if profile else []
    if not rows:
        return None
    out = {"source": "calibrated", "basis": f"the profile's held-out run ({rows[0].get('run')})"}
    for row in rows:
        for metric in CALIBRATED_METRICS.get(row.get("metric"), ()):
            out[metric] = {"typical": round(abs(float(row["error"])), 4), "deployments": 1}
    return out


def band_words(band: Optional[dict], metric: str) -> str:
    """`(typical error +-9 %, from 14 held-out deployments)`, or '' without a band."""
    entry = (band or {}).get(metric)
    if not entry:
        return ""
    where = ("from its held-out run" if band["source"] == "calibrated"
             else f"from {entry['deployments']} held-out deployments")
    return f" (typical error +-{entry['typical'] * 100:.0f} %, {where})"
