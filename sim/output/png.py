"""A drawn figure's pixels written as a PNG with numpy and zlib.

matplotlib saves a PNG through Pillow, whose encoder tries all five PNG row filters on every
row and keeps the best (in C, but five passes over ~1.5 MB a figure), then deflates at level 6:
two thirds of the instructions of saving simrun's six figures went there (docs/performance.md).
A plot is mostly flat colour, so one filter for every row ("Up": each byte minus the byte above,
zero wherever a row repeats the one above) and deflate's fastest level give files of the same
size at about a quarter of the cost. The pixels are the ones matplotlib's Agg canvas drew,
unchanged; an opaque figure (every figure here: a white face) is stored as RGB.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from sim.output.io import write_bytes

SIGNATURE = b"\x89PNG\r\n\x1a\n"
LEVEL = 1                  # deflate's fastest: with the Up filter, as small as Pillow's default here
FILTER_NONE, FILTER_UP = 0, 2


def png_bytes(rgba: np.ndarray, dpi: float, software: str = "") -> bytes:
    """(height, width, 4) uint8 pixels as a PNG: RGB when every pixel is opaque, with the
    resolution (pHYs) and a Software text as matplotlib writes them."""
    height, width, _ = rgba.shape
    opaque = rgba.size == 0 or int(rgba[..., 3].min()) == 255      # (one pass, no mask array)
    pixels = rgba[..., :3] if opaque else rgba
    rows = np.ascontiguousarray(pixels).reshape(height, -1)      # (numpy subtracts contiguous rows fastest)
    filtered = np.empty((height, rows.shape[1] + 1), dtype=np.uint8)
    filtered[:1, 0] = FILTER_NONE
    filtered[:1, 1:] = rows[:1]
    filtered[1:, 0] = FILTER_UP
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])          # (uint8: modulo 256, as PNG's Up)
    per_metre = int(dpi / 0.0254 + 0.5)
    parts = [SIGNATURE,
             _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2 if opaque else 6, 0, 0, 0)),
             _chunk(b"pHYs", struct.pack(">IIB", per_metre, per_metre, 1))]
    if software:
        parts.append(_chunk(b"tEXt", b"Software\0" + software.encode("latin-1", "replace")))
    parts += [_chunk(b"IDAT", zlib.compress(filtered, LEVEL)), _chunk(b"IEND", b"")]
    return b"".join(parts)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png(path: str | Path, rgba: np.ndarray, dpi: float, software: str = "") -> Path:
    """png_bytes written atomically to `path`."""
    return write_bytes(path, png_bytes(rgba, dpi, software))
