r"""The ILP that picks one strategy per op, one storage option per parameter and the edges'
keep flags, solved with HiGHS (``highspy``).

Formulation (bytes and seconds in units scaled to the problem, see ``_units``)::

  variables
    x[g,c] ∈ {0,1}     group g (op strategy, parameter storage) takes choice c
    z[e,k,a,σ] ≥ 0     edge e, keep copy k ∈ {0,1}, resharding step a (mesh axis a), in
                       state σ = (consumer placements on axes < a, producer placements on
                       axes ≥ a, consumer placement on axis a)
    κ[e] ∈ {0,1}       edge e keeps its saved copy in the producer's layout
    c[e,L,R] ≥ 0       edge e's consumer holds its own copy in layout L (R: which of its
                       copy holders — input, saved, re-gathered — are live)
    y[τ,H,L] ≥ 0       the producer's tensor τ is held in layout L by one of the holders H,
                       once the producer's own holder has ended
    M ≥ 0              peak bytes per device

  one choice      Σ_c x[g,c] = 1                                        add_choice_rows
  links           Σ_{c: ℓ_a(c)=ℓ} x[a,c] = Σ_{c: ℓ_b(c)=ℓ} x[b,c]  ∀ℓ    add_link_rows
  edge flow       Σ_k Σ_{σ at a=0 with producer part L} z = Σ_{s: out(s)=L} x[p,s]
                  Σ_k Σ_{σ at a=A−1 with consumer part K} z = Σ_{s: in(s)=K} x[c,s]
                  flow into each state of step a+1 = flow out of step a     add_edge_rows
                  Σ_{σ} z[e,1,0,σ] = κ[e]
  holders         c[e,L,R] ≥ [a holder of R holds L] − [producer's output is L]  _copy_var
                  (for a saved or re-gathered copy: the flow's producer layout under the same
                  keep flag, tighter in the LP relaxation)
                  held in L: the producer's indicator while its holder lives, else y with
                  y ≥ each kept copy's indicator, y + c ≥ [e holds L]         _held_vars
  peak            L_t = L_prev + Δ_t (live bytes, chained),  L_t + const_t ≤ M
                  for every candidate point t                               add_memory_rows
  reshards        L_t + Σ_k ρ[e_k,·] + S_t(x) + const_t ≤ M at a reshard point t, one row per
                  reshard it runs (``problem.reshard_terms``), S_t what changes at t before
                  its reshards run (``Slot.phase``: a weight's gradient reduce-scattered
                  first, its unsharded copy gone); ρ[e,f] ≥ Σ_c f(a, c)·X_cons(c)
                  − max_c f(a, c)·(1 − X_prod(a)) for every producer-side layout a (or the
                  same with the sides swapped, whichever has fewer layouts): the pair price f
                  of edge e (``problem.reshard_price``)                   add_reshard_rows
  step time       T = Σ instances·time(x) + Σ instances·time(z)             time_expression
                  T ≤ budget (objective "memory" with --max-step-time)      add_budget_rows
                  M ≤ capacity (objective "time")                            add_budget_rows

The edge flow is Alpa's edge linearisation factored by mesh axis: resharding runs axis by axis
(forward in axis order, gradients in reverse), so the cost of step a depends only on σ, and
an edge needs Σ_a |σ_a| variables instead of |producer layouts| × |consumer layouts|. With the
x integral the flow is integral (each state has one way in and out), so z is continuous.

Objectives: ``memory`` minimises M, then, with M held within the gap of its optimum, the step
time (ties broken by time); ``time`` minimises T subject to M ≤ budget, then M. The first
pass minimises the primary objective plus a small multiple of the other, which is usually
optimal for the primary one alone, as a plan-independent bound on the peak
(``evaluate.peak_lower_bound``) often shows at once, and then needs no second pass
(``_Highs.first_pass``).

Every minimisation starts with a dive (``_Highs._dive``): the LP relaxation by simplex, which
on memshard's ILPs is often integral already (LLaMA-3 8B on 8x8, GPT-3 1.3B on 2x4: the plan,
proved optimal by its own relaxation), else up to DIVE_DEPTH levels of branching on its most
fractional disjunctions (a group's choices, a keep flag's two values), each branch
warm-started from its parent's basis, which proves the plan where the relaxation split one or
two decisions (GPT-3 6.7B on 2x4: at batch 16 a tied embedding's storage between two choices,
both branches integral; at batch 8 a keep flag, then the final norm's strategy). HiGHS's branch and bound
runs only where the dive leaves the gap open, from the dive's plan if it had no start.

The reshard rows are lazy (without a memory budget): most plans' peak is not at a reshard,
and without those rows (a quarter of them, and their ρ) HiGHS takes a third less time. The
first pass runs without them; where the plan, priced by the evaluator, holds more than its M
at a reshard point, that point's rows are added and the first pass runs again, from that
plan, until none is over (``IlpBuilder.over_m``); the second pass likewise. A plan that
meets M is optimal with every row too: dropping rows only enlarges the feasible set. (Adding
every row at the first violation made one job's search 10× slower: GPT-3 175B as 48
micro-batches on 8x8x16, whose plan exceeds M at a handful of its hundreds of reshards.)
Every round's bound holds for the whole ILP. Out of time in a later round, the plan kept is
the better of that round's and the one before it, as the evaluator prices them, with its gap
to the best bound (the later round may have found only a worse plan, or none).
Solver options are fixed (one thread, seed 0) so the same input gives the same plan.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import highspy
import numpy as np

from memshard.baselines import zero
from memshard.cost import comm
from memshard.errors import MemshardError
from memshard.evaluate import (
    Evaluation,
    evaluate,
    peak_lower_bound,
    step_time,
    zero_redundancy_bound,
)
from memshard.placement import Layout, Partial
from memshard.problem import (
    BACKWARD_PRICES,
    DURING_RESHARDS,
    INPUT_COPY,
    KEPT_PRICES,
    PRODUCER,
    REGATHER,
    SAVED,
    Holder,
    OpGroup,
    Problem,
    Selection,
    complete_selection,
    reshard_price_table,
    reshard_terms,
    without_partial,
)

# In the first branch and bound, the secondary objective weighs TIE_BREAK of the primary one
# (at their typical values: the zero-redundancy bound, ZeRO-3's step time).
TIE_BREAK = 0.03
TIE_RESOLUTION = 1e-5  # relative slack on the primary objective in the second pass
HIGHS_TOLERANCE = 1e-6  # HiGHS's integrality and MIP feasibility tolerances (defaults)
INTEGRALITY = 1e-6  # a relaxation's choice columns this close to 0 or 1 count as integral
# A set of branches one of which every integral solution takes: (column, value it is fixed at).
Disjunction = tuple[tuple[int, float], ...]
DIVE_DEPTH = 3  # a dive branches at most this many levels deep
DIVE_BRANCHES = 24  # and solves at most this many branches (each costs a refactorisation)
DIVE_EFFORT = 1.0  # and spends at most this many times the relaxation's simplex iterations
DIVE_CUTOFF = 0.25  # a dive's branch stops this fraction of the gap below the best plan


@dataclass(frozen=True)
class SolveResult:
    selection: Selection
    status: str  # "optimal", "time_limit" (feasible, with gap)
    objective: str
    gap: float
    time_s: float
    variables: int
    constraints: int
    ilp_peak_bytes: float = 0.0  # the ILP's own M (≥ the evaluated peak; equal at optimum)
    search_space: str = "full"


class _Model:
    """Columns and rows collected in Python, handed to HiGHS once."""

    def __init__(self):
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.rows_lo: list[float] = []
        self.rows_hi: list[float] = []
        self.row_cols: list[np.ndarray] = []
        self.row_vals: list[np.ndarray] = []

    def cols(self, n: int, integer: bool, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
        start = len(self.lower)
        self.lower += [lo] * n
        self.upper += [hi] * n
        self.integer += [1 if integer else 0] * n
        return np.arange(start, start + n)

    def row(self, coefs: dict[int, float] | tuple[np.ndarray, np.ndarray], lo: float, hi: float) -> int:
        if isinstance(coefs, dict):
            cols = np.fromiter(coefs.keys(), dtype=np.int64, count=len(coefs))
            vals = np.fromiter(coefs.values(), dtype=float, count=len(coefs))
        else:
            cols, vals = coefs
            cols, inverse = np.unique(cols, return_inverse=True)
            vals = np.bincount(inverse, weights=vals)
        keep = vals != 0
        self.row_cols.append(cols[keep].astype(np.int64))
        self.row_vals.append(vals[keep])
        self.rows_lo.append(lo)
        self.rows_hi.append(hi)
        return len(self.rows_lo) - 1


class IlpBuilder:
    def __init__(self, problem: Problem):
        self.p = problem
        self.m = _Model()
        self.reference = _reference(problem)
        self.bytes_unit, self.time_unit = _units(self.reference)
        self.x = [self.m.cols(len(g.choices), integer=True) for g in problem.groups]
        self.edge_vars: list[dict] = []
        self.kappa: dict[int, int] = {}
        self.y: dict[tuple, list[int]] = {}
        self.copy_vars: dict[tuple, int | None] = {}
        self.peak = int(self.m.cols(1, integer=False, hi=highspy.kHighsInf)[0])
        self.time_cols: list[np.ndarray] = []
        self.time_vals: list[np.ndarray] = []
        self.live_col: dict[int, int] = {}  # schedule point → its live-bytes column
        self.constants_at: dict[int, float] = {}  # schedule point → its constant bytes
        self.rho: dict[tuple, int | None] = {}
        self.prices: dict[tuple, np.ndarray] = {}  # reshard memory price tables, by shape and layouts
        self.edge_states: dict[tuple, dict] = {}  # edge-flow states and times, likewise
        self.reshard_rows_added: set[int] = set()  # indices into problem.reshard_points

    # -- rows ----------------------------------------------------------------------------------
    def replicated_start(self) -> tuple[np.ndarray, np.ndarray]:
        """Every op unsplit, nothing stored sharded, nothing kept: a plan that exists whenever
        any does without a memory budget, given as the choice columns only."""
        return self.selection_start(
            complete_selection(self.p, {g: 0 for g, grp in enumerate(self.p.groups) if isinstance(grp, OpGroup)}))

    def disjunctions(self) -> list[Disjunction]:
        """Each group's choices and each keep flag's two values, as branches of the ILP."""
        return ([tuple((int(c), 1.0) for c in cols) for cols in self.x]
                + [((int(col), 1.0), (int(col), 0.0)) for _, col in sorted(self.kappa.items())])

    def selection(self, values: np.ndarray) -> Selection:
        """The plan a solution's columns say."""
        choices = tuple(int(np.argmax(values[cols])) for cols in self.x)
        keeps = tuple(int(round(values[self.kappa[e]])) if e in self.kappa else 0 for e in range(len(self.p.edges)))
        return Selection(choices, keeps)

    def over_m(self, values: np.ndarray, ev: Evaluation | None = None) -> set[int]:
        """The reshard points where the plan of a solution, priced by the evaluator (its
        reshards included; ``ev`` if already priced), holds more than the solution's M: the
        lazy reshard rows it violates. Empty: the plan meets every row, those not in the
        model too."""
        live = (ev or evaluate(self.p, self.selection(values))).live_bytes
        m = values[self.peak] * self.bytes_unit * (1 + HIGHS_TOLERANCE) + 1.0
        return {rp.point for rp in self.p.reshard_points if live[rp.point] > m}

    def selection_start(self, sel: Selection) -> tuple[np.ndarray, np.ndarray]:
        """A complete plan as a partial MIP start: its choice and keep columns."""
        cols, vals = [], []
        for g, group_cols in enumerate(self.x):
            cols.extend(int(c) for c in group_cols)
            vals.extend(float(k == sel.choices[g]) for k in range(len(group_cols)))
        for e, col in self.kappa.items():
            cols.append(int(col))
            vals.append(float(sel.keeps[e]))
        return np.array(cols), np.array(vals)

    def add_choice_rows(self) -> None:
        for cols in self.x:
            self.m.row((cols, np.ones(len(cols))), 1.0, 1.0)

    def add_link_rows(self) -> None:
        for link in self.p.links:
            by_label: dict = defaultdict(dict)
            for c, lab in enumerate(link.a_labels):
                by_label[lab][int(self.x[link.a][c])] = 1.0
            for c, lab in enumerate(link.b_labels):
                d = by_label[lab]
                col = int(self.x[link.b][c])
                d[col] = d.get(col, 0.0) - 1.0
            for lab in sorted(by_label, key=repr):
                self.m.row(by_label[lab], 0.0, 0.0)

    def add_edge_rows(self) -> None:
        for e in range(len(self.p.edges)):
            self.edge_vars.append(self._edge(e))

    def _edge(self, e: int) -> dict:
        p, mesh = self.p, self.p.mesh
        edge = p.edges[e]
        spec = edge.tensor
        A = mesh.ndim
        prod_strats = p.groups[edge.producer].strategies
        cons_strats = p.groups[edge.consumer].strategies
        grads = p.groups[edge.consumer].input_grads[edge.input_index]
        prod_layouts = sorted({s.output_layout for s in prod_strats}, key=repr)
        # consumer key per axis: (input placement, gradient placement)
        cons_keys = sorted({tuple(zip(s.input_layouts[edge.input_index], g)) for s, g in zip(cons_strats, grads)}, key=repr)
        keeps = (0, 1) if edge.saves else (0,)
        key = (spec.shape, spec.dtype_bytes, tuple(prod_layouts), tuple(cons_keys), keeps)
        if key not in self.edge_states:  # edges of one shape and layouts share their states
            self.edge_states[key] = self._edge_states(spec, prod_layouts, cons_keys, keeps)
        out = {"steps": {}, "keeps": keeps}
        cost_cols, cost_vals = [], []
        for step, (states, times) in self.edge_states[key].items():
            cols = self.m.cols(len(states), integer=False)
            out["steps"][step] = (states, cols)
            paid = times != 0
            cost_cols.append(cols[paid])
            cost_vals.append(times[paid] * (edge.executions / self.time_unit))
        self.time_cols.append(np.concatenate(cost_cols))
        self.time_vals.append(np.concatenate(cost_vals))
        # producer side: step 0 states with producer layout L = the producer's strategies with
        # output L; consumer side likewise at the last step with consumer key K
        prod_rows: dict[Layout, dict[int, float]] = {L: {} for L in prod_layouts}
        cons_rows: dict[tuple, dict[int, float]] = {K: {} for K in cons_keys}
        for k in keeps:
            states, cols = out["steps"][(k, 0)]
            for (_, psuf, _), col in zip(states, cols):
                prod_rows[psuf][int(col)] = 1.0
            states, cols = out["steps"][(k, A - 1)]
            for (cpre, _, cv), col in zip(states, cols):
                cons_rows[cpre + (cv,)][int(col)] = 1.0
        for c, s in enumerate(prod_strats):
            prod_rows[s.output_layout][int(self.x[edge.producer][c])] = -1.0
        for c, (s, g) in enumerate(zip(cons_strats, grads)):
            cons_rows[tuple(zip(s.input_layouts[edge.input_index], g))][int(self.x[edge.consumer][c])] = -1.0
        for coefs in (*prod_rows.values(), *cons_rows.values()):
            self.m.row(coefs, 0.0, 0.0)
        # conservation between steps
        for k in keeps:
            for a in range(A - 1):
                flow: dict[tuple, dict[int, float]] = defaultdict(dict)
                states, cols = out["steps"][(k, a)]
                for (cpre, psuf, cv), col in zip(states, cols):
                    flow[(cpre + (cv,), psuf[1:])][int(col)] = 1.0
                states, cols = out["steps"][(k, a + 1)]
                for (cpre, psuf, _), col in zip(states, cols):
                    flow[(cpre, psuf)][int(col)] = -1.0
                for key in sorted(flow, key=repr):
                    self.m.row(flow[key], 0.0, 0.0)
        # Which flow columns say "consumer layout L" (last step) or "kept producer layout L".
        out["consumer_layout_cols"] = {}
        for k in keeps:
            by_layout: dict[Layout, list[int]] = defaultdict(list)
            states, cols = out["steps"][(k, A - 1)]
            for (cpre, _, cv), col in zip(states, cols):
                by_layout[tuple(pl for pl, _ in cpre + (cv,))].append(int(col))
            out["consumer_layout_cols"][k] = by_layout
        # and which say "producer layout L" (first step), per keep
        out["producer_layout_cols"] = {}
        for k in keeps:
            by_layout = defaultdict(list)
            states, cols = out["steps"][(k, 0)]
            for (_, psuf, _), col in zip(states, cols):
                by_layout[psuf].append(int(col))
            out["producer_layout_cols"][k] = by_layout
        if edge.saves:
            kappa = int(self.m.cols(1, integer=True)[0])
            self.kappa[e] = kappa
            coefs = {int(c): 1.0 for c in out["steps"][(1, 0)][1]}
            coefs[kappa] = -1.0
            self.m.row(coefs, 0.0, 0.0)
        return out

    def _edge_states(self, spec, prod_layouts: list[Layout], cons_keys: list[tuple], keeps: tuple[int, ...]) -> dict:
        """Per (keep, step a): the flow states σ = (consumer prefix, producer suffix,
        consumer placement on axis a) and each one's time."""
        A = self.p.mesh.ndim
        prod_suffixes = [{L[a:] for L in prod_layouts} for a in range(A + 1)]
        cons_prefixes = [{K[:a] for K in cons_keys} for a in range(A + 1)]
        c_vals = [sorted({K[a] for K in cons_keys}, key=repr) for a in range(A)]
        out = {}
        for k in keeps:
            for a in range(A):
                states = [(cpre, psuf, cv)
                          for cpre in cons_prefixes[a]
                          for psuf in prod_suffixes[a] if not (k and any(isinstance(x, Partial) for x in psuf))
                          for cv in c_vals[a] if cpre + (cv,) in cons_prefixes[a + 1]]
                times = np.array([self._step_time(spec, a, *state, k, self.p.mesh) for state in states], dtype=float)
                out[(k, a)] = (states, times)
        return out

    @staticmethod
    def _step_time(spec, a, cpre, psuf, cv, keep, mesh) -> float:
        lc_pre = tuple(pl for pl, _ in cpre)
        gc_pre = tuple(g for _, g in cpre)
        gp_suf = tuple(without_partial(psuf))
        calls = []
        cur = lc_pre + psuf
        step = comm.reshard_step(spec.shape, spec.dtype_bytes, cur, a, cv[0], mesh)
        calls += step * (2 if keep else 1)
        cur_b = gc_pre + (cv[1],) + gp_suf[1:]
        calls += comm.reshard_step(spec.shape, spec.dtype_bytes, cur_b, a, gp_suf[0], mesh, reverse=True)
        return comm.total_time(calls, mesh)

    def indicator(self, h: Holder, layout: Layout, part: str = "all") -> dict[int, float]:
        """Linear expression of "holder h holds its tensor in ``layout``"; for a saved copy,
        ``part`` "copy" is the consumer's own copy (not kept), "kept" the producer's tensor."""
        p = self.p
        if h.kind == PRODUCER:
            strats = p.groups[h.source].strategies
            return {int(self.x[h.source][c]): 1.0 for c, s in enumerate(strats) if without_partial(s.output_layout) == layout}
        edge = p.edges[h.source]
        if h.kind == INPUT_COPY:
            strats = p.groups[edge.consumer].strategies
            return {int(self.x[edge.consumer][c]): 1.0 for c, s in enumerate(strats) if s.input_layouts[edge.input_index] == layout}
        ev = self.edge_vars[h.source]
        out: dict[int, float] = {}
        if h.kind == SAVED:  # kept in the consumer's layout, or (kept) in the producer's
            if part != "kept":
                out.update(dict.fromkeys(ev["consumer_layout_cols"][0].get(layout, ()), 1.0))
            if part != "copy":
                out.update(dict.fromkeys(ev["producer_layout_cols"].get(1, {}).get(layout, ()), 1.0))
        elif h.kind == REGATHER and 1 in ev["keeps"]:
            out.update(dict.fromkeys(ev["consumer_layout_cols"][1].get(layout, ()), 1.0))
        return out

    def producer_in(self, group: int, layout: Layout) -> dict[int, float]:
        """Π: the producer's output is exactly ``layout`` (a consumer reading it in that
        layout holds the producer's own tensor, no copy)."""
        strats = self.p.groups[group].strategies
        return {int(self.x[group][c]): 1.0 for c, s in enumerate(strats) if s.output_layout == layout}

    def add_memory_rows(self, points: list[int]) -> list[int]:
        """One row per candidate point: live bytes − M ≤ −constants, with live bytes written as
        a chain L_t = L_prev + (what changed since the previous point) so rows stay sparse."""
        p = self.p
        slot_vecs: dict[tuple, np.ndarray] = {}
        for s in p.slots:  # merge slots with one group and interval (e.g. the layers' weights)
            if s.phase == DURING_RESHARDS:  # in the reshard rows only
                continue
            key = (s.group, s.start, s.end)
            slot_vecs[key] = slot_vecs.get(key, 0) + s.nbytes / self.bytes_unit
        slot_keys = list(slot_vecs)
        s_start = np.array([k[1] for k in slot_keys])
        s_end = np.array([k[2] for k in slot_keys])
        # Holders: a tensor's live holders at a point form a bit mask over its holder list;
        # tensors of shared layers have the same producer group and holders (kinds, edges),
        # so (that key, mask) identifies one expression, counted once per tensor that has it.
        # (The last layer's output has other holders than the others': another consumer.)
        by_tensor: dict[int, list[Holder]] = defaultdict(list)
        position = []
        for h in p.holders:
            position.append(len(by_tensor[h.tensor]))
            by_tensor[h.tensor].append(h)
        if position and max(position) >= 31:
            raise ValueError("a tensor with more than 31 holders")
        h_start = np.array([h.start for h in p.holders])
        h_end = np.array([h.end for h in p.holders])
        h_tensor = np.array([h.tensor for h in p.holders])
        h_bit = np.left_shift(1, np.array(position, dtype=np.int64))
        kinds: dict[tuple, int] = {}
        tensor_key = np.array([kinds.setdefault((held.key, tuple((h.kind, h.source) for h in by_tensor[t])), len(kinds))
                               for t, held in enumerate(p.held)], dtype=np.int64)
        signature_expr: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        indicator_cache: dict[tuple, dict[int, float]] = {}

        def cached_indicator(h: Holder, layout: Layout, part: str) -> dict[int, float]:
            ikey = (h.kind, h.source, layout, part)
            if ikey not in indicator_cache:
                indicator_cache[ikey] = self.indicator(h, layout, part)
            return indicator_cache[ikey]

        def expression(key: int, mask: int, tensor: int):
            held = p.held[tensor]
            active = [h for k, h in enumerate(by_tensor[tensor]) if mask >> k & 1]
            expr: dict[int, float] = defaultdict(float)
            for lid, layout in enumerate(held.layouts):
                nbytes = held.nbytes[lid] / self.bytes_unit
                if nbytes == 0:
                    continue
                # The producer's tensor (its own holder, a copy kept in its layout) and, per
                # edge, the consumer's copy: its input copy, its saved copy (not kept) or the
                # re-gathered one; the same copy written with different columns, each a row.
                producer_active = any(h.kind == PRODUCER for h in active)
                own = [cached_indicator(h, layout, "kept") for h in active if h.kind in (PRODUCER, SAVED)]
                own = [ind for ind in own if ind]
                copies: dict[int, list[tuple[str, dict, dict]]] = defaultdict(list)  # (kind, copy, any)
                for h in active:
                    if h.kind == INPUT_COPY:
                        ind = cached_indicator(h, layout, "all")
                        copies[h.source].append((h.kind, ind, ind))
                    elif h.kind == SAVED:
                        copies[h.source].append((h.kind, cached_indicator(h, layout, "copy"), cached_indicator(h, layout, "all")))
                    elif h.kind == REGATHER:
                        ind = cached_indicator(h, layout, "copy")
                        copies[h.source].append((h.kind, ind, ind))
                copies = {e: [r for r in reps if r[2]] for e, reps in copies.items()}
                copies = {e: reps for e, reps in copies.items() if reps}
                cols: list[int] = []
                base = None
                if producer_active:
                    # Every kept copy is in the producer's layout, so while the producer's
                    # holder is live "its tensor is held in L" is the producer's indicator.
                    base = next(cached_indicator(h, layout, "kept") for h in active if h.kind == PRODUCER)
                elif not copies and len(own) == 1:
                    base = own[0]
                elif len(copies) == 1 and [k for k, _, _ in next(iter(copies.values()))] in (["saved"], ["saved", "regather"]):
                    # One consumer's saved tensor (a copy, or the producer's tensor kept):
                    # one tensor, held in L iff "any" says so; a re-gathered copy beside it.
                    (e, reps), = copies.items()
                    base = reps[0][2]
                    copies = {e: reps[1:]} if len(reps) > 1 else {}
                if base is not None:
                    for col, v in base.items():
                        expr[col] += v * nbytes
                    cols = [c for e, reps in sorted(copies.items()) if (c := self._copy_var(e, layout, reps, held.key)) is not None]
                elif own or copies:
                    cols = self._held_vars((key, mask, lid), own, copies, held.key, layout)
                for col in cols:
                    expr[col] += nbytes
            return (np.fromiter(expr.keys(), dtype=np.int64, count=len(expr)),
                    np.fromiter(expr.values(), dtype=float, count=len(expr)))

        terms = []
        for t in points:
            live_slots = np.nonzero((s_start <= t) & (t <= s_end))[0]
            act = np.nonzero((h_start <= t) & (t <= h_end))[0]
            masks = np.zeros(len(p.held), dtype=np.int64)
            np.bitwise_or.at(masks, h_tensor[act], h_bit[act])
            tensors = np.nonzero(masks)[0]
            combined = (tensor_key[tensors] << 32) | masks[tensors]
            uniq, first, counts = np.unique(combined, return_index=True, return_counts=True)
            sigs = []
            for u, f, c in zip(uniq.tolist(), first.tolist(), counts.tolist()):
                sig = (u >> 32, u & 0xFFFFFFFF)
                if sig not in signature_expr:
                    signature_expr[sig] = expression(*sig, int(tensors[f]))
                sigs.append((sig, c))
            const = sum(c.nbytes for c in p.constants if c.start <= t <= c.end) / self.bytes_unit
            terms.append((live_slots, sigs, const))

        live_cols = self.m.cols(len(points), integer=False, lo=-highspy.kHighsInf, hi=highspy.kHighsInf)
        n = len(self.m.lower)
        previous = np.zeros(n)
        rows = []
        for k, (live_slots, sigs, const) in enumerate(terms):
            dense = np.zeros(n)
            for idx in live_slots:
                key = slot_keys[idx]
                dense[self.x[key[0]]] += slot_vecs[key]
            for sig, count in sigs:
                cols, vals = signature_expr[sig]
                dense[cols] += vals * count
            diff = dense - previous
            changed = np.nonzero(np.abs(diff) > 1e-12 * max(1.0, float(np.abs(dense).max())))[0]
            cols = np.concatenate([changed, [live_cols[k]], [live_cols[k - 1]] if k else []]).astype(np.int64)
            vals = np.concatenate([diff[changed], [-1.0], [1.0] if k else []])
            self.m.row((cols, vals), 0.0, 0.0)
            rows.append(self.m.row({int(live_cols[k]): 1.0, self.peak: -1.0}, -highspy.kHighsInf, -const))
            self.live_col[points[k]] = int(live_cols[k])
            previous = dense
        self.constants_at = {t: terms[k][2] for k, t in enumerate(points)}
        return rows

    def add_reshard_rows(self, points: set[int] | None = None) -> None:
        """At each candidate reshard point (of ``points``, default all), one row per reshard it
        runs (after add_memory_rows), with what changes at the point before its reshards run
        (``Slot.phase``). A point's rows are added once."""
        swap: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        for s in self.p.slots:
            if s.reshard_change:
                for col, nbytes in zip(self.x[s.group], s.nbytes):
                    swap[s.end][int(col)] += s.reshard_change * nbytes / self.bytes_unit
        for i, rp in enumerate(self.p.reshard_points):
            if rp.point not in self.live_col or (points is not None and rp.point not in points):
                continue
            if i in self.reshard_rows_added:
                continue
            self.reshard_rows_added.add(i)
            for terms in reshard_terms(rp):
                cols = [c for c in (self.pair_var(e, kind, last) for e, kind, last in terms) if c is not None]
                if cols:
                    coefs = dict(swap.get(rp.point, {}))
                    coefs[self.live_col[rp.point]] = 1.0
                    coefs[self.peak] = -1.0
                    for c in cols:
                        coefs[c] = coefs.get(c, 0.0) + 1.0
                    self.m.row(coefs, -highspy.kHighsInf, -self.constants_at[rp.point])

    def pair_var(self, e: int, kind: str, last: bool) -> int | None:
        """ρ ≥ the price ``kind`` of edge ``e`` (``problem.reshard_price``) under the chosen
        producer and consumer strategies (None when it is 0 for every pair)."""
        key = (e, kind, last)
        if key in self.rho:
            return self.rho[key]
        p, mesh = self.p, self.p.mesh
        edge = p.edges[e]
        prod = p.groups[edge.producer].strategies
        if kind in BACKWARD_PRICES:
            a_of = [without_partial(s.output_layout) for s in prod]
            c_of = p.groups[edge.consumer].input_grads[edge.input_index]
        else:
            a_of = [s.output_layout for s in prod]
            c_of = [s.input_layouts[edge.input_index] for s in p.groups[edge.consumer].strategies]
        a_set = sorted(set(a_of), key=repr)
        c_set = sorted(set(c_of), key=repr)
        spec = edge.tensor
        pkey = (spec.shape, spec.dtype_bytes, kind, last, tuple(a_set), tuple(c_set))
        if pkey not in self.prices:  # edges of one shape and layouts (q, k, v's input) share prices
            self.prices[pkey] = reshard_price_table(spec, kind, a_set, c_set, mesh, last) / self.bytes_unit
        table = self.prices[pkey]
        if not table.any():
            self.rho[key] = None
            return None
        rho = int(self.m.cols(1, integer=False, hi=highspy.kHighsInf)[0])
        # ρ ≥ Σ_c f(a, c)·X_cons(c) − max_c f(a, c)·(1 − X_prod(a)) for each a, or the same
        # with the roles swapped: whichever side has fewer distinct layouts.
        a_pos = {a: i for i, a in enumerate(a_set)}
        c_pos = {c: j for j, c in enumerate(c_set)}
        a_idx = np.array([a_pos[a] for a in a_of])
        c_idx = np.array([c_pos[c] for c in c_of])
        sides = [(table, a_idx, self.x[edge.producer], c_idx, self.x[edge.consumer]),
                 (table.T, c_idx, self.x[edge.consumer], a_idx, self.x[edge.producer])]
        f, fixed_idx, fixed_cols, other_idx, other_cols = min(sides, key=lambda side: len(side[0]))
        # A price paid only if the edge keeps its copy: also − max·(1 − κ).
        kept = [self.kappa[e]] if kind in KEPT_PRICES else []
        for u in range(f.shape[0]):
            top = f[u].max()
            if top <= 0:
                continue
            mine = fixed_cols[fixed_idx == u]
            cols = np.concatenate([[rho], other_cols, mine, kept])
            vals = np.concatenate([[1.0], -f[u, other_idx], np.full(len(mine) + len(kept), -top)])
            self.m.row((cols, vals), -top * (1 + len(kept)), highspy.kHighsInf)
        self.rho[key] = rho
        return rho

    def _copy_var(self, e: int, layout: Layout, reps: list[tuple[str, dict, dict]], producer: int) -> int | None:
        """c ≥ A − Π: edge ``e``'s consumer holds its own copy in ``layout`` (A: input copy,
        saved copy not kept or re-gathered copy, one row per representation ``reps`` of the
        copy; Π: the producer's output is exactly ``layout``, so the consumer holds the
        producer's tensor instead). Shared by every point where the same representations
        are live.

        For a saved or re-gathered copy Π is the edge flow's "producer layout L" under the
        same keep flag as A (not kept, kept): equal to the producer's indicator when the
        choices are integral, but in the LP relaxation a fractional plan can no longer
        cancel a kept edge's copy with the weight of another plan whose producer is in L
        and keeps nothing (GPT-3 6.7B on 2x4: the final norm's re-gathered output, a root
        LP bound 3.5e-4 below the optimum, 2.4e-4 with this)."""
        key = (e, layout, tuple(kind for kind, _, _ in reps))
        if key not in self.copy_vars:
            if not any(copy for _, copy, _ in reps):
                self.copy_vars[key] = None
                return None
            col = int(self.m.cols(1, integer=False)[0])
            by_keep = self.edge_vars[e]["producer_layout_cols"]
            for kind, copy, _ in reps:
                if copy:
                    if kind == INPUT_COPY:
                        prod = self.producer_in(producer, layout)
                    else:
                        prod = dict.fromkeys(by_keep[int(kind == REGATHER)].get(layout, ()), 1.0)
                    r = dict(copy)
                    for c, v in prod.items():
                        r[c] = r.get(c, 0.0) - v
                    r[col] = r.get(col, 0.0) - 1.0
                    self.m.row(r, -highspy.kHighsInf, 0.0)
            self.copy_vars[key] = col
        return self.copy_vars[key]

    def _held_vars(self, key: tuple, own: list[dict], copies: dict[int, list[tuple[str, dict, dict]]], producer: int,
                   layout: Layout) -> list[int]:
        """Columns whose sum counts the distinct tensors held in ``layout`` once the producer's
        own holder has ended: y for the producer's tensor, c_e for edge e's consumer copy
        (``_copy_var``). With K_e "edge e's consumer holds a copy in ``layout`` or keeps the
        producer's tensor in it":

            y ≥ each indicator of the producer's tensor (kept copies),   y + c_e ≥ K_e.

        With the choices integral the sum is exact (a consumer holding the producer's tensor
        may be counted in c_e instead of y, never twice)."""
        if key not in self.y:
            inf = highspy.kHighsInf
            ycol = int(self.m.cols(1, integer=False)[0])
            cols = [ycol]
            for ind in own:
                r = dict(ind)
                r[ycol] = r.get(ycol, 0.0) - 1.0
                self.m.row(r, -inf, 0.0)
            for e in sorted(copies):
                ccol = self._copy_var(e, layout, copies[e], producer)
                if ccol is not None:
                    cols.append(ccol)
                for _, _, anyone in copies[e]:
                    r = dict(anyone)
                    r[ycol] = r.get(ycol, 0.0) - 1.0
                    if ccol is not None:
                        r[ccol] = r.get(ccol, 0.0) - 1.0
                    self.m.row(r, -inf, 0.0)
            self.y[key] = cols
        return self.y[key]

    def add_budget_rows(self, objective: str, time_expr, max_step_time_s, memory_budget_bytes) -> None:
        if objective == "memory" and max_step_time_s is not None:
            self.m.row(time_expr, -highspy.kHighsInf, max_step_time_s / self.time_unit)
        if objective == "time":
            budget = memory_budget_bytes if memory_budget_bytes is not None else self.p.mesh.device_memory_bytes
            self.m.row({self.peak: 1.0}, -highspy.kHighsInf, budget / self.bytes_unit)

    def time_expression(self) -> tuple[np.ndarray, np.ndarray]:
        cols, vals = list(self.time_cols), list(self.time_vals)
        for g, grp in enumerate(self.p.groups):
            cols.append(self.x[g])
            vals.append(np.array([c.time_s * grp.instances / self.time_unit for c in grp.choices]))
        c = np.concatenate(cols)
        v = np.concatenate(vals)
        cols_u, inverse = np.unique(c, return_inverse=True)
        return cols_u, np.bincount(inverse, weights=v)


