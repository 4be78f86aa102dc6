"""Regenerate docs/whatif/*.png and docs/whatif/results.md from the what-if scenarios.

    .venv/bin/python scripts/make_whatif_plots.py [--jobs N] [--only NAME ...]

Each question runs the exact `simrun` command docs/whatif.md shows (QUESTIONS below) into a
scratch folder; a sweep's figure is then drawn from the sweep.csv that command wrote, a
plan's is the plan.png it wrote. So the docs' images always come from their commands.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.cli import main as simrun, run_parser  # noqa: E402
from sim.output.report import format_value  # noqa: E402
from sim.whatif.sweep import Sweep, split_sets, sweep_points  # noqa: E402
from sim.whatif.sweep_output import Metric, plot_metrics, save_png  # noqa: E402

DOCS = ROOT / "docs" / "whatif"
GIB = 1 / 2**30


@dataclass(frozen=True)
class Question:
    name: str                       # docs/whatif/<name>.png
    title: str
    argv: tuple[str, ...]           # simrun's arguments, as docs/whatif.md shows them
    metrics: tuple = ()             # a sweep's panels (headline names or Metric)
    table: tuple[str, ...] = field(default=())   # sweep.csv columns for results.md

    @property
    def is_plan(self) -> bool:
        return self.argv[0] == "plan"

    @property
    def plan_files(self) -> tuple[str, str, str]:
        """The figure, table and page a plan writes (plan --autoscale names its own)."""
        if "--autoscale" in self.argv:
            return "autoscale.png", "autoscale.csv", "autoscale.html"
        return "plan.png", "plan.csv", "plan.html"

    @property
    def command(self) -> str:
        return "simrun " + " ".join(self.argv)


QUESTIONS = (
    Question("block_size", "Which block size?",
             ("scenarios/whatif_block_size.yaml", "--set", "engine.block_size=1,4,16,64,128,256",
              "--set", "workload.arrival.rate=3,4"),
             ("ttft_p99", "tpot_p99", "kv_usage_peak", "preemptions"),
             ("engine.block_size", "workload.arrival.rate", "ttft_s.p99", "tpot_s.p99", "preemptions")),
    Question("rate_slo", "How much load does one replica take within the SLOs?",
             ("plan", "scenarios/whatif_rate_slo.yaml", "--slo", "ttft_p99=1", "--slo", "tpot_p99=0.1",
              "--curve", "6"),
             table=("rate", "ok", "steady.late_finish_rate", "ttft_s.p99", "tpot_s.p99", "failed")),
    Question("replicas", "How many GPUs, and which?",
             ("plan", "scenarios/whatif_replicas.yaml", "--target-rate", "20", "--devices",
              "l4,a100-80g,h100-sxm", "--tp", "1,2"),
             table=("device", "tp", "replicas", "gpus", "$/hour", "TTFT p99 (s)", "TPOT p99 (s)")),
    Question("prefix_caching", "What does prefix caching buy?",
             ("scenarios/whatif_prefix_caching.yaml", "--set", "workload.arrival.rate=0.5,1,1.5,2,3,4",
              "--set", "engine.prefix_caching=false,true"),
             ("ttft_p99", "request_throughput", "tpot_p99", "prefix_hit_rate"),
             ("workload.arrival.rate", "engine.prefix_caching", "request_throughput", "ttft_s.p99",
              "prefix_hit_rate")),
    Question("kv_offload", "What does 64 GiB of CPU KV offloading buy a multi-turn chat on one L4?",
             ("scenarios/whatif_kv_offload.yaml", "--set", "workload.arrival.rate=0.05,0.1,0.2,0.4,0.7,1",
              "--set", "engine.kv_offload=null,{size_gib: 64}"),
             ("prefix_hit_rate", Metric("ttft_p50", "ttft_s.p50", "TTFT p50 (ms)", 1e3), "ttft_p99",
              "request_throughput"),
             ("workload.arrival.rate", "engine.kv_offload", "request_throughput", "ttft_s.p50", "ttft_s.p99",
              "prefix_hit_rate", "kv_offload.cpu_hit_rate", "kv_offload.gib_loaded")),
    Question("kv_offload_link", "At 0.4 conversations/s: how slow a host link still pays?",
             ("scenarios/whatif_kv_offload.yaml", "--set", "workload.arrival.rate=0.4",
              "--set", "engine.kv_offload.bandwidth_gbps=0.05,0.1,0.2,0.5,2,32"),
             (Metric("ttft_p50", "ttft_s.p50", "TTFT p50 (ms)", 1e3), "ttft_p99"),
             ("engine.kv_offload.bandwidth_gbps", "ttft_s.p50", "ttft_s.p99", "kv_offload.load_wait_s")),
    Question("tp", "tp=2 on two L4s or tp=1 on one H100?",
             ("scenarios/whatif_tp.yaml", "--set", "device=l4,l4,h100-sxm", "--set", "parallelism.tp=1,2,1",
              "--zip"),
             (Metric("weights", "memory.weight_bytes", "weights per GPU (GiB)", GIB),
              Metric("kv_pool", "memory.kv_pool_bytes", "KV pool per GPU (GiB)", GIB),
              Metric("step", "mean_step_s", "mean step time (ms)", 1e3),
              "goodput", "ttft_p99", "tpot_p99"),
             ("device", "parallelism.tp", "gpus", "cost_per_hour", "goodput", "ttft_s.p99", "tpot_s.p99")),
    Question("router", "Which router?",
             ("scenarios/whatif_router.yaml", "--set", "workload.arrival.rate=4,8,12,16", "--set",
              "cluster.router=round_robin,least_outstanding_tokens,prefix_aware"),
             ("prefix_hit_rate", "ttft_p99", "request_throughput", "kv_usage_peak"),
             ("workload.arrival.rate", "cluster.router", "prefix_hit_rate", "request_throughput", "ttft_s.p99")),
    Question("routers", "Which deployed router: llm-d, Dynamo or SGLang?",
             ("scenarios/whatif_routers.yaml", "--set", "workload.arrival.rate=0.8,1.2,1.6,2", "--set",
              "cluster.router=round_robin,least_outstanding_tokens,prefix_aware,llm_d,dynamo,sglang"),
             ("prefix_hit_rate", "ttft_p99",
              Metric("regret", "routing_regret.hit_rate_lost", "routing regret (% of prompt tokens)", 100.0),
              "request_throughput"),
             ("workload.arrival.rate", "cluster.router", "prefix_hit_rate", "ttft_s.p99",
              "routing_regret.hit_rate_lost", "routing_regret.regret_fraction")),
    Question("quantization", "bf16 or fp8 weights, and an fp8 KV cache, on one L4?",
             ("scenarios/whatif_quantization.yaml", "--set", "workload.arrival.rate=1,2,3,4,6,8",
              "--set", "model=llama-3.1-8b,llama-3.1-8b-fp8", "--set", "engine.kv_cache_dtype=auto,fp8"),
             (Metric("kv_pool", "memory.kv_pool_bytes", "KV pool (GiB)", GIB),
              Metric("concurrency", "memory.max_concurrency_at_max_model_len", "max concurrency at max_model_len"),
              "goodput", "ttft_p99", "tpot_p99", "preemptions"),
             ("workload.arrival.rate", "model", "engine.kv_cache_dtype", "memory.max_concurrency_at_max_model_len",
              "goodput", "ttft_s.p99", "tpot_s.p99")),
    Question("sliding_window", "What does Mistral v0.1's 4096-token window buy on 8-12k-token prompts?",
             ("scenarios/whatif_sliding_window.yaml", "--set", "workload.arrival.rate=0.25,0.5,0.75,1",
              "--set", "model.sliding_window=4096,null"),
             ("request_throughput", "ttft_p99", "tpot_p99", "kv_usage_peak"),
             ("workload.arrival.rate", "model.sliding_window", "request_throughput", "ttft_s.p99", "tpot_s.p99",
              "preemptions")),
    Question("moe", "A MoE model on four H100s: tp, dp or dp with expert parallelism?",
             ("scenarios/whatif_moe.yaml", "--set", "parallelism.dp=1,4,4", "--set", "parallelism.tp=4,1,1",
              "--set", "parallelism.ep=1,1,4", "--zip"),
             (Metric("weights", "memory.weight_bytes", "weights per GPU (GiB)", GIB),
              Metric("concurrency", "memory.max_concurrency_at_max_model_len", "max concurrency per engine rank"),
              Metric("step", "mean_step_s", "mean step time (ms)", 1e3),
              "goodput", "ttft_p99", "tpot_p99"),
             ("parallelism.tp", "parallelism.dp", "parallelism.ep", "gpus", "memory.weight_bytes", "goodput",
              "ttft_s.p99", "tpot_s.p99")),
    Question("autoscaling", "Autoscale over the day, or provision for the peak?",
             ("plan", "scenarios/whatif_autoscaling.yaml", "--autoscale", "--cost", "l4=0.8"),
             table=("fleet", "peak replicas", "mean replicas", "GPU-hours", "cost ($)", "SLO attainment",
                    "TTFT p99 (s)")),
)


def run_question(q: Question, scratch: Path, jobs: int) -> str:
    """Run q's command, write docs/whatif/<name>.png; returns its results.md section."""
    out = scratch / q.name
    if simrun([*q.argv, "--out", str(out), "--quiet", "--jobs", str(jobs)]) != 0:
        raise SystemExit(f"{q.command} failed")
    target = DOCS / f"{q.name}.png"
    if q.is_plan:
        png, csv, page = q.plan_files
        shutil.copyfile(out / png, target)
        return section(q, out / csv, verdict=plan_verdict(out / page))
    sweep = read_sweep(q, out / "sweep.csv")
    save_png(plot_metrics(sweep, q.metrics, ncols=3 if len(q.metrics) > 4 else 2, title=q.title), target)
    return section(q, out / "sweep.csv")


