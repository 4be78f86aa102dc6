"""Columnar run records, so a million-request run fits in memory: requests taken as they end, steps a row per step or per leap."""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.metrics import summarise
from sim.output.run_files import write_data_files
from sim.predict import predict
from sim.records import AGGREGATED_COLUMNS, STEP_COLUMNS, RunRecords, requests_frame
from sim.scenario import load_scenario
from sim.simulator import simulate
from sim.workload import build_requests

ROOT = Path(__file__).resolve().parents[2]


def busy_scenario(n=300, *extra):
    return load_scenario(ROOT / "scenarios" / "bench_sim_speed.yaml",
                         [f"workload.num_requests={n}", "workload.arrival.rate=300", *extra])


@pytest.fixture(scope="module")
def run():
    scenario = busy_scenario()
    records, _, _ = simulate(scenario)
    return scenario, records


def test_leaps_are_one_row_and_expand_to_every_step(run):
    _, records = run
    full, rows = records.steps_frame(), records.steps_frame(full=False)
    assert list(full.columns) == ["replica", *STEP_COLUMNS] and list(rows.columns) == ["replica", *AGGREGATED_COLUMNS]
    assert (rows["steps"] > 1).any() and len(rows) < len(full) == rows["steps"].sum()
    assert (full["step"].to_numpy() == np.arange(len(full))).all()
    last = np.cumsum(rows["steps"].to_numpy()) - 1
    first = last - rows["steps"].to_numpy() + 1
    for column in ("start_s", "kv_blocks_used", "decode_ctx", "blocks_read", "running", "num_seqs"):
        assert (rows[column].to_numpy() == full[column].to_numpy()[first]).all(), column
    assert (rows["end_s"].to_numpy() == full["end_s"].to_numpy()[last]).all()
    assert (rows["kv_blocks_used_last"].to_numpy() == full["kv_blocks_used"].to_numpy()[last]).all()
    assert np.allclose(rows["device_s"], np.add.reduceat(full["device_s"].to_numpy(), first), rtol=1e-12)
    # within a row every step starts where the previous one ended
    inner = np.setdiff1d(np.arange(len(full)), first)
    assert (full["start_s"].to_numpy()[inner] == full["end_s"].to_numpy()[inner - 1]).all()


def test_summary_from_columns_equals_the_one_from_a_per_step_frame(run):
    scenario, records = run
    df = requests_frame(records)
    from_frame = summarise(records, scenario.slo, df, records.steps_frame())
    from_columns = summarise(records, scenario.slo, df)
    assert json.dumps(from_frame, sort_keys=True) == json.dumps(from_columns, sort_keys=True)


def test_requests_taken_as_they_end_equal_requests_taken_at_the_end():
    scenario = busy_scenario(200, "workload.multi_turn={turns: 3, user_len: 30, think_time_s: 0.2}",
                             "engine.num_blocks=300")
    requests = build_requests(scenario)
    records, _, _ = simulate(scenario, requests)             # not released: the list stays whole
    assert len(requests) == 200 and all(r.is_finished for r in requests)
    at_end = RunRecords(requests, records.recorders, records.kv_blocks_total, records.block_size)
    pd.testing.assert_frame_equal(requests_frame(records), requests_frame(at_end), check_exact=True)
    assert requests_frame(records)["preemptions"].sum() > 0    # runs split by preemption are covered


def test_a_released_workload_is_emptied_and_every_request_recorded():
    scenario = busy_scenario(100)
    requests = build_requests(scenario)
    records, _, _ = simulate(scenario, requests, release=True)
    assert requests == [] and len(records.requests) == 100
    assert list(requests_frame(records)["id"]) == list(range(100))


def test_steps_csv_is_a_timeline_unless_rows_or_steps_are_asked(tmp_path):
    result = predict(busy_scenario(150))
    write_data_files(result, tmp_path / "timeline", interval_s=0.1)
    write_data_files(result, tmp_path / "rows", steps="aggregated")
    write_data_files(result, tmp_path / "full", steps="full")
    timeline = pd.read_csv(tmp_path / "timeline" / "steps.csv")
    rows, full = pd.read_csv(tmp_path / "rows" / "steps.csv"), pd.read_csv(tmp_path / "full" / "steps.csv")
    assert len(full) == result.summary["num_steps"] == rows["steps"].sum() == timeline["steps"].sum() > len(rows)
    assert len(rows) > len(timeline) and (np.diff(timeline["time_s"]) > 0).all()
    with pytest.raises(ValueError, match="steps='every'"):
        write_data_files(result, tmp_path / "bad", steps="every")


