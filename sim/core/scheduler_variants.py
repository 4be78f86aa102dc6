"""`make_scheduler`: the reference scheduler (sim/core/scheduler.py) composed with the variants a
config asks for.

Each variant is a mixin kept beside its own subject, overriding a few of the reference's hooks
(`_compose`, `_schedule_pass`, `_first_chunk`, `_skip_head`, `_admit`, `finish_step`,
`_after_pass`, `_free_finished`, ...) and calling the next through `super()`:

| name | mixin | module |
|---|---|---|
| async | AsyncScheduling | sim/core/async_scheduling.py |
| offload | OffloadScheduling | sim/core/offload.py |
| static | StaticBatching | sim/core/step_orders.py |
| prefill_first | PrefillFirst | sim/core/step_orders.py |
| speculative | SpecScheduling | sim/core/speculative.py |
| lora | LoraScheduling | sim/core/lora.py |

A scheduler without variants is the reference class itself, so a plain V1 run pays nothing for them.
"""
from __future__ import annotations

from functools import cache
from typing import Optional

from sim.core.async_scheduling import AsyncScheduling
from sim.core.kv import KVCacheManager
from sim.core.lora import LoraScheduling
from sim.core.offload import CpuTier, OffloadScheduling
from sim.core.scheduler import Scheduler
from sim.core.scheduler_config import SchedulerConfig, variants_of
from sim.core.speculative import SpecScheduling
from sim.core.step_orders import PrefillFirst, StaticBatching

# The order is the MRO: async scheduling defers a finisher's release, the CPU tier's part of it
# too; a request the tier loads is not counted against LoRA's max_loras.
VARIANTS = (("async", AsyncScheduling), ("offload", OffloadScheduling), ("static", StaticBatching),
            ("prefill_first", PrefillFirst), ("speculative", SpecScheduling), ("lora", LoraScheduling))


@cache
def scheduler_class(variants: frozenset) -> type:
    """The reference Scheduler with the named variants' mixins in front of it, in VARIANTS' order
    (one class per combination, made once)."""
    if not variants:
        return Scheduler
    mixins = tuple(mixin for name, mixin in VARIANTS if name in variants)
    slots = tuple(slot for mixin in mixins for slot in mixin.state)
    name = "".join(m.__name__ for m in mixins) + "Scheduler"
    return type(name, (*mixins, Scheduler), {"__slots__": slots, "variants": variants, "__module__": __name__})


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager, *, offload: Optional[CpuTier] = None) -> Scheduler:
    """The scheduler `config` asks for, with `offload` as its CPU tier (or none)."""
    return scheduler_class(variants_of(config, offload))(config, kv, offload)
