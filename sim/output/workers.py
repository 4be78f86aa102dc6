"""Processes that draw a run's figures while, and after, the main process prints its answer.

`simrun` starts one figure process before it simulates: it imports matplotlib and loads fonts
while the main process simulates (this module imports no plotting library, so the main process
prints its table without one), then draws report.RUN_FIGURES when the results come.
KVTWIN_PLOT_WORKERS=N sets the number of figure processes (default 1; 0 draws in the calling
process, as happens where fork is not available or from a process that runs other threads);
with N > 1 the figure process forks N - 1 copies, which draw their shares in parallel without
importing matplotlib again. One is the default: two drew Vidur's run ~0.6 s sooner, at a CPU cost
not yet measured reliably, and in CPU time one figure process costs the same as drawing in the
main process (docs/performance.md, "Figures from reductions"). A sweep's plots are split the same way
(`in_forked_shares`), once its points are done, in N + 1 processes: the caller and N copies.

A stop a signal asks for (sim/stop.py) is passed on to the figure process and from it to its
forked copies; each stops at its next figure write, and each waits for the processes it
started, so none outlives the run (or holds its stderr open).
"""
from __future__ import annotations

import gc
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence

from sim import stop
from sim.core.collector import gc_paused

OVERVIEW = "overview"     # (report.OVERVIEW: made of the other figures' panels)


def warm_up() -> None:
    """Import matplotlib and the plotting code, and load the font the figures' text is set in (the
    figure process does this while the parent simulates; copies forked after it inherit the
    loaded font). One text measured, no figure drawn: drawing a small one here cost ~0.16 G
    instructions that the figures' own first drawing did not save (docs/performance.md)."""
    with gc_paused():
        import sim.output.report  # noqa: F401
        from matplotlib.backends.backend_agg import RendererAgg
        from matplotlib.font_manager import FontProperties

        RendererAgg(10, 10, 72).get_text_width_height_descent("warm-up", FontProperties(), ismath=False)


@contextmanager
def fonts_made_in_memory() -> Iterator[None]:
    """Within: a font matplotlib opens from a file (ft2font.FT2Font given a path) is made from the
    file's bytes, read at once, instead. Given a path, FT2Font reads the font through a Python file
    object, a seek and a read (system calls outside the file object's buffer) each time FreeType
    asks for a piece: at every glyph it loads and, for every text laid out, the shaper's tables.
    From memory a text's layout takes ~1/3 of the time (DejaVu Sans, measured); the same bytes, so
    the same glyphs. Only where nothing reads a font's file name (FT2Font.fname: a file object
    here), as a PDF or PS backend would: the figure process, which draws PNGs only."""
    import io

    import matplotlib.font_manager  # noqa: F401  (its font list read, or made, first: that reads fname)
    from matplotlib import ft2font

    from_file = ft2font.FT2Font

    def from_memory(filename, *args, **kwargs):
        if isinstance(filename, (str, bytes, os.PathLike)):
            with open(filename, "rb") as file:
                filename = io.BytesIO(file.read())
        return from_file(filename, *args, **kwargs)

    ft2font.FT2Font = from_memory
    try:
        yield
    finally:
        ft2font.FT2Font = from_file


# Modules matplotlib's import reaches (from PIL, dateutil, fontTools and the standard library) that
# drawing the run's figures never reads: each was made lazy alone and the figures drawn (Vidur and
# quickstart), and these stayed unexecuted with the same pixels. ~9 % of the figure process's import.
UNREAD_BY_FIGURES = frozenset({
    "PIL.ExifTags", "PIL.ImageChops", "PIL.ImageMode", "PIL.ImagePalette", "PIL.ImageSequence", "PIL.TiffTags",
    "PIL.features", "dateutil._tzdata_impl", "fontTools.agl", "matplotlib._afm", "matplotlib._tight_bbox",
    "plistlib", "shlex"})


