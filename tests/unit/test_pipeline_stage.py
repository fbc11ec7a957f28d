"""A pipeline stage's graph and its memory in the exact model.

The stages of a split partition the graph's ops; a stage reads what the stage before made as
an input and keeps what it sends until its backward, as torch's ``PipelineStage`` does. A
middle stage of GPT holds Megatron-LM's per-layer activations (Korthikanti et al. 2022) for
each of its layers, and its output. A rank holding k micro-batches holds k − 1 more times
what one holds at the boundary between its forward and its backward; the ILP prices every
plan so, as the evaluator does, and adds nothing where k = 1."""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memshard.core.errors import MemshardError
from memshard.core.graph import RECEIVE, TensorKind, received_name
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.problem.evaluate import InconsistentPlan, check_plan, evaluate
from memshard.problem.memory import CATEGORIES
from memshard.problem.pricing import build_problem
from memshard.problem.recompute import replay_flags
from memshard.problem.records import OpGroup, PipelineStage, Selection, complete_selection
from memshard.search.formulation import Formulation
from memshard.search.solve import SearchRequest, solve
from tests.unit.test_ilp_pricing import random_plan

ACTIVATIONS, TRANSIENTS = CATEGORIES.index("activations"), CATEGORIES.index("transients")


@functools.cache
def _graph(model: str, layers: int, precision: str = "fp32"):
    return build_graph(model, batch=8, precision=precision, num_layers=layers)


def _split(layers: int, cuts: list[int]) -> list[tuple[int, int]]:
    ends = sorted({c for c in cuts if 0 < c < layers} | {layers})
    return list(zip([0, *ends], ends))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(model=st.sampled_from(["tiny-gpt", "tiny-llama", "bert-large"]), layers=st.integers(1, 6),
       cuts=st.lists(st.integers(1, 5), max_size=4))
def test_stages_partition_the_ops(model, layers, cuts):
    """Every op on exactly one stage, its FLOPs counted once; every stage a valid graph with
    each parameter its ops read (GPT's tied embedding on the first and the last); what a stage
    receives is what the stages before it sent, an input of the same dtype and shape."""
    graph = build_graph(model, batch=2, seq=16, num_layers=layers)
    stages = [graph.pipeline_stage(a, b) for a, b in _split(layers, cuts)]
    names = [op.name for s in stages for op in s.ops if op.kind != RECEIVE]
    assert sorted(names) == sorted(op.name for op in graph.ops) and len(set(names)) == len(names)
    assert math.fsum(s.flops(op) for s in stages for op in s.ops if op.kind != RECEIVE) == pytest.approx(
        math.fsum(graph.flops(op) for op in graph.ops), rel=1e-12)
    sent: set[str] = set()
    for s in stages:
        s.validate()
        read = {o.tensor for op in s.ops for o in op.inputs}
        assert set(s.parameters) == {p for p in graph.parameters if p in read}
        assert s.received <= sent and all(s.tensors[t].kind is TensorKind.INPUT for t in s.received)
        for t in s.received:
            assert (s.tensors[t].shape, s.tensors[t].dtype_bytes) == (graph.tensors[t].shape, graph.tensors[t].dtype_bytes)
            # read by its RECEIVE op alone, whose output the stage's readers read where the graph's read it
            ((i, _),) = s.consumers[t]
            assert s.ops[i].kind == RECEIVE and s.ops[i].output.tensor == received_name(t)
            readers = {s.ops[k].name for k, _ in s.consumers[received_name(t)]}
            assert readers == {graph.ops[k].name for k, _ in graph.consumers[t]} & {op.name for op in s.ops}
        sent |= s.sent
    assert stages[-1].loss == graph.loss and not stages[-1].sent and not stages[0].received
    if model == "tiny-gpt" and len(stages) > 1:
        assert "wte.weight" in stages[0].parameters and "wte.weight" in stages[-1].parameters


def test_a_stage_is_numbered_from_its_first_layer_and_sends_its_last_ops_output():
    graph = _graph("tiny-gpt", 4)
    stage = graph.pipeline_stage(1, 3)
    assert stage.num_layers == 2 and {op.layer for op in stage.ops} == {None, 0, 1}  # (None: its RECEIVE op)
    assert stage.ops[1].name == "layers.1.ln_1" and stage.ops[-1].name == "layers.2.mlp.residual"
    assert stage.sent == {stage.loss} == {"layers.2.mlp.residual.out"}
    assert stage.received == {"layers.0.mlp.residual.out"}
    # received by each rank as its share, in its RECEIVE op's layout (as a loader's batch)
    assert stage.ops[0].name == "receive:layers.0.mlp.residual.out" and stage.ops[0].kind == RECEIVE
    assert stage.loaded_inputs == {"layers.0.mlp.residual.out": (0, 0)}
    assert graph.pipeline_stage(0, 4) is graph
    for first, end in ((2, 2), (-1, 2), (3, 5)):
        with pytest.raises(MemshardError):
            graph.pipeline_stage(first, end)


