"""Prefill/decode disaggregation: the scenario section and what follows from it (no simulation here).

`cluster.disaggregation` describes vLLM's P/D deployment: a proxy in front of a pool of prefill
engines (`--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'`)
and a pool of decode engines (`kv_role: kv_consumer`), the KV cache read over a link between
them. Each pool is the scenario's engine with a patch (its device, tp, max_num_seqs, ...);
sim/disagg.py runs it. Off (None) by default: a scenario without it predicts as before.

Link defaults are per GPU and per direction (each tensor-parallel rank reads its own shard):
  nvlink    450 GB/s  H100 SXM NVLink 4, 900 GB/s bidirectional per GPU
                      (https://www.nvidia.com/en-us/data-center/h100/)
  rdma      50 GB/s   one 400 Gb/s ConnectX-7 NIC per GPU, as DGX H100 has
                      (https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html)
  pcie      64 GB/s   PCIe 5.0 x16, 32 GT/s x 16 lanes per direction (PCI-SIG)
  ethernet  12.5 GB/s a 100 GbE NIC (100 Gb/s)
The latencies (a transfer's fixed cost: NIXL's read request and completion notification, not
the wire alone) are kvtwin assumptions, not measurements: 10 us nvlink, 25 us rdma and pcie,
100 us ethernet (TCP); set `link.latency_s` from a measurement where you have one.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from sim.core.catalog import DeviceSpec, StrictModel
from sim.core.memory import pool_block_bytes

LINK_DEFAULTS = {           # kind -> (GB/s per GPU and direction, latency s); see the module docstring
    "nvlink": (450.0, 10e-6),
    "rdma": (50.0, 25e-6),
    "pcie": (64.0, 25e-6),
    "ethernet": (12.5, 100e-6),
}
# vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default (vllm/envs.py, 0.19): a prefill engine frees the
# blocks of a finished prefill that no decode engine read within this many seconds.
NIXL_ABORT_REQUEST_TIMEOUT_S = 480.0
# Engine settings both sides must share: the proxy sends one request to both, and NIXL reads block
# for block (same layout: NixlConnector's compatibility hash covers the cache dtype).
SHARED_ENGINE_FIELDS = ("block_size", "kv_cache_dtype", "max_model_len", "batching", "allocation",
                        "vllm_version", "vllm_engine")
SIDES = ("prefill", "decode")


class KVLink(StrictModel):
    """The link a decode engine reads a prefill engine's KV cache over (NIXL)."""

    kind: Literal["nvlink", "rdma", "pcie", "ethernet"] = Field(
        default="rdma", description="nvlink | rdma | pcie | ethernet: sets the defaults below")
    bandwidth_gb_s: Optional[float] = Field(
        default=None, gt=0, le=100_000,
        description="GB/s per GPU and direction; unset: the kind's default (nvlink 450, rdma 50, pcie 64, "
                    "ethernet 12.5); transfers into one decode engine share it")
    latency_s: Optional[float] = Field(
        default=None, ge=0, le=10,
        description="fixed seconds per transfer; unset: the kind's assumed default (10 us nvlink, 25 us rdma "
                    "and pcie, 100 us ethernet)")

    @property
    def bytes_per_s(self) -> float:
        return (self.bandwidth_gb_s or LINK_DEFAULTS[self.kind][0]) * 1e9

    @property
    def latency(self) -> float:
        return LINK_DEFAULTS[self.kind][1] if self.latency_s is None else self.latency_s


class Pool(StrictModel):
    """One side's engines: the scenario's engine with this pool's changes."""

    replicas: int = Field(default=1, ge=1, le=1024, description="engines in this pool")
    device: Optional[DeviceSpec] = Field(
        default=None, description="a catalog name or device mapping; unset: the scenario's device")
    tp: Optional[int] = Field(default=None, ge=1, le=1024,
                              description="tensor-parallel degree of each engine; unset: parallelism.tp")
    engine: dict[str, Any] = Field(
        default_factory=dict, max_length=64,
        description="engine fields that differ on this side (max_num_seqs, max_num_batched_tokens, "
                    "gpu_memory_utilization, ...); block_size, kv_cache_dtype, max_model_len, batching, "
                    "allocation, vllm_version and vllm_engine must match the scenario's")

    @model_validator(mode="after")
    def _shared_fields(self) -> "Pool":
        shared = [k for k in self.engine if k in SHARED_ENGINE_FIELDS]
        if shared:
            raise ValueError(f"engine.{shared[0]} cannot differ between the prefill and decode pools (both "
                             f"serve the same requests and NIXL reads the cache block for block); set it in "
                             f"the scenario's engine section")
        return self


