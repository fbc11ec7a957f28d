"""Collectives hidden under the compute (``evaluate.hidden_communication``): the frameworks that
run a layer's data-parallel collectives beside the compute (FSDP2, DDP) have them hidden up to
the ops' compute; memshard's runtime a layer's ZeRO-0 gradient all-reduces, its ZeRO-1
reduce-scatters and its ZeRO-1/2 updated-shard all-gathers (over one axis splitting the weight
evenly); the root's collectives and Megatron-LM's (no ``--overlap-grad-reduce``) run in line.
The ILP prices the same step time as the evaluator."""

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


@pytest.mark.parametrize("strategy", ["megatron-tp2-dp4", "zero3-fsdp"])
def test_megatron_and_memshards_zero_3_run_every_collective_in_line(strategy):
    """Megatron-LM without ``--overlap-grad-reduce``; memshard's runtime under ZeRO-3."""
    plan = memshard.strategy_plan("gpt3-1.3b", "8", strategy, **JOB)
    assert plan.hidden_communication_s == 0
    assert plan.step_time_s == pytest.approx(plan.compute_time_s + plan.communication_time_s)


def in_a_layer(problem, group: StorageGroup) -> bool:
    """Whether the group's parameter is first used in a layer (not the root)."""
    return next(op for op in problem.graph.ops if any(i.tensor == group.params[0] for i in op.inputs)).layer is not None


def _overlapped_by_memshard(option, G, calls, numel: int, mesh_shape) -> tuple:
    """The calls memshard's runtime runs beside the compute (``runtime/stores.py``), from the
    runtime's own conditions: ZeRO-0 all of them; ZeRO-1/2 over one axis that splits the local
    weight evenly its all-gather, ZeRO-1 besides its reductions where partial over that axis."""
    if option.stage == 0:
        return calls
    if option.stage == 3 or len(option.axes) != 1 or numel % mesh_shape[option.axes[0]]:
        return ()
    reduces = option.stage == 1 and G[option.axes[0]] == "P"
    return tuple(c for c in calls if c.kind == comm.ALL_GATHER or reduces)


@pytest.mark.parametrize("mesh", ["2x4", "8"])
def test_memshards_runtime_overlaps_what_it_runs_beside_the_compute(mesh):
    """memshard's problem: a layer weight's choice overlaps exactly the collectives its runtime
    runs beside the compute (``_overlapped_by_memshard``): ZeRO-0 all-reduces, ZeRO-1
    reductions and ZeRO-1/2 gathers over one axis; nothing at ZeRO-3, over two axes, or of the
    root's weights."""
    from memshard.core.placement import local_numel
    from memshard.problem.memory import param_layout

    problem = build_problem(build_graph("gpt3-1.3b", batch=8, seq=2048, num_layers=2), parse_mesh(mesh))
    assert problem.overlaps
    seen = set()
    for group in problem.groups:
        if not isinstance(group, StorageGroup):
            continue
        shape = problem.graph.tensors[group.params[0]].shape
        for choice, (G, option) in zip(group.choices, group.options):
            numel = local_numel(shape, param_layout(G), problem.mesh.shape)
            expected = _overlapped_by_memshard(option, G, choice.calls, numel, problem.mesh.shape)
            if not in_a_layer(problem, group):
                expected = ()
            assert choice.overlapped_s == pytest.approx(comm.total_time(expected, problem.mesh)), (G, option)
            kinds = frozenset(c.kind for c in expected)
            seen.add((option.stage, kinds))
    assert {(0, frozenset({comm.ALL_REDUCE})), (1, frozenset({comm.REDUCE_SCATTER, comm.ALL_GATHER})),
            (2, frozenset({comm.ALL_GATHER})), (3, frozenset())} <= seen
    if mesh == "2x4":  # over both axes: in line
        assert (1, frozenset()) in seen and (2, frozenset()) in seen


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2"])
def test_memshards_data_parallel_plans_hide_their_layer_collectives(strategy):
    """Under data parallelism on 8 (ZeRO over the one axis), the step hides the layers'
    collectives up to the compute (ZeRO-0's all-reduces, ZeRO-1's reduce-scatters and
    gathers, ZeRO-2's gathers); ZeRO-2's reduce-scatters and the root's run in line."""
    plan = memshard.strategy_plan("gpt3-1.3b", "8", strategy, **JOB)
    problem, selection = plan.problem, plan.selection
    overlapped = in_line = compute = 0.0
    for group, k in zip(problem.groups, selection.choices):
        choice = group.choices[k]
        if isinstance(group, OpGroup):
            compute += group.instances * choice.compute_s
            continue
        for call in choice.calls:
            t = group.instances * comm.total_time((call,), problem.mesh)
            beside = in_a_layer(problem, group) and not (strategy == "zero2" and call.kind == comm.REDUCE_SCATTER)
            overlapped += t if beside else 0.0
            in_line += 0.0 if beside else t
    assert overlapped > 0 and in_line > 0
    assert plan.hidden_communication_s == pytest.approx(min(overlapped, compute))
    assert plan.step_time_s == pytest.approx(plan.compute_time_s + plan.communication_time_s
                                             - plan.hidden_communication_s)


def test_a_zero_1_reduction_beside_the_backward_holds_its_shard_from_its_start():
    """ZeRO-1 on 8 under memshard's runtime: each reduce-scatter's shard is held from the
    weight's reduction to the backward's end, beside the whole gradient. At the backward's last
    point the plan holds ZeRO-0's (dp's) gradients plus one shard of every weight (ceil of
    its elements over 8, in the gradient's dtype); at the first backward point, before any
    weight is reduced, the same as dp."""
    from memshard.problem.evaluate import evaluate

    zero1, dp = (memshard.strategy_plan("tiny-gpt", "8", s, batch=8, precision="fp32") for s in ("zero1", "dp"))
    graph = zero1.problem.graph
    shards = sum(-(-graph.tensors[name].numel // 8) * graph.precision.grad_bytes for name in graph.parameters)
    transients = [[evaluate(p.problem, p.selection).breakdown_at(point)["gradients"]
                   for point in (p.problem.schedule.boundary, p.problem.schedule.optimizer - 1)] for p in (zero1, dp)]
    assert transients[0][0] == pytest.approx(transients[1][0])
    assert transients[0][1] - transients[1][1] == pytest.approx(shards)


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


def test_a_merged_axis_runs_as_its_real_axes():
    """The search plans alike axes as one (``search.coarsen.merged_mesh``), priced as the real
    mesh runs them: ZeRO-1/2 over a merged axis is stored over several real axes, which the
    runtime reduces and gathers in line; over one real axis, beside the compute."""
    from memshard.search.coarsen import merge_groups, merged_mesh

    mesh = parse_mesh("2x2x2")
    merged = merged_mesh(mesh, merge_groups(mesh))
    assert any(axis.parts for axis in merged.axes)
    problem = build_problem(build_graph("tiny-gpt", batch=8), merged)
    seen = set()
    for group in problem.groups:
        if isinstance(group, StorageGroup) and in_a_layer(problem, group):
            for choice, (_, option) in zip(group.choices, group.options):
                if option.stage in (1, 2) and comm.total_time(choice.calls, problem.mesh) > 0:
                    over_parts = any(problem.mesh.axes[a].parts for a in option.axes)
                    seen.add((over_parts, choice.overlapped_s > 0))
    assert (True, False) in seen and (True, True) not in seen
