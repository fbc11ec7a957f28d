"""The generic enumerator: named dims → every way to split them over the mesh axes.

The op under test is a linear ``x[b,s,h] · w[h,f] → y[b,s,f]``; its dims in first-appearance
order are b, s, h, f, and h is contracted. Expected counts and layouts are worked out by hand.
"""

from __future__ import annotations

import itertools

import pytest

from memshard.core.graph import MIXED, Graph, Op, Operand, TensorKind, TensorSpec
from memshard.core.mesh import parse_mesh
from memshard.core.placement import PARTIAL, REPLICATE, Shard, parse_layout
from memshard.problem.strategies import compute_split, enumerate_strategies, grad_layout

R, P = REPLICATE, PARTIAL


def linear_graph(b=8, s=8, h=8, f=8, unsplittable=()) -> tuple[Graph, Op]:
    tensors = {
        "x": TensorSpec("x", (b, s, h), 2, TensorKind.INPUT),
        "w": TensorSpec("w", (h, f), 2, TensorKind.PARAMETER),
        "y": TensorSpec("y", (b, s, f), 2, TensorKind.ACTIVATION),
    }
    op = Op(
        "lin", "linear", (Operand("x", ("b", "s", "h")), Operand("w", ("h", "f"))),
        Operand("y", ("b", "s", "f")), unsplittable_dims=unsplittable, saves_inputs=(0,),
    )
    return Graph("lin", tensors, (op,), "y", precision=MIXED), op


def by_assignment(graph, op, mesh):
    return {s.assignment: s for s in enumerate_strategies(graph, op, mesh)}


def test_count_all_divisible():
    graph, op = linear_graph()
    strategies = enumerate_strategies(graph, op, parse_mesh("2x4"))
    # each of the 2 axes takes one of 4 dims or none: 5·5; every dim (8) survives 2·4 = 8
    assert len(strategies) == (4 + 1) ** 2
    assignments = {s.assignment for s in strategies}
    assert assignments == set(itertools.product([None, "b", "s", "h", "f"], repeat=2))
    # deterministic order: none first
    assert strategies[0].assignment == (None, None)


def test_count_one_and_three_axes():
    graph, op = linear_graph()
    assert len(enumerate_strategies(graph, op, parse_mesh("4"))) == 5
    # 2x2x2: 5³ assignments, but a dim of 8 over all three axes (8 → 4 → 2 → 1) still fits
    assert len(enumerate_strategies(graph, op, parse_mesh("2x2x2"))) == 125


@pytest.mark.parametrize(
    "assignment, x, w, y",
    [
        ((None, None), "RR", "RR", "RR"),
        (("b", None), "S(0)R", "RR", "S(0)R"),
        ((None, "h"), "RS(2)", "RS(0)", "RP"),  # contracted h → partial output
        (("h", "f"), "S(2)R", "S(0)S(1)", "PS(2)"),
        (("b", "f"), "S(0)R", "RS(1)", "S(0)S(2)"),
        (("s", "b"), "S(1)S(0)", "RR", "S(1)S(0)"),
        (("f", None), "RR", "S(1)R", "S(2)R"),  # weight takes Shard on its own dim index
        (("b", "b"), "S(0)S(0)", "RR", "S(0)S(0)"),
        (("h", "h"), "S(2)S(2)", "S(0)S(0)", "PP"),
    ],
)
def test_layouts(assignment, x, w, y):
    graph, op = linear_graph()
    s = by_assignment(graph, op, parse_mesh("2x4"))[assignment]
    assert s.input_layouts == (parse_layout(x), parse_layout(w))
    assert s.output_layout == parse_layout(y)


def test_local_sizes_and_work_split():
    graph, op = linear_graph(b=8, s=16, h=32, f=64)
    mesh = parse_mesh("2x4")
    table = by_assignment(graph, op, mesh)
    s = table[("b", "f")]
    assert s.local_sizes == {"b": 4, "s": 16, "h": 32, "f": 16}
    assert compute_split(s, mesh) == 8
    # b over both axes: 8 → 4 → 1
    s = table[("b", "b")]
    assert s.local_sizes == {"b": 1, "s": 16, "h": 32, "f": 64}
    # an unused axis repeats the work
    assert compute_split(table[("h", None)], mesh) == 2
    assert compute_split(table[(None, None)], mesh) == 1
    assert table[("h", None)].name() == "h-"


