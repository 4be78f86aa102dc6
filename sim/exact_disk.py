"""numpy's reductions and percentiles, bit for bit, over columns kept on disk and read back a
slice at a time (a spilled run's summary: sim/output/streamed.py). Memory stays bounded by the
slice, whatever the column's length.

- A float sum: numpy sums a contiguous float64 array pairwise in one call (`pairwise_sum` in
  numpy's loops_utils.h): a run of n > 128 values is split at n/2 rounded down to a multiple of
  8, and the two halves' sums are added. That sum of a run depends only on the run's values, so it is taken here by the
  same splits down to runs of at most LEAF values, each summed by numpy itself (from -0.0, the
  identity of float addition, so the run is summed alone).
- An order statistic (the k-th smallest value, or the value where a running weight passes k): a
  first pass counts the values by the top 16 bits of their order-preserving 64-bit keys, finds the
  bucket holding rank k, and the next pass counts within that bucket by the next 16 bits, until the
  bucket is small enough to load (LOAD values) or holds one key; that bucket is then sorted.
  (-0.0 and 0.0 share a key, as they compare equal; which of the two a rank among such ties
  holds is numpy's partition order, not reproduced: a latency or a gap is never -0.0.)
- A percentile: the order statistics numpy's linear method reads, interpolated by numpy's own
  index, gamma and lerp, repeated here step by step, so the figure is np.percentile's.

tests/sim/test_exact_disk.py holds each to numpy and to metrics.distribution on adversarial data.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

LEAF = 1 << 20          # values summed by one numpy call
LOAD = 1 << 20          # values of a bucket loaded and sorted at once
READ = 1 << 20          # values read per slice in a pass


class DiskColumn:
    """An append-only column of one dtype in a file, read back a slice at a time."""

    def __init__(self, path: Path, dtype) -> None:
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self.length = 0
        self._file = create_fresh(self.path)

    def __len__(self) -> int:
        return self.length

    def append(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        if len(values):
            self._file.write(values.tobytes())
            self.length += len(values)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """values[lo:hi] as a fresh array (no map: its pages do not stay with the process)."""
        if self._file is not None:
            self._file.flush()
        hi = min(hi, self.length)
        if hi <= lo:
            return np.zeros(0, dtype=self.dtype)
        with open(self.path, "rb") as f:
            f.seek(lo * self.dtype.itemsize)
            return np.fromfile(f, dtype=self.dtype, count=hi - lo)

    def slices(self, size: int = READ) -> Iterator[np.ndarray]:
        for lo in range(0, self.length, size):
            yield self.read(lo, lo + size)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def unlink(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def create_fresh(path: Path):
    """`path` opened for writing as a new regular file: whatever was there goes first, so a link
    named like a scratch file (one that `--force` kept in an output folder) is replaced, never
    written through, and O_NOFOLLOW | O_EXCL refuse one that appears meanwhile."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return os.fdopen(fd, "wb")


Reader = Callable[[int, int], np.ndarray]


# ----------------------------------------------------------------------------- sums

def add_reduce(read: Reader, n: int):
    """np.add.reduce of the float64 array whose values[lo:hi] `read` gives, n values long."""
    if n == 0:
        return np.float64(0.0)
    return _pairwise(read, 0, n)


def _pairwise(read: Reader, lo: int, n: int):
    if n <= LEAF:
        return np.add.reduce(read(lo, lo + n), initial=-0.0)
    half = n // 2
    half -= half % 8
    return _pairwise(read, lo, half) + _pairwise(read, lo + half, n - half)


def column_sum(column: DiskColumn, nan_as_zero: bool = False):
    """np.sum of the column (with NaN set to 0 first: pandas' sum, sim/exact.py)."""
    read = column.read
    if nan_as_zero:
        def read(lo, hi):      # noqa: E306
            values = column.read(lo, hi)
            return np.where(np.isnan(values), 0.0, values)
    return add_reduce(read, len(column))


# ----------------------------------------------------------------------------- order statistics

_SIGN = np.uint64(1 << 63)


def _keys(values: np.ndarray) -> np.ndarray:
    """float64 -> uint64 in the same order (-0.0 and 0.0 both as 0.0's key: they compare equal)."""
    values = values + 0.0                       # (-0.0 + 0.0 is 0.0)
    bits = values.view(np.uint64)
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def _value(key: int) -> float:
    key = np.uint64(key)
    bits = key & ~_SIGN if key & _SIGN else ~key
    return np.array([bits], dtype=np.uint64).view(np.float64)[0]


