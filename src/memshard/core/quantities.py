"""Parsing and printing quantities: bytes (``80GiB``, ``1.5 TB``), seconds (``12 ms``), counts
(``6.66B`` parameters) and counted nouns (``1 device``, ``8 devices``).

What a user types is read here, each kind with its range: a count is a whole number from 1 to
``MAX_COUNT``, a duration a finite number of seconds up to ``MAX_SECONDS``, a size in bytes a
finite number of at least one byte (``MAX_BYTES`` bounds a device's memory and a budget), a
factor on a step time (a slack, a slowdown) at most ``MAX_FACTOR``; a value out of range is a
:class:`MemshardError` naming it.

Printed figures have three significant digits and never use scientific notation: a unit
changes where the rounded figure would reach 1000 (1023.9 MiB prints ``1 GiB``, 999.96 ms
``1 s``); past the largest unit the figure keeps plain digits (``8,880 PiB``, ``3,600 s``).
"""

from __future__ import annotations

import math
import re

from memshard.core.errors import MemshardError

_BYTE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50,
}
_BINARY = ("KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT = ("K", "M", "B", "T")  # thousand, million, billion, trillion
_SECONDS = ((1e-9, "ns"), (1e-6, "µs"), (1e-3, "ms"), (1.0, "s"))
_TOP = 999.5  # a figure that rounds to 1000 or more at three significant digits

# The ranges of what a user types (guards against runaway input: no job comes near them).
MAX_COUNT = 1 << 24  # sequences, tokens, model sizes, steps, points: 16,777,216
MAX_SECONDS = 1e6  # a step-time budget, a solver limit, a timeout: 11.6 days
MAX_BYTES = 1 << 60  # a device's memory or a memory budget: 1,024 PiB
MAX_FACTOR = 1e6  # a slack or slowdown factor on a step time


def parse_bytes(text: str) -> int:
    """``"80GiB"`` → 85899345920. Decimal (GB) and binary (GiB) units, case-insensitive; what
    :func:`format_bytes` prints reads back (``"1,024 PiB"``). At least one byte, and finite
    (``1e400GiB`` is refused, not overflowed)."""
    match = re.fullmatch(r"\s*([0-9][0-9,]*\.?[0-9]*|\.[0-9]+)(?:e([0-9]+))?\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(3).upper() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise MemshardError(f"cannot read {text!r} as a size in bytes (try e.g. 80GiB or 40GB)")
    mantissa, exponent = float(match.group(1).replace(",", "")), (match.group(2) or "0").lstrip("0") or "0"
    try:  # (an exponent of more than three digits overflows a float whatever it is)
        value = mantissa and mantissa * 10.0 ** int(exponent[:4]) * _BYTE_UNITS[unit]
    except OverflowError:
        value = math.inf
    if value <= 0:
        raise MemshardError(f"a size must be positive, got {text!r}")
    if value < 1:
        raise MemshardError(f"a size must be at least 1 byte, got {text!r}")
    if not math.isfinite(value):
        raise MemshardError(f"{text!r} is too large to be a size in bytes")
    return int(value)


def check_bytes(value: float, what: str) -> None:
    """Refuse a size in bytes above ``MAX_BYTES`` (``what``: the option, for the message)."""
    if value > MAX_BYTES:
        raise MemshardError(f"{what} must be at most {format_bytes(MAX_BYTES)}, got {format_bytes(value)}")


def check_factor(value, what: str) -> None:
    """Refuse a factor on a step time (a slack, a slowdown) that is not a number from 1 to
    ``MAX_FACTOR`` (``what``: the option, for the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= MAX_FACTOR:
        raise MemshardError(f"{what} must be a number from 1 to {MAX_FACTOR:,.0f}, got {value!r}")


def parse_count(text: str, most: int = MAX_COUNT) -> int:
    """A whole number from 1 to ``most``: ``"64"`` → 64; ``"2.5"``, ``"1e3"``, ``"0"`` refused."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise MemshardError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise MemshardError(f"expected a positive integer, got {text!r}")
    if value > most:
        raise MemshardError(f"expected a positive integer of at most {most:,}, got {text!r}")
    return value


def parse_seconds(text: str) -> float:
    """A duration: ``"1.5s"``, ``"800ms"``, ``"20us"`` or a plain number of seconds; positive,
    finite and at most ``MAX_SECONDS``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s|us|µs)?\s*", str(text))
    if not m:
        raise MemshardError(f"expected a duration like 1.5s or 800ms, got {text!r}")
    scale = {"ms": 1e-3, "us": 1e-6, "µs": 1e-6}.get(m.group(2) or "s", 1.0)
    value = float(m.group(1)) * scale
    if value <= 0:
        raise MemshardError(f"a duration must be positive, got {text!r}")
    if not value <= MAX_SECONDS:
        raise MemshardError(f"a duration must be at most {format_seconds(MAX_SECONDS)}, got {text!r}")
    return value


def _significant(v: float) -> str:
    """``v`` (0 ≤ v < 999.5) with three significant digits, trailing zeros dropped, plain digits."""
    decimals = 3 if v < 0.9995 else 2 if v < 9.995 else 1 if v < 99.95 else 0
    text = f"{v:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _special(n: float, unit: str) -> str | None:
    if math.isnan(n):
        return "n/a"
    if math.isinf(n):
        return f"{'-' if n < 0 else ''}∞ {unit}".rstrip()
    return None


def format_bytes(n: float) -> str:
    """Binary units with three significant digits: ``12.3 GiB``, ``512 B``, ``8,880 PiB``."""
    n = float(n)
    if (special := _special(n, "B")) is not None:
        return special
    return _scaled(n, 1024, ("B", *_BINARY), " ")


def _scaled(n: float, base: int, units: tuple[str, ...], space: str) -> str:
    """``n`` in the largest of ``units`` (each ``base`` times the one before) that keeps it
    below 1000 at three significant digits; whole numbers in the first; plain digits past the
    last."""
    sign, v = ("-" if n < 0 else ""), abs(n)
    if math.floor(v + 0.5) < base:
        return f"{sign}{math.floor(v + 0.5)}{space}{units[0]}".rstrip()
    for unit in units[1:]:
        v /= base
        if v < _TOP:
            return f"{sign}{_significant(v)}{space}{unit}"
    return f"{sign}{v:,.0f}{space}{units[-1]}"


def format_seconds(s: float) -> str:
    """Three significant digits in ns, µs, ms or s: ``512 ns``, ``1.64 s``, ``3,600 s``."""
    s = float(s)
    if (special := _special(s, "s")) is not None:
        return special
    sign, v = ("-" if s < 0 else ""), abs(s)
    if v >= _TOP:
        return f"{sign}{v:,.0f} s"
    for scale, unit in reversed(_SECONDS):
        if v / scale >= 0.9995 or unit == "ns":
            text = _significant(v / scale)
            return "0 s" if text == "0" else f"{sign}{text} {unit}"
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """A count with K, M, B, T (10³, 10⁶, 10⁹, 10¹²) and three significant digits:
    ``479``, ``56.2K``, ``6.66B``, ``175B``, ``1,200T``."""
    n = float(n)
    if (special := _special(n, "")) is not None:
        return special
    return _scaled(n, 1000, ("", *_COUNT), "")


def counted(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 device``, ``8 devices``, ``1,024 devices``; ``nouns`` when the plural is not noun + s."""
    return f"{n:,} {noun if n == 1 else (nouns or noun + 's')}"


def format_parameters(n: int) -> str:
    """A parameter count: ``1 parameter``, ``479 parameters``, ``6.66B parameters``."""
    return f"{format_count(n)} parameter{'' if n == 1 else 's'}"
