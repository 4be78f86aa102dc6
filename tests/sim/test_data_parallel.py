"""Data-parallel engines as vLLM runs them (sim/dp.py, docs/vllm_semantics.md "Data parallel"):
the DP load balancer and its information lag, full per-rank limits, padding across ranks, the
MoE exchange by --all2all-backend, and the releases where these differ. Each test cites the
vLLM file and release it follows (wheels 0.12-0.21 from the package registry)."""
from __future__ import annotations

import pytest

from sim.core.catalog import get_device, get_model
from sim.core.scheduler import Batch
from sim.costmodel import CostModel
from sim.dp import (DPLayout, DPLoadBalancer, DPPadding, STATS_INTERVAL_S, engine_peak_running, largest_graph,
                    remote_ranks)
from sim.errors import ScenarioError
from sim.scenario import validate_scenario
from sim.simulator import simulate

QWEN_MOE = get_model("qwen3-30b-a3b")


class _Rank:
    def __init__(self, index: int):
        self.index = index


def balancer(api_servers: int = 1, ranks: int = 2, publishes: bool = True) -> DPLoadBalancer:
    return DPLoadBalancer([_Rank(i) for i in range(ranks)], api_servers, publishes)


def picks(lb: DPLoadBalancer, times) -> list[int]:
    return [lb.pick(t).index for t in times]


def moe_dp_scenario(**changes) -> object:
    raw = {"model": "qwen3-30b-a3b", "device": "h100-sxm", "parallelism": {"dp": 2, "ep": 2},
           "engine": {"max_model_len": 4096, "prefix_caching": False},
           "workload": {"num_requests": 40, "arrival": {"process": "offline"}, "prompt_len": 64, "output_len": 16}}
    for key, value in changes.items():
        section, _, field = key.partition("__")
        raw[section] = {**raw.get(section, {}), field: value} if field else value
    return validate_scenario(raw)


def decode_batch(rows: int) -> Batch:
    batch = Batch(0)
    batch.decodes, batch.num_decode = [None] * rows, rows
    batch.decode_ctx, batch.blocks_read = rows * 800, rows * 50
    return batch


def prefill_batch(tokens: int) -> Batch:
    batch = Batch(0)
    batch.prefills, batch.num_prefill_tokens = [None], tokens
    batch.prefill_attn = tokens * (tokens + 1) // 2
    return batch


# ----------------------------------------------------------------------------- the load balancer

def test_balancer_picks_the_lowest_waiting_times_four_plus_running():
    """vllm/v1/engine/core_client.py (0.19) DPLBAsyncMPClient.get_core_engine_for_request:
    `score = waiting * 4 + running`, the lowest wins (the first scanned on a tie), and the chosen
    rank's waiting count goes up by the number of API servers until the next publication."""
    lb = balancer()
    lb.step_ended(0.01, ((1, 0), (0, 3)))       # rank 0: one waiting (4), rank 1: three running (3)
    lb.step_ended(0.02, ((1, 0), (0, 3)))       # (unchanged counts are not sent again)
    assert lb.pick(0.2).index == 1              # published at 0.1 (the interval since 0 was up)
    assert lb.views[0] == [[1, 0], [1, 3]]      # its own increment: +1 waiting (one API server)
    assert lb.pick(0.2).index == 0              # 4 vs 7
    lb2 = balancer(api_servers=2)
    lb2.step_ended(0.01, ((0, 0), (0, 0)))
    assert lb2.pick(0.0).index == 0 and lb2.views[0][0] == [2, 0]     # + the client count, 2


def test_a_burst_alternates_ranks_and_each_api_server_starts_at_its_own_rank():
    """Before any publication every API server balances on its own increments: a burst at one
    instant alternates the ranks. vLLM 0.19 DPLBAsyncMPClient: each client scans from
    eng_start_index = ranks x client_index // client_count, so two API servers start at ranks 0
    and 1 (requests reach the servers in turn here)."""
    lb = balancer(api_servers=2, ranks=2)
    assert picks(lb, [0.0] * 6) == [0, 1, 1, 0, 0, 1]
    assert lb.starts == [0, 1]
    burst = picks(balancer(api_servers=2, ranks=4), [0.0] * 400)
    assert [burst.count(r) for r in range(4)] == [100, 100, 100, 100]


