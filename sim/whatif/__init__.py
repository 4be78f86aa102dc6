"""Capacity planning: sweeps over any scenario field (`sweep`) and searches over rate, replicas and
devices (`plan`).

May import: `sim.core`, the simulation (`sim.*` top-level modules) and `sim.output`. Never `sim.cli`.
"""