def read_sweep(q: Question, csv: Path) -> Sweep:
    """The sweep q's command ran, rebuilt from its flags and the sweep.csv it wrote."""
    args = run_parser().parse_args(list(q.argv))
    _, axes = split_sets(args.overrides)
    return Sweep(axes, sweep_points(axes, args.zip), args.zip, pd.read_csv(csv))


def plan_verdict(page_path: Path) -> str:
    """The verdict line a plan's page carries (its first paragraph)."""
    page = page_path.read_text()
    return page.split("<p>", 1)[1].split("</p>", 1)[0].replace("&lt;", "<").replace("&gt;", ">")


def section(q: Question, csv: Path, verdict: str = "") -> str:
    lines = [f"## {q.title}", "", "```", q.command, "```", "", f"![{q.name}]({q.name}.png)", ""]
    if verdict:
        lines += [verdict, ""]
    frame = pd.read_csv(csv)
    lines += markdown_table(frame[list(q.table)])
    return "\n".join(lines) + "\n"


def markdown_table(frame: pd.DataFrame) -> list[str]:
    head = "| " + " | ".join(frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join(format_value(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return [head, rule, *rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--only", nargs="+", choices=[q.name for q in QUESTIONS], help="regenerate only these")
    args = p.parse_args()
    os.chdir(ROOT)                  # the commands name scenarios/ relative to the checkout
    DOCS.mkdir(parents=True, exist_ok=True)
    sections = []
    with tempfile.TemporaryDirectory() as scratch:
        for q in QUESTIONS:
            if args.only and q.name not in args.only:
                continue
            t0 = time.monotonic()
            sections.append(run_question(q, Path(scratch), args.jobs))
            print(f"{q.name}: {time.monotonic() - t0:.1f} s -> docs/whatif/{q.name}.png")
    if not args.only:
        header = ("# What-if results\n\nGenerated by `scripts/make_whatif_plots.py` from the commands below "
                  "(uncalibrated cost model: datasheet peaks x default efficiencies).\n\n")
        (DOCS / "results.md").write_text(header + "\n".join(sections))
    else:                           # the questions run replace their own sections only
        text = (DOCS / "results.md").read_text()
        for new in sections:
            text = replace_section(text, new)
        (DOCS / "results.md").write_text(text)
    return 0


def replace_section(text: str, new: str) -> str:
    """results.md with the section titled as `new` (its first line) replaced by `new`."""
    title = new.split("\n", 1)[0] + "\n"
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[:start] + new + (text[end:] if end >= 0 else "")


if __name__ == "__main__":
    sys.exit(main())
