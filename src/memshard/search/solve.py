"""Solving a problem: the formulation searched with HiGHS, stage by stage (``docs/search.md``).

Objectives: ``memory`` minimises M, then, with M held within the gap of its optimum, the step
time (ties broken by time); ``time`` minimises T subject to M ≤ budget, then M.

:func:`solve` takes one :class:`SearchRequest` and runs the stages in order: the
plan-independent floor against a cutoff (before anything is built); the formulation; the
relaxation of the peak beside the search (:class:`RelaxationBeside`, where the floor is
loose); then one loop over :data:`STAGES`, each a function from a typed input to an
:class:`Outcome`: the first pass (:func:`first_pass_rounds`, each round
``passes.first_pass``), round after round until its plan meets every lazy reshard row; and
the tie-break pass (:func:`tie_break_pass`) where the first pass could not show its ties
resolved. The :class:`Solver` holds what the stages share: the formulation, the HiGHS
search, the objectives, and the pricing of a plan and its lazy rows. Each stage (and each stage within them, ``highs.py``) appends its record to the
search's :class:`~memshard.search.stages.StageLog`; the result keeps it
(``SolveResult.stages``). ``search="plain"`` is the reference those stages are checked
against: one HiGHS branch and bound on the whole formulation (:func:`solve_plain`).
:func:`solve_fixed` prices several complete plans of one problem through the ILP, as
``fixed`` does one, on one formulation pinned to each in turn.

The reshard rows are lazy (without a memory budget): most plans' peak is not at a reshard,
and without those rows (and their ρ columns) each HiGHS solve is smaller. The first pass runs
without them; where the plan, priced by the evaluator, holds more than its M at a reshard
point, that point's rows are added and the first pass runs again, from that plan, until none
is over (``Formulation.points_over_peak``; the first pass checks its dive's plan before
branch and bound, its blended plan before any proof of it); the second pass likewise. A plan
that meets M is optimal with every row too: dropping rows only enlarges the feasible set.
Rows come point by point, not all at the first violation: a plan is often over M at a handful
of its hundreds of reshard points. Every round's bound holds for the whole ILP: the next
round starts from it. Out of time in a later round, the plan kept is the better of that
round's and the one before it, as the evaluator prices them, with its gap to the best bound.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from memshard.core.errors import Infeasible, MemshardError, NoBetterPlan, SolverTimeLimit
from memshard.problem.evaluate import Evaluation, evaluate, slot_peak
from memshard.problem.records import Problem, Selection
from memshard.search.formulation import Expression, Formulation
from memshard.search.highs import (
    ROWS_NEEDED,
    TIE_RESOLUTION,
    UNSETTLED,
    HighsSearch,
    SearchLimits,
    Solution,
    blend_objective,
    relative_gap,
    value_of,
)
from memshard.search.passes import Objectives, PassRules, first_pass
from memshard.search.reference import Reference, reference
from memshard.search.stages import BLEND, MEMORY, TIME, StageLog, StageRecord

OBJECTIVES = ("memory", "time")
SEARCHES = ("staged", "plain")  # the staged search, and the plain single MIP it is checked against
TIME_ROWS_BOUND = "the step time's relaxation without memory rows"  # (``NoBetterPlan.by``)
TIE_SLACK = 2e-3  # the most a loose floor's tie-break pass lets the peak exceed its bound by
# The tie-break pass runs its dive alone (no branch and bound) on a model of at least this many
# nonzeros: there the root of its branch and bound alone took longer than the whole first pass
# (docs/search.md, *The fastest plan*). A count, not a time: the same input, the same plan.
TIE_BREAK_NONZEROS = 150_000


@dataclass(frozen=True)
class SolveResult:
    """The search's result: the plan, how it ended (``status``: "optimal", or "time_limit":
    feasible, with its gap), the model's size, the ILP's own M (≥ the evaluated peak; equal at
    optimum), the bound the search proved (no plan's objective, in bytes or seconds, is below
    it), and the record of the stages run (their figures in bytes or seconds)."""

    selection: Selection
    status: str
    objective: str
    gap: float
    time_s: float
    variables: int
    constraints: int
    ilp_peak_bytes: float = 0.0
    bound: float = 0.0
    search_space: str = "full"
    evaluation: Evaluation | None = None  # the plan priced by the evaluator
    stages: tuple[StageRecord, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What a stage of :data:`STAGES` returns, where the search stands: a solution, its primary objective (model units), its gap,
    whether time ran out, whether its ties are resolved, and the best bound of all rounds."""

    values: np.ndarray
    best: float
    gap: float
    timed_out: bool
    ties_resolved: bool
    lower: float
    evaluation: Evaluation | None = None
    dive_proved: bool = False  # the first pass's plan its dive's, proved by the peak's relaxation


