"""Parsing and printing byte and time quantities (``80GiB``, ``1.5 TB``, ``12 ms``)."""

from __future__ import annotations

import re

from memshard.errors import MemshardError

_BYTE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` → 85899345920. Decimal (GB) and binary (GiB) units, case-insensitive."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise MemshardError(f"cannot read {text!r} as a size in bytes (try e.g. 80GiB or 40GB)")
    value = float(match.group(1)) * _BYTE_UNITS[unit]
    if value <= 0:
        raise MemshardError(f"a size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Binary units with three significant digits: ``12.3 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"
