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
