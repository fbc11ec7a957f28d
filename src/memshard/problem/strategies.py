"""Named dims → strategies: one generic enumerator for every op.

A strategy assigns each mesh axis to one of the op's dims, or to none. A dim may take several
axes (it is then split in axis order, as DTensor does). From the assignment follow:

- each operand's layout: ``Shard(i)`` on an axis whose dim is the operand's axis ``i``;
  on the output, ``Partial`` on an axis whose dim is contracted; ``Replicate`` otherwise;
- the gradient layout of each parameter input: ``Shard`` where the parameter is split,
  ``Partial`` where the op is split along a dim the parameter lacks (its gradient is a partial
  sum over that axis and must be reduced), ``Replicate`` where the axis is unused;
- the axes that split a reduced dim (statistics to all-reduce).

Splits follow ``torch.chunk``: a dim of size ``n`` split ``m`` ways needs ``n ≥ m``; uneven
pieces are priced at their largest. Axes of size 1 are never assigned.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from memshard.core.graph import Graph, Op, TensorKind
from memshard.core.mesh import Mesh
from memshard.core.placement import PARTIAL, REPLICATE, Layout, Shard, chunk_size

GradPlacement = str  # per axis: "S<i>", "P" or "R"


@dataclass(frozen=True)
class Strategy:
    assignment: tuple[str | None, ...]  # per mesh axis: the op dim it splits, or None
    input_layouts: tuple[Layout, ...]
    output_layout: Layout
    local_dims: tuple[tuple[str, int], ...]  # op dim → size on one device

    def name(self) -> str:
        return "".join("-" if d is None else d for d in self.assignment) or "-"

    @property
    def local_sizes(self) -> dict[str, int]:
        return dict(self.local_dims)


def _operand_layout(op_dims: tuple[str, ...], assignment, contracted: set[str], is_output: bool) -> Layout:
    layout = []
    for d in assignment:
        if d is not None and d in op_dims:
            layout.append(Shard(op_dims.index(d)))
        elif d is not None and is_output and d in contracted:
            layout.append(PARTIAL)
        else:
            layout.append(REPLICATE)
    return tuple(layout)


def enumerate_strategies(graph: Graph, op: Op, mesh: Mesh) -> tuple[Strategy, ...]:
    """Every valid assignment of mesh axes to the op's dims, in a fixed order."""
    sizes = graph.dim_sizes(op)
    dims = op.dims
    return _strategies(dims, tuple(sizes[d] for d in dims), tuple(d for d in dims if d not in op.unsplittable_dims),
                       frozenset(op.contracted_dims), tuple(x.dims for x in op.inputs), op.output.dims, mesh.shape)


@functools.lru_cache(maxsize=4096)  # the ops of one shape (every layer's, every problem's of a job) share them
def _strategies(dims: tuple[str, ...], sizes: tuple[int, ...], splittable: tuple[str, ...],
                contracted: frozenset[str], input_dims: tuple[tuple[str, ...], ...], output_dims: tuple[str, ...],
                mesh_shape: tuple[int, ...]) -> tuple[Strategy, ...]:
    per_axis = [[None] if m == 1 else [None, *splittable] for m in mesh_shape]
    out = []
    for assignment in itertools.product(*per_axis):
        local = dict(zip(dims, sizes))
        ok = True
        for d, m in zip(assignment, mesh_shape):
            if d is None:
                continue
            if local[d] < m:
                ok = False
                break
            local[d] = chunk_size(local[d], m)
        if not ok:
            continue
        out.append(
            Strategy(
                assignment=tuple(assignment),
                input_layouts=tuple(_operand_layout(x, assignment, contracted, False) for x in input_dims),
                output_layout=_operand_layout(output_dims, assignment, contracted, True),
                local_dims=tuple((d, local[d]) for d in dims),
            )
        )
    return tuple(out)


def input_grad_layout(strategy: Strategy, op: Op, j: int) -> Layout:
    """Layout of the gradient an op produces for its input ``j``: Shard where the input is
    split, Partial where the op is split along a dim the input lacks (the gradient is a
    partial sum over that axis: Megatron's ``f``/``g`` pair), Replicate where the axis is unused."""
    return _input_grad_layout(strategy.assignment, op.inputs[j].dims)


@functools.lru_cache(maxsize=1 << 14)
def _input_grad_layout(assignment: tuple[str | None, ...], dims: tuple[str, ...]) -> Layout:
    return tuple(
        REPLICATE if d is None else (Shard(dims.index(d)) if d in dims else PARTIAL)
        for d in assignment
    )


def grad_layout(op: Op, input_index: int, strategy: Strategy) -> tuple[GradPlacement, ...]:
    """:func:`input_grad_layout` as labels (``S<i>``, ``P``, ``R``), for parameter storage."""
    return _labels(input_grad_layout(strategy, op, input_index))


@functools.lru_cache(maxsize=4096)
def _labels(layout: Layout) -> tuple[GradPlacement, ...]:
    return tuple(f"S{p.dim}" if isinstance(p, Shard) else ("P" if p == PARTIAL else "R") for p in layout)


def parameter_inputs(graph: Graph, op: Op) -> tuple[int, ...]:
    return tuple(
        i for i, x in enumerate(op.inputs) if graph.tensors[x.tensor].kind is TensorKind.PARAMETER
    )


def activation_inputs(graph: Graph, op: Op) -> tuple[int, ...]:
    return tuple(
        i for i, x in enumerate(op.inputs) if graph.tensors[x.tensor].kind is TensorKind.ACTIVATION
    )


def compute_split(strategy: Strategy, mesh: Mesh) -> int:
    """How many ways the op's work is divided (axes assigned to no dim repeat the work)."""
    return math.prod(m for d, m in zip(strategy.assignment, mesh.shape) if d is not None)
