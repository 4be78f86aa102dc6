"""Running many points: on local processes (`--jobs`) or as Ray tasks (`--ray`), results in
item order whichever ran them, with one progress bar. Sweeps and plan's searches share it."""
from __future__ import annotations

import argparse
import os
import platform
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

from sim.errors import SweepError


@contextmanager
def progress_bar(label: str, total: int, quiet: bool = False) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields advance(n)."""
    if quiet:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda n=1: bar.advance(task, n)


def default_jobs() -> int:
    return os.cpu_count() or 1


def parallel_map(func: Callable[[Any], Any], items: Sequence[Any], jobs: int = 1, ray: Optional[str] = None,
                 label: str = "running", quiet: bool = False,
                 when_idle: Optional[Callable[[], None]] = None) -> list[Any]:
    """[func(item) for item in items], on `jobs` local processes or, when `ray` is not None,
    as Ray tasks ('' starts a local Ray instance, else the cluster address). Results come
    back in item order whatever order they finish in.

    `when_idle`: work of this process's own that can wait until a core is free, run once: on
    local processes as soon as the items left are fewer than the workers (one has nothing
    left to take: the tail of the map, when a core would otherwise sit idle); else after the
    items (Ray's or this process's)."""
    items = list(items)
    if ray is not None:
        results = _map_on_ray(func, items, ray or None, label, quiet)
    elif jobs <= 1 or len(items) <= 1:
        with progress_bar(label, len(items), quiet) as advance:
            results = [_advanced(func(item), advance) for item in items]
    else:
        return _map_on_processes(func, items, min(jobs, len(items)), label, quiet, when_idle)
    if when_idle is not None:
        when_idle()
    return results


def _advanced(result: Any, advance: Callable[[int], None]) -> Any:
    advance(1)
    return result


def _map_on_processes(func, items: list, jobs: int, label: str, quiet: bool,
                      when_idle: Optional[Callable[[], None]] = None) -> list:
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from sim import stop

    # A stop a signal asks for goes on to the workers (each stops at its next check, sim/stop.py);
    # the points not started are cancelled, and leaving `with` waits for the workers to end.
    with ProcessPoolExecutor(max_workers=jobs, initializer=_worker_started) as pool, \
            stop.forwarding(stop.forward_to_pool(pool)):
        # Submit before the progress bar starts its refresh thread: forked workers then
        # never inherit a lock that thread holds.
        futures = {pool.submit(func, item): i for i, item in enumerate(items)}
        results: list = [None] * len(items)
        left = len(items)
        try:
            with progress_bar(label, len(items), quiet) as advance:
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    advance(1)
                    left -= 1
                    if when_idle is not None and left < jobs:    # a worker has nothing left to take
                        when_idle()
                        when_idle = None
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return results


def _worker_started() -> None:
    """Initializer of a local worker process: a stop reaches it (sim/stop.py), and the memory
    one item frees is kept for the next."""
    from sim import stop

    stop.in_worker()
    keep_freed_memory()


# glibc's mallopt parameters (malloc.h) and the values a worker runs with: free heap kept up to
# 256 MiB (default 128 KiB), and blocks below 32 MiB (glibc's largest allowed on 64 bits) taken
# from the heap rather than mapped and unmapped one by one
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_FREE_BYTES, MAPPED_FROM_BYTES = 256 << 20, 32 << 20


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep what this process frees for its next allocations, instead of
    handing it back to the kernel: by default it trims the top of its heap beyond 128 KiB free and
    unmaps each freed block past its mmap threshold, so every sweep point of a worker faulted its
    working memory in afresh (~4k page faults a 10k-request point, zeroed by the kernel: its system
    CPU). A worker then holds its largest point's memory between points, which each point reaches
    anyway. False where the C library is not glibc or refuses the values."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt
    kept = mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
    mapped = mallopt(M_MMAP_THRESHOLD, MAPPED_FROM_BYTES)
    return bool(kept and mapped)


def _map_on_ray(func, items: list, address: Optional[str], label: str, quiet: bool) -> list:
    from sim import stop

    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray: pip install 'kvtwin[ray]' (or run without --ray "
                         "to use local processes)") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    refs: list = []
    try:
        remote = ray.remote(func)
        refs = [remote.remote(item) for item in items]
        pending = list(refs)
        with progress_bar(f"{label} (ray)", len(items), quiet) as advance:
            while pending:
                stop.check()               # a signal asked to stop (sim/stop.py): cancel what is left
                done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                advance(len(done))
        return ray.get(refs)
    except KeyboardInterrupt:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise
    finally:
        if started:
            ray.shutdown()


def check_jobs(jobs: Optional[int]) -> int:
    if jobs is not None and jobs < 1:
        raise SweepError(f"--jobs {jobs}: expected at least 1")
    return jobs or default_jobs()


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="local processes for the points (default: one per core)")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="run the points as tasks on a Ray cluster at ADDRESS (no address: "
                             "start a local Ray instance); needs the ray extra")
