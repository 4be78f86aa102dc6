"""CSV from columns of numpy arrays, byte for byte what pandas' `to_csv(index=False)` writes,
several times faster (4-5x on a run's files, measured side by side): a million-request run's
files take seconds, not half a minute.

pandas formats every cell as a Python object (and floats through numpy's slow shortest-digits
formatting). Here each column becomes a block of bytes at once, a row per cell, padded with
NUL bytes: integers digit by digit in numpy, floats as their shortest round-trip text (Python's
`repr`, which is pandas' text too; pyarrow's C++ formatter where it is installed and gives the
same text, checked by tests/output/test_columns_csv.py), text columns once per distinct value. The
blocks of a chunk of rows are laid side by side with the commas and newlines, and the NULs
dropped from the bytes in one pass.

Columns this does not format (other dtypes, text holding NUL) make `csv_chunks` return None:
the caller then writes with pandas.

It sits in the simulation layer, below sim/output/, because the manifest's workload digest
(sim/predict.py) makes its text from the same cells the CSV writer does.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterator, Mapping, Optional

import numpy as np

CHUNK_ROWS = 65_536           # rows formatted at once: bounded memory for a million-row file
_COMMA, _NEWLINE = ord(","), ord("\n")
_NEEDS_QUOTES = (",", '"', "\n", "\r")
# Where pyarrow's float text is Python's repr (checked over millions of values, boundaries in
# the tests): non-integral magnitudes in [1e-4, 1e9). Elsewhere repr is used.
_ARROW_LOW, _ARROW_HIGH = 1e-4, 1e9
_WHOLE_BELOW = 2.0 ** 53
_DOT_ZERO = np.frombuffer(b".0", np.uint8)


class Unsupported(Exception):
    """A column this writer does not format exactly as pandas does."""


def csv_chunks(columns: Mapping[str, np.ndarray]) -> Optional[Iterator[bytes]]:
    """The CSV's bytes (header, then chunks of rows), or None when a column is not supported."""
    names = list(columns)
    if not names or any(not isinstance(n, str) or _needs_quotes(n) or "\0" in n for n in names):
        return None
    arrays = [np.asarray(columns[n]) for n in names]
    if len(arrays) == 1 or len({len(a) for a in arrays}) != 1 or not all(map(_supported, arrays)):
        return None                      # (one column: csv quotes an empty cell there, pandas' way)
    try:
        texts = [_distinct_texts(a) if a.dtype.kind == "O" else None for a in arrays]
    except Unsupported:
        return None
    return _chunks(names, arrays, texts)


def _chunks(names: list[str], arrays: list[np.ndarray], texts: list) -> Iterator[bytes]:
    yield (",".join(names) + "\n").encode()
    n = len(arrays[0])
    fixed = [_one_cell(values) if text is None else None for values, text in zip(arrays, texts)]
    for start in range(0, n, CHUNK_ROWS):
        stop = min(n, start + CHUNK_ROWS)
        blocks = []
        for i, (values, text, cell) in enumerate(zip(arrays, texts, fixed)):
            blocks.append(_cells(values[start:stop], text, start, stop) if cell is None
                          else np.broadcast_to(cell, (stop - start, cell.shape[1])))
            blocks.append(np.full((stop - start, 1), _COMMA if i < len(arrays) - 1 else _NEWLINE, np.uint8))
        yield np.hstack(blocks).tobytes().replace(b"\0", b"")


def _one_cell(values: np.ndarray) -> Optional[np.ndarray]:
    """The (1, width) cell of a number or bool column holding one value throughout, bit for bit
    (0.0 and -0.0 are two), else None: its text made once, not row by row (a run's replica,
    priority, preemptions and host_s: ~8 % of requests.csv's formatting at a million rows)."""
    if len(values) < 2:
        return None
    bits = values.view(np.int64) if values.dtype.kind == "f" else values      # (floats: float64)
    if bits[0] != bits[-1] or not (bits == bits[0]).all():
        return None
    return _cells(values[:1], None, 0, 1)


