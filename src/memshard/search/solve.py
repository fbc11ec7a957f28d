"""Solving a problem: the formulation searched with HiGHS, lazy reshard rows, the tie-break pass.

Objectives: ``memory`` minimises M, then, with M held within the gap of its optimum, the step
time (ties broken by time); ``time`` minimises T subject to M ≤ budget, then M. The first
pass (``HighsSearch.first_pass``) minimises the primary objective with the secondary one as a
small tie-break, which is usually optimal for the primary one alone and then needs no second
pass.

The reshard rows are lazy (without a memory budget): most plans' peak is not at a reshard,
and without those rows (and their ρ columns) each HiGHS solve is smaller. The first pass runs
without them; where the plan, priced by the evaluator, holds more than its M at a reshard
point, that point's rows are added and the first pass runs again, from that plan, until none
is over (``Formulation.over_peak``; the first pass checks its dive's plan before branch and
bound, its blended plan before any proof of it); the second pass likewise. A plan that meets
M is optimal with every row too: dropping rows only enlarges the feasible set. Rows come
point by point, not all at the first violation: a plan is often over M at a handful of its
hundreds of reshard points. Every round's bound holds for the whole ILP: the next round
starts from it. Out of time in a later round, the plan kept is the better of that round's and
the one before it, as the evaluator prices them, with its gap to the best bound.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memshard.core.errors import MemshardError
from memshard.problem.evaluate import Evaluation, evaluate, slot_peak
from memshard.problem.records import Problem, Selection
from memshard.search.formulation import Expression, Formulation
from memshard.search.highs import (
    TIE_RESOLUTION,
    HighsSearch,
    Infeasible,
    NoBetterPlan,
    RowsNeeded,
    SolverTimeLimit,
    Unsettled,
    blend_objective,
    relative_gap,
    value_of,
)
from memshard.search.reference import Reference, reference

OBJECTIVES = ("memory", "time")
TIE_SLACK = 2e-3  # the most a loose floor's tie-break pass lets the peak exceed its bound by


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
    bound: float = 0.0  # no plan's objective (bytes or seconds) is below it, as the search proved
    search_space: str = "full"
    evaluation: Evaluation | None = None  # the plan priced by the evaluator


@dataclass
class Outcome:
    """Where the search stands: a solution, its primary objective (model units), its gap,
    whether time ran out, whether its ties are resolved, and the best bound of all rounds."""

    values: np.ndarray
    best: float
    gap: float
    timed_out: bool
    ties_resolved: bool
    lower: float
    evaluation: Evaluation | None = None
    dive_proved: bool = False  # the first pass's plan its dive's, proved by the peak's relaxation


def second_pass_cap(best: float, lower: float, tolerance: float) -> float:
    """The most the tie-break pass lets the primary objective reach: within ``tolerance`` of
    the best bound ``lower``, and at least ``best`` (the first pass's) plus TIE_RESOLUTION."""
    cap = best + abs(best) * TIE_RESOLUTION
    if lower > 0:
        cap = max(cap, lower / (1 - tolerance))
    return cap + 1e-9


class RelaxationBeside:
    """The LP relaxation of ``expr`` on ``model``, solved by interior point (with presolve) on
    a thread beside the search, from when the model is formulated: a second HiGHS model of it
    as it is then (without lazy rows added later: a bound still, on fewer rows). On GPT-3
    175B's least memory with recomputation, 4 s that the dive leaves the second core for.
    ``value`` waits for it (-inf where not solved in time); ``stop`` cuts it short."""

    def __init__(self, model, expr: Expression, deadline: float):
        search = HighsSearch(model, deadline)  # (the model passed to HiGHS here, before it grows)
        self.stopping = threading.Event()
        search.stop_on(self.stopping)
        self.result: list[float | None] = []
        self.thread = threading.Thread(target=lambda: self.result.append(search.relaxation(expr, presolve=True)),
                                       daemon=True)
        self.thread.start()

    def value(self) -> float:
        self.thread.join()
        return self.result[0] if self.result and self.result[0] is not None else -math.inf

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


class Solver:
    """One solve of ``problem``: its formulation, the HiGHS search on it, and the objectives."""

    def __init__(self, problem: Problem, objective: str, max_step_time_s: float | None,
                 memory_budget_bytes: float | None, deadline: float, fixed: Selection | None = None,
                 figures: Reference | None = None):
        self.problem = problem
        self.objective = objective
        self.memory_budget_bytes = memory_budget_bytes if objective == "time" else None
        if objective == "time" and memory_budget_bytes is None:
            self.memory_budget_bytes = problem.mesh.device_memory_bytes
        formulation = self.formulation = Formulation(problem, figures)
        # Lazy reshard rows, but not when pricing a given plan, nor under a memory budget: a
        # plan found without them may exceed it, and one found out of time would then be no
        # plan at all. With recomputation, for the first dive only (``speculative``): its
        # plans' peaks often fall on reshard points, and rounds took longer than all rows at
        # once (GPT-3 1.3B on 1x8: 45 s against 30 s), but where the first dive's plan is
        # proved and meets every row, that smaller LP is all (LLaMA-3 8B on 8x8: 0.9 s against
        # 2.6 s); else every row is added and the search starts again.
        self.lazy = fixed is None and (memory_budget_bytes is None or math.isinf(memory_budget_bytes))
        self.speculative = self.lazy and problem.recompute != "none"
        formulation.add_plan_constraints(problem.candidate_points, reshard_rows=not self.lazy)
        time_expr = formulation.time_expression()
        formulation.add_budget_constraints(objective, time_expr, max_step_time_s, memory_budget_bytes)
        if fixed is not None:
            formulation.fix(fixed)
        self.search = HighsSearch(formulation.model, deadline, formulation.disjunctions())
        ref = formulation.reference
        memory_floor = ref.memory_floor_bytes / formulation.bytes_unit
        time_estimate = ref.time_estimate_s / formulation.time_unit
        peak = formulation.peak_expression()
        self.secondary_cap = math.inf  # the most the secondary objective takes on any plan
        if objective == "memory":
            self.primary, self.secondary = peak, time_expr
            if max_step_time_s is not None:
                self.secondary_cap = max_step_time_s / formulation.time_unit
            self.floor, self.scales = ref.least_peak_bytes / formulation.bytes_unit, (memory_floor, time_estimate)
        else:
            self.primary, self.secondary = time_expr, peak
            self.secondary_cap = self.memory_budget_bytes / formulation.bytes_unit
            # Under a memory budget the tie-break is scaled to it: the blend then bounds T to
            # within TIE_BREAK of its typical value (T ≥ blend − w·budget).
            memory_scale = memory_floor if math.isinf(self.secondary_cap) else self.secondary_cap
            self.floor, self.scales = ref.time_floor_s / formulation.time_unit, (time_estimate, memory_scale)
        # What a start within the budget minimises: the budgeted quantity (then the other one)
        self.within_budget = (blend_objective(peak, time_expr, (memory_floor, time_estimate))[0] if objective == "time"
                              else blend_objective(time_expr, peak, (time_estimate, memory_floor))[0])
        self.max_step_time_s = max_step_time_s if objective == "memory" else None
        # the zero-redundancy floor lets every replayable tensor go for free: far below a
        # recomputing plan's least peak, it proves nothing there
        self.loose_floor = objective == "memory" and problem.recompute != "none"
        self.relaxed_peak: RelaxationBeside | None = None  # its bound there (``beside``)
        self.cutoff = math.inf  # the primary objective (model units) another plan reaches
        self.last_priced: tuple[np.ndarray, Evaluation, set[int]] | None = None

    def beside(self) -> None:
        """Where the floor is loose, start the peak's relaxation beside the search."""
        if self.loose_floor:
            self.relaxed_peak = RelaxationBeside(self.formulation.model, self.primary, self.search.deadline)

    def fallback_start(self) -> Expression | Callable[[], Expression | np.ndarray]:
        """Where branch and bound starts without a given plan: every op unsplit, or, where that
        breaks the budget (memory, or step time), the relaxation of the budgeted quantity
        rounded (a plan within the budget, so that a search out of time still has one; made
        only if the dive's own rounding breaks the budget)."""
        f = self.formulation
        replicated = f.replicated()
        memory, step_time = self.memory_budget_bytes, self.max_step_time_s
        if memory is not None and math.isinf(memory):
            memory = None
        if memory is None and step_time is None:
            return f.selection_start(replicated)
        # (its slots alone first: a fraction of pricing it, and where weights are what breaks the budget, enough)
        if memory is None or slot_peak(self.problem, replicated) <= memory:
            unsplit = evaluate(self.problem, replicated)
            if (memory is None or unsplit.peak_bytes <= memory) and (step_time is None or unsplit.step_time_s <= step_time):
                return f.selection_start(replicated)

        @functools.cache  # the dive may ask first, then branch and bound
        def within_budget() -> Expression | np.ndarray:
            found = self.search.rounded_minimum(self.within_budget)
            return f.selection_start(replicated) if found is None else found
        return within_budget

    def add_reshard_rows(self, points: set[int] | None) -> None:
        """The reshard rows at ``points`` (None: all, and no more lazy rounds after; a dive
        again, as on a new model)."""
        model = self.formulation.model
        columns, rows = model.num_columns, model.num_rows
        self.formulation.add_reshard_constraints(points)
        self.search.extend(model, columns, rows)
        if points is None:
            self.lazy = self.speculative = False
            self.search.dive_again()

    def priced(self, values: np.ndarray) -> tuple[Evaluation, set[int]]:
        """The plan of a solution priced by the evaluator, and the lazy rows it breaks
        (``Formulation.over_peak``); the last one remembered (the search may ask first)."""
        if self.last_priced is None or not np.array_equal(self.last_priced[0], values):
            evaluation = evaluate(self.problem, self.formulation.selection(values))
            self.last_priced = (values, evaluation, self.formulation.over_peak(values, evaluation))
        return self.last_priced[1], self.last_priced[2]

    def over_peak(self, values: np.ndarray) -> bool:
        return bool(self.priced(values)[1])

    def rows_broken_by(self, values: np.ndarray) -> tuple[tuple[np.ndarray, float], Expression]:
        """Add the lazy rows a solution's plan breaks: that plan with its evaluated objective
        (the round's, kept should a later one run out of time), and the start of the next."""
        evaluation, over = self.priced(values)
        self.add_reshard_rows(over)
        f = self.formulation
        return (values, self.primary_of(evaluation)), f.selection_start(f.selection(values))

    def primary_of(self, evaluation: Evaluation) -> float:
        """The primary objective of a plan as the evaluator prices it (model units)."""
        f = self.formulation
        return evaluation.peak_bytes / f.bytes_unit if self.objective == "memory" else evaluation.step_time_s / f.time_unit

    def given_start(self, start: Selection | None) -> Outcome | None:
        """What a search out of time before any plan of its own returns: the ``start`` it was
        given, priced by the evaluator, where that plan meets the budgets (None otherwise)."""
        if start is None:
            return None
        f, evaluation = self.formulation, evaluate(self.problem, start)
        if ((self.max_step_time_s is not None and evaluation.step_time_s > self.max_step_time_s * (1 + 1e-9))
                or (self.memory_budget_bytes is not None and evaluation.peak_bytes > self.memory_budget_bytes * (1 + 1e-9))):
            return None
        values = np.zeros(f.model.num_columns)
        columns, chosen = f.selection_start(start)
        values[columns] = chosen
        values[f.peak] = evaluation.peak_bytes / f.bytes_unit
        best = self.primary_of(evaluation)
        return Outcome(values, best, relative_gap(best, self.floor), True, False, self.floor, evaluation)

    def first_pass(self, mip_gap: float, fallback: Expression, time_limit_s: float,
                   start: Selection | None = None, on_branching: Callable[[], None] | None = None) -> Outcome:
        """The first pass, round after round until its plan meets every lazy row; out of time
        before any plan, the ``start`` it was given, where that one meets the budgets
        (``on_branching``: see ``HighsSearch.first_pass``)."""
        previous = None  # an earlier round's plan (over M at some reshard) and its evaluated objective
        lower = -math.inf  # every round's bound holds for the whole ILP: it has fewer rows
        while True:
            try:
                found = self.search.first_pass(self.primary, self.secondary, max(self.floor, lower), self.scales,
                                               max(mip_gap, TIE_RESOLUTION), fallback, self.secondary_cap,
                                               relaxed_bound=self.relaxed_peak and self.relaxed_peak.value,
                                               simplex_bound=self.objective == "time", cutoff=self.cutoff,
                                               speculative=self.speculative, on_branching=on_branching,
                                               needs_rows=self.over_peak if self.lazy else None)
            except Unsettled:
                self.add_reshard_rows(None)
                continue
            except RowsNeeded as needed:  # the dive's plan breaks lazy rows: those first, then from it
                (previous, fallback), lower = self.rows_broken_by(needed.values), max(lower, self.floor)
                continue
            except Infeasible:
                raise Infeasible(self.objective) from None
            except SolverTimeLimit:
                if previous is None:
                    given = self.given_start(start)
                    if given is None:
                        raise SolverTimeLimit(time_limit_s) from None
                    return given
                values, best = previous
                return Outcome(values, best, relative_gap(best, lower), True, False, lower)
            lower = max(lower, found.objective * (1 - found.gap))
            outcome = Outcome(found.values, found.objective, found.gap, found.timed_out, found.ties_resolved, lower,
                              dive_proved=found.dive_proved)
            if not self.lazy:
                return outcome
            outcome.evaluation, over = self.priced(found.values)
            if not over:
                return outcome
            if self.speculative and not (found.timed_out or self.search.expired()):
                self.add_reshard_rows(None)
                continue
            if found.timed_out or self.search.expired():  # out of time: the better plan, priced as it is
                outcome.best = self.primary_of(outcome.evaluation)
                if previous is not None and previous[1] < outcome.best:
                    (outcome.values, outcome.best), outcome.evaluation = previous, None
                outcome.gap = relative_gap(outcome.best, lower)
                return outcome
            # Reshards the plan runs hold more than M allows: again with their rows, from it.
            previous, fallback = self.rows_broken_by(found.values)

    def second_pass(self, outcome: Outcome, mip_gap: float) -> Outcome:
        """Hold the primary objective within the gap of the best bound, minimise the other one.
        The slack is at least the rows' feasibility tolerance accumulated along the chain of
        live-byte variables (≈1e-6 of the peak); ties finer than TIE_RESOLUTION of the primary
        objective are broken by the secondary one. (The first pass's plan meets every row, so
        its optimum holds with the reshard rows too.)"""
        f = self.formulation
        tolerance = max(mip_gap, TIE_RESOLUTION)
        # Where the bound is a loose floor's relaxation, the gap is room to prove the plan, not
        # to trade memory for time (GPT-3 13B on 1x8 at a 2% gap: +0.6%, and slower than the
        # per-op plan that gap ruled out): the cap is within TIE_SLACK.
        slack = min(tolerance, TIE_SLACK) if self.relaxed_peak is not None else tolerance
        self.search.add_row(self.primary, second_pass_cap(outcome.best, outcome.lower, slack))
        start = outcome.values
        # The secondary objective with the primary one as a small tie-break (TIE_BREAK of it
        # at the first pass's plan; the cap leaves the primary little room to trade): alone,
        # its relaxation is so degenerate that simplex took ten times as long.
        objective = blend_objective(self.secondary, self.primary,
                                    (value_of(self.secondary, start), value_of(self.primary, start)))[0]
        # A dive again, though the first pass's may have left its gap open: another objective,
        # and its reduced costs pin choices for the branch and bound (tiny-gpt on 2x2: 24 s → 9 s).
        # After a first pass without branch and bound (``dive_proved``), the dive alone: a
        # branch and bound after it only proved its plan (GPT-3 13B on 1x8: 8.1 s → 2.6 s,
        # GPT-3 1.3B with 2 layers on 8: 11.5 s → 2.9 s, the same plans).
        self.search.dive_again()
        with contextlib.suppress(SolverTimeLimit, Unsettled):  # else keep the first pass's plan
            while True:
                second = self.search.minimise(objective, tolerance, start=start, dive_only=outcome.dive_proved)
                over = f.over_peak(second.values) if self.lazy else set()
                if value_of(self.secondary, second.values) > value_of(self.secondary, outcome.values):
                    break  # out of time with a plan worse than the first pass's: that one stands
                if not over:
                    outcome.values, outcome.evaluation = second.values, None
                    outcome.timed_out = outcome.timed_out or second.timed_out
                    if outcome.lower > 0:  # the gap of the plan returned, not of the first pass's
                        outcome.gap = max(outcome.gap, relative_gap(value_of(self.primary, second.values),
                                                                    outcome.lower))
                    break
                if second.timed_out or self.search.expired():
                    break  # the first pass's plan stands
                self.add_reshard_rows(over)
                start = f.selection_start(f.selection(outcome.values))
        return outcome

    def result(self, outcome: Outcome, started: float) -> SolveResult:
        f = self.formulation
        selection = f.selection(outcome.values)
        return SolveResult(
            selection=selection,
            status="time_limit" if outcome.timed_out else "optimal",
            objective=self.objective,
            gap=outcome.gap,
            time_s=time.perf_counter() - started,
            variables=f.model.num_columns,
            constraints=f.model.num_rows,
            # The first pass's optimum: the tie-break pass may leave M anywhere in its slack.
            ilp_peak_bytes=outcome.best * f.bytes_unit if self.objective == "memory" else f.peak_bytes(outcome.values),
            bound=max(outcome.lower, 0.0) * (f.bytes_unit if self.objective == "memory" else f.time_unit),
            evaluation=outcome.evaluation,
        )


def solve(
    problem: Problem,
    objective: str = "memory",
    max_step_time_s: float | None = None,
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 60.0,
    mip_gap: float = 2e-3,
    fixed: Selection | None = None,
    start: Selection | None = None,
    cutoff: float | None = None,
    figures: Reference | None = None,
    on_formulated: Callable[[], None] | None = None,
    on_branching: Callable[[], None] | None = None,
) -> SolveResult:
    """Solve ``problem`` for ``objective``; with ``fixed``, price that complete plan through
    the ILP instead (every choice pinned), which checks the linearisation against the
    evaluator. ``start``: a plan of ``problem`` branch and bound starts from (default: every
    op unsplit); one within the budget guarantees an answer under a time limit (itself, if
    the search finds none in time). ``cutoff``: the objective (bytes or seconds) a plan found
    elsewhere reaches: where the search's first bounds show that no plan of ``problem`` is
    more than the gap below it, :class:`NoBetterPlan` is raised with that bound (in the same
    units). ``figures``: ``reference(problem)``, if already computed. ``on_formulated``:
    called once the model is built, before HiGHS solves anything (HiGHS releases the GIL
    while it solves: work started then on another thread runs beside it). ``on_branching``:
    called once, where the first pass's dive leaves its gap open (a long search follows)."""
    if objective not in OBJECTIVES:
        raise MemshardError(f"unknown objective {objective!r}; use memory or time")
    started = time.perf_counter()
    if figures is None:
        figures = reference(problem)
    if cutoff is not None:  # the plan-independent floor may rule the problem out before it is built
        floor = figures.least_peak_bytes if objective == "memory" else figures.time_floor_s
        if rules_out(floor, cutoff, mip_gap):
            raise NoBetterPlan(floor)
    solver = Solver(problem, objective, max_step_time_s, memory_budget_bytes, started + time_limit_s, fixed, figures)
    f = solver.formulation
    unit = f.bytes_unit if objective == "memory" else f.time_unit
    if cutoff is not None:
        solver.cutoff = cutoff / unit
    if on_formulated is not None:
        on_formulated()
    if fixed is not None:  # the one plan the rows allow: its objective, no search around it
        found = solver.search.minimise(solver.primary, TIE_RESOLUTION)
        return solver.result(Outcome(found.values, found.objective, 0.0, found.timed_out, True, found.objective),
                             started)
    fallback = f.selection_start(start) if start is not None else solver.fallback_start()
    solver.beside()
    try:
        outcome = solver.first_pass(mip_gap, fallback, time_limit_s, start,
                                    on_branching and functools.cache(on_branching))
        if not outcome.ties_resolved and not solver.search.expired():
            outcome = solver.second_pass(outcome, mip_gap)
    except NoBetterPlan as e:
        raise NoBetterPlan(e.bound * unit) from None
    finally:
        if solver.relaxed_peak is not None:
            solver.relaxed_peak.stop()
    return solver.result(outcome, started)


def rules_out(bound: float, cutoff: float, mip_gap: float) -> bool:
    """Whether ``bound`` shows that no plan is more than the gap below ``cutoff``, the
    objective a plan found elsewhere reaches: a search given that cutoff stops there."""
    return bound >= cutoff * (1 - max(mip_gap, TIE_RESOLUTION))


def relaxed_floor(problem: Problem, figures: Reference, deadline: float, max_step_time_s: float | None = None,
                  stop: threading.Event | None = None) -> float:
    """A lower bound on ``problem``'s least peak (bytes), the one a least-memory search given a
    cutoff computes before anything else: the floor, raised where it is loose
    (recomputation) to the LP relaxation of the peak, solved until ``deadline`` or until
    ``stop`` is set (then the floor alone)."""
    solver = Solver(problem, "memory", max_step_time_s, None, deadline, figures=figures)
    if not solver.loose_floor:
        return figures.least_peak_bytes
    if stop is not None:
        solver.search.stop_on(stop)
    relaxed = solver.search.relaxation(solver.primary, presolve=True)
    return figures.least_peak_bytes if relaxed is None else max(figures.least_peak_bytes,
                                                                relaxed * solver.formulation.bytes_unit)