class Disaggregation(StrictModel):
    """vLLM's prefill/decode disaggregation (NixlConnector, a proxy in front)."""

    prefill: Pool = Field(description="the kv_producer engines: each request's prompt, then its first token")
    decode: Pool = Field(description="the kv_consumer engines: read the prompt's KV, then decode")
    link: KVLink = Field(default_factory=KVLink, description="the KV link between the pools")
    transfer_timeout_s: float = Field(
        default=NIXL_ABORT_REQUEST_TIMEOUT_S, gt=0, le=86_400,
        description="a prefill engine frees KV no decode engine read within this many seconds "
                    "(VLLM_NIXL_ABORT_REQUEST_TIMEOUT); the decode engine then recomputes the prompt")

    def pool(self, side: str) -> Pool:
        return self.prefill if side == "prefill" else self.decode


def block_bytes_per_gpu(scenario, side: str) -> int:
    """Bytes of one KV block on one GPU of a `side` engine (its tp shard of every layer)."""
    tp = scenario.cluster.disaggregation.pool(side).tp or scenario.parallelism.tp
    return pool_block_bytes(scenario.model, scenario.engine.block_size, tp, scenario.engine.kv_cache_dtype)


def transfer_shard_bytes(scenario, blocks: int) -> int:
    """The bytes the busiest GPU link carries to move `blocks` KV blocks: every tensor-parallel rank
    reads (decode) or serves (prefill) its own shard in parallel, so the side whose per-GPU shard is
    larger (the smaller tp) bounds the transfer."""
    return blocks * max(block_bytes_per_gpu(scenario, side) for side in SIDES)


def pool_gpus(scenario) -> dict[str, int]:
    """GPUs per pool (replicas x tp)."""
    d = scenario.cluster.disaggregation
    return {side: d.pool(side).replicas * (d.pool(side).tp or scenario.parallelism.tp) for side in SIDES}


def pool_cost(scenario, price: Optional[float] = None) -> dict[str, Any]:
    """GPUs of both pools and their cost per hour: each pool's device at its catalog price, or every
    GPU at `price`; None when a device has no price."""
    d, gpus = scenario.cluster.disaggregation, pool_gpus(scenario)
    prices = {side: price if price is not None else (d.pool(side).device or scenario.device).cost_per_hour
              for side in SIDES}
    cost = None if None in prices.values() else sum(gpus[s] * prices[s] for s in SIDES)
    return {"gpus": sum(gpus.values()), "prefill_gpus": gpus["prefill"], "decode_gpus": gpus["decode"],
            "cost_per_hour": cost}


KV_ROLE_SIDES = {"kv_producer": "prefill", "kv_consumer": "decode"}


def kv_transfer_note(value: Optional[str]) -> str:
    """Why `vllm serve --kv-transfer-config ...` does not map onto one scenario, and what to write
    instead: a `vllm serve` line is one engine, one side of a P/D deployment (its kv_role), while a
    P/D scenario holds both pools (cluster.disaggregation)."""
    import json

    try:      # untrusted text: bounded before parsing (the offload flags' own parser reports the limit)
        config = json.loads(value) if value and len(value) <= 10_000 else None
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        return ("a KV connector config that is not a JSON object; kvtwin simulates prefill/decode "
                "disaggregation as cluster.disaggregation (both pools in one scenario)")
    connector, role = str(config.get("kv_connector", "?"))[:60], str(config.get("kv_role", "?"))[:20]
    side = KV_ROLE_SIDES.get(role)
    head = f"{connector} with kv_role {role}: this command is one engine"
    if side is not None:
        return (f"{head}, the {side} side of a P/D deployment; kvtwin simulates both sides in one scenario: put "
                f"this engine's settings under cluster.disaggregation.{side} (device, tp, engine) and the other "
                f"side's command under the other pool (docs/whatif/disaggregation.md); this scenario alone "
                f"predicts the engine co-located")
    return (f"{head} that both sends and receives KV (kv_both, as LMCache offloading or a P/D pair's symmetric "
            f"setup); kvtwin models CPU offloading for OffloadingConnector and LMCacheConnectorV1 only "
            f"(engine.kv_offload) and P/D only as cluster.disaggregation (docs/whatif/disaggregation.md); "
            f"this scenario predicts the engine co-located")
