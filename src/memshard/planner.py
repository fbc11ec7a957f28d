"""Planning a job: the problem to search, the search, and the plan.

``plan_job(job, options)`` is the one path from a :class:`~memshard.job.Job` to a
:class:`~memshard.plans.plan.Plan`: on meshes of three or more axes, adjacent axes with identical
links are planned as one (``search/coarsen.py``) unless ``full_mesh``, and only that problem is
built; a request no plan meets is explained with the least achievable figure.
``baseline_plans`` prices the hand-made strategies (``baselines/recipes.py``) of the same job.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from memshard.baselines.names import parse_strategy
from memshard.baselines.recipes import as_run_by, baselines, layer_split, split_baseline
from memshard.core.errors import Infeasible, MemshardError, NoBetterPlan, SolverTimeLimit
from memshard.core.quantities import check_bytes, format_bytes, format_seconds, parse_bytes
from memshard.job import Job
from memshard.plans.plan import Budgets, Plan, build_plan
from memshard.problem.evaluate import Evaluation, InconsistentPlan, check_plan, evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.recompute import RECOMPUTE_POLICIES
from memshard.problem.records import MEGATRON_OVERLAP, ZERO3_UNITS, OpGroup, Problem, Selection
from memshard.search.coarsen import lower_selection, merge_groups, merged_mesh, solve_merged
from memshard.search.highs import SearchLimits, relative_gap
from memshard.search.reference import Reference, reference
from memshard.search.solve import (
    OBJECTIVES,
    SEARCHES,
    SearchRequest,
    SolveResult,
    relaxed_floor,
    rules_out,
    solve,
)
from memshard.search.stages import MEMORY, StageRecord, TimeOut, in_scope

MAX_FINITE = sys.float_info.max
DEFAULT_GAP = 2e-3  # the relative optimality gap a search stops at, unless one is given
RECOMPUTE_MEMORY_GAP = 0.03  # and the least-memory search with recomputation (``SearchOptions.gap``)
UNIT_SEARCH = "unit's search"  # the stage of a ZeRO-3 unit's search that found no plan


@dataclass(frozen=True)
class SearchOptions:
    """What to search for and how: the objective and its budget (``max_step_time_s`` with
    ``memory``, ``memory_budget`` with ``time``: bytes or a string like ``80GiB``), the search
    space (``exact``: no variable sharing across identical layers; ``full_mesh``: no merged
    axes; ``zero3_unit``: ZeRO-3 weights gathered per ``op`` or per ``layer``, None: as
    ``zero3_units`` says; ``recompute``:
    which activations may be recomputed, ``none``, ``selective``, ``full`` or ``auto``), the solver's
    limit and relative gap (``mip_gap``; None: ``gap`` says), how many of the most
    redundant ops the plan lists with advice, and the search (``search``: ``staged``, the
    stages of docs/search.md; ``plain``, one HiGHS branch and bound on the whole formulation,
    the reference the staged search is checked against: ``search.solve.solve_plain``).
    ``time_out``: a test knob (``search.stages.TimeOut``): the stage run at which time runs
    out, in each search (``SearchLimits.time_out``), or, for the stage "unit's search", at
    the start or end of the search of the ZeRO-3 unit of that index in ``zero3_units``."""

    objective: str = "memory"
    max_step_time_s: float | None = None
    memory_budget: int | float | str | None = None
    exact: bool = False
    full_mesh: bool = False
    zero3_unit: str | None = None
    time_limit_s: float = 60.0
    mip_gap: float | None = None
    top: int = 10
    recompute: str = "none"
    search: str = "staged"
    time_out: TimeOut | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise MemshardError(f"unknown objective {self.objective!r}; use memory or time")
        if isinstance(self.memory_budget, str):
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        for value, what, most in ((self.memory_budget, "the memory budget", math.inf),  # math.inf: none
                                  (self.max_step_time_s, "the step-time budget", MAX_FINITE),
                                  (self.time_limit_s, "the solver time limit", MAX_FINITE)):
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and 0 < value <= most):
                raise MemshardError(f"{what} must be a positive{' finite' * (most < math.inf)} number, got {value!r}")
        if self.memory_budget is not None and self.memory_budget < math.inf:
            check_bytes(self.memory_budget, "the memory budget")
        if self.mip_gap is not None and not (isinstance(self.mip_gap, (int, float)) and 0 <= self.mip_gap < 1):
            raise MemshardError(f"the optimality gap must be in [0, 1), got {self.mip_gap}")
        if self.objective == "memory" and self.memory_budget is not None:
            raise MemshardError("a memory budget bounds the fastest plan (objective time); the least-memory plan "
                                "takes a step-time budget")
        if self.objective == "time" and self.max_step_time_s is not None:
            raise MemshardError("a step-time budget bounds the least-memory plan (objective memory); the fastest "
                                "plan takes a memory budget")
        if isinstance(self.top, bool) or not isinstance(self.top, int) or self.top < 1:
            raise MemshardError(f"top (how many redundant ops to list) must be a positive integer, got {self.top!r}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise MemshardError(f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)}, got {self.recompute!r}")
        if self.search not in SEARCHES:
            raise MemshardError(f"search must be one of {', '.join(SEARCHES)}, got {self.search!r}")
        if self.zero3_unit is not None and self.zero3_unit not in ZERO3_UNITS:
            raise MemshardError(f"the ZeRO-3 gather unit must be one of {', '.join(ZERO3_UNITS)}, "
                                f"got {self.zero3_unit!r}")

    @property
    def gap(self) -> float:
        """The relative optimality gap the search stops at: ``mip_gap`` where given; else
        RECOMPUTE_MEMORY_GAP for the least memory with recomputation, DEFAULT_GAP otherwise.
        There the bound is the LP relaxation of the peak (the zero-redundancy floor lets every
        replayable tensor go for free), which stays a little below the dive's plan: that plan
        is mostly the best a long branch and bound finds, and proving it closer takes that
        long (BENCHMARKS.md, *Least memory with recomputation: the default gap*)."""
        if self.mip_gap is not None:
            return self.mip_gap
        return RECOMPUTE_MEMORY_GAP if self.objective == "memory" and self.recompute != "none" else DEFAULT_GAP

    @property
    def budgets(self) -> Budgets:
        return Budgets(self.max_step_time_s, self.memory_budget)

    @property
    def zero3_units(self) -> tuple[str, ...]:
        """The ZeRO-3 gather units searched, each its own problem, the better plan kept: the
        one given; else, for the least memory with recomputation, per layer and then per op
        (per op, a replayed op's weight cannot be gathered per op: its layer's weights stay
        whole or sharded by its strategy, and the least-memory plans per layer are leaner on
        the jobs of BENCHMARKS.md); else per op."""
        if self.zero3_unit is not None:
            return (self.zero3_unit,)
        return ("layer", "op") if self.objective == "memory" and self.recompute != "none" else ("op",)

    @property
    def priced_unit(self) -> str:
        """The unit a fixed plan (a baseline) is priced with: the one given, else per op."""
        return self.zero3_unit or "op"


def searched_problem(job: Job, options: SearchOptions) -> Problem:
    """The problem the search solves (the first of ``options.zero3_units``): the job's mesh,
    or it with alike axes merged."""
    mesh, groups = job.mesh, merge_groups(job.mesh)
    mergeable = mesh.ndim >= 3 and len(groups) < mesh.ndim
    if options.full_mesh and not mergeable:
        raise MemshardError(f"full_mesh (--full-mesh) changes nothing on mesh {mesh}: no adjacent axes with "
                            "identical links are planned as one there")
    if mergeable and not options.full_mesh:
        mesh = merged_mesh(mesh, groups)
    return build_problem(job.graph, mesh, shared_layers=not options.exact, micro_batches=job.micro_batches,
                         zero3_unit=options.zero3_units[0], recompute=options.recompute)


def plan_job(job: Job, options: SearchOptions, start: Plan | None = None, problem: Problem | None = None) -> Plan:
    """The plan ``options`` ask for (``start``: a plan of the same job the search starts
    from; ``problem``: the searched problem, if already built)."""
    units = options.zero3_units
    if len(units) > 1:
        searched, result = _least_memory_of_units(job, options, start, problem)
    else:
        searched = problem if problem is not None else searched_problem(job, options)
        try:
            result = _search(searched, options, start)
        except Infeasible:
            raise explain_infeasible(searched, options) from None
    return build_plan(searched, result.selection, job, result=result, budgets=options.budgets, top=options.top)


def _least_memory_of_units(job: Job, options: SearchOptions, start: Plan | None,
                           problem: Problem | None) -> tuple[Problem, SolveResult]:
    """The leaner of the least-memory plans over ``options.zero3_units``, each unit its own
    problem (``problem``: that of the first, if built): each search after the first stops as
    soon as its bound reaches the least peak found; the plan's gap is against the least of
    the searches' bounds, its time theirs together. The time limit is the searches'
    together: a unit reached with no time left is not searched, and the bound it has then
    (its floor, or the relaxation computed beside the search before) is its bound. The next
    unit's work runs on a thread beside the search before (``_NextUnit``)."""
    best: tuple[Problem, SolveResult, float] | None = None
    bounds, started, out_of_time = [], time.perf_counter(), None
    stages: list[StageRecord] = []  # every unit's, in order
    deadline = started + options.time_limit_s
    units = options.zero3_units
    with ThreadPoolExecutor(max_workers=1) as pool:
        following: _NextUnit | None = None
        try:
            for k, unit in enumerate(units):
                if following is not None and following.built is not None:
                    (searched, figures), bound = following.built.result(), following.bound()
                else:
                    searched = (problem if problem is not None and problem.zero3_unit == unit
                                else searched_problem(job, replace(options, zero3_unit=unit)))
                    figures, bound = reference(searched), None  # (solve would compute them; the floor serves here too)
                left = deadline - time.perf_counter()
                if k and (left <= 0 or (bound is not None and best is not None
                                        and rules_out(bound, best[2], options.gap))):
                    bounds.append(bound if bound is not None else figures.least_peak_bytes)
                    stages.append(_unit_stage(unit, bounds[-1], "no time left" if left <= 0 else "ruled out by its bound"))
                    continue
                following = (_NextUnit(pool, job, replace(options, zero3_unit=units[k + 1]), deadline)
                             if k + 1 < len(units) else None)
                try:
                    if options.time_out is not None and options.time_out.hits(UNIT_SEARCH, k):
                        raise SolverTimeLimit(options.time_limit_s)  # (a test knob: time runs out here)
                    result = _search(searched, replace(options, time_limit_s=max(left, 1e-3)), start,
                                     cutoff=best[2] if best else None, figures=figures,
                                     on_formulated=following and following.build,
                                     on_branching=following and following.relax)
                    if options.time_out is not None and options.time_out.hits(UNIT_SEARCH, k, at_end=True):
                        deadline = time.perf_counter()  # (a test knob: time runs out as it ends)
                except Infeasible:  # under a step-time budget: no plan of this unit meets it
                    stages.append(_unit_stage(unit, None, "infeasible"))
                    continue
                except NoBetterPlan as no_better:
                    bounds.append(no_better.bound)
                    stages.append(_unit_stage(unit, no_better.bound, f"no better plan, by {no_better.by}"))
                    continue
                except SolverTimeLimit:  # no plan of this unit in time (``start`` may be of the other)
                    out_of_time = SolverTimeLimit(options.time_limit_s)
                    bounds.append(figures.least_peak_bytes)  # its floor: no plan is below it
                    stages.append(_unit_stage(unit, bounds[-1], "time limit, no plan"))
                    continue
                bounds.append(result.bound)
                stages.extend(in_scope(result.stages, _scope(unit)))
                result = replace(result, evaluation=_evaluation(searched, result))
                if best is None or result.evaluation.peak_bytes < best[2]:
                    best = searched, result, result.evaluation.peak_bytes
        finally:
            if following is not None:
                following.stop.set()
    if best is None:
        if out_of_time is not None:
            raise out_of_time
        raise explain_infeasible(problem or searched_problem(job, options), options)
    searched, result, peak = best
    gap = relative_gap(peak, min(bounds))
    status = result.status if gap <= max(result.gap, options.gap) else "time_limit"  # the other one's gap
    return searched, replace(result, gap=gap, status=status, time_s=time.perf_counter() - started,
                             stages=tuple(stages))


