"""Regenerate docs/whatif/disaggregation.png and its table: 4 H100s split into prefill and decode
engines (the best of 1P3D, 2P2D, 3P1D at each rate) against the same 4 GPUs co-located.

    .venv/bin/python scripts/make_disaggregation_plot.py [--jobs N]

Runs scenarios/whatif_disaggregation.yaml at a range of rates (each over the scenario's arrival
window, as `simrun plan` probes) for long (6000-token) and short (500-token) prompts, and reads
each run's SLO attainment (requests with TTFT <= 2 s and TPOT within the limit, over all sent)
for a tight and a loose TPOT limit.
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.metrics import meets_slo  # noqa: E402
from sim.scenario import Slo, load_scenario  # noqa: E402
from sim.whatif.sweep_output import save_png  # noqa: E402

SCENARIO = ROOT / "scenarios" / "whatif_disaggregation.yaml"
RATES = (2, 4, 6, 8, 10, 12, 14)
PROMPTS = (6000, 500)
LAYOUTS = {"co-located 4": None, "1P3D": (1, 3), "2P2D": (2, 2), "3P1D": (3, 1)}
TTFT_S = 2.0
TPOT_LIMITS = (0.012, 0.05)


def point(item: tuple[int, float, str]) -> dict:
    from sim.predict import predict

    prompt, rate, layout = item
    sets = ["variants={}", f"workload.prompt_len={prompt}", f"workload.arrival.rate={rate}",
            f"workload.num_requests={int(150 * rate)}", f"workload.warmup_requests={int(12 * rate)}"]
    split = LAYOUTS[layout]
    sets += (["cluster.disaggregation=null", "cluster.replicas=4"] if split is None else
             [f"cluster.disaggregation.prefill.replicas={split[0]}", f"cluster.disaggregation.decode.replicas={split[1]}"])
    result = predict(load_scenario(SCENARIO, sets), manifest=False)
    df = result.requests[~result.requests["is_warmup"].astype(bool)]
    done = df[df["status"] == "finished"]
    row = {"prompt": prompt, "rate": rate, "layout": layout,
           "ttft_p99": result.summary["ttft_s"]["p99"], "tpot_p99": result.summary["tpot_s"]["p99"]}
    for limit in TPOT_LIMITS:
        row[f"attainment@{limit:g}"] = float(meets_slo(done, Slo(ttft_s=TTFT_S, tpot_s=limit)).sum() / len(df))
    return row


def best_split(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per (prompt, rate): the split with the highest attainment (then the lowest TTFT p99)."""
    split = frame[frame["layout"] != "co-located 4"].sort_values([column, "ttft_p99"], ascending=[False, True])
    return split.groupby(["prompt", "rate"]).head(1).set_index(["prompt", "rate"]).sort_index()


def plot(frame: pd.DataFrame):
    from matplotlib.figure import Figure

    panels = [(6000, TPOT_LIMITS[0]), (6000, TPOT_LIMITS[1]), (500, TPOT_LIMITS[0])]
    fig = Figure(figsize=(13, 3.9), layout="constrained")
    for ax, (prompt, limit) in zip(fig.subplots(1, 3, sharey=True), panels):
        column = f"attainment@{limit:g}"
        mine = frame[frame["prompt"] == prompt]
        co = mine[mine["layout"] == "co-located 4"].set_index("rate")[column]
        best = best_split(mine, column)
        ax.plot(co.index, co.values, "o-", color="C0", label="4 co-located engines")
        ax.plot(best.index.get_level_values("rate"), best[column].values, "s-", color="C2",
                label="best xPyD split of 4 GPUs")
        for (_, rate), row in best.iterrows():
            ax.annotate(row["layout"], (rate, row[column]), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize="x-small", color="C2")
        ax.axhline(0.9, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{prompt}-token prompts, TTFT <= {TTFT_S:g} s, TPOT <= {limit * 1e3:g} ms", fontsize="small")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.axes[0].set_ylabel("SLO attainment")
    fig.axes[0].legend(loc="lower left", fontsize="small")
    fig.suptitle("Llama-3.1-8B on 4 x H100 (KV over 400 Gb/s RDMA): prefill/decode split vs co-located")
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    items = [(p, float(r), layout) for p in PROMPTS for r in RATES for layout in LAYOUTS]
    with ProcessPoolExecutor(args.jobs) as pool:
        frame = pd.DataFrame(list(pool.map(point, items)))
    save_png(plot(frame), ROOT / "docs" / "whatif" / "disaggregation.png")
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(frame.round(4).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
