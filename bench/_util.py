"""Shared helpers for the bench scripts: machine facts, atomic JSON output."""
from __future__ import annotations

import os
import platform
from datetime import datetime, timezone

from sim.output.io import write_json  # noqa: F401  (re-exported for the bench scripts)


def machine() -> dict:
    return {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}
