"""A finished simulation is freed by reference counting alone, as soon as its caller drops it.

Simulation.run pauses the cyclic collector (sim.core.collector.gc_paused) and then moves everything the
run made to the oldest generation, whose full collections come rarely. Anything of a run kept in
a reference cycle therefore stays until one: a LODO refit (validate/lodo.py), thousands of
simulations in one process, grew to 13.7 GB of KV pools and schedulers that way. These tests run
with the collector off, so a cycle anywhere between the simulation, its replicas' KV managers and
its cost model keeps them alive and fails the test (no timing or memory measurement involved).
"""
import gc
import weakref

import pytest

from sim.core.memory import plan_memory
from sim.costmodel import CostModel
from sim.records import requests_frame
from sim.scenario import validate_scenario
from sim.simulator import Simulation
from sim.workload import build_requests

WORKLOAD = {"num_requests": 24, "arrival": {"process": "poisson", "rate": 50},
            "prompt_len": {"dist": "fixed", "value": 300}, "output_len": {"dist": "fixed", "value": 40},
            "shared_prefix": {"groups": 2, "length": 128, "fraction": 0.5}}


def scenario(**workload):
    return validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm",
                              "engine": {"prefix_caching": True, "max_model_len": 4096},
                              "workload": {**WORKLOAD, **workload}})


@pytest.fixture
def collector_off():
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if enabled:
        gc.enable()


@pytest.mark.parametrize("workload, fast", [({}, True), ({}, False), ({"max_concurrency": 4}, True)],
                         ids=["open-loop chained", "reference path", "closed loop"])
def test_a_finished_simulation_needs_no_cyclic_collection(collector_off, workload, fast):
    s = scenario(**workload)
    cost = CostModel.for_scenario(s)
    requests = build_requests(s)      # kept, as validate/lodo.py keeps each run's requests
    sim = Simulation(s, requests, plan_memory(s), cost, fast=fast)
    records = sim.run()
    assert len(requests_frame(records)) == len(requests)
    kv = sim.replicas[0].kv
    alive = {"simulation": weakref.ref(sim), "KV manager": weakref.ref(kv),
             "KV coordinator": weakref.ref(kv.coordinator), "cost model": weakref.ref(cost)}
    del sim, kv, cost, records
    for request in requests:       # what a request keeps of its run goes at its next reset
        request.reset()
    assert [name for name, ref in alive.items() if ref() is not None] == []


def test_a_finished_disaggregated_simulation_needs_no_cyclic_collection(collector_off):
    from sim.disagg import build_simulation

    s = validate_scenario({"model": "qwen2.5-0.5b", "device": "h100-sxm", "engine": {"max_model_len": 4096},
                           "cluster": {"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1},
                                                          "link": {"kind": "rdma"}}},
                           "workload": {**WORKLOAD, "shared_prefix": None}})
    requests = build_requests(s)
    sim = build_simulation(s, requests, None, False)
    records = sim.run()
    assert len(requests_frame(records)) == len(requests)
    alive = {"simulation": weakref.ref(sim), "KV manager": weakref.ref(sim.replicas[-1].kv)}
    del sim, records
    for request in requests:
        request.reset()
    assert [name for name, ref in alive.items() if ref() is not None] == []


def test_the_kv_coordinator_updates_its_managers_held_slots():
    """(The coordinator reaches its manager through a weak proxy: the counts still go there.)"""
    from sim.core.kv import KVCacheManager
    from sim.core.request import make_request

    kv = KVCacheManager(num_blocks=64, block_size=16, enable_caching=True)
    req = make_request(0, 0.0, [(7, 40)], 4)
    assert kv.allocate_slots(req, 40)
    assert kv.held_slots == 48
    kv.free(req)
    assert kv.held_slots == 0
