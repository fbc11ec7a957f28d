"""The least-memory search of a pipeline stage's rank: a middle stage of GPT and LLaMA solves;
holding more micro-batches never needs less memory, and makes the search recompute at least
as much (a later stage, holding fewer, recomputes less: AdaPipe's observation)."""

from __future__ import annotations

import functools

import pytest

from memshard.core.graph import RECEIVE
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.records import PipelineStage
from memshard.search.solve import SearchRequest, solve


@functools.cache
def _least_memory(model: str, layers: tuple[int, int], held: int, recompute: str = "none"):
    graph = build_graph(model, batch=8, precision="fp32", num_layers=4)
    problem = build_problem(graph, parse_mesh("4"), micro_batches=4, recompute=recompute,
                            stage=PipelineStage(*layers, held))
    result = solve(SearchRequest(problem, "memory", mip_gap=0.0, time_limit_s=120))
    return problem, result, evaluate(problem, result.selection)


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama"])
def test_a_middle_stages_least_memory_plan_solves(model):
    problem, result, ev = _least_memory(model, (1, 3), 2)
    assert result.status == "optimal"
    assert result.ilp_peak_bytes == pytest.approx(ev.peak_bytes, rel=1e-6)
    assert {op.name.split(".")[1] for op in problem.graph.ops if op.kind != RECEIVE} == {"1", "2"}


def test_holding_more_micro_batches_needs_no_less_memory():
    _, _, one = _least_memory("tiny-gpt", (1, 3), 1)
    _, _, four = _least_memory("tiny-gpt", (1, 3), 4)
    assert one.boundary_activation_bytes > 0
    assert four.peak_bytes >= one.peak_bytes


def _recomputed(problem, selection) -> int:
    return sum(problem.groups[g].instances for g in range(len(problem.groups)) if problem.replayed(selection, g))


def test_holding_more_micro_batches_recomputes_at_least_as_much():
    """One layer's stage: its replay runs as its backward begins, so with one micro-batch held
    recomputing saves nothing at the peak and the search (step time its tie-break) replays
    nothing; micro-batches waiting hold what the forward kept, which replaying shrinks."""
    found = [_least_memory("tiny-gpt", (1, 2), held, "auto") for held in (1, 2, 4)]
    counts = [_recomputed(problem, result.selection) for problem, result, _ in found]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    (_, one, _), (four_problem, _, four) = found[0], found[-1]
    assert evaluate(four_problem, one.selection).peak_bytes > four.peak_bytes
