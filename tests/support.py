"""Helpers shared by test files (imported as `support`: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path


@contextlib.contextmanager
def alarm(seconds: int):
    """A hang is a failure, not a stuck suite: raise TimeoutError after `seconds`."""
    def fire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def with_changes(data: dict, **changes) -> dict:
    """A deep copy of a JSON-like `data` with `field=value` (or `field__INDEX=value` for one list
    element) set: one hostile variant of a good vLLM result file."""
    data = json.loads(json.dumps(data))
    for key, value in changes.items():
        field, _, index = key.partition("__")
        if index:
            data[field][int(index)] = value
        else:
            data[field] = value
    return data


# scenarios and runs the hostile-input tests share (test_hostile_*, test_scenario_bounds, ...)

BASE = {"model": "qwen2.5-0.5b", "device": "h100-sxm"}
SMALL = ("model: qwen2.5-0.5b\ndevice: h100-sxm\nengine: {num_blocks: 256, max_model_len: 256}\n"
         "workload: {num_requests: 4, prompt_len: 16, output_len: 4}\n")


REPO = Path(__file__).resolve().parents[1]
CODE_PACKAGES = ("sim", "engine", "validate", "bench")


def code_files(skip: Path | None = None) -> list[Path]:
    """The project's Python sources (what the repository scans read), without those under `skip`."""
    return [p for package in CODE_PACKAGES for p in sorted((REPO / package).rglob("*.py"))
            if skip is None or skip not in p.parents]


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


def run_cli(argv, capsys) -> tuple[int, str]:
    """`simrun ARGV` in process: its exit status and everything it printed."""
    from sim.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


SMOKE = Path(__file__).resolve().parents[1] / "scenarios" / "serve_smoke.yaml"
NO_PREFIX = ["--set", "workload.shared_prefix=null", "--set", "workload.warmup_requests=0"]


def vllm_result_file(tmp_path: Path, rates: tuple[float, ...] = (20.0,)) -> Path:
    """A (JSON Lines when several rates) vLLM result file made from kvtwin's own prediction."""
    from sim.predict import predict
    from sim.scenario import load_scenario
    from sim.vllm.results import vllm_result_dict

    lines = []
    for rate in rates:
        run = predict(load_scenario(SMOKE, [f"workload.arrival.rate={rate}", "workload.shared_prefix=null",
                                            "workload.warmup_requests=0"]), "measured")
        lines.append(json.dumps(vllm_result_dict(run.requests, {"model_id": "tiny", "request_rate": rate})))
    path = tmp_path / f"vllm{len(rates)}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# `simrun serve` on the tiny model (scenarios/serve_smoke.yaml)
SMOKE_MAX_MODEL_LEN = 512      # serve_smoke.yaml's engine.max_model_len
TINY_VOCAB = 1024              # the tiny model's vocabulary
TOKENIZER = Path(__file__).resolve().parent / "data" / "datasets" / "tokenizer.json"
