"""Prefill/decode disaggregation (cluster.disaggregation, sim/disagg.py).

The behaviour pinned here is vLLM's P/D serving with NixlConnector, vllm-project/vllm v0.19:
- vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py: NixlConnectorScheduler.
  request_finished returns delay_free_blocks=True for a do_remote_decode request that finished
  (length-capped), so the prefill engine holds its blocks until the decode side read them or
  VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s, vllm/envs.py) passed; get_num_new_matched_tokens
  returns (len(prompt) - num_computed_tokens, True) for do_remote_prefill: the whole prompt,
  less a local prefix hit, loads asynchronously.
- vllm/v1/core/sched/scheduler.py: the decode request's blocks are allocated in the waiting pass
  (head of line: it waits while they do not fit) and it sits in WAITING_FOR_REMOTE_KVS;
  _update_waiting_for_remote_kv then sets num_computed_tokens to the prompt less one token,
  which is recomputed for the first output token's logits.
- tests/v1/kv_connector/nixl_integration/toy_proxy_server.py: the proxy sends the prefill engine
  the request with max_tokens=1, then streams the decode engine's answer to the client.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from sim.disagg import build_simulation
from sim.disagg_config import LINK_DEFAULTS, block_bytes_per_gpu
from sim.scenario import pool_scenario
from sim.predict import predict
from sim.records import requests_frame
from sim.scenario import ScenarioError, validate_scenario


def pd_scenario(prefill: dict | None = None, decode: dict | None = None, link: dict | None = None,
                requests: list | None = None, **disagg) -> dict:
    workload = ({"requests": requests} if requests is not None else
                {"num_requests": 60, "arrival": {"process": "poisson", "rate": 20},
                 "prompt_len": {"dist": "uniform", "min": 200, "max": 600},
                 "output_len": {"dist": "uniform", "min": 8, "max": 40}})
    return {"name": "pd", "seed": 0, "model": "qwen2.5-0.5b", "device": "l4",
            "engine": {"max_model_len": 4096},
            "cluster": {"disaggregation": {"prefill": {"replicas": 1, **(prefill or {})},
                                           "decode": {"replicas": 1, **(decode or {})},
                                           "link": link or {"kind": "rdma"}, **disagg}},
            "workload": workload}


def run(raw: dict):
    sim = build_simulation(validate_scenario(raw))
    records = sim.run()
    return sim, records, requests_frame(records)


def problems(raw: dict) -> str:
    with pytest.raises(ScenarioError) as e:
        validate_scenario(raw)
    return str(e.value)


# ----------------------------------------------------------------------------- schema

def test_off_by_default_and_a_pool_is_the_scenario_with_its_patch():
    raw = pd_scenario(prefill={"tp": 2, "engine": {"max_num_batched_tokens": 4096}},
                      decode={"device": "a100-80g", "engine": {"max_num_seqs": 64}})
    assert validate_scenario({k: v for k, v in raw.items() if k != "cluster"}).cluster.disaggregation is None
    s = validate_scenario(raw)
    prefill, decode = pool_scenario(s, "prefill"), pool_scenario(s, "decode")
    assert (prefill.parallelism.tp, prefill.max_num_batched_tokens, prefill.device.name) == (2, 4096, "l4")
    assert (decode.parallelism.tp, decode.max_num_seqs, decode.device.name) == (1, 64, "a100-80g")
    assert decode.engine.max_model_len == prefill.engine.max_model_len == 4096
    assert prefill.cluster.disaggregation is None


@pytest.mark.parametrize("change, expected", [
    (lambda r: r["cluster"].update(replicas=2), "cluster.replicas: 2; set cluster.disaggregation.prefill.replicas"),
    (lambda r: r["cluster"]["disaggregation"]["decode"].update(engine={"block_size": 32}),
     "engine.block_size cannot differ between the prefill and decode pools"),
    (lambda r: r["cluster"]["disaggregation"]["prefill"].update(engine={"max_num_seqz": 3}),
     "cluster.disaggregation.prefill.engine"),
    (lambda r: r["cluster"]["disaggregation"]["decode"].update(tp=3), "cluster.disaggregation.decode: parallelism.tp: 3 does not divide"),
    (lambda r: r["cluster"]["disaggregation"]["link"].update(kind="carrier-pigeon"), "cluster.disaggregation.link.kind"),
    (lambda r: r["cluster"]["disaggregation"]["link"].update(bandwidth_gb_s=0), "bandwidth_gb_s"),
    (lambda r: r["cluster"]["disaggregation"]["decode"].update(device="no-such-gpu"),
     "cluster.disaggregation.decode.device"),
    (lambda r: r["cluster"]["disaggregation"]["decode"].update(engine={"num_blocks": 10**7}),
     "cluster.disaggregation.decode: engine.num_blocks: 10000000 blocks"),
    (lambda r: r.update(parallelism={"dp": 2}), "parallelism.dp"),
    (lambda r: r["engine"].update(batching="static"), "engine.batching/allocation"),
    (lambda r: r.update(model="mistral-7b-v0.1", engine={"max_model_len": 4096}), "sliding-window or hybrid"),
])
def test_invalid_combinations_name_the_field(change, expected):
    raw = pd_scenario()
    change(raw)
    assert expected in problems(raw)


# ----------------------------------------------------------------------------- one request, by hand

def test_transfer_time_is_latency_plus_the_busiest_gpus_shard_over_bandwidth():
    """A 1000-token prompt, prefill tp=1 and decode tp=2: each decode rank reads half the heads, the
    one prefill GPU serves all of them, so its shard (tp=1) bounds the read."""
    raw = pd_scenario(decode={"tp": 2}, link={"kind": "ethernet", "bandwidth_gb_s": 1.0, "latency_s": 0.002},
                      requests=[{"arrival_s": 0.0, "prompt_len": 1000, "output_len": 5}])
    sim, _, _ = run(raw)
    (t,) = sim.transfers
    s = sim.scenario
    assert t.blocks == math.ceil(1000 / 16)
    assert block_bytes_per_gpu(s, "prefill") == 2 * block_bytes_per_gpu(s, "decode")
    expected = 0.002 + t.blocks * block_bytes_per_gpu(s, "prefill") / 1e9
    assert t.done_s - t.allocated_s == pytest.approx(expected, rel=1e-9)
    assert t.allocated_s == t.prefill_done_s          # nothing else on the decode engine: no wait


def test_link_defaults_apply_per_kind_and_transfers_share_the_link():
    """Two equal prompts prefilled in one step start their reads together: sharing the link, each
    takes twice as long as one alone."""
    one = [{"arrival_s": 0.0, "prompt_len": 800, "output_len": 4}]
    link = {"kind": "pcie"}
    assert validate_scenario(pd_scenario(link=link)).cluster.disaggregation.link.bytes_per_s == \
        LINK_DEFAULTS["pcie"][0] * 1e9
    slow = {"kind": "ethernet", "bandwidth_gb_s": 0.5, "latency_s": 0.0}
    alone, _, _ = run(pd_scenario(link=slow, requests=one))
    two = [{"arrival_s": 0.0, "prompt": [{"segment": k, "len": 800}], "output_len": 4} for k in "ab"]
    together = pd_scenario(link=slow, requests=two)
    together["engine"]["front_end_s"] = 0.0      # no API server between: both reach the prefill engine at once
    pair, _, _ = run(together)
    single = alone.transfers[0].done_s - alone.transfers[0].allocated_s
    assert [t.allocated_s for t in pair.transfers] == [pair.transfers[0].allocated_s] * 2
    for t in pair.transfers:
        assert t.done_s - t.allocated_s == pytest.approx(2 * single, rel=1e-9)


def test_ttft_is_prefill_then_transfer_then_the_decode_engines_first_step():
    """The client's first token comes from the decode engine (the proxy streams its answer): after
    the prefill engine's step, the read, and one decode step computing the last prompt token."""
    raw = pd_scenario(link={"kind": "rdma", "bandwidth_gb_s": 2.0},
                      requests=[{"arrival_s": 0.0, "prompt_len": 1500, "output_len": 6}])
    sim, records, df = run(raw)
    steps = records.steps_frame()
    prefill_steps = steps[steps["replica"] == 0]
    decode_steps = steps[steps["replica"] == 1]
    (t,) = sim.transfers
    assert t.prefill_done_s == pytest.approx(prefill_steps["end_s"].max())
    first_decode = decode_steps.iloc[0]
    assert first_decode["start_s"] >= t.done_s
    assert first_decode["prefill_tokens"] == 1                     # only the last prompt token
    row = df.iloc[0]
    assert row["replica"] == 1 and row["status"] == "finished"
    assert row["ttft_s"] == pytest.approx(first_decode["end_s"] - row["arrival_s"])
    assert row["ttft_s"] > t.prefill_done_s + (t.done_s - t.allocated_s)
    assert prefill_steps["prefill_tokens"].sum() == 1500          # the whole prompt on the prefill side


