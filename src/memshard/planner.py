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
from memshard.baselines.recipes import (
    as_run_by,
    baselines,
    layer_split,
    priced_as_run,
    split_baseline,
)
from memshard.core.errors import Infeasible, MemshardError, NoBetterPlan, SolverTimeLimit
from memshard.core.mesh import Mesh, mesh_views
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
from memshard.search.stages import MEMORY, TIME, StageRecord, TimeOut, in_scope

MAX_FINITE = sys.float_info.max
DEFAULT_GAP = 2e-3  # the relative optimality gap a search stops at, unless one is given
RECOMPUTE_MEMORY_GAP = 0.03  # and the least-memory search with recomputation (``SearchOptions.gap``)
UNIT_SEARCH = "unit's search"  # the stage of a candidate's search (a ZeRO-3 unit, a view) that found no plan


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
    ``mesh_views``: whether the other views of the devices are searched too
    (``core.mesh.mesh_views``: a node of 8 as 2 × 4; the plan lies on the best), None: for the
    fastest plan (objective time) only: on the least memory a view rarely saves, multiplies
    the search, and under a step-time budget would make the answer depend on the budget's
    presence. ``time_out``: a test knob (``search.stages.TimeOut``): the stage run at which time runs
    out, in each search (``SearchLimits.time_out``), or, for the stage "unit's search", at
    the start or end of the search of that index in ``candidates`` (each view, each ZeRO-3
    unit)."""

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
    mesh_views: bool | None = None
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
        if self.mesh_views not in (None, True, False):
            raise MemshardError(f"mesh_views must be True, False or None, got {self.mesh_views!r}")
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
    def searches_views(self) -> bool:
        """Whether the other views of the devices are searched (``mesh_views``)."""
        return self.objective == "time" if self.mesh_views is None else self.mesh_views

    @property
    def priced_unit(self) -> str:
        """The unit a fixed plan (a baseline) is priced with: the one given, else per op."""
        return self.zero3_unit or "op"


def searched_problem(job: Job, options: SearchOptions, view: Mesh | None = None) -> Problem:
    """The problem the search solves (the first of ``options.zero3_units``): the job's mesh,
    or it with alike axes merged; or ``view``, another view of its devices, as it is."""
    if view is not None:
        return build_problem(job.graph, view, shared_layers=not options.exact, micro_batches=job.micro_batches,
                             zero3_unit=options.zero3_units[0], recompute=options.recompute)
    mesh, groups = job.mesh, merge_groups(job.mesh)
    mergeable = mesh.ndim >= 3 and len(groups) < mesh.ndim
    if options.full_mesh and not mergeable:
        raise MemshardError(f"full_mesh (--full-mesh) changes nothing on mesh {mesh}: no adjacent axes with "
                            "identical links are planned as one there")
    if mergeable and not options.full_mesh:
        mesh = merged_mesh(mesh, groups)
    return build_problem(job.graph, mesh, shared_layers=not options.exact, micro_batches=job.micro_batches,
                         zero3_unit=options.zero3_units[0], recompute=options.recompute)


@dataclass(frozen=True)
class Candidate:
    """One problem of a plan's search: the job on ``view`` (None: its mesh as typed), its
    ZeRO-3 weights gathered per ``unit``."""

    view: Mesh | None
    unit: str

    def problem(self, job: Job, options: SearchOptions) -> Problem:
        return searched_problem(job, replace(options, zero3_unit=self.unit), self.view)


def candidates(job: Job, options: SearchOptions) -> list[Candidate]:
    """The problems a plan of ``job`` is the best of: the mesh as typed and each other view of
    its devices where ``options.searches_views``, those of fewer axes first; each under every
    ZeRO-3 unit searched."""
    views = mesh_views(job.mesh) if options.searches_views else ()
    if options.mesh_views and not views:
        raise MemshardError(f"mesh views (--mesh-views on) change nothing on mesh {job.mesh}: its devices form "
                            "no other axes (docs/search.md, Mesh views)")
    # fewer axes first (the mesh as typed first among alike): a smaller problem, searched sooner,
    # whose plan is the cutoff of the larger ones
    ordered = sorted((None, *views), key=lambda view: (view or job.mesh).ndim)
    return [Candidate(view, unit) for view in ordered for unit in options.zero3_units]


def plan_job(job: Job, options: SearchOptions, start: Plan | None = None, problem: Problem | None = None,
             cutoff: float | None = None) -> Plan:
    """The plan ``options`` ask for (``start``: a plan of the same job the search starts
    from; ``problem``: the searched problem on the mesh as typed, if already built;
    ``cutoff``: where one problem is searched, a figure some other plan reaches: no plan below
    it by the gap raises ``NoBetterPlan``)."""
    searched_ones = candidates(job, options)
    if len(searched_ones) > 1:
        searched, result = _best_of(job, options, searched_ones, start, problem)
    else:
        searched = problem if problem is not None else searched_problem(job, options)
        try:
            result = _search(searched, options, start, cutoff=cutoff)
        except Infeasible:
            raise explain_infeasible([searched], options) from None
    return build_plan(searched, result.selection, job, result=result, budgets=options.budgets, top=options.top,
                      typed_mesh=job.mesh)


def _objective_of(options: SearchOptions, evaluation: Evaluation) -> float:
    return evaluation.peak_bytes if options.objective == "memory" else evaluation.step_time_s


def _floor_of(options: SearchOptions, figures: Reference) -> float:
    """The plan-independent floor of the objective: no plan of the problem is below it."""
    return figures.least_peak_bytes if options.objective == "memory" else figures.time_floor_s


def _best_of(job: Job, options: SearchOptions, searched_ones: list[Candidate], start: Plan | None,
             problem: Problem | None) -> tuple[Problem, SolveResult]:
    """The best plan of ``searched_ones`` (``problem``: that of the first, if built): each
    search after the first stops as soon as its bound reaches the best objective found; the
    plan's gap is against the least of the searches' bounds, its time theirs together. The
    time limit is the searches' together: a candidate reached with no time left is not
    searched, and the bound it has then (its floor, or, for the least memory, the relaxation
    computed beside the search before) is its bound. The next candidate's work runs on a
    thread beside the search before (``_NextCandidate``)."""
    best: tuple[Problem, SolveResult, float] | None = None
    bounds, started, out_of_time = [], time.perf_counter(), None
    stages: list[StageRecord] = []  # every candidate's, in order
    deadline = started + options.time_limit_s
    scope = _scoper(searched_ones, job.mesh)
    with ThreadPoolExecutor(max_workers=1) as pool:
        following: _NextCandidate | None = None
        try:
            for k, candidate in enumerate(searched_ones):
                if following is not None and following.built is not None:
                    (searched, figures), bound = following.built.result(), following.bound()
                else:
                    searched = problem if k == 0 and problem is not None else candidate.problem(job, options)
                    figures, bound = reference(searched), None  # (solve would compute them; the floor serves here too)
                left = deadline - time.perf_counter()
                if k and (left <= 0 or (bound is not None and best is not None
                                        and rules_out(bound, best[2], options.gap))):
                    bounds.append(bound if bound is not None else _floor_of(options, figures))
                    stages.append(_candidate_stage(scope(candidate), options, bounds[-1],
                                                   "no time left" if left <= 0 else "ruled out by its bound"))
                    continue
                following = (_NextCandidate(pool, job, options, searched_ones[k + 1], deadline)
                             if k + 1 < len(searched_ones) else None)
                searched_at = time.perf_counter()
                try:
                    if options.time_out is not None and options.time_out.hits(UNIT_SEARCH, k):
                        raise SolverTimeLimit(options.time_limit_s)  # (a test knob: time runs out here)
                    result = _search(searched, replace(options, time_limit_s=max(left, 1e-3)),
                                     _start_for(start, searched), cutoff=best[2] if best else None, figures=figures,
                                     on_formulated=following and following.build,
                                     on_branching=following.relax if following and options.objective == "memory"
                                     else None)
                    if options.time_out is not None and options.time_out.hits(UNIT_SEARCH, k, at_end=True):
                        deadline = time.perf_counter()  # (a test knob: time runs out as it ends)
                except Infeasible:  # under a budget: no plan of this candidate meets it
                    stages.append(_candidate_stage(scope(candidate), options, None, "infeasible"))
                    continue
                except NoBetterPlan as no_better:
                    bounds.append(no_better.bound)
                    stages.append(_candidate_stage(scope(candidate), options, no_better.bound,
                                                   f"no better plan, by {no_better.by}",
                                                   time.perf_counter() - searched_at))
                    continue
                except SolverTimeLimit:  # no plan of this candidate in time (``start`` may be of another)
                    out_of_time = SolverTimeLimit(options.time_limit_s)
                    bounds.append(_floor_of(options, figures))  # its floor: no plan is below it
                    stages.append(_candidate_stage(scope(candidate), options, bounds[-1], "time limit, no plan"))
                    continue
                bounds.append(result.bound)
                stages.extend(in_scope(result.stages, scope(candidate)))
                result = replace(result, evaluation=_evaluation(searched, result))
                value = _objective_of(options, result.evaluation)
                if best is None or value < best[2]:
                    best = searched, result, value
        finally:
            if following is not None:
                following.stop.set()
    if best is None:
        if out_of_time is not None:
            raise out_of_time
        raise explain_infeasible([problem or searched_problem(job, options)]
                                 + [c.problem(job, options) for c in searched_ones if c.view is not None
                                    and c.unit == searched_ones[0].unit], options)
    searched, result, value = best
    gap = relative_gap(value, min(bounds))
    status = result.status if gap <= max(result.gap, options.gap) else "time_limit"  # another one's gap
    return searched, replace(result, gap=gap, status=status, time_s=time.perf_counter() - started,
                             stages=tuple(stages))


def _scoper(searched_ones: list[Candidate], typed: Mesh) -> Callable[[Candidate], str]:
    """How a candidate's stage records are labelled: by what varies among ``searched_ones``
    (``ZeRO-3 per layer``; ``mesh 2x4``; both)."""
    units = len({c.unit for c in searched_ones}) > 1
    views = len({c.view for c in searched_ones}) > 1

    def scope(candidate: Candidate) -> str:
        parts = [f"mesh {candidate.view or typed}"] if views else []
        return ", ".join(parts + ([f"ZeRO-3 per {candidate.unit}"] if units else []))
    return scope


def _candidate_stage(scope: str, options: SearchOptions, bound: float | None, stopped: str,
                     time_s: float = 0.0) -> StageRecord:
    """The record of a candidate's search that found no plan (``bound``: what it proved;
    ``time_s``: how long it ran)."""
    return StageRecord(UNIT_SEARCH, MEMORY if options.objective == "memory" else TIME, None, bound, time_s, stopped,
                       scope=scope)


class _NextCandidate:
    """The next candidate's work, on a thread beside the search of the one before (HiGHS
    releases the GIL while it solves): its problem and figures, built once that search's
    model is formulated (started earlier, the build would only slow that formulation by as
    much), and, where that search branches (a long one follows) for the least memory, the
    bound the next search would compute first (``relaxed_floor``: on a large recomputing
    least-memory plan, a relaxation that the first candidate's branch and bound leaves the
    second core for). ``stop``: set once the searches end, the relaxation is cut short."""

    def __init__(self, pool: ThreadPoolExecutor, job: Job, options: SearchOptions, candidate: Candidate,
                 deadline: float):
        self.pool, self.job, self.options, self.deadline = pool, job, options, deadline
        self.candidate = candidate
        self.stop = threading.Event()
        self.built: Future | None = None
        self.relaxed: Future | None = None

    def build(self) -> None:
        self.built = self.pool.submit(self.with_figures)

    def with_figures(self) -> tuple[Problem, Reference]:
        """The candidate's problem and its reference figures."""
        searched = self.candidate.problem(self.job, self.options)
        return searched, reference(searched)

    def relax(self) -> None:
        built = self.built
        if built is not None:
            self.relaxed = self.pool.submit(
                lambda: relaxed_floor(*built.result(), self.deadline, self.options.max_step_time_s, self.stop))

    def bound(self) -> float | None:
        """The relaxed floor, once computed (None where the search before did not branch)."""
        return None if self.relaxed is None else self.relaxed.result()


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


