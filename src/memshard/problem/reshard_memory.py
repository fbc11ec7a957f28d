"""The memory a layout change allocates while it runs.

A reshard ``src → dst`` (``memshard.runtime.reshard.reshard_local``) runs one mesh axis at a
time, each step a DTensor ``redistribute`` of one axis or memshard's own all-to-all; the
caller holds the input throughout. :func:`reshard_peak_bytes` walks the same steps and
returns the most bytes the reshard itself holds at any moment, its result included: the
current intermediate layout plus what the step allocates. Per step, with ``in`` and ``out``
the step's local input and output bytes:

============================  =================================================  ==========
step                          what it allocates                                  peak
============================  =================================================  ==========
``R → S(d)``                  the local chunk (a copy)                           out
``P → R``                     the all-reduced tensor                             out
``P → S(0)``                  the reduce-scattered piece                         out
``P → S(d)``, d > 0           a copy with dim d's chunks leading, then the piece in + out
``S(0) → R``                  the gathered tensor                                out
``S(d) → R``, d > 0           the gathered tensor, then its rearranged copy      2·out
``S(i) → S(j)``               send buffer, receive buffer, the joined result     in + 2·out
============================  =================================================  ==========

(The all-to-all's send buffer is built from per-destination pieces, ``2·in`` at that moment.)
A step's input, when the reshard made it, lives until the step returns. The all-to-all joins
the received pieces straight into a contiguous result (nothing downstream copies it again).
"""

from __future__ import annotations

import functools

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


def _step_peak(in_bytes: int, out_bytes: int, here: Placement, target: Placement) -> int:
    """Bytes one single-axis step allocates at its peak (its output included)."""
    if isinstance(here, Shard) and isinstance(target, Shard):
        return max(2 * in_bytes, in_bytes + 2 * out_bytes)
    if isinstance(here, Partial) and isinstance(target, Shard) and target.dim > 0:
        return in_bytes + out_bytes
    if isinstance(here, Shard) and isinstance(target, Replicate) and here.dim > 0:
        return 2 * out_bytes
    return out_bytes


def reshard_peak_bytes(
    shape: tuple[int, ...], dtype_bytes: int, src: Layout, dst: Layout, mesh: Mesh, reverse: bool = False
) -> int:
    """Peak bytes the reshard ``src → dst`` holds beyond its input (0 when nothing changes);
    on a mesh with merged axes, as it runs on the real ones."""
    real = mesh.real
    if real is not mesh:
        src, dst = mesh.on_real_axes(src), mesh.on_real_axes(dst)
    return _peak(tuple(shape), dtype_bytes, tuple(src), tuple(dst), real.shape, reverse)


@functools.lru_cache(maxsize=1 << 16)  # the ILP asks for every layout pair of every edge
def _peak(shape: tuple[int, ...], dtype_bytes: int, src: Layout, dst: Layout, mesh_shape: tuple[int, ...],
          reverse: bool) -> int:
    if src == dst:
        return 0
    cur = src
    peak = 0
    first = True  # nothing resharded yet: the current layout is the caller's input
    for axis in range(len(src) - 1, -1, -1) if reverse else range(len(src)):
        here, target = src[axis], dst[axis]  # (the axes not yet resharded are the source's)
        if here is target or here == target:
            continue
        step = _axis_peak(shape, dtype_bytes, cur, axis, target, mesh_shape, first)
        if step > peak:
            peak = step
        cur = cur[:axis] + (target,) + cur[axis + 1 :]
        first = False
    return peak


@functools.lru_cache(maxsize=1 << 16)  # the pairs of a table share their axes' steps
def _axis_peak(shape: tuple[int, ...], dtype_bytes: int, layout: Layout, axis: int, target: Placement,
               mesh_shape: tuple[int, ...], first: bool) -> int:
    """The most ``layout``'s change on ``axis`` to ``target`` holds at once: the later axes
    splitting the dims it moves gathered (innermost first), the step, those sliced again; its
    input held by the reshard unless ``first`` (the caller's input)."""
    here = layout[axis]
    dims = {p.dim for p in (here, target) if isinstance(p, Shard)}
    inner = [b for b in range(len(layout) - 1, axis, -1) if isinstance(layout[b], Shard) and layout[b].dim in dims]
    steps = [(b, REPLICATE) for b in inner] + [(axis, target)] + [(b, layout[b]) for b in reversed(inner)]
    cur = layout
    nbytes = local_numel(shape, cur, mesh_shape) * dtype_bytes  # the current layout's bytes
    held = 0 if first else nbytes  # bytes of the current intermediate, 0 while it is the caller's input
    peak = 0
    for b, to in steps:
        after = cur[:b] + (to,) + cur[b + 1 :]
        out = local_numel(shape, after, mesh_shape) * dtype_bytes
        peak = max(peak, held + _step_peak(nbytes, out, cur[b], to))
        cur, nbytes, held = after, out, out
    return peak
