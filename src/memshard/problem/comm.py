"""Collectives, their time as NCCL runs them, and resharding between two layouts.

Per mesh axis of size ``m`` (bus bandwidth β per device, ring-step latency λ; the device's
collective start-up α), for a buffer of ``B`` bytes, NCCL's ring algorithm:

==============  ==========================================  ==================================
collective      B is                                          time
==============  ==========================================  ==================================
all-gather      the gathered (output) local buffer            α + (m−1)·λ + (m−1)/m · B/β
reduce-scatter  the input local buffer                        α + (m−1)·λ + (m−1)/m · B/β
all-reduce      the local buffer                              α + 2(m−1)·λ + 2(m−1)/m · B/β
all-to-all      the local buffer (each device keeps 1/m)      α + (m−1)·λ + (m−1)/m · B/β
==============  ==========================================  ==================================

β is NCCL's *bus* bandwidth (nccl-tests' busbw: the same for every group size) on large
messages; the latency terms make small messages latency-bound, as measured. An axis's β and λ
are its links' (``core/mesh.py``: within a node, or the NICs of a group spanning nodes).
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
import math
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
    group: tuple[int, ...] = ()  # one communicator over these axes of ``mesh.real`` (``axis`` the first)

    @property
    def axes(self) -> tuple[int, ...]:
        return self.group or (self.axis,)


def _size(c: Collective, mesh: Mesh) -> int:
    shape = mesh.real.shape
    return math.prod(shape[a] for a in c.group) if c.group else shape[c.axis]


def wire_bytes(c: Collective, mesh: Mesh) -> float:
    """Bytes one device sends."""
    m = _size(c, mesh)
    factor = 2.0 if c.kind == ALL_REDUCE else 1.0
    return factor * (m - 1) / m * c.buffer_bytes


def ring_links(axes: tuple[int, ...], mesh: Mesh) -> tuple[float, float]:
    """(bus bandwidth, latency of its steps per pass) of one ring over ``axes`` of ``mesh.real``.
    Within a node: the slowest axis's links. Across nodes: each node's ``k`` devices of the
    group send over ``k`` NICs (an axis across nodes gives its NIC's share), the steps that
    cross nodes at their latency."""
    real = [mesh.real.axes[a] for a in axes]
    size = math.prod(a.size for a in real)
    crossing = [a for a in real if a.per_node < a.size]
    inside = [a for a in real if a.per_node >= a.size]
    bandwidth = min((a.bandwidth_bytes_per_s for a in inside), default=math.inf)
    if crossing:
        per_node = math.prod(a.per_node for a in real)
        nic = min(a.bandwidth_bytes_per_s / a.per_node for a in crossing)
        bandwidth = min(bandwidth, per_node * nic)
    inter_steps = sum(a.size - 1 for a in crossing)
    intra_latency = min((a.latency_s for a in inside), default=0.0)
    latency = sum((a.size - 1) * a.latency_s for a in crossing) + (size - 1 - inter_steps) * intra_latency
    return bandwidth, latency


def collective_time(c: Collective, mesh: Mesh) -> float:
    """The ring's start-up and steps (split over what shares one call) and its bytes."""
    return _collective_time(c, mesh)


@functools.lru_cache(maxsize=1 << 16)  # the same calls recur across strategies, options and problems
def _collective_time(c: Collective, mesh: Mesh) -> float:
    if _size(c, mesh) == 1:
        return 0.0
    if c.group:
        bandwidth, steps_latency = ring_links(c.group, mesh)
    else:
        axis = mesh.real.axes[c.axis]
        bandwidth, steps_latency = axis.bandwidth_bytes_per_s, (axis.size - 1) * axis.latency_s
    passes = 2 if c.kind == ALL_REDUCE else 1
    latency = mesh.hardware.collective_latency_s + passes * steps_latency
    return latency * c.share + wire_bytes(c, mesh) / bandwidth


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


def one_communicator(calls: tuple[Collective, ...]) -> tuple[Collective, ...]:
    """``calls`` over several axes as one communicator over them all, as the frameworks run a
    data-parallel group (one NCCL ring; the same bytes as the reduce-scatters and all-gathers
    axis by axis, fewer for an all-reduce): one call per kind, on the kind's whole buffer."""
    out: list[Collective] = []
    for kind in dict.fromkeys(c.kind for c in calls):
        same = [c for c in calls if c.kind == kind]
        if len(same) == 1:
            out += same
            continue
        axes = tuple(sorted(c.axis for c in same))
        whole = max(c.buffer_bytes for c in same)
        out.append(Collective(kind, axes[0], whole, same[0].share, axes))
    return tuple(out)
