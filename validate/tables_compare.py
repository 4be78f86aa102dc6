"""Roofline vs measured operator tables, per catalog device, and the efficiencies the tables imply.

For a reference model (Llama-3.1-8B, bf16, tp 1) the device time of a decode grid (batch x context)
and a prefill grid (chunk sizes) is priced both ways. The roofline's compute and memory scales
that best match the tables (least squares on log time, decode and prefill together) give the
re-derived default efficiencies: flops_eff / attn_flops_eff and bw_eff / attn_bw_eff.

    python -m validate.tables_compare            # prints docs/validation.md's table
"""
from __future__ import annotations

import numpy as np

from sim.core.catalog import get_device, get_model
from sim.costmodel import CostCoefficients, CostModel, DeviceProfile
from sim.optables import SYSTEMS, tables_for
from validate.vllm_fit import coefficients_from

DECODE = [(b, c) for b in (1, 8, 32, 128) for c in (512, 2048, 8192)]
PREFILL = [256, 1024, 4096, 8192]


def grid_steps(block_size: int = 16) -> dict[str, np.ndarray]:
    rows = [(b, b, 0, b * c, 0, 0, b * -(-c // block_size)) for b, c in DECODE]
    rows += [(1, 0, p, 0, 0, p * (p + 1) // 2, -(-p // block_size)) for p in PREFILL]
    names = ("num_seqs", "decode_seqs", "prefill_tokens", "decode_ctx", "prefill_ctx", "prefill_attn", "blocks_read")
    return {n: np.array(col, dtype=float) for n, col in zip(names, zip(*rows))}


def compare(device_name: str, model_name: str = "llama-3.1-8b") -> dict:
    from scipy.optimize import least_squares

    model, device = get_model(model_name), get_device(device_name)
    steps = grid_steps()
    tables = tables_for(device_name, model, 1, 8192, 256, 16384)
    table_time = CostModel(model, device, 1, tables=tables).step_times(steps)[1]
    roof_time = CostModel(model, device, 1).step_times(steps)[1]
    base = CostCoefficients()

    def residuals(x):
        coeffs = coefficients_from({"compute_scale": np.exp(x[0]), "memory_scale": np.exp(x[1])}, base)
        return np.log(CostModel(model, device, 1, DeviceProfile(coeffs)).step_times(steps)[1] / table_time)

    fit = least_squares(residuals, [0.0, 0.0], diff_step=1e-3)
    derived = coefficients_from({"compute_scale": np.exp(fit.x[0]), "memory_scale": np.exp(fit.x[1])}, base)
    ratio = roof_time / table_time
    n = len(DECODE)
    return {"device": device_name, "tables": tables.describe(),
            "decode_ratio_median": float(np.median(ratio[:n])), "decode_ratio_range": (float(ratio[:n].min()), float(ratio[:n].max())),
            "prefill_ratio_median": float(np.median(ratio[n:])), "prefill_ratio_range": (float(ratio[n:].min()), float(ratio[n:].max())),
            "flops_eff": derived.flops_eff, "bw_eff": derived.bw_eff,
            "attn_flops_eff": derived.attn_flops_eff, "attn_bw_eff": derived.attn_bw_eff,
            "fit_rms_log_error": float(np.sqrt(np.mean(fit.fun ** 2)))}


def markdown(rows: list[dict]) -> str:
    lines = ["| device | tables | roofline / tables, decode (median, range) | prefill (median, range) | "
             "derived bw_eff | derived flops_eff | fit rms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['device']} | {r['tables'].split('(')[1].rstrip(')')} | {r['decode_ratio_median']:.2f} "
                     f"({r['decode_ratio_range'][0]:.2f}-{r['decode_ratio_range'][1]:.2f}) | "
                     f"{r['prefill_ratio_median']:.2f} ({r['prefill_ratio_range'][0]:.2f}-{r['prefill_ratio_range'][1]:.2f}) | "
                     f"{r['bw_eff']:.2f} | {r['flops_eff']:.2f} | {r['fit_rms_log_error']:.0%} |")
    return "\n".join(lines)


def main() -> int:
    rows = [compare(name) for name in SYSTEMS if SYSTEMS[name][1] is None]
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
