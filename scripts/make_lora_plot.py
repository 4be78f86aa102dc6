"""Draw docs/whatif/lora.png: throughput and TTFT against the number of LoRA adapters the requests
spread over, for vLLM's --max-loras 1, 4 and 8, with a skewed (zipf, s = 1) and a uniform mix, from
scenarios/whatif_lora.yaml.

    .venv/bin/python scripts/make_lora_plot.py [--out docs/whatif/lora.png]

Each point is `simrun scenarios/whatif_lora.yaml --set workload.lora.num_adapters=N --set
engine.lora.max_loras=M --set workload.lora.distribution=D`, and the base model alone (no LoRA) is
the reference line. It prints the table docs/whatif/lora.md quotes, and kvtwin's figures for vLLM's
published LoRA throughput measurement (PUBLISHED).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.predict import predict  # noqa: E402
from sim.scenario import load_scenario, validate_scenario  # noqa: E402

SCENARIO = ROOT / "scenarios" / "whatif_lora.yaml"
ADAPTERS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_LORAS = (1, 4, 8)
MIXES = ("zipf", "uniform")


def point(sets: list[str]) -> tuple[float, float]:
    """(output tok/s, TTFT p50 s) of the scenario with `sets`."""
    s = predict(load_scenario(SCENARIO, sets), manifest=False).summary
    return s["output_token_throughput"], s["ttft_s"]["p50"]


# vLLM's own LoRA throughput runs (1x A100, meta-llama/Llama-2-7b-hf, benchmark_throughput.py over
# 1000 ShareGPT prompts, the adapter yard1/llama-2-7b-sql-lora-test of rank 8 for every request,
# --max-loras 4 --max-lora-rank 8): without LoRA 11.45 req/s (V0, https://github.com/vllm-project/vllm/pull/11267);
# with LoRA on V1 with CUDA graphs 10.96 req/s (https://github.com/vllm-project/vllm/pull/11613).
PUBLISHED_BASE_REQ_S = 11.45
PUBLISHED_LORA_REQ_S = 10.96


def published_comparison(device: str) -> tuple[float, float]:
    """kvtwin's (req/s without LoRA, req/s with it) for that run on `device`."""
    def run(lora: bool) -> float:
        engine: dict = {"max_num_seqs": 256}
        workload: dict = {"num_requests": 1000, "arrival": {"process": "offline"},
                          "prompt_len": {"dist": "sharegpt"}, "output_len": {"dist": "sharegpt"}}
        if lora:
            engine["lora"] = {"max_loras": 4, "max_lora_rank": 8}
            workload["lora"] = {"num_adapters": 1, "rank": 8}
        s = validate_scenario({"model": "llama-2-7b", "device": device, "engine": engine, "workload": workload})
        return predict(s, manifest=False).summary["request_throughput"]
    return run(False), run(True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "whatif" / "lora.png")
    args = p.parse_args()
    base = point(["engine.lora=null", "workload.lora=null"])
    lines = {}
    for mix in MIXES:
        for m in MAX_LORAS:
            lines[(mix, m)] = [point([f"engine.lora.max_loras={m}", f"workload.lora.distribution={mix}",
                                      f"workload.lora.num_adapters={n}"]) for n in ADAPTERS]
    print(f"base model alone: {base[0]:,.0f} output tok/s, TTFT p50 {base[1] * 1e3:,.0f} ms")
    print("| adapters | " + " | ".join(f"{mix} max_loras {m}" for mix, m in lines) + " |")
    print("|---" * (len(lines) + 1) + "|")
    for i, n in enumerate(ADAPTERS):
        print(f"| {n} | " + " | ".join(f"{v[i][0]:,.0f} tok/s, {v[i][1] * 1e3:,.0f} ms" for v in lines.values()) + " |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sim.whatif.sweep_output import save_png

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {1: "tab:red", 4: "tab:blue", 8: "tab:green"}
    for (mix, m), values in lines.items():
        style = "-" if mix == "zipf" else "--"
        label = f"max_loras {m}, {mix}"
        left.plot(ADAPTERS, [v[0] for v in values], style, marker="o", color=colors[m], label=label)
        right.plot(ADAPTERS, [v[1] * 1e3 for v in values], style, marker="o", color=colors[m], label=label)
    left.axhline(base[0], color="grey", lw=1, label="base model, no LoRA")
    right.axhline(base[1] * 1e3, color="grey", lw=1, label="base model, no LoRA")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("adapters the requests spread over")
        ax.grid(alpha=0.3)
    right.set_yscale("log")
    left.set_ylabel("output tokens/s")
    right.set_ylabel("TTFT p50 (ms)")
    left.legend(fontsize=7)
    fig.suptitle("Llama-3.1-8B on H100, 30 req/s, rank-16 adapters: slots (max_loras) vs adapters")
    save_png(fig, args.out)
    print(f"wrote {args.out}")
    for device in ("a100-80g", "a100-40g"):
        b, lo = published_comparison(device)
        print(f"{device}: without LoRA {b:.2f} req/s, with {lo:.2f} req/s ({lo / b:.3f}x); published "
              f"{PUBLISHED_BASE_REQ_S} (V0) and {PUBLISHED_LORA_REQ_S} (V1) req/s "
              f"({PUBLISHED_LORA_REQ_S / PUBLISHED_BASE_REQ_S:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
