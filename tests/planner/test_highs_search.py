"""The HiGHS search's primal heuristics on small hand-made ILPs whose optima are known, its
time limits, and searches out of time; what the search did is read from its stage record
(``search/stages.py``)."""

from __future__ import annotations

import itertools
import threading
import time

import highspy
import numpy as np
import pytest

from memshard.baselines.recipes import baselines, run_by_memshard
from memshard.core.errors import NoBetterPlan, SolverTimeLimit
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.search import highs as highs_module
from memshard.search import solve as solve_module
from memshard.search.formulation import Formulation
from memshard.search.highs import (
    ROWS_NEEDED,
    HighsSearch,
    SearchLimits,
    relative_gap,
    value_of,
)
from memshard.search.model import LinearModel, RowTag
from memshard.search.passes import Objectives, PassRules, first_pass
from memshard.search.reference import reference
from memshard.search.solve import SearchRequest, relaxed_floor, second_pass_cap, solve
from memshard.search.stages import MEMORY, TimeOut

NO_BRANCHES = SearchLimits(dive_branches=0)  # a dive that only rounds its relaxation


def stage_names(result) -> list[str]:
    return [stage.name for stage in result.stages]


def odd_cycle(groups: int = 3):
    """``groups`` choices of three options each (0 free, 1 costs 1, 2 costs 10), and no two
    groups both at option 0: the relaxation puts every group half at 0 and half at 1 (cost
    groups / 2), its rounding (each group at its largest share, ties to the first option)
    breaks every conflict, and the best plan takes option 0 once and 1 elsewhere."""
    model = LinearModel()
    columns = [model.columns(3, integer=True) for _ in range(groups)]
    for g, cols in enumerate(columns):
        model.row({int(c): 1.0 for c in cols}, 1.0, 1.0, RowTag("choice", str(g)))
    for a, b in itertools.combinations(range(groups), 2):
        model.row({int(columns[a][0]): 1.0, int(columns[b][0]): 1.0}, -np.inf, 1.0, RowTag("conflict", f"{a},{b}"))
    disjunctions = [tuple((int(c), 1.0) for c in cols) for cols in columns]
    objective = (np.concatenate([cols[1:] for cols in columns]), np.tile([1.0, 10.0], groups))
    return model, disjunctions, objective, columns


def relaxation(search: HighsSearch) -> np.ndarray:
    with search.relaxing("simplex") as highs:
        highs.run()
        return np.array(highs.getSolution().col_value)


def test_the_search_within_the_relaxations_support_finds_the_plan_its_rounding_breaks():
    model, disjunctions, objective, columns = odd_cycle()
    search = HighsSearch(model, time.perf_counter() + 60, disjunctions)
    search.set_objective(objective)
    x = relaxation(search)
    assert np.allclose(x[[c for cols in columns for c in cols[:2]]], 0.5)
    with search.relaxing("simplex"):
        assert search.round_relaxation(x) is None
        values, value = search.search_within_support(x, 0.0)
    assert value == 2.0
    chosen = [int(np.argmax(values[cols])) for cols in columns]
    assert sorted(chosen) == [0, 1, 1]  # option 2 has no share in the relaxation: never taken
    # the model is as it was: every column free again, the relaxation unchanged
    assert np.allclose(relaxation(search), x)


def test_a_dive_whose_rounding_breaks_a_row_has_the_supports_plan_before_any_branch():
    model, disjunctions, objective, _ = odd_cycle(5)
    search = HighsSearch(model, time.perf_counter() + 60, disjunctions, NO_BRANCHES)
    search.set_objective(objective)
    dived = search.run_dive(0.0, None)
    assert dived is not None and dived.objective == 4.0 and dived.bound <= 4.0
    support, dive = search.stages.records  # (a stage within another ends first)
    assert support.name == "support search" and support.found == 4.0
    assert dive.name == "dive" and dive.found == 4.0 and dive.stopped == "gap open"