@dataclass(frozen=True)
class _Reference:
    """Cheap figures that scale the ILP and start its search."""

    memory_floor_bytes: float  # zero-redundancy bound: no plan's peak is lower (and the scale)
    least_peak_bytes: float  # a tighter plan-independent bound (``evaluate.peak_lower_bound``)
    time_floor_s: float  # every group at its fastest choice, no resharding: no plan is faster
    time_estimate_s: float  # a typical memory-lean plan's step time (ZeRO-3 where it exists)
    time_scale_s: float  # the slowest choice of every group: an over-estimate, of the right order


def _reference(problem: Problem) -> _Reference:
    time_floor = sum(g.instances * min(c.time_s for c in g.choices) for g in problem.groups)
    try:
        time_estimate = step_time(problem, zero(problem, 3))
    except ValueError:  # no ZeRO-3 here (BaselineUnavailable: e.g. a batch smaller than the mesh)
        time_estimate = time_floor
    return _Reference(
        memory_floor_bytes=float(zero_redundancy_bound(problem).max()),
        least_peak_bytes=peak_lower_bound(problem),
        time_floor_s=time_floor,
        time_estimate_s=time_estimate,
        # even where latencies, not FLOPs, dominate (tiny models)
        time_scale_s=sum(g.instances * max(c.time_s for c in g.choices) for g in problem.groups),
    )


