"""The overlapped engine loop (engine/pipeline.py) against the synchronous one: same batches,
same sampled tokens and logits, same request records, through prefills, prefix hits, chunks,
decodes and preemptions, with live requests (which force a step to settle before the next)
mixed in."""
import numpy as np
import pytest
import torch

from engine.pipeline import StepPipeline, overlap_wanted
from engine.runner import ModelRunner
from engine.weights import build_model, init_random_weights
from sim.core.catalog import get_model
from sim.core.kv import KVCacheManager
from sim.core.request import Request, make_request
from sim.core.scheduler import SchedulerConfig
from sim.core.scheduler_variants import make_scheduler

BLOCK, MAX_MODEL_LEN = 4, 64
RECORD_FIELDS = ("num_output", "output_len", "num_computed", "finish_step", "first_token_step",
                 "emit_runs", "admit_step", "num_cached_tokens")


@pytest.fixture(scope="module")
def model():
    m = build_model(get_model("tiny"), "cpu")
    init_random_weights(m, seed=1, std=0.1)
    return m


def requests(live: bool) -> list[Request]:
    rng = np.random.default_rng(0)
    reqs = [make_request(i, 0.0, [(1000 + i % 2, 16), (2000 + i, int(rng.integers(3, 18)))],
                         int(rng.integers(4, 12)), seed=3) for i in range(14)]
    if live:                              # the server's kind: outputs sampled, one stopping at EOS
        reqs += [Request(100 + i, 0.0, [(300 + i, 10 + 3 * i)], 8, []) for i in range(2)]
    return reqs


def run(model, overlap: bool, live: bool, eos: int | None = None):
    kv = KVCacheManager(24, BLOCK, enable_caching=True, max_model_len=MAX_MODEL_LEN)
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN), kv)
    runner = ModelRunner(model, 24, BLOCK, MAX_MODEL_LEN, seed=7)
    reqs = requests(live)
    if eos is not None:
        reqs[-1].eos_token_id = eos
    for r in reqs:
        assert scheduler.add(r)
    pipeline = StepPipeline(scheduler, runner, overlap=overlap)
    steps, early = [], 0
    while pipeline.busy():
        early += pipeline._finished is not None
        done = pipeline.step()
        assert done is not None, "the pipeline stalled with work left"
        b = done.batch
        steps.append({"step": b.step, "reqs": [r.id for r in b.reqs], "num_new": b.num_new,
                      "preempted": [r.id for r in b.preempted], "sampled": done.result.sampled,
                      "finished": [r.id for r in done.finished], "logits": done.result.logits,
                      "rows": done.result.rows, "tokens": done.result.tokens})
    scheduler.check_accounting()
    records = {r.id: {f: getattr(r, f) for f in RECORD_FIELDS} for r in reqs}
    outputs = {r.id: list(r.segments[-1]) for r in reqs if r.is_live}
    return steps, records, outputs, scheduler, early


def assert_same_runs(a, b):
    steps_a, records_a, outputs_a = a[:3]
    steps_b, records_b, outputs_b = b[:3]
    assert len(steps_a) == len(steps_b)
    for x, y in zip(steps_a, steps_b):
        lx, ly = x.pop("logits"), y.pop("logits")
        assert x == y
        assert torch.equal(lx, ly)              # the same arithmetic in the same order: bit for bit
    assert records_a == records_b and outputs_a == outputs_b


@pytest.mark.parametrize("live", [False, True])
def test_overlapped_steps_match_synchronous_ones(model, live):
    sync = run(model, overlap=False, live=live)
    over = run(model, overlap=True, live=live)
    scheduler = sync[3]
    assert scheduler.num_preemptions > 0 and scheduler.kv.stats.hits > 0, "the case lost its coverage"
    assert any(len(s["num_new"]) > 1 and max(s["num_new"]) > 1 and 1 in s["num_new"] for s in sync[0]), \
        "no mixed prefill + decode step"
    assert sync[4] == 0 and over[4] > 0       # only the overlapped loop settles steps early
    if live:
        assert over[4] < len(over[0])          # steps sampling for live requests wait for their ids
        assert all(len(out) == 8 for out in over[2].values())
    assert_same_runs(sync, over)


def test_a_live_eos_settles_its_step_before_the_next_is_scheduled(model):
    """EOS decides a live request's length: the overlapped loop must stop it where the
    synchronous one does (its greedy third token as EOS)."""
    probe = run(model, overlap=False, live=True)[2][101]
    sync = run(model, overlap=False, live=True, eos=probe[2])
    over = run(model, overlap=True, live=True, eos=probe[2])
    stop = probe.index(probe[2]) + 1
    assert over[2][101] == probe[:stop] and over[1][101]["num_output"] == stop
    assert_same_runs(sync, over)


def test_the_switch(monkeypatch, model):
    assert overlap_wanted()
    monkeypatch.setenv("KVTWIN_OVERLAP", "0")
    assert not overlap_wanted()
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN),
                          KVCacheManager(24, BLOCK, enable_caching=False, max_model_len=MAX_MODEL_LEN))
    assert not StepPipeline(scheduler, ModelRunner(model, 24, BLOCK, MAX_MODEL_LEN)).overlap
    assert StepPipeline(scheduler, None).step() is None     # nothing to run: no step, no runner call