def test_publications_come_every_100_ms_with_the_step_before_the_latest():
    """vllm/v1/engine/coordinator.py (0.19) process_input_socket: the coordinator sends the API
    servers the ranks' counts at most every 100 ms (min_stats_update_interval_ms) while they
    change, the snapshot taken before the latest step's counts (`last_step_counts`), or 50 ms
    after a lone change; unchanged counts again after 5 s. Each publication replaces the API
    servers' counts, their own increments included."""
    lb = balancer()
    a, b, c, d = ((0, 1), (0, 0)), ((0, 1), (2, 0)), ((0, 2), (0, 2)), ((3, 3), (0, 0))
    lb.step_ended(0.01, a)
    lb.step_ended(0.05, b)
    lb.pick(0.099)
    assert lb.publications == 0 and lb.views[0] == [[1, 0], [0, 0]]     # only its own increment yet
    lb._catch_up(0.1)
    assert lb.views[0] == [list(x) for x in a] and lb.publications == 1  # at 100 ms: a, not b (the latest)
    lb.step_ended(0.12, c)
    lb.step_ended(0.15, d)
    lb._catch_up(0.2)
    assert lb.views[0] == [list(x) for x in c]                           # at 200 ms: the step before d
    lb._catch_up(0.299)
    assert lb.publications == 2
    lb._catch_up(0.301)
    assert lb.views[0] == [list(x) for x in d] and lb.publications == 3  # d at 0.3, once nothing newer came
    lb.pick(0.31)                                                        # an increment ...
    lb._catch_up(5.29)
    assert lb.publications == 3 and lb.views[0] != [list(x) for x in d]
    lb._catch_up(5.31)
    assert lb.views[0] == [list(x) for x in d] and lb.publications == 4  # ... wiped by the 5 s republish


def test_a_dense_models_ranks_never_publish_so_balancing_is_blind_to_load():
    """vLLM 0.19 runs a dense model's dp ranks as plain EngineCoreProcs (v1/engine/core.py
    run_engine_core: "Non-MoE DP ranks are completely independent"), and only DPEngineCoreProc's
    busy loop calls _maybe_publish_request_counts: the coordinator republishes zeros every 5 s
    and the API servers balance on their own increments (vLLM's PR #49204, after 0.21, added the
    missing publication). A loaded rank keeps getting its turn."""
    lb = balancer(publishes=False)
    lb.step_ended(0.01, ((50, 256), (0, 0)))         # rank 0 swamped: not sent
    assert picks(lb, [0.5, 0.6, 0.7, 0.8]) == [0, 1, 0, 1]
    assert picks(lb, [5.0]) == [0]                   # the 5 s republish of zeros restarts the scan


def test_the_simulated_balancer_steers_new_requests_away_from_a_busy_rank():
    """One long request runs on rank 0; short ones arriving every 0.3 s then all go to rank 1,
    whose published counts are lower (vLLM 0.19 DPLBAsyncMPClient + DPCoordinator), where a
    round-robin router would send every other one to rank 0."""
    requests = [{"arrival_s": 0.0, "prompt_len": 64, "output_len": 3000}] + [
        {"arrival_s": 0.3 * (i + 1), "prompt_len": 64, "output_len": 4} for i in range(10)]
    scenario = moe_dp_scenario(workload={"requests": requests})
    records = simulate(scenario)[0]
    table = records.requests
    replica = dict(zip(table.column("id"), table.column("replica")))
    assert replica[0] == 0
    assert [replica[i] for i in range(1, 11)] == [1] * 10
    assert records.meta["data_parallel"]["load_balancer_publications"] > 10


# ----------------------------------------------------------------------------- per-rank limits

def test_each_rank_runs_the_full_max_num_seqs_and_the_summary_counts_the_engine():
    """vllm/config/parallel.py and engine/arg_utils.py (0.19) leave max_num_seqs and
    max_num_batched_tokens per engine, and every dp rank is an engine with its own scheduler: two
    ranks run up to 2 x max_num_seqs. kvtwin's step rows are per rank (peak_running: 8), vLLM's
    vllm:num_requests_running summed over the engine label counts both (16)."""
    from sim.metrics import summarise

    scenario = moe_dp_scenario(engine={"max_model_len": 4096, "prefix_caching": False, "max_num_seqs": 8})
    records = simulate(scenario)[0]
    summary = summarise(records)
    assert summary["peak_running"] == 8
    assert summary["data_parallel"]["peak_running_per_engine"] == [16]
    assert summary["data_parallel"]["api_servers"] == 2


def test_engine_peak_running_adds_overlapping_steps_of_independent_ranks():
    import pandas as pd

    steps = pd.DataFrame({"replica": [0, 0, 1, 1], "start_s": [0.0, 1.0, 0.5, 2.0],
                          "end_s": [1.0, 2.0, 1.5, 3.0], "running": [3, 5, 4, 1]})
    assert engine_peak_running(steps, [[0, 1]]) == [9]          # 5 + 4 between 1.0 and 1.5
    assert engine_peak_running(steps, [[0], [1]]) == [5, 4]


