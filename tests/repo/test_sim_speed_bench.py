"""bench/sim_speed.py's measured sweep: the `simrun` command it times is the sweep it claims."""
from pathlib import Path

from bench.sim_speed import SWEEP_RATES, measured_sweep, sweep_argv
from sim.whatif.sweep import split_sets, sweep_points


def swept(argv: list[str]) -> tuple[list[str], list]:
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    plain, axes = split_sets(sets)
    return plain, sweep_points(axes)


def test_a_hundred_points_are_ten_rates_times_ten_seeds():
    plain, points = swept(sweep_argv(100, 2, 10_000, Path("out")))
    assert plain == ["workload.num_requests=10000"] and len(points) == 100
    assert {p.values for p in points} == {(r, s) for r in SWEEP_RATES for s in range(10)}
    _, few = swept(sweep_argv(3, 2, 10_000, Path("out")))
    assert [p.values for p in few] == [(100,), (125,), (150,)]


def test_the_measured_sweep_runs_every_point_on_its_workers():
    m = measured_sweep(3, 2, requests=40)
    assert m["exit_code"] == 0 and m["points_written"] == 3 and m["points_failed"] == 0
    assert m["workers_cpu_s"] > 0 and m["main_process_cpu_s"] > 0 and m["wall_s"] >= m["wall_in_process_s"]


def test_simrun_results_keep_the_rows_of_cases_not_measured_again(tmp_path):
    """A million-request case is measured by its own invocation: it must not drop the others' rows."""
    import json

    from bench.sim_speed import _earlier_rows

    out = tmp_path / "simrun_speed.json"
    assert _earlier_rows(str(out), ["vidur-100k"]) == []
    out.write_text(json.dumps({"cases": [{"case": "vidur-100k", "cpu": 1}, {"case": "bench-1m-150", "cpu": 2}]}))
    assert _earlier_rows(str(out), ["vidur-100k"]) == [{"case": "bench-1m-150", "cpu": 2}]


def test_sliding_cost_is_read_per_request_and_per_step_against_full_attention():
    """Full attention may take a different number of steps (its predictions differ): both ratios."""
    from bench.sim_speed import cost_vs_full_attention

    sliding = {"simulate_cpu_s": 3.0, "steps": 200}
    full = {"simulate_cpu_s": 1.0, "steps": 100}
    assert cost_vs_full_attention(sliding, full) == {"per_request": 3.0, "per_step": 1.5}
