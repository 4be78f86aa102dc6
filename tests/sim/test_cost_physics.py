"""Cost-model physics beyond the single-GPU roofline: collectives over PCIe, data-parallel MoE
engines in lockstep, expert load imbalance, weight-only quantized GEMMs (docs/cost_model.md)."""
from __future__ import annotations

import pytest

from sim.core.catalog import DeviceSpec, get_device, get_model
from sim.costmodel import CostModel

LLAMA = get_model("llama-3.1-8b")


def allreduce_per_layer(device: DeviceSpec, tp: int, tokens: int, model=LLAMA) -> float:
    """Seconds a layer's two all-reduces add to a decode step of `tokens` rows: the step against
    the same step on a free link."""
    free = device.model_copy(update={"interconnect": None, "link_gbps": 1e15, "link_latency_us": 0.0})
    step = (tokens, tokens, 0, tokens * 500, 0, 0, tokens * 32)
    paid = CostModel(model, device, tp=tp).price(*step)[1]
    return (paid - CostModel(model, free, tp=tp).price(*step)[1]) / model.num_layers


def nccl_ring(ranks: int, nbytes: float, bus_bytes_s: float, hop_scale: float = 1.0) -> float:
    """NCCL's own estimate of a ring all-reduce on PCIe (NVIDIA/nccl src/graph/tuning.cc): base +
    2 (n - 1) steps x per-step latency + bytes over the algorithm bandwidth, the faster of LL
    (6.6 + 1.0 us per step, a quarter of the bus bandwidth) and Simple (8.4 + 5.7 us)."""
    steps = 2 * (ranks - 1)
    algorithm_bw = bus_bytes_s * ranks / steps
    ll = (6.6 + steps * 1.0 * hop_scale) * 1e-6 + nbytes / (algorithm_bw / 4)
    simple = (8.4 + steps * 5.7 * hop_scale) * 1e-6 + nbytes / algorithm_bw
    return min(ll, simple)


def test_pcie_cards_declare_their_link_and_nvlink_parts_keep_theirs():
    assert get_device("l40s").interconnect == "pcie" and get_device("l40s").link_gbps == 32.0     # Gen4 x16
    assert get_device("rtx-pro-6000-server").link_gbps == 64.0                                   # Gen5 x16
    assert get_device("t4").link_gbps == 16.0                                                   # Gen3 x16
    assert get_device("rtx-4090").peer_to_peer is False
    assert get_device("h100-sxm").interconnect == "nvlink" and get_device("h100-sxm").link_gbps == 450.0
    card = dict(name="card", memory_mib=24000, bf16_tflops=100, hbm_gbps=900, interconnect="pcie")
    assert DeviceSpec(**card, pcie_gen=5, pcie_lanes=8).link_gbps == 32.0
    with pytest.raises(ValueError, match="needs pcie_gen"):
        DeviceSpec(**card)
    with pytest.raises(ValueError, match="disagrees with PCIe Gen4 x16"):
        DeviceSpec(**card, pcie_gen=4, link_gbps=50.0)
    with pytest.raises(ValueError, match="link_latency_us is for nvlink"):
        DeviceSpec(**card, pcie_gen=4, link_latency_us=5.0)


def test_pcie_tp4_all_reduce_is_nccl_ring_model():
    """Four L40S (no NVLink, PCIe Gen4 x16, peer to peer): vLLM's custom all-reduce is off for
    more than two PCIe-only GPUs (vllm/distributed/device_communicators/custom_all_reduce.py,
    vLLM 0.19: 'not supported on more than two PCIe-only GPUs'), so NCCL's ring prices each
    all-reduce, at NCCL's PCIe bandwidth of 24 GB/s (src/graph/topo.cc: lanes x speed / 80)."""
    l40s = get_device("l40s")
    for tokens in (1, 32, 1024):
        nbytes = tokens * LLAMA.hidden_size * 2
        assert allreduce_per_layer(l40s, 4, tokens) == pytest.approx(2 * nccl_ring(4, nbytes, 24e9), rel=1e-9)
    # small messages go LL (latency), large ones Simple (bandwidth)
    one_row, algorithm_bw = LLAMA.hidden_size * 2, 24e9 * 4 / 6
    assert allreduce_per_layer(l40s, 4, 1) == pytest.approx(2 * ((6.6 + 6 * 1.0) * 1e-6 + one_row / (algorithm_bw / 4)))
    assert allreduce_per_layer(l40s, 4, 1024) == pytest.approx(2 * ((8.4 + 6 * 5.7) * 1e-6
                                                                    + 1024 * one_row / algorithm_bw))


