"""Sweeps: --set value lists, grid and zip points, per-point validation, sweep.csv, backends."""
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sim.cli import main
from sim.predict import predict
from sim.scenario import ScenarioError, apply_overrides, load_raw, load_scenario
from sim.whatif.sweep import Axis, SweepError, flatten, run_sweep, split_sets, split_values, sweep_points

SMALL = {
    "name": "small", "seed": 0, "model": "llama-3.1-8b", "device": "l4",
    "engine": {"max_model_len": 1024, "prefix_caching": False, "max_num_seqs": 16},
    "workload": {"num_requests": 80, "warmup_requests": 5, "arrival": {"process": "poisson", "rate": 2},
                 "prompt_len": {"dist": "uniform", "min": 64, "max": 256},
                 "output_len": {"dist": "uniform", "min": 16, "max": 64}},
}


@pytest.fixture
def scenario_file(tmp_path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


def sweep_of(path: Path, overrides: list[str], zipped: bool = False, jobs: int = 1, ray=None):
    plain, axes = split_sets(overrides)
    raw = apply_overrides(load_raw(path), plain)
    return run_sweep(raw, path.parent, str(path), axes, zipped, jobs, ray, quiet=True)


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, expected", [
    ("8,16,32", ["8", "16", "32"]),
    ("16", ["16"]),
    ("l4, h100-sxm", ["l4", "h100-sxm"]),
    ("[0,600]", ["[0,600]"]),                           # a YAML flow list is one value
    ("{base: l4, memory_mib: 20000}", ["{base: l4, memory_mib: 20000}"]),
])
def test_commas_split_values_unless_the_value_is_a_yaml_collection(text, expected):
    assert split_values(text) == expected


def test_single_values_stay_plain_overrides_and_lists_become_axes():
    plain, axes = split_sets(["engine.block_size=8,16", "workload.trace.window_s=[0,600]",
                              "engine.prefix_caching=true,false", "seed=3"])
    assert plain == ["workload.trace.window_s=[0,600]", "seed=3"]
    assert axes == [Axis("engine.block_size", ("8", "16"), (8, 16)),
                    Axis("engine.prefix_caching", ("true", "false"), (True, False))]


@pytest.mark.parametrize("overrides, message", [
    (["engine.block_size=8,,16"], "empty value"),
    (["engine.block_size=8,16", "engine.block_size=32"], "given twice"),
    (["engine.block_size=8,8,16"], "more than once"),
])
def test_malformed_sweeps_are_named(overrides, message):
    with pytest.raises(SweepError, match=message):
        _, axes = split_sets(overrides)
        sweep_points(axes)


def test_grid_takes_every_combination_with_the_first_field_outermost():
    _, axes = split_sets(["a=1,2", "b=x,y,z"])
    points = sweep_points(axes)
    assert [p.texts for p in points] == [("1", "x"), ("1", "y"), ("1", "z"), ("2", "x"), ("2", "y"), ("2", "z")]


def test_zip_pairs_values_and_needs_equal_lengths():
    _, axes = split_sets(["device=l4,l4,h100-sxm", "parallelism.tp=1,2,1"])
    assert [p.values for p in sweep_points(axes, zipped=True)] == [("l4", 1), ("l4", 2), ("h100-sxm", 1)]
    _, uneven = split_sets(["a=1,2", "b=x,y,z"])
    with pytest.raises(SweepError, match="a has 2, b has 3"):
        sweep_points(uneven, zipped=True)


def test_flatten_dots_nested_keys_and_drops_lists():
    assert flatten({"ttft_s": {"p99": 1.0}, "replicas": [{"replica": 0}], "preemptions": 2}) == \
        {"ttft_s.p99": 1.0, "preemptions": 2}


# ----------------------------------------------------------------------------- running

