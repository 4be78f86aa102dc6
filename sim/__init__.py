"""kvtwin's simulator. `sim.core` is the policy shared with the engine; the modules at this level
are the simulation (scenario, workload, traces, cost model, router, simulator, records, metrics,
predict); `sim.output` writes and draws; `sim.whatif` sweeps and searches; `sim.cli` is `simrun`.
Import directions: core <- simulation <- output/whatif <- cli (tests/repo/test_layers.py).
"""

from sim.ownership import check_top_level_modules as _check

_check()          # sim, engine, validate: kvtwin's own, or a clear error (sim/ownership.py)
del _check
