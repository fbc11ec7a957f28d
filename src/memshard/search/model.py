"""Columns and rows of the ILP, collected in Python and handed to HiGHS once.

Every row carries a :class:`RowTag`: the family that built it (``formulation.py`` documents
each) and, where it has one, the schedule point or the item (group, link, edge) it is about,
so that a binding or violated row can be named (:meth:`LinearModel.binding`,
:meth:`LinearModel.violated`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_INT64, _FLOAT64 = np.dtype(np.int64), np.dtype(float)  # (given as records: np.fromiter resolves a name each call)


@dataclass(frozen=True)
class RowTag:
    family: str  # e.g. "memory", "reshard", "edge-flow" (see formulation.py)
    point: int | None = None  # the schedule point it prices, if any
    item: str = ""  # the group, link or edge it is about, if any

    def __str__(self) -> str:
        where = f" at point {self.point}" if self.point is not None else ""
        return f"{self.family}{where}{f' ({self.item})' if self.item else ''}"


def summed(cols: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct columns, sorted, each with its values summed in the order given (what
    ``np.unique`` and ``np.bincount`` give, for less: rows seldom repeat a column)."""
    order = np.argsort(cols, kind="stable")
    unique = np.empty(len(cols), dtype=bool)
    unique[:1] = True
    np.not_equal(cols[order][1:], cols[order][:-1], out=unique[1:])
    if unique.all():
        return cols[order], vals[order]
    inverse = np.empty(len(cols), dtype=np.int64)
    inverse[order] = np.cumsum(unique) - 1
    return cols[order][unique], np.bincount(inverse, weights=vals)


class LinearModel:
    """Columns (bounds, integrality) and rows (bounds, sparse coefficients, tag)."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.rows_lower: list[float] = []
        self.rows_upper: list[float] = []
        self.row_columns: list[np.ndarray] = []
        self.row_values: list[np.ndarray] = []
        self.tags: list[RowTag] = []

    @property
    def num_columns(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.rows_lower)

    def columns(self, n: int, integer: bool, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
        start = len(self.lower)
        self.lower += [lo] * n
        self.upper += [hi] * n
        self.integer += [1 if integer else 0] * n
        return np.arange(start, start + n)

    def row(self, coefs: dict[int, float] | tuple[np.ndarray, np.ndarray], lo: float, hi: float,
            tag: RowTag) -> int:
        """Add ``lo ≤ Σ coefs·x ≤ hi``; coefficients of one column given twice are summed."""
        if isinstance(coefs, dict):  # (most rows: a few columns, fastest without numpy masks)
            if 0.0 in coefs.values():
                coefs = {c: v for c, v in coefs.items() if v != 0}
            self.row_columns.append(np.fromiter(coefs.keys(), _INT64, len(coefs)))
            self.row_values.append(np.fromiter(coefs.values(), _FLOAT64, len(coefs)))
        else:
            cols, vals = summed(*coefs)
            keep = vals != 0
            self.row_columns.append(cols[keep].astype(np.int64))
            self.row_values.append(vals[keep])
        self.rows_lower.append(lo)
        self.rows_upper.append(hi)
        self.tags.append(tag)
        return len(self.rows_lower) - 1

    def append_row(self, columns: np.ndarray, values: np.ndarray, lo: float, hi: float, tag: RowTag) -> int:
        """Add ``lo ≤ Σ values·x[columns] ≤ hi`` as given: ``columns`` distinct (int64), ``values``
        non-zero, in the order the row keeps them (``row`` of a dict in that order); neither
        is copied nor written to later."""
        self.row_columns.append(columns)
        self.row_values.append(values)
        self.rows_lower.append(lo)
        self.rows_upper.append(hi)
        self.tags.append(tag)
        return len(self.rows_lower) - 1

    def activity(self, values: np.ndarray, row: int) -> float:
        return float(values[self.row_columns[row]] @ self.row_values[row])

    def violated(self, values: np.ndarray, tolerance: float = 1e-6) -> list[RowTag]:
        """The rows a solution breaks by more than ``tolerance`` (relative to the row's bounds)."""
        return [self.tags[r] for r in range(self.num_rows) if self.slack(values, r) < -tolerance * self._scale(r)]

    def binding(self, values: np.ndarray, family: str, tolerance: float = 1e-6) -> list[RowTag]:
        """The rows of ``family`` a solution meets with no more slack than ``tolerance``."""
        return [self.tags[r] for r in range(self.num_rows)
                if self.tags[r].family == family and self.slack(values, r) <= tolerance * self._scale(r)]

    def slack(self, values: np.ndarray, row: int) -> float:
        """How far a solution is inside the row's bounds (negative: outside)."""
        a = self.activity(values, row)
        return min(a - self.rows_lower[row], self.rows_upper[row] - a)

    def _scale(self, row: int) -> float:
        finite = [abs(b) for b in (self.rows_lower[row], self.rows_upper[row]) if np.isfinite(b)]
        return max([1.0, *finite])