# ----------------------------------------------------------------------------- under load

def test_decode_steps_are_free_of_prefill_and_every_request_is_accounted_for():
    sim, records, df = run(pd_scenario())
    steps = records.steps_frame()
    decode = steps[steps["replica"] == 1]
    # each request's one prefill token on the decode side is its last prompt token
    assert (decode["prefill_tokens"] <= decode["num_seqs"]).all()
    assert decode["prefill_tokens"].sum() == len(df)
    assert steps[steps["replica"] == 0]["prefill_tokens"].sum() == df["prompt_tokens"].sum()
    assert (df["status"] == "finished").all() and len(df) == 60
    assert len(sim.transfers) == 60 and all(t.blocks > 0 for t in sim.transfers)
    for replica in sim.replicas:
        assert replica.kv.num_used_blocks == 0


def test_back_pressure_waits_for_decode_blocks_while_both_sides_hold_the_kv():
    """A decode pool of 100 blocks with 3 x 40-block prompts arriving together: the third waits
    for blocks (the prefill engine keeps its KV meanwhile), and while each read runs the KV is
    held on both sides."""
    prompts = [{"arrival_s": 0.0, "prompt": [{"segment": k, "len": 630}], "output_len": 30} for k in "abc"]
    raw = pd_scenario(decode={"engine": {"num_blocks": 101}}, requests=prompts,
                      link={"kind": "ethernet", "bandwidth_gb_s": 0.2})
    raw["engine"]["max_model_len"] = 1024
    sim, records, df = run(raw)
    assert (df["status"] == "finished").all()
    waits = sorted(t.allocated_s - t.prefill_done_s for t in sim.transfers)
    assert waits[0] == 0 and waits[-1] > 0
    for t in sim.transfers:
        prefill_held, decode_held = t.held_on_both
        assert prefill_held >= t.blocks and decode_held >= t.blocks
    waited = max(sim.transfers, key=lambda t: t.allocated_s - t.prefill_done_s)
    prefill_steps = records.steps_frame()
    prefill_steps = prefill_steps[prefill_steps["replica"] == 0]
    # the prefill engine holds every prompt's blocks until its read is done (40 blocks each)
    assert waited.held_on_both[0] >= 40 and prefill_steps["kv_blocks_used"].max() >= 3 * 40 - 1