def _scope(unit: str) -> str:
    return f"ZeRO-3 per {unit}"


def _unit_stage(unit: str, bound: float | None, stopped: str) -> StageRecord:
    """The record of a ZeRO-3 unit's search that found no plan (``bound``: what it proved)."""
    return StageRecord(UNIT_SEARCH, MEMORY, None, bound, 0.0, stopped, scope=_scope(unit))


class _NextUnit:
    """The next ZeRO-3 unit's work, on a thread beside the search of the one before (HiGHS
    releases the GIL while it solves): its problem and figures, built once that search's
    model is formulated (started earlier, the build would only slow that formulation by as
    much), and, where that search branches (a long one follows), the bound the next search
    would compute first (``relaxed_floor``: on a large recomputing least-memory plan, a
    relaxation that the first unit's branch and bound leaves the second core for). ``stop``:
    set once the searches end, the relaxation is cut short."""

    def __init__(self, pool: ThreadPoolExecutor, job: Job, options: SearchOptions, deadline: float):
        self.pool, self.job, self.options, self.deadline = pool, job, options, deadline
        self.stop = threading.Event()
        self.built: Future | None = None
        self.relaxed: Future | None = None

    def build(self) -> None:
        self.built = self.pool.submit(_with_figures, self.job, self.options)

    def relax(self) -> None:
        built = self.built
        if built is not None:
            self.relaxed = self.pool.submit(
                lambda: relaxed_floor(*built.result(), self.deadline, self.options.max_step_time_s, self.stop))

    def bound(self) -> float | None:
        """The relaxed floor, once computed (None where the search before did not branch)."""
        return None if self.relaxed is None else self.relaxed.result()