@pytest.mark.parametrize("extra", [
    ("workload.warmup_requests=10", "workload.multi_turn={turns: 3, user_len: 30, think_time_s: 0.3}"),
    ("workload.tenants=[{name: a, share: 0.5, salt: true}, {name: b, share: 0.5}]", "cluster.replicas=2"),
], ids=["multi-turn+warm-up", "tenants+replicas"])
def test_a_streamed_workload_predicts_what_the_built_list_does(extra):
    scenario = busy_scenario(150, *extra)
    streamed, _, _ = simulate(scenario)                       # requests made as the run reaches them
    built, _, _ = simulate(scenario, build_requests(scenario))
    a, b = requests_frame(streamed), requests_frame(built)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert json.dumps(summarise(streamed, scenario.slo), sort_keys=True) == \
        json.dumps(summarise(built, scenario.slo), sort_keys=True)


def test_a_rejected_first_turn_rejects_its_streamed_follow_ups():
    scenario = busy_scenario(6, "workload.multi_turn={turns: 2, user_len: 30, think_time_s: 0.1}",
                             "workload.prompt_len={dist: fixed, value: 5000}")
    df = requests_frame(simulate(scenario)[0])
    assert len(df) == 6 and (df["status"] == "rejected").all()
    assert df["reject_reason"].str.contains("an earlier turn").sum() == 3


def test_step_buffers_keep_every_value_exactly_across_packs():
    """Steps and rows are buffered packed between packs (times as doubles, integer columns as
    64-bit integers): floats, numpy scalars and integers past 2**31 come back unchanged, in order,
    over several packs."""
    from types import SimpleNamespace

    from sim.records import PER_STEP, StepRecorder

    class Small(StepRecorder):
        CHUNK = 3                          # pack every few steps
        LONG_LEAP = 4

    recorder, expected = Small(), []
    big = 2 ** 40 + 7
    for i in range(7):
        batch = SimpleNamespace(step=len(expected), num_decode=2, num_prefill_tokens=big + i, prefills=[1],
                                prefill_ctx=i, prefill_attn=big, preempted=[], decode_ctx=big - i, blocks_read=i)
        sched = SimpleNamespace(running=[1, 2, 3], waiting=[None] * i)
        end = 0.1 * i + 1e-9
        recorder.record(batch, sched, 0.1 * i, end, 1 / 3, np.float64(0.2 + i), big, i, -i)
        expected.append((end, 1 / 3, 0.2 + i, big - i, i, big, i, -i))
        k = 2 + i % 4                      # short and long leaps, numpy and Python values
        ends = list(np.cumsum(np.full(k, 0.7)) + end) if i % 2 else [end + 0.3 * (j + 1) for j in range(k)]
        ctx = np.arange(k, dtype=np.int64) + big
        recorder.record_leap(first_step=len(expected), start_s=end, ends=ends, rows=5, decode_ctx=ctx,
                             blocks_read=[3] * k, running=5, waiting=0, kv_used=[big] * k, kv_cached=[0] * k,
                             slack=list(range(k)), host=[0.01] * k, device=[0.02] * k)
        expected += [(ends[j], 0.01, 0.02, int(ctx[j]), 3, big, 0, j) for j in range(k)]
    assert len(recorder) == len(expected)
    for n, name in enumerate(PER_STEP):
        assert recorder.step_column(name).tolist() == [row[n] for row in expected], name
    assert recorder.step_column("step").tolist() == list(range(len(expected)))
    assert recorder.step_column("prefill_tokens")[0] == big