def _start_for(start: Plan | None, problem: Problem) -> Plan | None:
    """``start`` where ``problem`` can start from it: not a plan on another view of the same
    devices (a plan of another job is refused by ``_start_selection``)."""
    if start is None:
        return None
    mesh = start.job.mesh
    other_view = mesh.num_devices == problem.mesh.num_devices and mesh != problem.mesh.real
    return None if other_view else start


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


def explain_infeasible(problems: list[Problem], options: SearchOptions) -> MemshardError:
    """Say what the least achievable figure over ``problems`` (the views searched) is, so the
    user knows what to ask for."""
    if options.objective == "time":
        budget = options.memory_budget if options.memory_budget is not None else problems[0].mesh.device_memory_bytes
        least = min((_evaluation(p, solve(SearchRequest(p, "memory", time_limit_s=options.time_limit_s)))
                     for p in problems), key=lambda e: e.peak_bytes)
        hint = ("; recomputing activations needs less (--recompute auto)"
                if options.recompute == "none" and problems[0].graph.num_layers else "")
        return MemshardError(
            f"no plan fits in {format_bytes(budget)} per device: the least any plan needs is "
            f"{format_bytes(least.peak_bytes)} (zero-redundancy bound {format_bytes(least.lower_bound_bytes)}){hint}"
        )
    fastest = min(_evaluation(p, solve(SearchRequest(p, "time", memory_budget_bytes=math.inf,
                                                     time_limit_s=options.time_limit_s))).step_time_s
                  for p in problems)
    return MemshardError(f"no plan runs a step within {format_seconds(options.max_step_time_s)}: "
                         f"the fastest plan takes {format_seconds(fastest)}")


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
    overlapped = priced_as_run(as_run_by(split.problem, MEGATRON_OVERLAP), split.selection, name)  # (its buckets)
    return build_plan(overlapped, split.selection, job, strategy=str(name),
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