def test_grid_rows_match_individual_runs(scenario_file):
    sweep = sweep_of(scenario_file, ["engine.block_size=16,32", "workload.arrival.rate=1,3"])
    frame = sweep.frame
    assert list(frame.columns[:3]) == ["engine.block_size", "workload.arrival.rate", "requests_total"]
    assert "ttft_s.p99" in frame and "memory.num_blocks" in frame and "cost_per_hour" in frame
    assert frame[["engine.block_size", "workload.arrival.rate"]].values.tolist() == [[16, 1], [16, 3], [32, 1], [32, 3]]
    alone = predict(load_scenario(scenario_file, ["engine.block_size=32", "workload.arrival.rate=1"])).summary
    row = frame.iloc[2]
    for key in ("request_throughput", "ttft_s.p99", "tpot_s.p99", "kv_blocks_peak", "memory.num_blocks"):
        assert row[key] == flatten(alone)[key], key


def test_a_bad_value_names_the_field_and_the_point(scenario_file):
    with pytest.raises(ScenarioError) as e:
        sweep_of(scenario_file, ["engine.block_size=16,0"])
    assert "(at engine.block_size=0): engine.block_size:" in str(e.value)


def test_the_point_an_error_names_is_quoted_short(scenario_file):
    """Errors quote input as a short excerpt: a 5,000-character swept value made a 5,000-character
    '(at name=xxxx...)' (found by h/audit2), and a repeated one a 10,000-character line."""
    long = "x" * 5000
    with pytest.raises(ScenarioError) as e:
        sweep_of(scenario_file, [f"name={long},b"])
    assert "(at name=xxx" in str(e.value) and len(str(e.value)) < 500
    with pytest.raises(SweepError) as e:
        sweep_points(split_sets([f"name={long},{long}"])[1])
    assert "more than once" in str(e.value) and len(str(e.value)) < 500


def test_a_point_that_does_not_fit_is_a_row_with_an_error(scenario_file):
    frame = sweep_of(scenario_file, ["model=llama-3.1-8b,llama-3.1-70b"]).frame
    assert frame.columns[-1] == "error"
    assert pd.isna(frame["error"][0]) and frame["error"][1].startswith("does not fit")
    assert pd.isna(frame["request_throughput"][1])


def test_variants_need_dropping_before_a_sweep(tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "variants": {"a": {}, "b": {}}}))
    with pytest.raises(SweepError, match="variants=\\{\\}"):
        sweep_of(path, ["engine.block_size=16,32"])
    assert sweep_of(path, ["engine.block_size=16,32", "variants={}"]).frame.shape[0] == 2


def run_cli(path: Path, out: Path, *extra: str) -> bytes:
    assert main([str(path), "--set", "engine.block_size=16,32", "--set", "workload.arrival.rate=1,3",
                 "--out", str(out), "--quiet", *extra]) == 0
    return (out / "sweep.csv").read_bytes()


def test_cli_sweep_writes_csv_plots_and_page_identically_for_any_jobs(scenario_file, tmp_path):
    one = run_cli(scenario_file, tmp_path / "one", "--jobs", "1")
    two = run_cli(scenario_file, tmp_path / "two", "--jobs", "2")
    assert one == two
    names = {p.name for p in (tmp_path / "two").iterdir()}
    assert {"sweep.csv", "sweep.html", "sweep_ttft_p99.png", "sweep_kv_usage_peak.png"} <= names
    assert "sweep_goodput.png" not in names             # no SLO, no goodput: no empty plot


def test_point_outputs_write_each_run(scenario_file, tmp_path):
    out = tmp_path / "out"      # not the scenario's own folder: kvtwin refuses folders with foreign files
    assert main([str(scenario_file), "--set", "engine.block_size=16,32", "--out", str(out),
                 "--quiet", "--jobs", "1", "--point-outputs"]) == 0
    folders = sorted(p.name for p in (out / "points").iterdir())
    assert folders == ["000_block_size=16", "001_block_size=32"]
    assert (out / "points" / folders[0] / "summary.json").exists()


def test_no_plots_applies_to_a_sweep_and_its_points(scenario_file, tmp_path):
    """--no-plots on a sweep: sweep.csv and each point's data files, no figure and no page."""
    out, plotted = tmp_path / "out", tmp_path / "plotted"
    assert run_cli(scenario_file, out, "--jobs", "1", "--point-outputs", "--no-plots") == run_cli(
        scenario_file, plotted, "--jobs", "1")
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert "sweep.csv" in written and "points/000_block_size=16,rate=1/summary.json" in written
    assert not [f for f in written if f.endswith((".png", ".html"))], written
    assert (plotted / "sweep.html").exists()


