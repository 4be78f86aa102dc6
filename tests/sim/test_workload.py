"""Workload generation: a scenario's `workload` section -> deterministic Requests."""
import hashlib
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.core.request import stable_key
from sim.scenario import ScenarioError, validate_scenario
from sim.workload import WorkloadError, build_requests, build_workload

ROOT = Path(__file__).parents[2]


def scenario(seed=1, **workload):
    return validate_scenario({"model": "tiny", "device": "cpu", "workload": workload, "seed": seed})


def build(seed=1, **workload):
    return build_requests(scenario(seed, **workload))


def signature(requests):
    return [(r.id, r.arrival, r.segments, r.output_len, r.tenant, r.salt, r.priority,
             r.think_time, r.conversation, r.is_warmup,
             r.next_turn.id if r.next_turn else None) for r in requests]


def gaps(requests):
    return np.diff([0.0] + [r.arrival for r in requests])


def spearman(x, y):
    return float(np.corrcoef(pd.Series(x).rank(), pd.Series(y).rank())[0, 1])


RICH = dict(num_requests=300, arrival={"process": "gamma", "rate": 20, "cv": 2},
            prompt_len={"dist": "lognormal", "mean": 200, "std": 150}, length_correlation=0.5,
            shared_prefix={"groups": 3, "fraction": 0.7, "popularity": "zipf"},
            dynamic_segment={"length": 8, "position": "last"},
            multi_turn={"turns": {"dist": "uniform", "min": 1, "max": 4}},
            tenants=[{"name": "a"}, {"name": "b", "share": 2, "salt": False}],
            priorities={"values": [0, 1, 2]}, warmup_requests=10)


# ----------------------------------------------------------------------------- determinism

def test_same_seed_gives_identical_requests_and_another_seed_does_not():
    first, again = build(**RICH), build(**RICH)
    assert signature(first) == signature(again)
    other = build(seed=2, **RICH)
    assert [(r.arrival, r.segments, r.output_len) for r in other] != \
           [(r.arrival, r.segments, r.output_len) for r in first]


def test_a_fresh_process_builds_the_same_requests():
    code = ("import hashlib, sys; sys.path.insert(0, '.');"
            "from tests.sim.test_workload import build, signature, RICH;"
            "print(hashlib.sha256(repr(signature(build(**RICH))).encode()).hexdigest())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}   # str hashes differ; keys must not
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == hashlib.sha256(repr(signature(build(**RICH))).encode()).hexdigest()


def test_ids_follow_the_list_and_known_arrivals_never_decrease():
    requests = build(**RICH)
    assert [r.id for r in requests] == list(range(300))
    known = [r.arrival for r in requests if r.arrival is not None]
    assert known == sorted(known)


def test_adding_tenants_leaves_arrivals_and_lengths_unchanged():
    """Each kind of random choice has its own stream."""
    plain = build(num_requests=50, arrival={"process": "poisson", "rate": 5})
    with_tenants = build(num_requests=50, arrival={"process": "poisson", "rate": 5},
                         tenants=[{"name": "a"}, {"name": "b"}])
    assert [(r.arrival, r.prompt_len, r.output_len) for r in plain] == \
           [(r.arrival, r.prompt_len, r.output_len) for r in with_tenants]


# ----------------------------------------------------------------------------- arrivals

def test_offline_requests_all_arrive_at_zero():
    assert {r.arrival for r in build(num_requests=20)} == {0.0}


def test_fixed_arrivals_are_exactly_one_over_rate_apart_starting_one_gap_in():
    requests = build(num_requests=10, arrival={"process": "fixed", "rate": 4})
    assert [r.arrival for r in requests] == [(i + 1) / 4 for i in range(10)]


def cv_tolerance(n, excess_kurtosis):
    """Five standard errors of a sample CV (delta method: var(s)/s^2 ~ (kurtosis - 1) / 4n)."""
    return 5 * math.sqrt((excess_kurtosis + 2) / (4 * n))


def test_poisson_gaps_have_mean_one_over_rate_and_cv_one():
    n, rate = 4000, 10.0
    g = gaps(build(num_requests=n, arrival={"process": "poisson", "rate": rate}))
    # vLLM bench rescales the gaps so the last request arrives at exactly n / rate.
    assert g.sum() == pytest.approx(n / rate, rel=1e-12)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=cv_tolerance(n, 6))


