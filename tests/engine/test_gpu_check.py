"""The GPU check, rehearsed: its calibration grids are executable, its orchestration keeps
what finished when a step dies or time runs out, and its correctness gate catches a wrong kernel.

The grid test builds, for every scenario the check runs, the calibration probes the H200
would run (device h200, its planned pool, the scenario's max_model_len / token budget /
sequence cap, the extra block-size pools sized from the memory the plan leaves), then
(1) allocates each probe at full size in a pool of the planned size and checks it with the
runner's own batch check, and (2) executes each probe on the CPU engine (tiny model) with
every length and limit divided by SCALE (contexts rounded down, new tokens up): same batch sizes and composition, 1/16 of
the tokens, so a 256 x 4096 decode probe becomes 256 x 256.
"""
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from engine.runner import ModelRunner, check_batch
from engine.weights import build_model
from sim.core.catalog import get_model
from sim.core.kv import KVCacheManager
from sim.core.memory import cdiv, plan_memory
from validate import gpu_check
from validate.calibrate import (Grid, ProbeLimits, measure_points, planned_extra_pool_tokens, probe_batch,
                                probe_pools, release)

ROOT = Path(__file__).resolve().parents[2]
SCALE = 16


def h200_pools(name):
    scenario = gpu_check.gpu_scenario(name, device="h200")
    plan = plan_memory(scenario)
    limits = ProbeLimits.of(scenario, plan.num_blocks)
    return scenario, plan, limits, probe_pools(Grid(), limits, planned_extra_pool_tokens(plan))


# bench_prefix_reuse has bench_steady_nocache's limits (only prefix caching differs)
@pytest.mark.parametrize("name", ["seed_static_vs_continuous", "bench_steady_nocache"])
def test_h200_calibration_grid_fits_the_scenario(name):
    scenario, plan, limits, pools = h200_pools(name)
    assert scenario.device.name.lower().startswith("h200")
    assert pools[0].block_size == scenario.engine.block_size and len(pools[0].points) >= 10
    left = plan.visible_bytes - plan.predicted_peak_bytes - plan.reserved_bytes
    for pool in pools:
        assert pool.points, pool.block_size
        # the extra pools are allocated one at a time beside the main one: half of what is left
        if pool is not pools[0]:
            assert pool.num_blocks * plan.kv_bytes_per_token * pool.block_size <= 0.5 * left + plan.block_bytes
        kv = KVCacheManager(pool.num_blocks, pool.block_size, enable_caching=False)
        for tag, (kind, seqs) in enumerate(pool.points):
            assert all(ctx + new <= scenario.max_model_len for ctx, new, _ in seqs), (kind, len(seqs))
            batch = probe_batch(kv, seqs, tag)
            check_batch(batch, pool.block_size, scenario.max_model_len, pool.num_blocks)
            assert batch.num_prefill_tokens + batch.num_decode <= scenario.max_num_batched_tokens
            assert batch.num_seqs <= scenario.max_num_seqs
            release(kv, batch)


def test_bench_prefix_reuse_shares_the_tested_limits():
    names = set(gpu_check.GPU_SCENARIOS)
    limits = {n: ProbeLimits.of(gpu_check.gpu_scenario(n), 10 ** 6) for n in names}
    assert limits["bench_prefix_reuse"] == limits["bench_steady_nocache"]   # why one of them is tested


def test_the_grid_drops_probes_past_max_model_len():
    """The bug the check had: decode probes at 8192 on a 4096-token engine."""
    _, _, limits, pools = h200_pools("bench_steady_nocache")
    contexts = {ctx for _, seqs in pools[0].points for ctx, _, _ in seqs}
    assert max(contexts) == 4095 and 2048 in contexts       # 8192 probed at the limit instead
    unfiltered = ProbeLimits(limits.max_tokens, limits.max_seqs, 10 ** 9, limits.num_blocks, limits.block_size)
    assert len(pools[0].points) < len(probe_pools(Grid(), unfiltered, 0)[0].points)


@pytest.fixture(scope="module")
def tiny():
    return build_model(get_model("tiny"), "cpu")


