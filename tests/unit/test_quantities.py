"""Printed quantities: three significant digits, plain digits (never ``1e+03 MiB``), units
that change where the rounded figure reaches 1000, monotone, and read back within rounding."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memshard.core.quantities import (
    counted,
    format_bytes,
    format_count,
    format_parameters,
    format_seconds,
    parse_bytes,
)

SECONDS = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
COUNTS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
ROUNDING = 0.005  # three significant digits: at most half a unit in the third digit of 100


def _seconds(text: str) -> float:
    value, unit = text.split(" ")
    return float(value.replace(",", "")) * SECONDS[unit]


def _count(text: str) -> float:
    value, unit = re.fullmatch(r"([0-9,.]+)([KMBT]?)", text).groups()
    return float(value.replace(",", "")) * COUNTS[unit]


def _plain(text: str) -> bool:
    return not re.search(r"[0-9]e[+-]?[0-9]", text) and "e+" not in text and "e-" not in text


def _three_digits(text: str) -> bool:
    if text.endswith(" B"):  # whole bytes, below 1024
        return 0 <= int(text[:-2]) < 1024
    digits = re.sub(r"[^0-9]", "", text.split(" ")[0]).lstrip("0")
    return len(digits) <= 3 or "," in text  # past the largest unit: plain digits


byte_sizes = st.floats(min_value=0, max_value=1e30, allow_nan=False)
durations = st.floats(min_value=1e-9, max_value=1e9, allow_nan=False)
counts = st.floats(min_value=0, max_value=1e18, allow_nan=False)


@settings(max_examples=400, deadline=None)
@given(byte_sizes)
def test_bytes_are_plain_three_digit_figures_that_read_back(n):
    text = format_bytes(n)
    assert _plain(text) and _three_digits(text), text
    if n >= 1:
        assert parse_bytes(text) == pytest.approx(n, rel=ROUNDING, abs=1), text


@settings(max_examples=400, deadline=None)
@given(byte_sizes, byte_sizes)
def test_bytes_are_monotone(a, b):
    a, b = sorted((a, b))
    if a >= 1:
        assert parse_bytes(format_bytes(a)) <= parse_bytes(format_bytes(b))


@settings(max_examples=400, deadline=None)
@given(durations)
def test_seconds_are_plain_three_digit_figures_that_read_back(s):
    text = format_seconds(s)
    assert _plain(text) and _three_digits(text), text
    assert _seconds(text) == pytest.approx(s, rel=ROUNDING), text


@settings(max_examples=400, deadline=None)
@given(durations, durations)
def test_seconds_are_monotone(a, b):
    a, b = sorted((a, b))
    assert _seconds(format_seconds(a)) <= _seconds(format_seconds(b))


@settings(max_examples=400, deadline=None)
@given(counts)
def test_counts_are_plain_three_digit_figures_that_read_back(n):
    text = format_count(n)
    assert _plain(text) and _three_digits(text), text
    assert _count(text) == pytest.approx(n, rel=ROUNDING, abs=0.5), text


@settings(max_examples=400, deadline=None)
@given(counts, counts)
def test_counts_are_monotone(a, b):
    a, b = sorted((a, b))
    assert _count(format_count(a)) <= _count(format_count(b))


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1023.9 * 2**20, "1 GiB"), (999.4 * 2**20, "999 MiB"),
    (999.6 * 2**20, "0.976 GiB"), (1.01e3 * 2**30, "0.986 TiB"), (68.7 * 2**30, "68.7 GiB"),
    (8.88e14 * 2**50, "888,000,000,000,000 PiB"), (-393 * 2**20, "-393 MiB"), (math.inf, "∞ B"),
])
def test_bytes_examples(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(("s", "text"), [
    (0, "0 s"), (5e-10, "0.5 ns"), (20e-6, "20 µs"), (0.9999, "1 s"), (0.510, "510 ms"), (999.96e-3, "1 s"),
    (1.64, "1.64 s"), (69.9, "69.9 s"), (3600, "3,600 s"), (-0.002, "-2 ms"),
])
def test_seconds_examples(s, text):
    assert format_seconds(s) == text


@pytest.mark.parametrize(("n", "text"), [
    (1, "1 parameter"), (479, "479 parameters"), (56_200, "56.2K parameters"), (124_439_808, "124M parameters"),
    (6_658_404_352, "6.66B parameters"), (174_591_676_416, "175B parameters"), (999_600, "1M parameters"),
])
def test_parameter_counts(n, text):
    assert format_parameters(n) == text


def test_counted_nouns():
    assert counted(1, "device") == "1 device"
    assert counted(1024, "device") == "1,024 devices"
    assert counted(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert counted(48, "micro-batch", "micro-batches") == "48 micro-batches"
