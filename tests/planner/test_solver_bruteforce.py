"""The ILP's optimum equals brute-force enumeration on small random graphs and meshes,
for both objectives, including the secondary objective that breaks ties."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from memshard.core.graph import FP32, MIXED, Graph, Op, Operand, SavedBuffer, TensorKind, TensorSpec
from memshard.core.mesh import make_mesh
from memshard.problem.bounds import least_choice_bound, peak_lower_bound, zero_redundancy_bound
from memshard.problem.evaluate import evaluate, slot_peak
from memshard.problem.pricing import build_problem
from memshard.search.formulation import Formulation
from memshard.search.highs import TIE_RESOLUTION, HighsSearch
from memshard.search.solve import SearchRequest, solve
from tests.bruteforce import count_selections, evaluate_all

SIZES = st.sampled_from([2, 3, 4, 6, 8])
MESHES = st.sampled_from([(2,), (3,), (4,), (2, 2), (1, 2)])
MAX_PLANS = 3000


@st.composite
def small_graphs(draw):
    precision = draw(st.sampled_from([MIXED, FP32]))
    act = precision.activation_bytes
    dims = {"a": draw(SIZES), "b": draw(SIZES), "c": draw(SIZES)}
    tensors = {
        "x": TensorSpec("x", (dims["a"], dims["b"]), 4, TensorKind.INPUT),
        "labels": TensorSpec("labels", (dims["a"],), 8, TensorKind.INPUT),
        "w0": TensorSpec("w0", (dims["b"], dims["c"]), precision.param_bytes, TensorKind.PARAMETER),
    }
    ops = [Op("proj", "linear", (Operand("x", ("a", "b")), Operand("w0", ("b", "c"))), Operand("t0", ("a", "c")),
              saves_inputs=(0,), flops_per_point=2.0, backward_flops_ratio=2.0)]
    tensors["t0"] = TensorSpec("t0", (dims["a"], dims["c"]), act, TensorKind.ACTIVATION)
    live = ["t0"]
    n_ops = draw(st.integers(1, 2))
    for k in range(1, n_ops + 1):
        kind = draw(st.sampled_from(["gelu", "dropout", "norm", "softmax", "mul", "linear", "scaled_norm"]))
        src = draw(st.sampled_from(live))
        out = f"t{k}"
        tensors[out] = TensorSpec(out, (dims["a"], dims["c"]), act, TensorKind.ACTIVATION)
        io = Operand(src, ("a", "c"))
        if kind == "gelu":
            op = Op(f"op{k}", kind, (io,), Operand(out, ("a", "c")), saves_inputs=(0,))
        elif kind == "dropout":
            op = Op(f"op{k}", kind, (io,), Operand(out, ("a", "c")), buffers=(SavedBuffer(f"m{k}", ("a", "c"), 1),))
        elif kind == "norm":
            op = Op(f"op{k}", "layernorm", (io,), Operand(out, ("a", "c")), reduced_dims=("c",), stats_per_row=2,
                    saves_inputs=(0,))
        elif kind == "softmax":
            op = Op(f"op{k}", kind, (io,), Operand(out, ("a", "c")), reduced_dims=("c",), stats_per_row=2,
                    saves_output=True)
        elif kind == "linear":  # a square weight: the output keeps the tensor shape
            w = f"w{k}"
            tensors[w] = TensorSpec(w, (dims["c"], dims["c"]), precision.param_bytes, TensorKind.PARAMETER)
            op = Op(f"op{k}", kind, (io, Operand(w, ("c", "e"))), Operand(out, ("a", "e")), saves_inputs=(0,),
                    flops_per_point=2.0, backward_flops_ratio=2.0)
        elif kind == "scaled_norm":
            w = f"g{k}"
            tensors[w] = TensorSpec(w, (dims["c"],), precision.param_bytes, TensorKind.PARAMETER)
            op = Op(f"op{k}", "rmsnorm", (io, Operand(w, ("c",))), Operand(out, ("a", "c")), reduced_dims=("c",),
                    stats_per_row=1, saves_inputs=(0,))
        else:
            other = draw(st.sampled_from(live))
            op = Op(f"op{k}", kind, (io, Operand(other, ("a", "c"))), Operand(out, ("a", "c")), saves_inputs=(0, 1))
        ops.append(op)
        live.append(out)
    tensors["loss"] = TensorSpec("loss", (), 4, TensorKind.ACTIVATION)
    ops.append(Op("loss", "cross_entropy", (Operand(live[-1], ("a", "c")), Operand("labels", ("a",))),
                  Operand("loss", ()), reduced_dims=("c",), stats_per_row=3, saves_inputs=(0,)))
    return Graph("random", tensors, tuple(ops), "loss", precision=precision)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(graph=small_graphs(), shape=MESHES, budget_quantile=st.floats(0.2, 0.9))
def test_ilp_matches_brute_force(graph, shape, budget_quantile):
    mesh = make_mesh(shape)
    problem = build_problem(graph, mesh, shared_layers=False)
    assume(count_selections(problem, MAX_PLANS) <= MAX_PLANS)  # small enough to enumerate
    evals = evaluate_all(problem)
    assert evals

    # memory objective: least peak, then least time among the least-peak plans
    min_peak = min(ev.peak_bytes for _, ev in evals)
    # the plan-independent bounds the solver certifies with hold at every point of every plan
    bound = np.maximum(zero_redundancy_bound(problem), least_choice_bound(problem))
    assert all((ev.live_bytes >= bound - 1e-9 * min_peak).all() for _, ev in evals)
    assert peak_lower_bound(problem) <= min_peak * (1 + 1e-12)
    # what a plan's slots alone hold (the quick check a start within a budget is made from) is below its peak
    assert all(slot_peak(problem, selection) <= ev.peak_bytes * (1 + 1e-12) for selection, ev in evals)
    ties = [ev for _, ev in evals if ev.peak_bytes <= min_peak * (1 + 1e-9)]
    min_time_at_min_peak = min(ev.step_time_s for ev in ties)
    result = solve(SearchRequest(problem, "memory", mip_gap=0.0))
    got = evaluate(problem, result.selection)
    # exact up to the slack the second (tie-breaking) pass allows on the first objective
    assert abs(got.peak_bytes - min_peak) <= 2 * TIE_RESOLUTION * min_peak
    assert got.step_time_s <= min_time_at_min_peak * (1 + 2 * TIE_RESOLUTION) + 1e-12

    # at a 5% gap the plan is within 5% of the least peak, and the gap reported is no smaller
    # than the plan's real one (the tie-break pass may spend the slack the bound leaves)
    result = solve(SearchRequest(problem, "memory", mip_gap=0.05))
    got = evaluate(problem, result.selection)
    assert got.peak_bytes <= min_peak / (1 - 0.05) * (1 + 1e-9)
    assert result.gap >= (got.peak_bytes - min_peak) / got.peak_bytes - 1e-6

    # the dive alone (every row): its bound holds and its plan is priced as the evaluator does
    dived = dive(problem)
    if dived is not None:
        plan_peak, bound = dived
        assert bound <= min_peak * (1 + 1e-6)
        assert plan_peak >= min_peak * (1 - 1e-6)

    # time objective under a budget between the least and the largest peak
    peaks = sorted(ev.peak_bytes for _, ev in evals)
    budget = peaks[int(budget_quantile * (len(peaks) - 1))]
    feasible = [ev for _, ev in evals if ev.peak_bytes <= budget]
    min_time = min(ev.step_time_s for ev in feasible)
    result = solve(SearchRequest(problem, "time", memory_budget_bytes=budget, mip_gap=0.0))
    got = evaluate(problem, result.selection)
    assert got.peak_bytes <= budget * (1 + 1e-9)
    assert abs(got.step_time_s - min_time) <= 2 * TIE_RESOLUTION * min_time + 1e-12
    fastest_ties = [ev for ev in feasible if ev.step_time_s <= min_time * (1 + 1e-9) + 1e-15]
    assert got.peak_bytes <= min(ev.peak_bytes for ev in fastest_ties) * (1 + 2 * TIE_RESOLUTION)

    # at a 5% gap the fastest plan is within 5% and its reported gap is no smaller than its real
    # one (the bound a blend gives under the budget, T ≥ B − w·budget, included)
    result = solve(SearchRequest(problem, "time", memory_budget_bytes=budget, mip_gap=0.05))
    got = evaluate(problem, result.selection)
    assert got.peak_bytes <= budget * (1 + 1e-9)
    assert got.step_time_s <= min_time / (1 - 0.05) * (1 + 1e-9) + 1e-12
    assert result.gap >= (got.step_time_s - min_time) / got.step_time_s - 1e-6


def dive(problem):
    """``HighsSearch.run_dive`` on the peak with every row: (its plan's evaluated peak, its bound),
    in bytes, after checking the ILP's M for that plan is its evaluated peak; None if no plan."""
    f = Formulation(problem)
    f.add_plan_constraints(problem.candidate_points)
    search = HighsSearch(f.model, time.perf_counter() + 60, f.disjunctions())
    search.set_objective(f.peak_expression())
    dived = search.run_dive(0.0, None)
    if dived is None:
        return None
    peak = evaluate(problem, f.selection(dived.values)).peak_bytes
    assert dived.objective * f.bytes_unit == pytest.approx(peak, rel=1e-6)
    return peak, dived.bound * f.bytes_unit
