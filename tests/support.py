"""Helpers shared by test files (imported as `support`: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import contextlib
import json
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


def with_changes(data: dict, **changes) -> dict:
    """A deep copy of a JSON-like `data` with `field=value` (or `field__INDEX=value` for one list
    element) set: one hostile variant of a good vLLM result file."""
    data = json.loads(json.dumps(data))
    for key, value in changes.items():
        field, _, index = key.partition("__")
        if index:
            data[field][int(index)] = value
        else:
            data[field] = value
    return data
