"""Megatron-LM's ``--tp-comm-overlap``: Transformer Engine's userbuffers run the
sequence-parallel collectives of a layer's column- and row-parallel linears in chunks beside
those linears' GEMMs.

Transformer Engine splits the all-gather of a column-parallel linear's input and the GEMM that
reads it into chunks, and each chunk's GEMM runs while the next chunk travels; so does the
reduce-scatter after a row-parallel linear's GEMM. In backward its bulk overlaps run the input's
all-gather (for the weight gradient) beside the input-gradient GEMM and the input gradient's
reduce-scatter beside the weight-gradient GEMM (``transformer_engine/pytorch/module/linear.py``,
``layernorm_linear.py``: ``ub_overlap_ag``, ``ub_overlap_rs``, ``ub_bulk_dgrad``,
``ub_bulk_wgrad``; Megatron-LM's ``--tp-comm-overlap`` turns them on, with sequence parallelism
only). memshard prices it so: each such collective over the tensor-parallel axes, per
micro-batch, hides under its own GEMMs' compute in the same pass, and what outlasts them stays:

    exposed = max(0, collectives − GEMMs)        per linear, forward and backward apart

A linear's forward GEMM hides the all-gather of its input (or of the input its fused
projections gather once, ``tensor_parallel``'s redistributions) and the reduce-scatter of its output;
its two backward GEMMs together hide the gradients' collectives and the input's re-gather. Each
GEMM hides once. The rest of the TP communication (the embedding's, the head's, the loss's)
runs in line. The hidden seconds are the op choices' ``hidden_s``
(``evaluate.hidden_communication``); like the buckets (``buckets.py``), they are priced for a
fixed plan's problem.
"""

from __future__ import annotations

from dataclasses import replace

from memshard.problem import comm
from memshard.problem.kernels import op_time
from memshard.problem.records import OpGroup, Problem, Selection

LINEAR = "linear"


def tp_overlapped(problem: Problem, selection: Selection, tp_axes: tuple[int, ...]) -> Problem:
    """``problem`` with ``selection``'s layer linears hiding their TP collectives (over
    ``tp_axes`` of ``problem.mesh``) under their GEMMs: each linear's op choice carries the
    seconds it hides per instance (``Choice.hidden_s``)."""
    real = set(problem.mesh.to_real_axes(tp_axes))
    if not real:
        return problem
    left: dict[tuple[int, bool], float] = {}  # (op group, backward) → GEMM seconds per micro-batch not yet hiding
    hidden: dict[int, float] = {}  # op group → seconds hidden per step
    for e, edge in enumerate(problem.edges):
        gemms = edge_gemms(problem, e)
        if not gemms:
            continue
        forward, backward = tp_calls(problem, selection, e, real)
        for backward_pass, calls in ((False, forward), (True, backward)):
            need = comm.total_time(calls, problem.mesh)
            for g in gemms:
                key = (g, backward_pass)
                if key not in left:
                    left[key] = gemm_seconds(problem, selection, g)[backward_pass]
                covered = min(need, left[key])
                left[key] -= covered
                need -= covered
                hidden[g] = hidden.get(g, 0.0) + covered * edge.executions
    groups = list(problem.groups)
    for g, seconds in hidden.items():
        group = groups[g]
        k = selection.choices[g]
        choices = list(group.choices)
        choices[k] = replace(choices[k], hidden_s=seconds / group.instances)
        groups[g] = replace(group, choices=choices)
    return replace(problem, groups=groups)


def edge_gemms(problem: Problem, e: int) -> list[int]:
    """The op groups of the layer linears whose GEMMs hide edge ``e``'s TP collectives: its
    consumer; or, where the consumer only feeds linears (the input fused projections gather
    once, ``tensor_parallel``'s redistributions), those linears; else its producer."""
    edge, ops = problem.edges[e], problem.graph.ops
    consumer = problem.groups[edge.consumer]
    producer = problem.groups[edge.producer]
    if not (isinstance(consumer, OpGroup) and isinstance(producer, OpGroup)):
        return []
    op = ops[consumer.ops[0]]
    if op.layer is None:
        return []
    if op.kind == LINEAR:
        return [edge.consumer]
    readers = [other.consumer for other in problem.edges if other.producer == edge.consumer]
    if readers and all(ops[problem.groups[g].ops[0]].kind == LINEAR for g in readers):
        return readers
    if ops[producer.ops[0]].kind == LINEAR and ops[producer.ops[0]].layer is not None:
        return [edge.producer]
    return []


def tp_calls(problem: Problem, selection: Selection, e: int,
             real_tp_axes: set[int]) -> tuple[tuple[comm.Collective, ...], tuple[comm.Collective, ...]]:
    """Edge ``e``'s all-gathers and reduce-scatters over the TP axes per execution: in the
    forward, and in the backward (its gradient's and the kept input's re-gather)."""
    spec, layouts, mesh = problem.edges[e].tensor, problem.edge_layouts(selection, e), problem.mesh
    forward = comm.reshard(spec.shape, spec.dtype_bytes, layouts.producer, layouts.consumer, mesh)
    backward = comm.reshard(spec.shape, spec.dtype_bytes, layouts.consumer_grad, layouts.producer_grad, mesh,
                            reverse=True)
    if layouts.kept or layouts.replayed:  # (a kept copy's re-gather, a replay's reshard: in backward)
        backward += forward

    def over_tp(calls):
        return tuple(c for c in calls if c.kind in (comm.ALL_GATHER, comm.REDUCE_SCATTER)
                     and set(c.axes) <= real_tp_axes)
    return over_tp(forward), over_tp(backward)


def gemm_seconds(problem: Problem, selection: Selection, group: int) -> tuple[float, float]:
    """(forward, backward) GEMM seconds per micro-batch of op group ``group``'s chosen strategy."""
    g = problem.groups[group]
    op = problem.graph.ops[g.ops[0]]
    kernels = op_time(op, problem.graph, g.strategies[selection.choices[group]].local_sizes, problem.mesh.hardware)
    return kernels.forward_s, kernels.backward_s