def test_poisson_count_over_a_duration_matches_the_rate():
    rate, duration = 10.0, 400.0
    requests = build(duration_s=duration, arrival={"process": "poisson", "rate": rate})
    assert abs(len(requests) - rate * duration) < 5 * math.sqrt(rate * duration)
    assert max(r.arrival for r in requests) < duration


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_gaps_have_the_requested_cv(cv):
    n = 8000
    g = gaps(build(num_requests=n, arrival={"process": "gamma", "rate": 5, "cv": cv}))
    assert g.std() / g.mean() == pytest.approx(cv, rel=cv_tolerance(n, 6 * cv * cv))


def test_duration_cuts_arrivals_at_the_first_limit_reached():
    fixed = {"process": "fixed", "rate": 10}
    assert len(build(duration_s=5, arrival=fixed)) == 49          # 0.1 .. 4.9; 5.0 is outside
    assert len(build(duration_s=5, num_requests=20, arrival=fixed)) == 20
    assert len(build(duration_s=1, num_requests=500, arrival=fixed)) == 9


def test_a_duration_with_no_arrival_is_an_error():
    with pytest.raises(WorkloadError, match="workload.duration_s"):
        build(duration_s=0.01, arrival={"process": "fixed", "rate": 1})


# ----------------------------------------------------------------------------- lengths

def prompts(**dist):
    return np.array([r.prompt_len for r in build(num_requests=3000, prompt_len=dist)])


def test_fixed_length_is_exact():
    requests = build(num_requests=5, prompt_len=7, output_len=3)
    assert {(r.prompt_len, r.output_len) for r in requests} == {(7, 3)}


def test_uniform_lengths_cover_the_inclusive_range():
    assert set(prompts(dist="uniform", min=3, max=7)) == {3, 4, 5, 6, 7}


def test_normal_lengths_are_clipped_to_min_and_max():
    x = prompts(dist="normal", mean=100, std=50, min=80, max=120)
    assert x.min() == 80 and x.max() == 120
    assert prompts(dist="normal", mean=5, std=10).min() == 1     # lengths are at least 1


def test_lognormal_mean_and_std_are_those_of_the_length():
    x = np.array([r.prompt_len for r in build(num_requests=20000, prompt_len={
        "dist": "lognormal", "mean": 200, "std": 100})])
    assert x.mean() == pytest.approx(200, rel=0.03)
    assert x.std() == pytest.approx(100, rel=0.06)


def test_empirical_values_come_only_from_the_set_with_their_frequencies():
    x = prompts(dist="empirical", values=[10, 20, 20, 30])
    assert set(x) == {10, 20, 30}
    assert (x == 20).mean() == pytest.approx(0.5, abs=0.05)


def test_empirical_lengths_from_a_plain_file_and_a_csv_column(tmp_path):
    plain = tmp_path / "lengths.txt"
    plain.write_text("5\n\n9\n12.0\n")
    assert set(prompts(dist="empirical", file=str(plain))) == {5, 9, 12}
    table = tmp_path / "lengths.csv"
    table.write_text("num_prefill_tokens,num_decode_tokens\n100,7\n200,8\n")
    assert set(prompts(dist="empirical", file=str(table), column="num_prefill_tokens")) == {100, 200}


