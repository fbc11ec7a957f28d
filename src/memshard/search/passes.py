"""The first pass: the primary objective minimised with the secondary one as a small
tie-break (the blend), then proved, on one :class:`~memshard.search.highs.HighsSearch`.

Branch and bound on the primary objective alone stalls on its many exact ties (which axis
splits the batch, …): HiGHS's primal heuristics find no plan for long. So the first pass
minimises the primary objective plus a small multiple of the other one (the blend), which is
usually optimal for the primary one alone, as a plan-independent bound on it often shows at
once. Its stages, in order: the blend's minimisation (a dive, then, where the dive leaves its
gap open and nothing stops the pass there, branch and bound); the proof of the blend's plan
(the floor, the blend's own bound, the relaxation of the primary objective); and, where none
proves it, the search on the primary objective alone (:func:`primary_alone`).

Where the relaxation is known to be loose (``PassRules.relax_first``: the step time, whose
overlapped collectives the relaxation hides behind the compute of another plan mixed in), it
is solved before the blend's branch and bound: where it leaves the dive's plan more than the
gap open, that branch and bound is skipped and the search on the primary objective alone
starts from the dive's plan. The blend's proof would have ended there too unless it found a
plan faster by that much, which the search on the primary objective finds as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memshard.core.errors import NoBetterPlan, SolverTimeLimit
from memshard.search.formulation import HIGHS_TOLERANCE, Expression
from memshard.search.highs import (
    ROWS_NEEDED,
    TIE_BREAK,
    TIE_RESOLUTION,
    UNSETTLED,
    HighsSearch,
    Solution,
    blend_objective,
    relative_gap,
    value_of,
)
from memshard.search.stages import BLEND


@dataclass(frozen=True)
class Objectives:
    """What a first pass minimises: ``primary`` (``kind``: what it measures, ``stages.MEMORY``
    or ``stages.TIME``; no plan's is below ``floor``), ties broken by ``secondary``, at their
    typical ``scales``; ``secondary_cap`` bounds ``secondary`` on every plan (a budget)."""

    primary: Expression
    secondary: Expression
    kind: str
    floor: float
    scales: tuple[float, float]
    secondary_cap: float = math.inf


@dataclass(frozen=True)
class PassRules:
    """How a first pass goes: its relative ``gap``; ``cutoff``: a value some other plan
    reaches (:class:`NoBetterPlan` at once where the floor, raised to ``relaxed_bound`` first,
    is not below it by the gap); ``relaxed_bound``: where the floor may be loose
    (recomputation: it lets every replayable tensor go for free), a bound on the primary
    objective from its relaxation (computed beside the search; -inf if none), asked for
    before the blend's branch and bound, not where the floor proves the blend's dive; where
    it proves the dive's plan within the gap, that plan is returned without branch and bound,
    its ties unresolved; ``simplex_bound``: the primary objective's relaxation by dual
    simplex from the basis the model has first; ``speculative``: the dive alone (halted UNSETTLED
    where its plan is not proved); ``on_branching``: called where the blend's dive leaves its
    gap open, or its plan goes on to the primary objective alone (a long search follows); ``needs_rows``: whether a plan breaks lazy rows (halted
    ROWS_NEEDED with the dive's plan that does; the blend's returned unproved: no search of
    a model about to change); ``relax_first``: the primary objective's relaxation before the
    blend's branch and bound, which is skipped where the relaxation leaves the dive's plan
    more than the gap open (the search on the primary objective alone instead); with a
    cutoff, that relaxation comes first, before the blend's dive: it may rule the search out
    at once."""

    gap: float
    cutoff: float = math.inf
    relaxed_bound: Callable[[], float] | None = None
    simplex_bound: bool = False
    speculative: bool = False
    on_branching: Callable[[], None] | None = None
    needs_rows: Callable[[np.ndarray], bool] | None = None
    relax_first: bool = False


RELAXATION_OPEN = "relaxation open"  # (``Solution.halted``) the blend's dive's plan, unproved by the relaxation


def first_pass(search: HighsSearch, objectives: Objectives, rules: PassRules, fallback) -> Solution:
    """Minimise ``objectives.primary`` (≥ its floor), ties broken by the secondary one.

    Branch and bound first minimises the blend primary + w·secondary from ``fallback`` (a
    start as ``HighsSearch.minimise`` takes it), w such that the secondary weighs TIE_BREAK
    of the primary at their typical scales, to a gap TIE_BREAK times finer. Usually that plan
    is optimal for the primary objective, as the floor or its LP relaxation alone shows. Its
    ties are resolved to within the gap of the secondary when the blend's remaining gap and
    HiGHS's tolerances, divided by w, are that small. Otherwise :func:`primary_alone`. A
    ``secondary_cap`` (a budget) bounds the primary objective by the blend's bound B too:
    primary ≥ B − w·cap (what a blend out of time reports)."""
    return FirstPass(search, objectives, rules).run(fallback)


class FirstPass:
    """One first pass on ``search`` (``first_pass``), with its floor as it rises."""

    def __init__(self, search: HighsSearch, objectives: Objectives, rules: PassRules):
        self.search, self.objectives, self.rules = search, objectives, rules
        self.floor = objectives.floor
        self.relaxed = False  # whether the floor holds the primary objective's relaxation already
        self.blend, self.weight = blend_objective(objectives.primary, objectives.secondary, objectives.scales)

    def raise_floor(self) -> None:
        """Raise the floor to the primary objective's relaxation, where there is one."""
        if self.rules.relaxed_bound is not None:
            self.floor = max(self.floor, self.rules.relaxed_bound())

    def raise_floor_against_cutoff(self) -> None:
        """Raise the floor (``raise_floor``), and stop the search where it shows no plan is
        below the cutoff by the gap (:class:`NoBetterPlan`)."""
        self.raise_floor()
        if self.floor >= self.rules.cutoff * (1 - self.rules.gap):
            raise NoBetterPlan(self.floor)

    def before_branching(self, dived: np.ndarray | None) -> Solution | None:
        """What stops the blend's minimisation before its branch and bound, given the dive's
        plan ``dived`` (None: none): a speculative pass, lazy rows the plan breaks, or the
        primary objective's relaxation proving the plan; None: nothing does."""
        rules, primary = self.rules, self.objectives.primary
        if rules.on_branching is not None:
            rules.on_branching()
        if rules.speculative:
            return Solution.halt(UNSETTLED)
        if rules.needs_rows is not None and dived is not None and rules.needs_rows(dived):
            return Solution.halt(ROWS_NEEDED, dived)
        self.raise_floor_against_cutoff()
        if rules.relaxed_bound is not None and dived is not None:
            dived_value = value_of(primary, dived)
            if relative_gap(dived_value, self.floor) <= rules.gap:
                return Solution(dived, dived_value, relative_gap(dived_value, self.floor), False, False, True)
        if rules.relax_first and dived is not None and relative_gap(value_of(primary, dived), self.floor) > rules.gap:
            self.relax_primary()
            self.raise_floor_against_cutoff()
            if relative_gap(value_of(primary, dived), self.floor) > rules.gap:
                return Solution.halt(RELAXATION_OPEN, dived)
        return None

    def relax_primary(self) -> None:
        """Raise the floor to the primary objective's relaxation (the stage "relaxation"),
        once."""
        if self.relaxed:
            return
        self.relaxed = True
        bound = self.search.solve_relaxation(self.objectives.primary, simplex_first=self.rules.simplex_bound,
                                             kind=self.objectives.kind)
        if bound is not None:
            self.floor = max(self.floor, bound)

    def run(self, fallback) -> Solution:
        """The pass: the blend minimised from ``fallback``, then its plan proved."""
        search, rules = self.search, self.rules
        if math.isfinite(rules.cutoff):
            self.raise_floor_against_cutoff()
            if rules.relax_first:
                self.relax_primary()
                self.raise_floor_against_cutoff()
        blended = search.minimise(self.blend, rules.gap * TIE_BREAK, start=fallback,
                                  before_branching=self.before_branching, kind=BLEND)
        if blended.halted == RELAXATION_OPEN:  # from the dive's plan, the primary objective alone
            value = value_of(self.objectives.primary, blended.values)
            return primary_alone(search, self.objectives, rules.gap,
                                 Solution(blended.values, value, relative_gap(value, self.floor), False),
                                 self.floor, dive=True, cutoff=rules.cutoff)
        if blended.halted or blended.dive_proved:
            return blended
        return self.proved(blended)

    def proved(self, blended: Solution) -> Solution:
        """The blend's plan ``blended`` checked against the floor, the blend's own bound and
        the primary objective's relaxation; where none proves it, ``primary_alone``."""
        search, rules, objectives = self.search, self.rules, self.objectives
        primary, gap = objectives.primary, rules.gap
        values, value = blended.values, value_of(primary, blended.values)
        blend_error = (blended.gap + HIGHS_TOLERANCE) * max(abs(blended.objective), 1.0)  # (and the tolerances)
        ties_resolved = blend_error <= self.weight * gap * abs(value_of(objectives.secondary, values))
        self.floor = max(self.floor, blended.objective * (1 - blended.gap) - self.weight * objectives.secondary_cap)
        floor_gap = relative_gap(value, self.floor)
        if floor_gap > gap and not search.expired():
            if rules.speculative:
                return Solution.halt(UNSETTLED)
            if rules.needs_rows is not None and not blended.timed_out and rules.needs_rows(values):
                return Solution(values, value, floor_gap, False, False)
            if rules.relaxed_bound is None:
                self.relax_primary()
            self.raise_floor()
            floor_gap = relative_gap(value, self.floor)
        if blended.timed_out or search.expired():
            return Solution(values, value, floor_gap, True, False)
        if floor_gap <= gap:
            return Solution(values, value, floor_gap, False, ties_resolved)
        if rules.on_branching is not None:
            rules.on_branching()
        # a dive on the primary objective alone first, not on a loose floor's peak: simplex
        # solves its relaxation slowly (docs/search.md, *Measurements*)
        return primary_alone(search, objectives, gap, Solution(values, value, floor_gap, False, ties_resolved),
                             self.floor, dive=rules.relaxed_bound is None, cutoff=rules.cutoff)


def primary_alone(search: HighsSearch, objectives: Objectives, gap: float, blended: Solution, floor: float,
                  dive: bool, cutoff: float = math.inf) -> Solution:
    """The search on the primary objective alone (a dive first if ``dive``), from the blend's
    plan ``blended`` that ``floor`` leaves unproved: that plan, its ties broken, where nothing
    better is found or the bound reached proves it within the gap too; else the better plan.
    Its branch and bound searches below ``cutoff`` by the gap only (:class:`NoBetterPlan`
    where there is nothing)."""
    values, value = blended.values, blended.objective
    try:
        if dive:
            search.dive_again()
        best = search.minimise(objectives.primary, gap, start=values, kind=objectives.kind, cutoff=cutoff)
    except SolverTimeLimit:
        return Solution(values, value, blended.gap, True, False)
    # the best bound known: branch and bound's own (none where time ran out at once), or the floor
    floor = max(floor, best.objective - best.gap * abs(best.objective))
    if best.objective >= value - abs(value) * TIE_RESOLUTION or relative_gap(value, floor) <= gap:
        return Solution(values, value, relative_gap(value, floor), best.timed_out,
                        blended.ties_resolved and not best.timed_out)
    return Solution(best.values, best.objective, relative_gap(best.objective, floor), best.timed_out, False)