def _units(ref: _Reference) -> tuple[float, float]:
    """Bytes and seconds per model unit: a power of two near the zero-redundancy bound and a
    power of ten near the step time, so the peak and the step time are O(1) in the model and
    HiGHS's absolute tolerances mean the same at any model size."""
    bytes_unit = 2.0 ** round(math.log2(max(ref.memory_floor_bytes, 1.0)))
    time_unit = 10.0 ** round(math.log10(max(ref.time_scale_s, 1e-12)))
    return bytes_unit, time_unit


def solve(
    problem: Problem,
    objective: str = "memory",
    max_step_time_s: float | None = None,
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 60.0,
    mip_gap: float = 2e-3,
    fixed: Selection | None = None,
    start: Selection | None = None,
) -> SolveResult:
    """Solve ``problem`` for ``objective``; with ``fixed``, price that complete plan through
    the ILP instead (every choice pinned), which checks the linearisation against the
    evaluator. ``start``: a plan of ``problem`` branch and bound starts from (default: every
    op unsplit); one within the budget guarantees an answer under a time limit."""
    if objective not in ("memory", "time"):
        raise MemshardError(f"unknown objective {objective!r}; use memory or time")
    started = time.perf_counter()
    b = IlpBuilder(problem)
    b.add_choice_rows()
    b.add_link_rows()
    b.add_edge_rows()
    b.add_memory_rows(problem.candidate_points)
    # Lazy reshard rows (see the module docstring), but not when pricing a given plan, nor
    # under a memory budget: a plan found without them may exceed it, and one found out of
    # time would then be no plan at all.
    lazy = fixed is None and (memory_budget_bytes is None or math.isinf(memory_budget_bytes))
    if not lazy:
        b.add_reshard_rows()
    t_cols, t_vals = b.time_expression()
    b.add_budget_rows(objective, (t_cols, t_vals), max_step_time_s, memory_budget_bytes)
    m = b.m

    if fixed is not None:
        for g, cols in enumerate(b.x):
            for c, col in enumerate(cols):
                m.lower[col] = m.upper[col] = float(c == fixed.choices[g])
        for e, col in b.kappa.items():
            m.lower[col] = m.upper[col] = float(fixed.keeps[e])
    hs = _Highs(m, started + time_limit_s, b.disjunctions())
    peak_obj = (np.array([b.peak]), np.array([1.0]))
    memory_floor = b.reference.memory_floor_bytes / b.bytes_unit
    time_estimate = b.reference.time_estimate_s / b.time_unit
    if objective == "memory":
        primary, secondary = peak_obj, (t_cols, t_vals)
        floor, scales = b.reference.least_peak_bytes / b.bytes_unit, (memory_floor, time_estimate)
    else:
        primary, secondary = (t_cols, t_vals), peak_obj
        floor, scales = b.reference.time_floor_s / b.time_unit, (time_estimate, memory_floor)
    fallback = b.selection_start(start) if start is not None else b.replicated_start()

    def add_reshard_rows(points: set[int]) -> None:
        cols, rows = len(m.lower), len(m.rows_lo)
        b.add_reshard_rows(points)
        hs.extend(m, cols, rows)

    def primary_of(ev: Evaluation) -> float:
        """The primary objective of a plan as the evaluator prices it (ILP units)."""
        return ev.peak_bytes / b.bytes_unit if objective == "memory" else ev.step_time_s / b.time_unit

    previous = None  # an earlier round's plan (over M at some reshard) and its evaluated objective
    lower = -math.inf  # every round's bound holds for the whole ILP: it has fewer rows
    while True:
        try:
            values, best, gap, timed_out, ties_resolved = hs.first_pass(
                primary, secondary, floor, scales, max(mip_gap, TIE_RESOLUTION), fallback)
        except Infeasible:
            raise Infeasible(objective) from None
        except SolverTimeLimit:
            if previous is None:
                raise SolverTimeLimit(time_limit_s) from None
            (values, best), timed_out, ties_resolved = previous, True, False
            gap = _relative_gap(best, lower)
            break
        lower = max(lower, best * (1 - gap))
        ev = evaluate(problem, b.selection(values)) if lazy else None
        over = b.over_m(values, ev) if lazy else set()
        if over and (timed_out or hs.expired()):  # out of time: the better plan, priced as it is
            best = primary_of(ev)
            if previous is not None and previous[1] < best:
                values, best = previous
            gap = _relative_gap(best, lower)
            break
        if not over:
            break
        # Reshards the plan runs hold more than M allows: again with their rows, from it.
        previous = (values, primary_of(ev))
        add_reshard_rows(over)
        fallback = b.selection_start(b.selection(values))
    if fixed is None and not ties_resolved and not hs.expired():
        # Second pass: hold the primary objective within the gap of the best bound, minimise
        # the other one. The slack is at least the rows' feasibility tolerance accumulated
        # along the chain of live-byte variables (≈1e-6 of the peak); ties finer than 1e-5
        # of the primary objective are broken by the secondary one. (The first pass's plan
        # meets every row, so its optimum holds with the reshard rows too.)
        tolerance = max(mip_gap, TIE_RESOLUTION)
        hs.add_row(primary, second_pass_cap(best, lower, tolerance))
        second_start = values
        with contextlib.suppress(SolverTimeLimit):  # else keep the first pass's plan
            while True:
                second, _, _, second_timed_out = hs.run(secondary, tolerance, start=second_start)
                over = b.over_m(second) if lazy else set()
                if not over:
                    values, timed_out = second, timed_out or second_timed_out
                    if lower > 0:  # the gap of the plan returned, not of the first pass's
                        gap = max(gap, _relative_gap(float(second[primary[0]] @ primary[1]), lower))
                    break
                if second_timed_out or hs.expired():
                    break  # the first pass's plan stands
                add_reshard_rows(over)
                second_start = b.selection_start(b.selection(values))
    rows = len(m.rows_lo)
    return SolveResult(
        selection=b.selection(values),
        status="time_limit" if timed_out else "optimal",
        objective=objective,
        gap=gap,
        time_s=time.perf_counter() - started,
        variables=len(m.lower),
        constraints=rows,
        # The first pass's optimum: the tie-break pass may leave M anywhere in its slack.
        ilp_peak_bytes=(best if objective == "memory" else float(values[b.peak])) * b.bytes_unit,
    )