def scaled(seqs):
    """Context rounded down, new tokens up: floor(c/S) + ceil(n/S) <= ceil((c+n)/S), so a probe
    within max_model_len stays within max_model_len / S."""
    return [(ctx // SCALE, cdiv(new, SCALE), decode) for ctx, new, decode in seqs]


@pytest.mark.parametrize("name", ["seed_static_vs_continuous", "bench_steady_nocache"])
def test_h200_probes_execute_on_the_cpu_engine_scaled(name, tiny):
    scenario, _, _, pools = h200_pools(name)       # bench_prefix_reuse has the same limits as nocache
    max_model_len = scenario.max_model_len // SCALE
    rows = 0
    for pool in pools:
        points = [(kind, scaled(seqs)) for kind, seqs in pool.points]
        need = max(sum(cdiv(c + n, pool.block_size) for c, n, _ in seqs) for _, seqs in points) + 1
        runner = ModelRunner(tiny, need, pool.block_size, max_model_len)
        measured = measure_points(runner, points, repeats=0)
        assert len(measured) == len(points) and all(r["device_s"] > 0 for r in measured)
        rows += len(measured)
    assert rows >= sum(len(p.points) for p in pools)


def test_estimates_fit_the_deadline():
    assert sum(s.estimate_s for s in gpu_check.STEPS) <= gpu_check.DEFAULT_DEADLINE_S
    assert [s.name for s in gpu_check.STEPS][:4] == ["environment", "compile", "gate", "calibration"]


def run_check(tmp_path, *args):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "validate.gpu_check", "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, out, json.loads((out / "gpu_check.json").read_text())


def archived(out):
    with tarfile.open(out / "reports.tar.gz") as tar:
        return set(tar.getnames())


def assert_flat(out):
    files = [p for p in out.rglob("*")]
    assert len(files) <= 8 and all(p.is_file() and p.parent == out for p in files), files


def test_a_dead_step_does_not_stop_the_next(tmp_path):
    proc, out, summary = run_check(tmp_path, "--only", "environment", "kernel_bench",
                                   "--inject-failure", "environment")
    assert proc.returncode == 1
    assert not summary["steps"]["environment"]["ok"] and "exited with 134" in summary["steps"]["environment"]["error"]
    assert summary["steps"]["kernel_bench"]["ok"], summary
    assert "reports/cpu/kernels.json" in archived(out)
    assert_flat(out)
    assert "fits" in proc.stdout


def test_the_dry_run_replays_a_scenario_on_the_engine_and_archives_the_comparison(tmp_path):
    """The cheap form of `python -m validate.gpu_check --dry-run`: one validation step end to end
    (the scenario predicted, replayed on the CPU engine, compared, archived), the GPU run's path."""
    proc, out, summary = run_check(tmp_path, "--only", "validate_seed_static_vs_continuous")
    step = summary["steps"]["validate_seed_static_vs_continuous"]
    assert proc.returncode == 0 and step["ok"], (summary, proc.stderr[-2000:])
    names = archived(out)
    for variant in ("static", "continuous"):
        folder = f"reports/cpu/seed_static_vs_continuous/{variant}"
        assert {f"{folder}/comparison.csv", f"{folder}/measured/steps.csv", f"{folder}/predicted/summary.json"} <= names
    assert_flat(out)


def test_the_deadline_skips_and_still_archives(tmp_path):
    proc, out, summary = run_check(tmp_path, "--deadline", "0.01")
    assert proc.returncode == 1
    assert set(summary["steps"]) == set(gpu_check.STEP_NAMES)
    assert all("deadline" in r["skipped"] for r in summary["steps"].values())
    assert (out / "reports.tar.gz").exists()
    assert_flat(out)


def test_a_step_past_its_time_is_killed_and_recorded(tmp_path):
    proc, out, summary = run_check(tmp_path, "--only", "environment", "--max-step-s", "0.3")
    assert "timeout" in summary["steps"]["environment"]["error"]
    assert_flat(out)


def small_gate_scenario():
    return gpu_check.gpu_scenario("bench_steady_nocache", dry_run=True, extra=["engine.max_model_len=96"])


def test_the_gate_passes_a_correct_engine():
    from validate.gate import correctness_gate

    result = correctness_gate(small_gate_scenario(), "cpu")
    assert result["rows"] == 5 and max(result["row_rel_errors"]) < 1e-3
    assert result["overlap"]["steps"] >= 5 and result["overlap"]["worst_row_rel_error"] == 0.0


def test_the_gate_fails_a_wrong_kernel(monkeypatch):
    """A kernel that reads one token too few of every context must not pass."""
    import engine.attention as attention
    from validate.gate import correctness_gate

    original = attention.TritonPagedAttention.__call__

    def short_context(self, q, k, v, k_cache, v_cache, scale, layer=attention.FULL):
        self.meta.seq_lens = self.meta.seq_lens - 1
        return original(self, q, k, v, k_cache, v_cache, scale, layer)

    monkeypatch.setattr(attention.TritonPagedAttention, "__call__", short_context)
    with pytest.raises(AssertionError, match="Triton vs torch"):
        correctness_gate(small_gate_scenario(), "cpu")
