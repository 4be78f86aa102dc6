"""make_scheduler composes the reference V1 scheduler with exactly the variants a config asks for."""
import pytest

from sim.core.async_scheduling import AsyncScheduling
from sim.core.kv import KVCacheManager
from sim.core.lora import LoraScheduling
from sim.core.request import make_request
from sim.core.scheduler import Scheduler, SchedulerConfig
from sim.core.scheduler_variants import make_scheduler, scheduler_class
from sim.core.speculative import SpecScheduling
from sim.core.step_orders import PrefillFirst, StaticBatching

BASE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)


def config(**fields) -> SchedulerConfig:
    return SchedulerConfig(**{**BASE, **fields})


def test_a_plain_v1_config_is_the_reference_class_itself():
    sched = make_scheduler(config(), KVCacheManager(64, 16))
    assert type(sched) is Scheduler and sched.variants == frozenset()


@pytest.mark.parametrize("fields, mixins", [
    (dict(async_scheduling=True), [AsyncScheduling]),
    (dict(batching="static"), [StaticBatching]),
    (dict(step_composition="prefill_first"), [PrefillFirst]),
    (dict(batching="static", step_composition="prefill_first"), [StaticBatching]),    # static wins
    (dict(speculative=("ngram", 2, (0.5, 0.5), 0)), [SpecScheduling]),
    (dict(lora=(1, 2), async_scheduling=True, step_composition="prefill_first"),
     [AsyncScheduling, PrefillFirst, LoraScheduling]),
])
def test_each_variant_puts_its_mixin_in_front_in_a_fixed_order(fields, mixins):
    sched = make_scheduler(config(**fields), KVCacheManager(64, 16))
    mro = type(sched).__mro__
    assert [m for m in mro if m in (AsyncScheduling, StaticBatching, PrefillFirst, SpecScheduling,
                                     LoraScheduling)] == mixins
    assert mro[len(mixins) + 1] is Scheduler          # the composed class, its mixins, the reference
    assert type(sched) is scheduler_class(sched.variants)     # one class per combination


def test_variant_fields_reach_the_scheduler_only_through_make_scheduler():
    with pytest.raises(TypeError, match="make_scheduler"):
        Scheduler(config(async_scheduling=True), KVCacheManager(64, 16))


def test_a_composed_scheduler_runs_a_request_to_the_end():
    sched = make_scheduler(config(async_scheduling=True, lora=(1, 1)), KVCacheManager(64, 16))
    req = make_request(0, 0.0, [(1, 40)], 3)
    assert sched.add(req)
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.finish_step(batch)
        steps += 1
    assert req.num_output == 3 and steps == 3
    sched.check_accounting()