def test_reduced_cost_fixing_pins_only_what_no_better_plan_moves():
    """Five groups, no two at option 0: the relaxation 2.5, the dive's plan 4 (the support's,
    no branches), optimal. Option 2 of every group (cost 10, off the relaxation's support)
    has a reduced cost above 4 − 2.5: pinned at 0, no plan better than 4 takes it; options
    0 and 1 are not pinned. Branch and bound with the pins proves 4 (gap 0), and the model's
    bounds are as they were after it."""
    model, disjunctions, objective, columns = odd_cycle(5)
    # (the relaxation is 37.5% below the plan)
    search = HighsSearch(model, time.perf_counter() + 60, disjunctions, SearchLimits(dive_branches=0, pin_gap=1.0))
    search.set_objective(objective)
    x = relaxation(search)
    dived = search.run_dive(0.0, None)
    assert dived.objective == 4.0 and dived.relaxed == pytest.approx(2.5) and dived.bound < 4.0
    pinned = search.run_reduced_cost_fixing(dived)
    assert sorted(pinned.columns.tolist()) == sorted(int(cols[2]) for cols in columns)
    assert np.all(pinned.values == 0.0) and pinned.bound > dived.objective
    (fixing,) = search.stages.named("reduced-cost fixing")
    assert fixing.stopped == "5 columns pinned" and fixing.bound == pinned.bound
    found = search.run_branch_and_bound(0.0, dived.values, pinned)
    assert found.objective == pytest.approx(4.0) and found.gap == 0.0
    assert np.allclose(relaxation(search), x)  # every column free again
    assert search.minimise(objective, 0.0).objective == pytest.approx(4.0)  # the same, end to end
    far = HighsSearch(model, time.perf_counter() + 60, disjunctions, SearchLimits(dive_branches=0, pin_gap=0.3))
    assert far.run_reduced_cost_fixing(dived) is None  # a dive this far off pins nothing
    assert not far.stages.named("reduced-cost fixing")  # (the stage did not run)


def partial_start(columns, chosen: list[int]):
    """A plan of ``odd_cycle`` as a partial start (columns, values): group g at ``chosen[g]``."""
    cols = np.array([int(c) for group in columns for c in group])
    return cols, np.array([float(k == chosen[g]) for g, group in enumerate(columns) for k in range(len(group))])


def test_branch_and_bound_starts_from_the_dives_plan_not_a_worse_start_given():
    """Five groups, no two at option 0, the start given costs 40 (option 2 everywhere but
    one): the dive (no branches, its plan the support's, 4) leaves a gap to the relaxation
    (2.5), and branch and bound then starts from the dive's plan (a full solution: its
    objective is recorded), not from the worse start."""
    model, disjunctions, objective, columns = odd_cycle(5)
    # (no pins: branch and bound takes the start as given)
    search = HighsSearch(model, time.perf_counter() + 60, disjunctions, SearchLimits(dive_branches=0, pin_gap=0.0))
    found = search.minimise(objective, 0.0, start=partial_start(columns, [0, 2, 2, 2, 2]))
    assert found.objective == pytest.approx(4.0)
    (branch_and_bound,) = search.stages.named("branch and bound")
    assert branch_and_bound.start == pytest.approx(4.0) and branch_and_bound.found == pytest.approx(4.0)
    assert [stage.name for stage in search.stages.records] == ["support search", "dive", "branch and bound"]


def test_the_start_chosen_is_the_dives_plan_or_the_start_given_completed():
    """``choose_start``: a partial start that costs more than the dive's plan gives way to it;
    one that costs less is completed (its columns as given, the rest solved for) and kept."""
    model, disjunctions, objective, columns = odd_cycle(5)
    search = HighsSearch(model, time.perf_counter() + 60, disjunctions)
    search.set_objective(objective)
    with search.relaxing("simplex"):
        worse, cost = search.solve_completion(*partial_start(columns, [0, 2, 2, 2, 2]))
    assert cost == pytest.approx(40.0)
    dived = highs_module.Dive(worse, 40.0, 2.5)
    cols, values = partial_start(columns, [0, 1, 1, 1, 1])
    better = search.choose_start((cols, values), dived)
    assert value_of(objective, better) == pytest.approx(4.0) and np.allclose(better[cols], values)
    best = highs_module.Dive(better, 4.0, 2.5)
    assert search.choose_start(partial_start(columns, [0, 2, 2, 2, 2]), best) is better
    assert search.choose_start(worse, best) is better  # a full start: the dive had it as incumbent