def test_empirical_file_errors_name_the_file_and_line(tmp_path):
    plain = tmp_path / "lengths.txt"
    plain.write_text("5\n9\nmany\n")
    with pytest.raises(WorkloadError, match=r"lengths.txt:3: 'many' is not a token length"):
        prompts(dist="empirical", file=str(plain))
    plain.write_text("5\n2.5\n")
    with pytest.raises(WorkloadError, match=r"lengths.txt:2: '2.5'"):
        prompts(dist="empirical", file=str(plain))
    table = tmp_path / "lengths.csv"
    table.write_text("a,b\n1,2\n")
    with pytest.raises(WorkloadError, match=r"lengths.csv:1: no column 'c'.*workload.prompt_len.column"):
        prompts(dist="empirical", file=str(table), column="c")
    with pytest.raises(WorkloadError, match="workload.prompt_len.file: no such file"):
        prompts(dist="empirical", file=str(tmp_path / "missing.txt"))


def test_sharegpt_preset_stays_in_its_bounds_with_its_documented_means():
    requests = build(num_requests=20000)   # the default: sharegpt prompt and output
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    assert p.min() >= 4 and p.max() <= 1024 and o.min() >= 4 and o.max() <= 1024
    assert p.mean() == pytest.approx(227, rel=0.05) and o.mean() == pytest.approx(201, rel=0.05)


@pytest.mark.parametrize("rank_correlation", [0.8, 0.0, -0.5])
def test_prompt_and_output_lengths_have_the_requested_rank_correlation(rank_correlation):
    n = 5000
    requests = build(num_requests=n, length_correlation=rank_correlation,
                     prompt_len={"dist": "uniform", "min": 1, "max": 4000},
                     output_len={"dist": "lognormal", "mean": 300, "std": 400})
    r = spearman([q.prompt_len for q in requests], [q.output_len for q in requests])
    assert r == pytest.approx(rank_correlation, abs=5 / math.sqrt(n))


def test_a_zero_fixed_length_and_sharegpt_turns_are_schema_errors():
    with pytest.raises(ScenarioError, match="workload.output_len.value: Input should be greater than or equal to 1"):
        build(num_requests=2, output_len=0)
    with pytest.raises(ScenarioError, match="multi_turn.turns cannot use the sharegpt preset"):
        build(num_requests=2, multi_turn={"turns": {"dist": "sharegpt"}})


# ----------------------------------------------------------------------------- prompt layout

def prefix_keys(groups, seed=1):
    return {stable_key("prefix", seed, g) for g in range(groups)}


def test_shared_prefix_fraction_groups_and_lengths():
    n = 4000
    requests = build(num_requests=n, prompt_len=100, shared_prefix={
        "groups": 4, "fraction": 0.3, "length": {"dist": "uniform", "min": 10, "max": 500}})
    carriers = [r for r in requests if r.segments[0][0] in prefix_keys(4)]
    share = len(carriers) / n
    assert share == pytest.approx(0.3, abs=5 * math.sqrt(0.3 * 0.7 / n))
    assert {r.segments[0][0] for r in carriers} == prefix_keys(4)
    assert len({r.segments[0] for r in carriers}) == 4            # one length per group
    # prompt_len sizes the request's own part; the prefix comes on top.
    assert all(r.prompt_len == 100 + r.segments[0][1] for r in carriers)
    assert all(r.prompt_len == 100 for r in requests if r not in carriers)


def test_zipf_popularity_favours_the_first_group():
    requests = build(num_requests=4000, shared_prefix={"groups": 5, "popularity": "zipf", "zipf_s": 1.0})
    counts = pd.Series([r.segments[0][0] for r in requests]).value_counts()
    top = counts[stable_key("prefix", 1, 0)] / counts[stable_key("prefix", 1, 1)]
    assert top == pytest.approx(2.0, rel=0.15)                     # (2/1)^s


def first_block_hashes(requests, block_size=16):
    for r in requests:
        r.extend_block_hashes(1, block_size)
    return {r.block_hashes[0] for r in requests}


