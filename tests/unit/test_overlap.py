"""Collectives hidden under the compute (``evaluate.hidden_communication``): the frameworks that
run a layer's data-parallel collectives beside the compute (FSDP2, DDP) have them hidden up to
the ops' compute; memshard's runtime only a layer's ZeRO-0 gradient all-reduces; the root's
collectives and Megatron-LM's (no ``--overlap-grad-reduce``) run in line. The ILP prices the
same step time as the evaluator."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memshard
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.problem import comm
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.records import OpGroup, StorageGroup
from memshard.search.formulation import Formulation
from memshard.search.solve import SearchRequest, solve
from tests.unit.test_ilp_pricing import random_plan

JOB = dict(batch=8, seq=2048, precision="mixed")


def overlapped_and_window(plan) -> tuple[float, float, float]:
    """(the layers' overlapped collectives, the root's collectives, the ops' compute) of ``plan``."""
    problem, selection = plan.problem, plan.selection
    layers = root = compute = 0.0
    for group, k in zip(problem.groups, selection.choices):
        choice = group.choices[k]
        if isinstance(group, OpGroup):
            compute += group.instances * choice.compute_s
            continue
        assert isinstance(group, StorageGroup)
        first_use = next(op for op in problem.graph.ops if any(i.tensor == group.params[0] for i in op.inputs))
        layered = first_use.layer is not None
        collectives = group.instances * (choice.time_s - choice.compute_s)
        layers += collectives if layered else 0.0
        root += 0.0 if layered else collectives
        assert choice.overlapped_s == pytest.approx(choice.time_s - choice.compute_s if layered else 0.0)
    return layers, root, compute


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp", "torch-tp2-fsdp4"])
def test_a_frameworks_layer_collectives_hide_under_the_compute(strategy):
    """GPT-3 1.3B on 8: the layers' gathers and reductions are hidden up to the compute, the
    root's are not; the step is the compute, plus the collectives, less what is hidden."""
    plan = memshard.strategy_plan("gpt3-1.3b", "8", strategy, **JOB)
    layers, root, compute = overlapped_and_window(plan)
    assert layers > 0 and root > 0
    assert plan.hidden_communication_s == pytest.approx(min(layers, compute))
    assert plan.hidden_communication_s < plan.communication_time_s
    assert plan.step_time_s == pytest.approx(plan.compute_time_s + plan.communication_time_s
                                             - plan.hidden_communication_s)


@pytest.mark.parametrize("strategy", ["megatron-tp2-dp4", "zero1", "zero2", "zero3-fsdp"])
def test_megatron_and_memshards_zero_1_to_3_run_every_collective_in_line(strategy):
    """Megatron-LM without ``--overlap-grad-reduce``; memshard's runtime under ZeRO-1, 2, 3."""
    plan = memshard.strategy_plan("gpt3-1.3b", "8", strategy, **JOB)
    assert plan.hidden_communication_s == 0
    assert plan.step_time_s == pytest.approx(plan.compute_time_s + plan.communication_time_s)


def in_a_layer(problem, group: StorageGroup) -> bool:
    """Whether the group's parameter is first used in a layer (not the root)."""
    return next(op for op in problem.graph.ops if any(i.tensor == group.params[0] for i in op.inputs)).layer is not None


def test_memshards_runtime_overlaps_only_a_layers_zero_0_all_reduces():
    """memshard's problem: every choice of a layer weight at ZeRO-0 overlaps its gradient
    all-reduces (all its collectives), any other stage nothing, the root's weights nothing;
    under data parallelism the step hides them up to the compute."""
    problem = build_problem(build_graph("gpt3-1.3b", batch=8, seq=2048, num_layers=2), parse_mesh("2x4"))
    assert problem.overlaps
    seen = set()
    for group in problem.groups:
        if not isinstance(group, StorageGroup):
            continue
        for choice, (_, option) in zip(group.choices, group.options):
            reduces = comm.total_time(choice.calls, problem.mesh)
            if option.stage == 0 and in_a_layer(problem, group):
                assert all(c.kind == comm.ALL_REDUCE for c in choice.calls)
                assert choice.overlapped_s == pytest.approx(reduces)
                seen.add("layer, ZeRO-0" if reduces else "layer, nothing to reduce")
            else:
                assert choice.overlapped_s == 0
                seen.add(("layer" if in_a_layer(problem, group) else "root") + (", collectives" if reduces else ""))
    assert {"layer, ZeRO-0", "layer, collectives", "root, collectives"} <= seen
    plan = memshard.strategy_plan("gpt3-1.3b", "8", "dp", **JOB)
    layers, root, compute = overlapped_and_window(plan)
    assert layers > 0 and root > 0
    assert plan.hidden_communication_s == pytest.approx(min(layers, compute))
    assert plan.step_time_s == pytest.approx(plan.compute_time_s + plan.communication_time_s
                                             - plan.hidden_communication_s)


def test_the_hidden_collectives_are_at_most_the_compute():
    """A tiny model on slow links: the gathers outlast the compute, which hides its own length."""
    mesh = parse_mesh("8").with_links((1e8,))
    plan = memshard.strategy_plan("tiny-gpt", mesh, "fsdp2", batch=8)
    layers, _, compute = overlapped_and_window(plan)
    assert layers > compute > 0
    assert plan.hidden_communication_s == pytest.approx(compute)


@pytest.mark.parametrize("framework", ["megatron", "memshard"])
def test_the_exposed_column_is_there_only_where_the_framework_overlaps(framework):
    """Megatron-LM's problems (no ``--overlap-grad-reduce``): the ILP is the one without
    overlap; memshard's: with it (its runtime overlaps ZeRO-0 all-reduces)."""
    problem = build_problem(build_graph("tiny-gpt", batch=8), parse_mesh("4"), framework=framework)
    formulation = Formulation(problem)
    formulation.add_plan_constraints(problem.candidate_points)
    overlaps = framework == "memshard"
    assert (formulation.exposed is not None) == overlaps
    assert any(tag.family == "overlap" for tag in formulation.model.tags) == overlaps


@functools.cache
def _framework_problem(framework: str, mesh: str):
    return build_problem(build_graph("tiny-llama", batch=8, precision="fp32"), parse_mesh(mesh),
                         framework=framework)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(framework=st.sampled_from(["fsdp2", "ddp", "memshard"]), mesh=st.sampled_from(["4", "2x2"]),
       seed=st.integers(0, 2**32 - 1))
def test_the_ilp_prices_a_plans_step_time_with_overlap_as_the_evaluator(framework, mesh, seed):
    """Any plan pinned in the ILP of a framework that overlaps: the fastest plan's proved bound
    is its step time, as the evaluator prices it."""
    problem = _framework_problem(framework, mesh)
    plan = random_plan(problem, random.Random(seed))
    forced = solve(SearchRequest(problem, "time", fixed=plan, mip_gap=0.0, memory_budget_bytes=float("inf")))
    assert forced.selection == plan
    assert forced.bound == pytest.approx(evaluate(problem, plan).step_time_s, rel=1e-6)