def test_a_read_that_times_out_is_recomputed_on_the_decode_engine():
    """VLLM_NIXL_ABORT_REQUEST_TIMEOUT: the prefill engine frees KV nobody read in time; the request
    still finishes (the decode engine prefills it itself)."""
    prompts = [{"arrival_s": 0.0, "prompt": [{"segment": k, "len": 630}], "output_len": 200} for k in "abc"]
    raw = pd_scenario(decode={"engine": {"num_blocks": 101}}, requests=prompts, transfer_timeout_s=0.001)
    raw["engine"]["max_model_len"] = 1024
    sim, records, df = run(raw)
    assert (df["status"] == "finished").all()
    assert sum(t.expired for t in sim.transfers) >= 1
    decode = records.steps_frame()
    assert decode[decode["replica"] == 1]["prefill_tokens"].max() > 1


def test_a_decode_pool_that_stalls_is_a_clean_error_not_a_lost_request():
    """A decode pool of 70 blocks with outputs that outgrow it: a decode request preempts itself and
    waits at the head of the queue for blocks that reads behind it took (kvtwin allocates a read's
    blocks as soon as they fit, not in the waiting pass's order; found by h/audit2). The run
    ended with an AssertionError ('60 of 60 requests never ended'); now the stall is a UserError
    that names the engine and what to change."""
    from sim.errors import UserError

    raw = pd_scenario(decode={"engine": {"num_blocks": 70}})
    raw["engine"]["max_model_len"] = 1024
    raw["workload"]["output_len"] = {"dist": "uniform", "min": 100, "max": 200}
    with pytest.raises(UserError) as e:
        run(raw)
    message = str(e.value)
    assert "decode engine 1 stalled" in message and "engine.num_blocks" in message, message


