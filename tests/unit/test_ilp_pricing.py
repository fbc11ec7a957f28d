"""The ILP prices any complete plan exactly as the evaluator does: random op strategies,
storage options (ZeRO stages) and keep flags, every choice pinned, ILP peak = evaluated peak.
(The evaluator is the one checked against MemTracker; the ILP's linearisation — shared
variables, holder counting, reshard rows — must agree with it at every integral point.)"""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.records import OpGroup, Selection
from memshard.search.solve import SearchRequest, solve, solve_fixed


@functools.cache
def _problem(model: str, mesh: str, shared: bool):
    graph = build_graph(model, batch=8, precision="fp32")
    return build_problem(graph, parse_mesh(mesh), shared_layers=shared)


def random_plan(problem, rng: random.Random) -> Selection:
    """Any plan the links allow: groups drawn in order, each among the choices its links to
    groups already drawn leave (tied weights, a parameter's storage and its gradient layout)."""
    choices: dict[int, int] = {}
    links = [(lk.a, lk.a_labels, lk.b, lk.b_labels) for lk in problem.links]
    links += [(b, bl, a, al) for a, al, b, bl in links]
    for g in sorted(range(len(problem.groups)), key=lambda g: not isinstance(problem.groups[g], OpGroup)):
        allowed = range(len(problem.groups[g].choices))
        for a, a_labels, b, b_labels in links:
            if b == g and a in choices:
                allowed = [c for c in allowed if b_labels[c] == a_labels[choices[a]]]
        choices[g] = rng.choice(list(allowed))
    sel = Selection(tuple(choices[g] for g in range(len(problem.groups))), (0,) * len(problem.edges))
    keeps = tuple(int(rng.random() < 0.5 and problem.edges[e].can_keep(*problem.edge_layouts(sel, e)[:2]))
                  for e in range(len(problem.edges)))
    return Selection(sel.choices, keeps)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(model=st.sampled_from(["tiny-llama", "tiny-gpt"]), mesh=st.sampled_from(["4", "2x2"]),
       shared=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_ilp_prices_random_plans_as_the_evaluator(model, mesh, shared, seed):
    problem = _problem(model, mesh, shared)
    plan = random_plan(problem, random.Random(seed))
    forced = solve(SearchRequest(problem, "memory", fixed=plan, mip_gap=0.0))
    assert forced.selection == plan
    assert forced.ilp_peak_bytes == pytest.approx(evaluate(problem, plan).peak_bytes, rel=1e-6)


@pytest.mark.parametrize("objective", ["memory", "time"])
def test_plans_pinned_in_turn_on_one_formulation_price_as_each_alone(objective):
    """``solve_fixed`` (one formulation, pinned to each plan in turn) returns what ``solve``
    returns for each plan alone: the same plan, ILP peak, bound and model size."""
    problem = _problem("tiny-gpt", "2x2", True)
    rng = random.Random(1)
    plans = [random_plan(problem, rng) for _ in range(3)]
    assert len(set(plans)) == 3
    request = SearchRequest(problem, objective, mip_gap=0.0, memory_budget_bytes=float("inf"))
    for plan, together in zip(plans, solve_fixed(request, plans), strict=True):
        alone = solve(SearchRequest(problem, objective, fixed=plan, mip_gap=0.0, memory_budget_bytes=float("inf")))
        assert together.selection == alone.selection == plan
        assert (together.status, together.ilp_peak_bytes, together.bound) == (alone.status, alone.ilp_peak_bytes,
                                                                              alone.bound)
        assert (together.variables, together.constraints) == (alone.variables, alone.constraints)
