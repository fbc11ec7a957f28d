"""Layout changes of activations between ops, with DTensor, one mesh axis at a time.

The planner prices a reshard ``src → dst`` as one collective per mesh axis whose placement
changes, forward activations in axis order and their gradients in reverse axis order
(``memshard.problem.comm.reshard``). :func:`reshard_local` runs exactly those steps, one per
axis: an even split's step calls the one functional collective DTensor would (all-gather,
reduce-scatter, all-reduce, or a local slice) without DTensor's per-call dispatch; an uneven
one goes through DTensor's ``redistribute``; ``Shard(i) → Shard(j)`` is memshard's own
all-to-all.

:class:`Reshard` is the autograd function an edge of the graph runs: forward ``lp → lc``,
backward the consumer's input-gradient layout ``gc → gp`` (the producer's output layout with
partial sums read as replicated).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from memshard.core.placement import Layout, Partial, Replicate, Shard


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor (the tensor itself, not a view: an in-place change
    of it is the DTensor's), or ``t``."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def to_torch(layout: Layout) -> tuple:
    """memshard placements → DTensor placements."""
    out = []
    for p in layout:
        if isinstance(p, Shard):
            out.append(TorchShard(p.dim))
        elif isinstance(p, Partial):
            out.append(TorchPartial())
        else:
            out.append(TorchReplicate())
    return tuple(out)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def as_dtensor(local: torch.Tensor, mesh: DeviceMesh, layout: Layout, shape: Sequence[int]) -> DTensor:
    return DTensor.from_local(
        local, mesh, to_torch(layout), run_check=False,
        shape=torch.Size(shape), stride=contiguous_stride(shape),
    )


@torch.no_grad()
def reshard_local(
    local: torch.Tensor,
    shape: Sequence[int],
    mesh: DeviceMesh,
    src: Layout,
    dst: Layout,
    reverse: bool = False,
) -> torch.Tensor:
    """The local tensor of ``src`` turned into ``dst``, one mesh axis at a time."""
    if tuple(src) == tuple(dst):
        return local
    current = list(src)
    axes = range(len(src) - 1, -1, -1) if reverse else range(len(src))
    for axis in axes:
        if current[axis] == dst[axis]:
            continue
        # Shards of one dim nest in axis order: gather the later axes splitting the dims this
        # step touches (innermost first), change this axis, slice them again (free).
        here, target = current[axis], dst[axis]
        dims = {p.dim for p in (here, target) if isinstance(p, Shard)}
        inner = [b for b in range(len(current) - 1, axis, -1)
                 if isinstance(current[b], Shard) and current[b].dim in dims]
        saved = {b: current[b] for b in inner}
        for b in inner:
            local = _single_step(local, shape, mesh, current, b, Replicate())
        local = _single_step(local, shape, mesh, current, axis, target)
        for b in reversed(inner):
            local = _single_step(local, shape, mesh, current, b, saved[b])
    return local


def _single_step(local, shape, mesh, current: list, axis: int, target) -> torch.Tensor:
    """Change one axis (no later axis splits the dims involved); updates ``current``."""
    before = tuple(current)
    current[axis] = target
    here = before[axis]
    if isinstance(here, Shard) and isinstance(target, Shard) and here.dim != target.dim:
        return _all_to_all(local, shape, mesh, before, axis, target.dim)  # DTensor on CPU would all-gather
    direct = _direct_step(local, shape, mesh, before, axis, target)
    if direct is not None:
        return direct
    x = as_dtensor(local, mesh, before, shape).redistribute(mesh, to_torch(tuple(current)))
    local = x.to_local()
    # Functional collectives hand back lazily-waited tensors; make it a plain tensor.
    return local.wait() if hasattr(local, "wait") else local


_FUNCTIONAL = torch.ops._c10d_functional


def _direct_step(local, shape, mesh: DeviceMesh, before: Layout, axis: int, target) -> torch.Tensor | None:
    """An even split's step as the one functional collective DTensor would run, without
    DTensor's per-call dispatch (a few ms of CPU each, hundreds of calls per step); the same
    buffers as DTensor allocates (``cost.reshard_memory``; c10d's in-place
    ``reduce_scatter_tensor`` would copy its input on gloo). None: let DTensor do it (uneven
    splits)."""
    here = before[axis]
    m, me = mesh.size(axis), mesh.get_local_rank(axis)
    name = mesh.get_group(axis).group_name
    if isinstance(here, Partial) and isinstance(target, Replicate):
        return _FUNCTIONAL.wait_tensor(_FUNCTIONAL.all_reduce(local, "sum", name))
    if isinstance(target, Shard) and local.shape[target.dim] % m:
        return None
    if isinstance(here, Replicate) and isinstance(target, Shard):
        c = local.shape[target.dim] // m
        return local.narrow(target.dim, me * c, c).clone(memory_format=torch.contiguous_format)
    if isinstance(here, Partial) and isinstance(target, Shard):
        d = target.dim
        src = local if d == 0 else torch.cat(local.chunk(m, d))  # dim d's chunks leading
        if not src.is_contiguous():
            return None
        return _FUNCTIONAL.wait_tensor(_FUNCTIONAL.reduce_scatter_tensor(src, "sum", m, name))
    if isinstance(here, Shard) and isinstance(target, Replicate):
        d = here.dim
        if _size_before(shape, mesh, before, axis, d) % m or not local.is_contiguous():
            return None
        out = _FUNCTIONAL.wait_tensor(_FUNCTIONAL.all_gather_into_tensor(local, m, name))
        return out if d == 0 else torch.cat(out.chunk(m), dim=d)
    return None


def _size_before(shape, mesh: DeviceMesh, layout: Layout, axis: int, d: int) -> int:
    """This rank's size of dim ``d`` before ``axis`` splits it: earlier axes' torch.chunk pieces."""
    size, coords = shape[d], mesh.get_coordinate()
    for a in range(axis):
        if layout[a] == Shard(d):
            size = _pieces(size, mesh.size(a))[coords[a]]
    return size


def _pieces(n: int, m: int) -> list[int]:
    c = -(-n // m)
    return [max(0, min(c, n - r * c)) for r in range(m)]


def _all_to_all(local: torch.Tensor, shape, mesh: DeviceMesh, current: Layout, axis: int, j: int) -> torch.Tensor:
    """Move the split of ``axis`` from dim ``i`` to dim ``j`` with one all-to-all."""
    i = current[axis].dim
    coords = mesh.get_coordinate()
    size_i = _size_before(shape, mesh, current, axis, i)
    m, me = mesh.size(axis), coords[axis]
    pieces_i, pieces_j = _pieces(size_i, m), _pieces(local.shape[j], m)
    starts_j = [sum(pieces_j[:r]) for r in range(m)]
    send = torch.cat([local.narrow(j, starts_j[r], pieces_j[r]).movedim(i, 0).reshape(-1) for r in range(m)])
    rest = local.numel() // max(1, local.shape[i] * local.shape[j])
    out_sizes = [pieces_i[r] * pieces_j[me] * rest for r in range(m)]
    recv = send.new_empty(sum(out_sizes))
    in_sizes = [local.shape[i] * pieces_j[r] * rest for r in range(m)]
    dist.all_to_all_single(recv, send, out_sizes, in_sizes, group=mesh.get_group(axis))
    moved = list(local.movedim(i, 0).shape)
    jj = j if j > i else j + 1  # dim j's place once dim i is moved to the front
    moved[jj] = pieces_j[me]
    # Joined straight into a contiguous tensor: a view with dim i moved back would make every
    # consumer (a matmul in backward, the next DTensor step) copy it once more.
    out_shape = list(local.shape)
    out_shape[i], out_shape[j] = sum(pieces_i), pieces_j[me]
    out = recv.new_empty(out_shape)
    if len(set(pieces_i)) == 1:  # every rank's piece alike: one copy, dim i split as (rank, piece)
        blocks = recv.view([m, pieces_i[0], *moved[1:]]).movedim((0, 1), (i, i + 1))
        out.unflatten(i, (m, pieces_i[0])).copy_(blocks)
        return out
    start = 0
    for r, p in enumerate(recv.split(out_sizes)):
        out.narrow(i, start, pieces_i[r]).copy_(p.view([pieces_i[r], *moved[1:]]).movedim(0, i))
        start += pieces_i[r]
    return out


def without_partial(layout: Layout) -> Layout:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in layout)


class Reshard(torch.autograd.Function):
    """``lp → lc`` forward; the gradient ``gc → gp`` backward (reverse axis order)."""

    @staticmethod
    def forward(ctx, x, shape, mesh, lp, lc, gc):
        ctx.spec = (shape, mesh, gc, without_partial(lp))
        return reshard_local(x, shape, mesh, lp, lc)

    @staticmethod
    def backward(ctx, grad):
        shape, mesh, gc, gp = ctx.spec
        return reshard_local(grad.contiguous(), shape, mesh, gc, gp, reverse=True), None, None, None, None, None