def first_pass_with_lazy_rows(breaks: list[bool]):
    """``odd_cycle(5)``'s first pass (floor 1; the dive without branches leaves its gap open),
    told in turn by ``breaks`` whether the plans it asks about break rows the model lacks: the
    pass, the names of the stages it ran, and the plans (their costs) it asked about."""
    model, disjunctions, objective, columns = odd_cycle(5)
    tie_break = (np.array([int(group[0]) for group in columns]), np.ones(5))
    search = HighsSearch(model, time.perf_counter() + 60, disjunctions, NO_BRANCHES)
    asked = []

    def needs_rows(values: np.ndarray) -> bool:
        asked.append(value_of(objective, values))
        return breaks[len(asked) - 1]
    found = first_pass(search, Objectives(objective, tie_break, MEMORY, 1.0, (4.0, 1.0)),
                       PassRules(1e-3, needs_rows=needs_rows), None)
    return found, [stage.name for stage in search.stages.records], asked


def test_a_dives_plan_that_breaks_lazy_rows_stops_the_pass_before_branch_and_bound():
    """Where the dive's plan breaks rows the model lacks, the first pass stops there, with
    that plan: no branch and bound or relaxation is spent on a model about to change."""
    needed, stages, asked = first_pass_with_lazy_rows([True])
    assert needed.halted == ROWS_NEEDED and value_of(odd_cycle(5)[2], needed.values) == pytest.approx(4.0)
    assert asked == [pytest.approx(4.0)] and stages == ["support search", "dive"]


def test_a_blended_plan_that_breaks_lazy_rows_is_returned_before_any_proof():
    """The blend's plan (its branch and bound run: the dive's plan broke no row), off its
    floor by more than the gap: where it breaks rows the model lacks, it comes back unproved
    (its gap the floor's), no relaxation spent on it; where it breaks none, the proof follows
    (the relaxation, then the search on the objective alone), to the optimum."""
    unproved, stages, asked = first_pass_with_lazy_rows([False, True])
    assert asked == [pytest.approx(4.0), pytest.approx(unproved.objective)]
    assert stages.count("branch and bound") == 1 and "relaxation" not in stages
    assert not unproved.timed_out and not unproved.ties_resolved and not unproved.halted
    assert unproved.gap == pytest.approx(relative_gap(unproved.objective, 1.0))
    proved, stages, _ = first_pass_with_lazy_rows([False, False])
    assert "relaxation" in stages and proved.objective == pytest.approx(4.0) and proved.gap <= 1e-3
    assert stages.index("relaxation") < len(stages) - 1 - stages[::-1].index("branch and bound")  # then alone


def test_a_search_out_of_time_before_any_plan_returns_the_start_it_was_given():
    """LLaMA-3 8B on 8x8 with recomputation searched: the relaxation alone takes seconds, so
    half a second finds no plan; the search returns the plan it started from, priced, with
    the time limit said (and refuses one that breaks the step-time budget)."""
    graph = build_graph("llama3-8b", batch=64, seq=8192)
    problem = build_problem(graph, parse_mesh("8x8"), recompute="auto")
    (baseline,), _ = baselines(problem, lambda name: name == "megatron-tp8-dp8-sp+full")
    _, start = run_by_memshard(baseline.problem, baseline.selection)  # (its layout without fused GEMMs)
    priced = evaluate(problem, start)
    result = solve(SearchRequest(problem, "memory", time_limit_s=0.5, start=start))
    assert result.status == "time_limit" and result.selection == start
    assert result.ilp_peak_bytes == pytest.approx(priced.peak_bytes)
    assert 0 < result.gap < 1  # against the plan-independent bound: nothing better was proved
    with pytest.raises(SolverTimeLimit):
        solve(SearchRequest(problem, "memory", time_limit_s=0.5, start=start, max_step_time_s=priced.step_time_s / 2))


