"""Numbers for people: sizes in binary units, durations in the unit that reads best, counts with separators.

Every function returns ``-`` for a missing value (None or NaN), so table cells never read ``nan``.
"""

from __future__ import annotations

import math
from typing import Final

MISSING: Final = "-"
_BINARY_UNITS: Final = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _missing(value: float | int | None) -> bool:
    if value is None:
        return True
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return True


def human_bytes(n: float | int | None) -> str:
    """``25690112`` -> ``24.5 MiB``; three significant digits, binary units."""
    if _missing(n):
        return MISSING
    value = float(n)  # type: ignore[arg-type]
    unit = 0
    while abs(value) >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.3g} {_BINARY_UNITS[unit]}" if abs(value) >= 100 else f"{value:.1f} {_BINARY_UNITS[unit]}"


def human_ms(ms: float | int | None) -> str:
    """A duration given in milliseconds: ``0.4 ms``, ``15 ms``, ``1.25 s``, ``2.5 min``, ``1.2 h``."""
    if _missing(ms):
        return MISSING
    v = float(ms)  # type: ignore[arg-type]
    if abs(v) < 10:
        return f"{v:.1f} ms"
    if abs(v) < 1000:
        return f"{v:.0f} ms"
    return human_s(v / 1000.0)


def human_s(s: float | int | None) -> str:
    """A duration given in seconds: ``850 ms``, ``4.2 s``, ``38 s``, ``2.5 min``, ``1.2 h``, ``3.0 d``."""
    if _missing(s):
        return MISSING
    v = float(s)  # type: ignore[arg-type]
    if abs(v) < 1:
        return f"{v * 1000:.0f} ms"
    if abs(v) < 10:
        return f"{v:.2g} s" if v == int(v) else f"{v:.1f} s"
    if abs(v) < 120:
        return f"{v:.0f} s"
    if abs(v) < 7200:
        return f"{v / 60:.1f} min"
    if abs(v) < 172800:
        return f"{v / 3600:.1f} h"
    return f"{v / 86400:.1f} d"


def human_count(n: float | int | None) -> str:
    """``24576`` -> ``24,576`` (never abbreviated: token counts are read exactly)."""
    if _missing(n):
        return MISSING
    return f"{round(float(n)):,}"  # type: ignore[arg-type]


def human_share(x: float | None, digits: int = 0) -> str:
    """``0.8912`` -> ``89%``."""
    if _missing(x):
        return MISSING
    return f"{float(x) * 100:.{digits}f}%"  # type: ignore[arg-type]


def human_ratio(x: float | None) -> str:
    """A speed-up: ``1.31`` -> ``1.31x``."""
    if _missing(x):
        return MISSING
    return f"{float(x):.2f}x"  # type: ignore[arg-type]
