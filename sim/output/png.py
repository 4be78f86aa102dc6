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
from typing import Mapping, Optional

import numpy as np

from sim.output.io import write_bytes

SIGNATURE = b"\x89PNG\r\n\x1a\n"
LEVEL = 1                  # deflate's fastest: with the Up filter, as small as Pillow's default here
FILTER_NONE, FILTER_UP = 0, 2


def png_bytes(rgba: np.ndarray, dpi: float, software: str = "", texts: Optional[Mapping[str, str]] = None) -> bytes:
    """(height, width, 4) uint8 pixels (or (height, width, 3): opaque) as a PNG: RGB when every
    pixel is opaque, with the resolution (pHYs), a Software text as matplotlib writes them and
    `texts` as further tEXt chunks."""
    height, width, channels = rgba.shape
    opaque = channels == 3 or rgba.size == 0 or int(rgba[..., 3].min()) == 255     # (one pass, no mask array)
    pixels = rgba[..., :3] if opaque else rgba
    if not pixels.flags.c_contiguous:                             # (numpy subtracts contiguous rows fastest)
        pixels = copy_channels(np.empty(pixels.shape, dtype=np.uint8), pixels)
    rows = pixels.reshape(height, -1)
    filtered = np.empty((height, rows.shape[1] + 1), dtype=np.uint8)
    filtered[:1, 0] = FILTER_NONE
    filtered[:1, 1:] = rows[:1]
    filtered[1:, 0] = FILTER_UP
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])          # (uint8: modulo 256, as PNG's Up)
    per_metre = int(dpi / 0.0254 + 0.5)
    parts = [SIGNATURE,
             _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2 if opaque else 6, 0, 0, 0)),
             _chunk(b"pHYs", struct.pack(">IIB", per_metre, per_metre, 1))]
    for key, text in {**({"Software": software} if software else {}), **(texts or {})}.items():
        parts.append(_chunk(b"tEXt", key.encode("latin-1") + b"\0" + text.encode("latin-1", "replace")))
    parts += [_chunk(b"IDAT", zlib.compress(filtered, LEVEL)), _chunk(b"IEND", b"")]
    return b"".join(parts)


def copy_channels(out: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """out[...] = pixels, a channel at a time: numpy copies a view with a 3-byte last axis (RGB of
    RGBA pixels) in an inner loop of 3 bytes, ~5x the time of the 3 channels' long strided loops."""
    for channel in range(pixels.shape[-1]):
        out[..., channel] = pixels[..., channel]
    return out


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png(path: str | Path, rgba: np.ndarray, dpi: float, software: str = "",
              texts: Optional[Mapping[str, str]] = None) -> Path:
    """png_bytes written atomically to `path`."""
    return write_bytes(path, png_bytes(rgba, dpi, software, texts))


def read_png(path: str | Path) -> tuple[np.ndarray, dict[str, str]]:
    """A PNG that png_bytes wrote: its (height, width, 3 or 4) uint8 pixels and its tEXt chunks.
    Only that kind (8 bits, RGB or RGBA, rows filtered None then Up): anything else is refused."""
    data = Path(path).read_bytes()
    if not data.startswith(SIGNATURE):
        raise ValueError(f"{path}: not a PNG")
    at, header, texts, idat = len(SIGNATURE), b"", {}, []
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        at += 12 + length
        if kind == b"IHDR":
            header = body
        elif kind == b"tEXt":
            key, _, text = body.partition(b"\0")
            texts[key.decode("latin-1")] = text.decode("latin-1")
        elif kind == b"IDAT":
            idat.append(body)
    if len(header) != 13 or header[8:] not in (bytes([8, 2, 0, 0, 0]), bytes([8, 6, 0, 0, 0])):
        raise ValueError(f"{path}: not a PNG this module wrote (8-bit RGB or RGBA, not interlaced)")
    width, height = struct.unpack(">II", header[:8])
    channels = 3 if header[9] == 2 else 4
    rows = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, 1 + width * channels)
    if height and (rows[0, 0] != FILTER_NONE or (rows[1:, 0] != FILTER_UP).any()):
        raise ValueError(f"{path}: rows filtered other than as this module writes them")
    pixels = np.cumsum(rows[:, 1:], axis=0, dtype=np.uint8)       # Up undone (uint8: modulo 256)
    return pixels.reshape(height, width, channels), texts