def test_each_run_gets_the_time_left_on_the_clock_highs_reads():
    """HiGHS compares an LP's time limit with the model's run clock, which adds up every run
    so far, and a branch and bound's with that run's own time: a limit of what is left would
    stop a later LP at once. ``limit_time`` gives each run the time left on its own clock."""
    model, disjunctions, objective, _ = odd_cycle(12)
    search = HighsSearch(model, time.perf_counter() + 60, disjunctions)
    search.set_objective(objective)
    while search.highs.getRunTime() < 0.2:  # runs enough for the run clock to count
        search.highs.clearSolver()
        relaxation(search)
    with search.relaxing("simplex") as highs:
        ran = highs.getRunTime()
        highs.setOptionValue("time_limit", ran / 2)  # less than the run clock: HiGHS stops at once
        highs.clearSolver()
        highs.run()
        assert highs.getModelStatus() == highspy.HighsModelStatus.kTimeLimit
        search.deadline = time.perf_counter() + ran / 2
        search.limit_time()  # the same half, on the run clock
        highs.clearSolver()
        highs.run()
        assert highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
    search.deadline = time.perf_counter() + 60
    search.limit_time()  # a branch and bound's limit: its own run's
    limit = search.highs.getOptionValue("time_limit")  # (status, value) in some highspy versions
    assert (limit[1] if isinstance(limit, tuple) else limit) <= 60
    assert search.run_branch_and_bound(0.0).objective == 11.0


def test_a_branch_and_bound_out_of_time_before_any_bound_proves_nothing():
    """Out of time before its root, HiGHS has a plan (the start) and no bound (its mip_gap
    infinite): the search's gap is then 100%, the bound 0 of every objective here, not 0%."""
    model, disjunctions, objective, columns = odd_cycle(150)  # (11,175 conflict rows)
    search = HighsSearch(model, time.perf_counter() + 60, disjunctions)
    search.set_objective(objective)
    with search.relaxing("simplex"):
        start, cost = search.solve_completion(*partial_start(columns, [0] + [2] * 149))
    search.deadline = time.perf_counter()  # (the least limit HiGHS is given: 1 ms)
    found = search.run_branch_and_bound(0.0, start)
    assert not np.isfinite(search.highs.getInfo().mip_gap)
    assert found.timed_out and found.objective == pytest.approx(cost) and found.gap == 1.0


def test_a_recomputing_search_out_of_time_has_the_peaks_own_bound():
    """With recomputation the zero-redundancy floor lets every replayable tensor go for free
    (here over 5% below the plan): a least-memory search whose branch and bound runs out of
    time (made to, here: ``SearchLimits.time_out``) still has, as its gap, the LP relaxation
    of the peak alone (solved before the branch and bound), which no plan beats (the recipes
    of memshard's own search space checked)."""
    problem = build_problem(build_graph("gpt3-1.3b", batch=8, seq=1024, num_layers=2, precision="mixed"),
                            parse_mesh("8"), recompute="auto")
    out_of_time = SearchLimits(time_out=TimeOut("branch and bound"))
    result = solve(SearchRequest(problem, "memory", time_limit_s=60, limits=out_of_time))
    assert result.status == "time_limit"
    (branch_and_bound,) = [stage for stage in result.stages if stage.name == "branch and bound"]
    assert branch_and_bound.stopped == "time limit, no plan"  # the time out where it was asked for
    (beside,) = [stage for stage in result.stages if stage.name == "relaxation beside"]
    assert beside.stopped == "waited for" and beside.bound == pytest.approx(result.ilp_peak_bytes * (1 - result.gap))
    floor_gap = relative_gap(result.ilp_peak_bytes, reference(problem).least_peak_bytes)
    assert floor_gap > 0.05 and 0 < result.gap < floor_gap / 2
    bound = result.ilp_peak_bytes * (1 - result.gap)
    in_space = [plan for plan in baselines(problem)[0] if plan.problem is problem]  # memshard's own plans
    assert len(in_space) >= 5
    for plan in in_space:
        assert evaluate(problem, plan.selection).peak_bytes >= bound, plan.name


