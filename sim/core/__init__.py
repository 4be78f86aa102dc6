"""The serving policy that the simulator and the engine both run: requests, the KV block pool and
prefix cache, the scheduler (its fast paths in sim/core/fast), the memory plan, and the model/device catalog
those need. No clock lives here: the simulator advances it with modelled step times, the engine with
real GPU steps.

May import: the standard library, numpy, pydantic, yaml and other `sim.core` modules. Never simpy,
pandas, torch, or anything else under `sim` (tests/repo/test_layers.py checks).
"""