def test_pcie_tp2_with_peer_to_peer_uses_vllms_custom_all_reduce_below_8_mib():
    """Two L40S: vLLM's custom all-reduce (custom_all_reduce.py, vLLM 0.19: world size 2 needs no
    NVLink, only P2P; `should_custom_ar` takes messages under max_size, 8 MiB) for decode
    steps: LL's handshake latency at the full bandwidth; a 2048-token prefill (16 MiB per
    all-reduce) goes to NCCL."""
    l40s = get_device("l40s")
    bus = 24e9
    decode_bytes = 32 * LLAMA.hidden_size * 2
    assert allreduce_per_layer(l40s, 2, 32) == pytest.approx(2 * ((6.6 + 2 * 1.0) * 1e-6 + decode_bytes / bus),
                                                            rel=1e-9)
    prefill_bytes = 2048 * LLAMA.hidden_size * 2
    assert allreduce_per_layer(l40s, 2, 2048) == pytest.approx(2 * nccl_ring(2, prefill_bytes, bus), rel=1e-9)


def test_geforce_cards_without_peer_to_peer_stage_collectives_in_host_memory():
    """RTX 4090s: the driver forbids P2P, so vLLM's custom all-reduce is off (its `_can_p2p` check,
    custom_all_reduce.py, vLLM 0.19) and NCCL stages each ring step through host memory: half the
    speed of a direct step (host_staging_eff), bandwidth and per-step latency alike."""
    geforce = get_device("rtx-4090")
    same_card_with_p2p = geforce.model_copy(update={"peer_to_peer": True})
    for tokens in (1, 32, 512):
        nbytes = tokens * LLAMA.hidden_size * 2
        staged = allreduce_per_layer(geforce, 2, tokens)
        assert staged == pytest.approx(2 * nccl_ring(2, nbytes, 24e9 * 0.5, hop_scale=2.0), rel=1e-9)
        assert staged > allreduce_per_layer(same_card_with_p2p, 2, tokens)


def test_pcie_collective_coefficients_are_the_fits_handles():
    """pcie_latency_scale stretches the latencies, link_eff the bandwidth: what a fit learns."""
    from dataclasses import replace

    from sim.costmodel import DeviceProfile

    l40s, base = get_device("l40s"), CostModel(LLAMA, get_device("l40s"), tp=4)
    slow = DeviceProfile(replace(base.coefficients, pcie_latency_scale=2.0, link_eff=0.5))
    tuned = CostModel(LLAMA, l40s, tp=4, profile=slow)
    one = base._tp_allreduce(min)(1)
    assert tuned._tp_allreduce(min)(1) == pytest.approx(2 * one, rel=0.02)         # latency-bound
    big = 8192
    assert tuned._tp_allreduce(min)(big) == pytest.approx(2 * base._tp_allreduce(min)(big), rel=0.02)


def test_an_nvlink_all_reduce_latency_is_its_own_term():
    """allreduce_latency_s prices an NVLink all-reduce's fixed latency apart from link_eff, which then
    prices its bandwidth only: a one-row decode step's all-reduces (latency-bound) move with it, a
    large batch's bytes do not. At its default (0) the latency is the device's over link_eff, as before."""
    from dataclasses import replace

    from sim.costmodel import DeviceProfile

    a100, model = get_device("a100-40g"), get_model("llama-3.1-70b")
    free = a100.model_copy(update={"interconnect": None, "link_gbps": 1e15, "link_latency_us": 0.0})

    def allreduce(tokens: int, **coefficients) -> float:
        """Seconds one layer's two all-reduces add to a decode step of `tokens` rows."""
        step = (tokens, tokens, 0, tokens * 500, 0, 0, tokens * 32)
        base = CostModel(model, a100, tp=8)
        paid = CostModel(model, a100, tp=8, profile=DeviceProfile(replace(base.coefficients, **coefficients)))
        return (paid.price(*step)[1] - CostModel(model, free, tp=8).price(*step)[1]) / model.num_layers

    bytes_s = 0.25 * 300e9 / (2 * 7 / 8)           # link_eff x NVLink, over the ring's traffic per byte
    one_efficiency = allreduce(1, link_eff=0.25)
    assert one_efficiency == pytest.approx(2 * (10e-6 / 0.25 + model.hidden_size * 2 / bytes_s), rel=1e-6)
    own_latency = allreduce(1, link_eff=0.25, allreduce_latency_s=5e-6)
    assert own_latency == pytest.approx(2 * (5e-6 + model.hidden_size * 2 / bytes_s), rel=1e-6)
    big = 1024                                     # the bandwidth share: the same under either latency
    assert allreduce(big, link_eff=0.25, allreduce_latency_s=5e-6) - own_latency == pytest.approx(
        allreduce(big, link_eff=0.25) - one_efficiency, rel=1e-9)
    # a PCIe card keeps NCCL's table (pcie_latency_scale): the term does not reach it
    l40s = get_device("l40s")
    plain = CostModel(LLAMA, l40s, tp=4)
    tuned = CostModel(LLAMA, l40s, tp=4, profile=DeviceProfile(replace(plain.coefficients, allreduce_latency_s=5e-6)))
    assert tuned.price(1, 1, 0, 500, 0, 0, 32) == plain.price(1, 1, 0, 500, 0, 0, 32)


