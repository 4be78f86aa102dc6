"""Measured operator tables (aiconfigurator-core) as a step-time source."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("aiconfigurator_core")

from sim.core.kv import KVCacheManager  # noqa: E402
from sim.costmodel import CostModel  # noqa: E402
from sim.optables import OperatorTables, TablesUnavailable, bucket, data_root, tables_for  # noqa: E402
from sim.scenario import validate_scenario  # noqa: E402
from validate.calibrate import probe_batch  # noqa: E402

SCENARIO = {"model": "llama-3.1-8b", "device": "h100-sxm", "step_times": "tables",
            "engine": {"max_model_len": 4096, "max_num_seqs": 64, "max_num_batched_tokens": 2048}}


@pytest.fixture(scope="module")
def tables():
    s = validate_scenario(SCENARIO)
    return tables_for(s.device.name, s.model, 1, s.max_num_batched_tokens, s.max_num_seqs, s.max_model_len)


def test_a_grid_point_reads_back_the_measured_latency(tables):
    import pandas as pd

    gemm = pd.read_parquet(data_root() / "h100_sxm" / "gemm" / "vllm" / tables.version / "gemm_perf.parquet")
    row = gemm[(gemm.gemm_dtype == "bfloat16") & (gemm.m == 64) & (gemm.n == 4096) & (gemm.k == 4096)].iloc[0]
    assert tables._lookup(tables._gemm, 64, 4096, 4096) == pytest.approx(row.latency * 1e-3, rel=1e-9)


def test_precomputed_sizes_equal_direct_lookups(tables):
    direct = sum(tables._lookup(tables._gemm, 300, n, k) for n, k in tables._layer_gemms)
    assert tables.linear_s(300) == pytest.approx(direct, rel=1e-9)
    ctx = bucket(1000)
    assert tables.generation_s(16, ctx) == pytest.approx(tables._lookup(tables._generation, 16, ctx), rel=1e-9)
    assert tables.linear_s(2000) > tables.linear_s(200) > 0 and tables.generation_s(64, ctx) > tables.generation_s(1, ctx)
    # a chunk against cached context costs more than alone, less than the whole sequence
    assert tables.context_s(512, 0) < tables.context_s(512, 1024) < tables.context_s(1536, 0)


def test_a_scenario_picks_the_tables_and_every_output_says_so():
    from sim.predict import predict

    s = validate_scenario({**SCENARIO, "workload": {"num_requests": 24, "prompt_len": 300, "output_len": 16}})
    result = predict(s)
    assert result.summary["step_time_source"] == "tables"
    assert "aiconfigurator-core" in result.manifest["cost_model"]["tables"]
    datasheet = predict(validate_scenario({**SCENARIO, "step_times": "datasheet",
                                           "workload": {"num_requests": 24, "prompt_len": 300, "output_len": 16}}))
    assert datasheet.summary["step_time_source"] == "datasheet"
    from sim.cli import step_time_line

    assert "aiconfigurator-core, vLLM" in step_time_line(result.cost_model)
    assert step_time_line(datasheet.cost_model).startswith("datasheet (UNCALIBRATED")
    assert not np.isclose(result.steps["device_s"].sum(), datasheet.steps["device_s"].sum())
    host, device = result.cost_model.step_times(result.steps)        # recorded steps reprice the same
    assert np.allclose(device, result.steps["device_s"])


def test_decode_step_is_priced_from_its_composition():
    s = validate_scenario(SCENARIO)
    cost = CostModel.for_scenario(s)
    kv = KVCacheManager(4096, 16, enable_caching=False)
    batch = probe_batch(kv, [(1000, 1, True)] * 8, tag=1)
    _, device = cost.step_time(batch)
    t, c = cost.tables, cost.coefficients
    per_layer = (t.linear_s(8) + t.generation_s(8, bucket(batch.decode_ctx / 8)) + c.layer_overhead_s
                 + batch.blocks_read * c.block_overhead_s)
    expected = c.step_device_s + s.model.num_layers * per_layer + t.head_s(8) + 8 * cost._sample_row_s
    assert device == pytest.approx(expected, rel=1e-9)


def test_uncovered_device_or_dtype_is_a_clear_error():
    s = validate_scenario(SCENARIO)
    with pytest.raises(TablesUnavailable, match="no operator tables for device 'l4'"):
        OperatorTables("l4", s.model)
    with pytest.raises(TablesUnavailable, match="bfloat16 only"):
        OperatorTables("h100-sxm", s.model.model_copy(update={"dtype": "float16"}))


def test_roofline_vs_tables_rederives_physical_efficiencies():
    from validate.tables_compare import compare

    row = compare("h100-sxm")
    assert 0.5 < row["decode_ratio_median"] < 2 and 0.5 < row["prefill_ratio_median"] < 2
    assert 0.2 < row["bw_eff"] <= 1.0 and 0.2 < row["flops_eff"] <= 1.0
