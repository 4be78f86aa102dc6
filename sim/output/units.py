"""One unit system for everything a person reads: the run table, sweeps and plans, bench and
compare, validate, and every HTML page.

- latencies in milliseconds (the unit goes in the column or row label: "TTFT p99 (ms)"),
  run lengths in seconds;
- shares as percentages with the sign in the cell ("47.7%"), differences and relative errors
  signed ("+3.1%", "-12%");
- memory in GiB ("0.93 GiB");
- counts with thousands separators ("13,213"); other numbers to 3-4 significant digits.

Files keep machine units (summary.json: seconds, fractions, bytes; see docs/outputs.md); only
what is displayed goes through here. No pandas at import (the CLI's help must stay light).
"""
from __future__ import annotations

import math
from typing import Any, Optional

EMPTY = "—"
GIB = 2.0 ** 30

# kinds of value, each with its display scale and formatter
KINDS = ("count", "number", "s", "ms", "pct", "signed_pct", "gib", "ratio", "text")


def is_number(value: Any) -> bool:
    if isinstance(value, bool) or value is None:
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, str)


def _missing(value: Any) -> bool:
    return value is None or (is_number(value) and math.isnan(float(value)))


def format_value(value: Any) -> str:
    """A plain number: counts with thousands separators, other numbers to about 3-4 digits."""
    if value is None:
        return EMPTY
    if not is_number(value):
        return str(value)
    v = float(value)
    if math.isnan(v):
        return EMPTY
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    if v.is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"
    size = abs(v)
    if size >= 1000:
        return f"{v:,.0f}"
    if size >= 100:
        return f"{v:.1f}"
    if size >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def count(value: Any) -> str:
    return EMPTY if _missing(value) else f"{round(float(value)):,}"


def ms(seconds: Any) -> str:
    """A latency given in seconds, as a bare number of milliseconds (the label carries 'ms')."""
    return EMPTY if _missing(seconds) else format_value(float(seconds) * 1e3)


def ms_unit(seconds: Any) -> str:
    """A latency with its unit, for prose: '12.3 ms' (or '4.2 s' from 1 s up)."""
    if _missing(seconds):
        return EMPTY
    v = float(seconds)
    return f"{format_value(v)} s" if abs(v) >= 1 else f"{format_value(v * 1e3)} ms"


def pct(fraction: Any, signed: bool = False) -> str:
    """A share given as a fraction, as a percentage with the sign: 0.477 -> '47.7%'."""
    if _missing(fraction):
        return EMPTY
    v = float(fraction) * 100
    if math.isinf(v):
        return format_value(v) + "%"
    size = abs(v)
    digits = 0 if size >= 100 or v == 0 else 1 if size >= 1 else 2 if size >= 0.01 else 3
    while digits < 3 and size < 100 <= round(size, digits):    # 99.96% of requests is not "100.0%"
        digits += 1
    text = f"{v:+.{digits}f}%" if signed else f"{v:.{digits}f}%"
    return text


def signed_pct(fraction: Any) -> str:
    return pct(fraction, signed=True)


def money(dollars: Any) -> str:
    """'$2.00', '$0.80', '$0.031': cents from ten cents up, else two significant digits."""
    if _missing(dollars):
        return EMPTY
    value = float(dollars)
    return f"${value:,.2f}" if abs(value) >= 0.1 or value == 0 else f"${value:.2g}"


def gib(nbytes: Any) -> str:
    if _missing(nbytes):
        return EMPTY
    v = float(nbytes) / GIB
    return f"{v:,.0f} GiB" if abs(v) >= 100 else f"{v:.3g} GiB"


def ratio(value: Any) -> str:
    """A ratio to a baseline: '1.93x'."""
    if _missing(value):
        return EMPTY
    v = float(value)
    return f"{v:,.0f}x" if abs(v) >= 100 else f"{v:.1f}x" if abs(v) >= 10 else f"{v:.2f}x" if abs(v) >= 0.1 \
        else f"{v:.2g}x"


def seconds(value: Any) -> str:
    return EMPTY if _missing(value) else format_value(float(value))


FORMATTERS = {"count": count, "number": format_value, "s": seconds, "ms": ms, "pct": pct,
              "signed_pct": signed_pct, "gib": gib, "ratio": ratio, "text": str}
SCALES = {"ms": 1e3, "pct": 100.0, "signed_pct": 100.0, "gib": 1 / GIB}


def display(value: Any, kind: str) -> str:
    """`value` in machine units (seconds, fractions, bytes) shown as `kind`."""
    return FORMATTERS[kind](value)


def display_number(value: Any, kind: str) -> Optional[float]:
    """`value` in display units as a float (ms, percent, GiB), for plots and numeric tables."""
    if _missing(value):
        return math.nan
    return float(value) * SCALES.get(kind, 1.0)