@contextmanager
def imported_lazily(names: frozenset) -> Iterator[None]:
    """Within: a module in `names`, when imported, is made but not executed until one of its names
    is first read (importlib.util.LazyLoader, the standard library's lazy import), so code that
    imports it and never uses it skips its cost. Pure-Python modules only."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import sys

    class LazyFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            spec = importlib.machinery.PathFinder.find_spec(name, path) if name in names else None
            if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
                return None              # (the usual finders then)
            spec.loader = importlib.util.LazyLoader(spec.loader)
            return spec

    finder = LazyFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def figure_process_start() -> None:
    """What the figure process does first, while the parent simulates: matplotlib imported without
    its Artist docstrings, without its 3D toolkit and with UNREAD_BY_FIGURES lazy, then warm_up.
    matplotlib writes each Artist subclass's `set()` docstring, a list of every property, as it imports (artist.kwdoc: ~30% of
    the import's instructions, measured); a process that only draws never reads one, so there the
    list is left empty. It also imports mpl_toolkits.mplot3d to offer a 3D projection, which no
    figure here uses (~8 % of the rest of the import): matplotlib goes on without it when the import
    fails, as it is made to here (its warning about that silenced), and the 3D toolkit stays
    importable afterwards. The figures' font is made from its file's bytes in memory
    (fonts_made_in_memory). Only where matplotlib has not been imported yet, and only in this process."""
    import sys
    import warnings

    if "matplotlib.artist" not in sys.modules:
        with gc_paused(), imported_lazily(UNREAD_BY_FIGURES):
            import matplotlib.artist

            if callable(getattr(matplotlib.artist, "kwdoc", None)):
                matplotlib.artist.kwdoc = lambda artist: ""
            if "mpl_toolkits.mplot3d" not in sys.modules:
                sys.modules["mpl_toolkits.mplot3d"] = None     # (an import then fails: Python's documented way)
                try:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message="Unable to import Axes3D")
                        import matplotlib.projections  # noqa: F401
                finally:
                    del sys.modules["mpl_toolkits.mplot3d"]
            with fonts_made_in_memory():     # (warm_up makes the figures' font: get_font keeps it)
                warm_up()
    else:
        warm_up()


def draw_share(views: Mapping, out_dir: str, title: str, names: Sequence[str]) -> dict[str, Path]:
    with gc_paused():
        from sim.output.report import plot_run_figures

        return plot_run_figures(views, out_dir, title, names)


def draw_in_parallel(views: Mapping, out_dir: str, title: str, names: Sequence[str], ways: int) -> dict[str, Path]:
    """Every figure in `names`, split `ways` ways over this process and forked copies of it (which
    inherit matplotlib, the fonts and the views); the overview, made of the others' panels, once
    they are all written (in one process: from the pixels it drew, not the files)."""
    if ways <= 1:
        return draw_share(views, out_dir, title, names)
    drawn = in_forked_shares([name for name in names if name != OVERVIEW], ways,
                             lambda share: draw_share(views, out_dir, title, share),
                             lambda name: Path(out_dir) / f"{name}.png")
    if OVERVIEW in names:
        drawn.update(draw_share(views, out_dir, title, [OVERVIEW]))
    return {name: drawn[name] for name in names}


def in_forked_shares(names: Sequence[str], ways: int, draw: Callable[[list[str]], Mapping[str, Path]],
                     path_of: Callable[[str], Path]) -> dict[str, Path]:
    """draw(share) for `ways` shares of `names`: the first share here, each other one in a forked
    copy of this process, all at once. Every name must give a file, at path_of(name)."""
    shares = [list(names[i::ways]) for i in range(ways) if names[i::ways]]
    if not shares:
        return {}
    children = []
    with ExitStack() as forwards:
        try:
            for share in shares[1:]:
                with frozen_heap():
                    pid = os.fork()
                if pid == 0:                               # the copy: draw, then leave without cleanup
                    code = 1
                    try:
                        stop.in_worker()
                        draw(share)
                        code = 0
                    finally:
                        os._exit(code)
                children.append(pid)
                forwards.enter_context(stop.forwarding(stop.forward_to_pid(pid)))
            drawn = dict(draw(shares[0]))
        finally:                                           # even when stopping: no copy outlives this
            codes = [os.waitpid(pid, 0)[1] for pid in children]
    stop.check()                                           # a copy that stopped is not a failure
    failed = [share for code, share in zip(codes, shares[1:]) if code != 0]
    if failed:
        raise RuntimeError(f"drawing {', '.join(failed[0])} failed (run with KVTWIN_PLOT_WORKERS=1 to see why)")
    for share in shares[1:]:
        drawn.update({name: path_of(name) for name in share})
    return {name: drawn[name] for name in names}


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Around a fork: the objects alive now are moved out of the cyclic collector's reach
    (gc.freeze) until the fork is done, so the child's collections (matplotlib's import makes
    several) never write to the pages it shares with its parent, each of which would then be
    copied: ~1/3 of the figure processes' page faults (docs/performance.md). The parent's
    collector gets them back at once; the child keeps them frozen (it lives for one run)."""
    parent = os.getpid()
    gc.freeze()
    try:
        yield
    finally:
        if os.getpid() == parent:
            gc.unfreeze()


def figure_processes() -> int:
    """KVTWIN_PLOT_WORKERS (default 1): the processes that draw a run's figures beside the main one."""
    text = os.environ.get("KVTWIN_PLOT_WORKERS", "").strip() or "1"
    if not (text.isascii() and text.isdigit()) or int(text) > 64:
        from sim.errors import UserError
        raise UserError(f"KVTWIN_PLOT_WORKERS={text!r}: expected a whole number from 0 to 64")
    return int(text)


def plot_ways() -> int:
    """The shares a sweep's figures are drawn in: the calling process's and its figure processes'."""
    return 1 + figure_processes()


def can_fork_here() -> bool:
    """fork copies one thread only: with other threads alive (a server, a test runner's helpers)
    a lock one of them holds would stay locked in the child forever."""
    import multiprocessing
    import threading

    return threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()


def run_plot_names() -> list[str]:
    # the same names as report.RUN_FIGURES, without importing matplotlib here
    return [OVERVIEW, "kv_blocks", "queue", "batch_tokens", "latency_cdf", "step_time"]


class FigureWorkers:
    def __init__(self, workers: Optional[int] = None) -> None:
        self.workers = figure_processes() if workers is None else workers
        self.pool = None
        self._forwarding = ExitStack()
        if self.workers >= 1 and can_fork_here():      # else draw here
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"),
                                            initializer=stop.in_worker)
            with frozen_heap():
                self.pool.submit(figure_process_start)    # (forks the figure process)
            self._forwarding.enter_context(stop.forwarding(stop.forward_to_pool(self.pool)))

    def draw(self, views: Mapping, out_dir: str | Path, title: str = "") -> dict[str, Path]:
        names = run_plot_names()
        if self.pool is None:
            return draw_share(views, str(out_dir), title, names)
        from sim.output.views import drawable_views

        drawable = drawable_views(views)      # reductions only: small to send
        return self.pool.submit(draw_in_parallel, drawable, str(out_dir), title, names, self.workers).result()

    def close(self) -> None:
        if self.pool is not None:
            try:
                self.pool.shutdown(wait=True, cancel_futures=True)
            finally:
                self._forwarding.close()
                self.pool = None

    def __enter__(self) -> "FigureWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