def test_vllms_custom_all_reduce_on_nvlink_is_priced_apart_from_nccls_ring():
    """custom_allreduce_eff prices the all-reduces vLLM's custom kernel runs on NVLink: messages under
    its max_size of 8 MiB on 2, 4, 6 or 8 GPUs (vllm/distributed/device_communicators/custom_all_reduce.py,
    0.7.3 and 0.19: `should_custom_ar`, `_SUPPORTED_WORLD_SIZES`; cuda_communicator.py `all_reduce` tries
    it before pynccl); larger ones stay NCCL's ring at link_eff. Llama-3.1-70B's rows are 16 KiB, so a
    step of 511 rows is under the size, one of 512 at it. At its default (0) every message is at link_eff."""
    from dataclasses import replace

    from sim.costmodel import CUSTOM_ALLREDUCE_MAX_BYTES, DeviceProfile

    a100, model = get_device("a100-40g"), get_model("llama-3.1-70b")
    free = a100.model_copy(update={"interconnect": None, "link_gbps": 1e15, "link_latency_us": 0.0})
    row_bytes = model.hidden_size * 2
    below = CUSTOM_ALLREDUCE_MAX_BYTES // row_bytes - 1
    assert below == 511

    def allreduce(tokens: int, **coefficients) -> float:
        """Seconds one layer's two all-reduces add to a decode step of `tokens` rows."""
        step = (tokens, tokens, 0, tokens * 500, 0, 0, tokens * 32)
        base = CostModel(model, a100, tp=8)
        paid = CostModel(model, a100, tp=8, profile=DeviceProfile(replace(base.coefficients, **coefficients)))
        return (paid.price(*step)[1] - CostModel(model, free, tp=8).price(*step)[1]) / model.num_layers

    def expected(tokens: int, efficiency: float) -> float:
        return 2 * (10e-6 / 0.5 + tokens * row_bytes * (2 * 7 / 8) / (efficiency * 300e9))

    for tokens in (1, below):
        assert allreduce(tokens, link_eff=0.5, custom_allreduce_eff=0.1) == pytest.approx(expected(tokens, 0.1), rel=1e-6)
        assert allreduce(tokens, link_eff=0.5) == pytest.approx(expected(tokens, 0.5), rel=1e-6)
    for tokens in (below + 1, 4096):
        assert allreduce(tokens, link_eff=0.5, custom_allreduce_eff=0.1) == pytest.approx(expected(tokens, 0.5), rel=1e-6)
    # PCIe keeps its own custom / NCCL choice (tp 2 with peer-to-peer only): the term does not reach it
    l40s = get_device("l40s")
    plain = CostModel(LLAMA, l40s, tp=4)
    tuned = CostModel(LLAMA, l40s, tp=4, profile=DeviceProfile(replace(plain.coefficients, custom_allreduce_eff=0.1)))
    assert tuned.price(1, 1, 0, 500, 0, 0, 32) == plain.price(1, 1, 0, 500, 0, 0, 32)


# ----------------------------------------------------------------------------- data-parallel MoE

