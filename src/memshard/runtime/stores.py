"""A parameter's storage on one rank, as a plan lays it out: :class:`ParamStore` (one parameter:
its compute weight, the shard the optimizer updates, its gradient's reduction by ZeRO stage) and
:class:`GatherUnit` (the weights of a ZeRO-3 layer unit in one flat shard, gathered together, as
FSDP's unit is). ``executor.ShardedGraphModel`` holds one per parameter or unit.

What runs beside the compute (``problem/storage.py``'s ``reduction_overlaps`` and
``gather_overlaps`` say which weights; it prices exactly this, the layers' weights only, the
root's conservatively in line):

- A ZeRO-0 weight's gradient all-reduces, per bucket (:class:`ReductionBucket`), as DDP runs
  them: the ZeRO-0 weights, in the order the backward makes their gradients final
  (``storage.ready_order``), are packed into buckets by DDP's caps (1 MiB of local gradient
  first, 25 MiB after: ``storage.assign_buckets``; weights reduced over other process groups
  apart). In the backward that syncs gradients (the last micro-batch's), once the last
  gradient of a bucket is final, the bucket's all-reduces start together, in place and
  asynchronously: one coalesced call per process group (``dist._coalescing_manager``; on NCCL
  one grouped launch, no copy). The end of the backward waits for them before the reduced
  gradients are used (:meth:`ParamStore.finish_gradients`); a bucket some of whose gradients
  never came reduces them in line then. That holds nothing longer than the in-line reduction
  did: each gradient is kept until the end of the backward either way. (gloo's
  ``allreduce_coalesced`` copies the bucket into one flat buffer on its own thread and back:
  on CPU a bucket's bytes more while it runs, which memory tracking on the caller's thread
  does not see and the model, pricing NCCL, does not hold.) ``problem/storage.py`` prices each
  weight's all-reduce as a share of its bucket's call.
- A ZeRO-1 weight's reduction, off a pipeline, where it is stored over one mesh axis that
  splits its local weight evenly and its gradient is a partial sum there: the same, its all-reduces (over the
  other partial axes) then its reduce-scatter into a new shard. The shard exists from the start
  of the reduce-scatter, beside the whole gradient, to the end of the backward (the model
  prices it there); the whole gradient is kept until then too, as in line.
- A ZeRO-1 or ZeRO-2 weight's all-gather of its updated shards, on one such axis: the optimizer
  step's hook starts it, in place (the shard is this rank's slot of the compute weight's flat
  buffer: nothing is allocated), and the weight's first use in the next forward waits for it
  (:meth:`ParamStore.wait_gathered`), as Megatron-LM's ``--overlap-param-gather`` does. Whatever
  else reads or writes the shards waits first: the next optimizer step, the state dicts.

On NCCL a collective issued from the compute stream waits for its input's producer and runs on
NCCL's stream beside the next kernels; ``wait`` makes the compute stream wait. On gloo it runs on
gloo's thread. A chain (a gradient partial over several axes: all-reduced axis by axis, then
reduce-scattered) issues each collective once the one before has completed (on CUDA through a
side stream: neither the caller nor the compute stream waits; on CPU the caller waits for all
but the last). Every other collective runs in line: a ZeRO-2 reduction (it frees the whole
gradient at once; run beside the compute it would hold it until waited for), ZeRO-3 gathers
and reductions (a prefetched gather would hold the weights earlier than the model prices), a
ZeRO-1/2 weight stored over several axes or split unevenly, and the resharding between ops.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from memshard.core.graph import Graph
from memshard.core.placement import PARTIAL, REPLICATE, Layout, Partial, Shard
from memshard.problem.storage import assign_buckets, gather_overlaps, reduction_overlaps
from memshard.runtime.reshard import local_of, reshard_local, to_torch


def compute_dtype(graph: Graph) -> torch.dtype:
    """The dtype of a built graph's weights and activations: bf16 under mixed precision
    (its fp32 master weights are the optimizer's, ``optim.LeanAdam``), else fp32."""
    return torch.bfloat16 if graph.precision.param_bytes == 2 else torch.float32


def made(x) -> torch.Tensor:
    """A model input, or one the module's code makes where it is read (a callable, as
    ``traced.MadeInput``), made now."""
    return x() if callable(x) else x


def _flat_range(n: int, axes: tuple[int, ...], mesh: DeviceMesh, coords) -> tuple[int, int]:
    """This rank's piece of a flat buffer of ``n`` split over ``axes`` in order (torch.chunk)."""
    start = 0
    for a in axes:
        m = mesh.size(a)
        c = -(-n // m)
        i = coords[a]
        start += i * c
        n = max(0, min(c, n - i * c))
    return start, n


def gather_flat(shard: torch.Tensor, numel: int, mesh: DeviceMesh, axes: tuple[int, ...],
                flat_sharded: Layout, dtype: torch.dtype) -> torch.Tensor:
    """The whole flat buffer of ``numel`` elements in ``dtype`` from this rank's piece (split
    over ``axes`` in order). A piece in another dtype (the fp32 master of a mixed-precision
    ZeRO-3 weight) split evenly is cast straight into its place in the output and gathered
    there, innermost axis first, as FSDP2 casts into its all-gather buffer: no copy of the
    piece besides; otherwise the piece in ``dtype`` is resharded (:func:`reshard_local`)."""
    ways = math.prod(mesh.size(a) for a in axes)
    if shard.dtype == dtype or numel % ways:
        whole = tuple(REPLICATE for _ in flat_sharded)
        return reshard_local(shard.detach().to(dtype), (numel,), mesh, flat_sharded, whole, reverse=True)
    coords = mesh.get_coordinate()
    out = shard.new_empty(numel, dtype=dtype)
    out.narrow(0, *_flat_range(numel, axes, mesh, coords)).copy_(shard.detach())
    for k in reversed(range(len(axes))):
        region = out.narrow(0, *_flat_range(numel, axes[:k], mesh, coords))
        piece = region.numel() // mesh.size(axes[k])
        dist.all_gather_single(region, region.narrow(0, coords[axes[k]] * piece, piece),
                              group=mesh.get_group(axes[k]))
    return out


def all_reduce_together(flats: list[torch.Tensor], group: dist.ProcessGroup):
    """Start the all-reduces of ``flats`` in place over ``group`` as one coalesced call
    (``allreduce_coalesced``: on NCCL one grouped launch; gloo copies them into one flat buffer
    on its thread and back) and return its handle (one ``dist.Work`` for all) without waiting."""
    with dist._coalescing_manager(group, async_ops=True) as together:
        for flat in flats:
            dist.all_reduce(flat, group=group, async_op=True)
    (work,) = together.works  # (the coalesced call's: torch's fast path for all-reduces)
    return work


def start_all_reduces(flat: torch.Tensor | list[torch.Tensor], groups: tuple, stream: torch.cuda.Stream | None = None,
                      scatter: tuple[torch.Tensor, dist.ProcessGroup] | None = None) -> dist.Work | None:
    """Start the all-reduces of ``flat`` (a list: all-reduced together, :func:`all_reduce_together`)
    in place over ``groups`` in order, then (``scatter``: an output and a group) its
    reduce-scatter into that output, each once the one before has completed, and return the last
    one's handle (a ``dist.Work``; ``None`` for none) without waiting for it. A later one waits
    for the one before on ``stream`` (a side CUDA stream) where one is given, else in the caller
    (gloo's handles)."""
    if isinstance(flat, list):
        calls = [functools.partial(all_reduce_together, flat, group) for group in groups]
    else:
        calls = [functools.partial(dist.all_reduce, flat, group=group, async_op=True) for group in groups]
    if scatter is not None:
        out, group = scatter
        calls.append(functools.partial(dist.reduce_scatter_single, out, flat, group=group, async_op=True))
    work = None
    for call in calls:
        if work is not None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                work.wait()
                work = call()
        else:
            work = call()
    return work


@dataclass
class StartedReduction:
    """A gradient whose reduction runs beside the backward: at ZeRO-0 its flat buffer, all-reduced
    in place (the reduced gradient); at ZeRO-1 the shard its reduce-scatter writes; and the
    handle of its last collective (``None``: nothing to reduce)."""

    reduced: torch.Tensor
    work: dist.Work | None


class ReductionBucket:
    """ZeRO-0 weights whose gradients are all-reduced together (:func:`reduction_buckets`): once
    the last of them is final in the backward that syncs, one coalesced call per process group
    (:func:`all_reduce_together`, chained as :func:`start_all_reduces` chains), in place."""

    def __init__(self, stores: list[ParamStore]):
        self.stores = stores
        self.arrived = 0
        for store in stores:
            store.bucket = self

    def gradient_final(self, stream: torch.cuda.Stream | None = None) -> None:
        """One member's gradient is final: start the bucket's all-reduces if it was the last."""
        self.arrived += 1
        if self.arrived < len(self.stores):
            return
        self.arrived = 0
        flats = [store.local_gradient() for store in self.stores]
        work = start_all_reduces(flats, self.stores[0].all_reduce_groups, stream)
        for store, flat in zip(self.stores, flats):
            store.started = StartedReduction(flat, work)

    def reset(self) -> None:
        """Forget the members that arrived (the backward ended before the last did: they reduce
        in line, :meth:`ParamStore.finish_gradients`)."""
        self.arrived = 0


def reduction_buckets(stores: dict[str, ParamStore], order: list[str], reduce_bytes: int) -> list[ReductionBucket]:
    """The ZeRO-0 weights of ``stores`` that all-reduce their gradients beside the backward,
    bucketed as ``problem/storage.py`` prices them: in ``order`` (the order their gradients
    become final, ``storage.ready_order``), apart by process groups and dtype, a bucket closing at DDP's
    caps (``storage.assign_buckets``) of their local gradients in the reduce dtype
    (``reduce_bytes`` an element)."""
    by_groups: dict[tuple, list[ParamStore]] = {}
    for name in order:
        store = stores.get(name)
        if store is not None and store.stage == 0 and store.reduces_beside and store.all_reduce_groups:
            by_groups.setdefault((store.all_reduce_groups, store.compute_dtype), []).append(store)
    buckets = []
    for members in by_groups.values():
        index = assign_buckets([store.numel * reduce_bytes for store in members])
        for b in range(index[-1] + 1):
            buckets.append(ReductionBucket([store for store, k in zip(members, index) if k == b]))
    return buckets


class ParamStore:
    """One parameter under a plan: compute layout, gradient layout, ZeRO stage and axes."""

    def __init__(self, name: str, full: torch.Tensor, compute: Layout, grad: Layout, stage: int,
                 axes: tuple[int, ...], mesh: DeviceMesh, uses: int, in_unit: bool = False,
                 shard_dtype: torch.dtype | None = None, in_pipeline: bool = False):
        self.name, self.mesh, self.stage, self.axes, self.uses = name, mesh, stage, axes, uses
        self.compute_dtype = full.dtype
        self.unit: GatherUnit | None = None  # set by the unit that stores this weight
        self.compute, self.grad = compute, grad
        self.shape = tuple(full.shape)
        self.module_shape = self.shape  # a state dict's (the module's, where a trace reshaped it)
        coords = mesh.get_coordinate() or [0] * mesh.ndim
        dt = distribute_tensor(full, mesh, to_torch(compute), src_data_rank=None)
        self.local_shape = tuple(dt.to_local().shape)
        self.numel = math.prod(self.local_shape)
        self.flat_start, self.flat_len = _flat_range(self.numel, axes, mesh, coords)
        # The flat buffer's layout: partial where the gradient is a partial sum, sharded over
        # the storage axes; the axes splitting the compute shard play no part.
        self.flat_partial = tuple(PARTIAL if isinstance(p, Partial) else REPLICATE for p in grad)
        self.flat_sharded = tuple(Shard(0) if a in axes else REPLICATE for a in range(mesh.ndim))
        # the process groups of the gradient's all-reduces: the axes where it is a partial sum
        # and not stored (stage 0: all of them)
        self.all_reduce_groups = tuple(mesh.get_group(a) for a, p in enumerate(self.flat_partial)
                                       if isinstance(p, Partial) and (stage == 0 or a not in axes))
        self.pending: torch.Tensor | None = None
        self.outstanding = 0
        self.on_gradient: Callable[[torch.Tensor], None] | None = None  # a memory meter's
        # stages 0 and 1: the model's, told that this store's local gradient arrived (one that
        # ``reduces_beside`` starts its reduction then if gradient sync is on; the model
        # finishes the reductions when the backward ends)
        self.on_local_gradient: Callable[[ParamStore], None] | None = None
        self.started: StartedReduction | None = None  # stages 0 and 1: a reduction running
        self.bucket: ReductionBucket | None = None  # stage 0: the weights all-reduced with this one
        # What runs beside the compute (``problem.storage``'s rules, which price it): the
        # gradient's reduction, and (stages 1 and 2) the gather of the updated shards.
        local_numel = math.prod(self.local_shape)
        partial_axes = tuple(a for a, p in enumerate(grad) if isinstance(p, Partial))
        axis_sizes = tuple((size,) for size in mesh.shape)
        self.reduces_beside = reduction_overlaps(stage, axes, partial_axes, axis_sizes, local_numel, in_pipeline)
        self.gathers_beside = gather_overlaps(stage, axes, axis_sizes, local_numel)
        self.gathering: dist.Work | None = None  # stages 1 and 2: the updated shards' all-gather
        # The optimizer's parameter (``opt``) is this rank's flat shard as a 1-D DTensor of the
        # parameter's size: ``Shard(0)`` over the axes that split the compute weight or store
        # it, ``Replicate`` over the rest. The element order is the plan's, not ``torch.chunk``'s,
        # but every element lies on the ranks the placements say, so a reduction over the mesh
        # (``torch.nn.utils.clip_grad_norm_``) counts each once.
        self.flat_placements = tuple(
            TorchShard(0) if isinstance(p, Shard) or (stage >= 1 and a in axes) else TorchReplicate()
            for a, p in enumerate(compute))
        self.shard: torch.Tensor | None = None  # the plain local tensor of ``opt``
        self.opt: nn.Parameter | None = None
        self.gathered_version = (0, 0)
        # ZeRO-3: what a use's gather hangs on in autograd, so that its backward runs; the
        # gradient goes to the shard by hand (``accumulate``), none through autograd
        self.anchor = torch.empty(0, device=full.device, requires_grad=True)
        if stage < 3:
            self.param = nn.Parameter(dt)
            flat = dt.to_local().view(-1)
            piece = flat[self.flat_start:self.flat_start + self.flat_len] if stage >= 1 else flat
            self.hold_shard(piece)  # shares storage with the DTensor's local tensor
            self.param.register_post_accumulate_grad_hook(lambda p: self._gradient_arrived())
        elif in_unit:
            self.local = dt.to_local().reshape(-1)  # the unit takes its piece, then drops this
            self.param = None
        else:  # the shard is the master weight (``shard_dtype``): gathered in the compute dtype
            flat = dt.to_local().reshape(-1)
            piece = flat[self.flat_start:self.flat_start + self.flat_len]
            self.hold_shard(piece.to(shard_dtype or piece.dtype, copy=True))
            self.param = self.opt
        del dt

    def flat_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's flat shard, or a tensor of its size) as the 1-D DTensor the
        optimizer sees (``flat_placements``); no communication."""
        return DTensor.from_local(local.reshape(-1), self.mesh, self.flat_placements, run_check=False,
                                  shape=(math.prod(self.shape),), stride=(1,))

    def hold_shard(self, shard: torch.Tensor) -> None:
        """Make ``shard`` (a plain flat tensor) this rank's shard, and ``opt`` its DTensor."""
        self.shard = shard
        self.opt = nn.Parameter(self.flat_dtensor(shard))
        self.gathered_version = self.version()

    def version(self) -> tuple[int, int]:
        """The shard's version: an in-place change through the parameter moves it on."""
        return self.opt._version, local_of(self.opt)._version

    # gradient reduction: all-reduce the axes the storage does not shard, then reduce-scatter
    # over the storage axes (``problem/storage.py``'s sync_calls prices exactly this).
    def _reduce(self, local_grad: torch.Tensor) -> torch.Tensor:
        flat = local_grad.reshape(-1)
        for group in self.all_reduce_groups:
            dist.all_reduce(flat, group=group)  # in place: no second copy
        if self.stage == 0:
            return flat
        src = tuple(p if a in self.axes else REPLICATE for a, p in enumerate(self.flat_partial))
        return reshard_local(flat, (self.numel,), self.mesh, src, self.flat_sharded)

    @torch.no_grad()
    def accumulate(self, g: torch.Tensor) -> None:
        """Add ``g`` (this rank's reduced flat gradient) to the shard's gradient (cast to the
        shard's dtype: an fp32 master's gradient is fp32, as autograd casts it)."""
        g = g.to(self.opt.dtype)
        if self.opt.grad is None:
            self.opt.grad = self.flat_dtensor(g)
        else:
            local_of(self.opt.grad).add_(g.reshape(-1))
        if self.on_gradient is not None:
            self.on_gradient(local_of(self.opt.grad))

    def _reduce_now(self) -> None:
        g = self.param.grad
        self.param.grad = None
        local = torch.zeros(self.local_shape, device=self.param.device, dtype=self.param.dtype) if g is None else (g.to_local() if isinstance(g, DTensor) else g)
        self.accumulate(self._reduce(local))

    def _gradient_arrived(self) -> None:
        """A backward's gradient is in the compute weight's ``.grad`` (stages 0 to 2): stage 2
        reduce-scatters it now; stages 0 and 1 tell the model."""
        if self.on_gradient is not None:
            g = self.param.grad
            self.on_gradient(g.to_local() if isinstance(g, DTensor) else g)
        if self.stage == 2:
            self._reduce_now()
        elif self.on_local_gradient is not None:
            self.on_local_gradient(self)

    def start_reduction(self, stream: torch.cuda.Stream | None = None) -> None:
        """Stage 0 or 1 (``reduces_beside``), its gradient final in a backward that syncs
        gradients: start its all-reduces in place and (stage 1) its reduce-scatter into a new
        shard, beside the rest of the backward (``start_all_reduces``; ``stream``: the side
        stream that chains them on CUDA). :meth:`finish_gradients` waits for them; the
        gradient is kept until then, as in line."""
        if self.bucket is not None:
            self.bucket.gradient_final(stream)
            return
        flat = self.local_gradient()
        if self.stage == 0:
            self.started = StartedReduction(flat, start_all_reduces(flat, self.all_reduce_groups, stream))
            return
        shard = flat.new_empty(self.flat_len)
        work = start_all_reduces(flat, self.all_reduce_groups, stream, (shard, self.mesh.get_group(self.axes[0])))
        self.started = StartedReduction(shard, work)

    def local_gradient(self) -> torch.Tensor:
        """The compute weight's local gradient, flat (a view)."""
        g = self.param.grad
        return (g.to_local() if isinstance(g, DTensor) else g).reshape(-1)

    def drop_started(self) -> None:
        """Forget the all-reduces a backward started and did not finish (it raised): their
        collectives go on and free their buffers when done."""
        self.started = None
        if self.bucket is not None:
            self.bucket.reset()

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward (stages 0 and 1): wait for the collectives it
        started, or reduce now; the reduced gradient goes to the shard's."""
        started, self.started = self.started, None
        if self.bucket is not None:
            self.bucket.reset()
        if started is not None:
            if started.work is not None:
                started.work.wait()
            self.param.grad = None
            self.accumulate(started.reduced)
        elif self.stage <= 1:
            self._reduce_now()

    def is_updated(self) -> bool:
        """Whether the shard changed through its parameter since its compute weight was
        gathered (stages 1 and 2). (An optimizer's ``foreach`` update of a DTensor moves no
        version on: its step hook gathers regardless, ``gather_updated(force=True)``.)"""
        return self.stage in (1, 2) and self.version() != self.gathered_version

    @torch.no_grad()
    def gather_updated(self, force: bool = False, beside: bool = False) -> None:
        """Stages 1 and 2: gather the updated shards back into the compute weight, if the shard
        changed since the last gather (or ``force``). ``beside`` (after an optimizer step), where
        ``gathers_beside``: start the all-gather in place (the shard is the rank's own slot of the
        compute weight) and return; :meth:`wait_gathered` waits for it. A gather still running
        is left to run."""
        if self.gathering is not None or not (self.stage in (1, 2) and (force or self.is_updated())):
            return
        if beside and self.gathers_beside:
            flat = self.param.to_local().view(-1)
            self.gathering = dist.all_gather_single(flat, self.shard, group=self.mesh.get_group(self.axes[0]),
                                                    async_op=True)
            self.gathered_version = self.version()
            return
        full = reshard_local(self.shard.detach(), (self.numel,), self.mesh, self.flat_sharded,
                             tuple(REPLICATE for _ in self.flat_sharded), reverse=True)
        self.param.to_local().view(-1).copy_(full)
        self.gathered_version = self.version()

    def wait_gathered(self) -> None:
        """Wait for the all-gather :meth:`gather_updated` started beside the compute, if one runs
        (the compute weight is whole after it)."""
        gathering, self.gathering = self.gathering, None
        if gathering is not None:
            gathering.wait()
            self.gathered_version = self.version()

    def after_step(self) -> None:
        """What an optimizer step hook does for this parameter (:meth:`gather_updated`)."""
        self.gather_updated()

    def gather(self) -> torch.Tensor:
        full = gather_flat(self.shard, self.numel, self.mesh, self.axes, self.flat_sharded, self.compute_dtype)
        return full.view(self.local_shape)

    def weight(self) -> tuple[torch.Tensor, Callable | None]:
        """The local compute weight for one use, and (stage 3) how to gather it again."""
        if self.stage < 3:
            if self.gathering is not None:  # its first use since the optimizer step
                self.wait_gathered()
                self.gather_updated()  # (in line, if the shard changed since the gather began)
            return self.param.to_local(grad_placements=to_torch(self.grad)), None
        return _GatherForUse.apply(self.anchor, self), self.gather


class _GatherForUse(torch.autograd.Function):
    """ZeRO-3: gather the weight for one use; backward reduces the gradient of all uses of
    this micro-batch once, straight into the shard's gradient (``ParamStore.accumulate``)."""

    @staticmethod
    def forward(ctx, anchor, store: ParamStore):
        ctx.store = store
        store.outstanding += 1
        return store.gather()

    @staticmethod
    def backward(ctx, grad):
        store = ctx.store
        store.pending = grad if store.pending is None else store.pending.add_(grad)
        store.outstanding -= 1
        if store.outstanding:
            return None, None
        g, store.pending = store.pending, None
        store.accumulate(store._reduce(g))
        return None, None


class GatherUnit:
    """ZeRO-3 weights of one layer stored as one flat shard (``zero3_unit="layer"``).

    The members' local compute shards, concatenated, are split over the storage axes like
    one parameter's flat buffer; an all-gather gives the whole concatenation, each member a
    view of it (no copy). Forward gathers it at the layer's first use and drops it after
    the last; backward gathers it again at the first saved weight it needs and drops it
    after the last. The members' gradients wait until every use's backward has run, are
    copied into one flat buffer, all-reduced over the axes where they are partial sums and
    not stored (per run of members alike), and reduce-scattered once into the shard
    (``problem.LayerUnit`` prices these steps).

    As FSDP2 does, the optimizer sees each member as a parameter of its own: the part of this
    rank's flat shard that lies in the member (maybe empty), a 1-D DTensor of the member's
    size (``ParamStore.opt``), its gradient a view of the unit's reduced gradient."""

    def __init__(self, stores: list[ParamStore], mesh: DeviceMesh, shard_dtype: torch.dtype | None = None):
        self.stores, self.mesh = stores, mesh
        first = stores[0]
        self.axes, self.flat_sharded = first.axes, first.flat_sharded
        # Partial over a storage axis: reduce-scattered; else (the rest) all-reduced first.
        self.src = tuple(p if a in self.axes else REPLICATE for a, p in enumerate(first.flat_partial))
        self.offsets, self.reduce_ranges = [], []
        start = 0
        for store in stores:
            self.offsets.append(start)
            axes = tuple(a for a, p in enumerate(store.flat_partial) if isinstance(p, Partial) and a not in self.axes)
            if self.reduce_ranges and self.reduce_ranges[-1][2] == axes and self.reduce_ranges[-1][1] == start:
                self.reduce_ranges[-1] = (self.reduce_ranges[-1][0], start + store.numel, axes)
            elif axes:
                self.reduce_ranges.append((start, start + store.numel, axes))
            start += store.numel
        self.numel = start
        coords = mesh.get_coordinate() or [0] * mesh.ndim
        lo, n = _flat_range(self.numel, self.axes, mesh, coords)
        flat = torch.cat([store.local for store in stores])
        self.compute_dtype = flat.dtype
        self.shard = flat[lo:lo + n].to(shard_dtype or flat.dtype, copy=True)
        del flat
        for k, (store, (begin, end)) in enumerate(zip(stores, self.member_pieces())):
            store.unit, store.unit_index, store.local = self, k, None
            store.hold_shard(self.shard[begin:end])
        self.uses = sum(store.uses for store in stores)  # member uses per forward pass
        self.forward_flat: torch.Tensor | None = None
        self.left = 0
        self.pending: dict[int, torch.Tensor] = {}
        self.outstanding = 0
        self.regather = _UnitRegather(self)

    def gather(self) -> torch.Tensor:
        return gather_flat(self.shard, self.numel, self.mesh, self.axes, self.flat_sharded, self.compute_dtype)

    def member(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        store = self.stores[k]
        return flat.narrow(0, self.offsets[k], store.numel).view(store.local_shape)

    def weight(self, k: int) -> tuple[torch.Tensor, Callable]:
        """Member ``k``'s local weight for one forward use, and how to make it again."""
        if self.forward_flat is None:
            self.forward_flat, self.left = self.gather(), self.uses
        flat = self.forward_flat
        self.left -= 1
        if not self.left:  # the last use: the op's arguments hold the buffer until it returns
            self.forward_flat = None
        return _UnitUse.apply(self.stores[k].anchor, self, k, flat), self.regather

    def piece_range(self) -> tuple[int, int]:
        """Where this rank's shard lies in the unit's flat buffer."""
        lo, n = _flat_range(self.numel, self.axes, self.mesh, self.mesh.get_coordinate() or [0] * self.mesh.ndim)
        return lo, lo + n

    def member_pieces(self) -> list[tuple[int, int]]:
        """Each member's part of this rank's shard: its range there (empty where none)."""
        lo, hi = self.piece_range()
        out = []
        for store, start in zip(self.stores, self.offsets):
            begin = min(max(lo, start), hi) - lo
            out.append((begin, max(begin, min(hi, start + store.numel) - lo)))
        return out

    def accumulate(self, reduced: torch.Tensor) -> None:
        """This rank's shard of the unit's reduced gradient into the members' gradients
        (views of it, the first time)."""
        reduced = reduced.to(self.shard.dtype)
        for store, (begin, end) in zip(self.stores, self.member_pieces()):
            store.accumulate(reduced[begin:end])

    def reduce(self) -> torch.Tensor:
        """The members' summed gradients as this rank's shard of the unit's gradient."""
        pending = self.pending
        self.pending = {}
        flat = torch.cat([pending[k].reshape(-1) for k in range(len(self.stores))])
        for start, end, axes in self.reduce_ranges:
            for a in axes:
                dist.all_reduce(flat[start:end], group=self.mesh.get_group(a))
        return reshard_local(flat, (self.numel,), self.mesh, self.src, self.flat_sharded)


class _UnitRegather:
    """A unit's weights made again in backward: one all-gather serves every saved member view
    (``replay.pack_again`` counts them as they are saved and made again)."""

    def __init__(self, unit: GatherUnit):
        self.unit = unit
        self.flat: torch.Tensor | None = None
        self.saved = 0

    def packed(self) -> None:
        self.saved += 1

    def hold(self) -> Callable[[], None]:
        """Gather the unit for a replay (if not yet) and keep it until the returned function
        is called; the backward's saved views keep it after that, as usual."""
        if self.flat is None:
            self.flat = self.unit.gather()
        self.saved += 1

        def release() -> None:
            self.saved -= 1
            if not self.saved:
                self.flat = None
        return release

    def __call__(self) -> torch.Tensor:
        if self.flat is None:
            self.flat = self.unit.gather()
        flat = self.flat
        self.saved -= 1
        if not self.saved:
            self.flat = None
        return flat


class _UnitUse(torch.autograd.Function):
    """One use of a unit member's weight; the last use's backward reduces the whole unit."""

    @staticmethod
    def forward(ctx, anchor, unit: GatherUnit, k: int, flat: torch.Tensor):
        ctx.unit, ctx.k = unit, k
        unit.outstanding += 1
        return unit.member(flat, k)

    @staticmethod
    def backward(ctx, grad):
        unit, k = ctx.unit, ctx.k
        unit.pending[k] = grad if k not in unit.pending else unit.pending[k].add_(grad)
        unit.outstanding -= 1
        if not unit.outstanding:
            unit.accumulate(unit.reduce())
        return None, None, None, None
