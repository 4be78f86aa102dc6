"""sim/exact_disk.py: numpy's sum, np.percentile and metrics.distribution, bit for bit, over
columns on disk read a slice at a time (small slices, leaves and buckets here, so a few thousand
values take every path: split sums, buckets counted over several 16-bit levels, loaded buckets)."""
import numpy as np
import pytest

import sim.exact_disk as ed
from sim.metrics import distribution, percentiles
from sim.predict import _length_stats


@pytest.fixture(autouse=True)
def small_slices(monkeypatch):
    monkeypatch.setattr(ed, "LEAF", 1000)
    monkeypatch.setattr(ed, "LOAD", 50)
    monkeypatch.setattr(ed, "READ", 333)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 9, 127, 128, 129, 1000, 1001, 5000, 20011, 300007])
def test_the_sum_is_numpys_to_the_bit(n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)
    got = ed.add_reduce(lambda lo, hi: a[lo:hi], n)
    assert np.float64(got).tobytes() == np.float64(np.add.reduce(a)).tobytes()


def _values(kind: str, n: int, rng) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)
    if kind == "ties":                     # a few distinct values: ranks fall inside runs of ties
        return rng.integers(0, 3, n).astype(float) * 0.1
    if kind == "constant":                 # one key: the buckets never get small
        return np.full(n, 0.25)
    if kind == "nan":
        v = rng.exponential(1.0, n)
        v[rng.random(n) < 0.3] = np.nan
        return v
    if kind == "close":                    # neighbours in the last bits of the mantissa
        return 1.0 + rng.integers(0, 40, n) * np.finfo(float).eps
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["normal", "ties", "constant", "nan", "close"])
@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000, 4097])
def test_a_sample_on_disk_has_the_distribution_of_the_array(tmp_path, kind, n):
    rng = np.random.default_rng(n)
    values = _values(kind, n, rng)
    weights = rng.integers(0, 4, n)
    plain, weighted = ed.Sample(tmp_path, "plain"), ed.Sample(tmp_path, "weighted", weighted=True)
    for lo in range(0, n, 37):                        # appended in pieces, as a run adds them
        plain.add(values[lo:lo + 37])
        weighted.add(values[lo:lo + 37], weights[lo:lo + 37])
    assert plain.distribution((50, 90, 99)) == distribution(values)
    assert weighted.distribution((50, 90, 99)) == distribution(values, weights)


def test_an_empty_or_weightless_sample_has_no_figures(tmp_path):
    empty, weightless = ed.Sample(tmp_path, "e"), ed.Sample(tmp_path, "w", weighted=True)
    empty.add(np.array([np.nan]))
    weightless.add(np.array([1.0, 2.0]), np.array([0, 0]))
    assert empty.distribution((50, 90, 99)) == distribution(np.array([np.nan]))
    assert weightless.distribution((50, 90, 99)) == distribution(np.array([1.0, 2.0]), np.array([0, 0]))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 99, 100, 1001])
def test_percentiles_and_median_from_order_statistics_are_numpys(n):
    rng = np.random.default_rng(n)
    a = rng.integers(1, 50, n).astype(float)
    ordered = np.sort(a)
    kth = (lambda ranks: {k: ordered[k] for k in ranks})     # noqa: E731
    qs = (0, 1, 50, 90, 99, 99.9, 100)
    assert ed.linear_percentiles(n, qs, kth).tobytes() == np.percentile(a, qs).tobytes()
    assert float(ed.linear_percentiles(n, 90, kth)) == float(np.percentile(a, 90))
    assert float(ed.median(n, kth)) == float(np.median(a))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 99, 100, 1001, 30_000])
def test_the_summarys_percentiles_are_numpys_to_the_bit(n):
    """metrics.percentiles (a partition and exact_disk's interpolation, no np.unique) is np.percentile."""
    rng = np.random.default_rng(n)
    qs = (0, 1, 50, 90, 99, 99.9, 100)
    for a in (rng.integers(1, 50, n).astype(float), rng.lognormal(-3, 2, n), -rng.standard_normal(n)):
        assert percentiles(a, qs).tobytes() == np.percentile(a, qs).tobytes()
        assert percentiles(a, (50, 90, 99)).tobytes() == np.percentile(a, (50, 90, 99)).tobytes()


def test_length_counts_give_the_manifests_length_figures():
    from sim.predict import LengthCounts

    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 1000):
        prompt, output = rng.integers(1, 4000, n), rng.integers(1, 3, n)
        counts = LengthCounts()
        for p, o in zip(prompt.tolist(), output.tolist()):
            counts.add(p, o)
        assert counts.stats() == _length_stats(prompt.tolist(), output.tolist())
