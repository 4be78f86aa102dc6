"""vLLM's KV offloading flags -> engine.kv_offload (sim/core/offload.py).

vLLM 0.19 (vllm/config/vllm.py `_post_init_kv_transfer_config`, config/cache.py):
- `--kv-offloading-size GiB` turns offloading on (the total over the TP x PP ranks);
  `--kv-offloading-backend` (native | lmcache, default native) alone does nothing;
- native: the connector becomes OffloadingConnector and `cpu_bytes_to_use = size x 2^30` is
  merged into kv_connector_extra_config (so a --kv-transfer-config's block_size and
  eviction_policy stay); lmcache: LMCacheConnectorV1 with the extra config *replaced* by
  {lmcache.local_cpu: true, lmcache.max_local_cpu_size: size / ranks};
- the size flag wins over any connector a --kv-transfer-config names (its extra config stays for
  native: block_size, eviction_policy).
`--kv-transfer-config` JSON on its own: OffloadingConnector (extra config cpu_bytes_to_use,
block_size, eviction_policy; vllm/v1/kv_offload/cpu/spec.py) or LMCacheConnectorV1 (extra config
lmcache.max_local_cpu_size per rank, lmcache.local_cpu, lmcache.chunk_size). Any other connector
(NixlConnector for disaggregated prefill, ...) is left to the ignored list.
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional

from sim.core.files import excerpt

GIB = 1 << 30
OFFLOAD_CONNECTORS = ("OffloadingConnector", "LMCacheConnectorV1")
MAX_JSON_CHARS = 10_000
# LMCache's own defaults (LMCache/LMCache lmcache/v1/config.py _CONFIG_DEFINITIONS): local_cpu true,
# max_local_cpu_size 5.0 (GB per worker), chunk_size 256. LMCACHE_* variables or an
# LMCACHE_CONFIG_FILE can change them; a command line does not show those (docs/kv_offload.md).
LMCACHE_DEFAULT_CPU_GB = 5.0


class FlagError(ValueError):
    """A value vLLM would refuse, or one kvtwin cannot model faithfully."""


def offloading_size(text: str) -> float:
    """--kv-offloading-size: GiB, a positive finite number."""
    try:
        value = float(text)
    except ValueError:
        raise FlagError(f"{excerpt(text)} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0 or value > 1 << 20:
        raise FlagError(f"{excerpt(text)}: expected GiB of CPU memory, > 0 and at most 2^20")
    return value


def transfer_config(text: str) -> dict[str, Any]:
    """--kv-transfer-config JSON, parsed and bounded."""
    if len(text) > MAX_JSON_CHARS:
        raise FlagError(f"a JSON object of at most {MAX_JSON_CHARS:,} characters expected")
    try:
        config = json.loads(text)
    except ValueError as e:
        config = _unquoted(text)
        if config is not None:
            return config
        raise FlagError(f"not JSON ({e.msg} at character {e.pos}); expected e.g. "
                        f"'{{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\", "
                        f"\"kv_connector_extra_config\": {{\"cpu_bytes_to_use\": 68719476736}}}}'") from None
    if not isinstance(config, dict):
        raise FlagError("expected a JSON object with kv_connector")
    extra = config.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise FlagError("kv_connector_extra_config: expected a JSON object")
    return config


def _unquoted(text: str) -> Optional[dict[str, Any]]:
    """{kv_connector:LMCacheConnectorV1,kv_role:kv_both}: what a shell leaves of an unquoted flat
    JSON object (a public command line has it so); None if it is not one."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")) or "{" in body[1:-1] or "[" in body:
        return None
    out: dict[str, Any] = {}
    for pair in filter(str.strip, body[1:-1].split(",")):
        key, sep, value = (part.strip() for part in pair.partition(":"))
        if not sep or not key:
            return None
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def is_offload_connector(config: dict[str, Any]) -> bool:
    return config.get("kv_connector") in OFFLOAD_CONNECTORS


def _number(extra: dict, key: str, low: float, high: float) -> float:
    value = extra[key]
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low < value <= high:
        raise FlagError(f"kv_connector_extra_config.{key} = {excerpt(extra[key])}: expected a number in ({low:g}, {high:g}]")
    return float(value)