# ----------------------------------------------------------------------------- lockstep and padding

def test_ranks_pad_to_the_largest_only_when_every_rank_runs_a_cuda_graph():
    """vllm/v1/worker/dp_utils.py _synchronize_dp_ranks, 0.19: `should_dp_pad =
    synced_cudagraph_mode != 0`, the mode being the minimum over the ranks; a batch beyond the
    largest captured size runs without a graph (mode NONE), so a rank prefilling 2048 tokens next
    to one decoding 8 leaves both unpadded, the experts seeing 2056 tokens. 0.12-0.16 padded
    whenever graphs were configured (gpu_model_runner.py `allow_dp_padding`)."""
    h100 = get_device("h100-sxm")
    new = CostModel(QWEN_MOE, h100, dp=2, ep=2, dp_padding=DPPadding(512, only_when_all_graphed=True))
    old = CostModel(QWEN_MOE, h100, dp=2, ep=2, dp_padding=DPPadding(512, only_when_all_graphed=False))
    big, small = prefill_batch(2048), decode_batch(8)
    (_, _), (_, small_new) = new.lockstep_times([big, small])
    (_, _), (_, small_old) = old.lockstep_times([big, small])
    assert small_new < small_old
    own_gemms = new._sizes(8, 8, 0, 0, 0, 8, 2056)(8 * 800, 8 * 50)[1]
    assert small_new == own_gemms
    assert small_old == old._sizes(8, 8, 0, 0, 0, 2048, 4096)(8 * 800, 8 * 50)[1]
    # under the largest graph both releases pad: 64 and 8 decodes run at 64 each
    assert new.lockstep_times([decode_batch(64), small]) == old.lockstep_times([decode_batch(64), small])
    # enforce_eager (no graphs): no padding in any release
    eager = DPPadding(0, only_when_all_graphed=False)
    assert eager.run_tokens([64, 8]) == [64, 8] and DPPadding(512, False).run_tokens([64, 8]) == [64, 64]


def test_the_padding_rule_follows_the_scenarios_release_eager_flag_and_backend():
    assert DPPadding.for_scenario(moe_dp_scenario()) == DPPadding(512, True)
    assert DPPadding.for_scenario(moe_dp_scenario(engine={"vllm_version": "0.16"})).only_when_all_graphed is False
    assert DPPadding.for_scenario(moe_dp_scenario(engine={"enforce_eager": True})).graph_max == 0
    # config/compilation.py (0.19): DeepEP high-throughput with dp > 1 turns CUDA graphs off
    ht = moe_dp_scenario(parallelism={"dp": 2, "ep": 2, "all2all_backend": "deepep_high_throughput"})
    assert DPPadding.for_scenario(ht).graph_max == 0
    small = moe_dp_scenario(engine={"max_num_seqs": 50, "max_model_len": 4096})
    assert DPPadding.for_scenario(small).graph_max == 96


@pytest.mark.parametrize("seqs, tokens, expected", [(1024, 8192, 512), (256, 2048, 512), (150, 8192, 288),
                                                     (128, 8192, 256), (50, 8192, 96), (2, 8192, 4),
                                                     (3, 8192, 4), (1024, 200, 200), (1024, 130, 128)])
def test_largest_cuda_graph_follows_vllms_capture_sizes(seqs, tokens, expected):
    """vllm/config/vllm.py _set_cudagraph_sizes (0.12-0.21): capture up to min(2 x max_num_seqs,
    512, max_num_batched_tokens) in sizes 1, 2, 4, then multiples of 8 below 256 and of 16 from 256."""
    cap = min(2 * seqs, 512, tokens)
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, min(cap + 1, 256), 8)) + (
        list(range(256, cap + 1, 16)) if cap >= 256 else [])
    assert largest_graph(seqs, tokens) == sizes[-1] == expected


