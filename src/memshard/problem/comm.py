"""Collectives, their alpha-beta time, and resharding between two layouts.

Per mesh axis of size ``m`` (latency α, bandwidth β per device), for a buffer of ``B`` bytes:

==============  ==========================================  ===========================
collective      B is                                          time
==============  ==========================================  ===========================
all-gather      the gathered (output) local buffer            α + (m−1)/m · B/β
reduce-scatter  the input local buffer                        α + (m−1)/m · B/β
all-reduce      the local buffer                              2α + 2(m−1)/m · B/β
all-to-all      the local buffer (each device keeps 1/m)      α + (m−1)/m · B/β
==============  ==========================================  ===========================

Bytes on the wire per device are the bandwidth terms times β. (One may write all-to-all as
``(m−1)/m² · B`` with ``B`` the buffer summed over the axis group; it is the same figure.)

Resharding ``src → dst`` runs one mesh axis at a time, each step changing the placement of that
axis on the current local tensor: forward activations go in axis order, their gradients in
reverse axis order (so both steps on axis ``a`` see the same other-axis state, which lets the
ILP price edges axis by axis). The steps: ``P→R`` all-reduce, ``P→S`` reduce-scatter,
``S→R`` all-gather, ``S(i)→S(j)`` all-to-all, ``R→S`` a local slice, ``R→P`` never needed.
The runtime redistributes in the same order, so predicted and measured bytes agree.

On a mesh with merged axes (``search/coarsen.py``) every collective is priced as it runs on the real
axes: a step over a merged axis is a step over each of its parts (in order, or in reverse
for gradients), and a ``Collective``'s axis is an axis of ``mesh.real``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from memshard.core.mesh import Mesh
from memshard.core.placement import (
    REPLICATE,
    Layout,
    Partial,
    Placement,
    Replicate,
    Shard,
    local_numel,
)

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_TO_ALL = "all_to_all"
KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)


@dataclass(frozen=True)
class Collective:
    kind: str
    axis: int  # of ``mesh.real``
    buffer_bytes: float
    share: float = 1.0  # of one call: weights gathered together split its latency (and count)


def wire_bytes(c: Collective, mesh: Mesh) -> float:
    """Bytes one device sends."""
    m = mesh.real.axes[c.axis].size
    factor = 2.0 if c.kind == ALL_REDUCE else 1.0
    return factor * (m - 1) / m * c.buffer_bytes


def collective_time(c: Collective, mesh: Mesh) -> float:
    axis = mesh.real.axes[c.axis]
    if axis.size == 1:
        return 0.0
    steps = 2 if c.kind == ALL_REDUCE else 1
    return steps * axis.latency_s * c.share + wire_bytes(c, mesh) / axis.bandwidth_bytes_per_s


def total_time(calls: tuple[Collective, ...] | list[Collective], mesh: Mesh) -> float:
    return sum(collective_time(c, mesh) for c in calls)


def total_wire_bytes(calls: tuple[Collective, ...] | list[Collective], mesh: Mesh) -> float:
    return sum(wire_bytes(c, mesh) for c in calls)


def reshard_step(
    shape: tuple[int, ...], dtype_bytes: int, current: Layout, axis: int, target: Placement, mesh: Mesh,
    reverse: bool = False,
) -> tuple[Collective, ...]:
    """The collectives that change ``current``'s placement on ``axis`` to ``target`` (on a
    merged axis: on each of its real axes, last first if ``reverse``)."""
    if mesh.real is mesh:
        return _real_step(shape, dtype_bytes, tuple(current), axis, target, mesh)
    cur = mesh.on_real_axes(current)
    calls: list[Collective] = []
    parts = mesh.real_axes[axis]
    for part in reversed(parts) if reverse else parts:
        calls += _real_step(shape, dtype_bytes, cur, part, target, mesh.real)
        cur = cur[:part] + (target,) + cur[part + 1 :]
    return tuple(calls)


@functools.lru_cache(maxsize=8192)  # per edge, per flow state, per solve: the same few steps
def _real_step(
    shape: tuple[int, ...], dtype_bytes: int, current: Layout, axis: int, target: Placement, mesh: Mesh
) -> tuple[Collective, ...]:
    """``reshard_step`` on a mesh without merged axes.

    Shards of one tensor dim over several axes nest in axis order, so an axis can change a
    split of dim ``i`` only after every later axis splitting ``i`` is gathered (innermost
    first); those are sliced again afterwards, for free. DTensor does the same."""
    a = current[axis]
    if a == target:
        return ()
    if isinstance(target, Partial):
        raise ValueError("resharding never targets a partial layout")
    dims = {p.dim for p in (a, target) if isinstance(p, Shard)}
    calls = []
    cur = tuple(current)
    for b in range(len(cur) - 1, axis, -1):
        if isinstance(cur[b], Shard) and cur[b].dim in dims:
            after = cur[:b] + (REPLICATE,) + cur[b + 1 :]
            calls.append(Collective(ALL_GATHER, b, local_numel(shape, after, mesh.shape) * dtype_bytes))
            cur = after
    if isinstance(a, Replicate):
        return tuple(calls)  # Replicate → Shard is a local slice
    before = local_numel(shape, cur, mesh.shape) * dtype_bytes
    if isinstance(a, Partial):
        calls.append(Collective(ALL_REDUCE if isinstance(target, Replicate) else REDUCE_SCATTER, axis, before))
    elif isinstance(target, Replicate):
        after = cur[:axis] + (target,) + cur[axis + 1 :]
        calls.append(Collective(ALL_GATHER, axis, local_numel(shape, after, mesh.shape) * dtype_bytes))
    else:
        calls.append(Collective(ALL_TO_ALL, axis, before))
    return tuple(calls)


def reshard(
    shape: tuple[int, ...],
    dtype_bytes: int,
    src: Layout,
    dst: Layout,
    mesh: Mesh,
    reverse: bool = False,
) -> tuple[Collective, ...]:
    """The collectives that turn ``src`` into ``dst``, one axis at a time in axis order
    (``reverse``: last axis first, the order gradients flow back in)."""
    if src == dst:
        return ()
    calls: list[Collective] = []
    cur = tuple(src)
    axes = range(len(src) - 1, -1, -1) if reverse else range(len(src))
    for axis in axes:
        calls += reshard_step(shape, dtype_bytes, cur, axis, dst[axis], mesh, reverse)
        cur = cur[:axis] + (dst[axis],) + cur[axis + 1 :]
    return tuple(calls)


def gather_flat(numel: int, dtype_bytes: int, axes: tuple[int, ...], mesh: Mesh) -> tuple[Collective, ...]:
    """All-gather a flat buffer sharded over ``axes`` (ZeRO / FSDP storage), innermost first."""
    axes, mesh = mesh.to_real_axes(axes), mesh.real
    calls = []
    shards = [mesh.axes[a].size for a in axes]
    remaining = numel
    for a in axes:
        remaining = -(-remaining // mesh.axes[a].size)
    size = remaining
    for a, m in reversed(list(zip(axes, shards))):
        size *= m
        calls.append(Collective(ALL_GATHER, a, min(size, numel) * dtype_bytes))
    return tuple(calls)


def reduce_scatter_flat(numel: int, dtype_bytes: int, axes: tuple[int, ...], mesh: Mesh) -> tuple[Collective, ...]:
    """Reduce-scatter a flat buffer over ``axes`` in axis order (the inverse of gather_flat)."""
    axes, mesh = mesh.to_real_axes(axes), mesh.real
    calls = []
    size = numel
    for a in axes:
        calls.append(Collective(REDUCE_SCATTER, a, size * dtype_bytes))
        size = -(-size // mesh.axes[a].size)
    return tuple(calls)


def all_reduce_over(nbytes: float, axes: tuple[int, ...], mesh: Mesh) -> tuple[Collective, ...]:
    return tuple(Collective(ALL_REDUCE, r, nbytes) for r in mesh.to_real_axes(axes))