def joined_rows(parts: list, rows: int) -> bytes:
    """Rows of text laid out as the CSV's rows are: each part a (rows, width) NUL-padded block of
    cells (`int_cells`, `float_cells`, `bytes_block`) or bytes every row carries; the rows' texts
    one after another, nothing between them (the manifest's workload digest: sim/predict.py)."""
    blocks = [np.broadcast_to(np.frombuffer(p, np.uint8), (rows, len(p))) if isinstance(p, bytes) else p
              for p in parts]
    return np.hstack(blocks).tobytes().replace(b"\0", b"")


def _supported(a: np.ndarray) -> bool:
    return a.ndim == 1 and (a.dtype.kind in "iubO" or a.dtype == np.float64)


def _needs_quotes(text: str) -> bool:
    return any(c in text for c in _NEEDS_QUOTES)


def _cells(values: np.ndarray, text, start: int, stop: int) -> np.ndarray:
    """One column's cells as a (rows, width) uint8 block, NUL-padded."""
    kind = values.dtype.kind
    if kind == "f":
        return float_cells(values)
    if kind in "iu":
        return int_cells(values)
    if kind == "b":
        return bytes_block(np.where(values, b"True", b"False"))
    codes, table = text
    return bytes_block(table[codes[start:stop]])


def bytes_block(cells: np.ndarray) -> np.ndarray:
    """A fixed-width bytes array ('S') as its (rows, width) uint8 block."""
    if cells.dtype.itemsize == 0:
        return np.zeros((len(cells), 0), np.uint8)
    return cells.view(np.uint8).reshape(len(cells), cells.dtype.itemsize)


def int_cells(values: np.ndarray) -> np.ndarray:
    """Decimal text, NUL-padded: pyarrow's cast where installed, else digit by digit in numpy."""
    if len(values) == 0:
        return np.zeros((0, 0), np.uint8)
    arrow = _pyarrow()
    if arrow is not None:
        return _arrow_block(arrow, values)
    if values.dtype.kind == "u" and int(values.max()) > np.iinfo(np.int64).max \
            or int(values.min()) == np.iinfo(np.int64).min:
        return bytes_block(np.array([str(x).encode() for x in values.tolist()], dtype="S"))
    v = values.astype(np.int64)
    magnitude = np.abs(v)
    width = len(str(int(magnitude.max())))
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    lead = magnitude[:, None] < powers
    lead[:, -1] = False                                  # 0 is one digit
    block = np.zeros((len(v), width + 1), np.uint8)      # column 0: room for a sign
    block[:, 1:] = (magnitude[:, None] // powers) % 10 + ord("0")
    block[:, 1:][lead] = 0
    negative = np.flatnonzero(v < 0)
    if len(negative):
        block[negative, lead[negative].sum(axis=1)] = ord("-")
    return block


def float_cells(values: np.ndarray) -> np.ndarray:
    """Shortest round-trip text (Python's repr, as pandas writes), NaN as an empty cell."""
    n = len(values)
    nan = np.isnan(values)
    arrow = _pyarrow()
    magnitude = np.abs(values)
    if arrow is None:
        by_repr = ~nan
        block = np.zeros((n, 0), np.uint8)
    else:
        by_repr = ~nan & ~((magnitude >= _ARROW_LOW) & (magnitude < _ARROW_HIGH) & (values != np.floor(values)))
        block = _arrow_block(arrow, values)
    # A whole number below 2**53 (< 1e16: no exponent) is its integer's text and ".0" in repr, -0.0
    # apart: a column of them (a run's host_s, all 0.0) is not formatted a value at a time.
    whole = by_repr & (values == np.floor(values)) & (magnitude < _WHOLE_BELOW) & ~((values == 0) & np.signbit(values))
    if whole.any():
        digits = int_cells(values[whole].astype(np.int64))
        block = _placed(block, whole, np.hstack([digits, np.full((len(digits), 2), _DOT_ZERO)]))
        by_repr &= ~whole
    if by_repr.any():
        block = _placed(block, by_repr, _text_block(list(map(float.__repr__, values[by_repr].tolist()))))
    block[nan] = 0
    return block


def _placed(block: np.ndarray, rows: np.ndarray, texts: np.ndarray) -> np.ndarray:
    """`block` (widened where `texts` is wider) with the cells of `rows` replaced by `texts`."""
    if texts.shape[1] > block.shape[1]:
        block = np.hstack([block, np.zeros((len(block), texts.shape[1] - block.shape[1]), np.uint8)])
    block[rows] = 0
    block[rows, :texts.shape[1]] = texts
    return block


def _text_block(texts: list[str]) -> np.ndarray:
    """ASCII strings as a NUL-padded uint8 block (numpy stores them as 4-byte code points)."""
    u = np.array(texts)
    return u.view(np.uint32).reshape(len(u), -1).astype(np.uint8)


def _arrow_block(arrow, values: np.ndarray) -> np.ndarray:
    """pyarrow's number -> text cast, each text padded with NULs to one width by pyarrow's rpad,
    whose data buffer is then the block (~6x faster than laying the cast's texts out in numpy by
    a mask). The kernels are called through pyarrow._compute: pyarrow.compute's import builds ~300
    wrappers from docstrings, ~0.2 G instructions, a fixed cost of every simrun."""
    pa, cast, padded = arrow
    values = np.ascontiguousarray(values)
    n = len(values)
    # from the buffer: pa.array(values) imports pandas (~0.4 s) to check for its types
    array = pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), n, [None, pa.py_buffer(values)])
    strings = cast(array)
    width = max(1, int(np.diff(_offsets(strings)).max(initial=0)))
    strings = padded(strings, width)
    start = int(_offsets(strings)[0])
    return np.frombuffer(strings.buffers()[2], np.uint8, n * width, start).reshape(n, width)