def every_row(problem) -> int:
    """The rows of ``problem``'s least-memory model with every reshard row."""
    formulation = Formulation(problem)
    formulation.add_plan_constraints(problem.candidate_points)
    return formulation.model.num_rows


def test_a_least_memory_plan_the_floor_proves_is_found_by_one_dive_without_reshard_rows():
    """LLaMA-3 8B on 8x8 with recomputation, least memory, ZeRO-3 per layer: the first dive,
    its reshard rows left out, finds a plan the plan-independent floor proves (within 0.02%)
    and that meets every row left out (priced by the evaluator, its peak is the model's):
    no branch and bound, fewer rows than the whole model, and the relaxation of the peak,
    started beside the search, neither waited for nor let run on (it is stopped)."""
    problem = build_problem(build_graph("llama3-8b", batch=64, seq=8192), parse_mesh("8x8"), recompute="auto",
                            zero3_unit="layer")
    branched = []
    result = solve(SearchRequest(problem, "memory", time_limit_s=60, on_branching=lambda: branched.append(True)))
    assert result.status == "optimal" and result.gap <= 2e-4 and not branched
    # one dive, no branch and bound, no lazy rows added; the relaxation beside stopped, never waited for
    assert stage_names(result) == ["dive", "first pass", "relaxation beside"]
    assert result.stages[-1].stopped.startswith("not needed")
    assert result.constraints < every_row(problem)
    assert result.bound == pytest.approx(reference(problem).least_peak_bytes)
    assert evaluate(problem, result.selection).peak_bytes == pytest.approx(result.ilp_peak_bytes, rel=1e-6)


def test_the_fastest_plan_is_proved_by_the_step_times_relaxation_from_the_blends_basis():
    """LLaMA-3 8B's layers (4 of them) on 8x8 A100s with recomputation, the fastest plan within
    80 GiB: the blend's bound proves it only to w·(budget − M); the step time's own
    relaxation, by dual simplex from the blend's basis, proves it without an interior-point
    run. (The path does not depend on the layer count: all 32 take it too, in thirty times
    as long.)"""
    problem = build_problem(build_graph("llama3-8b", batch=64, seq=8192, num_layers=4),
                            parse_mesh("8x8", hardware="a100-80gb"), recompute="auto")
    result = solve(SearchRequest(problem, "time", memory_budget_bytes=80 * 2**30, time_limit_s=60))
    assert result.status == "optimal" and result.gap <= 2e-3
    relaxations = [stage for stage in result.stages if stage.name == "relaxation"]
    assert relaxations and all(stage.stopped == "solved by dual simplex" for stage in relaxations)  # no IPM
    assert all(stage.objective == "time" for stage in relaxations)
    dive = stage_names(result).index("dive")
    assert dive < stage_names(result).index("relaxation")  # the blend's basis first