def _with_figures(job: Job, options: SearchOptions) -> tuple[Problem, Reference]:
    """The problem searched under ``options``, and its reference figures."""
    searched = searched_problem(job, options)
    return searched, reference(searched)


def _search(problem: Problem, options: SearchOptions, start: Plan | None, cutoff: float | None = None,
            figures: Reference | None = None, on_formulated: Callable[[], None] | None = None,
            on_branching: Callable[[], None] | None = None) -> SolveResult:
    initial = _start_selection(start, problem) if start is not None else None
    o = options
    search = solve if problem.mesh.real is problem.mesh else solve_merged
    request = SearchRequest(problem, o.objective, max_step_time_s=o.max_step_time_s,
                            memory_budget_bytes=o.memory_budget, time_limit_s=o.time_limit_s, mip_gap=o.gap,
                            figures=figures, on_formulated=on_formulated, search=o.search,
                            limits=SearchLimits(time_out=o.time_out))
    if o.search == "plain":
        return search(request)
    return search(replace(request, start=initial, cutoff=cutoff, on_branching=on_branching))


def _start_selection(start: Plan, problem: Problem) -> Selection | None:
    """``start`` as a selection of the searched ``problem``: the same strategies, storage and
    kept copies, whatever the recomputation or framework it was priced under (None where
    ``problem`` has no such plan, or it treats merged axes differently)."""
    searched = start.searched
    if searched.mesh == problem.mesh and len(searched.groups) == len(problem.groups):
        return _carried(searched, start.searched_selection, problem)
    if len(start.problem.groups) != len(problem.groups):
        raise MemshardError("the start plan is of another job")
    if problem.mesh.real is problem.mesh:
        return _carried(start.problem, start.selection, problem)
    return lower_selection(problem, start.problem, start.selection, list(problem.mesh.real_axes))


