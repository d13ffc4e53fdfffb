"""Numbers as the planner prints them: bytes, seconds, percentages.

Example:
    >>> human_bytes(1.5e9), short_bytes(2.5e6), human_time(0.0123), percent(0.034), percent(0.004)
    ('1.50 GB', '2.5M', '12.3 ms', '3%', '0.4%')
"""

from __future__ import annotations

__all__ = ["human_bytes", "short_bytes", "percent", "human_time"]


def human_bytes(n: float) -> str:
    """``1.5e9`` -> ``"1.50 GB"``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def short_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"


def percent(x: float) -> str:
    """``0.034`` -> ``"3%"``, ``0.004`` -> ``"0.4%"``."""
    return f"{x:.0%}" if x >= 0.01 or x == 0 else f"{x:.1%}"


def human_time(t: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``."""
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"
