"""What a reshard holds while it runs (row family ``reshard``).

At a reshard point t, one row per reshard it runs (``problem.reshard_terms``):

  L_t + Σ_k ρ[e_k, f_k] + S_t(x) + const_t ≤ M

S_t is what changes at t before its reshards run (``Slot.phase``: a weight's gradient
reduce-scattered first, its unsharded copy gone); ρ[e, f] ≥ 0 bounds the price f of edge e
(``problem.reshard_price``) under the chosen producer and consumer strategies
(family ``reshard-price``):

  ρ[e,f] ≥ Σ_c f(a, c)·X_cons(c) − max_c f(a, c)·(1 − X_prod(a))    for every producer-side layout a

(or the same with the sides swapped, whichever has fewer layouts; a price paid only when the
edge keeps its copy also subtracts max·(1 − κ[e])).
"""

from __future__ import annotations

from collections import defaultdict

import highspy
import numpy as np

from memshard.problem.records import (
    ALWAYS,
    BACKWARD_PRICES,
    KEPT_PRICES,
    REPLAY_PRICES,
    Problem,
    replay_price_paid,
    reshard_price_table,
    reshard_terms,
    without_partial,
)
from memshard.search.model import LinearModel, RowTag


class ReshardRows:
    """Adds reshard rows point by point (each point once) and the ρ columns they need."""

    def __init__(self, problem: Problem, model: LinearModel, choice_columns: list[np.ndarray],
                 keep_columns: dict[int, int], bytes_unit: float):
        self.problem = problem
        self.model = model
        self.choice_columns = choice_columns
        self.keep_columns = keep_columns
        self.bytes_unit = bytes_unit
        self.price_columns: dict[tuple, int | None] = {}
        self.price_tables: dict[tuple, np.ndarray] = {}  # by shape and layouts
        self.side_sets: dict[tuple, tuple[tuple, np.ndarray]] = {}  # see sides
        self.added: set[int] = set()  # indices into problem.reshard_points

    def add(self, live_column: dict[int, int], peak: int, constants_at: dict[int, float],
            points: set[int] | None = None) -> None:
        """The rows of each candidate reshard point of ``points`` (default all) not added yet."""
        swap: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)  # S_t's terms
        for s in self.problem.slots:
            if s.phase != ALWAYS:
                swap[s.end].append((self.choice_columns[s.group], s.reshard_change * s.nbytes / self.bytes_unit))
        for i, rp in enumerate(self.problem.reshard_points):
            if rp.point not in live_column or (points is not None and rp.point not in points) or i in self.added:
                continue
            self.added.add(i)
            changes = swap.get(rp.point, [])
            for terms in reshard_terms(rp):
                cols = [c for c in (self.price_column(e, kind, last) for e, kind, last in terms) if c is not None]
                if cols:
                    columns = np.concatenate([[live_column[rp.point], peak], cols, *(c for c, _ in changes)])
                    values = np.concatenate([[1.0, -1.0], np.ones(len(cols)), *(v for _, v in changes)])
                    self.model.row((columns, values), -highspy.kHighsInf, -constants_at[rp.point],
                                   RowTag("reshard", rp.point))

    def price_column(self, e: int, kind: str, last: bool) -> int | None:
        """ρ ≥ the price ``kind`` of edge ``e`` (``problem.reshard_price``) under the chosen
        producer and consumer strategies (None when it is 0 for every pair)."""
        key = (e, kind, last)
        if key not in self.price_columns:
            self.price_columns[key] = self._price_column(e, kind, last)
        return self.price_columns[key]

    def _price_column(self, e: int, kind: str, last: bool) -> int | None:
        problem = self.problem
        edge = problem.edges[e]
        if kind in KEPT_PRICES and e not in self.keep_columns:  # a copy its consumer's replay reads whole
            return None
        if kind in BACKWARD_PRICES and edge.gradient_through:  # the gradient passes as it is
            return None
        backward, replay = kind in BACKWARD_PRICES, kind in REPLAY_PRICES
        a_set, a_idx = self.sides(edge.producer, None, backward, replay)
        c_set, c_idx = self.sides(edge.consumer, edge.input_index, backward, replay)
        spec = edge.tensor
        table_key = (spec.shape, spec.dtype_bytes, kind, last, a_set, c_set, edge.replay)
        if table_key not in self.price_tables:  # edges of one shape and layouts (q, k, v's input) share prices
            table = reshard_price_table(spec, kind, [a for a, _ in a_set], [c for c, _ in c_set], problem.mesh, last)
            if kind in REPLAY_PRICES:
                table = table * np.array([[replay_price_paid(kind, edge, fa, fc) for _, fc in c_set]
                                          for _, fa in a_set], dtype=float).reshape(table.shape)
            self.price_tables[table_key] = table / self.bytes_unit
        table = self.price_tables[table_key]
        if not table.any():
            return None
        rho = int(self.model.columns(1, integer=False, hi=highspy.kHighsInf)[0])
        x = self.choice_columns
        sides = [(table, a_idx, x[edge.producer], c_idx, x[edge.consumer]),
                 (table.T, c_idx, x[edge.consumer], a_idx, x[edge.producer])]
        f, fixed_idx, fixed_cols, other_idx, other_cols = min(sides, key=lambda side: len(side[0]))
        kept = [self.keep_columns[e]] if kind in KEPT_PRICES else []
        self.price_rows(rho, f, fixed_idx, fixed_cols, other_idx, other_cols, kept, RowTag("reshard-price", item=edge.key))
        return rho

    def sides(self, group: int, input_index: int | None, backward: bool, replay: bool) -> tuple[tuple, np.ndarray]:
        """An edge's producer (``input_index`` None) or consumer sides in op group ``group``'s
        choices: its output layout or its input's (``backward``: its output gradient's,
        partial sums reduced, or its input gradient's), with whether the choice is replayed
        where a price depends on it (``replay``); the distinct sides sorted by repr, and each
        choice's among them."""
        key = (group, input_index, backward, replay)
        if key not in self.side_sets:
            grp = self.problem.groups[group]
            if backward:
                of = ([(without_partial(s.output_layout), False) for s in grp.strategies] if input_index is None
                      else [(g, False) for g in grp.input_grads[input_index]])
            else:  # (``replay and grp.replayed(k)``)
                replayed = grp.replays if replay and grp.replays else [False] * len(grp.strategies)
                of = list(zip([s.output_layout for s in grp.strategies] if input_index is None
                              else [s.input_layouts[input_index] for s in grp.strategies], replayed))
            ordered = tuple(sorted(set(of), key=repr))
            position = {side: i for i, side in enumerate(ordered)}
            self.side_sets[key] = (ordered, np.array([position[side] for side in of]))
        return self.side_sets[key]

    def price_rows(self, rho: int, f: np.ndarray, fixed_idx: np.ndarray, fixed_cols: np.ndarray,
                   other_idx: np.ndarray, other_cols: np.ndarray, kept: list[int], tag: RowTag) -> None:
        """ρ − Σ_c f(u, c)·X_other(c) − top_u·(X_fixed(u) + κ) ≥ −top_u·(1 + |κ|) for every side
        ``u`` of the fixed side whose prices are not all 0 (top_u: the largest): each row's
        columns sorted, the zero coefficients left out."""
        columns = np.concatenate([[rho], other_cols, fixed_cols, kept]).astype(np.int64)
        order = np.argsort(columns, kind="stable")
        columns = columns[order]
        if len(columns) > 1 and not np.all(columns[1:] != columns[:-1]):  # a column twice: summed by ``row``
            for u in range(f.shape[0]):
                top = f[u].max()
                if top > 0:
                    mine = fixed_cols[fixed_idx == u]
                    vals = np.concatenate([[1.0], -f[u, other_idx], np.full(len(mine) + len(kept), -top)])
                    self.model.row((np.concatenate([[rho], other_cols, mine, kept]), vals), -top * (1 + len(kept)),
                                   highspy.kHighsInf, tag)
            return
        tops = f.max(axis=1)
        values = np.zeros((f.shape[0], len(columns)))  # per row u, in the columns' first order
        values[:, 0] = 1.0
        values[:, 1:1 + len(other_cols)] = -f[:, other_idx]
        fixed = 1 + len(other_cols) + np.arange(len(fixed_cols))
        values[fixed_idx, fixed] = -tops[fixed_idx]
        values[:, len(values[0]) - len(kept):] = -tops[:, None]
        rows = np.nonzero(tops > 0)[0]
        values = values[rows][:, order]
        nonzero = values != 0
        columns, values = np.broadcast_to(columns, values.shape)[nonzero], values[nonzero]  # row after row
        bounds = np.cumsum([0, *nonzero.sum(axis=1)]).tolist()
        lower = -tops[rows] * (1 + len(kept))
        for r in range(len(rows)):
            self.model.append_row(columns[bounds[r]:bounds[r + 1]], values[bounds[r]:bounds[r + 1]], lower[r],
                                  highspy.kHighsInf, tag)