def test_rejections_carry_the_side_that_refused():
    requests = [{"arrival_s": 0.0, "prompt_len": 100, "output_len": 10},
                {"arrival_s": 0.0, "prompt_len": 5000, "output_len": 10},        # beyond max_model_len
                {"arrival_s": 0.0, "prompt_len": 200, "output_len": 10}]
    result = predict(validate_scenario(pd_scenario(requests=requests)))
    df = result.requests.set_index("id")
    assert df["status"].tolist() == ["finished", "rejected", "finished"]
    assert df.loc[1, "reject_reason"].startswith("prefill engine: prompt of 5000 tokens")
    assert result.summary["requests_finished"] + result.summary["requests_rejected"] == 3
    assert result.summary["pools"]["transfers"]["transfers"] == 2


def test_a_request_only_the_decode_engine_refuses_is_rejected_before_it_takes_blocks():
    """Prompt 4090 + max_tokens 1 fits the prefill engine's max_model_len 4096; prompt + 20 output
    tokens does not fit the decode engine's. The proxy gets the decode engine's refusal: the request
    is rejected with it, and no KV stays allocated (it was refused only after its read, with its
    128 blocks left held: 'decode engine 1 still holds 256 KV blocks after the run'; found by
    h/audit2)."""
    requests = [{"arrival_s": 0.0, "prompt_len": 100, "output_len": 10},
                {"arrival_s": 0.0, "prompt_len": 4090, "output_len": 20}]
    result = predict(validate_scenario(pd_scenario(requests=requests)))
    df = result.requests.set_index("id")
    assert df["status"].tolist() == ["finished", "rejected"]
    assert df.loc[1, "reject_reason"] == ("decode engine: prompt (4090) + max output (20) = 4110 tokens exceeds "
                                          "max_model_len 4096")
    assert result.summary["requests_finished"] + result.summary["requests_rejected"] == 2


def test_summary_has_per_pool_figures_and_runs_are_deterministic():
    a = predict(validate_scenario(pd_scenario()))
    b = predict(validate_scenario(pd_scenario()))
    assert a.requests.equals(b.requests)
    pools = a.summary["pools"]
    assert set(pools) == {"prefill", "decode", "transfers"}
    for side in ("prefill", "decode"):
        assert 0 < pools[side]["utilization"] <= 1 and 0 < pools[side]["kv_usage_peak"] <= 1
    assert pools["transfers"]["transfers"] == 60 and pools["transfers"]["transfer_s"]["mean"] > 0