@pytest.mark.parametrize("position", ["first", "last"])
def test_dynamic_segment_position_decides_whether_the_prefix_is_shared(position):
    requests = build(num_requests=20, shared_prefix={"length": 64},
                     dynamic_segment={"length": 8, "position": position})
    prefix = stable_key("prefix", 1, 0)
    if position == "first":
        assert all(r.segments[1][0] == prefix for r in requests)
        assert len({r.segments[0] for r in requests}) == 20       # unique per request
        assert len(first_block_hashes(requests)) == 20            # every hit destroyed
    else:
        assert all(r.segments[0][0] == prefix and r.segments[1][1] == 8 for r in requests)
        assert len(first_block_hashes(requests)) == 1


def test_tenants_follow_their_shares_and_salt_isolates_them():
    requests = build(num_requests=3000, shared_prefix={"length": 64}, tenants=[
        {"name": "a", "share": 1}, {"name": "b", "share": 3}, {"name": "open", "salt": False},
        {"name": "open2", "salt": False}])
    by = {t: [r for r in requests if r.tenant == t] for t in ("a", "b", "open", "open2")}
    assert len(by["b"]) / len(by["a"]) == pytest.approx(3, rel=0.2)
    assert len({r.salt for r in by["a"]}) == 1 and len({r.salt for r in by["b"]}) == 1
    assert by["a"][0].salt != by["b"][0].salt and 0 not in (by["a"][0].salt, by["b"][0].salt)
    assert {r.salt for r in by["open"] + by["open2"]} == {0}
    # Same prefix tokens for everyone: unsalted tenants share blocks, salted ones never do.
    assert len({r.segments[0] for r in requests}) == 1
    assert len(first_block_hashes(by["open"] + by["open2"])) == 1
    assert len(first_block_hashes(by["a"] + by["b"] + by["open"][:1])) == 3


def test_priorities_are_drawn_by_weight_and_default_to_zero():
    requests = build(num_requests=4000, priorities={"values": [0, 5], "weights": [1, 3]})
    assert np.mean([r.priority == 5 for r in requests]) == pytest.approx(0.75, abs=0.035)
    assert {r.priority for r in build(num_requests=10)} == {0}
    with pytest.raises(ScenarioError, match="workload.priorities: weights must be >= 0 with a positive sum"):
        build(num_requests=10, priorities={"values": [0, 5], "weights": [0, 0]})


# ----------------------------------------------------------------------------- multi-turn

MULTI = dict(num_requests=10, arrival={"process": "poisson", "rate": 1}, prompt_len=300,
             output_len={"dist": "uniform", "min": 5, "max": 50}, shared_prefix={"length": 32},
             multi_turn={"turns": 3, "user_len": 20, "think_time_s": 2.0, "think_dist": "fixed"})


def test_turn_k_extends_turn_k_minus_1_with_its_scripted_answer():
    requests = build(**MULTI)
    assert len(requests) == 10                                     # 3 + 3 + 3 + 1
    assert [r.conversation for r in requests] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    for prev, req in zip(requests, requests[1:]):
        if req.conversation != prev.conversation:
            assert req.arrival is not None and prev.next_turn is None and prev.think_time == 0
            continue
        assert prev.next_turn is req and req.arrival is None and prev.think_time == 2.0
        assert req.segments[: len(prev.segments)] == prev.segments
        assert prev.segments[-1] == (stable_key("output", 1, prev.id), prev.output_len)
        assert req.segments[len(prev.segments)] == (stable_key("user", 1, req.id), 20)
        assert req.prompt_len == prev.prompt_len + prev.output_len + 20


def test_first_turn_uses_prompt_len_and_later_turns_user_len():
    requests = build(**MULTI)
    assert requests[0].prompt_len == 32 + 300
    assert requests[1].prompt_len - requests[0].max_len == 20


def test_exponential_think_times_have_the_requested_mean():
    requests = build(**{**MULTI, "num_requests": 3000,
                        "multi_turn": {"turns": 2, "think_time_s": 4.0}})
    think = np.array([r.think_time for r in requests if r.next_turn is not None])
    assert think.mean() == pytest.approx(4.0, abs=5 * 4.0 / math.sqrt(len(think)))