def _carried(source: Problem, selection: Selection, problem: Problem) -> Selection | None:
    """``selection`` of ``source`` as the same plan of ``problem`` (a choice's index means
    another strategy where the recomputation searched differs): each op's assignment and
    replay, each parameter's storage, each edge's kept copy, matched by name; None where
    ``problem`` has no such choice or the plan breaks one of its rules."""
    if source is problem:
        return selection
    choices = []
    for was, group, k in zip(source.groups, problem.groups, selection.choices):
        if was.key != group.key or type(was) is not type(group):
            raise MemshardError("the start plan is of another job")
        if isinstance(group, OpGroup):
            choice = group.choice_of(was.strategies[k].assignment, was.replayed(k))
        else:
            choice = next((c for c, option in enumerate(group.options) if option == was.options[k]), None)
        if choice is None:
            return None
        choices.append(choice)
    kept = {edge.key: selection.keeps[e] for e, edge in enumerate(source.edges)}
    carried = Selection(tuple(choices), tuple(kept.get(edge.key, 0) for edge in problem.edges))
    try:
        check_plan(problem, carried)
    except InconsistentPlan:
        return None
    return carried


def baseline_problem(job: Job, options: SearchOptions, plan: Plan | None = None) -> Problem:
    """The problem the baselines of ``job`` are priced on, on the real mesh, its ZeRO-3 weights
    gathered as ``options.priced_unit`` says: ``plan``'s where it is that one, else built."""
    if plan is not None and plan.problem.zero3_unit == options.priced_unit:
        return plan.problem
    return build_problem(job.graph, job.mesh, shared_layers=not options.exact, micro_batches=job.micro_batches,
                         zero3_unit=options.priced_unit, recompute=options.recompute)


