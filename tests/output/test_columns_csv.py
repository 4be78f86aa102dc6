"""The columnar CSV writer (sim/columns.py) writes exactly pandas' `to_csv(index=False)` bytes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim import columns as columnar
from sim.output.io import write_csv

ROOT = Path(__file__).resolve().parents[2]

EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 2.0 ** 53 - 1, -(2.0 ** 53 - 1), 2.0 ** 53, 1e16 - 2, 9e15, 1e10, 12.0, -3.0, 0.5, 1e-4, 9.999999999999999e-05, 1.2e-05, 0.00022419999999999997,
               999999999.5, 1e9 + 0.5, 1e9, 1e15, 1e16, 1.5e16, 123456789.123, 0.1 + 0.2, 5e-324,
               1.7976931348623157e308, np.inf, -np.inf, np.nan, 13.199123556080494, -2.5e-7, 3.0e10 + 0.25]


def _random_frame(rng: np.random.Generator, n: int) -> pd.DataFrame:
    magnitudes = 10 ** rng.uniform(-8, 18, n) * rng.choice([-1, 1], n)
    floats = np.concatenate([EDGE_FLOATS, magnitudes, rng.random(n), np.round(rng.random(n) * 100, 2),
                             np.round(magnitudes)])                        # whole numbers, every size
    m = len(floats)
    ints = rng.integers(-(2 ** 40), 2 ** 40, m)
    ints[:4] = [0, -1, np.iinfo(np.int64).max, np.iinfo(np.int64).min + 1]
    text = rng.choice(np.array(["finished", "rejected", 'say "hi", then go', "two\nlines", "", None, "é"],
                               dtype=object), m)
    conversation = np.array([None if i % 3 else int(i) for i in range(m)], dtype=object)
    return pd.DataFrame({"f": floats, "i": ints, "small": ints % 7, "u": np.arange(m, dtype=np.uint32),
                         "b": rng.random(m) < 0.5, "text": text, "conversation": conversation,
                         "status": pd.array(rng.choice(["finished", "aborted"], m), dtype="str"),
                         "none": np.full(m, None, dtype=object)})


@pytest.mark.parametrize("with_arrow", [True, False])
def test_csv_is_pandas_byte_for_byte(tmp_path, monkeypatch, with_arrow):
    if with_arrow:
        pytest.importorskip("pyarrow")
    else:
        monkeypatch.setattr(columnar, "_pyarrow", lambda: None)
    monkeypatch.setattr(columnar, "CHUNK_ROWS", 1000)             # several chunks
    frame = _random_frame(np.random.default_rng(7), 5000)
    assert columnar.csv_chunks(dict(frame.items())) is not None   # the fast path, not the fallback
    write_csv(tmp_path / "fast.csv", frame)
    assert (tmp_path / "fast.csv").read_bytes() == frame.to_csv(index=False).encode()


@pytest.mark.parametrize("with_arrow", [True, False])
def test_columns_of_one_value_are_pandas_byte_for_byte(tmp_path, monkeypatch, with_arrow):
    """A number or bool column holding one value throughout is formatted once (`_one_cell`), bit for
    bit: 0.0 beside -0.0, or a last row that differs, is not one value; the same bytes as pandas."""
    if with_arrow:
        pytest.importorskip("pyarrow")
    else:
        monkeypatch.setattr(columnar, "_pyarrow", lambda: None)
    monkeypatch.setattr(columnar, "CHUNK_ROWS", 700)             # several chunks
    n = 2000
    last_differs = np.full(n, 0.5)
    last_differs[-1] = 0.25
    frame = pd.DataFrame({"zero": np.zeros(n), "minus_zero": np.full(n, -0.0), "nan": np.full(n, np.nan),
                          "zeros_signed": np.where(np.arange(n) == n // 2, -0.0, 0.0), "last": last_differs,
                          "big": np.full(n, 1e300), "tiny": np.full(n, 1.2e-05), "whole": np.full(n, 3.0),
                          "int": np.full(n, -7, np.int64), "u8": np.full(n, 200, np.uint8),
                          "true": np.ones(n, bool), "ids": np.arange(n)})
    assert columnar._one_cell(frame["zeros_signed"].to_numpy()) is None
    assert columnar._one_cell(frame["last"].to_numpy()) is None
    assert columnar._one_cell(frame["int"].to_numpy()) is not None
    write_csv(tmp_path / "one.csv", frame)
    assert (tmp_path / "one.csv").read_bytes() == frame.to_csv(index=False).encode()


def test_empty_and_all_missing_columns(tmp_path):
    for frame in (pd.DataFrame({"a": np.zeros(0), "b": np.zeros(0, int)}),
                  pd.DataFrame({"a": [np.nan] * 3, "b": [1, 2, 3], "c": [None] * 3})):
        write_csv(tmp_path / "x.csv", frame)
        assert (tmp_path / "x.csv").read_bytes() == frame.to_csv(index=False).encode()


def test_unsupported_columns_fall_back_to_pandas(tmp_path):
    frame = pd.DataFrame({"mixed": np.array([1, 1.0, True], dtype=object), "f32": np.ones(3, np.float32),
                          "t": pd.to_datetime(["2026-01-01"] * 3)})
    for name in frame.columns:
        assert columnar.csv_chunks({name: frame[name].to_numpy(), "x": np.arange(3)}) is None
    write_csv(tmp_path / "x.csv", frame)
    assert (tmp_path / "x.csv").read_bytes() == frame.to_csv(index=False).encode()


def test_run_files_are_pandas_byte_for_byte(tmp_path):
    """A run's requests.csv and steps.csv (aggregated and full) as pandas wrote them before."""
    from sim.output.run_files import write_data_files
    from sim.predict import predict
    from sim.scenario import load_scenario
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml", ["workload.num_requests=300"])
    result = predict(scenario)
    for kind in ("aggregated", "full"):
        files = write_data_files(result, tmp_path / kind, kind)
        steps = result.steps if kind == "full" else result.records.steps_frame(full=False)
        assert files["steps"].read_bytes() == steps.to_csv(index=False).encode()
        assert files["requests"].read_bytes() == result.requests.to_csv(index=False).encode()