def test_arrival_rate_is_the_rate_of_new_conversations():
    requests = build(**{**MULTI, "num_requests": 3000, "arrival": {"process": "fixed", "rate": 2}})
    starts = [r.arrival for r in requests if r.arrival is not None]
    assert len(starts) == 1000 and starts[-1] == 500.0


# ----------------------------------------------------------------------------- explicit, warm-up

EXPLICIT = [
    {"arrival_s": 2.0, "prompt": [{"segment": "system", "len": 64}, {"segment": "q1", "len": 10}],
     "output_len": 5, "tenant": "a"},
    {"arrival_s": 1.0, "prompt": [{"segment": "system", "len": 64}, {"segment": "q2", "len": 12}],
     "output_len": 6, "tenant": "b", "priority": 1},
    {"arrival_s": 1.0, "prompt_len": 30, "output_len": 7},
]


def test_explicit_requests_are_sorted_and_named_segments_shared():
    requests = build(requests=EXPLICIT, tenants=[{"name": "a"}, {"name": "b", "salt": False}])
    assert [(r.arrival, r.output_len) for r in requests] == [(1.0, 6), (1.0, 7), (2.0, 5)]
    assert requests[0].segments[0] == requests[2].segments[0] == (stable_key("named", "system"), 64)
    assert requests[1].segments[0] == (stable_key("user", 1, 1), 30)
    assert (requests[0].tenant, requests[0].salt, requests[0].priority) == ("b", 0, 1)
    assert requests[2].salt == stable_key("tenant", "a")
    without_tenant_list = build(requests=EXPLICIT)
    assert {r.salt for r in without_tenant_list} == {0}


def test_explicit_request_with_an_unknown_tenant_names_the_field():
    with pytest.raises(WorkloadError, match=r"workload.requests\[1\].tenant: 'b' is not in workload.tenants"):
        build(requests=EXPLICIT, tenants=[{"name": "a"}])


def test_synthetic_settings_beside_explicit_requests_are_errors():
    with pytest.raises(ScenarioError, match="num_requests, shared_prefix describe a synthetic workload "
                                            "and would be ignored with 'requests'"):
        scenario(requests=EXPLICIT, num_requests=5, shared_prefix={"groups": 2})


def test_settings_the_chosen_mode_never_reads_are_noted_not_dropped():
    """A rate with offline arrivals and priorities under fcfs pass the schema (a sweep over the modes
    keeps them) but change nothing: the run says so beside its results (found by h/audit)."""
    from sim.predict import predict

    offline = scenario(num_requests=4, arrival={"process": "offline", "rate": 3})
    assert any("arrival.rate 3 is not read with process offline" in n for n in build_workload(offline).notes)
    fcfs = validate_scenario({"model": "tiny", "device": "cpu", "engine": {"scheduling_policy": "fcfs"},
                              "workload": {"num_requests": 4, "arrival": {"process": "poisson", "rate": 2},
                                           "priorities": {"values": [0, 1]}}})
    streamed = predict(fcfs).manifest["workload"]["notes"]            # the synthetic stream's path
    assert any("priorities are not read with engine.scheduling_policy fcfs" in n for n in streamed)
    explicit = validate_scenario({"model": "tiny", "device": "cpu", "workload": {"requests": [
        {"arrival_s": 0, "prompt_len": 8, "output_len": 2, "priority": 1}]}})
    assert any("priorities are not read" in n for n in build_workload(explicit).notes)
    used = fcfs.model_copy(update={"engine": fcfs.engine.model_copy(update={"scheduling_policy": "priority"})})
    assert not build_workload(used).notes and not build_workload(scenario(num_requests=4)).notes


def test_warmup_marks_the_first_requests():
    requests = build(num_requests=10, warmup_requests=3, arrival={"process": "poisson", "rate": 1})
    assert [r.is_warmup for r in requests] == [True] * 3 + [False] * 7
    built = build_workload(scenario(num_requests=2, warmup_requests=5))
    assert all(r.is_warmup for r in built.requests) and "covers all 2 requests" in built.notes[0]


