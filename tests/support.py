"""Helpers shared by test files (imported as `support`: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def alarm(seconds: int):
    """A hang is a failure, not a stuck suite: raise TimeoutError after `seconds`."""
    def fire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