Chunks = Callable[[], Iterator[tuple[np.ndarray, Optional[np.ndarray]]]]


def order_statistics(chunks: Chunks, ranks: Sequence[int]) -> dict[int, np.float64]:
    """{k: the value at rank k} of the (values, weights) that `chunks()` yields afresh at each pass:
    with weights None the k-th smallest (from 0), else the first value in sorted order whose running
    weight exceeds k (np.searchsorted(cumsum, k, side='right') over a stable sort). No NaN."""
    # each rank's bucket: (bits known, their value, rank within the bucket)
    todo = {k: (0, 0, k) for k in set(ranks)}
    out: dict[int, np.float64] = {}
    while todo:
        buckets = {(bits, prefix) for bits, prefix, _ in todo.values()}
        counts = _bucket_counts(chunks, buckets)
        load = set()
        for k, (bits, prefix, rank) in list(todo.items()):
            cum = np.cumsum(counts[(bits, prefix)])
            sub = int(np.searchsorted(cum, rank, side="right"))
            rank -= int(cum[sub - 1]) if sub else 0
            inside = cum[sub] - (cum[sub - 1] if sub else 0)
            bits, prefix = bits + 16, (prefix << 16) | sub
            if bits == 64:
                out[k] = _value(prefix)
                del todo[k]
                continue
            todo[k] = (bits, prefix, rank)
            if inside <= LOAD:
                load.add((bits, prefix))
        if load:
            loaded = _bucket_values(chunks, load)
            for k, (bits, prefix, rank) in list(todo.items()):
                if (bits, prefix) in loaded:
                    out[k] = _select(*loaded[(bits, prefix)], rank)
                    del todo[k]
    return out


def _in_bucket(keys: np.ndarray, bits: int, prefix: int) -> np.ndarray:
    if bits == 0:
        return np.ones(len(keys), dtype=bool)
    return (keys >> np.uint64(64 - bits)) == np.uint64(prefix)


def _bucket_counts(chunks: Chunks, buckets: set) -> dict:
    counts = {b: np.zeros(1 << 16) for b in buckets}
    for values, weights in chunks():
        keys = _keys(values)
        for bits, prefix in buckets:
            inside = _in_bucket(keys, bits, prefix)
            sub = ((keys[inside] >> np.uint64(48 - bits)) & np.uint64(0xFFFF)).astype(np.int64)
            w = None if weights is None else weights[inside].astype(np.float64)
            counts[(bits, prefix)] += np.bincount(sub, weights=w, minlength=1 << 16)
    return counts


def _bucket_values(chunks: Chunks, buckets: set) -> dict:
    parts: dict = {b: ([], []) for b in buckets}
    for values, weights in chunks():
        keys = _keys(values)
        for b in buckets:
            inside = _in_bucket(keys, *b)
            parts[b][0].append(values[inside])
            parts[b][1].append(np.ones(int(inside.sum()), dtype=np.int64) if weights is None
                               else weights[inside].astype(np.int64))
    return {b: (np.concatenate(v), np.concatenate(w)) for b, (v, w) in parts.items()}


def _select(values: np.ndarray, weights: np.ndarray, rank: int) -> np.float64:
    order = np.argsort(_keys(values), kind="stable")
    cum = np.cumsum(weights[order])
    return values[order[np.searchsorted(cum, rank, side="right")]]


# ----------------------------------------------------------------------------- percentiles