def test_disaggregation_keeps_decode_steps_short_against_the_same_gpus_colocated():
    """Long prompts at load: co-located engines mix prefill chunks into decode steps (TPOT rises);
    a decode pool only decodes."""
    workload = {"num_requests": 80, "arrival": {"process": "poisson", "rate": 8},
                "prompt_len": 3000, "output_len": 64}
    pd = pd_scenario()
    pd["workload"] = workload
    colocated = {**pd, "cluster": {"replicas": 2}}
    tpot_pd = predict(validate_scenario(pd)).summary["tpot_s"]["p99"]
    tpot_co = predict(validate_scenario(colocated)).summary["tpot_s"]["p99"]
    assert tpot_pd < 0.8 * tpot_co
    assert np.isfinite(tpot_pd)


# ----------------------------------------------------------------------------- plan, engine, from-vllm

def test_plan_finds_the_cheapest_split_that_meets_the_slos():
    """Every split of up to 3 x 3 probed by hand: the search's answer is the cheapest passing one,
    and it probed no split it could rule out (covered by a failed one)."""
    from sim.whatif.plan import SloTarget, Traffic
    from sim.whatif.plan_pd import _probe_split, plan_splits, splits
    from sim.whatif.sweep import PointTask

    raw = pd_scenario(decode={"device": "a100-80g"})
    raw["workload"] = {"num_requests": 120, "arrival": {"process": "poisson", "rate": 40},
                       "prompt_len": {"dist": "uniform", "min": 1500, "max": 2500}, "output_len": 30}
    raw["step_times"] = "datasheet"        # the SLOs below were sized on datasheet step times
    base = PointTask(raw, ".", "test", ())
    slos = (SloTarget("ttft_p99", "ttft_s.p99", 0.6), SloTarget("tpot_p99", "tpot_s.p99", 0.03))
    prices = {"prefill": 0.8, "decode": 1.6}
    plan = plan_splits(base, Traffic.of(base.scenario()), slos, 40, prices, 3, 3, jobs=1, ray=None, quiet=True)
    everything = [_probe_split((base, s, slos)) for s in splits(base.scenario(), prices, 3, 3)]
    passing = [r for r in everything if r["ok"]]
    assert passing and len(passing) < len(everything)          # the case has an answer, and choices that fail
    cheapest = min(passing, key=lambda r: r["cost_per_hour"])
    assert plan.answer["split"] == cheapest["split"]
    assert plan.answer["cost_per_hour"] == pytest.approx(cheapest["prefill"] * 0.8 + cheapest["decode"] * 1.6)
    assert len(plan.rows) + plan.skipped <= len(everything)


def test_plan_cli_writes_the_split_table_and_figure(tmp_path):
    import yaml

    from sim.cli import main

    raw = pd_scenario()
    raw["workload"] = {"num_requests": 80, "arrival": {"process": "poisson", "rate": 10},
                       "prompt_len": 500, "output_len": 20}
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "plan"
    assert main(["plan", str(path), "--target-rate", "10", "--disaggregation", "--max-prefill", "2",
                 "--max-decode", "2", "--slo", "ttft_p99=1", "--cost", "l4=0.5", "--out", str(out), "--quiet"]) == 0
    table = (out / "plan.csv").read_text()
    assert table.startswith("split,prefill,decode,gpus,cost_per_hour,ok") and "1P1D,1,1,2,1.0," in table
    assert (out / "plan.png").stat().st_size > 0 and (out / "plan.html").exists()
    assert not [p for p in out.iterdir() if "tmp" in p.name]                 # no temp files left


