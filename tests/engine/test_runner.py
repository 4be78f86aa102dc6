"""The runner driven by the real scheduler and block pool, checked against unpaged forwards.

Every emitted logits row must equal the last-token logits of a dense, cache-free forward of
the request's own tokens: that holds only if prefix hits, chunked prefill and
preemption-recompute all read the right K/V. Tolerance: fp32, the same arithmetic reordered
(SDPA over gathered blocks vs over contiguous K/V), ~1e-5 on logits of size ~1 (see
test_model.py); 1e-4 leaves room and a wrong block or position misses by orders more.
"""
from collections import defaultdict

import numpy as np
import pytest
import torch

from engine.attention import AttentionMetadata
from engine.runner import InconsistentBatchError, ModelRunner, profile_query_lens, profile_run
from engine.weights import build_model, init_random_weights
from sim.core.catalog import get_model
from sim.core.kv import KVCacheManager
from sim.core.memory import InsufficientMemoryError, plan_memory
from sim.core.request import Request, make_request
from sim.scenario import validate_scenario
from sim.core.scheduler import Batch, Scheduler, SchedulerConfig
from sim.core.scheduler_variants import make_scheduler

TOL = dict(atol=1e-4, rtol=1e-4)
BLOCK = 4
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model():
    m = build_model(get_model("tiny"), "cpu")
    init_random_weights(m, seed=1, std=0.1)   # sharper attention than 0.02: wrong K/V shows more
    return m


def make_engine(model, num_blocks: int, max_num_seqs: int = 6, max_num_batched_tokens: int = 32,
                temperature: float = 0.0, caching: bool = True):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=caching, max_model_len=MAX_MODEL_LEN)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=MAX_MODEL_LEN)
    runner = ModelRunner(model, num_blocks, BLOCK, MAX_MODEL_LEN, temperature=temperature, seed=7)
    return make_scheduler(config, kv), runner


def drive(scheduler: Scheduler, runner: ModelRunner) -> dict[int, dict[int, torch.Tensor]]:
    """schedule -> execute -> finish_step until done; request id -> {output index: logits}."""
    logits = defaultdict(dict)
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        assert batch is not None, "scheduler stalled with work left"
        out_index = {r.id: r.num_output for r in batch.reqs}
        result = runner.execute(batch)
        assert result.host_s > 0 and result.device_s > 0
        for row, rid in enumerate(result.sampled):
            logits[rid][out_index[rid]] = result.logits[row]
        scheduler.finish_step(batch)
    scheduler.check_accounting()
    return logits


@torch.inference_mode()
def dense_logits(model, token_ids: np.ndarray) -> torch.Tensor:
    """Logits at every position of one sequence, without paging, batching or a KV cache."""
    n = len(token_ids)
    meta = AttentionMetadata.dense([n], torch.device("cpu"))
    hidden = model(torch.from_numpy(token_ids), torch.arange(n), meta)
    return model.compute_logits(hidden)


def shared_prefix_requests(n: int) -> list[Request]:
    rng = np.random.default_rng(0)
    return [make_request(i, 0.0, [(1000 + i % 2, 16), (2000 + i, int(rng.integers(3, 18)))],
                         int(rng.integers(4, 12)), seed=3) for i in range(n)]


def test_logits_match_unpaged_forward_through_hits_chunks_and_preemptions(model):
    scheduler, runner = make_engine(model, num_blocks=24)
    reqs = shared_prefix_requests(14)
    for r in reqs:
        assert scheduler.add(r)
    logits = drive(scheduler, runner)
    assert scheduler.num_finished == len(reqs)
    assert scheduler.kv.stats.hits > 0, "no prefix hits: the test would not cover them"
    assert scheduler.num_preemptions > 0, "no preemption: the test would not cover recompute"
    for r in reqs:
        assert sorted(logits[r.id]) == list(range(r.output_len))
        want = dense_logits(model, r.token_ids(0, r.max_len - 1, model.spec.vocab_size))
        got = torch.stack([logits[r.id][k] for k in range(r.output_len)])
        torch.testing.assert_close(got, want[r.prompt_len - 1:], **TOL)


