"""Processes that draw a run's figures in parallel with the simulation's end.

`simrun` starts them before it simulates, so they import matplotlib and load fonts while the
parent simulates (this module itself imports no plotting library: the parent prints its table
without one). Each worker then draws a share of report.RUN_PLOTS. With one core, or where fork is
not available, the figures are drawn in the calling process instead; KVTWIN_PLOT_WORKERS=N sets
the number of workers (1: none).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence


def warm_up() -> None:
    """Import matplotlib and load its fonts (a worker does this while the parent simulates)."""
    import io

    from sim.output.report import new_figure

    fig, (ax,) = new_figure()
    ax.set_title("warm-up")
    ax.plot([0, 1])
    fig.savefig(io.BytesIO(), format="png", dpi=20)


def draw_share(views: Mapping, out_dir: str, title: str, names: Sequence[str]) -> dict[str, Path]:
    from sim.output.report import RUN_PLOTS, plot_run_figures

    return plot_run_figures(views, out_dir, title, {name: RUN_PLOTS[name] for name in names})


def run_plot_names() -> list[str]:
    # the same names as report.RUN_PLOTS, without importing matplotlib here
    return ["overview", "kv_blocks", "queue", "batch_tokens", "latency_cdf", "step_time"]


class FigureWorkers:
    def __init__(self, workers: Optional[int] = None) -> None:
        import multiprocessing
        import os
        import threading

        if workers is None:
            workers = int(os.environ.get("KVTWIN_PLOT_WORKERS") or min(2, os.cpu_count() or 1))
        self.workers = workers
        self.pool = None
        # fork copies one thread only: with other threads alive (a server, a test runner's helpers)
        # a lock one of them holds would stay locked in the child forever, so draw here instead
        alone = threading.active_count() == 1
        if self.workers > 1 and alone and "fork" in multiprocessing.get_all_start_methods():
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"))
            for _ in range(self.workers):
                self.pool.submit(warm_up)

    def draw(self, views: Mapping, out_dir: str | Path, title: str = "") -> dict[str, Path]:
        names = run_plot_names()
        if self.pool is None:
            return draw_share(views, str(out_dir), title, names)
        shares = [names[i::self.workers] for i in range(self.workers)]   # the overview and kv_blocks apart
        futures = [self.pool.submit(draw_share, dict(views), str(out_dir), title, share) for share in shares]
        drawn: dict[str, Path] = {}
        for future in futures:
            drawn.update(future.result())
        return {name: drawn[name] for name in names}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def __enter__(self) -> "FigureWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