def test_a_stages_output_is_never_recomputed():
    """It is kept for the next stage's gradient, as a layer's output is kept for the next
    layer: a one-layer stage recomputes every op of its layer but its last (and its RECEIVE op,
    in no layer: the piece torch received)."""
    stage = _graph("tiny-gpt", 4).pipeline_stage(1, 2)
    flags = replay_flags(stage, "full")
    assert [op.name for op, f in zip(stage.ops, flags) if f == (False,)] == [
        "receive:layers.0.mlp.residual.out", "layers.1.mlp.residual"]


@pytest.mark.parametrize("policy, per_layer", [
    ("none", lambda s, b, h, a: s * b * h * (34 + 5 * a * s / h)),
    ("selective", lambda s, b, h, a: 34 * s * b * h),
    ("full", lambda s, b, h, a: 2 * s * b * h),
])
def test_a_middle_stage_holds_megatrons_activations_per_layer_and_its_output(policy, per_layer):
    """Between its forward and its backward a middle stage of two GPT layers (16-bit, one
    device) holds each layer's activations as Korthikanti et al. (2022) count them, and its
    output (2sbh): torch's PipelineStage keeps a stage's outputs for its backward
    (``fwd_cache``). The first layer's input (2sbh of the first layer's count) is the tensor it
    received, held in torch's receive buffer: a buffer per micro-batch of the step, not one
    micro-batch's activations; so is the output's gradient. Those two buffers are the
    transients there; the received input's gradient, sent back as the backward ends, is one
    more at the backward's last point."""
    s, b, h, a = 256, 2, 256, 8
    graph = build_graph("gpt3-1.3b", batch=b, seq=s, hidden=h, heads=a, ffn=4 * h, num_layers=4, precision="mixed")
    problem = build_problem(graph, parse_mesh("1"), recompute=policy, stage=PipelineStage(1, 3))
    plan = complete_selection(problem, {g: 0 for g, grp in enumerate(problem.groups) if isinstance(grp, OpGroup)})
    ev = evaluate(problem, plan)
    assert ev.boundary_activation_bytes == pytest.approx(2 * per_layer(s, b, h, a) - 2 * s * b * h + 2 * s * b * h)
    assert ev.category_bytes[TRANSIENTS, problem.schedule.boundary] == 2 * (2 * s * b * h)
    assert ev.category_bytes[TRANSIENTS, problem.schedule.optimizer - 1] == 3 * (2 * s * b * h)


@functools.cache
def _problem(model: str, mesh: str, recompute: str, held: int, shared: bool = True, layers: tuple[int, int] = (1, 3)):
    return build_problem(_graph(model, 4), parse_mesh(mesh), shared_layers=shared, micro_batches=4,
                         recompute=recompute, stage=PipelineStage(*layers, held))


def _plan(problem, seed: int) -> Selection:
    """A random plan of ``problem``: the first ``random_plan`` of ``seed`` that is a plan once
    its keep flags are dropped where a kept copy would serve a recomputed op."""
    rng = random.Random(seed)
    while True:
        plan = random_plan(problem, rng)
        for candidate in (plan, Selection(plan.choices, (0,) * len(plan.keeps))):
            try:
                check_plan(problem, candidate)
                return candidate
            except InconsistentPlan:
                pass


@settings(max_examples=40, deadline=None, derandomize=True)
@given(model=st.sampled_from(["tiny-gpt", "tiny-llama"]), mesh=st.sampled_from(["4", "2x2"]),
       recompute=st.sampled_from(["none", "auto"]), held=st.sampled_from([1, 2, 4]), shared=st.booleans(),
       layers=st.sampled_from([(0, 1), (1, 3), (3, 4)]), seed=st.integers(0, 2**32 - 1))