def test_a_search_given_a_cutoff_its_bound_reaches_finds_no_better_plan():
    """A least-memory search with recomputation given a cutoff above its plan-independent
    floor by more than the gap, which the peak's relaxation reaches (that floor is over 5%
    below the plan, the relaxation not: the test above), stops there, saying so with that
    bound; given one within the gap of its floor it stops at once, before the model is built;
    given one above its optimum it returns the plan it returns without one (after a dive on
    every row: its first dive, with the reshard rows left out, leaves the gap open, and
    ``on_branching`` is called once). ``relaxed_floor`` computes the bound the cutoff is
    checked against, without the search (the floor alone where it is stopped)."""
    problem = build_problem(build_graph("gpt3-1.3b", batch=8, seq=1024, num_layers=2, precision="mixed"),
                            parse_mesh("8"), recompute="auto")
    branched = []
    plain = solve(SearchRequest(problem, "memory", time_limit_s=60, on_branching=lambda: branched.append(True)))
    assert plain.status == "optimal" and 0 < plain.bound <= plain.ilp_peak_bytes
    assert plain.constraints == every_row(problem) and branched == [True]
    assert [stage.stopped for stage in plain.stages if stage.name == "lazy rows"] == ["every reshard row added"]
    floor = reference(problem).least_peak_bytes
    with pytest.raises(NoBetterPlan) as stopped:
        solve(SearchRequest(problem, "memory", time_limit_s=60, cutoff=floor * 1.01))
    assert floor * 1.01 * (1 - 2e-3) <= stopped.value.bound <= plain.bound * (1 + 1e-6)
    assert relaxed_floor(problem, reference(problem), time.perf_counter() + 60) == stopped.value.bound
    assert stopped.value.by == "the search's bound"
    stop = threading.Event()
    stop.set()
    assert relaxed_floor(problem, reference(problem), time.perf_counter() + 60, stop=stop) == floor
    with pytest.raises(NoBetterPlan) as at_once:
        solve(SearchRequest(problem, "memory", time_limit_s=60, cutoff=floor * 1.001))
    assert at_once.value.bound == pytest.approx(floor) and at_once.value.by == "the plan-independent floor"
    above = solve(SearchRequest(problem, "memory", time_limit_s=60, cutoff=plain.ilp_peak_bytes * 1.5))
    assert above.selection == plain.selection


def test_a_dives_plan_the_peaks_relaxation_proves_within_the_gap_needs_no_branch_and_bound():
    """GPT-3 1.3B (2 layers) on 8 devices, least memory with recomputation searched, at the
    3% gap a plan's options default to there: the zero-redundancy floor is over 5% below the
    dive's plan, the LP relaxation of the peak (computed beside the search: the same bound as
    ``relaxed_floor`` computes on its own) within 3%, so that plan is returned, proved within
    it, without branch and bound; its bound holds for the recipes of memshard's own search
    space. The tie-break pass after it runs its dive alone (no branch and bound either) and
    holds the peak within TIE_SLACK of the bound or at the plan found (the gap is slack to
    prove, not to trade memory for time)."""
    problem = build_problem(build_graph("gpt3-1.3b", batch=8, seq=1024, num_layers=2, precision="mixed"),
                            parse_mesh("8"), recompute="auto")
    result = solve(SearchRequest(problem, "memory", time_limit_s=60, mip_gap=0.03))
    assert result.status == "optimal" and 2e-3 < result.gap <= 0.03
    names = stage_names(result)
    assert "branch and bound" not in names and names.count("tie-break pass") == 1
    first = [stage for stage in result.stages if stage.name == "first pass"][-1]
    assert first.stopped == "dive proved by the relaxation"
    assert "waited for" in [stage.stopped for stage in result.stages if stage.name == "relaxation beside"]
    floor = reference(problem).least_peak_bytes
    assert relative_gap(result.ilp_peak_bytes, floor) > 0.05
    assert result.bound == pytest.approx(relaxed_floor(problem, reference(problem), time.perf_counter() + 60),
                                         rel=1e-9)
    for plan in (plan for plan in baselines(problem)[0] if plan.problem is problem):
        assert evaluate(problem, plan.selection).peak_bytes >= result.bound, plan.name
    best, lower = first.found, first.bound  # (bytes: the record's figures are scaled)
    assert best == pytest.approx(result.ilp_peak_bytes)
    assert lower < best * (1 - solve_module.TIE_SLACK)  # (so the cap is the plan's own peak)
    assert evaluate(problem, result.selection).peak_bytes <= second_pass_cap(best, lower, solve_module.TIE_SLACK) * (1 + 1e-6)


