"""Megatron-LM's fused GEMMs in its baselines' pricing (``tensor_parallel.with_input_gathers``
with ``saved_split``): a transformer layer's tensor-parallel collectives per micro-batch are
the ones Megatron-LM's own layers run, counted from its source's rule below, not from
memshard's pricing; the gathered input is saved split, as the memory formula counts it."""

from __future__ import annotations

from collections import Counter

import pytest

from memshard.api import make_job, strategy_plan
from memshard.core.graph import TensorKind
from memshard.models import build_graph
from memshard.plans.plan import runnable
from memshard.problem.evaluate import evaluate
from memshard.problem.tensor_parallel import FUSED_GATHER, with_input_gathers, without_fused_gathers

# megatron/core/tensor_parallel/layers.py and mappings.py, per GEMM and micro-batch:
# ``ColumnParallelLinear`` (``LinearWithGradAccumulationAndAsyncCommunication``): with sequence
# parallelism its forward all-gathers its input into a buffer, its backward all-gathers the
# saved (split) input again for the weight gradient and reduce-scatters the input gradient;
# without, its backward all-reduces the input gradient (``allreduce_dgrad``).
# ``RowParallelLinear``: with sequence parallelism its output is reduce-scattered
# (``reduce_scatter_to_sequence_parallel_region``), whose backward all-gathers the gradient;
# without, its output is all-reduced (``reduce_from_tensor_model_parallel_region``).
COLUMN = {True: {"all_gather": 2, "reduce_scatter": 1}, False: {"all_reduce": 1}}
ROW = {True: {"reduce_scatter": 1, "all_gather": 1}, False: {"all_reduce": 1}}
# A layer's GEMMs as Megatron-LM builds them: the fused QKV and fc1 (LLaMA's gate and up fused
# by ``--swiglu``) column-parallel, the attention's output projection and fc2 row-parallel.
FUSED_COLUMN, ROW_PARALLEL = 2, 2


def megatrons_collectives(sequence_parallel: bool) -> Counter:
    out: Counter = Counter()
    for rule, count in ((COLUMN, FUSED_COLUMN), (ROW, ROW_PARALLEL)):
        for kind, n in rule[sequence_parallel].items():
            out[kind] += n * count
    return out


def tensor_parallel_collectives(model: str, strategy: str, layers: int, micro_batches: int) -> Counter:
    """The step's collectives over the tensor-parallel axis (the innermost), by kind."""
    job = make_job(model, "2x2", batch=8, seq=64, micro_batches=micro_batches, num_layers=layers,
                   precision="mixed")
    plan = strategy_plan(job, strategy=strategy)
    problem, selection = plan.problem, plan.selection
    axis = problem.mesh.real.ndim - 1
    priced = [(g.instances, g.choices[k].calls) for g, k in zip(problem.groups, selection.choices)]
    priced += [(edge.executions, problem.edge_calls(selection, e)) for e, edge in enumerate(problem.edges)]
    out: Counter = Counter()
    for n, calls in priced:
        for call in calls:
            if axis in call.axes:
                out[call.kind] += n * call.share
    return out


def per_layer_and_micro_batch(model: str, strategy: str) -> Counter:
    """One layer's collectives per micro-batch: what a layer more adds with two micro-batches
    less what it adds with one (the once-a-step collectives, the layer's norms' gradients
    under sequence parallelism, cancel)."""
    def layer(m: int) -> Counter:
        more, fewer = (tensor_parallel_collectives(model, strategy, n, m) for n in (3, 2))
        return Counter({k: more[k] - fewer[k] for k in more.keys() | fewer.keys()})
    two, one = layer(2), layer(1)
    return Counter({k: round(two[k] - one[k]) for k in two.keys() | one.keys() if round(two[k] - one[k])})


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_layers_tensor_parallel_collectives_are_megatrons(model, sequence_parallel):
    """GPT's q, k and v (LLaMA's too, and its gate and up) read the norm's output through one
    gather; its input gradient is reduced once (reduce-scattered, or all-reduced without
    sequence parallelism), and with sequence parallelism gathered again once in backward."""
    strategy = "megatron-tp2-dp2" + ("-sp" if sequence_parallel else "")
    assert per_layer_and_micro_batch(model, strategy) == megatrons_collectives(sequence_parallel)


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama"])
def test_the_gathered_input_is_saved_split_and_no_reader_saves_the_gathered_one(model):
    """Megatron-LM's fused GEMM saves its input as it came (``ctx.save_for_backward(input)``,
    the sequence-parallel piece) and gathers into a buffer it does not keep: the gather saves
    its input, kept in the norm's split layout, and no reader saves the gathered tensor."""
    job = make_job(model, "2x2", batch=8, seq=64, micro_batches=1, num_layers=2, precision="mixed")
    plan = strategy_plan(job, strategy="megatron-tp2-dp2-sp")
    problem, selection = plan.problem, plan.selection
    graph = problem.graph
    gathers = [i for i, op in enumerate(graph.ops) if op.kind == FUSED_GATHER]
    per_layer = 2 if model == "tiny-llama" else 1  # (GPT's fc1 has one reader: no gather needed)
    assert len(gathers) == per_layer * graph.num_layers
    for i in gathers:
        op = graph.ops[i]
        readers = graph.consumers[op.output.tensor]
        assert len(readers) >= 2 and op.saves_inputs == (0,)
        assert all(graph.ops[c].inputs[j].tensor == op.output.tensor and j not in graph.ops[c].saves_inputs
                   for c, j in readers)
        assert all(graph.tensors[o.tensor].kind is TensorKind.PARAMETER or o.tensor == op.output.tensor
                   for c, _ in readers for o in graph.ops[c].inputs)
        edge = problem.edge_of_input[(i, 0)]
        assert selection.keeps[edge]  # saved in the producer's (split) layout, gathered again in backward
        layouts = problem.edge_layouts(selection, edge)
        assert "s" in problem.strategy(selection, problem.op_group[graph.producer[op.inputs[0].tensor]]).assignment
        assert layouts.producer != layouts.consumer
    assert evaluate(problem, selection).peak_bytes == pytest.approx(plan.peak_bytes)


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama"])
def test_memshards_runtime_runs_each_projection_on_its_own(model):
    """The runtime fuses no GEMMs: undoing the gathers gives back memshard's graph, and a
    Megatron-LM baseline runs there with each op's strategy as chosen, every projection
    keeping its input split where its gather kept its own."""
    graph = build_graph(model, batch=4, seq=32)
    fused = with_input_gathers(graph, saved_split=True)
    assert fused != graph and without_fused_gathers(fused) == graph
    plan = strategy_plan(model, "2x2", "megatron-tp2-dp2-sp", batch=8)
    run = runnable(plan)
    assert run.problem.framework == "memshard" and not any(op.kind == FUSED_GATHER for op in run.problem.graph.ops)
    chosen = {op.name: plan.problem.strategy(plan.selection, plan.problem.op_group[i])
              for i, op in enumerate(plan.problem.graph.ops)}
    for i, op in enumerate(run.problem.graph.ops):
        assert run.problem.strategy(run.selection, run.problem.op_group[i]) == chosen[op.name]
    old = plan.problem.graph
    for i, op in enumerate(old.ops):
        if op.kind != FUSED_GATHER:
            continue
        kept = plan.selection.keeps[plan.problem.edge_of_input[(i, 0)]]
        assert kept
        for reader, j in old.consumers[op.output.tensor]:
            k = next(n for n, o in enumerate(run.problem.graph.ops) if o.name == old.ops[reader].name)
            assert run.selection.keeps[run.problem.edge_of_input[(k, j)]] == kept