def moe_dp(dp: int = 2, model: str = "qwen3-30b-a3b", **workload):
    from sim.scenario import validate_scenario

    return validate_scenario({
        "model": model, "device": "h100-sxm", "parallelism": {"dp": dp},
        "engine": {"max_model_len": 4096, "prefix_caching": False},
        "workload": {"num_requests": 40, "arrival": {"process": "poisson", "rate": 8},
                     "prompt_len": {"dist": "uniform", "min": 64, "max": 512},
                     "output_len": {"dist": "uniform", "min": 8, "max": 96}, **workload}})


def test_lockstep_pads_every_rank_to_the_largest_batch_and_idle_ranks_run_a_dummy():
    """vLLM pads each dp rank's batch to the most tokens of any rank when CUDA graphs are on
    (vllm/v1/worker/dp_utils.py, vLLM 0.19: `_post_process_dp_padding`), and a rank with nothing
    scheduled runs a one-token dummy batch (gpu_worker.execute_dummy_batch), padded alike."""
    from sim.core.scheduler import Batch

    cost = CostModel(get_model("qwen3-30b-a3b"), get_device("h100-sxm"), dp=2)

    def decode_batch(rows: int) -> Batch:
        batch = Batch(0)
        batch.decodes, batch.num_decode = [None] * rows, rows
        batch.decode_ctx, batch.blocks_read = rows * 800, rows * 50
        return batch
    big, small = decode_batch(64), decode_batch(2)
    (big_host, big_device), (small_host, small_device) = cost.lockstep_times([big, small])
    assert (big_host, big_device) == cost.step_time(big)          # the largest batch: its own price
    assert small_host == cost.step_time(small)[0]                 # host work is each rank's own
    assert small_device > cost.step_time(small)[1]                # its GEMMs and MoE at 64 tokens
    # the small rank's own attention, at the big one's GEMM size
    own_attention = cost.price(2, 2, 0, 2 * 800, 0, 0, 2 * 50)[1] - cost.price(2, 2, 0, 0, 0, 0, 0)[1]
    padded_no_attention = cost._sizes(2, 2, 0, 0, 0, 64)(0, 0)[1]
    assert small_device == pytest.approx(padded_no_attention + own_attention, rel=1e-12)
    (_, dummy_device), _ = cost.lockstep_times([None, big])
    assert 0 < dummy_device < big_device


def test_dp_moe_ranks_step_in_lockstep():
    """Every step of a data-parallel MoE engine starts and ends on all its ranks at once
    (vLLM 0.19, vllm/v1/engine/core.py DPEngineCoreProc.run_busy_loop: each rank runs its step or
    `execute_dummy_batch()` while the engines are running, and the MoE layers' collectives join
    them), lasting as long as the slowest rank's part."""
    from sim.predict import predict

    steps = predict(moe_dp()).records.steps_frame(full=True)
    ranks = [steps[steps["replica"] == r] for r in (0, 1)]
    spans = [set(zip(s["start_s"], s["end_s"])) for s in ranks]
    ends = sorted(set().union(*spans))
    assert len(spans[0]) > 20 and len(spans[1]) > 20
    # one clock: any two steps, whichever rank, are the same step or do not overlap
    for (start, end), (next_start, _) in zip(ends, ends[1:]):
        assert next_start >= end
    both = spans[0] & spans[1]
    assert len(both) > 10                                  # steps both ranks had work in
    # a step both ranks ran lasts as long as the slower part: each rank's host + device is the step
    for rank in ranks:
        shared = rank[[span in both for span in zip(rank["start_s"], rank["end_s"])]]
        assert ((shared["host_s"] + shared["device_s"]) - (shared["end_s"] - shared["start_s"])).abs().max() < 1e-12


def test_an_engine_that_ran_dry_steps_dummies_until_the_32nd_step_check():
    """vLLM's dp ranks all-reduce 'any unfinished requests?' only every 32nd step of a wave
    (DPEngineCoreProc._has_global_unfinished_reqs, vllm/v1/engine/core.py, vLLM 0.19: `if
    self.step_counter % 32 != 0: return True`), stepping dummy batches meanwhile. So a request
    that arrives just after the engine ran dry waits for the dummy step in flight, where a
    lone engine would start it at once."""
    from sim.simulator import simulate
    from sim.workload import build_requests

    scenario = moe_dp(num_requests=3, output_len={"dist": "fixed", "value": 4})

    def steps_with_third_at(when: float):
        requests = build_requests(scenario)
        for req, arrival in zip(requests, (0.0, 0.0, when)):
            req.arrival = arrival
        return simulate(scenario, requests)[0].steps_frame(full=True)
    first = steps_with_third_at(1000.0)
    dry_at = first[first["start_s"] < 500]["end_s"].max()
    steps = steps_with_third_at(dry_at + 1e-6)
    third_starts = steps[steps["start_s"] > dry_at]["start_s"].min()
    dummy = max(h + d for h, d in CostModel.for_scenario(scenario).lockstep_times([None, None]))
    assert dry_at + 1e-6 < third_starts <= dry_at + dummy * (1 + 1e-9)   # it waited for the dummy step in flight


