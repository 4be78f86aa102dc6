"""kvtwin's prediction against a live OpenAI-compatible endpoint, or against a vLLM result file.

`simrun bench SCENARIO --endpoint URL` replays the scenario's workload against the endpoint:
each request is sent at its arrival time (a follow-up turn think_time after the previous
turn's last token) as a streamed /v1/completions call with the workload's prompt token ids,
max_tokens = its output length, ignore_eos and temperature 0, and every streamed chunk is
timestamped at the client, as vLLM's benchmark client does (TTFT = first chunk - send,
ITL = gaps between chunks, E2E = last chunk - send). Before the run one fixed short request
(16 tokens, max_tokens 8) must come back with 8 tokens; during it /metrics is scraped for
KV usage and queue lengths when the endpoint offers vLLM's metric names.

Before the run a fixed probe prompt shows whether the server's prefix cache is warm from an
earlier run, and /reset_prefix_cache is tried; `workload.max_concurrency` makes the client
closed-loop (a semaphore, as vLLM's --max-concurrency); --header / --api-key reach endpoints
behind authentication.

`simrun compare SCENARIO --vllm-result FILE` reads what `vllm bench serve --save-result`
writes (sim.vllm.results: per-request ttfts, itls, input_lens, output_lens with --save-detailed;
the aggregate mean/median/p99 fields otherwise) and checks the file's workload against the
scenario's before comparing: a comparison on a different workload is meaningless, so differences
are a banner before the table and exit status 1 (unless --allow-mismatch).
--use-file-workload replays the file's own requests instead; a file of several runs
(--append-result) is compared rate by rate (validate/compare_sweep.py).

Both take --server-log (a vLLM log or /metrics scrapes; sim.vllm.timeseries) and compare its
running / waiting / KV % over time with the prediction's; bench uses its own scrapes otherwise.

Both write, beside `simrun validate`'s layout:
    out/measured/    summary.json, requests.csv, manifest.json (+ metrics_timeline.csv)
    out/predicted/   simrun's prediction of the same scenario
    out/comparison.csv, out/*.png, out/report.html (+ series_comparison.csv with a time series)
Measured summaries come from sim.metrics.summarise on a requests frame of records.py's
schema plus the client's ITL samples; what a black-box endpoint cannot show (steps, the
queue/host/device split) is None, and KV figures come from the scraped timeline.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Optional

from sim.cli import positive_seconds
from sim.errors import UserError
from sim.extras import require
from sim.output.console import err_console
from sim.output.run_dir import check_out_folder, out_folder_arg, owned_run_folder
from sim.scenario import scenario_args
from sim.vllm.timeseries import load_series
from validate.bench import run_bench
from validate.comparison_output import print_comparison, write_comparison
from validate.endpoint_client import BenchError, normalise_endpoint
from validate.measured import Measured
from validate.vllm_result import file_workload_scenario, load_vllm_runs, read_vllm_result


def _single_scenario(args):
    from sim.scenario import expand_variants, load_scenario

    scenario = load_scenario(args.scenario, args.overrides, args.seed)
    variants = expand_variants(scenario, base_dir=args.scenario.parent.resolve(), source=str(args.scenario))
    if len(variants) > 1:
        raise UserError(f"{args.scenario} has variants ({', '.join(variants)}); a measurement is of one "
                        f"configuration: write the variant as its own scenario")
    return scenario


def request_headers(lines: list[str], api_key: Optional[str]) -> dict[str, str]:
    """--header 'Name: value' lines and --api-key (else $OPENAI_API_KEY, as vLLM's bench) as headers."""
    import os

    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name.strip() or any(c in line for c in "\r\n"):
            raise UserError(f"--header {line!r}: expected 'Name: value' on one line")
        if not line.isascii():               # HTTP sends header values as ASCII
            raise UserError(f"--header {line!r}: expected ASCII text")
        headers[name.strip()] = value.strip()
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if key and not key.isascii():
        raise UserError("--api-key (or $OPENAI_API_KEY): expected ASCII text")
    if key and "Authorization" not in headers:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def finite_float(text: str) -> float:
    """An argparse type: a number that is not NaN or infinite (float() takes 'nan' and 'inf')."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: expected a finite number of seconds")
    return value


def series_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server-log", type=Path, metavar="FILE",
                   help="the vLLM server's log, /metrics scrapes (each headed by '# TIME <unix s>') or a "
                        "Prometheus query_range JSON, covering the run: its running / waiting / KV %% "
                        "curves are compared with the prediction's")
    p.add_argument("--series-offset", type=finite_float, metavar="S",
                   help="run time = series time + S (default: from the wall clocks when both are known, "
                        "else the offset that fits the curves best)")
    p.add_argument("--log-year", type=int, help="the year of the log's MM-DD times (default: this year)")


def check_series_args(args, offset_needs_log: bool) -> None:
    """A series flag without the file it applies to is a mistake worth naming, not a no-op.
    `offset_needs_log`: the command has no series but the log's (compare; a bench scrapes /metrics)."""
    if args.server_log is not None:
        return
    if args.log_year is not None:
        raise UserError(f"--log-year {args.log_year}: applies to the MM-DD times of a --server-log file; "
                        f"give --server-log FILE, or drop --log-year")
    if offset_needs_log and args.series_offset is not None:
        raise UserError(f"--series-offset {args.series_offset:g}: applies to a --server-log file's time series; "
                        f"give --server-log FILE, or drop --series-offset")


def attach_series(measured: Measured, args) -> None:
    if args.server_log is not None:
        measured.series = load_series(args.server_log, year=args.log_year)
    if args.series_offset is not None:
        measured.series_offset = args.series_offset


def bench_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="simrun bench",
                                description="Replay a scenario's workload against an OpenAI-compatible "
                                            "endpoint and compare the measurement with the prediction.")
    scenario_args(p)
    p.add_argument("--endpoint", required=True, help="server root URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first of the endpoint's /v1/models)")
    p.add_argument("--out", type=out_folder_arg,
                   help="output folder (default runs/bench/<scenario file name without .yaml>)")
    p.add_argument("--force", action="store_true", help="write into --out even if it holds files kvtwin did not write")
    p.add_argument("--request-timeout", type=positive_seconds, default=300.0,
                   help="seconds a request may wait for its next streamed chunk")
    p.add_argument("--scrape-interval", type=positive_seconds, default=0.5, help="seconds between /metrics samples")
    p.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="an HTTP header sent with every request (repeatable)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY when set)")
    series_args(p)
    args = p.parse_args(argv)
    require("simrun bench", "httpx")
    check_series_args(args, offset_needs_log=False)
    from sim.predict import predict

    scenario = _single_scenario(args)
    out = args.out or Path("runs") / "bench" / args.scenario.stem
    check_out_folder(out, force=args.force)      # before measuring; a bench that measured nothing leaves no folder
    try:
        measured = run_bench(scenario, args.endpoint, args.model, args.request_timeout, args.scrape_interval,
                             say=lambda msg: err_console.print(f"bench: {msg}", markup=False),
                             headers=request_headers(args.header, args.api_key))
    except BenchError as e:
        raise UserError(str(e)) from None
    attach_series(measured, args)
    with owned_run_folder(out, force=args.force):
        table, _ = write_comparison(predict(scenario, "predicted"), measured, out,
                                    f"kvtwin bench: {scenario.name} against {normalise_endpoint(args.endpoint)}")
    print_comparison(table, measured, out)
    return 1 if measured.summary["partial"] else 0


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="simrun compare",
                                description="Compare a `vllm bench serve --save-result` file with the "
                                            "prediction of the same workload. A file of several runs "
                                            "(--append-result, a rate sweep) is compared run by run "
                                            "against the scenario at each run's rate.")
    scenario_args(p)
    p.add_argument("--vllm-result", type=Path, required=True,
                   help="the JSON (or --append-result JSON Lines) file vLLM's benchmark saved")
    p.add_argument("--use-file-workload", action="store_true",
                   help="replay the file's own requests (send times, prompt and output lengths; needs "
                        "--save-detailed) instead of the scenario's workload")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="exit 0 even when the file's workload differs from the scenario's")
    p.add_argument("--out", type=out_folder_arg,
                   help="output folder (default runs/compare/<scenario file name without .yaml>)")
    p.add_argument("--force", action="store_true", help="write into --out even if it holds files kvtwin did not write")
    series_args(p)
    args = p.parse_args(argv)
    check_series_args(args, offset_needs_log=True)
    from sim.predict import predict

    scenario = _single_scenario(args)
    runs = load_vllm_runs(args.vllm_result)
    out = args.out or Path("runs") / "compare" / args.scenario.stem
    if len(runs) > 1:
        from validate.compare_sweep import compare_sweep

        if args.server_log is not None or args.series_offset is not None:
            raise UserError(f"--server-log compares one run's time series; {args.vllm_result} holds {len(runs)} "
                            f"runs: cut the file to the run the log covers")

        with owned_run_folder(out, force=args.force):      # checked before predicting
            return compare_sweep(scenario, runs, out, args.use_file_workload, args.allow_mismatch)
    with owned_run_folder(out, force=args.force):          # checked before predicting
        notes: list[str] = []
        if args.use_file_workload:
            scenario, notes = file_workload_scenario(scenario, runs[0])
        measured = read_vllm_result(args.vllm_result, scenario, runs[0], args.use_file_workload)
        measured.manifest["workload_notes"] = notes
        attach_series(measured, args)
        table, _ = write_comparison(predict(scenario, "predicted"), measured, out,
                                    f"kvtwin vs vLLM benchmark: {scenario.name} ({args.vllm_result.name})")
    print_comparison(table, measured, out)
    mismatch = bool(measured.manifest["notes"])
    if mismatch and not args.allow_mismatch:
        err_console.print("[bold red]workload mismatch[/]: exit status 1 (--allow-mismatch to accept it, "
                          "--use-file-workload to replay the file's own requests)")
        return 1
    return 0