def linear_percentiles(n: int, percentiles, kth: Callable[[list[int]], dict]) -> np.ndarray:
    """np.percentile(a, percentiles) (method 'linear') of an array of n values, given `kth` that
    returns {rank: value} of the sorted array. numpy's own arithmetic, step by step (numpy 2.x,
    lib/_function_base_impl.py: `_quantile` with the 'linear' method, `_get_indexes`, `_get_gamma`,
    `_lerp`), so the result is equal bit for bit; tests/sim/test_exact_disk.py compares the two."""
    q = np.true_divide(np.asanyarray(percentiles), 100)
    virtual = np.asanyarray((n - 1) * q)
    previous_i = np.array(np.floor(virtual))          # (arrays, also for one percentile)
    next_i = np.array(previous_i + 1)
    last = virtual >= n - 1                  # numpy takes the last value there (index -1)
    previous_i[last] = -1
    next_i[last] = -1
    previous_i[virtual < 0] = 0
    next_i[virtual < 0] = 0
    gamma = np.asanyarray(virtual - previous_i, dtype=virtual.dtype)
    previous_i = previous_i.astype(np.intp) % n
    next_i = next_i.astype(np.intp) % n
    values = kth(sorted({*previous_i.ravel().tolist(), *next_i.ravel().tolist()}))
    a = np.array([values[i] for i in previous_i.ravel().tolist()]).reshape(virtual.shape)
    b = np.array([values[i] for i in next_i.ravel().tolist()]).reshape(virtual.shape)
    return _lerp(a, b, gamma)


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray):
    """numpy's interpolation between neighbours: from the nearer end, a + (b - a) t below one half
    and b - (b - a)(1 - t) from it (monotone and exact at both ends)."""
    diff = b - a
    out = np.asanyarray(np.add(a, diff * t))
    np.subtract(b, diff * (1 - t), out=out, where=t >= 0.5, casting="unsafe", dtype=type(out.dtype))
    return out[()] if out.ndim == 0 else out


def median(n: int, kth: Callable[[list[int]], dict]) -> np.float64:
    """np.median of an array of n values (NaN-free): the middle value, or the mean of the two."""
    half = n // 2
    if n % 2:
        return np.mean(np.array([kth([half])[half]]))
    values = kth([half - 1, half])
    return np.mean(np.array([values[half - 1], values[half]]))


def weighted_percentiles(total: int, percentiles, kth: Callable[[list[int]], dict]) -> list[float]:
    """metrics.weighted_percentiles over a sample of total weight `total`, given its weighted ranks."""
    wanted = []
    for q in percentiles:
        pos = q / 100 * (total - 1)
        wanted.append((pos, int(np.floor(pos)), int(np.ceil(pos))))
    values = kth(sorted({r for _, lo, hi in wanted for r in (lo, hi)}))
    return [float(values[lo] + (values[hi] - values[lo]) * (pos - lo)) for pos, lo, hi in wanted]


# ----------------------------------------------------------------------------- a distribution

class Sample:
    """A sample on disk (values, optional integer weights, and their products for the weighted
    mean) as metrics.distribution takes it: NaN values (and their weights) left out as they come."""

    def __init__(self, folder: Path, name: str, weighted: bool = False) -> None:
        self.values = DiskColumn(Path(folder) / f"{name}.values.bin", np.float64)
        self.weights = DiskColumn(Path(folder) / f"{name}.weights.bin", np.int64) if weighted else None
        self.products = DiskColumn(Path(folder) / f"{name}.products.bin", np.float64) if weighted else None
        self.total_weight = 0
        self.largest = -np.inf

    def add(self, values: np.ndarray, weights: Optional[np.ndarray] = None) -> None:
        values = np.asarray(values, dtype=np.float64)
        kept = ~np.isnan(values)
        values = values[kept]
        if not len(values):
            return
        self.values.append(values)
        self.largest = max(self.largest, values.max())
        if self.weights is not None:
            weights = np.asarray(weights)[kept]
            self.weights.append(weights)
            self.products.append(np.multiply(values, weights, dtype=np.float64))
            self.total_weight += int(np.sum(weights, dtype=np.int64))

    def _chunks(self):
        for lo in range(0, len(self.values), READ):
            yield (self.values.read(lo, lo + READ),
                   None if self.weights is None else self.weights.read(lo, lo + READ))

    def kth(self, ranks: list[int]) -> dict:
        return order_statistics(self._chunks, ranks)

    def distribution(self, percentiles) -> dict[str, Optional[float]]:
        """metrics.distribution of the sample, figure for figure."""
        n = len(self.values)
        if n == 0 or (self.weights is not None and self.total_weight == 0):
            return {"mean": None, **{f"p{p}": None for p in percentiles}, "max": None}
        if self.weights is None:
            mean = column_sum(self.values) / n
            cuts = linear_percentiles(n, percentiles, self.kth)
        else:
            # np.average: the products' sum over the weights' float64 sum (exact: integers below 2**53)
            mean = column_sum(self.products) / np.float64(self.total_weight)
            cuts = weighted_percentiles(self.total_weight, percentiles, self.kth)
        out = {"mean": float(mean), **{f"p{p}": float(c) for p, c in zip(percentiles, cuts)}}
        out["max"] = float(self.largest)
        return out

    def unlink(self) -> None:
        for column in (self.values, self.weights, self.products):
            if column is not None:
                column.unlink()