def test_dense_models_with_dp_run_independent_engines():
    """DPEngineCoreProc serves MoE models only (vllm/v1/engine/core.py, vLLM 0.19, its assertion
    'DPEngineCoreProc should only be used for MoE models'): dense dp ranks never wait for each
    other."""
    from sim.predict import predict

    steps = predict(moe_dp(model="qwen2.5-0.5b")).records.steps_frame(full=True)
    spans = [set(zip(s["start_s"], s["end_s"])) for _, s in steps.groupby("replica")]
    ordered = sorted(spans[0] | spans[1])
    assert any(nxt[0] < end for (_, end), nxt in zip(ordered, ordered[1:]))   # overlapping, unaligned


def test_dp_moe_exchange_over_pcie_is_nccls_all_gather_and_reduce_scatter():
    """vLLM 0.19's default all2all backend, allgather_reducescatter (vllm/config/parallel.py;
    AgRsAll2AllManager in vllm/distributed/device_communicators/all2all.py): each MoE layer
    all-gathers the dp ranks' tokens and reduce-scatters the outputs; on PCIe cards each is an
    NCCL ring of n - 1 steps (src/graph/tuning.cc), LL at a third of the bus bandwidth or Simple."""
    model, card = get_model("qwen3-30b-a3b"), get_device("rtx-pro-6000-server")
    free = card.model_copy(update={"interconnect": None, "link_gbps": 1e15, "link_latency_us": 0.0})
    bus = 64e9 * 0.75
    for tokens in (1, 64, 2048):
        share = tokens * model.hidden_size * 2                 # one rank's hidden states
        ll = (6.6 + 1 * 1.0) * 1e-6 + share / (bus / 3)
        simple = (8.4 + 1 * 5.7) * 1e-6 + share / bus
        paid = CostModel(model, card, dp=2, ep=2).moe_layer_time(tokens)
        assert paid - CostModel(model, free, dp=2, ep=2).moe_layer_time(tokens) == pytest.approx(
            2 * min(ll, simple), rel=1e-6)


# ----------------------------------------------------------------------------- expert imbalance

def monte_carlo_busiest_gpu(experts: int, top_k: int, ep: int, tokens: int, trials: int = 4000):
    """Mean over routings of (busiest GPU's routed pairs, busiest GPU's distinct experts), each over
    its mean: uniform top-k routing of `tokens` tokens, experts split into ep equal groups."""
    import numpy as np

    rng = np.random.default_rng(0)
    picks = np.argsort(rng.random((trials, tokens, experts)), axis=2)[:, :, :top_k]   # k distinct each
    group = picks // (experts // ep)
    pairs = np.stack([(group == g).sum(axis=(1, 2)) for g in range(ep)], axis=1)
    hit = np.zeros((trials, experts), dtype=bool)
    np.put_along_axis(hit, picks.reshape(trials, -1), True, axis=1)
    touched = hit.reshape(trials, ep, -1).sum(axis=2)
    return (pairs.max(axis=1).mean() / pairs.mean(), touched.max(axis=1).mean() / touched.mean())


@pytest.mark.parametrize("ep, tokens", [(4, 4), (4, 64), (8, 16)])
def test_expert_parallel_imbalance_follows_the_routing_statistics(ep, tokens):
    """With whole experts per GPU (expert parallelism) the MoE layer waits for the busiest GPU:
    the model's factors on the routed pairs (compute) and on the experts read (bandwidth) match a
    simulation of uniform top-k routing (128 experts, 8 per token: Qwen3-30B-A3B) within 5 %."""
    import math

    from sim.costmodel import expected_experts_touched, expert_imbalance

    experts, top_k = 128, 8
    noise, skew, z = expert_imbalance(experts, top_k, ep, 0.0)
    compute_factor = min(1 + z * math.sqrt(noise / tokens + skew), ep)
    hit = expected_experts_touched(experts, top_k, tokens) / experts
    read_factor = min(1 + z * math.sqrt((1 - hit) * ep / (experts * hit)), 1 / hit)
    pairs, touched = monte_carlo_busiest_gpu(experts, top_k, ep, tokens)
    assert compute_factor == pytest.approx(pairs, rel=0.05)
    assert read_factor == pytest.approx(touched, rel=0.05)


