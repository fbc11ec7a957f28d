r"""The ILP that picks one strategy per op, one storage option per parameter and the edges'
keep flags, solved with HiGHS (``highspy``).

Formulation (memory in GiB and time in ms inside the model, for conditioning)::

  variables
    x[g,c] ∈ {0,1}     group g (op strategy, parameter storage) takes choice c
    z[e,k,a,σ] ≥ 0     edge e, keep copy k ∈ {0,1}, resharding step a (mesh axis a), in
                       state σ = (consumer placements on axes < a, producer placements on
                       axes ≥ a, consumer placement on axis a)
    κ[e] ∈ {0,1}       edge e keeps its saved copy in the producer's layout
    y[τ,H,L] ≥ 0       tensor τ is held in layout L by one of the holders H live together
    M ≥ 0              peak bytes per device

  one choice      Σ_c x[g,c] = 1                                        add_choice_rows
  links           Σ_{c: ℓ_a(c)=ℓ} x[a,c] = Σ_{c: ℓ_b(c)=ℓ} x[b,c]  ∀ℓ    add_link_rows
  edge flow       Σ_k Σ_{σ at a=0 with producer part L} z = Σ_{s: out(s)=L} x[p,s]
                  Σ_k Σ_{σ at a=A−1 with consumer part K} z = Σ_{s: in(s)=K} x[c,s]
                  flow into each state of step a+1 = flow out of step a     add_edge_rows
                  Σ_{σ} z[e,1,0,σ] = κ[e]
  holders         y[τ,H,L] ≥ [holder h holds τ in L]  ∀h ∈ H                add_holder_rows
  peak            Σ live bytes at point t ≤ M   for every candidate point t   add_memory_rows
  step time       T = Σ instances·time(x) + Σ instances·time(z)             time_expression
                  T ≤ budget (objective "memory" with --max-step-time)      add_budget_row
                  M ≤ capacity (objective "time")                            add_budget_row

The edge flow is Alpa's edge linearisation factored by mesh axis: resharding runs axis by axis
(forward in axis order, gradients in reverse), so the cost of step a depends only on σ, and
an edge needs Σ_a |σ_a| variables instead of |producer layouts| × |consumer layouts|. With the
x integral the flow is integral (each state has one way in and out), so z is continuous.

Objectives: ``memory`` minimises M, then, with M held at its optimum, the step time (ties
broken by time); ``time`` minimises T subject to M ≤ budget, then M. Solver options are
fixed (one thread, seed 0) so the same input gives the same plan.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import highspy
import numpy as np

from memshard.cost import comm
from memshard.errors import MemshardError
from memshard.placement import Layout, Partial, Shard
from memshard.problem import INPUT_COPY, PRODUCER, REGATHER, SAVED, Holder, Problem, Selection, without_partial

# Weight of the secondary objective in the warm-start pass, in the model's units (see _units).
TIE_BREAK = {"memory": 1e-4, "time": 1e-3}


@dataclass(frozen=True)
class SolveResult:
    selection: Selection
    status: str  # "optimal", "time_limit" (feasible, with gap)
    objective: str
    gap: float
    time_s: float
    variables: int
    constraints: int
    ilp_peak_bytes: float
    ilp_step_time_s: float


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
        self.bytes_unit, self.time_unit = _units(problem)
        self.x = [self.m.cols(len(g.choices), integer=True) for g in problem.groups]
        self.edge_vars: list[dict] = []
        self.kappa: dict[int, int] = {}
        self.y: dict[tuple, int] = {}
        self.peak = int(self.m.cols(1, integer=False, hi=highspy.kHighsInf)[0])
        self.time_cols: list[np.ndarray] = []
        self.time_vals: list[np.ndarray] = []

    # -- rows ----------------------------------------------------------------------------------
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
        prod_strats = p.groups[edge.producer].meta["strategies"]
        cons_strats = p.groups[edge.consumer].meta["strategies"]
        grads = p.groups[edge.consumer].meta["input_grads"][edge.input_index]
        prod_layouts = sorted({s.output_layout for s in prod_strats}, key=repr)
        # consumer key per axis: (input placement, gradient placement)
        cons_keys = sorted({tuple(zip(s.input_layouts[edge.input_index], g)) for s, g in zip(cons_strats, grads)}, key=repr)
        prod_suffixes = [{L[a:] for L in prod_layouts} for a in range(A + 1)]
        cons_prefixes = [{K[:a] for K in cons_keys} for a in range(A + 1)]
        p_vals = [sorted({L[a] for L in prod_layouts}, key=repr) for a in range(A)]
        c_vals = [sorted({K[a] for K in cons_keys}, key=repr) for a in range(A)]
        keeps = (0, 1) if edge.saves else (0,)
        out = {"steps": {}, "keeps": keeps}
        cost_cols, cost_vals = [], []
        for k in keeps:
            for a in range(A):
                states = []
                for cpre in cons_prefixes[a]:
                    for psuf in prod_suffixes[a]:
                        if k and any(isinstance(x, Partial) for x in psuf):
                            continue
                        for cv in c_vals[a]:
                            if cpre + (cv,) not in cons_prefixes[a + 1]:
                                continue
                            states.append((cpre, psuf, cv))
                cols = self.m.cols(len(states), integer=False)
                out["steps"][(k, a)] = (states, cols)
                for (cpre, psuf, cv), col in zip(states, cols):
                    t = self._step_time(spec, a, cpre, psuf, cv, k, mesh)
                    if t:
                        cost_cols.append(col)
                        cost_vals.append(t * edge.instances / self.time_unit)
        if cost_cols:
            self.time_cols.append(np.array(cost_cols))
            self.time_vals.append(np.array(cost_vals))
        # producer side: step 0 states with producer layout L
        for L in prod_layouts:
            coefs: dict[int, float] = {}
            for k in keeps:
                states, cols = out["steps"][(k, 0)]
                for (_, psuf, _), col in zip(states, cols):
                    if psuf == L:
                        coefs[int(col)] = 1.0
            for c, s in enumerate(prod_strats):
                if s.output_layout == L:
                    coefs[int(self.x[edge.producer][c])] = -1.0
            self.m.row(coefs, 0.0, 0.0)
        # consumer side: last step states with consumer key K
        for K in cons_keys:
            coefs = {}
            for k in keeps:
                states, cols = out["steps"][(k, A - 1)]
                for (cpre, _, cv), col in zip(states, cols):
                    if cpre + (cv,) == K:
                        coefs[int(col)] = 1.0
            for c, (s, g) in enumerate(zip(cons_strats, grads)):
                if tuple(zip(s.input_layouts[edge.input_index], g)) == K:
                    coefs[int(self.x[edge.consumer][c])] = -1.0
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
        if edge.saves:
            kappa = int(self.m.cols(1, integer=True)[0])
            self.kappa[e] = kappa
            coefs = {int(c): 1.0 for c in out["steps"][(1, 0)][1]}
            coefs[kappa] = -1.0
            self.m.row(coefs, 0.0, 0.0)
        return out

    @staticmethod
    def _step_time(spec, a, cpre, psuf, cv, keep, mesh) -> float:
        lc_pre = tuple(pl for pl, _ in cpre)
        gc_pre = tuple(g for _, g in cpre)
        gp_suf = tuple(without_partial(psuf))
        calls = []
        cur = lc_pre + psuf
        step = comm.reshard_step(spec.shape, spec.dtype_bytes, cur, a, cv[0], mesh)
        if step:
            calls.append(step)
            if keep:
                calls.append(step)
        cur_b = gc_pre + (cv[1],) + gp_suf[1:]
        step = comm.reshard_step(spec.shape, spec.dtype_bytes, cur_b, a, gp_suf[0], mesh)
        if step:
            calls.append(step)
        return comm.total_time(calls, mesh)

    def indicator(self, h: Holder, layout: Layout) -> dict[int, float]:
        """Linear expression of "holder h holds its tensor in ``layout``"."""
        p = self.p
        if h.kind == PRODUCER:
            strats = p.groups[h.source].meta["strategies"]
            return {int(self.x[h.source][c]): 1.0 for c, s in enumerate(strats) if without_partial(s.output_layout) == layout}
        edge = p.edges[h.source]
        if h.kind == INPUT_COPY:
            strats = p.groups[edge.consumer].meta["strategies"]
            return {int(self.x[edge.consumer][c]): 1.0 for c, s in enumerate(strats) if s.input_layouts[edge.input_index] == layout}
        ev = self.edge_vars[h.source]
        last = self.p.mesh.ndim - 1
        out: dict[int, float] = {}

        def consumer_side(k):
            states, cols = ev["steps"][(k, last)]
            for (cpre, _, cv), col in zip(states, cols):
                if tuple(pl for pl, _ in cpre + (cv,)) == layout:
                    out[int(col)] = 1.0

        if h.kind == SAVED:
            consumer_side(0)
            if 1 in ev["keeps"]:
                states, cols = ev["steps"][(1, 0)]
                for (_, psuf, _), col in zip(states, cols):
                    if psuf == layout:
                        out[int(col)] = 1.0
        elif h.kind == REGATHER and 1 in ev["keeps"]:
            consumer_side(1)
        return out

    def add_memory_rows(self, points: list[int]) -> list[int]:
        """One row per candidate point: live bytes − M ≤ −constants."""
        p = self.p
        slot_groups: dict[tuple, np.ndarray] = {}
        for s in p.slots:  # merge slots with one group and interval (e.g. layers' weights)
            key = (s.group, s.start, s.end)
            slot_groups[key] = slot_groups.get(key, 0) + s.nbytes
        slot_keys = list(slot_groups)
        starts = np.array([k[1] for k in slot_keys])
        ends = np.array([k[2] for k in slot_keys])
        holders_by_tensor: dict[int, list[Holder]] = defaultdict(list)
        for h in p.holders:
            holders_by_tensor[h.tensor].append(h)
        h_start = {t: np.array([h.start for h in hs]) for t, hs in holders_by_tensor.items()}
        h_end = {t: np.array([h.end for h in hs]) for t, hs in holders_by_tensor.items()}
        indicator_cache: dict[tuple, dict[int, float]] = {}
        rows = []
        previous: dict[int, float] = {}
        previous_col = None
        for t in points:
            expr: dict[int, float] = defaultdict(float)
            for idx in np.nonzero((starts <= t) & (t <= ends))[0]:
                g = slot_keys[idx][0]
                for col, v in zip(self.x[g], slot_groups[slot_keys[idx]] / self.bytes_unit):
                    if v:
                        expr[int(col)] += v
            # holders: aggregate equal (tensor role, live holder set) across shared layers
            counts: dict[tuple, list] = {}
            for tensor, hs in holders_by_tensor.items():
                live = np.nonzero((h_start[tensor] <= t) & (t <= h_end[tensor]))[0]
                if not len(live):
                    continue
                active = tuple(hs[i] for i in live)
                sig = (p.held[tensor].key, _tensor_role(p, tensor), tuple(sorted((h.kind, h.source) for h in active)))
                if sig in counts:
                    counts[sig][1] += 1
                else:
                    counts[sig] = [(tensor, active), 1]
            for sig, ((tensor, active), count) in counts.items():
                held = p.held[tensor]
                for lid, layout in enumerate(held.layouts):
                    nbytes = held.nbytes[lid] / self.bytes_unit * count
                    if nbytes == 0:
                        continue
                    exprs = []
                    for h in active:
                        key = (h.kind, h.source, layout)
                        if key not in indicator_cache:
                            indicator_cache[key] = self.indicator(h, layout)
                        if indicator_cache[key]:
                            exprs.append(indicator_cache[key])
                    if len(exprs) == 1:
                        for col, v in exprs[0].items():
                            expr[col] += v * nbytes
                    elif exprs:
                        expr[self._or_var((sig, lid), exprs)] += nbytes
            const = sum(c.nbytes for c in p.constants if c.start <= t <= c.end) / self.bytes_unit
            # Live bytes as a chain L_t = L_prev + (what changed), so each row stays sparse.
            live_col = int(self.m.cols(1, integer=False, lo=-highspy.kHighsInf, hi=highspy.kHighsInf)[0])
            diff = {col: v - previous.get(col, 0.0) for col, v in expr.items()}
            for col, v in previous.items():
                if col not in expr:
                    diff[col] = -v
            diff[live_col] = -1.0
            if previous_col is not None:
                diff[previous_col] = 1.0
            self.m.row(diff, 0.0, 0.0)
            rows.append(self.m.row({live_col: 1.0, self.peak: -1.0}, -highspy.kHighsInf, -const))
            previous, previous_col = expr, live_col
        return rows

    def _or_var(self, key: tuple, exprs: list[dict[int, float]]) -> int:
        """A variable ≥ each of ``exprs``: the tensor is held in this layout by any holder."""
        if key not in self.y:
            ycol = int(self.m.cols(1, integer=False)[0])
            self.y[key] = ycol
            for expr in exprs:
                row = dict(expr)
                row[ycol] = row.get(ycol, 0.0) - 1.0
                self.m.row(row, -highspy.kHighsInf, 0.0)
        return self.y[key]

    def time_expression(self) -> tuple[np.ndarray, np.ndarray]:
        cols, vals = list(self.time_cols), list(self.time_vals)
        for g, grp in enumerate(self.p.groups):
            cols.append(self.x[g])
            vals.append(np.array([c.time_s * grp.instances / self.time_unit for c in grp.choices]))
        c = np.concatenate(cols)
        v = np.concatenate(vals)
        cols_u, inverse = np.unique(c, return_inverse=True)
        return cols_u, np.bincount(inverse, weights=v)


def _units(problem: Problem) -> tuple[float, float]:
    """Bytes and seconds per model unit: powers of two and ten near the problem's scale, so
    peak and step time are O(1) in the model and HiGHS's tolerances mean the same at any size."""
    total_bytes = sum(float(s.nbytes.max()) for s in problem.slots) + sum(float(h.nbytes.max()) for h in problem.held)
    total_bytes += sum(c.nbytes for c in problem.constants)
    total_time = sum(g.instances * max(c.time_s for c in g.choices) for g in problem.groups)
    bytes_unit = 2.0 ** math.floor(math.log2(max(total_bytes, 1.0)))
    time_unit = 10.0 ** math.floor(math.log10(max(total_time, 1e-12)))
    return bytes_unit, time_unit


