"""Numbers as people read them: one home for every summary, explain, drawing and timeline.

Bytes use IEC units (KiB = 1024 B) everywhere; seconds pick s, ms or µs; counts use
K, M, G (powers of 1000); FLOPs and FLOP/s use SI prefixes. Nothing here imports torch.
"""

from __future__ import annotations

import math

_IEC = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def nbytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``inf`` -> ``"unlimited"`` (a memory with no limit)."""
    if not math.isfinite(count):
        return "unlimited"
    value = float(count)
    for unit in _IEC:
        if abs(value) < 1024 or unit == _IEC[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def seconds(value: float) -> str:
    """``0.0123`` -> ``"12.30 ms"``; 3 significant decimals in the unit that fits."""
    if value == 0:
        return "0 s"
    if abs(value) >= 1:
        return f"{value:.2f} s"
    if abs(value) >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.0f} µs"


def time_unit(value: float) -> tuple[float, str]:
    """The (scale, unit) that ``seconds`` would use for ``value``: for axes and tables."""
    if abs(value) >= 1:
        return 1.0, "s"
    if abs(value) >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def count(value: float) -> str:
    """``1_234_567`` -> ``"1.23M"``; below 1000 the integer itself."""
    for scale, unit in _SI[2:]:
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return str(int(value))


def flops(value: float) -> str:
    """``2.5e9`` -> ``"2.5 GFLOP"``."""
    for scale, unit in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}FLOP"
    return f"{value:.0f} FLOP"