@dataclass
class RoundsSoFar:
    """The first pass in progress (its working record, not a stage output): the start of its
    next round (``fallback``), the best bound of all rounds (every round's holds for the
    whole ILP: it has fewer rows), and an earlier round's plan (over M at some reshard) with
    its evaluated objective (``previous``)."""

    fallback: object
    lower: float = -math.inf
    previous: tuple[np.ndarray, float] | None = None


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
    as it is then (without lazy rows added later: a bound still, on fewer rows); a stage the
    search need not wait for until it needs the bound. ``wait_for_bound`` waits for it (-inf
    where not solved in time); ``stop`` cuts it short. Either records its stage in ``log``
    (once)."""

    def __init__(self, model, expr: Expression, deadline: float, log: StageLog):
        search = HighsSearch(model, deadline)  # (the model passed to HiGHS here, before it grows)
        self.stopping = threading.Event()
        search.stop_on(self.stopping)
        self.log, self.recorded = log, False
        self.started, self.ended = time.perf_counter(), math.nan
        self.result: list[float | None] = []
        self.thread = threading.Thread(target=lambda: self.solve(search, expr), daemon=True)
        self.thread.start()

    def solve(self, search: HighsSearch, expr: Expression) -> None:
        self.result.append(search.solve_relaxation(expr, presolve=True))
        self.ended = time.perf_counter()

    def wait_for_bound(self) -> float:
        """Wait for the relaxation: its minimum (-inf where not solved in time)."""
        self.thread.join()
        self.record("waited for")
        return self.result[0] if self.result and self.result[0] is not None else -math.inf

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.record("not needed")

    def record(self, stopped: str) -> None:
        """Record the stage in the log, the first time only (its thread has ended)."""
        if self.recorded:
            return
        self.recorded = True
        bound = self.result[0] if self.result else None
        ended = self.ended if math.isfinite(self.ended) else time.perf_counter()
        self.log.extend([StageRecord("relaxation beside", MEMORY, None, bound, ended - self.started,
                                     stopped if bound is not None else f"{stopped}, unsolved")])


@dataclass(frozen=True)
class SearchRequest:
    """What :func:`solve` searches: ``problem`` for ``objective`` ("memory" or "time"), within
    the budgets (``max_step_time_s`` with memory; ``memory_budget_bytes`` with time, None:
    the device's memory), until ``time_limit_s``, to the relative ``mip_gap``. ``fixed``: a
    complete plan priced through the ILP instead (every choice pinned), which checks the
    linearisation against the evaluator. ``start``: a plan of ``problem`` branch and bound
    starts from (default: every op unsplit); one within the budget guarantees an answer under
    a time limit (itself, if the search finds none in time). ``cutoff``: the objective (bytes
    or seconds) a plan found elsewhere reaches: where the search's first bounds show that no
    plan of ``problem`` is more than the gap below it, :class:`NoBetterPlan` is raised with
    that bound (in the same units). ``figures``: ``reference(problem)``, if already computed.
    ``on_formulated``: called once the model is built, before HiGHS solves anything (HiGHS
    releases the GIL while it solves: work started then on another thread runs beside it).
    ``on_branching``: called once, where the first pass's dive leaves its gap open (a long
    search follows). ``search``: "staged" (the stages of ``docs/search.md``), or "plain"
    (:func:`solve_plain`, which takes no ``fixed``, ``start`` nor ``cutoff``). ``limits``: the
    counts that bound the search's heuristics, and the test knob ``SearchLimits.time_out``."""

    problem: Problem
    objective: str = "memory"
    max_step_time_s: float | None = None
    memory_budget_bytes: float | None = None
    time_limit_s: float = 60.0
    mip_gap: float = 2e-3
    fixed: Selection | None = None
    start: Selection | None = None
    cutoff: float | None = None
    figures: Reference | None = None
    on_formulated: Callable[[], None] | None = None
    on_branching: Callable[[], None] | None = None
    search: str = "staged"
    limits: SearchLimits = SearchLimits()


