"""vLLM's LoRA flags -> engine.lora (and the adapters --lora-modules names -> workload.lora).

vLLM (vllm/engine/arg_utils.py, vllm/config/lora.py, 0.11-0.19): `--enable-lora` builds a
LoRAConfig from `--max-loras` (default 1), `--max-lora-rank` (16) and `--max-cpu-loras` (unset:
max_loras); without `--enable-lora` there is no LoRAConfig and those flags change nothing.
`--lora-modules` (the OpenAI server's, nargs '+') names the adapters served from start-up, each
`name=path` or a JSON object {"name": ..., "path": ..., "base_model_name": ...}; the requests pick
one by naming it as their `model`. A command does not say how the traffic spreads over them, so
their count becomes workload.lora.num_adapters (uniform, every request with an adapter) when the
workload has no lora section of its own, and the scenario's notes say so.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from sim.core.files import excerpt

LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules")
# (flag, engine.lora field)
_LIMITS = (("--max-loras", "max_loras"), ("--max-lora-rank", "max_lora_rank"), ("--max-cpu-loras", "max_cpu_loras"))
MAX_MODULES = 10_000


class FlagError(ValueError):
    """A value vLLM would refuse."""


def _positive(flag: str, text: Optional[str]) -> int:
    if text is None:
        raise FlagError(f"vLLM flag {flag}: needs a value (a whole number)")
    try:
        value = int(text)
    except ValueError:
        raise FlagError(f"vLLM flag {flag} {excerpt(text, 40)}: a whole number expected") from None
    if value < 1:
        raise FlagError(f"vLLM flag {flag} {value}: at least 1 expected")
    return value


def _switch(name: str, value: Optional[str]) -> bool:
    if name.startswith("--no-"):
        return False
    if value is None:
        return True
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise FlagError(f"vLLM flag --enable-lora {excerpt(value, 40)}: a switch (true or false)")


def module_names(value: str) -> list[str]:
    """The adapter names of one --lora-modules value: `name=path`, a JSON object with a name, or
    (a --config file's list) a JSON list of either."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            raise FlagError(f"vLLM flag --lora-modules {excerpt(text, 60)}: not a JSON list") from None
        if not isinstance(items, list) or len(items) > MAX_MODULES:
            raise FlagError(f"vLLM flag --lora-modules: a list of at most {MAX_MODULES:,} adapters expected")
        return [n for item in items for n in module_names(item if isinstance(item, str) else json.dumps(item))]
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except ValueError:
            raise FlagError(f"vLLM flag --lora-modules {excerpt(text, 60)}: not a JSON object") from None
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name:
            raise FlagError(f"vLLM flag --lora-modules {excerpt(text, 60)}: the JSON object needs a \"name\"")
        return [name]
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise FlagError(f"vLLM flag --lora-modules {excerpt(text, 60)}: expected name=path or a JSON object "
                        f"{{\"name\": ..., \"path\": ...}}")
    return [name]


def apply(result, flags: list[tuple[str, Optional[str]]]) -> None:
    """Write engine.lora from the flags (the last of each counts, as argparse does; --lora-modules
    values add up) and record the adapters' count on the Translation (`lora_adapters`)."""
    from sim.errors import UserError

    values: dict[str, tuple[str, Optional[str]]] = {}
    names: list[str] = []
    seen = False
    try:
        for name, value in flags:
            base = "--" + name[5:] if name.startswith("--no-") else name
            if base not in LORA_FLAGS:
                continue
            seen = True
            if base == "--lora-modules":
                if value is None:
                    raise FlagError("vLLM flag --lora-modules: needs at least one name=path")
                names += module_names(value)
            else:
                values[base] = (name, value)
        if not seen:
            return
        enabled = _switch(*values["--enable-lora"]) if "--enable-lora" in values else False
        limits = {field: _positive(flag, values[flag][1]) for flag, field in _LIMITS if flag in values}
    except FlagError as e:
        raise UserError(str(e)) from None
    adapters = list(dict.fromkeys(names))
    if not enabled:
        for flag in [f for f in LORA_FLAGS if f in values and f != "--enable-lora"] + \
                (["--lora-modules"] if names else []):
            shown = values[flag][1] if flag in values else ", ".join(adapters)
            result.ignored.append((flag, shown, "without --enable-lora vLLM builds no LoRA config (and refuses "
                                                "requests for adapters)"))
        if "--enable-lora" in values:
            result.mapped.append((values["--enable-lora"][0], "engine.lora", None))
        return
    section: dict[str, Any] = dict(limits)
    engine = result.raw.setdefault("engine", {})
    engine["lora"] = section
    result.mapped.append(("--enable-lora", "engine.lora", section or "{} (vLLM's defaults)"))
    for flag, field in _LIMITS:
        if field in limits:
            result.mapped.append((f"{flag} {limits[field]}", f"engine.lora.{field}", limits[field]))
    if adapters:
        result.mapped.append((f"--lora-modules ({len(adapters)} adapter{'s' if len(adapters) > 1 else ''})",
                              "workload.lora.num_adapters", len(adapters)))
        result.lora_adapters = len(adapters)


def workload_sections(result, kept: dict) -> dict:
    """The workload's lora section from --lora-modules, unless the workload (kept from an earlier
    file) has one: merged into `kept` in place, or returned as a new `workload` section. Adds a
    remark to the scenario's notes either way."""
    n = getattr(result, "lora_adapters", 0)
    if not n:
        return {}
    workload = kept.get("workload")
    if isinstance(workload, dict) and workload.get("lora") is not None:
        result.remarks.append(f"--lora-modules names {n} adapter(s); the kept workload.lora is used as it is")
        return {}
    section = {"num_adapters": n}
    result.remarks.append(f"--lora-modules names {n} adapter(s): workload.lora.num_adapters = {n}, each request "
                          f"asking for one of them uniformly (the command does not say how traffic spreads: "
                          f"edit workload.lora's distribution and base_fraction)")
    if isinstance(workload, dict):
        workload["lora"] = section
        return {}
    return {"workload": {"lora": section}}