def test_ilp_prices_a_stage_holding_micro_batches_as_the_evaluator(model, mesh, recompute, held, shared, layers,
                                                                    seed):
    """Random plans of the first, a middle and the last stage, every choice pinned: the ILP's
    peak is the evaluator's. (The last stage's loss re-gathers the logits it keeps at the
    boundary: a transient, not held by the micro-batches waiting.)"""
    problem = _problem(model, mesh, recompute, held, shared, layers)
    plan = _plan(problem, seed)
    forced = solve(SearchRequest(problem, "memory", fixed=plan, mip_gap=0.0))
    assert forced.selection == plan
    assert forced.ilp_peak_bytes == pytest.approx(evaluate(problem, plan).peak_bytes, rel=1e-6)


@pytest.mark.parametrize("recompute", ["none", "auto"])
def test_each_micro_batch_held_adds_the_activations_at_the_boundary_at_every_point(recompute):
    """k micro-batches held (fewer than the step's 4): the live bytes of one plus k − 1 times S
    at every point of the forward and the backward, filed as activations; S the activations at
    the boundary, the same whatever k. The optimizer step holds none: every micro-batch has run
    its backward."""
    one = _problem("tiny-gpt", "2x2", recompute, 1)
    plan = _plan(one, 3)
    base = evaluate(one, plan)
    assert base.boundary_activation_bytes > 0
    step = one.schedule.optimizer
    for held in (2, 3):
        ev = evaluate(_problem("tiny-gpt", "2x2", recompute, held), plan)
        assert ev.boundary_activation_bytes == base.boundary_activation_bytes
        assert np.allclose(ev.live_bytes[:step], base.live_bytes[:step] + (held - 1) * base.boundary_activation_bytes,
                           rtol=0)
        assert ev.live_bytes[step] == base.live_bytes[step]
        others = [k for k in range(len(CATEGORIES)) if k != ACTIVATIONS]
        assert np.array_equal(ev.category_bytes[others], base.category_bytes[others])
        assert ev.redundant_bytes >= base.redundant_bytes


def test_a_stage_holding_every_micro_batch_has_no_gradient_while_they_wait():
    """Holding all of the step's micro-batches (GPipe), the rank runs every forward before the
    first backward: no gradient is accumulated while they wait, and the gradients are the
    same from the first backward on (a stage holding fewer has them all step)."""
    fewer, every = (_problem("tiny-gpt", "4", "none", held) for held in (3, 4))
    plan = _plan(fewer, 5)
    a, b = evaluate(fewer, plan), evaluate(every, plan)
    gradients, boundary = CATEGORIES.index("gradients"), fewer.schedule.boundary
    assert a.category_bytes[gradients, :boundary].min() > 0
    assert not b.category_bytes[gradients, :boundary].any()
    assert b.category_bytes[gradients, fewer.schedule.optimizer] == a.category_bytes[gradients, fewer.schedule.optimizer]


def _model(problem):
    f = Formulation(problem)
    f.add_plan_constraints(problem.candidate_points)
    return f


def test_one_micro_batch_held_leaves_the_ilp_as_it_was():
    """k = 1 adds nothing: the whole graph as a stage of every layer is its problem, column
    for column and row for row; a stage holding one micro-batch has no in-flight row, holding
    two it has one, over one more column (A)."""
    graph = _graph("tiny-gpt", 2)
    whole = build_problem(graph, parse_mesh("2x2"))
    staged = build_problem(graph, parse_mesh("2x2"), stage=PipelineStage(0, 2, 1))
    a, b = _model(whole).model, _model(staged).model
    assert (a.lower, a.upper, a.integer, a.rows_lower, a.rows_upper, a.tags) == (
        b.lower, b.upper, b.integer, b.rows_lower, b.rows_upper, b.tags)
    assert all(np.array_equal(x, y) for x, y in zip(a.row_columns + a.row_values, b.row_columns + b.row_values))
    one, two = _model(_problem("tiny-gpt", "2x2", "none", 1)), _model(_problem("tiny-gpt", "2x2", "none", 2))
    assert one.live.in_flight_column is None and not [t for t in one.model.tags if t.family == "in-flight"]
    assert len([t for t in two.model.tags if t.family == "in-flight"]) == 1
    assert two.live.in_flight_column is not None
    assert two.model.num_columns >= one.model.num_columns + 1 and two.model.num_rows >= one.model.num_rows + 1


def test_a_stage_holds_at_most_the_steps_micro_batches():
    for held in (0, 5):
        with pytest.raises(MemshardError):
            build_problem(_graph("tiny-gpt", 4), parse_mesh("2"), micro_batches=4, stage=PipelineStage(1, 3, held))