def _native(extra: dict, size_gib: Optional[float]) -> dict[str, Any]:
    if size_gib is None:
        if "cpu_bytes_to_use" not in extra:
            raise FlagError("OffloadingConnector needs kv_connector_extra_config.cpu_bytes_to_use (vLLM's "
                            "CPUOffloadingSpec raises without it)")
        size_gib = _number(extra, "cpu_bytes_to_use", 0, float(1 << 50)) / GIB
    out: dict[str, Any] = {"backend": "native", "size_gib": size_gib}
    if "block_size" in extra:
        out["offloaded_block_size"] = int(_number(extra, "block_size", 0, 1 << 16))
    if "eviction_policy" in extra:
        policy = extra["eviction_policy"]
        if policy not in ("lru", "arc"):
            raise FlagError(f"kv_connector_extra_config.eviction_policy = {excerpt(policy)}: vLLM 0.19 has lru, arc")
        out["eviction_policy"] = policy
    if "store_threshold" in extra and _number(extra, "store_threshold", -1, 1 << 30) >= 2:
        raise FlagError("kv_connector_extra_config.store_threshold >= 2 (store only blocks looked up that often, "
                        "vLLM's FilterReusedOffloadingManager) is not modelled by kvtwin")
    return out


def _lmcache(extra: dict, size_gib: Optional[float], ranks: int) -> dict[str, Any]:
    if size_gib is not None:             # vLLM replaces the extra config: size / ranks per rank
        return {"backend": "lmcache", "size_gib": size_gib}
    if extra.get("lmcache.local_cpu") is False:
        raise FlagError("lmcache.local_cpu false: LMCache's disk / remote backends are not modelled")
    per_rank = (_number(extra, "lmcache.max_local_cpu_size", 0, 1 << 20) if "lmcache.max_local_cpu_size" in extra
                else LMCACHE_DEFAULT_CPU_GB)
    out: dict[str, Any] = {"backend": "lmcache", "size_gib": per_rank * ranks}
    if "lmcache.chunk_size" in extra:
        out["offloaded_block_size"] = int(_number(extra, "lmcache.chunk_size", 0, 1 << 16))
    return out


def kv_offload_section(size_gib: Optional[float], backend: Optional[str], config: Optional[dict],
                       ranks: int) -> Optional[dict[str, Any]]:
    """engine.kv_offload from the three flags as vLLM 0.19 combines them; None: offloading is off."""
    extra = dict((config or {}).get("kv_connector_extra_config", {}))
    if size_gib is not None:
        if (backend or "native") == "lmcache":
            return _lmcache({}, size_gib, ranks)
        return _native(extra, size_gib)     # (merged into whatever extra config the JSON gave)
    if config is None or not is_offload_connector(config):
        return None
    if config["kv_connector"] == "OffloadingConnector":
        return _native(extra, None)
    return _lmcache(extra, None, ranks)


def apply(result, flags: list[tuple[str, Optional[str]]], tp: int) -> None:
    """Rewrite a Translation's engine.kv_offload from the three flags (the last of each counts, as
    argparse does), and move --kv-transfer-config between its ignored and mapped lists."""
    from sim.errors import UserError

    values: dict[str, Optional[str]] = {}
    for name, value in flags:
        if name in ("--kv-offloading-size", "--kv-offloading-backend", "--kv-transfer-config"):
            values[name] = value
    if not values:
        return
    try:
        size = offloading_size(values["--kv-offloading-size"]) if values.get("--kv-offloading-size") else None
        config = transfer_config(values["--kv-transfer-config"]) if values.get("--kv-transfer-config") else None
        section = kv_offload_section(size, values.get("--kv-offloading-backend"), config, tp)
    except FlagError as e:
        flag = "--kv-transfer-config" if "kv_connector" in str(e) or "JSON" in str(e) else "--kv-offloading-size"
        raise UserError(f"vLLM flag {flag}: {e}") from None
    engine = result.raw.setdefault("engine", {})
    engine.pop("kv_offload", None)
    if section is not None:
        engine["kv_offload"] = section
    elif not engine:
        result.raw.pop("engine")
    if config is not None and (section is not None and is_offload_connector(config) or size is not None):
        result.ignored = [entry for entry in result.ignored if entry[0] != "--kv-transfer-config"]
        result.mapped.append((f"--kv-transfer-config {excerpt(values['--kv-transfer-config'], 60)}",
                              "engine.kv_offload", section))
    if section is None and "--kv-offloading-backend" in values:
        result.mapped = [m for m in result.mapped if not m[0].startswith("--kv-offloading-backend")]
        result.ignored.append(("--kv-offloading-backend", values["--kv-offloading-backend"],
                               "vLLM turns offloading on only with --kv-offloading-size"))