# ----------------------------------------------------------------------------- speed

def test_100k_poisson_sharegpt_requests_build_quickly():
    s = scenario(num_requests=100_000, arrival={"process": "poisson", "rate": 100})
    start = time.process_time()
    requests = build_requests(s)
    assert len(requests) == 100_000
    assert time.process_time() - start < 4.0     # ~1.2 s on a busy 2-core box


def test_vidur_poisson_arrivals_are_vidurs_stream():
    """Vidur seeds Python's global `random` with 42 right before drawing; gaps capped at 3/qps."""
    import math
    import random as pyrandom

    from sim.scenario import load_scenario
    from sim.workload import build_requests
    scenario = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "vidur_llama2_70b.yaml",
                             ["workload.num_requests=2000"])
    arrivals = [r.arrival for r in build_requests(scenario)]
    pyrandom.seed(42)
    t, expected = 0.0, []
    for _ in range(2000):
        t += min(-math.log(1.0 - pyrandom.random()) / 2.0, 1.5)
        expected.append(t)
    assert arrivals == expected
    gaps = np.diff([0.0] + arrivals)
    assert gaps.max() == 1.5 and abs(gaps.mean() - 0.5) < 0.03     # capped, not rescaled


# ----------------------------------------------------------------------------- draws made in chunks

SINGLE_TURN = {k: v for k, v in RICH.items() if k != "multi_turn"}


@pytest.mark.parametrize("workload", [
    SINGLE_TURN,
    dict(SINGLE_TURN, arrival={"process": "poisson", "rate": 50}, length_correlation=-0.3),
    dict(SINGLE_TURN, arrival={"process": "poisson", "rate": 50, "rescale": False}),
    dict(SINGLE_TURN, arrival={"process": "fixed", "rate": 7}, dynamic_segment={"length": 4, "position": "first"}),
    dict(num_requests=300, arrival={"process": "offline"}, output_len={"dist": "uniform", "min": 1, "max": 9}),
    dict(num_requests=300, arrival={"process": "poisson", "rate": 10}, shared_prefix={"length": 16},
         priorities={"values": [3, 1], "weights": [1, 2]}),
])
def test_draws_made_in_chunks_are_the_whole_arrays_draws(monkeypatch, workload):
    """_ChunkedDraws (chunks of 7 requests: every stream drawn in many calls, the second array of a
    stream from a copy moved past the first, running sums carried across chunks) gives every row,
    value and Python type, and so every request, that the whole arrays give."""
    import sim.workload as wl

    s = scenario(**workload)
    assert wl.drawn_in_chunks(s.workload)
    whole = list(wl._WholeDraws(s.workload, s.seed).rows())
    expected = signature(build_requests(s))
    monkeypatch.setattr(wl, "LISTED_CHUNK", 7)
    chunked = list(wl._ChunkedDraws(s.workload, s.seed).rows())
    assert [[(type(v), v) for v in row] for row in chunked] == [[(type(v), v) for v in row] for row in whole]
    assert signature(build_requests(s)) == expected
    monkeypatch.setattr(wl, "drawn_in_chunks", lambda w: False)
    assert signature(build_requests(s)) == expected


def test_draws_in_chunks_refuse_what_the_whole_draws_refuse(monkeypatch):
    import sim.workload as wl

    s = scenario(num_requests=2, arrival={"process": "gamma", "rate": 1, "cv": 100})   # (gaps underflow)
    assert wl.drawn_in_chunks(s.workload)
    with pytest.raises(WorkloadError) as chunked:
        build_requests(s)
    monkeypatch.setattr(wl, "drawn_in_chunks", lambda w: False)
    with pytest.raises(WorkloadError) as whole:
        build_requests(s)
    assert str(chunked.value) == str(whole.value)
