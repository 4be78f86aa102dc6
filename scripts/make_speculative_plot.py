"""Draw docs/whatif/speculative.png: TPOT with and without speculative decoding against the decode
batch (a closed-loop client's concurrency), from scenarios/whatif_speculative.yaml.

    .venv/bin/python scripts/make_speculative_plot.py [--out docs/whatif/speculative.png]

Each point is `simrun scenarios/whatif_speculative.yaml --set workload.max_concurrency=C` with
engine.speculative as the line says (off, the scenario's EAGLE-3 k=3, EAGLE-3 k=7, ngram k=3 at
acceptance 0.5);
the crossover is where a speculative line meets the plain one. It also prints the table the docs page
quotes, and kvtwin's speedup for vLLM's published EAGLE measurement (PUBLISHED).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.predict import predict  # noqa: E402
from sim.scenario import load_scenario  # noqa: E402

SCENARIO = ROOT / "scenarios" / "whatif_speculative.yaml"
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LINES = {
    "no speculation": ["engine.speculative=null"],
    "EAGLE-3, k=3": [],
    "EAGLE-3, k=7": ["engine.speculative.num_speculative_tokens=7"],
    "ngram, k=3, acceptance 0.5": ['engine.speculative={"method": "ngram", "num_speculative_tokens": 3, '
                                   '"acceptance_rate": 0.5}'],
}


def tpot_ms(sets: list[str], concurrency: int) -> float:
    s = load_scenario(SCENARIO, [*sets, f"workload.max_concurrency={concurrency}",
                                 f"workload.num_requests={max(64, 4 * concurrency)}"])
    return predict(s, manifest=False).summary["tpot_s"]["mean"] * 1e3


# vLLM's EAGLE measurement, https://github.com/vllm-project/vllm/pull/16035 (Llama-3-8B-Instruct with
# lmsys/sglang-EAGLE-LLaMA3-Instruct-8B, MT-bench, max_num_seqs 1): output tok/s without, and per k
# (speedup, mean acceptance length).
PUBLISHED_BASE_TOK_S = 128.64
PUBLISHED = {2: (175.49 / 128.64, 1.89), 4: (165.65 / 128.64, 2.08)}


def published_comparison() -> tuple[float, dict[int, tuple[float, float]]]:
    """kvtwin's figures for that measurement, one request at a time with the acceptance fitted to
    its lengths: (tok/s without, {k: (predicted speedup, published speedup)})."""
    from sim.scenario import validate_scenario
    from sim.vllm.spec_metrics import fitted_rates

    def run(spec):
        engine = {"max_num_seqs": 1, **({"speculative": spec} if spec else {})}
        s = validate_scenario({"model": "llama-3.1-8b", "device": "h100-sxm", "engine": engine, "workload": {
            "num_requests": 40, "max_concurrency": 1, "arrival": {"rate": 1000}, "prompt_len": 100,
            "output_len": 256}})
        return predict(s, manifest=False).summary["output_token_throughput"]

    base = run(None)
    speedups = {}
    for k, (published, length) in PUBLISHED.items():
        rates = fitted_rates(1.0, length - 1, {}, k)
        speedups[k] = (run({"method": "eagle", "num_speculative_tokens": k, "acceptance_rates": rates}) / base,
                       published)
    return base, speedups


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "whatif" / "speculative.png")
    args = p.parse_args()
    table = {name: [tpot_ms(sets, c) for c in CONCURRENCY] for name, sets in LINES.items()}
    print("| concurrency | " + " | ".join(f"{n} TPOT (ms)" for n in table) + " |")
    print("|---" * (len(table) + 1) + "|")
    for i, c in enumerate(CONCURRENCY):
        print(f"| {c} | " + " | ".join(f"{v[i]:.2f}" for v in table.values()) + " |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sim.whatif.sweep_output import save_png

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, values in table.items():
        ax.plot(CONCURRENCY, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight (decode batch)")
    ax.set_ylabel("TPOT mean (ms)")
    ax.set_title("Llama-3.1-8B on H100: speculative decoding pays at small batches only")
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, args.out)
    print(f"wrote {args.out}")
    base, speedups = published_comparison()
    print(f"no speculation: {base:.1f} tok/s predicted ({PUBLISHED_BASE_TOK_S} published)")
    for k, (predicted, published) in speedups.items():
        print(f"eagle k={k}: {predicted:.2f}x predicted, {published:.2f}x published")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