def _tensor_role(p: Problem, tensor: int) -> str:
    name = p.held[tensor].name
    return name.split(".", 2)[2] if name.startswith("layers.") else name


def solve(
    problem: Problem,
    objective: str = "memory",
    max_step_time_s: float | None = None,
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 60.0,
    mip_gap: float = 1e-4,
) -> SolveResult:
    if objective not in ("memory", "time"):
        raise MemshardError(f"unknown objective {objective!r}; use memory or time")
    started = time.perf_counter()
    b = IlpBuilder(problem)
    b.add_choice_rows()
    b.add_link_rows()
    b.add_edge_rows()
    b.add_memory_rows(problem.candidate_points)
    t_cols, t_vals = b.time_expression()
    m = b.m
    if objective == "memory" and max_step_time_s is not None:
        m.row((t_cols, t_vals), -highspy.kHighsInf, max_step_time_s / b.time_unit)
    if objective == "time":
        budget = memory_budget_bytes if memory_budget_bytes is not None else problem.mesh.device_memory_bytes
        m.row(({b.peak: 1.0}), -highspy.kHighsInf, budget / b.bytes_unit)

    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(__import__("os").environ.get("MEMSHARD_HIGHS_LOG")))
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", mip_gap)
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.setOptionValue("presolve", "off")
    n = len(m.lower)
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = len(m.rows_lo)
    lp.col_cost_ = np.zeros(n)
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
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in m.integer]
    h.passModel(lp)

    def run(cost_cols, cost_vals, remaining, start):
        cost = np.zeros(n)
        np.add.at(cost, cost_cols, cost_vals)
        h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
        h.setOptionValue("time_limit", max(remaining, 1e-3))
        if start is not None:
            h.setSolution(start)
        h.run()
        return h.getModelStatus()

    peak_obj = (np.array([b.peak]), np.array([1.0]))
    if objective == "memory":
        primary, secondary = peak_obj, (t_cols, t_vals)
    else:
        primary, secondary = (t_cols, t_vals), peak_obj
    # Warm start: the primary objective plus a small weight on the secondary one breaks the
    # many exact ties (which axis splits the batch, …) that stall HiGHS's primal heuristics.
    blend = (np.concatenate([primary[0], secondary[0]]),
             np.concatenate([primary[1], secondary[1] * TIE_BREAK[objective]]))
    status = run(*blend, time_limit_s - (time.perf_counter() - started), None)
    solution = h.getSolution() if h.getInfo().primal_solution_status == 2 else None
    status = run(*primary, time_limit_s - (time.perf_counter() - started), solution)
    info = h.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise Infeasible(objective)
    if info.primal_solution_status != 2:  # no feasible solution
        if status == highspy.HighsModelStatus.kTimeLimit:
            raise MemshardError(
                f"solver time limit ({time_limit_s:g} s) hit before any plan was found; raise --time-limit"
            )
        raise MemshardError(f"solver stopped without a plan: {h.modelStatusToString(status)}")
    gap = float(info.mip_gap) if np.isfinite(info.mip_gap) else 0.0
    timed_out = status == highspy.HighsModelStatus.kTimeLimit
    best = float(info.objective_function_value)
    solution = h.getSolution()
    # Second pass: hold the primary objective at its optimum, minimise the other one.
    remaining = time_limit_s - (time.perf_counter() - started)
    if not timed_out and remaining > 0.1:
        slack = max(abs(best) * mip_gap, 1e-9)
        row_cols, row_vals = primary
        h.addRow(-highspy.kHighsInf, best + slack, len(row_cols), row_cols.astype(np.int32), row_vals)
        status2 = run(*secondary, remaining, solution)
        if h.getInfo().primal_solution_status == 2:
            solution = h.getSolution()
            timed_out = status2 == highspy.HighsModelStatus.kTimeLimit
    values = np.array(solution.col_value)
    choices = tuple(int(np.argmax(values[cols])) for cols in b.x)
    keeps = tuple(int(round(values[b.kappa[e]])) if e in b.kappa else 0 for e in range(len(problem.edges)))
    step_time = float(values[t_cols] @ t_vals) * b.time_unit
    return SolveResult(
        selection=Selection(choices, keeps),
        status="time_limit" if timed_out else "optimal",
        objective=objective,
        gap=gap,
        time_s=time.perf_counter() - started,
        variables=n,
        constraints=len(m.rows_lo) + 1,
        ilp_peak_bytes=float(values[b.peak]) * b.bytes_unit,
        ilp_step_time_s=step_time,
    )


class Infeasible(MemshardError):
    def __init__(self, objective: str):
        super().__init__(f"no plan satisfies the {objective} constraints")
        self.objective = objective