def test_a_wrong_block_table_is_caught_by_the_same_check(model):
    """The oracle is sharp: reading one block of never-written K/V moves the logits far past TOL."""
    scheduler, runner = make_engine(model, num_blocks=24)
    req = make_request(0, 0.0, [(5, 20)], 2)
    scheduler.add(req)
    batch = scheduler.schedule()
    runner.execute(batch)
    scheduler.finish_step(batch)
    batch = scheduler.schedule()
    req.blocks[0] = scheduler.kv.pool.get_new_blocks(1)[0]
    got = runner.execute(batch).logits[0]
    want = dense_logits(model, req.token_ids(0, 21, model.spec.vocab_size))[-1]
    assert (got - want).abs().max() > 100 * TOL["atol"]


def test_live_requests_append_their_samples(model):
    scheduler, runner = make_engine(model, num_blocks=40)
    live = [Request(i, 0.0, [(300 + i, 10 + 3 * i)], 8, []) for i in range(3)]
    for r in live:
        scheduler.add(r)
    drive(scheduler, runner)
    for r in live:
        out = r.segments[-1]
        assert len(out) == r.output_len
        # Greedy: each output is the argmax after the tokens before it.
        want = dense_logits(model, r.token_ids(0, r.max_len - 1, model.spec.vocab_size)).argmax(-1)
        assert out == want[r.prompt_len - 1:].tolist()


def test_live_request_stops_at_eos(model):
    scheduler, runner = make_engine(model, num_blocks=40)
    probe = Request(0, 0.0, [(500, 12)], 6, [])
    scheduler.add(probe)
    drive(scheduler, runner)
    greedy = probe.segments[-1]
    stop = greedy.index(greedy[2]) + 1          # its third greedy token, as EOS, ends it here
    req = Request(1, 0.0, [(500, 12)], 6, [])
    req.eos_token_id = greedy[2]
    scheduler.add(req)
    drive(scheduler, runner)
    assert req.segments[-1] == greedy[:stop]
    assert req.num_output == req.output_len == stop


def test_temperature_sampling_is_seeded(model):
    def run():
        scheduler, runner = make_engine(model, num_blocks=40, temperature=1.0, caching=False)
        reqs = [Request(i, 0.0, [(400 + i, 12)], 10, []) for i in range(3)]
        for r in reqs:
            scheduler.add(r)
        drive(scheduler, runner)
        return [r.segments[-1] for r in reqs]

    first = run()
    assert first == run()
    greedy_scheduler, greedy_runner = make_engine(model, num_blocks=40, caching=False)
    greedy = [Request(i, 0.0, [(400 + i, 12)], 10, []) for i in range(3)]
    for r in greedy:
        greedy_scheduler.add(r)
    drive(greedy_scheduler, greedy_runner)
    assert first != [r.segments[-1] for r in greedy]


def one_request_batch(req: Request, n: int) -> Batch:
    batch = Batch(step=0)
    batch.add(req, n, BLOCK)
    return batch


@pytest.mark.parametrize("break_it, message", [
    (lambda r: setattr(r, "blocks", [1]), "blocks cannot hold"),
    (lambda r: setattr(r, "blocks", [1, 2, 99]), "outside"),
    (lambda r: setattr(r, "num_computed", 30), "only 10 are known"),
])
def test_runner_refuses_inconsistent_batches(model, break_it, message):
    _, runner = make_engine(model, num_blocks=24)
    req = make_request(0, 0.0, [(1, 10)], 4)
    batch = one_request_batch(req, 10)
    req.blocks = [1, 2, 3]
    break_it(req)
    with pytest.raises(InconsistentBatchError, match=message):
        runner.execute(batch)


def test_runner_refuses_context_beyond_max_model_len(model):
    runner = ModelRunner(model, 40, BLOCK, max_model_len=16)
    req = make_request(0, 0.0, [(1, 20)], 4)
    batch = one_request_batch(req, 20)
    req.blocks = list(range(1, 6))
    with pytest.raises(InconsistentBatchError, match="exceeds max_model_len 16"):
        runner.execute(batch)


def tiny_scenario(**engine):
    return validate_scenario({"model": "tiny", "device": "cpu", "workload": {"num_requests": 1},
                              "engine": {"max_model_len": 256, "max_num_seqs": 8,
                                         "max_num_batched_tokens": 128, **engine}})