class Solver:
    """One solve of a request: its formulation, the HiGHS search on it, the objectives, and
    the helpers the stages share (pricing a plan, adding lazy rows); ``plain``: the whole
    formulation, no dive, no lazy rows (``solve_plain``)."""

    def __init__(self, request: SearchRequest, figures: Reference | None, deadline: float, plain: bool = False):
        problem, objective, fixed = request.problem, request.objective, None if plain else request.fixed
        self.request = request
        # called once, where the first pass's dive leaves its gap open
        self.on_branching = request.on_branching and functools.cache(request.on_branching)
        max_step_time_s, memory_budget_bytes = request.max_step_time_s, request.memory_budget_bytes
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
        # once, but where the first dive's plan is proved and meets every row, that smaller LP
        # is all; else every row is added and the search starts again.
        self.lazy = (not plain and fixed is None
                     and (memory_budget_bytes is None or math.isinf(memory_budget_bytes)))
        self.speculative = self.lazy and problem.recompute != "none"
        formulation.add_plan_constraints(problem.candidate_points, reshard_rows=not self.lazy)
        time_expr = formulation.time_expression()
        formulation.add_budget_constraints(objective, time_expr, max_step_time_s, memory_budget_bytes)
        self.free_bounds = (list(formulation.model.lower), list(formulation.model.upper))  # (before any pin)
        if fixed is not None:
            formulation.fix(fixed)
        self.search = HighsSearch(formulation.model, deadline, None if plain else formulation.disjunctions(),
                                  request.limits)
        self.stages = self.search.stages
        self.set_objectives(objective, time_expr, max_step_time_s)
        self.max_step_time_s = max_step_time_s if objective == "memory" else None
        # the zero-redundancy floor lets every replayable tensor go for free: far below a
        # recomputing plan's least peak, it proves nothing there
        self.loose_floor = objective == "memory" and problem.recompute != "none"
        self.relaxed_peak: RelaxationBeside | None = None  # its bound there (``start_relaxation_beside``)
        self.cutoff = math.inf  # the primary objective (model units) another plan reaches
        self.last_priced: tuple[np.ndarray, Evaluation, set[int]] | None = None

    def pin(self, selection: Selection, deadline: float) -> None:
        """Price ``selection`` next, as a request with it ``fixed`` would: the formulation's
        bounds as built, every choice and keep flag pinned to it, on a fresh HiGHS search."""
        model = self.formulation.model
        model.lower[:], model.upper[:] = self.free_bounds
        self.formulation.fix(selection)
        self.search = HighsSearch(model, deadline, self.formulation.disjunctions(), self.request.limits)
        self.stages = self.search.stages

    def set_objectives(self, objective: str, time_expr: Expression, max_step_time_s: float | None) -> None:
        """The primary and secondary objectives, their floor and scales, the cap on the
        secondary one, and what a start within the budget minimises."""
        formulation = self.formulation
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

    def start_relaxation_beside(self) -> None:
        """Where the floor is loose, start the peak's relaxation beside the search."""
        if self.loose_floor:
            self.relaxed_peak = RelaxationBeside(self.formulation.model, self.primary, self.search.deadline,
                                                 self.stages)

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
            found = self.search.find_rounded_minimum(self.within_budget)
            return f.selection_start(replicated) if found is None else found
        return within_budget

    def add_reshard_rows(self, points: set[int] | None) -> None:
        """Add the reshard rows at ``points`` (None: all, and no more lazy rounds after; a dive
        again, as on a new model): the stage "lazy rows"."""
        started = time.perf_counter()
        model = self.formulation.model
        columns, rows = model.num_columns, model.num_rows
        self.formulation.add_reshard_constraints(points)
        self.search.extend(model, columns, rows)
        if points is None:
            self.lazy = self.speculative = False
            self.search.dive_again()
        added = "every reshard row added" if points is None else f"rows of {len(points)} reshard points added"
        self.stages.add("lazy rows", self.objective, started, added)

    def price(self, values: np.ndarray) -> tuple[Evaluation, set[int]]:
        """The plan of a solution priced by the evaluator, and the lazy rows it breaks
        (``Formulation.points_over_peak``); the last one remembered (the search may ask first)."""
        if self.last_priced is None or not np.array_equal(self.last_priced[0], values):
            evaluation = evaluate(self.problem, self.formulation.selection(values))
            self.last_priced = (values, evaluation, self.formulation.points_over_peak(values, evaluation))
        return self.last_priced[1], self.last_priced[2]

    def breaks_lazy_rows(self, values: np.ndarray) -> bool:
        """Whether a solution's plan breaks reshard rows the model lacks."""
        return bool(self.price(values)[1])

    def add_rows_broken_by(self, values: np.ndarray) -> tuple[tuple[np.ndarray, float], Expression]:
        """Add the lazy rows a solution's plan breaks; return that plan with its evaluated
        objective (the round's, kept should a later one run out of time), and the start of the
        next round."""
        evaluation, over = self.price(values)
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

    def pass_inputs(self, lower: float) -> tuple[Objectives, PassRules]:
        """What a round of the first pass minimises (its floor raised to ``lower``), and how."""
        objectives = Objectives(self.primary, self.secondary, self.objective, max(self.floor, lower), self.scales,
                                self.secondary_cap)
        rules = PassRules(max(self.request.mip_gap, TIE_RESOLUTION), cutoff=self.cutoff,
                          relaxed_bound=self.relaxed_peak.wait_for_bound if self.relaxed_peak is not None else None,
                          simplex_bound=self.objective == "time", speculative=self.speculative,
                          relax_first=self.objective == "time" and self.formulation.exposed is not None,
                          on_branching=self.on_branching, needs_rows=self.breaks_lazy_rows if self.lazy else None)
        return objectives, rules

    def result(self, outcome: Outcome, started: float) -> SolveResult:
        """The search's result from its last stage's ``outcome`` (``started``: when it began)."""
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
            stages=tuple(record.scaled(f.bytes_unit, f.time_unit) for record in self.stages.records),
        )


