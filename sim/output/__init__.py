"""What a person or a file receives: the consoles, atomic file writes (`io`), a run's files
(`run_files`), plots, the HTML page and the Perfetto trace (`report`).

May import: `sim.core` and the simulation (`sim.*` top-level modules). Never `sim.whatif` or `sim.cli`.
"""