@dataclass
class _Search:
    """A dive's state: its gap, its budget (simplex iterations) and what it spent, the best
    integral solution met and its objective."""

    gap: float
    effort: float
    best: np.ndarray | None
    value: float
    branches: int = 0
    iterations: int = 0

    def cutoff(self) -> float:
        return self.value - DIVE_CUTOFF * self.gap * abs(self.value) if self.best is not None else math.inf

    def affordable(self) -> bool:
        return self.branches < DIVE_BRANCHES and self.iterations < self.effort

    def proved(self, bound: float) -> bool:
        return self.value - bound <= self.gap * abs(self.value)


class _Highs:
    """One HiGHS model solved several times with different objectives and extra rows, each
    branch and bound warm-started from a given or freshly found solution, and preceded, when
    ``disjunctions`` are given, by a dive (``_dive``) until one leaves its gap open."""

    def __init__(self, m: _Model, deadline: float, disjunctions: list[Disjunction] | None = None):
        self.deadline = deadline
        self.n = len(m.lower)
        self.disjunctions = disjunctions or []
        self.dive = bool(self.disjunctions)  # until a dive fails to prove its plan
        self.lower, self.upper = np.array(m.lower), np.array(m.upper)  # the integer columns' bounds
        self.integer_cols = np.flatnonzero(np.array(m.integer, dtype=bool))
        log = bool(os.environ.get("MEMSHARD_HIGHS_LOG"))
        with contextlib.nullcontext() if log else _silenced_stdout():
            h = self.h = highspy.Highs()  # prints a banner from C++ on construction
        h.setOptionValue("output_flag", log)
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("threads", 1)
        h.setOptionValue("mip_abs_gap", 1e-9)
        h.setOptionValue("presolve", "off")  # its probing costs more than it saves here
        lp = highspy.HighsLp()
        lp.num_col_ = self.n
        lp.num_row_ = len(m.rows_lo)
        lp.col_cost_ = np.zeros(self.n)
        lp.col_lower_ = np.array(m.lower)
        lp.col_upper_ = np.array(m.upper)
        lp.row_lower_ = np.array(m.rows_lo)
        lp.row_upper_ = np.array(m.rows_hi)
        starts = np.zeros(len(m.row_cols) + 1, dtype=np.int64)
        starts[1:] = np.cumsum([len(c) for c in m.row_cols])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = starts
        lp.a_matrix_.index_ = np.concatenate(m.row_cols) if m.row_cols else np.zeros(0, dtype=np.int64)
        lp.a_matrix_.value_ = np.concatenate(m.row_vals) if m.row_vals else np.zeros(0)
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in m.integer]
        h.passModel(lp)

    def extend(self, m: _Model, cols: int, rows: int) -> None:
        """Pass the continuous columns and the rows ``m`` gained since it had ``cols`` and
        ``rows`` of them."""
        h, n = self.h, len(m.lower)
        if any(m.integer[cols:]):
            raise ValueError("only continuous columns can be added")
        if n > cols:
            h.addVars(n - cols, np.array(m.lower[cols:]), np.array(m.upper[cols:]))
            self.n = n
        lengths = [len(c) for c in m.row_cols[rows:]]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32) if lengths else np.zeros(0, np.int32)
        h.addRows(len(lengths), np.array(m.rows_lo[rows:]), np.array(m.rows_hi[rows:]), int(sum(lengths)), starts,
                  np.concatenate(m.row_cols[rows:]).astype(np.int32) if lengths else np.zeros(0, np.int32),
                  np.concatenate(m.row_vals[rows:]) if lengths else np.zeros(0))

    def expired(self) -> bool:
        return time.perf_counter() >= self.deadline

    def _limit_time(self) -> None:
        """HiGHS's time limit: what is left until the deadline."""
        self.h.setOptionValue("time_limit", max(self.deadline - time.perf_counter(), 1e-3))

    @contextlib.contextmanager
    def _relaxing(self, solver: str):
        """Within: solve the LP relaxation with ``solver``, in the time left; after: branch and
        bound again."""
        h = self.h
        h.setOptionValue("solve_relaxation", True)
        h.setOptionValue("solver", solver)
        self._limit_time()
        try:
            yield h
        finally:
            h.setOptionValue("solve_relaxation", False)
            h.setOptionValue("solver", "choose")

    def add_row(self, expr, upper: float) -> None:
        cols, vals = expr
        self.h.addRow(-highspy.kHighsInf, upper, len(cols), cols.astype(np.int32), vals)

    def _set_cost(self, expr) -> None:
        cost = np.zeros(self.n)
        np.add.at(cost, expr[0], expr[1])
        self.h.changeColsCost(self.n, np.arange(self.n, dtype=np.int32), cost)

    def run(self, expr, gap: float, start=None):
        """Minimise ``expr`` to relative ``gap``: the dive, and where it does not prove its
        plan, branch and bound from that plan, else from ``start`` (a full or partial
        solution): (values, objective, gap, timed_out)."""
        h = self.h
        self._set_cost(expr)
        if self.dive:
            incumbent = None
            if isinstance(start, np.ndarray):
                incumbent = (start, float(start[expr[0]] @ expr[1]))
            dived = self._dive(gap, incumbent)
            if dived is not None:
                values, value, bound = dived
                if value - bound <= gap * abs(value) + 1e-9:
                    return values, value, _relative_gap(value, bound), False
                if start is None:
                    start = values
            # A model whose relaxation a dive did not settle seldom changes in the next runs
            # (the same rows and a few more, another objective): no more dives, each an LP.
            self.dive = False
        h.setOptionValue("mip_rel_gap", gap)
        self._limit_time()
        if isinstance(start, tuple):  # partial: HiGHS completes it
            h.setSolution(len(start[0]), start[0].astype(np.int32), start[1].astype(np.float64))
        elif start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = list(start)
            sol.value_valid = True
            h.setSolution(sol)
        h.run()
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            raise Infeasible("")
        info = h.getInfo()
        if info.primal_solution_status != 2:
            if status == highspy.HighsModelStatus.kTimeLimit:
                raise SolverTimeLimit()
            raise MemshardError(f"solver stopped without a plan: {h.modelStatusToString(status)}")
        values = np.array(h.getSolution().col_value)
        gap = float(info.mip_gap) if np.isfinite(info.mip_gap) else 0.0
        return values, float(info.objective_function_value), gap, status == highspy.HighsModelStatus.kTimeLimit

    def _dive(self, gap: float, incumbent: tuple[np.ndarray, float] | None):
        """The LP relaxation of the set objective, by simplex; where it is fractional, a
        branching DIVE_DEPTH levels deep on its most fractional disjunctions, each branch
        warm-started from its parent's basis: (the best integral solution met, or the
        ``incumbent`` (values, objective) if none is better, its objective, a lower bound on
        the ILP's), or None where neither exists.

        On memshard's ILPs the relaxation is often integral already, or splits one or two
        decisions (a tied weight's storage, a keep flag) whose branches are integral:
        HiGHS's branch and bound would spend most of its time in root cuts and heuristics to
        prove what the branches show. A branch's bound is its LP optimum (or, not solved, its
        parent's plus what the reduced cost says moving its column costs: a dual bound), or
        where it branches further, the least of its own branches' bounds if larger. Once a
        plan is known, a branch stops where its dual simplex passes a cutoff DIVE_CUTOFF of
        the gap below that plan (HiGHS's ``objective_bound``, the node cutoff of its own
        search). The root's bound is, for each disjunction branched on, the least of its
        branches' bounds (one of them holds for every plan); the largest over them. At most
        DIVE_BRANCHES branches are solved, in at most DIVE_EFFORT times the relaxation's
        simplex iterations: counts, not times, so that the same input gives the same plan.
        The dive gives up where the relaxation's own branches, explored first, yield no plan."""
        with self._relaxing("simplex") as h:
            h.run()
            if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return None
            info, solution = h.getInfo(), h.getSolution()
            relaxed = float(info.objective_function_value)
            x = np.array(solution.col_value)
            if self._integral(x):
                return x, relaxed, relaxed
            search = _Search(gap, DIVE_EFFORT * max(info.simplex_iteration_count, 1), *(
                incumbent if incumbent is not None else (None, math.inf)))
            try:
                bound = self._subtree(search, x, np.array(solution.col_dual), relaxed, h.getBasis(), 0)
            finally:
                h.setOptionValue("objective_bound", highspy.kHighsInf)
            if bound is None or search.best is None:
                return None
            return search.best, search.value, min(bound, search.value)

    def _subtree(self, search: _Search, x: np.ndarray, reduced: np.ndarray, relaxed: float, basis,
                 depth: int) -> float | None:
        """A lower bound on the ILP below a node whose relaxation is ``x`` (objective
        ``relaxed``, reduced costs, ``basis``), branching on its most fractional disjunctions
        (all at the root, one below); None at the root if its own branches found no plan."""
        h = self.h

        def share(branch):  # how much of the relaxation takes the branch
            col, at = branch
            return x[col] if at else 1 - x[col]

        fractional = sorted((d for d in self.disjunctions if max(map(share, d)) < 1 - INTEGRALITY),
                            key=lambda d: (max(map(share, d)), d[0]))
        bound = relaxed
        for disjunction in fractional if depth == 0 else fractional[:1]:
            least = math.inf
            # the relaxation's own branches first, then the least reduced cost
            for col, at in sorted(disjunction, key=lambda b: (-share(b), reduced[b[0]] * (b[1] - x[b[0]]), b)):
                if depth == 0 and search.best is None and share((col, at)) <= INTEGRALITY:
                    return None  # the relaxation's own branches gave no plan: not this dive's kind
                cutoff = search.cutoff()
                branch = relaxed + max(float(reduced[col]) * (at - x[col]), 0.0)
                if branch < cutoff and search.affordable() and not self.expired():
                    h.changeColBounds(col, at, at)
                    try:
                        branch = self._branch(search, basis, cutoff, branch, depth)
                    finally:
                        h.changeColBounds(col, self.lower[col], self.upper[col])
                least = min(least, branch)
            bound = max(bound, least)
            if search.proved(bound) or not search.affordable():
                break
        return bound

    def _branch(self, search: _Search, basis, cutoff: float, fallback: float, depth: int) -> float:
        """Solve the relaxation as fixed now, from ``basis``, stopped at ``cutoff``; keep its
        solution if integral and better, else branch on below DIVE_DEPTH: a lower bound on
        the branch (``fallback`` if none was found)."""
        h = self.h
        h.setBasis(basis)
        h.setOptionValue("objective_bound", cutoff)
        self._limit_time()
        h.run()
        status, info = h.getModelStatus(), h.getInfo()
        search.branches += 1
        search.iterations += max(info.simplex_iteration_count, 1)
        if status == highspy.HighsModelStatus.kInfeasible:
            return math.inf
        if status == highspy.HighsModelStatus.kObjectiveBound:
            return cutoff
        if status != highspy.HighsModelStatus.kOptimal:
            return fallback
        value = float(info.objective_function_value)
        solution = h.getSolution()
        x = np.array(solution.col_value)
        if self._integral(x):
            if value < search.value:
                search.best, search.value = x, value
            return value
        if depth + 1 < DIVE_DEPTH and search.affordable():
            below = self._subtree(search, x, np.array(solution.col_dual), value, h.getBasis(), depth + 1)
            return max(value, below)
        return value

    def _integral(self, x: np.ndarray) -> bool:
        v = x[self.integer_cols]
        return bool(np.all(np.abs(v - np.round(v)) <= INTEGRALITY))

    def relaxation(self, expr) -> float | None:
        """The LP relaxation's minimum of ``expr`` (None if not found in time): interior point
        without crossover, a bound is all that is needed."""
        self._set_cost(expr)
        with self._relaxing("ipm") as h:
            h.setOptionValue("run_crossover", "off")
            h.run()
            if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return None
            return float(h.getInfo().objective_function_value)

    def first_pass(self, expr, tie_break, floor: float, scales: tuple[float, float], gap: float, fallback):
        """Minimise ``expr`` (≥ ``floor``), ties broken by ``tie_break``: (values, value of
        ``expr``, gap, timed_out, ties resolved).

        Branch and bound on ``expr`` alone stalls on its many exact ties (which axis splits
        the batch, …): HiGHS's primal heuristics find no plan for long. So branch and bound
        first minimises ``expr`` + w·``tie_break`` from ``fallback`` (a partial solution:
        columns, values), w such that ``tie_break`` weighs TIE_BREAK of ``expr`` at their
        typical ``scales``, to a gap TIE_BREAK times finer. Usually that plan is optimal for
        ``expr``, as ``floor`` often shows at once, or else the LP relaxation of ``expr``
        alone. Its ties are resolved to within ``gap`` of ``tie_break`` when the blend's
        remaining gap and HiGHS's tolerances, divided by w, are that small. Otherwise branch
        and bound on ``expr`` alone continues from it, and where it finds nothing better the
        blend's plan (and its tie-breaking) stands.
        """
        blend, w = blend_objective(expr, tie_break, scales)
        values, blend_value, blend_gap, timed_out = self.run(blend, gap * TIE_BREAK, start=fallback)
        value = float(values[expr[0]] @ expr[1])
        # what the blend may be off by: its gap, and the integrality and feasibility tolerances
        blend_error = (blend_gap + HIGHS_TOLERANCE) * max(abs(blend_value), 1.0)
        ties_resolved = blend_error <= w * gap * abs(float(values[tie_break[0]] @ tie_break[1]))
        floor_gap = _relative_gap(value, floor)
        if timed_out or self.expired():
            return values, value, floor_gap, True, False
        if floor_gap <= gap:
            return values, value, floor_gap, False, ties_resolved
        bound = self.relaxation(expr)
        if bound is not None and bound > floor:
            floor_gap = _relative_gap(value, bound)
            if floor_gap <= gap:
                return values, value, floor_gap, False, ties_resolved
        try:
            best, best_value, best_gap, timed_out = self.run(expr, gap, start=values)
        except SolverTimeLimit:
            return values, value, floor_gap, True, False
        if best_value >= value - abs(value) * TIE_RESOLUTION:  # the blend's plan stands
            return values, value, best_gap, timed_out, ties_resolved and not timed_out
        return best, best_value, best_gap, timed_out, False


