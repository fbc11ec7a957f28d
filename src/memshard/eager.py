"""A graph as the framework that runs it computes it (:func:`framework_graph`).

PyTorch's implementations run the eager module (:func:`as_eager`); torch TP's styles gather
and scatter at module boundaries (``tensor_parallel``); Megatron-LM and FSDP2 keep gradients
in their own precision.

memshard's runtime lays every tensor it reshards out in its dims' order, so a traced graph
keeps a :data:`~memshard.graph.LAYOUT_COPY` op where the module regroups a kernel's output
(``attention.transpose(1, 2).contiguous()`` after a fused SDPA). Eager PyTorch makes no copy
there: the kernel's output is already laid out that way. :func:`as_eager` removes those ops
and lets their readers read the kernel's output, which is how the baselines named after
PyTorch's own implementations (``problem.TORCH_FRAMEWORKS``) are priced.
"""

from __future__ import annotations

from dataclasses import replace

from memshard.graph import LAYOUT_COPY, MIXED, Graph
from memshard.problem import FSDP2_FRAMEWORKS, MEGATRON, TORCH_FRAMEWORKS, TORCH_TP_FRAMEWORKS
from memshard.tensor_parallel import with_input_gathers, with_output_scatters


def framework_graph(graph: Graph, framework: str) -> Graph:
    """``graph`` as ``framework`` (``problem.FRAMEWORKS``) runs it."""
    if framework in TORCH_FRAMEWORKS:  # the eager module's views, not memshard's runtime's copies
        graph = as_eager(graph)
    if framework in TORCH_TP_FRAMEWORKS:
        graph = with_input_gathers(with_output_scatters(graph))
    if framework == MEGATRON:  # bf16 training accumulates and reduces gradients in fp32 (main_grad)
        graph = replace(graph, precision=replace(graph.precision, grad_bytes=4))
    if framework in FSDP2_FRAMEWORKS and graph.precision.name == MIXED.name:
        # FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 gathered
        # weights and computed gradients, the fp32 shard the master weight (as memshard's
        # ZeRO-3), gradients reduce-scattered in fp32
        graph = replace(graph, precision=replace(graph.precision, reduced_grad_bytes=4))
    return graph


def as_eager(graph: Graph) -> Graph:
    """``graph`` without its layout copies, their readers rewired to what each copied (the
    traced graph's dims are named alike across ops, so the reader's dims stay its own)."""
    copies = {op.output.tensor: op.inputs[0] for op in graph.ops if op.kind == LAYOUT_COPY}
    if not copies:
        return graph
    ops = tuple(
        replace(op, inputs=tuple(copies.get(o.tensor, o) for o in op.inputs))
        for op in graph.ops if op.kind != LAYOUT_COPY
    )
    tensors = {name: spec for name, spec in graph.tensors.items() if name not in copies}
    return replace(graph, ops=ops, tensors=tensors)