def test_imbalance_slows_expert_parallel_moe_layers_only():
    """Experts sliced over the GPUs (vLLM without --enable-expert-parallel: every GPU a slice of
    every expert) are balanced by construction; whole experts per GPU are not, most visibly
    where few tokens touch few experts, and more so with skewed routing (expert_load_cv)."""
    from dataclasses import replace

    from sim.costmodel import DeviceProfile

    model, h100 = get_model("qwen3-30b-a3b"), get_device("h100-sxm")
    sliced, whole = CostModel(model, h100, dp=4), CostModel(model, h100, dp=4, ep=4)
    assert whole.moe_layer_time(1) > 1.1 * sliced.moe_layer_time(1)           # decode: the reads
    assert whole.moe_layer_time(4096) > sliced.moe_layer_time(4096)            # prefill: the GEMMs
    assert CostModel(model, h100, tp=4).moe_layer_time(1) == CostModel(model, h100, tp=4, ep=1).moe_layer_time(1)
    skewed = DeviceProfile(replace(whole.coefficients, expert_load_cv=0.5))
    assert CostModel(model, h100, dp=4, ep=4, profile=skewed).moe_layer_time(4096) > whole.moe_layer_time(4096)


def test_fused_moe_serial_share_adds_part_of_the_smaller_expert_time():
    """vLLM 0.7.3's Triton fused MoE (vllm/model_executor/layers/fused_moe/fused_moe.py,
    `moe_align_block_size`, `invoke_fused_moe_kernel`) pads each expert's routed rows to a multiple
    of BLOCK_SIZE_M and runs one program per BLOCK_SIZE_M x BLOCK_SIZE_N tile, whose K loop streams
    that expert's weight slice (configs/E=8,N=1792,device_name=NVIDIA_A100-SXM4-40GB.json and
    ..._H100_80GB_HBM3.json, Mixtral-8x7B at tp 8: BLOCK_SIZE_M 16-128 up to M = 4096). Even padded
    to 128 rows per expert, Mixtral's GEMMs stay below the weight reads on A100 40GB and H100, so the
    roofline's maximum is the reads; `expert_serial_share` adds that share of the smaller time (the
    compute the kernel does not hide behind its loads), which grows with the batch."""
    from dataclasses import replace

    from sim.costmodel import DeviceProfile, gemm_peak_flops

    mixtral = get_model("mixtral-8x7b")
    for device in (get_device("a100-40g"), get_device("h100-sxm")):
        plain = CostModel(mixtral, device, tp=8)
        c = plain.coefficients
        assert c.expert_serial_share == 0.0                      # the default: the roofline's maximum

        def with_share(share: float) -> CostModel:
            return CostModel(mixtral, device, tp=8, profile=DeviceProfile(replace(c, expert_serial_share=share)))
        full, half = with_share(1.0), with_share(0.5)
        pair_s = 6 * mixtral.hidden_size * mixtral.moe_intermediate_size / 8 / (
            gemm_peak_flops(device, mixtral, "experts") * c.flops_eff)
        padded_tokens = 128 * mixtral.num_experts // mixtral.num_experts_per_tok   # 128 rows per expert
        assert padded_tokens * mixtral.num_experts_per_tok * pair_s < plain.moe_layer_time(padded_tokens)
        for tokens in (1, 16, 256):
            compute = tokens * mixtral.num_experts_per_tok * pair_s
            added = full.moe_layer_time(tokens) - plain.moe_layer_time(tokens)
            assert added == pytest.approx(compute, rel=1e-9)       # the sum of compute and reads
            assert half.moe_layer_time(tokens) - plain.moe_layer_time(tokens) == pytest.approx(added / 2)
        # a decode step's device time: the layers' share of it, and more at a larger batch
        step = lambda cost, n: cost.price(n, n, 0, n * 300, 0, 0, n * 20)[1]   # noqa: E731
        assert step(full, 256) - step(plain, 256) == pytest.approx(
            mixtral.num_layers * 256 * mixtral.num_experts_per_tok * pair_s, rel=1e-9)
        assert step(full, 256) - step(plain, 256) > 100 * (step(full, 1) - step(plain, 1))
    dense = get_model("llama-3.1-8b")                             # a dense model has no expert term
    serial = DeviceProfile(replace(CostModel(dense, get_device("h100-sxm")).coefficients, expert_serial_share=1.0))
    assert (CostModel(dense, get_device("h100-sxm"), profile=serial).price(8, 8, 0, 800, 0, 0, 64)
            == CostModel(dense, get_device("h100-sxm")).price(8, 8, 0, 800, 0, 0, 64))