def test_dense_dp_ranks_step_in_lockstep_before_014_and_alone_after():
    """vllm/v1/engine/core.py run_engine_core: 0.12 and 0.13 start DPEngineCoreProc for every dp
    rank (`if parallel_config.data_parallel_size > 1 or dp_rank > 0`); from 0.14 only for MoE
    models ("Non-MoE DP ranks are completely independent")."""
    def spans(version: str):
        scenario = validate_scenario({
            "model": "qwen2.5-0.5b", "device": "h100-sxm", "parallelism": {"dp": 2},
            "engine": {"max_model_len": 2048, "vllm_version": version},
            "workload": {"num_requests": 30, "arrival": {"process": "poisson", "rate": 40},
                         "prompt_len": {"dist": "uniform", "min": 16, "max": 400},
                         "output_len": {"dist": "uniform", "min": 4, "max": 60}}})
        steps = simulate(scenario)[0].steps_frame(full=True)
        return [set(zip(s["start_s"], s["end_s"])) for _, s in steps.groupby("replica")], scenario
    (a, b), old = spans("0.13")
    assert DPLayout.for_scenario(old).lockstep
    ends = sorted(a | b)
    assert all(nxt[0] >= end[1] for end, nxt in zip(ends, ends[1:]))     # one clock: no overlap
    (a, b), new = spans("0.14")
    assert not DPLayout.for_scenario(new).lockstep
    ends = sorted(a | b)
    assert any(nxt[0] < end[1] for end, nxt in zip(ends, ends[1:]))      # independent: steps overlap


# ----------------------------------------------------------------------------- layout and flags

def test_api_servers_default_to_the_balanced_ranks_from_015():
    """entrypoints/cli/serve.py (0.15-0.21): --api-server-count unset is the dp size (internal),
    dp_local (hybrid) or 1 (external); 0.12-0.14's cli_args.py default is 1."""
    assert DPLayout.for_scenario(moe_dp_scenario()).api_servers == 2
    assert DPLayout.for_scenario(moe_dp_scenario(engine={"vllm_version": "0.14"})).api_servers == 1
    hybrid = moe_dp_scenario(parallelism={"dp": 4, "ep": 4, "dp_local": 2, "dp_load_balancing": "hybrid"})
    assert (DPLayout.for_scenario(hybrid).group_size, DPLayout.for_scenario(hybrid).api_servers) == (2, 2)
    # engine/arg_utils.py: hybrid on one node is internal, with one rank per node external
    one_node = moe_dp_scenario(parallelism={"dp": 2, "ep": 2, "dp_local": 2, "dp_load_balancing": "hybrid"})
    assert DPLayout.for_scenario(one_node).balancing == "internal"
    per_rank = moe_dp_scenario(parallelism={"dp": 2, "ep": 2, "dp_local": 1, "dp_load_balancing": "hybrid"})
    assert DPLayout.for_scenario(per_rank).balancing == "external"
    assert not DPLayout.for_scenario(per_rank).balanced
    assert DPLayout.for_scenario(moe_dp_scenario(parallelism={"dp": 2, "ep": 2, "api_servers": 5})).api_servers == 5


def test_hybrid_balancing_gives_each_node_its_balancer_and_the_router_picks_the_node():
    scenario = moe_dp_scenario(parallelism={"dp": 4, "ep": 4, "dp_local": 2, "dp_load_balancing": "hybrid"},
                               workload={"num_requests": 40, "arrival": {"process": "poisson", "rate": 30},
                                         "prompt_len": 64, "output_len": 16})
    table = simulate(scenario)[0].requests
    by_arrival = list(table.sorted_column("replica"))        # (ids in arrival order)
    assert set(by_arrival) == {0, 1, 2, 3}
    # round_robin across the two nodes: requests alternate between ranks {0, 1} and {2, 3}
    assert all((r < 2) == (i % 2 == 0) for i, r in enumerate(by_arrival))


def test_dp_fields_are_checked_as_vllm_accepts_them():
    base = {"model": "qwen3-30b-a3b", "device": "h100-sxm", "engine": {"max_model_len": 4096}}
    with pytest.raises(ScenarioError, match="dp_local: 3 ranks per node do not divide dp 4"):
        validate_scenario({**base, "parallelism": {"dp": 4, "dp_local": 3}})
    with pytest.raises(ScenarioError, match="hybrid needs parallelism.dp_local"):
        validate_scenario({**base, "parallelism": {"dp": 4, "dp_load_balancing": "hybrid"}})
    # config/parallel.py All2AllBackend: mori from 0.15, nixl_ep from 0.18
    with pytest.raises(ScenarioError, match="mori is not in vLLM 0.14's --all2all-backend choices"):
        validate_scenario({**base, "parallelism": {"dp": 2, "all2all_backend": "mori"},
                           "engine": {"max_model_len": 4096, "vllm_version": "0.14"}})
    validate_scenario({**base, "parallelism": {"dp": 2, "all2all_backend": "mori"}})
    # before 0.12 there was no --all2all-backend to check against (VLLM_ALL2ALL_BACKEND only)
    validate_scenario({**base, "parallelism": {"dp": 2}, "engine": {"max_model_len": 4096, "vllm_version": "0.11"}})
    with pytest.raises(ScenarioError, match="llm_d in front of data-parallel engines"):
        validate_scenario({**base, "parallelism": {"dp": 2}, "cluster": {"replicas": 2, "router": "llm_d"}})
    validate_scenario({**base, "parallelism": {"dp": 2, "dp_load_balancing": "external"},
                       "cluster": {"replicas": 2, "router": "llm_d"}})
    validate_scenario({**base, "parallelism": {"dp": 2}, "cluster": {"replicas": 1, "router": "llm_d"}})