def second_pass_cap(best: float, lower: float, tolerance: float) -> float:
    """The most the tie-break pass lets the primary objective reach: within ``tolerance`` of
    the best bound ``lower``, and at least ``best`` (the first pass's) plus TIE_RESOLUTION."""
    cap = best + abs(best) * TIE_RESOLUTION
    if lower > 0:
        cap = max(cap, lower / (1 - tolerance))
    return cap + 1e-9


def blend_objective(expr, tie_break, scales: tuple[float, float]):
    """``expr`` + w·``tie_break``, w such that ``tie_break`` weighs TIE_BREAK of ``expr`` at
    their typical ``scales``: ((columns, coefficients), w)."""
    w = TIE_BREAK * scales[0] / scales[1] if scales[0] > 0 and scales[1] > 0 else TIE_BREAK
    return (np.concatenate([expr[0], tie_break[0]]), np.concatenate([expr[1], tie_break[1] * w])), w


def _relative_gap(value: float, bound: float) -> float:
    """How far ``value`` may be above the optimum, given a lower ``bound`` on it."""
    return max(0.0, (value - bound) / abs(value)) if value else 0.0


@contextlib.contextmanager
def _silenced_stdout():
    """Send the process's C-level stdout to /dev/null for a moment (HiGHS's banner)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


class SolverTimeLimit(MemshardError):
    def __init__(self, limit_s: float | None = None):
        within = f" ({limit_s:g} s)" if limit_s is not None else ""
        super().__init__(f"solver time limit{within} hit before any plan was found; raise --time-limit")


class Infeasible(MemshardError):
    def __init__(self, objective: str):
        super().__init__(f"no plan satisfies the {objective} constraints")
        self.objective = objective