# ----------------------------------------------------------------------------- weight-only GEMMs

def quantized_llama(method: str = "awq"):
    from sim.scenario import validate_scenario

    return validate_scenario({"model": {"base": "llama-3.1-8b", "quantization": {"method": method}},
                              "device": "h100-sxm"}).model


def prefill_device_s(cost: CostModel, tokens: int) -> float:
    """Device seconds of one prefill chunk of `tokens` new tokens (no cached context)."""
    return cost.price(1, 0, tokens, 0, 0, 0, 0)[1]


def test_weight_only_gemms_dequantize_once_per_64_row_tile():
    """AWQ int4 Llama-3.1-8B on an H100: Marlin (vLLM csrc/quantization/gptq_marlin/gptq_marlin.cu,
    max_thread_m_blocks = 4 blocks of 16 rows) runs at most 64 batch rows per weight tile and runs
    a larger batch as such problems side by side, each dequantizing the weights again; the tensor
    cores run at the 16-bit rate. So the dequantization steps up at each 64th row, and a batch
    of whole tiles runs at 1 / (1 + dequant_overhead) = 0.8 x the 16-bit rate."""
    from dataclasses import replace

    from sim.costmodel import DeviceProfile

    model, h100 = quantized_llama(), get_device("h100-sxm")
    cost = CostModel(model, h100)
    free = CostModel(model, h100, profile=DeviceProfile(replace(cost.coefficients, dequant_overhead=0.0)))
    h, q, kv, inter = 4096, 4096, 1024, 14336
    weights = h * (q + 2 * kv) + q * h + 3 * h * inter           # per layer
    tile = 0.25 * weights * 2 * 64 / (989e12 * 0.55)               # one tile's dequantization
    for tokens, tiles in ((4096, 64), (4097, 65), (8192, 128)):
        added = (prefill_device_s(cost, tokens) - prefill_device_s(free, tokens)) / model.num_layers
        assert added == pytest.approx(tiles * tile, rel=1e-9)
    mma = 4096 * 2 * weights / (989e12 * 0.55)
    assert mma / (mma + 64 * tile) == pytest.approx(0.8)


def test_weight_only_small_batches_stay_bound_by_the_quantized_bytes():
    """A decode step of a few rows streams the 4-bit weights (a quarter of the 16-bit bytes, plus
    scales) and its one tile's dequantization hides under that stream: the dequantization cost
    does not show, and the step is ~3.5x quicker on its linear layers than bf16."""
    from dataclasses import replace

    from sim.costmodel import DeviceProfile

    model, h100 = quantized_llama(), get_device("h100-sxm")
    cost = CostModel(model, h100)
    free = CostModel(model, h100, profile=DeviceProfile(replace(cost.coefficients, dequant_overhead=0.0)))
    for rows in (1, 8, 32):
        step = (rows, rows, 0, rows * 1000, 0, 0, rows * 63)
        assert cost.price(*step) == free.price(*step)
    assert cost._linear_weight_s < 0.3 * CostModel(LLAMA, h100)._linear_weight_s


def test_w8a8_on_fp8_tensor_cores_has_no_dequantization():
    """fp8 W8A8 on an H100 runs on the fp8 tensor cores (no dequantization term); the same
    checkpoint on an A100 (no fp8 tensor cores) runs weight-only, as vLLM's fp8 Marlin does."""
    fp8 = quantized_llama("fp8")
    assert CostModel(fp8, get_device("h100-sxm"))._dequant_tile_s == 0.0
    assert CostModel(fp8, get_device("a100-80g"))._dequant_tile_s > 0.0
    assert CostModel(LLAMA, get_device("a100-80g"))._dequant_tile_s == 0.0
