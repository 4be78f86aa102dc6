"""pandas' reductions of a Series, bit for bit, on numpy arrays (the summary is made from the
record columns without a frame, and must keep the figures a frame gave).

pandas (`pandas.core.nanops`, skipna=True) reduces a float column by setting its missing values
to the operation's identity and calling numpy's own reduction on the array: a sum is numpy's
pairwise summation of the values with NaN set to 0, a mean that sum over the count of non-NaN
values, a max or min the numpy max or min with NaN set to -inf or +inf (NaN when none is left).
Integers and booleans have no missing values: numpy's reduction as it is (a bool's sum counts).
An object column (a measured run's field the endpoint did not report: None) is left to pandas
itself: only measured runs have them, and their None-skipping rules are pandas' own.
tests/sim/test_exact.py holds each to pandas on random data, NaN included.
"""
from __future__ import annotations

import numpy as np


def _floats_without_nan(values: np.ndarray, fill: float) -> tuple[np.ndarray, int]:
    """The values with NaN set to `fill` (a copy only where there is one), and the count left."""
    nan = np.isnan(values)
    missing = int(nan.sum())
    if missing:
        values = values.copy()
        np.putmask(values, nan, fill)
    return values, len(values) - missing


def _object_series(values: np.ndarray):
    import pandas as pd

    return pd.Series(values, dtype=object)


def nansum(values: np.ndarray):
    """Series.sum(): float64, or the integer sum for integers and booleans (a count)."""
    values = np.asarray(values)
    if values.dtype.kind == "O":
        return _object_series(values).sum()
    if values.dtype.kind == "f":
        return _floats_without_nan(values, 0.0)[0].sum()
    if values.dtype.kind == "b":
        return values.sum(dtype=np.int64)
    return values.sum()


def nanmean(values: np.ndarray) -> float:
    """Series.mean(): the sum of the non-NaN values over their count (NaN when there is none)."""
    values = np.asarray(values)
    if values.dtype.kind == "O":
        return _object_series(values).mean()
    if values.dtype.kind == "f":
        kept, count = _floats_without_nan(values, 0.0)
        total, count = kept.sum(), np.float64(count)
    else:
        total, count = values.sum(dtype=np.float64), np.float64(len(values))
    return total / count if count > 0 else np.nan


def nanmax(values: np.ndarray):
    """Series.max(): NaN skipped; NaN when nothing is left."""
    return _extreme(np.asarray(values), -np.inf, np.max)


def nanmin(values: np.ndarray):
    """Series.min(): NaN skipped; NaN when nothing is left."""
    return _extreme(np.asarray(values), np.inf, np.min)


def _extreme(values: np.ndarray, fill: float, reduce):
    if values.dtype.kind == "O":
        series = _object_series(values)
        return series.max() if reduce is np.max else series.min()
    if values.dtype.kind != "f":
        return reduce(values) if len(values) else np.nan
    kept, count = _floats_without_nan(values, fill)
    return reduce(kept) if count else np.nan