def explain_infeasible(problem: Problem, options: SearchOptions) -> MemshardError:
    """Say what the least achievable figure is, so the user knows what to ask for."""
    if options.objective == "time":
        budget = options.memory_budget if options.memory_budget is not None else problem.mesh.device_memory_bytes
        least = _evaluation(problem, solve(SearchRequest(problem, "memory", time_limit_s=options.time_limit_s)))
        hint = ("; recomputing activations needs less (--recompute auto)"
                if options.recompute == "none" and problem.graph.num_layers else "")
        return MemshardError(
            f"no plan fits in {format_bytes(budget)} per device: the least any plan needs is "
            f"{format_bytes(least.peak_bytes)} (zero-redundancy bound {format_bytes(least.lower_bound_bytes)}){hint}"
        )
    fastest = solve(SearchRequest(problem, "time", memory_budget_bytes=math.inf,
                                    time_limit_s=options.time_limit_s))
    return MemshardError(f"no plan runs a step within {format_seconds(options.max_step_time_s)}: "
                         f"the fastest plan takes {format_seconds(_evaluation(problem, fastest).step_time_s)}")


def _evaluation(problem: Problem, result: SolveResult) -> Evaluation:
    return result.evaluation or evaluate(problem, result.selection)


def baseline_plans(job: Job, problem: Problem, wanted: Callable[[str], bool] | None = None,
                   layer_splits: bool = True) -> tuple[list[Plan], list[tuple[str, str]]]:
    """Every hand-made strategy of ``job`` that ``problem`` (on the job's real mesh) can lay
    out (``wanted``: those it accepts), priced like memshard's plans (no advice), and (name,
    reason) for the others. Listing them all (no ``wanted``), each recipe that fits only with
    recomputation also comes with as few layers recomputed as fit (``layer_splits``)."""
    fixed, skipped = baselines(problem, wanted)
    plans = [build_plan(b.problem, b.selection, job, strategy=b.name, advice=False) for b in fixed]
    if wanted is None and layer_splits:
        splits: dict[str, Plan] = {}
        for plain in plans:
            name = parse_strategy(plain.strategy)
            if name.overlap:  # (its twin without, listed before it, holds the same memory)
                twin = splits.get(str(replace(name, overlap=False)))
                split = twin and _overlapped(twin, job)
            else:
                split = _fewest_layers_recomputed(job, problem, plain, plans)
            if split is not None:
                splits[plain.strategy] = split
        plans += splits.values()
    return plans, skipped


def _overlapped(split: Plan, job: Job) -> Plan:
    """A Megatron-LM layer split with ``-overlap``: the same layers recomputed as ``split``'s
    (the overlap moves no memory), priced with its collectives beside the compute."""
    name = replace(parse_strategy(split.strategy), overlap=True)
    return build_plan(as_run_by(split.problem, MEGATRON_OVERLAP), split.selection, job, strategy=str(name),
                      advice=False)


def _fewest_layers_recomputed(job: Job, problem: Problem, plain: Plan, plans: list[Plan]) -> Plan | None:
    """Recipe ``plain`` with as few of its layers fully recomputed as fit the device
    (``baselines.layer_split``: Megatron-LM's block method, torchtitan's every N-th layer),
    where it fits with full recomputation and not without; None elsewhere. Searched over the
    count as the peak falls with each layer recomputed: the next probe where the line through
    the bracket's peaks meets the device memory (near-affine in the count: two probes), halving
    where a side repeats; after a first probe over the memory, the most recomputed count."""
    name = parse_strategy(plain.strategy)
    split, full_name = layer_split(name), str(replace(name, recompute="full"))
    full = next((p for p in plans if p.strategy == full_name), None)
    if (name.recompute != "none" or split is None or full is None or plain.memory.fits
            or not full.memory.fits):
        return None
    counts, memory = split.counts(problem.graph.num_layers), job.mesh.device_memory_bytes
    low, high = -1, len(counts)  # counts[low] fits (-1: full), counts[high] does not (len: plain)
    peaks: dict[int, float] = {low: full.peak_bytes, high: plain.peak_bytes}
    fitting, sides = None, []  # (only the fitting plan is kept: a problem of a large model is large)
    while high - low > 1:
        k = (low + high) // 2
        if low == -1 and sides:  # the first probe is over: is even the most recomputed?
            k = 0
        elif sides[-2:] not in ([True, True], [False, False]) and peaks[high] > peaks[low]:
            k = low + int((memory - peaks[low]) / (peaks[high] - peaks[low]) * (high - low))
            k = min(max(k, low + 1), high - 1)
        baseline = split_baseline(problem, plain.strategy, counts[k])
        plan = baseline and build_plan(baseline.problem, baseline.selection, job, strategy=baseline.name,
                                       advice=False)
        peaks[k] = plan.peak_bytes if plan is not None else peaks[high]
        sides.append(plan is not None and plan.memory.fits)
        low, high, fitting = (k, high, plan) if sides[-1] else (low, k, fitting)
    return fitting
