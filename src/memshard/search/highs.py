"""The search on one HiGHS model: one minimisation, as stages (``docs/search.md``).

Every minimisation (:meth:`HighsSearch.minimise`) starts with a dive (:meth:`HighsSearch.run_dive`):
the LP relaxation by simplex, which on memshard's ILPs is often integral already (the plan,
proved optimal by its own relaxation), else up to ``SearchLimits.dive_depth`` levels of
branching on its most fractional disjunctions (a group's choices, a keep flag's two values),
each branch warm-started from its parent's basis, which proves the plan where the relaxation
split one or two decisions (a tied embedding's storage between two choices, a keep flag, a
norm's strategy). Within the dive, the search within the relaxation's support
(:meth:`HighsSearch.search_within_support`) gives it a plan where the rounding breaks a row. HiGHS's
branch and bound runs only where the dive leaves the gap open, from the dive's plan if it had
no start, with the columns reduced-cost fixing pins (:meth:`HighsSearch.run_reduced_cost_fixing`).
Each stage appends its record to ``HighsSearch.stages``.

The first pass, which minimises a blend of the two objectives, is ``passes.py``'s.

Solver options are fixed (one thread, seed 0, counts rather than times bound the dive) so the
same input gives the same plan.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import highspy
import numpy as np

from memshard.core.errors import Infeasible, MemshardError, NoBetterPlan, SolverTimeLimit
from memshard.search.formulation import Disjunction, Expression
from memshard.search.model import LinearModel
from memshard.search.stages import BLEND, StageLog, TimeOut

# In the first branch and bound, the secondary objective weighs TIE_BREAK of the primary one
# (at their typical values: the zero-redundancy bound, ZeRO-3's step time).
TIE_BREAK = 0.03
TIE_RESOLUTION = 1e-5  # relative slack on the primary objective in the second pass
INTEGRALITY = 1e-6  # a relaxation's choice columns this close to 0 or 1 count as integral
DIVE_DEPTH = 3  # a dive branches at most this many levels deep
DIVE_BRANCHES = 24  # and solves at most this many branches (each costs a refactorisation)
DIVE_EFFORT = 1.0  # and spends at most this many times the relaxation's simplex iterations
DIVE_CUTOFF = 0.25  # a dive's branch stops this fraction of the gap below the best plan
SUPPORT_NODES = 200  # the search within a relaxation's support explores at most this many nodes
SUPPORT_TRIGGER = 0.01  # and runs where the rounding breaks a row or is this far above the relaxation
# A branch and bound with columns pinned by reduced-cost fixing presolves a model of at least
# this many nonzeros: below, presolve's probing costs more than the analytic centre of the
# whole LP it saves; above, the other way round (docs/search.md, *Measurements*).
PRESOLVE_NONZEROS = 150_000
# Reduced-cost fixing runs where the dive's plan is within this of its bound: there most of the
# choices are ruled out and what is left is the proof; further off, the pins sent HiGHS down
# another, slower path (docs/search.md, *Measurements*).
PIN_GAP = 0.01
# The step time's relaxation tries dual simplex from the basis the model has for at most this
# many times the root relaxation's iterations (or the model's rows, if more) before interior point
RELAXATION_ITERATIONS = 2.0


@dataclass(frozen=True)
class SearchLimits:
    """The counts that bound a search's heuristics (counts, not times: the same input, the
    same plan): a dive's depth and branches (``dive_branches``), and the most a dive's plan
    may lie above its bound for reduced-cost fixing to run (``pin_gap``); and a test knob,
    ``time_out`` (``stages.TimeOut``): the stage run at which time runs out (None: none; a
    stage checks it as it starts, ``HighsSearch.begin_stage``)."""

    dive_depth: int = DIVE_DEPTH
    dive_branches: int = DIVE_BRANCHES
    pin_gap: float = PIN_GAP
    time_out: TimeOut | None = None


# Why a minimisation stopped before its proof (``Solution.halted``)
UNSETTLED = "unsettled"  # a dive alone was asked for (speculative, dive only), and it did not settle
ROWS_NEEDED = "rows needed"  # the dive's plan breaks rows the model lacks (lazy ones): those first


@dataclass(frozen=True)
class Solution:
    """What a minimisation (or a first pass) ends with: a solution's columns, its objective,
    its relative gap to the best bound, whether the time limit stopped the search, whether its
    ties are resolved (the secondary objective within the gap of its best too), whether a
    dive's plan the relaxation of a loose floor proves (no branch and bound); and, where it
    stopped before any proof (``halted``: UNSETTLED, ROWS_NEEDED), why (then ``values`` is the
    plan that needs rows, or None)."""

    values: np.ndarray | None
    objective: float
    gap: float
    timed_out: bool
    ties_resolved: bool = False
    dive_proved: bool = False
    halted: str = ""

    @staticmethod
    def halt(reason: str, values: np.ndarray | None = None) -> Solution:
        """A minimisation stopped before its proof, for ``reason``, with ``values`` if any."""
        return Solution(values, math.nan, math.inf, False, halted=reason)


@dataclass(frozen=True)
class Dive:
    """What the stage "dive" returns (:meth:`HighsSearch.run_dive`): its best integral
    solution, its objective, and a lower bound on the ILP's; and its root relaxation
    (objective, solution, reduced costs), the input of reduced-cost fixing."""

    values: np.ndarray
    objective: float
    bound: float
    relaxed: float = -math.inf
    root: np.ndarray | None = None
    reduced: np.ndarray | None = None


@dataclass(frozen=True)
class Pinned:
    """What the stage "reduced-cost fixing" returns, the input of branch and bound: integer
    columns pinned at values, and the least objective any plan that moves one of them off
    has."""

    columns: np.ndarray
    values: np.ndarray
    bound: float


@dataclass
class DiveProgress:
    """A dive in progress (its working record, not a stage output): its gap, its budget
    (simplex iterations) and what it spent, the best integral solution met and its
    objective."""

    gap: float
    effort: float
    best: np.ndarray | None
    value: float
    max_branches: int = DIVE_BRANCHES
    branches: int = 0
    iterations: int = 0

    def cutoff(self) -> float:
        return self.value - DIVE_CUTOFF * self.gap * abs(self.value) if self.best is not None else math.inf

    def affordable(self) -> bool:
        return self.branches < self.max_branches and self.iterations < self.effort

    def proved(self, bound: float) -> bool:
        return self.value - bound <= self.gap * abs(self.value)


def relative_gap(value: float, bound: float) -> float:
    """How far ``value`` may be above the optimum, given a lower ``bound`` on it."""
    return max(0.0, (value - bound) / abs(value)) if value else 0.0


def blend_objective(expr: Expression, tie_break: Expression, scales: tuple[float, float]) -> tuple[Expression, float]:
    """``expr`` + w·``tie_break``, w such that ``tie_break`` weighs TIE_BREAK of ``expr`` at
    their typical ``scales``: ((columns, coefficients), w)."""
    w = TIE_BREAK * scales[0] / scales[1] if scales[0] > 0 and scales[1] > 0 else TIE_BREAK
    return (np.concatenate([expr[0], tie_break[0]]), np.concatenate([expr[1], tie_break[1] * w])), w


def branch_share(x: np.ndarray, branch: tuple[int, float]) -> float:
    """How much of the relaxation ``x`` takes a branch (column, value it is fixed at)."""
    col, at = branch
    return x[col] if at else 1 - x[col]


def value_of(expr: Expression, values: np.ndarray) -> float:
    return float(values[expr[0]] @ expr[1])


def dived_proves(dived: Dive, gap: float) -> bool:
    """Whether a dive's plan is within ``gap`` of the dive's own bound."""
    return dived.objective - dived.bound <= gap * abs(dived.objective) + 1e-9


_STDOUT_SWAP = threading.Lock()  # two threads swapping file descriptor 1 at once could lose it


@contextlib.contextmanager
def _silenced_stdout():
    """Send the process's C-level stdout to /dev/null for a moment (HiGHS's banner)."""
    with _STDOUT_SWAP:
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


def _option(highs: highspy.Highs, name: str):
    value = highs.getOptionValue(name)  # (status, value) in some highspy versions
    return value[1] if isinstance(value, tuple) else value


@contextlib.contextmanager
def _options(highs: highspy.Highs, options: dict):
    """Within: HiGHS's ``options`` set; after: as they were."""
    saved = {name: _option(highs, name) for name in options}
    try:
        for name, value in options.items():
            highs.setOptionValue(name, value)
        yield
    finally:
        for name, value in saved.items():
            highs.setOptionValue(name, value)