def test_a_leaps_steps_packed_column_after_column_come_back_in_step_order():
    """A short leap's step values are packed one column after the other (one pack for the leap);
    taken between single steps packed side by side, every column comes back in step order."""
    from types import SimpleNamespace

    from sim.records import PER_STEP, StepRecorder

    recorder, expected = StepRecorder(), []

    def step(i):
        batch = SimpleNamespace(step=len(expected), num_decode=1, num_prefill_tokens=0, prefills=[], prefill_ctx=0,
                                prefill_attn=0, preempted=[], decode_ctx=10 + i, blocks_read=i)
        recorder.record(batch, SimpleNamespace(running=[1], waiting=[]), i, i + 0.5, 0.1, 0.4, 7, 8, -9)
        expected.append((i + 0.5, 0.1, 0.4, 10 + i, i, 7, 8, -9))

    step(0)
    k = 3
    recorder.record_leap(first_step=len(expected), start_s=0.5, ends=[1.0, 1.5, 2.0], rows=1, decode_ctx=[20, 21, 22],
                         blocks_read=[2, 2, 3], running=1, waiting=0, kv_used=[5, 5, 6], kv_cached=[1, 0, 0],
                         slack=[3, 2, 17], host=[0.1, 0.2, 0.3], device=[0.4, 0.5, 0.6])
    expected += [(1.0, 0.1, 0.4, 20, 2, 5, 1, 3), (1.5, 0.2, 0.5, 21, 2, 5, 0, 2), (2.0, 0.3, 0.6, 22, 3, 6, 0, 17)]
    step(2)
    assert recorder.step_values.blocks == [8 * len(PER_STEP), k]     # the leap went in as one block, after one step
    for n, name in enumerate(PER_STEP):
        assert recorder.step_column(name).tolist() == [row[n] for row in expected], name


def _one_weighted_percentile(values, weights, q):
    """The summary's weighted percentile as it was, one sort per q (the reference)."""
    order = np.argsort(values, kind="stable")
    v, cum = values[order], np.cumsum(weights[order])
    pos = q / 100 * (int(cum[-1]) - 1)
    lo, hi = int(np.floor(pos)), int(np.ceil(pos))
    v_lo, v_hi = v[np.searchsorted(cum, lo, side="right")], v[np.searchsorted(cum, hi, side="right")]
    return float(v_lo + (v_hi - v_lo) * (pos - lo))


