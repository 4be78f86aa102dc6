"""`simrun validate` and `simrun calibrate`."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from engine.hardware import add_device_args, catalog_device_for_cuda, pick_device, set_cpu_threads
from sim.core.files import FileFormatError, read_yaml
from sim.errors import UserError
from sim.extras import require
from sim.output.console import console, err_console
from sim.output.run_dir import check_out_file, out_folder_arg, owned_run_folder
from sim.scenario import scenario_args
from sim.scenario import expand_variants, load_scenario, validate_scenario
from sim.output.io import write_csv

SAMPLES_HEADER = "kind,block_size,"    # the first columns of the probe samples calibrate writes (validate/calibrate.py)


# ----------------------------------------------------------------------------- validate

def validate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="simrun validate",
                                description="Predict a scenario, replay it on the engine, compare the two.")
    scenario_args(p)
    add_device_args(p)
    p.add_argument("--profile", type=Path, help="a calibrated device profile (simrun calibrate writes one)")
    p.add_argument("--out", type=out_folder_arg,
                   help="output folder (default runs/validate/<scenario file name without .yaml>)")
    p.add_argument("--force", action="store_true", help="write into --out even if it holds files kvtwin did not write")
    p.add_argument("--offline", action="store_true", help="release every request at t=0")
    p.add_argument("--cold", action="store_true",
                   help="no kernel warm-up before the measured run (a cold start)")
    p.add_argument("--tolerances", help="'gpu' for the H200 targets (see docs/validation.md), or a YAML file of "
                                        "{metric row: relative tolerance}")
    args = p.parse_args(argv)
    require("simrun validate", "torch")
    from validate.run import validate, write_validation

    device = pick_device(args.device)
    set_cpu_threads(device, args.threads)
    scenario = load_scenario(args.scenario, args.overrides, args.seed)
    variants = expand_variants(scenario, base_dir=args.scenario.parent.resolve(), source=str(args.scenario))
    out = args.out or Path("runs") / "validate" / args.scenario.stem
    tolerances = load_tolerances(args.tolerances)
    failures = []
    with owned_run_folder(out, force=args.force):      # checked before measuring
        for name, variant in variants.items():
            folder = out / name if len(variants) > 1 else out
            result = validate(variant, device, args.profile, online=not args.offline, cold=args.cold,
                              tolerances=tolerances, progress=lambda msg: err_console.print(f"{name}: {msg}"))
            write_validation(result, folder)
            print_validation(name, result, folder)
            failures += [f"{name}: {line}" for line in _failures(result.table)]
    for line in failures:
        err_console.print(f"[red]outside tolerance[/] {line}")
    return 1 if failures else 0


def load_tolerances(spec: Optional[str]) -> Optional[dict[str, float]]:
    from validate.compare import GPU_TARGETS

    if spec is None:
        return None
    if spec == "gpu":
        return dict(GPU_TARGETS)
    try:
        data = read_yaml(spec, "--tolerances YAML file")      # bounded, no recursive aliases
    except FileFormatError as e:
        raise UserError(f"--tolerances: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
        raise UserError(f"--tolerances {spec}: expected a mapping of metric row -> relative tolerance")
    return {str(k): float(v) for k, v in data.items()}


def _failures(table) -> list[str]:
    from validate.compare import check_within

    return check_within(table)


def print_validation(name: str, result, folder: Path) -> None:
    from rich.markup import escape
    from rich.table import Table

    from sim.output.setup import setup_text

    for line in setup_text(result.predicted.manifest):
        console.print(escape(line), soft_wrap=True)

    table = Table(title=f"{name}: predicted vs measured", header_style="bold")
    for col in ("metric", "predicted", "measured", "error", "tolerance"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    from sim.output.pages import display_comparison

    shown = display_comparison(result.table)
    for (metric, row), within in zip(shown.iterrows(), result.table["within"]):
        style = {True: "green", False: "red"}.get(within, "")
        table.add_row(metric, row.predicted, row.measured, row.error, row.tolerance, style=style)
    console.print(table)
    steps = result.step_errors["all"]
    console.print(f"step time: median error {steps['median_rel_error']:+.1%}, p90 {steps['p90_rel_error']:+.1%} "
                  f"over {steps['steps']:,} measured steps")
    calibrated = result.predicted.cost_model.calibrated
    console.print("cost model: " + ("calibrated profile" if calibrated else
                                     "UNCALIBRATED (datasheet defaults); pass --profile from `simrun calibrate`"))
    console.print(f"wrote {folder}/ (report.html, comparison.csv, step_times.csv, predicted/, measured/)")


# ----------------------------------------------------------------------------- calibrate

def calibrate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="simrun calibrate",
                                description="Profile the engine and fit the cost model; writes a device profile.")
    add_device_args(p)
    p.add_argument("--model", help="catalog model name, or a Hugging Face folder (config.json + weights)")
    p.add_argument("--scenario", type=Path, help="take model, device and engine settings from a scenario")
    p.add_argument("--catalog-device", help="the device catalog entry to fit (default: detected, or 'cpu')")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a setting of the deployment, e.g. --set engine.max_model_len=4096 "
                        "(repeatable)")
    p.add_argument("--out", type=Path, help="profile YAML to write (default profiles/<device>_<model>.yaml; "
                                            "with --from-vllm profiles/<device>_<model>_vllm.yaml)")
    p.add_argument("--force", action="store_true", help="replace --out even if kvtwin did not write it")
    p.add_argument("--from-vllm", nargs="+", type=Path, metavar="RESULT.json",
                   help="fit to measured `vllm bench serve --save-result --save-detailed` files of one "
                        "deployment (JSON or --append-result JSONL) instead of profiling the engine; "
                        "give the deployment with --scenario, or --model and --catalog-device (and --set)")
    p.add_argument("--series", nargs="+", metavar="LOG|SCRAPES",
                   help="with --from-vllm: each run's server log or /metrics scrapes (one per run, in order; "
                        "'-' for none): its running / waiting / KV-usage curves are fitted too")
    p.add_argument("--hold-out", type=int, default=None, metavar="INDEX",
                   help="with --from-vllm: which run (0-based, in the order given) to keep out of the fit "
                        "and report (default: the last)")
    args = p.parse_args(argv)
    if args.from_vllm:
        from validate.vllm_fit import calibrate_from_vllm_main

        return calibrate_from_vllm_main(args)
    for flag, given in (("--series", args.series), ("--hold-out", args.hold_out is not None)):
        if given:
            raise UserError(f"{flag} applies to fits to vLLM runs: give them with --from-vllm RESULT.json ...")
    require("simrun calibrate", "torch", "scipy")    # profiling runs the engine (--from-vllm needs neither)
    from validate.calibrate import calibrate, coefficients_table, write_profile

    device = pick_device(args.device)
    set_cpu_threads(device, args.threads)
    scenario = calibration_base(args, device)
    from validate.vllm_fit import profile_out

    out = profile_out(args, scenario)
    samples_out = out.with_suffix(".samples.csv")     # checked with the profile, before any profiling
    check_out_file(samples_out, SAMPLES_HEADER, force=args.force)
    console.print(f"calibrating {scenario.model.name} ({scenario.model.dtype}) on {device} "
                  f"as catalog device '{scenario.device.name}'")
    cal = calibrate(scenario, device, progress=None)
    write_profile(out, cal)
    write_csv(samples_out, cal.samples)
    console.print(coefficients_table(cal.profile).to_string())
    fit = cal.profile.fit
    for part in ("device_train", "device_held_out"):
        q = fit.get(part) or {}
        if q:
            kinds = ", ".join(f"{k} {q[k]['median_rel_error']:.1%}/{q[k]['p90_rel_error']:.1%}"
                              for k in ("decode", "prefill", "mixed") if k in q)
            console.print(f"{part}: R^2 {q['r2']:.3f}, median/p90 relative error {q['median_rel_error']:.1%}/"
                          f"{q['p90_rel_error']:.1%} over {q['points']} points ({kinds})")
    console.print(f"host terms: median relative error {fit['host_median_rel_error']:.1%} over "
                  f"{fit['replayed_steps']} replayed steps")
    # absolute: the hint works from any folder
    console.print(f"wrote {out} (use it: simrun SCENARIO --set device.profile={out.resolve()})")
    return 0


def calibration_base(args, device: str):
    """The scenario calibration profiles: --scenario, else the model on the detected device."""
    if args.scenario:
        scenario = load_scenario(args.scenario, args.overrides)
        return next(iter(expand_variants(scenario, args.scenario.parent.resolve(), source=str(args.scenario)).values()))
    if not args.model:
        raise UserError("give --model NAME (or --scenario FILE)")
    catalog_device = args.catalog_device or ("cpu" if device == "cpu" else catalog_device_for_cuda())
    model = {"hf_config": args.model} if Path(args.model).exists() else args.model
    raw = {"model": model, "device": catalog_device,
           "engine": {"max_model_len": 2048 if device == "cpu" else 8192}}
    if device == "cpu":
        raw["engine"].update(num_blocks=1024, max_num_seqs=32, max_num_batched_tokens=512)
    from sim.scenario import apply_overrides

    return validate_scenario(apply_overrides(raw, args.overrides), base_dir=Path.cwd())
