"""Gradient accumulation: a step runs K micro-batches of one graph and one update."""

from __future__ import annotations

import pytest

import memshard
from memshard.core.errors import MemshardError
from memshard.core.mesh import make_mesh
from memshard.models import build_graph
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.records import OpGroup, StorageGroup, complete_selection


def _replicated(problem):
    return complete_selection(problem, {g: 0 for g, grp in enumerate(problem.groups) if isinstance(grp, OpGroup)})


def test_accumulated_gradients_are_live_from_the_first_forward_and_compute_scales():
    graph = build_graph("gpt2", batch=2, seq=16, num_layers=2, hidden=32, heads=2, vocab=64, ffn=64)
    one = build_problem(graph, make_mesh((1,)), shared_layers=False, micro_batches=1)
    four = build_problem(graph, make_mesh((1,)), shared_layers=False, micro_batches=4)
    a, b = evaluate(one, _replicated(one)), evaluate(four, _replicated(four))
    grad_bytes = graph.num_parameters * graph.precision.grad_bytes  # Ψ · 2 B, all on one device
    # Before the first backward, one micro-batch holds no gradients; with accumulation the
    # previous micro-batches' gradients are there.
    assert b.live_bytes[0] - a.live_bytes[0] == grad_bytes
    # After the last backward (the optimizer step) both hold exactly the same.
    assert b.live_bytes[-1] == a.live_bytes[-1]
    # Every op runs per micro-batch, the optimizer step once per step.
    selection = _replicated(one)
    optimizer = sum(g.instances * g.choices[k].compute_s for g, k in zip(one.groups, selection.choices)
                    if isinstance(g, StorageGroup))
    assert optimizer > 0
    assert b.compute_time_s == pytest.approx(4 * (a.compute_time_s - optimizer) + optimizer)


def test_data_parallel_gradients_are_reduced_once_per_step():
    # Data parallel over 4 devices, no ZeRO: one all-reduce of every gradient per step,
    # 2(m−1)/m · Ψ · 2 B on the wire, however many micro-batches.
    graph = build_graph("gpt2", batch=4, seq=16, num_layers=1, hidden=32, heads=2, vocab=64, ffn=64)
    for k in (1, 3):
        problem = build_problem(graph, make_mesh((4,)), shared_layers=False, micro_batches=k)
        strategies = {}
        for g, grp in enumerate(problem.groups):
            if isinstance(grp, OpGroup):
                strategies[g] = next(i for i, s in enumerate(grp.strategies) if s.assignment == ("b",))
        ev = evaluate(problem, complete_selection(problem, strategies))
        reduce = ev.communication_by_kind["all_reduce"]
        grad_wire = 2 * 3 / 4 * graph.num_parameters * graph.precision.grad_bytes
        # the only other all-reduces would be statistics of split reduced dims: none here
        assert reduce["wire_bytes"] == pytest.approx(grad_wire)


def test_batch_must_split_into_micro_batches():
    with pytest.raises(MemshardError, match="micro-batches"):
        memshard.plan("gpt2", "2x2", batch=6, micro_batches=4, num_layers=1)