@dataclass(frozen=True)
class FirstPassInput:
    """The first stage's input: where its first round starts (``fallback``: a start as
    ``HighsSearch.minimise`` takes it), and the plan the request gave (``start``, or None),
    which it returns where time runs out before any plan of its own."""

    fallback: object
    start: Selection | None


def first_pass_rounds(solver: Solver, given: FirstPassInput) -> Outcome:
    """The first pass, round after round until its plan meets every lazy row (each round
    the stage "first pass", each round of rows the stage "lazy rows"); out of time before any
    plan, the ``start`` it was given, where that one meets the budgets."""
    rounds = RoundsSoFar(given.fallback)
    while True:
        started = time.perf_counter()
        try:
            solver.search.begin_stage("first pass")
            found = first_pass(solver.search, *solver.pass_inputs(rounds.lower), rounds.fallback)
        except Infeasible:
            solver.stages.add("first pass", solver.objective, started, "infeasible")
            raise Infeasible(solver.objective) from None
        except SolverTimeLimit:
            solver.stages.add("first pass", solver.objective, started, "time limit, no plan")
            return out_of_time(solver, rounds, given.start)
        outcome, stopped = settle_round(solver, found, rounds)
        if found.halted:  # (the dive's plan that needs rows, as the evaluator prices it)
            plan = rounds.previous[1] if found.halted == ROWS_NEEDED else None
        else:
            plan = found.objective
        solver.stages.add("first pass", solver.objective, started, stopped, found=plan,
                          bound=rounds.lower if math.isfinite(rounds.lower) else None)
        if outcome is not None:
            return outcome


def out_of_time(solver: Solver, rounds: RoundsSoFar, start: Selection | None) -> Outcome:
    """The first pass out of time before a round's plan: the round before's, else the
    ``start`` given where it meets the budgets (else :class:`SolverTimeLimit`)."""
    if rounds.previous is None:
        given = solver.given_start(start)
        if given is None:
            raise SolverTimeLimit(solver.request.time_limit_s) from None
        return given
    values, best = rounds.previous
    return Outcome(values, best, relative_gap(best, rounds.lower), True, False, rounds.lower)


