"""A clean stop on SIGTERM or Ctrl-C: the signal only asks, the work stops at its next check.

Raising an exception from a signal handler is not a reliable stop: Python runs the handler
between any two bytecodes, so the KeyboardInterrupt can surface inside a finalizer (printed as
"Exception ignored" and lost: the run then finishes with exit 0), inside an import (wrapped in
another error), or during interpreter shutdown (exit -2). So while a run holds its output folder
(sim.output.run_dir.owned_run_folder) the handler only sets a flag, and the work checks it at
points where stopping is safe:
  - every prediction (sim.predict: before and after building the workload, every 256 finished
    requests while simulating, before summarising) and the engine replay of `simrun validate`;
  - every output file written (sim.output.io.atomic_path, before it creates its temp file);
and raises `StopRequested` there (a KeyboardInterrupt: temp files are removed on the way out,
INCOMPLETE stays, `simrun` exits 130).

Worker processes (figure drawing, sweep and plan points) get the same handler, and the stop is
forwarded to them (`forwarding`), so each stops at its own next check and the parent waits for
them to end before it exits: none is left behind writing into the folder.

SIGTERM is idempotent (a second one changes nothing; SIGKILL is the immediate stop). A second
Ctrl-C raises KeyboardInterrupt at once, as Python does, for work stuck between checks.
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


class StopRequested(KeyboardInterrupt):
    """A stop a signal asked for, raised at a point where stopping is safe."""


_asked: Optional[str] = None           # the name of the signal that asked, once one has
_depth = 0                             # nesting of stop_on_signals() regions
_forward_to: dict[int, Callable[[], None]] = {}     # id -> a function passing the stop on to one child


def asked() -> bool:
    return _asked is not None


def check() -> None:
    """Raise StopRequested if a stop was asked for."""
    if _asked is not None:
        raise StopRequested(f"stopped on {_asked}")


def request(name: str = "request") -> None:
    """Ask for a stop (what the signal handler does), and pass it on to the registered children."""
    global _asked
    again = _asked is not None
    if not again:
        _asked = name
    for forward in list(_forward_to.values()):
        _call(forward)
    if again and name == "SIGINT":     # a second Ctrl-C: out now
        raise KeyboardInterrupt


def _call(forward: Callable[[], None]) -> None:
    try:
        forward()
    except Exception:          # noqa: BLE001 - a child that ended meanwhile; a signal handler must not fail
        pass


def polling(progress: Optional[Callable[[int], None]]) -> Callable[[int], None]:
    """A progress callback that first checks for a stop (then calls `progress`, if any)."""
    def poll(done: int) -> None:
        check()
        if progress is not None:
            progress(done)
    return poll


def _handler(signum, _frame) -> None:
    request(signal.Signals(signum).name)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT ask for a stop while this is open (in the main thread; a no-op elsewhere).
    The outermost region starts with no stop asked and restores the previous handlers at the end;
    `asked()` stays true after it, so the caller can report an interrupted run."""
    global _depth, _asked
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        _asked = None
        old = {sig: signal.signal(sig, _handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def in_worker() -> None:
    """Initializer of a worker process: signals ask for a stop here too, and the parent's
    registered children are not this process's to forward to."""
    global _depth
    _forward_to.clear()
    _depth = 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _handler)


def forward_to_pid(pid: int) -> Callable[[], None]:
    """Pass a stop on to the child process `pid` (one this process forked and has not yet waited for)."""
    return lambda: os.kill(pid, signal.SIGTERM)


def forward_to_pool(pool) -> Callable[[], None]:
    """Pass a stop on to every live worker of a concurrent.futures ProcessPoolExecutor."""
    def forward() -> None:
        # list() copies in one step (the executor's thread may change the mapping); terminate()
        # signals only a process not yet reaped, so never a reused pid
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()
    return forward


@contextmanager
def forwarding(forward: Callable[[], None]) -> Iterator[None]:
    """While open, a stop asked for here is passed on by calling `forward` (which sends the child
    a SIGTERM). A stop already asked for is passed on at once."""
    key = id(forward)
    _forward_to[key] = forward
    try:
        if asked():
            _call(forward)
        yield
    finally:
        _forward_to.pop(key, None)
