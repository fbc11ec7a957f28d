"""Tensor parallelism's view of a graph: the dims it splits, and the gathers PyTorch adds.

- :func:`tensor_parallel_dims`: which dims Megatron-style tensor parallelism splits, in the
  order an op picks its first (the baselines lay every op out by it).
- :func:`with_input_gathers`: the graph as PyTorch's ``parallelize_module`` runs it with
  torchtitan's plan, where ``PrepareModuleInput`` gathers a sequence-parallel activation once
  for every projection reading it (q, k, v; gate and up): one :data:`REDISTRIBUTE` op before
  them, whose output they all read, save and send their gradients to; with ``saved_split``
  the graph as Megatron-LM runs it, where those projections are one fused GEMM (QKV; gate and
  up as fc1) whose ``LinearWithGradAccumulationAndAsyncCommunication`` gathers its input once
  into a buffer, saves the input as it came (split over the sequence) and gathers it again in
  backward: one :data:`FUSED_GATHER` op that saves its input, its readers saving none of its
  output (:func:`without_fused_gathers` undoes it, for memshard's runtime, which fuses none);
- :func:`with_output_scatters`: where a row-parallel op's partial output (the vocabulary-parallel
  embedding's) has several readers, ``RowwiseParallel(output_layouts=Shard(1))`` reduce-scatters
  it once: one :data:`SCATTER` op after it, whose output they all read (and a checkpointed
  block saves as its input).

A redistribution computes nothing; its output's gradient is the sum of its readers' partial
gradients (PyTorch sums them before the redistribution's backward reduce-scatters once), so
the edges out of it reshard no gradient (``Edge.gradient_through``) and its own input
gradient is partial wherever it is replicated (``redistribute_grad_layout``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from memshard.core.graph import Graph, Op, Operand, Origin, TensorKind
from memshard.core.placement import PARTIAL, REPLICATE, Layout

TP_DIMS = ("v", "f", "e", "n")  # a built model's dims tensor parallelism splits, first found in the op
REDISTRIBUTE = "redistribute"  # op kind: an input gathered once for several readers
SCATTER = "redistribute_scatter"  # op kind: a partial output reduce-scattered once for several readers
FUSED_GATHER = "redistribute_fused"  # op kind: a fused GEMM's input gathered once, saved as it came
REDISTRIBUTIONS = frozenset({REDISTRIBUTE, SCATTER, FUSED_GATHER})
GATHERS = frozenset({REDISTRIBUTE, FUSED_GATHER})  # an input gathered once for several readers


def tensor_parallel_dims(graph: Graph) -> tuple[str, ...]:
    """The dims tensor parallelism splits, in the order an op picks its first: a built
    model's :data:`TP_DIMS`; for a traced one, the outermost feature atom of every weight that
    is not the model dim (the dim most weights have): the q/k/v and MLP weights' outputs, the
    output projections' inputs, the vocabulary. ``ColwiseParallel`` and ``RowwiseParallel``
    split a linear's features contiguously, i.e. that atom: heads (kv heads × group for
    grouped queries), never the head dim. Two exceptions, as Megatron-LM lays them out: a
    fused weight's fusion atom (GPT-2's ``[3, heads, head dim]``: the atom its output's
    consumers select away) is passed over for the next, and tables other than the token
    embedding (looked up by the batch's tokens) stay whole (positions)."""
    if graph.origin is Origin.BUILT:
        return TP_DIMS
    weights = []
    for p in graph.parameters:
        for i, j in graph.consumers.get(p, ())[:1]:
            op = graph.ops[i]
            tokens = any(graph.tensors[o.tensor].kind is TensorKind.INPUT and "b" in o.dims for o in op.inputs)
            if op.kind != "embedding" or tokens:
                weights.append((op, op.inputs[j].dims))
    model_dim = Counter(d for _, dims in weights for d in set(dims)).most_common(1)[0][0]
    out: dict[str, None] = {}
    for op, dims in weights:
        features = [d for d in dims if d != model_dim and not _selected_away(graph, op, d)]
        if features:
            out[features[0]] = None
    return tuple(out)


def _selected_away(graph: Graph, op: Op, dim: str) -> bool:
    """Whether every op reading ``op``'s output selects ``dim`` away (a fused weight's q/k/v index)."""
    readers = [graph.ops[i] for i, _ in graph.consumers.get(op.output.tensor, ())]
    return (bool(readers) and dim in op.output.dims
            and all(r.kind == "select" and dim not in r.output.dims for r in readers))


def tensor_parallel_dim(op: Op, dims: tuple[str, ...]) -> str | None:
    """The dim tensor parallelism splits in ``op``: the first of ``dims`` it has and can split."""
    return next((d for d in dims if d in op.dims and d not in op.unsplittable_dims), None)


def with_input_gathers(graph: Graph, saved_split: bool = False) -> Graph:
    """``graph`` with a :data:`REDISTRIBUTE` op before every activation that two or more
    projections read in one layer without a tensor-parallel dim of their own input
    (``ColwiseParallel`` projections, whose weight carries the split), those readers rewired
    to its output: ``PrepareModuleInput`` before a block's attention and MLP. With
    ``saved_split``, a :data:`FUSED_GATHER` op instead, as Megatron-LM's fused GEMM runs: it
    saves its input (kept split where the producer's layout is, and gathered again in
    backward: ``Edge.can_keep``), and the readers save none of its output."""
    dims = tensor_parallel_dims(graph)
    kind, saves = (FUSED_GATHER, (0,)) if saved_split else (REDISTRIBUTE, ())
    additions = []
    for name, readers in graph.consumers.items():
        if graph.tensors[name].kind is not TensorKind.ACTIVATION:
            continue
        projections = [(i, j) for i, j in readers if _column_parallel(graph, graph.ops[i], j, dims)]
        if len(projections) < 2 or len({graph.ops[i].layer for i, _ in projections}) != 1:
            continue
        first = graph.ops[projections[0][0]]
        gathered = f"{name}.gathered"
        dims_of = first.inputs[projections[0][1]].dims
        module = first.name.rsplit(".", 1)[0] if "." in first.name else first.name
        gather = Op(name=f"{module}/gather#{name}", kind=kind, inputs=(Operand(name, dims_of),),
                    output=Operand(gathered, dims_of), saves_inputs=saves, flops_per_point=0.0, backward_flops_ratio=0.0,
                    layer=first.layer, role=None if first.role is None else f"{first.role}/gather",
                    layer_class=first.layer_class)
        additions.append((projections[0][0], gather, projections))
    return _with_redistributions(graph, additions, saved_by_readers=not saved_split)


def without_fused_gathers(graph: Graph) -> Graph:
    """``graph`` without its :data:`FUSED_GATHER` ops, as runs that fuse no GEMMs run it (memshard's
    runtime): each reader reads the gathered input, and saves it, on its own."""
    gathers = {op.output.tensor: op.inputs[0].tensor for op in graph.ops if op.kind == FUSED_GATHER}
    if not gathers:
        return graph
    ops = []
    for op in graph.ops:
        if op.kind == FUSED_GATHER:
            continue
        rewired = {j for j, o in enumerate(op.inputs) if o.tensor in gathers}
        if rewired:
            op = replace(op, inputs=tuple(Operand(gathers[o.tensor], o.dims) if o.tensor in gathers else o
                                          for o in op.inputs),
                         saves_inputs=tuple(sorted({*op.saves_inputs, *rewired})))
        ops.append(op)
    tensors = {name: spec for name, spec in graph.tensors.items() if name not in gathers}
    return replace(graph, ops=tuple(ops), tensors=tensors)


def with_output_scatters(graph: Graph) -> Graph:
    """``graph`` with a :data:`SCATTER` op after every activation of a row-parallel op (a
    weight, the op's tensor-parallel dim not in its output) that two or more ops read, those
    readers rewired to its output."""
    dims = tensor_parallel_dims(graph)
    additions = []
    for i, op in enumerate(graph.ops):
        readers = graph.consumers.get(op.output.tensor, ())
        tp_dim = tensor_parallel_dim(op, dims)
        has_weight = any(graph.tensors[o.tensor].kind is TensorKind.PARAMETER for o in op.inputs)
        if len(readers) < 2 or not has_weight or tp_dim is None or tp_dim in op.output.dims:
            continue
        name = op.output.tensor
        scatter = Op(name=f"{op.name.split('/')[0]}/scatter#{name}", kind=SCATTER, inputs=(op.output,),
                     output=Operand(f"{name}.scattered", op.output.dims), flops_per_point=0.0,
                     backward_flops_ratio=0.0, layer=op.layer, role=None, layer_class=op.layer_class)
        additions.append((i + 1, scatter, readers))
    return _with_redistributions(graph, additions)


def _with_redistributions(graph: Graph, additions: list[tuple[int, Op, list[tuple[int, int]]]],
                          saved_by_readers: bool = True) -> Graph:
    """``graph`` with each ``(position, redistribution, readers)``: the op inserted before
    ``position``, its output a tensor like its input, each reader's input ``j`` rewired to it
    (and, unless ``saved_by_readers``, no longer saved by it)."""
    ops, tensors = list(graph.ops), dict(graph.tensors)
    for _, op, readers in additions:
        out = op.output.tensor
        tensors[out] = replace(graph.tensors[op.inputs[0].tensor], name=out)
        for i, j in readers:
            ops[i] = replace(ops[i], inputs=tuple(Operand(out, o.dims) if k == j else o
                                                  for k, o in enumerate(ops[i].inputs)),
                             saves_inputs=tuple(k for k in ops[i].saves_inputs if saved_by_readers or k != j))
    for position, op, _ in sorted(additions, key=lambda x: x[0], reverse=True):
        ops.insert(position, op)
    return replace(graph, ops=tuple(ops), tensors=tensors)


def _column_parallel(graph: Graph, op: Op, j: int, dims: tuple[str, ...]) -> bool:
    """Whether ``op`` reads input ``j`` as a column-parallel projection: a weight input, and
    the op's tensor-parallel dim absent from input ``j``."""
    has_weight = any(graph.tensors[o.tensor].kind is TensorKind.PARAMETER for o in op.inputs)
    tp_dim = tensor_parallel_dim(op, dims)
    return has_weight and tp_dim is not None and tp_dim not in op.inputs[j].dims


def redistribute_grad_layout(output_layout: Layout, mesh_shape: tuple[int, ...]) -> Layout:
    """The input gradient of a redistribution laid out as ``output_layout``: its readers'
    partial sums wherever it is replicated (on axes of more than one device)."""
    return tuple(PARTIAL if p == REPLICATE and n > 1 else p for p, n in zip(output_layout, mesh_shape))
