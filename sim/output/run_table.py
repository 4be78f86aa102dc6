"""What `simrun SCENARIO` prints the moment the simulation ends: the setup, vLLM's start-up lines
for the same pool, the headline table (a ratio column per variant), requests not served and why,
and a one-line answer."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from rich.markup import escape
from rich.table import Table

from sim.output import units
from sim.output.console import console
from sim.output.setup import rejection_line, setup_text, vllm_startup_lines


def print_results(results: Mapping, out: Path) -> None:
    from sim.output.pages import summary_text
    from sim.output.run_files import view_of

    first = next(iter(results.values()))
    for line in setup_text(first.manifest):
        console.print(escape(line), soft_wrap=True)
    startup = {name: vllm_startup_lines(r.summary, r.manifest) for name, r in results.items()}
    same = len({tuple(lines) for lines in startup.values()}) == 1
    for name, lines in (list(startup.items())[:1] if same else startup.items()):
        for line in lines:
            console.print(f"[dim]{escape(('' if same else name + ': ') + line)}[/]", soft_wrap=True)
    views = {name: view_of(r, name, all_step_columns=False) for name, r in results.items()}   # (the summaries)
    print_table(summary_text(views, ratios=True))
    for name, r in results.items():
        line = rejection_line(r.request_columns, r.summary)
        if line:
            console.print(f"[yellow]{escape((name + ': ') if len(results) > 1 else '')}{escape(line)}[/]",
                          soft_wrap=True)
        for note in r.manifest.get("workload", {}).get("notes") or []:
            console.print(f"[yellow]note[/] ({escape(name)}): {escape(note)}", soft_wrap=True)
        if r.summary.get("replicas"):
            from sim.metrics import replica_frame

            print_frame(replica_frame(r.summary), title=f"per replica ({name})")
    for name, r in results.items():
        console.print(answer_line(name if len(results) > 1 else r.scenario.name, r.summary), soft_wrap=True)


def print_frame(frame, title: Optional[str] = None) -> None:
    """A frame as a rich table on stdout, numbers formatted as everywhere else (sim.output.units)."""
    table = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    for i, col in enumerate(frame.columns):      # fold, never cut: a long value or name stays whole
        table.add_column(str(col), justify="left" if i == 0 else "right", overflow="fold")
    for row in frame.itertuples(index=False):
        table.add_row(*(units.format_value(v) for v in row))
    console.print(table)


def print_table(text) -> None:
    """A table of display strings (sim.output.pages.TextTable), as rich draws it."""
    table = Table(show_header=True, header_style="bold")
    table.add_column(str(text.index_name or "metric"))
    for col in text.columns:
        table.add_column(str(col), justify="right")
    for metric, *row in zip(text.labels, *text.columns.values()):
        table.add_row(str(metric), *[str(v) for v in row])
    console.print(table)


def answer_line(name: str, s: dict) -> str:
    """The run in one line: throughput, the latency that SLOs bind (with the typical error of the
    step-time source, sim/trained.py), memory pressure."""
    from sim.trained import band_words

    parts = [f"{units.format_value(s.get('request_throughput'))} req/s",
             f"{units.format_value(s.get('output_token_throughput'))} output tok/s",
             f"TTFT p99 {units.ms_unit((s.get('ttft_s') or {}).get('p99'))}{band_words(s.get('error_band'), 'ttft_p99')}",
             f"TPOT p99 {units.ms_unit((s.get('tpot_s') or {}).get('p99'))}{band_words(s.get('error_band'), 'tpot_p99')}"]
    if s.get("slo_attainment") is not None:
        parts.append(f"SLOs met by {units.pct(s['slo_attainment'])}")
    parts.append(f"KV peak {units.pct(s.get('kv_usage_peak'))} of the pool")
    parts.append(f"{s.get('preemptions', 0):,} preemptions")
    regret = s.get("routing_regret")
    if regret is not None:      # (sim/routers/regret.py)
        parts.append(f"prefix hit rate {units.pct(s.get('prefix_hit_rate'))}, routing regret "
                     f"{units.pct(regret['hit_rate_lost'])} of prompt tokens ({units.pct(regret['regret_fraction'])} "
                     f"of the oracle's hits)")
    return f"[bold]{escape(name)}[/]: " + ", ".join(parts)
