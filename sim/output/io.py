"""Atomic output: write to a temporary file beside the target, then rename over it."""
from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from sim import stop


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; it replaces `path` only if the block succeeds.
    Every output write is a point where a run stops if a signal asked it to (sim/stop.py)."""
    stop.check()
    path = Path(path)
    _check_inside(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)          # mkstemp makes files owner-only; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_ROOTS: list[Path] = []      # the run folders being written (sim.output.run_dir): writes stay inside


@contextmanager
def confined_to(folder: str | Path) -> Iterator[None]:
    """While open, every atomic write must land inside `folder` once links are followed: a link
    in it (left there by someone else, kept by --force) cannot carry a write outside."""
    _ROOTS.append(Path(folder).resolve())
    try:
        yield
    finally:
        _ROOTS.pop()


def _check_inside(path: Path) -> None:
    if not _ROOTS:
        return
    root = _ROOTS[-1]
    existing = next(p for p in (path.parent, *path.parent.parents) if p.exists() or p.is_symlink())
    real = existing.resolve()
    if real != root and root not in real.parents:
        from sim.errors import UserError

        raise UserError(f"{existing}: leads outside the output folder {root} (a link?); kvtwin does not "
                        f"write through it: remove it, or pick another --out")


def write_text(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_json(path: str | Path, data: Any) -> Path:
    """Valid JSON always: NaN and infinities (which json.dumps writes bare) become null."""
    return write_text(path, json.dumps(finite_json(data), indent=2, allow_nan=False) + "\n")


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by None and numpy/Path values made plain."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return finite_json(plain_value(value))


def write_csv(path: str | Path, frame) -> Path:
    """A DataFrame, or a mapping of equal-length columns, as CSV without an index: what pandas'
    `to_csv(index=False)` writes, through the columnar writer where it formats every column
    (sim/columns.py), else through pandas."""
    from sim.columns import csv_chunks

    columns = frame if isinstance(frame, Mapping) else _frame_columns(frame)
    chunks = csv_chunks(columns) if columns is not None else None
    with atomic_path(path) as tmp:
        if chunks is None:
            _as_frame(frame).to_csv(tmp, index=False)
        else:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
    return Path(path)


def _frame_columns(frame) -> Optional[dict]:
    """A frame's columns as arrays, or None where the columnar writer cannot stand in for pandas
    (an index to write, repeated column names, a column of an extension type other than text)."""
    import numpy as np
    import pandas as pd

    if frame.columns.has_duplicates or isinstance(frame.columns, pd.MultiIndex):
        return None
    columns = {}
    for name in frame.columns:
        column = frame[name]
        if isinstance(column.dtype, pd.StringDtype) or column.dtype == object:
            columns[name] = column.to_numpy(dtype=object)
        elif isinstance(column.dtype, np.dtype):
            columns[name] = column.to_numpy()
        else:
            return None
    return columns


def _as_frame(frame):
    import pandas as pd

    return frame if isinstance(frame, pd.DataFrame) else pd.DataFrame(dict(frame))


def plain_value(value: Any) -> Any:
    """A Path as text, a numpy scalar or array as Python values (json.dumps' `default`)."""
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):          # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