def test_percentiles_taken_in_one_pass_equal_one_call_per_percentile():
    """The summary sorts a sample once for all its percentiles (the ITL sample has a value per
    step): the figures are those of one call per q, to the last bit."""
    from sim.metrics import PERCENTILES, distribution

    rng = np.random.default_rng(7)
    for size in (1, 2, 5, 97, 1000, 50_000):
        # rounded: ties, as step times have (at 50k long runs of them, which the summary's unstable
        # sort reorders; zeros of both signs among them)
        values = np.round(rng.exponential(0.01, size), 4 if size < 50_000 else 3)
        values[rng.integers(0, size, size // 50)] = -0.0
        weights = rng.integers(0, 5, size)
        weights[0] = max(weights[0], 1)
        plain, weighted = distribution(values), distribution(values, weights)
        for q in PERCENTILES:
            assert plain[f"p{q}"] == float(np.percentile(values, q))
            assert weighted[f"p{q}"] == _one_weighted_percentile(values, weights, q)
            assert np.isclose(weighted[f"p{q}"], np.percentile(np.repeat(values, weights), q), rtol=1e-12)
        assert plain["mean"] == float(values.mean()) and weighted["max"] == float(values.max())


def _weighted_ranks_by_one_sort(values, weights, ranks):
    """The value at each running weight k of the sample sorted whole (the reference)."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order], dtype=np.int64)
    return {k: values[order[np.searchsorted(cum, k, side="right")]] for k in ranks}


def test_weighted_ranks_sorting_between_bounds_equal_one_whole_sort():
    """A long sample's weighted ranks are read by sorting only the values between bounds from a
    strided subsample (widened where they miss): the values are those of one sort of the whole
    sample, bit for bit, also where the subsample misleads (values or weights that repeat with its
    stride, weight on values it skips, ties across the bounds)."""
    from sim import metrics

    rng = np.random.default_rng(11)
    size = 3 * metrics.SORTED_WHOLE + 5
    step = size // metrics.SUBSAMPLE
    stride = np.arange(size) % step == 0
    samples = {
        "ties": (np.round(rng.exponential(0.01, size), 3), rng.integers(0, 40, size)),
        "unique": (rng.random(size), rng.integers(1, 3, size)),
        # the subsample sees only the large values, the weight sits on the small ones
        "strided values": (np.where(stride, 10.0 + rng.random(size), rng.random(size)),
                           np.where(stride, 1, 1000)),
        # the subsample's weights say nothing of the rest's
        "strided weights": (rng.random(size), np.where(stride, 10**6, 0)),
        "one value": (np.full(size, 0.25), rng.integers(0, 3, size)),
        "weight at the top": (rng.random(size), np.where(np.arange(size) == size - 1, 10**7, 1)),
    }
    for name, (values, weights) in samples.items():
        total = int(weights.sum())
        ranks = sorted({0, 1, total // 2, int(0.9 * (total - 1)), int(0.99 * (total - 1)), total - 2, total - 1,
                        *rng.integers(0, total, 20).tolist()})
        got = metrics.weighted_ranks(values, weights, ranks)
        want = _weighted_ranks_by_one_sort(values, weights, ranks)
        assert set(got) == set(ranks), name
        for k in ranks:
            assert got[k] == want[k] and got[k].tobytes() == want[k].tobytes(), (name, k)
        weighted = metrics.distribution(values, weights)
        for q in metrics.PERCENTILES:
            assert weighted[f"p{q}"] == _one_weighted_percentile(values, weights, q), (name, q)



def test_a_weighted_rank_past_the_total_weight_is_an_error_not_an_endless_widening():
    """The bounds widen until they hold, at worst to the whole sample; a rank no value holds (at or
    past the total weight) would widen forever: it is refused."""
    from sim import metrics

    values = np.random.default_rng(1).random(metrics.SORTED_WHOLE + 1)
    weights = np.ones(len(values), dtype=np.int64)
    assert metrics.weighted_ranks(values, weights, [len(values) - 1])[len(values) - 1] == values.max()
    with pytest.raises(ValueError, match="outside the sample's total weight"):
        metrics.weighted_ranks(values, weights, [len(values)])

def test_selecting_owned_entries_by_lookup_equals_a_binary_search():
    """select_owned renumbers owners by a table lookup: the entries and numbers a binary search in
    the wanted positions gave, also for owners past the last wanted position or between them, and
    where every position up to the last is wanted (the entries then as they are)."""
    from sim.records import select_owned

    rng = np.random.default_rng(5)
    cases = ((50, 0.3, 50), (1000, 0.9, 1000), (1000, 1.0, 1000), (7, 0.0, 7), (1000, 1.0, 600))
    for total, wanted, first_positions in cases:      # (the last: owners past every wanted position)
        idx = np.flatnonzero(rng.random(first_positions) < wanted)
        owner = rng.integers(0, total, 5 * total)
        values = rng.random(len(owner))
        if not len(idx):
            got = select_owned(owner, idx, values)
            assert len(got[0]) == 0 and len(got[1]) == 0
            continue
        pos = np.searchsorted(idx, owner)
        keep = (pos < len(idx)) & (idx[np.minimum(pos, len(idx) - 1)] == owner)
        got = select_owned(owner, idx, values)
        assert got[0].tolist() == pos[keep].tolist() and got[1].tolist() == values[keep].tolist()
        assert (idx[got[0]] == owner[keep]).all()


def test_simulating_does_not_import_pandas():
    """Frames are made only for files and the summary; a process that only simulates skips pandas."""
    import subprocess
    import sys

    code = ("import sys; from sim.scenario import load_scenario; from sim.simulator import simulate; "
            f"simulate(load_scenario({str(ROOT / 'scenarios' / 'bench_sim_speed.yaml')!r}, "
            "['workload.num_requests=50'])); print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_reasons_are_looked_up_by_id_in_any_block_of_the_table():
    """`RequestTable.reasons` (numpy lookups) gives each row its id's reason, None elsewhere; a
    block of a spilled run shares the whole table's reasons, most of them for ids not in it."""
    from sim.records import RequestTable

    scenario = busy_scenario(6, "workload.multi_turn={turns: 2, user_len: 30, think_time_s: 0.1}",
                             "workload.prompt_len={dist: fixed, value: 5000}",
                             "workload.warmup_requests=2")
    records = simulate(scenario)[0]
    frame = requests_frame(records)
    by_id = dict(zip(frame["id"].tolist(), frame["reject_reason"].tolist()))
    assert sum(r is not None for r in by_id.values()) == 6
    table = records.requests
    assert table.reasons().tolist() == [by_id[i] for i in table.sorted_column("id").astype(int).tolist()]
    packed = table.take_packed()
    block = table.with_columns({**{name: column[4:1:-1] for name, column in packed.items()},
                                "run_steps": np.zeros(0, np.int64), "chunk_steps": np.zeros(0, np.int64)})
    assert block.reasons().tolist() == [by_id[i] for i in block.sorted_column("id").astype(int).tolist()]
    assert RequestTable().reasons().tolist() == []


def test_ended_requests_keep_every_figure_exactly_across_packs():
    """An ended request's figures are packed as it is taken (integers as 64-bit integers, the
    arrival as a double) and its runs' and chunks' steps into integer arrays: ids past 2**31, a
    missing arrival (NaN) and conversation, numpy scalars, runs and chunk steps come back
    unchanged and in order over several packs; a request that did not finish keeps no chunk."""
    from sim.core.request import Request
    from sim.core.status import FINISHED, REJECTED
    from sim.records import RequestTable

    class Small(RequestTable):
        CHUNK = 3                          # pack every few requests

    table, big = Small(), 2 ** 40 + 3
    requests = []
    for i in range(8):
        req = Request(big + i if i % 2 else i, None if i == 5 else np.float64(0.5 * i), [(7, 10 + i)], 4 + i,
                      (9, 4 + i), tenant="t" if i % 3 else None)
        req.status, req.num_output, req.admit_step = (REJECTED if i == 4 else FINISHED), 4 + i, np.int64(big)
        req.conversation = None if i % 2 else i
        req.emit_runs, req.chunk_steps = [big + i, big + i + 2] * (i % 3), [i, big]
        req.is_warmup = i == 0
        table.add(req)
        requests.append(req)
    packed = table.take_packed()
    assert packed["id"].tolist() == [r.id for r in requests]
    arrivals = packed["arrival_s"]
    assert np.isnan(arrivals[5]) and np.delete(arrivals, 5).tolist() == [0.5 * i for i in range(8) if i != 5]
    assert packed["conversation"].tolist() == [-(2 ** 62) if i % 2 else i for i in range(8)]
    assert packed["prompt_tokens"].tolist() == [10 + i for i in range(8)]
    assert packed["admit_step"].tolist() == [big] * 8
    assert packed["is_warmup"].tolist() == [1] + [0] * 7
    assert packed["runs"].tolist() == [i % 3 for i in range(8)]
    assert packed["run_steps"].tolist() == [s for r in requests for s in r.emit_runs]
    assert packed["chunks"].tolist() == [0 if i == 4 else 2 for i in range(8)]
    assert packed["chunk_steps"].tolist() == [s for i in range(8) if i != 4 for s in (i, big)]


def test_emit_runs_and_chunk_steps_list_each_requests_own_in_id_order():
    """`RequestTable.emit_runs` and `chunk_steps` move each request's entries from where it was
    recorded (in the order requests end) to its place in id order, keeping their own order:
    requests ended out of id order over several packs, some with no run or no chunk, step
    numbers that fit 32 bits in one pack and not in another."""
    from sim.core.request import Request
    from sim.core.status import FINISHED
    from sim.records import RequestTable

    class Small(RequestTable):
        CHUNK = 3                          # pack every few requests

    table, big = Small(), 2 ** 40
    ended = [5, 0, 7, 2, 3, 6, 1, 4]       # ids, in the order they end
    runs = {i: [(10 * i + k, 10 * i + k + 1 + (big if i == 6 else 0)) for k in range(i % 3)] for i in ended}
    chunks = {i: [100 + i] * (i % 2) for i in ended}
    for i in ended:
        req = Request(i, 0.1 * i, [(7, 10)], 4, (9, 4))
        req.status = FINISHED
        req.emit_runs = [s for run in runs[i] for s in run]
        req.chunk_steps = chunks[i]
        table.add(req)
    owner, first, last = table.emit_runs()
    assert owner.tolist() == [i for i in range(8) for _ in runs[i]]
    assert list(zip(first.tolist(), last.tolist())) == [run for i in range(8) for run in runs[i]]
    owner, steps = table.chunk_steps()
    assert owner.tolist() == [i for i in range(8) for _ in chunks[i]]
    assert steps.tolist() == [s for i in range(8) for s in chunks[i]]


def test_the_itl_sample_takes_about_one_array_of_the_steps_at_its_peak():
    """`itl_samples` runs over every step of a run (8.5M at a million requests on
    bench_sim_speed.yaml): its peak fresh memory sets the summary's, so the largest run's peak RSS.
    A float64 difference array reused for the counts and the gaps, plus the sample, is ~24 bytes a
    step; integer counts in fresh step-long arrays took ~43 (+126 MB at 1M, found and reverted on
    7 December). tracemalloc counts numpy's allocations, so the figure is exact, not timed."""
    import tracemalloc

    from sim.records import itl_samples

    records, _, _ = simulate(busy_scenario(2000, "workload.arrival.rate=150"))
    ids = records.requests.sorted_column("id")
    steps = sum(len(r) for r in records.recorders)
    itl_samples(records, ids)                    # (the emit runs are made once and kept)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        values, _ = itl_samples(records, ids)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert steps > 10_000 and len(values) > steps / 2
    assert peak < 30 * steps, f"{peak / steps:.1f} bytes a step at the peak"