def test_dim_too_small_is_skipped():
    # b = 3: it can go to the axis of 2 (pieces 2, 1) but not to the axis of 4
    graph, op = linear_graph(b=3)
    table = by_assignment(graph, op, parse_mesh("2x4"))
    assert len(table) == 25 - 5
    assert not any(a[1] == "b" for a in table)
    assert ("b", None) in table and table[("b", None)].local_sizes["b"] == 2
    # b = 4 fits the axis of 4, but not both axes (4 → 2, then 2 over 4)
    graph, op = linear_graph(b=4)
    table = by_assignment(graph, op, parse_mesh("2x4"))
    assert len(table) == 24
    assert (None, "b") in table and ("b", "b") not in table


def test_several_small_dims():
    # b = 1 cannot be split at all and s = 2 only over the axis of 2, so axis 0 takes
    # none/s/h/f and axis 1 none/h/f: 4·3 = 12 (h = f = 8 fit over both axes).
    graph, op = linear_graph(b=1, s=2)
    table = by_assignment(graph, op, parse_mesh("2x4"))
    assert set(table) == set(itertools.product([None, "s", "h", "f"], [None, "h", "f"]))


def test_axes_of_size_one_are_never_assigned():
    graph, op = linear_graph()
    strategies = enumerate_strategies(graph, op, parse_mesh("1x4"))
    assert len(strategies) == 5
    assert all(s.assignment[0] is None for s in strategies)
    # one device: a single strategy, everything replicated
    only = enumerate_strategies(graph, op, parse_mesh("1"))
    assert len(only) == 1 and only[0].output_layout == (R,)


def test_unsplittable_dims():
    graph, op = linear_graph(unsplittable=("h",))
    table = by_assignment(graph, op, parse_mesh("2x4"))
    assert len(table) == 4 * 4
    assert not any("h" in a for a in table)
    # the output is then never partial
    assert not any(P in s.output_layout for s in table.values())


def test_grad_layout_of_the_weight():
    graph, op = linear_graph()
    table = by_assignment(graph, op, parse_mesh("2x4"))
    # op split along b (a dim w lacks) → w's gradient is a partial sum over axis 0
    assert grad_layout(op, 1, table[("b", "f")]) == ("P", "S1")
    assert grad_layout(op, 1, table[(None, "h")]) == ("R", "S0")
    assert grad_layout(op, 1, table[("s", "b")]) == ("P", "P")
    assert grad_layout(op, 1, table[(None, None)]) == ("R", "R")
    # and of the activation input: split along f (x lacks it) → partial
    assert grad_layout(op, 0, table[("b", "f")]) == ("S0", "P")
    assert grad_layout(op, 0, table[("h", "s")]) == ("S2", "S1")


def test_reduced_dim_is_not_contracted():
    # a norm over h: splitting h leaves a sharded (not partial) output
    tensors = {
        "x": TensorSpec("x", (8, 8), 2, TensorKind.INPUT),
        "y": TensorSpec("y", (8, 8), 2, TensorKind.ACTIVATION),
    }
    op = Op("ln", "layernorm", (Operand("x", ("t", "h")),), Operand("y", ("t", "h")),
            reduced_dims=("h",), stats_per_row=2)
    graph = Graph("ln", tensors, (op,), "y")
    table = by_assignment(graph, op, parse_mesh("2x4"))
    assert len(table) == 9
    assert table[("h", None)].output_layout == (Shard(1), R)
    # a contracted dim instead (a sum over h) gives a partial output
    op2 = Op("sum", "sum", (Operand("x", ("t", "h")),), Operand("y2", ("t",)))
    tensors["y2"] = TensorSpec("y2", (8,), 4, TensorKind.ACTIVATION)
    graph2 = Graph("sum", tensors, (op2,), "y2")
    table2 = by_assignment(graph2, op2, parse_mesh("2x4"))
    assert table2[("h", None)].output_layout == (P, R)
