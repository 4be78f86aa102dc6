"""The cyclic garbage collector paused around work that makes objects by the hundred thousand and
few cycles: building and simulating a workload, importing matplotlib and drawing figures."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused() -> Iterator[None]:
    """Building (and simulating) 100k requests allocates millions of small objects, none of
    them in a cycle, and matplotlib's import and drawing hundreds of thousands (its collections
    were ~7 % of the figure process's CPU); the cyclic collector's repeated passes over them cost
    more than the work. Nested uses leave it to the outermost."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            # Everything allocated meanwhile sits in the youngest generation, so the first
            # collection after re-enabling would walk all of it (~10% of a run). Move it to the
            # oldest generation instead, as surviving a collection would: any cycle in it is
            # still collected, by the next full collection.
            gc.freeze()
            gc.enable()
            gc.unfreeze()