def test_the_tie_break_pass_dives_again():
    """tiny LLaMA on 2 devices, the least memory: the first pass's dive leaves its gap open (the
    model's later runs then skip the dive), and its plan's ties are not shown resolved; the
    tie-break pass dives again, and returns a plan no slower than the first pass's, its peak
    within the cap the first pass's bound sets. (The path does not depend on the mesh's size:
    one axis of 2 takes it as 2x2 does, in a fraction of the time.)"""
    problem = build_problem(build_graph("tiny-llama", batch=4, seq=32), parse_mesh("2"))
    result = solve(SearchRequest(problem, "memory", time_limit_s=120))
    names = stage_names(result)
    assert result.status == "optimal" and names.count("tie-break pass") == 1
    rounds = [k for k, name in enumerate(names) if name == "first pass"]
    first, before = rounds[-1], (rounds[-2] if len(rounds) > 1 else -1)  # the last round of the first pass
    assert ("dive", "gap open") in [(stage.name, stage.stopped) for stage in result.stages[before + 1:first]]
    assert "dive" in names[first:names.index("tie-break pass")]  # a dive in the tie-break pass
    tie_break = result.stages[names.index("tie-break pass")]
    priced = evaluate(problem, result.selection)
    assert tie_break.objective == "time" and tie_break.start is not None  # the first pass's plan's step time
    assert priced.step_time_s <= tie_break.start * (1 + 1e-6)
    best, lower = result.stages[first].found, result.stages[first].bound
    assert priced.peak_bytes <= second_pass_cap(best, lower, 2e-3) * (1 + 1e-6)


def test_on_a_model_of_tie_break_nonzeros_the_tie_break_pass_runs_its_dive_alone(monkeypatch):
    """The same search with every model at TIE_BREAK_NONZEROS (0): the tie-break pass dives
    and runs no branch and bound, and its plan (the dive's, or the first pass's where the dive
    finds none better) is no slower than the first pass's, its peak within the cap the first
    pass's bound sets; the result stays optimal (the peak, its primary objective, proved)."""
    monkeypatch.setattr(solve_module, "TIE_BREAK_NONZEROS", 0)
    problem = build_problem(build_graph("tiny-llama", batch=4, seq=32), parse_mesh("2"))
    result = solve(SearchRequest(problem, "memory", time_limit_s=120))
    names = stage_names(result)
    first = len(names) - 1 - names[::-1].index("first pass")  # the first pass's last round
    after = names[first + 1:]
    assert "tie-break pass" in after and "dive" in after and "branch and bound" not in after
    tie_break = result.stages[names.index("tie-break pass")]
    assert tie_break.stopped in ("dive alone", "dive unsettled: the first pass's plan stands",
                                 "no better plan: the first pass's plan stands")
    priced = evaluate(problem, result.selection)
    assert result.status == "optimal" and priced.step_time_s <= tie_break.start * (1 + 1e-6)
    best, lower = result.stages[first].found, result.stages[first].bound
    assert priced.peak_bytes <= second_pass_cap(best, lower, 2e-3) * (1 + 1e-6)


def test_a_search_out_of_time_after_its_dives_plan_needed_rows_returns_that_plan():
    """tiny-gpt on 2x2 (batch 8, gap 5%, as the runtime tests plan it): the first dive's plan
    breaks reshard rows left out, so they are added before any branch and bound; where time
    then runs out (made to, as the second round of the first pass starts), the search returns
    that plan, priced, with its gap to the floor (not the infinite gap of no bound)."""
    problem = build_problem(build_graph("tiny-gpt", batch=8), parse_mesh("2x2"))
    out_of_time = SearchLimits(time_out=TimeOut("first pass", run=1))
    result = solve(SearchRequest(problem, "memory", mip_gap=0.05, limits=out_of_time))
    assert result.status == "time_limit"
    rows, breaks, out = [stage for stage in result.stages if stage.name in ("first pass", "lazy rows")]
    assert rows.name == "lazy rows" and rows.stopped.startswith("rows of")  # some points', not every row
    assert (breaks.name, breaks.stopped) == ("first pass", "dive's plan breaks lazy rows")
    assert (out.name, out.stopped) == ("first pass", "time limit, no plan")
    assert "branch and bound" not in stage_names(result)
    priced = evaluate(problem, result.selection)
    floor = reference(problem).least_peak_bytes
    assert result.gap == pytest.approx(relative_gap(priced.peak_bytes, floor)) and 0 < result.gap < 1