def settle_round(solver: Solver, found: Solution, rounds: RoundsSoFar) -> tuple[Outcome | None, str]:
    """What a round of the first pass that found ``found`` leads to: the pass's outcome,
    or None where another round follows (its rows added, ``rounds`` moved on); and why
    the round stopped."""
    if found.halted == UNSETTLED:  # a speculative dive left its gap open: every row, again
        solver.add_reshard_rows(None)
        return None, "dive unsettled"
    if found.halted == ROWS_NEEDED:  # the dive's plan breaks lazy rows: those first, then from it
        (rounds.previous, rounds.fallback), rounds.lower = solver.add_rows_broken_by(found.values), max(
            rounds.lower, solver.floor)
        return None, "dive's plan breaks lazy rows"
    rounds.lower = max(rounds.lower, found.objective * (1 - found.gap))
    outcome = Outcome(found.values, found.objective, found.gap, found.timed_out, found.ties_resolved,
                      rounds.lower, dive_proved=found.dive_proved)
    done = "time limit" if found.timed_out else "dive proved by the relaxation" if found.dive_proved else "proved"
    if not solver.lazy:
        return outcome, done
    evaluation, over = solver.price(found.values)
    outcome = replace(outcome, evaluation=evaluation)
    if not over:
        return outcome, done
    expired = found.timed_out or solver.search.expired()
    if solver.speculative and not expired:
        solver.add_reshard_rows(None)
        return None, "plan breaks lazy rows"
    if expired:  # out of time: the better plan, priced as it is
        values, best = outcome.values, solver.primary_of(evaluation)
        if rounds.previous is not None and rounds.previous[1] < best:
            (values, best), evaluation = rounds.previous, None
        return replace(outcome, values=values, best=best, evaluation=evaluation,
                       gap=relative_gap(best, rounds.lower)), "time limit"
    # Reshards the plan runs hold more than M allows: again with their rows, from it.
    rounds.previous, rounds.fallback = solver.add_rows_broken_by(found.values)
    return None, "plan breaks lazy rows"


def tie_break_pass(solver: Solver, outcome: Outcome) -> Outcome:
    """The tie-break pass (the stage "tie-break pass"), where the first pass could not show
    its ties resolved and time is left: hold the primary objective within the gap of the best
    bound, minimise the other one. The slack is at least the rows' feasibility tolerance
    accumulated along the chain of live-byte variables (≈1e-6 of the peak); ties finer than
    TIE_RESOLUTION of the primary objective are broken by the secondary one. (The first
    pass's plan meets every row, so its optimum holds with the reshard rows too.) Its dive
    alone after a first pass without branch and bound, or on a model of TIE_BREAK_NONZEROS."""
    if outcome.ties_resolved or solver.search.expired():
        return outcome
    started, first = time.perf_counter(), value_of(solver.secondary, outcome.values)
    tolerance = max(solver.request.mip_gap, TIE_RESOLUTION)
    # Where the bound is a loose floor's relaxation, the gap is room to prove the plan, not
    # to trade memory for time (a plan slower than one the gap had ruled out): the cap is
    # within TIE_SLACK.
    slack = min(tolerance, TIE_SLACK) if solver.relaxed_peak is not None else tolerance
    solver.search.add_row(solver.primary, second_pass_cap(outcome.best, outcome.lower, slack))
    # The secondary objective with the primary one as a small tie-break (TIE_BREAK of it
    # at the first pass's plan; the cap leaves the primary little room to trade): alone,
    # its relaxation is so degenerate that simplex takes far longer.
    start = outcome.values
    objective = blend_objective(solver.secondary, solver.primary,
                                (value_of(solver.secondary, start), value_of(solver.primary, start)))[0]
    # A dive again, though the first pass's may have left its gap open: another objective,
    # and its reduced costs pin choices for the branch and bound. After a first pass without
    # branch and bound (``dive_proved``), the dive alone: a branch and bound after it only
    # proved its plan.
    solver.search.dive_again()
    dive_only = outcome.dive_proved or solver.search.highs.getNumNz() >= TIE_BREAK_NONZEROS
    try:
        outcome, stopped = break_ties(solver, outcome, objective, tolerance, dive_only)
    except SolverTimeLimit:
        stopped = "time limit: the first pass's plan stands"
    secondary = TIME if solver.objective == MEMORY else MEMORY
    solver.stages.add("tie-break pass", secondary, started, stopped, found=value_of(solver.secondary, outcome.values),
                      start=first)
    return outcome