def test_from_scenario_sizes_the_pool_with_sim_memory():
    scenario = tiny_scenario(gpu_memory_utilization=0.01)
    runner = ModelRunner.from_scenario(scenario, device="cpu")
    plan = plan_memory(scenario)
    assert runner.plan == plan and runner.num_blocks == plan.num_blocks
    report = runner.memory_report()
    assert report["weight_bytes"] == scenario.model.weight_bytes()
    assert report["kv_pool_bytes"] == plan.kv_pool_bytes
    assert report["peak_bytes"] == plan.weight_bytes + plan.kv_pool_bytes


def test_profile_run_splits_the_token_budget_like_vllm(model):
    assert profile_query_lens(50, 8) == [6] * 7 + [8]
    assert profile_query_lens(5, 8) == [1] * 5
    assert profile_run(model, 50, 8) is None              # CPU: nothing to measure, but it runs


def test_a_pool_too_small_for_one_request_is_refused():
    with pytest.raises(InsufficientMemoryError, match="max_model_len 256"):
        ModelRunner.from_scenario(tiny_scenario(num_blocks=4), device="cpu")


# -- static batching: HF generate's padded batch ------------------------------------------------

def static_requests() -> list[Request]:
    """Prompts of unequal length and outputs of unequal length: padding in both phases."""
    shapes = [(5, 9), (13, 3), (8, 6), (2, 11), (11, 4)]
    return [make_request(i, 0.0, [(3000 + i, p)], o, seed=3) for i, (p, o) in enumerate(shapes)]


def drive_static(model, pad: bool, temperature: float = 0.0):
    """A static batch end to end; (per-request logits, sampled tokens, per-step (scheduler rows,
    scheduler tokens, runner rows, runner tokens))."""
    kv = KVCacheManager(40, BLOCK, enable_caching=False, max_model_len=MAX_MODEL_LEN)
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN,
                             batching="static")
    scheduler = make_scheduler(config, kv)
    runner = ModelRunner(model, 40, BLOCK, MAX_MODEL_LEN, temperature=temperature, seed=7)
    if not pad:
        runner.static_padding = lambda batch: ([], [], [])
    reqs = static_requests()
    for r in reqs:
        scheduler.add(r)
    logits, tokens, steps = defaultdict(dict), defaultdict(list), []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        out_index = {r.id: r.num_output for r in batch.reqs}
        result = runner.execute(batch)
        steps.append((batch.num_seqs, batch.num_tokens, result.rows, result.tokens))
        for row, (rid, token) in enumerate(result.sampled.items()):
            logits[rid][out_index[rid]] = result.logits[row]
            tokens[rid].append(token)
        scheduler.finish_step(batch)
    return logits, dict(tokens), steps, runner


def test_static_batch_runs_the_padded_rows_the_simulator_prices(model):
    _, _, steps, runner = drive_static(model, pad=True)
    assert [(s, t) for s, t, _, _ in steps] == [(rows, tokens) for _, _, rows, tokens in steps]
    # padding really happened: a [3, 13] prefill, then all 3 rows until the 9-token member ends
    assert steps[0] == (3, 3 * 13, 3, 3 * 13)
    assert [rows for _, _, rows, _ in steps[:9]] == [3] * 9
    assert steps[8][1] == 3 and len(steps) > 9
    # the padding wrote no K/V: the null block is still zero
    assert not runner.kv_cache[:, :, 0].any()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_padding_changes_no_live_output(model, temperature):
    padded, out_padded, steps_padded, _ = drive_static(model, pad=True, temperature=temperature)
    plain, out_plain, steps_plain, _ = drive_static(model, pad=False, temperature=temperature)
    assert out_padded == out_plain
    assert sum(s[3] for s in steps_padded) > sum(s[3] for s in steps_plain)     # padding computed
    for rid, rows in plain.items():
        for i, row in rows.items():
            torch.testing.assert_close(padded[rid][i], row, atol=1e-5, rtol=1e-5)
    if temperature == 0.0:      # and each row is the request's own unpaged forward
        for r in static_requests():
            dense = dense_logits(model, r.token_ids(0, r.max_len - 1, model.spec.vocab_size))
            for i, row in padded[r.id].items():
                torch.testing.assert_close(row, dense[r.prompt_len - 1 + i], **TOL)