def test_speculation_is_refused_wherever_ranks_step_in_lockstep():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": 0.5}
    dense = {"model": "qwen2.5-0.5b", "device": "h100-sxm", "parallelism": {"dp": 2},
             "workload": {"num_requests": 4, "prompt_len": 16, "output_len": 4}}
    with pytest.raises(ScenarioError, match="ranks step in lockstep"):
        CostModel.for_scenario(validate_scenario({**dense, "engine": {"vllm_version": "0.13",
                                                                     "speculative": spec}}))
    assert CostModel.for_scenario(validate_scenario({**dense, "engine": {"speculative": spec}})).draft is not None


# ----------------------------------------------------------------------------- the MoE exchange

def test_the_exchange_follows_the_all2all_backend():
    """vllm/distributed/device_communicators/all2all.py (0.19): allgather_reducescatter (the
    default, config/parallel.py) all-gathers the ranks' tokens and reduce-scatters the outputs;
    naive broadcasts each rank's tokens and all-reduces all of them back; the all-to-all kernels
    send a token only to the ranks holding its experts, which for 8 of 128 experts over 2 ranks is
    nearly always the other one (1 - C(64, 8) / C(128, 8))."""
    h100 = get_device("h100-sxm")
    token_bytes = QWEN_MOE.hidden_size * QWEN_MOE.dtype_bytes
    link = h100.link_gbps * 1e9

    def comm(backend: str, dp: int = 2) -> float:
        return CostModel(QWEN_MOE, h100, dp=dp, ep=dp, all2all_backend=backend)._moe_comm_token_s
    assert comm("allgather_reducescatter") == 2 * 1 * token_bytes / link
    assert comm("naive") == 3 * 1 * token_bytes / link
    miss = 1.0
    for i in range(8):
        miss *= (64 - i) / (128 - i)
    assert remote_ranks(128, 8, 2) == pytest.approx(1 - miss, rel=1e-12)
    assert comm("deepep_low_latency") == pytest.approx(2 * (1 - miss) * token_bytes / link, rel=1e-12)
    # with 8 ranks a token reaches fewer than all 7 others: the all-to-all moves less than the gather
    assert comm("pplx", dp=8) < comm("allgather_reducescatter", dp=8)


def test_the_experts_see_every_ranks_tokens_and_the_exchange_their_mean_share():
    """Unequal ranks (no padding): the experts of each GPU compute over all ranks' tokens
    together, the all-gather moves each rank's share (all_gatherv's sizes, dp_utils
    num_tokens_across_dp); equal ranks price as before."""
    cost = CostModel(QWEN_MOE, get_device("h100-sxm"), dp=2, ep=2)
    assert cost.moe_layer_time(64, gathered=128) == cost.moe_layer_time(64)
    assert cost.moe_layer_time(8, gathered=2056) == cost.moe_layer_time(1028)
    assert cost.moe_layer_time(8, gathered=2056) > cost.moe_layer_time(8)


@pytest.mark.parametrize("model, extra", [("qwen2.5-0.5b", {}), ("qwen3-30b-a3b", {"ep": 2})])
def test_fast_paths_and_the_reference_agree_behind_the_balancer(model, extra):
    """The balancer reads only its own state and the time, so leaps (dense ranks) and the
    one-by-one path place and time every request alike, bit for bit."""
    scenario = validate_scenario({
        "model": model, "device": "h100-sxm", "parallelism": {"dp": 2, **extra},
        "engine": {"max_model_len": 2048, "num_blocks": 300},
        "workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 60},
                     "prompt_len": {"dist": "uniform", "min": 16, "max": 600},
                     "output_len": {"dist": "uniform", "min": 4, "max": 200}}})
    fast, reference = simulate(scenario, fast=True)[0], simulate(scenario, fast=False)[0]
    assert fast.steps_frame(full=True).equals(reference.steps_frame(full=True))
    for column in ("replica", "finish_step", "first_token_step"):
        assert list(fast.requests.sorted_column(column)) == list(reference.requests.sorted_column(column))