def break_ties(solver: Solver, outcome: Outcome, objective: Expression, tolerance: float,
               dive_only: bool) -> tuple[Outcome, str]:
    """Minimise the tie-break pass's ``objective`` from ``outcome``'s plan (by its dive alone
    where ``dive_only``), round after round of lazy rows: the outcome with its plan where it
    is no worse on the secondary objective and meets every row (else ``outcome``), and why
    the pass stopped."""
    f, start = solver.formulation, outcome.values
    while True:
        second = solver.search.minimise(objective, tolerance, start=start, dive_only=dive_only, kind=BLEND)
        if second.halted:
            return outcome, "dive unsettled: the first pass's plan stands"
        over = f.points_over_peak(second.values) if solver.lazy else set()
        if value_of(solver.secondary, second.values) > value_of(solver.secondary, outcome.values):
            return outcome, "no better plan: the first pass's plan stands"  # (out of time with a worse one)
        if not over:
            gap = outcome.gap
            if outcome.lower > 0:  # the gap of the plan returned, not of the first pass's
                gap = max(gap, relative_gap(value_of(solver.primary, second.values), outcome.lower))
            return replace(outcome, values=second.values, evaluation=None, gap=gap,
                           timed_out=outcome.timed_out or second.timed_out), (
                "time limit" if second.timed_out else "dive alone" if dive_only and not outcome.dive_proved
                else "proved")
        if second.timed_out or solver.search.expired():
            return outcome, "time limit: the first pass's plan stands"
        solver.add_reshard_rows(over)
        start = f.selection_start(f.selection(outcome.values))


# The stages :func:`solve` runs, in order: each takes the one before's output (the first, a
# FirstPassInput) and returns an Outcome.
STAGES: tuple[Callable[[Solver, object], Outcome], ...] = (first_pass_rounds, tie_break_pass)


def solve(request: SearchRequest) -> SolveResult:
    """Solve ``request`` (:class:`SearchRequest`): with a cutoff, the plan-independent floor
    first (it may rule the problem out before anything is built); the formulation; the
    relaxation beside the search, where the floor is loose; then :data:`STAGES`, in order.
    With ``request.fixed``, that plan priced through the ILP, no search around it."""
    problem, objective = request.problem, request.objective
    if objective not in OBJECTIVES:
        raise MemshardError(f"unknown objective {objective!r}; use memory or time")
    if request.search not in SEARCHES:
        raise MemshardError(f"unknown search {request.search!r}; use {' or '.join(SEARCHES)}")
    started = time.perf_counter()
    figures = request.figures if request.figures is not None else reference(problem)
    if request.search == "plain":
        return solve_plain(request, figures)
    if request.cutoff is not None:  # the plan-independent floor may rule the problem out before it is built
        floor = figures.least_peak_bytes if objective == "memory" else figures.time_floor_s
        if rules_out(floor, request.cutoff, request.mip_gap):
            raise NoBetterPlan(floor, by="the plan-independent floor")
    relaxed_time = None
    if request.cutoff is not None and objective == "time" and request.fixed is None:
        # the step time's relaxation on its own rows: a fraction of the whole model's work
        relaxed_time = step_time_relaxation(problem, figures, started + request.time_limit_s)
        if relaxed_time is not None and rules_out(relaxed_time, request.cutoff, request.mip_gap):
            raise NoBetterPlan(relaxed_time, by=TIME_ROWS_BOUND)
    solver = Solver(request, figures, started + request.time_limit_s)
    f = solver.formulation
    unit = f.bytes_unit if objective == "memory" else f.time_unit
    if request.cutoff is not None:
        solver.cutoff = request.cutoff / unit
    if relaxed_time is not None:
        solver.floor = max(solver.floor, relaxed_time / unit)
    if request.on_formulated is not None:
        request.on_formulated()
    if request.fixed is not None:
        return fixed_result(solver, started)
    fallback = f.selection_start(request.start) if request.start is not None else solver.fallback_start()
    solver.start_relaxation_beside()
    state: object = FirstPassInput(fallback, request.start)
    try:
        for stage in STAGES:
            state = stage(solver, state)
    except NoBetterPlan as e:
        raise NoBetterPlan(e.bound * unit, e.by) from None
    finally:
        if solver.relaxed_peak is not None:
            solver.relaxed_peak.stop()
    return solver.result(state, started)