@pytest.mark.parametrize("argv, expected", [
    (["--target-rate", "5", "--disaggregation", "--devices", "l4"], "--devices applies to the replica search"),
    (["--disaggregation"], "give --target-rate"),
    (["--target-rate", "5", "--max-decode", "3"], "--max-decode applies to the split search"),
    (["--target-rate", "5", "--disaggregation", "--max-prefill", "0"], "--max-prefill 0"),
])
def test_plan_refuses_flags_that_do_not_apply(tmp_path, argv, expected):
    from sim.whatif.plan import PlanError
    from sim.whatif.plan_cli import plan_main

    path = tmp_path / "pd.yaml"
    path.write_text(__import__("yaml").safe_dump(pd_scenario()))
    with pytest.raises(PlanError, match=expected):
        plan_main([str(path), *argv])


def test_the_engine_refuses_a_disaggregated_scenario():
    pytest.importorskip("torch")
    from engine.replay import EngineUnsupportedError, check_engine_supports

    with pytest.raises(EngineUnsupportedError, match="cluster.disaggregation: the engine replays one engine"):
        check_engine_supports(validate_scenario(pd_scenario()))


@pytest.mark.parametrize("role, expected", [
    ("kv_producer", "the prefill side of a P/D deployment; .* cluster.disaggregation.prefill"),
    ("kv_consumer", "the decode side of a P/D deployment; .* cluster.disaggregation.decode"),
    ("kv_both", "both sends and receives KV"),
])
def test_from_vllm_says_what_a_kv_transfer_config_needs(role, expected):
    """A `vllm serve --kv-transfer-config` line is one engine of one side (its kv_role): the
    translation says so and where its settings go, instead of dropping the flag silently."""
    from sim.vllm.serve_flags import translate

    config = '{"kv_connector":"NixlConnector","kv_role":"%s"}' % role
    t = translate(["vllm", "serve", "tiny", "--kv-transfer-config", config], "cpu")
    (note,) = [n for n in t.notes() if n.startswith("--kv-transfer-config")]
    assert __import__("re").search(expected, note)
    assert "cluster" not in t.raw


def test_conversations_and_a_closed_loop_client_end_every_turn():
    """Follow-up turns are sent when the decode engine finishes the previous one; a closed-loop
    client's slots free at decode finishes; every turn ends finished."""
    raw = pd_scenario(prefill={"replicas": 2}, decode={"replicas": 2})
    raw["cluster"]["router"] = "prefix_aware"
    raw["workload"] = {"num_requests": 30, "max_concurrency": 6, "arrival": {"process": "poisson", "rate": 20},
                       "prompt_len": 300, "output_len": 12,
                       "multi_turn": {"turns": 3, "user_len": 40, "think_time_s": 0.05}}
    result = predict(validate_scenario(raw))
    df = result.requests
    assert (df["status"] == "finished").all() and len(df) == result.summary["requests_total"]
    assert df["conversation"].notna().all() and df["replica"].isin([2, 3]).all()
    # later turns find their conversation's earlier prompt cached on a prefill engine
    assert result.summary["prefix_hit_rate"] > 0


def test_a_sweep_counts_both_pools_gpus_at_their_devices_prices():
    from sim.core.catalog import get_device
    from sim.whatif.sweep import gpu_cost

    s = validate_scenario(pd_scenario(prefill={"replicas": 3, "tp": 2}, decode={"replicas": 2, "device": "h100-sxm"}))
    cost = gpu_cost(s)
    assert (cost["gpus"], cost["prefill_gpus"], cost["decode_gpus"]) == (8, 6, 2)
    assert cost["cost_per_hour"] == pytest.approx(6 * get_device("l4").cost_per_hour
                                                  + 2 * get_device("h100-sxm").cost_per_hour)


def test_kv_offload_with_disaggregation_is_refused():
    """One vLLM engine runs one KV connector (kv_transfer_config names a single kv_connector, vllm/config/
    kv_transfer.py, 0.19): a CPU-offload tier and a P/D link together are refused, naming both fields."""
    raw = pd_scenario()
    raw["engine"]["kv_offload"] = {"size_gib": 8}
    with pytest.raises(ScenarioError, match=r"engine\.kv_offload.*cluster\.disaggregation"):
        validate_scenario(raw)