@pytest.mark.parametrize("flag", [["--trace"], ["--steps", "full"]])
def test_point_run_flags_without_point_outputs_are_an_error(scenario_file, tmp_path, capsys, flag):
    """--trace and --steps full shape each point's own files, which only --point-outputs writes."""
    assert main([str(scenario_file), "--set", "engine.block_size=16,32", "--out", str(tmp_path / "out"),
                 "--quiet", *flag]) == 2
    assert f"{' '.join(flag)} applies to each point's own run files: add --point-outputs" in capsys.readouterr().err


@pytest.mark.parametrize("sets, message", [
    (["--set", "engine.block_size=16,banana"], "engine.block_size"),
    (["--set", "engine.block_size=16,16"], "comes more than once"),
    (["--set", "engine.block_size=16,32", "--jobs", "0"], "--jobs")])
def test_a_sweep_that_cannot_run_leaves_no_output_folder(scenario_file, tmp_path, capsys, sets, message):
    """Every point is validated (and --jobs checked) before the folder is made: a bad point left a
    new folder holding only INCOMPLETE and the run marker (found by h/audit2)."""
    out = tmp_path / "out"
    assert main([str(scenario_file), *sets, "--out", str(out), "--quiet"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_sweep_flags_without_a_sweep_are_an_error(scenario_file, tmp_path, capsys):
    assert main([str(scenario_file), "--zip", "--out", str(tmp_path), "--quiet"]) == 2
    assert "--zip applies to sweeps" in capsys.readouterr().err


def test_ray_backend_gives_the_same_csv(scenario_file, tmp_path):
    ray = pytest.importorskip("ray")
    local = run_cli(scenario_file, tmp_path / "local", "--jobs", "1")
    sigterm = signal.getsignal(signal.SIGTERM)                           # ray.init installs its own
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)   # the test's own local instance
    try:
        assert run_cli(scenario_file, tmp_path / "in_process", "--ray") == local
        assert ray.is_initialized()                                      # the sweep left it running
        address = ray.get_runtime_context().gcs_address                  # a second driver connects by address
        out = tmp_path / "by_address"
        subprocess.run([sys.executable, "-m", "sim.cli", str(scenario_file), "--set", "engine.block_size=16,32",
                        "--set", "workload.arrival.rate=1,3", "--out", str(out), "--quiet", "--ray", address],
                       check=True, timeout=120)
        assert (out / "sweep.csv").read_bytes() == local
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


def test_the_idle_work_runs_once_on_processes_and_in_one_process():
    """parallel_map's `when_idle` (a sweep loads its output libraries there): once, and the results
    still come back in item order."""
    from sim.whatif.parallel import parallel_map

    calls = []
    assert parallel_map(abs, [-3, -1, -2], jobs=2, quiet=True, when_idle=lambda: calls.append("processes")) == [3, 1, 2]
    assert parallel_map(abs, [-3, -1], jobs=1, quiet=True, when_idle=lambda: calls.append("here")) == [3, 1]
    assert calls == ["processes", "here"]


def faults_refilling_freed_memory(megabytes: int) -> int:
    """Page faults of allocating `megabytes` again after this process freed as many (run in a worker)."""
    import resource

    import numpy as np

    np.ones(megabytes << 17).sum()                # (8 bytes an element) allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.ones(megabytes << 17).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_local_worker_reuses_the_memory_an_item_freed():
    """A sweep's worker keeps what a point frees for the next point (keep_freed_memory): without it,
    glibc unmaps a freed 16 MB block, and the next one faults in its 4096 pages again (zeroed by the
    kernel, a few % of a 10k-request point's CPU). Two items so that each worker gets one."""
    from sim.whatif.parallel import parallel_map

    # glibc takes both values (asked in a child: mallopt would change this test process's heap
    # for the tests after it)
    took = subprocess.run([sys.executable, "-c", "from sim.whatif.parallel import keep_freed_memory as k; "
                           "raise SystemExit(0 if k() else 1)"], cwd=Path(__file__).resolve().parents[2])
    assert took.returncode == 0
    assert max(parallel_map(faults_refilling_freed_memory, [16, 16], jobs=2, quiet=True)) < 400
