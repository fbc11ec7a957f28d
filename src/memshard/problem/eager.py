"""A traced graph as the eager module runs it, for the frameworks that run the module itself.

memshard's runtime lays every tensor it reshards out in its dims' order, so a traced graph
keeps a :data:`~memshard.core.graph.LAYOUT_COPY` op where the module regroups a kernel's output
(``attention.transpose(1, 2).contiguous()`` after a fused SDPA). Eager PyTorch makes no copy
there: the kernel's output is already laid out that way. :func:`as_eager` removes those ops
and lets their readers read the kernel's output, which is how the baselines named after
PyTorch's own implementations (``problem.TORCH_FRAMEWORKS``) are priced.
"""

from __future__ import annotations

from dataclasses import replace

from memshard.core.graph import LAYOUT_COPY, Graph


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