def fixed_result(solver: Solver, started: float) -> SolveResult:
    """The result of a solver whose plan is pinned: the one plan the rows allow, its objective,
    no search around it."""
    found = solver.search.minimise(solver.primary, TIE_RESOLUTION, kind=solver.objective)
    return solver.result(Outcome(found.values, found.objective, 0.0, found.timed_out, True, found.objective), started)


def solve_fixed(request: SearchRequest, selections: list[Selection]) -> list[SolveResult]:
    """What :func:`solve` returns for ``request`` with each of ``selections`` as its ``fixed``
    plan, from one formulation: built once, then pinned to each plan in turn (the same model
    HiGHS is given for each, so the same results). ``request`` gives no ``fixed``, ``start``,
    ``cutoff`` nor callbacks."""
    if request.objective not in OBJECTIVES:
        raise MemshardError(f"unknown objective {request.objective!r}; use memory or time")
    figures = request.figures if request.figures is not None else reference(request.problem)
    results, solver = [], None
    for selection in selections:
        started = time.perf_counter()
        if solver is None:
            solver = Solver(replace(request, fixed=selection), figures, started + request.time_limit_s)
        else:
            solver.pin(selection, started + request.time_limit_s)
        results.append(fixed_result(solver, started))
    return results


def solve_plain(request: SearchRequest, figures: Reference | None = None) -> SolveResult:
    """The plain search, the reference the staged one is checked against: one HiGHS branch
    and bound on the whole formulation (every reshard row), minimising the primary objective
    alone to ``mip_gap``: no dive, no lazy rows, no blend, no tie-break pass (so ties in the
    primary objective fall as HiGHS finds them). Slower than the staged search, and its plan
    may differ where several plans tie; its optimum agrees within the gap. It takes no
    ``fixed``, ``start`` nor ``cutoff``."""
    started = time.perf_counter()
    solver = Solver(request, figures, started + request.time_limit_s, plain=True)
    if request.on_formulated is not None:
        request.on_formulated()
    try:
        found = solver.search.minimise(solver.primary, max(request.mip_gap, TIE_RESOLUTION), kind=request.objective)
    except Infeasible:
        raise Infeasible(request.objective) from None
    except SolverTimeLimit:
        raise SolverTimeLimit(request.time_limit_s) from None
    lower = found.objective * (1 - found.gap)
    return solver.result(Outcome(found.values, found.objective, found.gap, found.timed_out, True, lower), started)


def rules_out(bound: float, cutoff: float, mip_gap: float) -> bool:
    """Whether ``bound`` shows that no plan is more than the gap below ``cutoff``, the
    objective a plan found elsewhere reaches: a search given that cutoff stops there."""
    return bound >= cutoff * (1 - max(mip_gap, TIE_RESOLUTION))


def step_time_relaxation(problem: Problem, figures: Reference, deadline: float) -> float | None:
    """A lower bound on ``problem``'s least step time (seconds), None where not found by
    ``deadline``: the LP relaxation of the step time on the rows that price it alone
    (``Formulation.add_time_constraints``: no memory rows, no budget; fewer rows, so a bound
    on the whole model's relaxation), by dual simplex. Where the memory rows do not bind
    the relaxation, it equals the whole model's, formulated and solved in a fraction of its
    time."""
    formulation = Formulation(problem, figures)
    formulation.add_time_constraints()
    search = HighsSearch(formulation.model, deadline)
    bound = search.solve_relaxation(formulation.time_expression(), simplex_first=True, kind=TIME)
    return None if bound is None else bound * formulation.time_unit


def relaxed_floor(problem: Problem, figures: Reference, deadline: float, max_step_time_s: float | None = None,
                  stop: threading.Event | None = None) -> float:
    """A lower bound on ``problem``'s least peak (bytes), the one a least-memory search given a
    cutoff computes before anything else: the floor, raised where it is loose
    (recomputation) to the LP relaxation of the peak, solved until ``deadline`` or until
    ``stop`` is set (then the floor alone)."""
    solver = Solver(SearchRequest(problem, "memory", max_step_time_s), figures, deadline)
    if not solver.loose_floor:
        return figures.least_peak_bytes
    if stop is not None:
        solver.search.stop_on(stop)
    relaxed = solver.search.solve_relaxation(solver.primary, presolve=True, kind=MEMORY)
    return figures.least_peak_bytes if relaxed is None else max(figures.least_peak_bytes,
                                                                relaxed * solver.formulation.bytes_unit)