def _pass_model(highs: highspy.Highs, m: LinearModel) -> None:
    """Hand ``m`` to ``highs`` as arrays (a ``HighsLp``'s fields would convert element by
    element, several times slower)."""
    lengths = np.fromiter((len(c) for c in m.row_columns), dtype=np.int64, count=m.num_rows)
    starts = np.zeros(m.num_rows, dtype=np.int32)
    np.cumsum(lengths[:-1], out=starts[1:])
    index = np.concatenate(m.row_columns).astype(np.int32) if m.row_columns else np.zeros(0, dtype=np.int32)
    value = np.concatenate(m.row_values) if m.row_values else np.zeros(0)
    highs.passModel(m.num_columns, m.num_rows, len(index), int(highspy.MatrixFormat.kRowwise),
                    int(highspy.ObjSense.kMinimize), 0.0, np.zeros(m.num_columns), np.array(m.lower), np.array(m.upper),
                    np.array(m.rows_lower), np.array(m.rows_upper), starts, index, value,
                    np.array(m.integer, dtype=np.int32))


class HighsSearch:
    """One HiGHS model solved several times with different objectives and extra rows, each
    branch and bound warm-started from a given or freshly found solution, and preceded, when
    ``disjunctions`` are given, by a dive until one leaves its gap open."""

    def __init__(self, model: LinearModel, deadline: float, disjunctions: list[Disjunction] | None = None,
                 limits: SearchLimits | None = None):
        self.deadline = deadline
        self.num_columns = model.num_columns
        self.disjunctions = disjunctions or []
        self.limits = limits or SearchLimits()
        self.stages = StageLog()  # the record of the stages run
        self.runs: dict[str, int] = {}  # how many runs of each stage have begun (``begin_stage``)
        self.objective_kind = BLEND  # what the objective set measures (``stages.MEMORY``, …)
        self.dive_again()  # until a dive fails to prove its plan
        self.relaxation_solver: str | None = None  # within ``relaxing``: its LP solver
        self.relaxation_iterations = 0  # and its simplex iterations
        self.objective: Expression | None = None  # the objective set
        self.lower, self.upper = np.array(model.lower), np.array(model.upper)  # the integer columns' bounds
        self.integer_columns = np.flatnonzero(np.array(model.integer, dtype=bool))
        log = bool(os.environ.get("MEMSHARD_HIGHS_LOG"))
        with contextlib.nullcontext() if log else _silenced_stdout():
            highs = self.highs = highspy.Highs()  # prints a banner from C++ on construction
        highs.setOptionValue("output_flag", log)
        highs.setOptionValue("random_seed", 0)
        highs.setOptionValue("threads", 1)
        highs.setOptionValue("mip_abs_gap", 1e-9)
        highs.setOptionValue("presolve", "off")  # its probing costs more than it saves here
        # A branch and bound's root LP (and its sub-MIPs') by interior point, with crossover for
        # the basis: dual simplex on the root LP that HiGHS presolves can cycle in its cleanup
        # of the cost perturbation and never end (docs/search.md, *The root LP*)
        highs.setOptionValue("mip_lp_solver", "ipm")
        _pass_model(highs, model)

    def extend(self, model: LinearModel, columns: int, rows: int) -> None:
        """Pass the continuous columns and the rows ``model`` gained since it had ``columns``
        and ``rows`` of them."""
        highs, n = self.highs, model.num_columns
        if any(model.integer[columns:]):
            raise ValueError("only continuous columns can be added")
        if n > columns:
            highs.addVars(n - columns, np.array(model.lower[columns:]), np.array(model.upper[columns:]))
            self.num_columns = n
        lengths = [len(c) for c in model.row_columns[rows:]]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32) if lengths else np.zeros(0, np.int32)
        highs.addRows(len(lengths), np.array(model.rows_lower[rows:]), np.array(model.rows_upper[rows:]),
                      int(sum(lengths)), starts,
                      np.concatenate(model.row_columns[rows:]).astype(np.int32) if lengths else np.zeros(0, np.int32),
                      np.concatenate(model.row_values[rows:]) if lengths else np.zeros(0))

    def expired(self) -> bool:
        return time.perf_counter() >= self.deadline

    def begin_stage(self, stage: str) -> None:
        """Count a run of the stage ``stage`` as begun. Where ``SearchLimits.time_out`` names
        this run, time runs out now: the deadline passes, and :class:`SolverTimeLimit` is
        raised (a test knob)."""
        run = self.runs.get(stage, 0)
        self.runs[stage] = run + 1
        if self.limits.time_out is not None and self.limits.time_out.hits(stage, run):
            self.deadline = time.perf_counter()
            raise SolverTimeLimit()

    def dive_again(self) -> None:
        """The next minimisation starts with a dive (where there are disjunctions to branch on)."""
        self.diving = bool(self.disjunctions)

    def stop_on(self, event: threading.Event) -> None:
        """Interior point stops (unsolved) once ``event`` is set: a bound computed beside
        another search, no longer needed when that one ends."""
        def interrupt(_kind, _message, _data_out, data_in, _user) -> None:
            if event.is_set():
                data_in.user_interrupt = True
        self.highs.setCallback(interrupt, None)
        self.highs.startCallback(highspy.cb.HighsCallbackType.kCallbackIpmInterrupt)

    def limit_time(self) -> None:
        """HiGHS's time limit: what is left until the deadline. A branch and bound compares
        the limit with its own run's time, an LP with the model's run clock, which adds up
        every run so far."""
        highs = self.highs
        left = max(self.deadline - time.perf_counter(), 1e-3)
        highs.setOptionValue("time_limit", left + (highs.getRunTime() if _option(highs, "solve_relaxation") else 0.0))

    @contextlib.contextmanager
    def relaxing(self, solver: str):
        """Within: solve the LP relaxation with ``solver``, in the time left; after: as before
        (branch and bound again, or the enclosing relaxation's solver)."""
        highs = self.highs
        outer = self.relaxation_solver
        highs.setOptionValue("solve_relaxation", True)
        highs.setOptionValue("solver", solver)
        self.relaxation_solver = solver
        self.limit_time()
        try:
            yield highs
        finally:
            self.relaxation_solver = outer
            highs.setOptionValue("solve_relaxation", outer is not None)
            highs.setOptionValue("solver", outer or "choose")

    def add_row(self, expr: Expression, upper: float) -> None:
        cols, vals = expr
        self.highs.addRow(-highspy.kHighsInf, upper, len(cols), cols.astype(np.int32), vals)

    def set_objective(self, expr: Expression, kind: str | None = None) -> None:
        """Minimise ``expr`` in the next runs; ``kind``: what it measures, for the stage
        record (None: as before)."""
        self.objective = expr
        if kind is not None:
            self.objective_kind = kind
        cost = np.zeros(self.num_columns)
        np.add.at(cost, expr[0], expr[1])
        self.highs.changeColsCost(self.num_columns, np.arange(self.num_columns, dtype=np.int32), cost)

    def minimise(self, expr: Expression, gap: float, start=None,
                 before_branching: Callable[[np.ndarray | None], Solution | None] | None = None,
                 dive_only: bool = False, kind: str | None = None, cutoff: float = math.inf) -> Solution:
        """Minimise ``expr`` (``kind``: what it measures; None: as the objective before) to
        relative ``gap``: the dive, and where it does not prove its plan, the proof (branch
        and bound) from that plan, else from ``start`` (a full solution, a partial one as
        (columns, values), or a function making one when it is needed).
        ``before_branching``: asked once a branch and bound is needed, before it starts, with
        the dive's plan if any (it may solve relaxations of its own): a solution it returns
        ends the minimisation there; None lets it go on. ``dive_only``: no branch and bound:
        the dive's plan, with the dive's gap (halted UNSETTLED where it has none). ``cutoff``:
        the value a plan found elsewhere reaches; the branch and bound searches only below it by
        the gap (:class:`NoBetterPlan` where there is nothing)."""
        self.set_objective(expr, kind)
        kind = self.objective_kind
        dived = None
        if self.diving:
            incumbent = None
            if isinstance(start, np.ndarray):
                incumbent = (start, value_of(expr, start))
            dived = self.run_dive(gap, incumbent, start if callable(start) else None)
            if dived is not None and (dive_only or dived_proves(dived, gap)):
                return Solution(dived.values, dived.objective, relative_gap(dived.objective, dived.bound), False)
            # A model whose relaxation a dive did not settle seldom changes in the next runs
            # (the same rows and a few more): no more dives, each an LP (but see the tie-break pass).
            self.diving = False
        if dive_only:
            return Solution.halt(UNSETTLED)
        if before_branching is not None:
            halted = before_branching(None if dived is None else dived.values)
            if halted is not None:
                return halted
            self.set_objective(expr, kind)
        return self.prove(expr, kind, gap, start, dived, cutoff)

    def prove(self, expr: Expression, kind: str, gap: float, start, dived: Dive | None,
              cutoff: float = math.inf) -> Solution:
        """Branch and bound on ``expr`` after the dive ``dived`` (None: none, or no plan from
        it), from the better of its plan and ``start`` (as ``minimise`` takes it), with the
        columns reduced-cost fixing pins; out of time with nothing better, the dive's plan."""
        if dived is not None:
            # branch and bound from the better of the dive's plan and the start given (a full
            # start is the dive's incumbent already): the dive's plan is the faster start
            start = self.choose_start(start, dived)
        elif callable(start):
            start = start()
            self.set_objective(expr, kind)
        pinned = self.run_reduced_cost_fixing(dived) if dived is not None else None
        if pinned is not None:  # (the dive's plan keeps every pin: it is not above itself; a given start may not)
            start = dived.values
        try:
            found = self.run_branch_and_bound(gap, start, pinned, cutoff)
        except SolverTimeLimit:
            if dived is None:
                raise
            found = None
        if dived is not None and (found is None or dived.objective < found.objective):  # out of time above it, or tied
            bound = dived.bound if found is None else max(dived.bound, found.objective - found.gap * abs(found.objective))
            return Solution(dived.values, dived.objective, relative_gap(dived.objective, bound),
                            found is None or found.timed_out)
        return found

    def choose_start(self, start, dived: Dive) -> np.ndarray:
        """The dive's plan, or ``start`` completed where it is a partial one (columns, values)
        that does better."""
        if not isinstance(start, tuple):
            return dived.values
        with self.relaxing("simplex"):
            completed = self.solve_completion(*start)
        return completed[0] if completed is not None and completed[1] < dived.objective else dived.values

    def make_start_amid_dive(self, make_start: Callable[[], object], basis) -> np.ndarray | None:
        """A start ``make_start`` makes (solving relaxations of its own) amid a dive: the
        objective and the dive's basis set back after; None unless it is a full solution."""
        objective, kind = self.objective, self.objective_kind
        made = make_start()
        self.set_objective(objective, kind)
        self.highs.setBasis(basis)
        return made if isinstance(made, np.ndarray) else None

    def run_reduced_cost_fixing(self, dived: Dive) -> Pinned | None:
        """The integer columns the dive's root relaxation pins (reduced-cost fixing): a column
        at a bound there, with reduced cost d, is off that bound only in plans of objective at
        least the relaxation's + |d|; where that is above the dive's plan, no better plan moves
        it (so the bound branch and bound proves holds for every plan). None where none is
        pinned, or where the dive's plan is more than ``SearchLimits.pin_gap`` above its bound
        (then no stage runs)."""
        if dived.reduced is None or relative_gap(dived.objective, dived.bound) > self.limits.pin_gap:
            return None
        started = time.perf_counter()
        pinned = self.pins(dived)
        self.stages.add("reduced-cost fixing", self.objective_kind, started,
                        f"{len(pinned.columns)} columns pinned" if pinned is not None else "no column pinned",
                        bound=None if pinned is None else pinned.bound)
        return pinned

    def pins(self, dived: Dive) -> Pinned | None:
        """The columns the dive's root relaxation pins (``run_reduced_cost_fixing``), or None."""
        cols = self.integer_columns
        x, d = dived.root[cols], dived.reduced[cols]
        # (a margin for HiGHS's dual feasibility tolerance)
        threshold = dived.objective - dived.relaxed + 1e-7 * max(abs(dived.objective), 1.0)
        at_lower = (x <= self.lower[cols] + INTEGRALITY) & (d > threshold)
        at_upper = (x >= self.upper[cols] - INTEGRALITY) & (-d > threshold)
        pin = at_lower | at_upper
        if not pin.any():
            return None
        return Pinned(cols[pin], np.where(at_lower, self.lower[cols], self.upper[cols])[pin],
                      dived.relaxed + float(np.abs(d[pin]).min()))

    def run_branch_and_bound(self, gap: float, start=None, pinned: Pinned | None = None,
                             cutoff: float = math.inf) -> Solution:
        """HiGHS's branch and bound on the objective set, from ``start`` (until the deadline),
        with the ``pinned`` columns fixed; on a model of at least PRESOLVE_NONZEROS, with
        presolve, which drops them, and without the start (HiGHS computes the analytic centre
        of the whole LP at every root, an interior-point solve). Where ``cutoff`` is finite, among the plans below it
        by the gap only (``run_below_cutoff``)."""
        started = time.perf_counter()
        start_value = value_of(self.objective, start) if isinstance(start, np.ndarray) else None
        try:
            self.begin_stage("branch and bound")
            found = self.run_below_cutoff(gap, start, pinned, cutoff)
        except MemshardError as error:
            stopped = ("time limit, no plan" if isinstance(error, SolverTimeLimit)
                       else "no plan below the cutoff" if isinstance(error, NoBetterPlan) else "no plan")
            self.stages.add("branch and bound", self.objective_kind, started, stopped, start=start_value)
            raise
        self.stages.add("branch and bound", self.objective_kind, started,
                        "time limit" if found.timed_out else "gap closed", found=found.objective,
                        bound=found.objective - found.gap * abs(found.objective), start=start_value)
        return found

    def run_below_cutoff(self, gap: float, start, pinned: Pinned | None, cutoff: float) -> Solution:
        """``run_pinned_branch_and_bound``, where ``cutoff`` is finite with the objective held
        below cutoff·(1 − gap) by a row for this run: no plan there is what rules the search
        out (:class:`NoBetterPlan`, that bound). A plan found there is the one the whole
        search finds, and its bound holds for the whole: every plan the row leaves out is
        above it."""
        if not math.isfinite(cutoff):
            return self.run_pinned_branch_and_bound(gap, start, pinned)
        # (a hair above cutoff·(1 − gap): the bound then lies within the gap of the cutoff, not a
        # rounding error beyond it)
        highs, limit = self.highs, cutoff * (1 - gap) * (1 + 1e-12)
        self.add_row(self.objective, limit)
        row = np.array([highs.getNumRow() - 1], dtype=np.int32)
        try:
            return self.run_pinned_branch_and_bound(gap, start, pinned)
        except Infeasible:
            raise NoBetterPlan(limit, by="branch and bound") from None
        finally:
            highs.deleteRows(1, row)

    def run_pinned_branch_and_bound(self, gap: float, start, pinned: Pinned | None) -> Solution:
        """``run_branch_and_bound`` (its stage unrecorded)."""
        if pinned is None:
            return self.run_highs_mip(gap, start)
        highs = self.highs
        columns = pinned.columns.astype(np.int32)
        highs.changeColsBounds(len(columns), columns, pinned.values, pinned.values)
        presolve = highs.getNumNz() >= PRESOLVE_NONZEROS
        try:
            # Presolved, no start: HiGHS (highspy 1.16) maps a start into presolve's reduced
            # model, reports the objective of another solution there, lower than the start's
            # own, and returns the start as proved at it (docs/search.md, *The fastest plan*).
            with _options(highs, {"presolve": "on" if presolve else "off"}):
                found = self.run_highs_mip(gap, None if presolve else start)
        finally:
            highs.changeColsBounds(len(columns), columns, self.lower[columns], self.upper[columns])
        bound = min(found.objective - found.gap * abs(found.objective), pinned.bound)
        return Solution(found.values, found.objective, relative_gap(found.objective, bound), found.timed_out)

    def run_highs_mip(self, gap: float, start=None) -> Solution:
        highs = self.highs
        highs.setOptionValue("mip_rel_gap", gap)
        self.limit_time()
        if isinstance(start, tuple):  # partial: HiGHS completes it
            highs.setSolution(len(start[0]), start[0].astype(np.int32), start[1].astype(np.float64))
        elif start is not None:
            solution = highspy.HighsSolution()
            solution.col_value = list(start)
            solution.value_valid = True
            highs.setSolution(solution)
        highs.run()
        status = highs.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            raise Infeasible("")
        info = highs.getInfo()
        if info.primal_solution_status != 2:
            if status == highspy.HighsModelStatus.kTimeLimit:
                raise SolverTimeLimit()
            raise MemshardError(f"solver stopped without a plan: {highs.modelStatusToString(status)}")
        # The solution's own objective, not the one HiGHS reports: with presolve, a start's can
        # be another solution's (``run_pinned_branch_and_bound``). HiGHS's bound is infinite
        # where it has none yet (out of time before its root): then 0 bounds it, as it does
        # every objective here.
        values = np.array(highs.getSolution().col_value)
        objective = value_of(self.objective, values)
        bound = min(float(info.mip_dual_bound), objective) if math.isfinite(info.mip_dual_bound) else 0.0
        return Solution(values, objective, relative_gap(objective, bound),
                        status == highspy.HighsModelStatus.kTimeLimit)

    def run_dive(self, gap: float, incumbent: tuple[np.ndarray, float] | None,
             make_start: Callable[[], object] | None = None) -> Dive | None:
        """The dive (``dive_below_relaxation``), its stage recorded: why it stopped, whether
        its plan is within ``gap`` of its bound."""
        started = time.perf_counter()
        dived = self.dive_below_relaxation(gap, incumbent, make_start)
        if dived is None:
            stopped = "no plan"
        elif dived.root is None:
            stopped = "relaxation integral"
        else:
            stopped = "gap closed" if dived_proves(dived, gap) else "gap open"
        self.stages.add("dive", self.objective_kind, started, stopped, found=None if dived is None else dived.objective,
                        bound=None if dived is None else dived.bound, start=None if incumbent is None else incumbent[1])
        return dived

    def dive_below_relaxation(self, gap: float, incumbent: tuple[np.ndarray, float] | None,
                              make_start: Callable[[], object] | None = None) -> Dive | None:
        """The LP relaxation of the objective set, by simplex; where it is fractional, a
        branching ``SearchLimits.dive_depth`` levels deep on its most fractional disjunctions, each branch
        warm-started from its parent's basis: the best integral solution met (or the
        ``incumbent`` (values, objective) if none is better), or None where neither exists.

        A branch's bound is its LP optimum (or, not solved, its parent's plus what the
        reduced cost says moving its column costs: a dual bound), or where it branches
        further, the least of its own branches' bounds if larger. Once a plan is known, a
        branch stops where its dual simplex passes a cutoff DIVE_CUTOFF of the gap below that
        plan (HiGHS's ``objective_bound``, the node cutoff of its own search). The root's
        bound is, for each disjunction branched on, the least of its branches' bounds (one of
        them holds for every plan); the largest over them. At most ``dive_branches`` branches are
        solved, in at most DIVE_EFFORT times the relaxation's simplex iterations: counts, not
        times, so that the same input gives the same plan. The dive gives up where the
        relaxation's own branches, explored first, yield no plan."""
        with self.relaxing("simplex") as highs:
            highs.run()
            self.relaxation_iterations = highs.getInfo().simplex_iteration_count
            if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return None
            info, solution = highs.getInfo(), highs.getSolution()
            relaxed = float(info.objective_function_value)
            x = np.array(solution.col_value)
            if self.integral(x):
                return Dive(x, relaxed, relaxed)
            state = DiveProgress(gap, DIVE_EFFORT * max(info.simplex_iteration_count, 1), *(
                incumbent if incumbent is not None else (None, math.inf)), max_branches=self.limits.dive_branches)
            basis, reduced = highs.getBasis(), np.array(solution.col_dual)
            rounded = self.round_relaxation(x)
            if rounded is None or rounded[1] - relaxed > SUPPORT_TRIGGER * abs(rounded[1]):
                supported = self.search_within_support(x, gap)
                if supported is not None and (rounded is None or supported[1] < rounded[1]):
                    rounded = supported
            if rounded is None and state.best is None and make_start is not None:
                # the rounding breaks a budget: the plan within it, before branching needs one
                made = self.make_start_amid_dive(make_start, basis)
                rounded = None if made is None else (made, value_of(self.objective, made))
            if rounded is not None and rounded[1] < state.value:
                state.best, state.value = rounded
            highs.setBasis(basis)
            try:
                bound = self.branch_below(state, x, reduced, relaxed, basis, 0)
            finally:
                highs.setOptionValue("objective_bound", highspy.kHighsInf)
            if bound is None or state.best is None:
                return None
            return Dive(state.best, state.value, min(bound, state.value), relaxed, x, reduced)

    def branch_below(self, state: DiveProgress, x: np.ndarray, reduced: np.ndarray, relaxed: float, basis,
                depth: int) -> float | None:
        """A lower bound on the ILP below a node whose relaxation is ``x`` (objective
        ``relaxed``, reduced costs, ``basis``), branching on its most fractional disjunctions
        (all at the root, one below); None at the root if its own branches found no plan."""
        highs = self.highs

        def share(branch):
            return branch_share(x, branch)

        fractional = sorted((d for d in self.disjunctions if max(map(share, d)) < 1 - INTEGRALITY),
                            key=lambda d: (max(map(share, d)), d[0]))
        bound = relaxed
        for disjunction in fractional if depth == 0 else fractional[:1]:
            least = math.inf
            # the relaxation's own branches first, then the least reduced cost
            for col, at in sorted(disjunction, key=lambda b: (-share(b), reduced[b[0]] * (b[1] - x[b[0]]), b)):
                if depth == 0 and state.best is None and share((col, at)) <= INTEGRALITY:
                    return None  # the relaxation's own branches gave no plan: not this dive's kind
                cutoff = state.cutoff()
                branch = relaxed + max(float(reduced[col]) * (at - x[col]), 0.0)
                if branch < cutoff and state.affordable() and not self.expired():
                    highs.changeColBounds(col, at, at)
                    try:
                        branch = self.solve_branch(state, basis, cutoff, branch, depth)
                    finally:
                        highs.changeColBounds(col, self.lower[col], self.upper[col])
                least = min(least, branch)
            bound = max(bound, least)
            if state.proved(bound) or not state.affordable():
                break
        return bound

    def solve_branch(self, state: DiveProgress, basis, cutoff: float, fallback: float, depth: int) -> float:
        """Solve the relaxation as fixed now, from ``basis``, stopped at ``cutoff``; keep its
        solution if integral and better, else branch on below the dive's depth: a lower bound on
        the branch (``fallback`` if none was found). Dual simplex runs without its cost
        perturbation here: perturbed, a branch of a model whose costs span ten orders of
        magnitude can meet bad basis change after bad basis change (docs/search.md)."""
        highs = self.highs
        highs.setBasis(basis)
        highs.setOptionValue("objective_bound", cutoff)
        self.limit_time()
        with _options(highs, {"dual_simplex_cost_perturbation_multiplier": 0.0}):
            highs.run()
        status, info = highs.getModelStatus(), highs.getInfo()
        state.branches += 1
        state.iterations += max(info.simplex_iteration_count, 1)
        if status == highspy.HighsModelStatus.kInfeasible:
            return math.inf
        if status == highspy.HighsModelStatus.kObjectiveBound:
            return cutoff
        if status != highspy.HighsModelStatus.kOptimal:
            return fallback
        value = float(info.objective_function_value)
        solution = highs.getSolution()
        x = np.array(solution.col_value)
        if self.integral(x):
            if value < state.value:
                state.best, state.value = x, value
            return value
        if depth + 1 < self.limits.dive_depth and state.affordable():
            below = self.branch_below(state, x, np.array(solution.col_dual), value, highs.getBasis(), depth + 1)
            return max(value, below)
        return value

    def round_relaxation(self, x: np.ndarray) -> tuple[np.ndarray, float] | None:
        """The relaxation ``x`` rounded: each disjunction fixed at its largest share, the
        continuous columns solved for by the LP under the objective set (inside a relaxing
        context): a plan and its objective, or None where that rounding breaks a row (a link,
        a budget). Often close to the optimum (a few groups split between two choices), it
        gives branch and bound and the dive an incumbent before either finds one."""
        columns = np.array(sorted({col for d in self.disjunctions for col, _ in d}), dtype=np.int32)
        at = dict.fromkeys(columns.tolist(), 0.0)
        for d in self.disjunctions:
            col, value = max(d, key=lambda branch: (branch_share(x, branch), -branch[0]))
            at[col] = value
        return self.solve_completion(columns, np.array([at[col] for col in columns.tolist()]))

    def solve_completion(self, columns: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, float] | None:
        """The integer ``columns`` fixed at ``values``, the others solved for by the LP under
        the objective set (inside a relaxing context): a solution and its objective, or None
        where those values break a row."""
        highs = self.highs
        columns = columns.astype(np.int32)
        highs.changeColsBounds(len(columns), columns, values, values)
        try:
            self.limit_time()
            highs.run()
            if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return None
            return np.array(highs.getSolution().col_value), float(highs.getInfo().objective_function_value)
        finally:
            highs.changeColsBounds(len(columns), columns, self.lower[columns], self.upper[columns])

    def search_within_support(self, x: np.ndarray, gap: float) -> tuple[np.ndarray, float] | None:
        """The best plan among the branches the relaxation ``x`` takes some share of: branch
        and bound (with presolve, which removes the branches fixed away) restricted to them,
        at most SUPPORT_NODES nodes (a count, not a time: the same input, the same plan). Where
        the relaxation splits groups between choices whose rounding breaks a row or costs
        more (recomputation: a strategy's replay against another's), the restricted search
        picks the combination that fits: a plan before branching, often within a few percent
        of the relaxation. None if it finds none."""
        started = time.perf_counter()
        found = self.branch_within_support(x, gap)
        self.stages.add("support search", self.objective_kind, started, "plan found" if found else "no plan",
                        found=found[1] if found else None)
        return found

    def branch_within_support(self, x: np.ndarray, gap: float) -> tuple[np.ndarray, float] | None:
        """``search_within_support`` (its stage unrecorded)."""
        highs = self.highs
        forbidden = sorted({(col, 1.0 - at) for d in self.disjunctions for col, at in d
                            if branch_share(x, (col, at)) <= INTEGRALITY})
        columns = np.array([col for col, _ in forbidden], dtype=np.int32)
        values = np.array([value for _, value in forbidden])
        highs.changeColsBounds(len(columns), columns, values, values)
        options = {"solve_relaxation": False, "solver": "choose", "presolve": "on", "mip_rel_gap": gap,
                   "mip_max_nodes": SUPPORT_NODES}
        try:
            with _options(highs, options):
                self.limit_time()
                highs.run()
            if highs.getInfo().primal_solution_status != 2:
                return None
            return np.array(highs.getSolution().col_value), float(highs.getInfo().objective_function_value)
        finally:
            highs.changeColsBounds(len(columns), columns, self.lower[columns], self.upper[columns])

    def find_rounded_minimum(self, expr: Expression, kind: str = BLEND) -> np.ndarray | None:
        """A plan near the least ``expr`` (``kind``: what it measures): its LP relaxation by
        simplex, rounded (None if that breaks a row or time runs out). The next solve starts
        afresh: from this basis the next objective's relaxation took far longer than from none."""
        started = time.perf_counter()
        self.set_objective(expr, kind)
        with self.relaxing("simplex") as highs:
            highs.run()
            found = None
            if highs.getModelStatus() == highspy.HighsModelStatus.kOptimal:
                found = self.round_relaxation(np.array(highs.getSolution().col_value))
            highs.clearSolver()
        self.stages.add("rounded relaxation", kind, started, "plan found" if found else "rounding breaks a row",
                        found=found[1] if found else None)
        return None if found is None else found[0]

    def integral(self, x: np.ndarray) -> bool:
        v = x[self.integer_columns]
        return bool(np.all(np.abs(v - np.round(v)) <= INTEGRALITY))

    def solve_relaxation(self, expr: Expression, simplex_first: bool = False, presolve: bool = False,
                   kind: str | None = None) -> float | None:
        """The LP relaxation's minimum of ``expr`` (``kind``: what it measures; None if not
        found in time): where ``simplex_first``, by dual simplex from the basis the model has
        (the blend's optimum, or none), unpresolved, in at most RELAXATION_ITERATIONS times the
        root relaxation's iterations or the model's rows (a guard: unpresolved it does not
        cycle as on the presolved root LP, ``docs/search.md``); else (or then) by interior
        point without crossover, a bound is all that is needed, with ``presolve`` if asked."""
        started = time.perf_counter()
        self.set_objective(expr, kind)
        bound, solver = self.find_relaxed_minimum(simplex_first, presolve)
        self.stages.add("relaxation", self.objective_kind, started,
                        f"solved by {solver}" if bound is not None else "not solved in time", bound=bound)
        return bound

    def find_relaxed_minimum(self, simplex_first: bool, presolve: bool) -> tuple[float | None, str]:
        """``solve_relaxation`` of the objective set: its minimum (None if not found in time), and
        the LP solver that found it."""
        if simplex_first:
            limit = RELAXATION_ITERATIONS * max(self.relaxation_iterations, self.highs.getNumRow())
            dual = {"simplex_strategy": 1, "simplex_iteration_limit": int(limit)}
            with self.relaxing("simplex") as highs, _options(highs, dual):
                highs.run()
                if highs.getModelStatus() == highspy.HighsModelStatus.kOptimal:
                    return float(highs.getInfo().objective_function_value), "dual simplex"
        ipm = {"presolve": "on" if presolve else "off", "run_crossover": "off"}
        with self.relaxing("ipm") as highs, _options(highs, ipm):
            highs.run()
            if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return None, "interior point"
            return float(highs.getInfo().objective_function_value), "interior point"