def _offsets(strings) -> np.ndarray:
    """A pyarrow string array's offsets (its texts' bounds in its data buffer)."""
    return np.frombuffer(strings.buffers()[1], np.int32, len(strings) + 1, strings.offset * 4)


@lru_cache(maxsize=1)
def _pyarrow():
    """(pyarrow, its cast of an array to text, its padding of texts with NULs to a width), or None
    where pyarrow is not installed."""
    try:
        import pyarrow as pa
        from pyarrow._compute import CastOptions, PadOptions, call_function
    except ImportError:
        return None
    to_text = CastOptions.safe(pa.string())
    return (pa, lambda array: call_function("cast", [array], to_text),
            lambda strings, width: call_function("ascii_rpad", [strings], PadOptions(width, "\0")))


def _distinct_texts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A text (object) column as (a code per row, the bytes of each code): each distinct value is
    formatted once (str(), quoted where it holds a comma, quote or line break; missing: empty)."""
    items = values.tolist()
    kinds = set(map(type, items)) - {str, type(None)}
    if len(kinds) > 1:
        raise Unsupported("mixed types")     # 1, 1.0 and True are one value to a dict, not to pandas
    codes, uniques = _factorize(items)
    cells = []
    for value in uniques:
        if not isinstance(value, (str, int, float)):
            raise Unsupported(type(value).__name__)
        text = value if isinstance(value, str) else str(value)
        if "\0" in text:
            raise Unsupported("NUL")
        if _needs_quotes(text):
            text = '"' + text.replace('"', '""') + '"'
        cells.append(text.encode())
    table = np.array(cells + [b""], dtype="S")           # code -1 (missing): the last, empty
    return codes, table


def _factorize(items: list) -> tuple[np.ndarray, list]:
    """(a code per item, the distinct values in order of appearance); None and NaN are missing
    (code -1), as pandas.factorize has them."""
    distinct = dict.fromkeys(items)                   # (each loop over the items runs in C)
    uniques = [v for v in distinct if not (v is None or v != v)]
    code = {v: -1 for v in distinct}
    code.update(zip(uniques, range(len(uniques))))
    if len(code) == 1:                                # (one value throughout: a column of None, say)
        return np.full(len(items), code[next(iter(code))], np.int64), uniques
    return np.fromiter(map(code.__getitem__, items), np.int64, len(items)), uniques
