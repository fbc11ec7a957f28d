"""Run memshard's graph in PyTorch: the reference model, and the same model under a plan.

:class:`GraphModel` is the single-device reference: an ``nn.Module`` holding the full
parameters of a :class:`~memshard.core.graph.Graph` whose forward runs the graph's ops in order
with the kernels of ``ops.py``, so every op of the plan is one piece of code.

:class:`ShardedGraphModel` runs a reference model's graph for a plan on a ``DeviceMesh``
(``parallel.parallelize`` makes it); the reference gives the full parameters and the kernel
table (``ops.KERNELS``, or a traced module's in ``traced.py``), the executor the rest:

- every parameter becomes a DTensor in the layout its op's strategy needs; with ZeRO storage
  (``ParamStore``) the optimizer sees only this rank's flat shard of it, as a 1-D DTensor of
  the parameter's size (the module's parameters are these shards, so any ``torch.optim``
  optimizer over ``parameters()`` trains the plan: ``loop.py``, and torch's
  ``clip_grad_norm_`` reduces over the mesh): stage 1 shards the optimizer states, 2 also the
  gradients (reduce-scattered as soon as each is complete), 3 also the weight (under mixed precision
  the fp32 shard is the master weight, cast to bf16 into its all-gather's output, its reduced
  bf16 gradient cast to fp32: FSDP2's layout), gathered around each use and gathered again in
  backward — or, with the plan's ``zero3_unit="layer"``, all of a layer's such weights as one flat shard
  (``GatherUnit``, FSDP's unit; the optimizer sees each member's part): one all-gather for
  the layer's forward, one for its backward, one reduce-scatter of their gradients;
- every activation is redistributed at each op boundary from its producer's layout to its
  consumer's (``reshard.Reshard``: forward in axis order, gradient in reverse axis order);
- an edge the plan keeps (Megatron's sequence parallelism) saves the producer's smaller
  piece and gathers it again when backward needs it (saved-tensor hooks);
- activations are dropped after their last forward use;
- the gradient reductions run from the backward (post-accumulate-grad hooks: stage 2 at once,
  stages 0 and 1 when the backward ends, unless gradient sync is off); an optimizer step hook
  gathers the updated stage 1-2 shards into the compute weights (``loop.py``); the forward
  returns the global loss on every rank; ``state_dict`` is by the module's names
  (``checkpoint.py``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from memshard.core.graph import Graph, TensorKind
from memshard.core.placement import PARTIAL, REPLICATE, Layout, Partial, Shard
from memshard.problem.gathers import layer_units
from memshard.problem.memory import param_layout
from memshard.problem.records import Problem, Selection
from memshard.problem.strategies import Strategy, input_grad_layout
from memshard.runtime import checkpoint, loop, ops
from memshard.runtime.replay import LayerReplay, ReplayLinks, again_hooks, storage_id
from memshard.runtime.reshard import Reshard, local_of, reshard_local, to_torch, without_partial

INIT_STD = 0.02


def _key(name: str) -> str:
    return name.replace(".", "/")


def compute_dtype(graph: Graph) -> torch.dtype:
    """The dtype of a built graph's weights and activations: bf16 under mixed precision
    (its fp32 master weights are the optimizer's, ``optim.LeanAdam``), else fp32."""
    return torch.bfloat16 if graph.precision.param_bytes == 2 else torch.float32


def init_parameter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic initial value of a parameter from its name: the same on every rank
    and in every sharding. Norm weights start at 1, biases at 0, the rest N(0, 0.02)."""
    leaf = name.rsplit(".", 2)
    if leaf[-1] == "bias":
        return torch.zeros(shape)
    if "norm" in name or "ln_" in name:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 7919 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=gen) * INIT_STD


def make_batch(graph: Graph, micro_batches: int, seed: int, device="cpu") -> list[dict[str, torch.Tensor]]:
    """Random token ids and labels for each micro-batch, identical on every rank."""
    vocab = next(graph.tensors[op.inputs[1].tensor].shape[0] for op in graph.ops if op.kind == "embedding")
    out = []
    for k in range(micro_batches):
        gen = torch.Generator().manual_seed(seed * 1009 + k)
        out.append({
            name: torch.randint(0, vocab, spec.shape, generator=gen).to(device)
            for name, spec in graph.tensors.items() if spec.kind is TensorKind.INPUT
        })
    return out


class Shares(dict):
    """A rank's share of one micro-batch's graph inputs (``ShardedGraphModel.shares``)."""


def made(x) -> torch.Tensor:
    """A model input, or one the module's code makes where it is read (a callable, as
    ``traced.MadeInput``), made now."""
    return x() if callable(x) else x


# -- the interpreter -------------------------------------------------------------------------
@dataclass
class _Boundary:
    """How one consumer input is fed: reshard producer → consumer, and whether it is kept."""

    lp: Layout
    lc: Layout
    gc: Layout
    keep: bool


def _run_graph(
    graph: Graph,
    inputs: dict[str, torch.Tensor],
    kernels: ops.KernelTable,
    context: Callable[[int], ops.OpContext],
    weight: Callable[[int, int], tuple[torch.Tensor, Callable | None]],
    feed: Callable[[int, int, torch.Tensor], tuple[torch.Tensor, Callable | None]],
    input_for: Callable[[int, int, torch.Tensor], torch.Tensor],
    replay: LayerReplay | None = None,
) -> torch.Tensor:
    """Forward of the whole graph; returns the (local) loss.

    ``kernels(op.kind)`` runs each op; ``weight(i, j)`` gives op i's parameter input j and ``feed(i, j, x)`` its activation
    input j, each with a function that makes it again when the op should not save it (a
    ZeRO-3 weight, a kept edge); ``input_for`` slices a model input to op i's layout;
    ``replay`` recomputes the plan's replayed ops (``replay.py``).
    """
    last_use = {t: uses[-1][0] for t, uses in graph.consumers.items()}
    env: dict[str, torch.Tensor] = {}
    for i, op in enumerate(graph.ops):
        args = []
        again: dict[int, Callable] = {}
        for j, operand in enumerate(op.inputs):
            kind = graph.tensors[operand.tensor].kind
            produced = None
            if kind is TensorKind.INPUT:
                x, make = input_for(i, j, inputs[operand.tensor]), None
            elif kind is TensorKind.PARAMETER:
                x, make = weight(i, j)
            else:
                produced = env[operand.tensor]
                x, make = feed(i, j, produced)
            if make is not None:
                again[storage_id(x)] = make
            if replay is not None:
                replay.record(i, j, produced, x)
            args.append(x)
        kernel = kernels(op.kind)
        hooks = replay.hooks(i, args, again) if replay is not None else (again_hooks(again) if again else None)
        if hooks is not None:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                out = kernel(context(i), *args)
        else:
            out = kernel(context(i), *args)
        env[op.output.tensor] = out
        if replay is not None:
            replay.produced(i, out)
        # (the loop's names would keep the last input — a gathered weight, a consumed
        # activation — alive through the next op's reshards)
        del args, again
        x = make = produced = None
        for operand in op.inputs:
            if last_use.get(operand.tensor) == i:
                env.pop(operand.tensor, None)
    return env[graph.loss]


class GraphModel(nn.Module):
    """The single-device reference model of ``graph`` (full parameters, plain tensors).

    A reference model, for :class:`ShardedGraphModel`, has ``graph``, ``seed``,
    ``parameter(name)`` (the full tensor) and ``kernels`` (its :class:`ops.KernelTable`)."""

    kernels = ops.KERNELS

    def __init__(self, graph: Graph, seed: int = 0, device: str | torch.device = "cpu"):
        super().__init__()
        self.graph = graph
        self.seed = seed
        dtype = compute_dtype(graph)
        self.weights = nn.ParameterDict({
            _key(name): nn.Parameter(
                init_parameter(name, graph.tensors[name].shape, seed).to(device, dtype)
                if torch.device(device).type != "meta"
                else torch.empty(graph.tensors[name].shape, device="meta", dtype=dtype)
            )
            for name in graph.parameters
        })
        self.step = 0

    def parameter(self, name: str) -> nn.Parameter:
        return self.weights[_key(name)]

    def module_shape(self, name: str) -> tuple[int, ...]:
        """The parameter's shape in a state dict: the graph's."""
        return self.graph.tensors[name].shape

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        g = self.graph

        def context(i):
            op = g.ops[i]
            return ops.OpContext(g, op, i, Strategy((), (), (), ()), (), (), g.dim_sizes(op), self.step,
                                 next(self.parameters()).device)

        return _run_graph(
            g, inputs, self.kernels, context,
            weight=lambda i, j: (self.parameter(g.ops[i].inputs[j].tensor), None),
            feed=lambda i, j, x: (x, None),
            input_for=lambda i, j, x: made(x),
        )


# -- parameters under a plan -------------------------------------------------------------------
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


class ParamStore:
    """One parameter under a plan: compute layout, gradient layout, ZeRO stage and axes."""

    def __init__(self, name: str, full: torch.Tensor, compute: Layout, grad: Layout, stage: int,
                 axes: tuple[int, ...], mesh: DeviceMesh, uses: int, in_unit: bool = False,
                 shard_dtype: torch.dtype | None = None):
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
        self.pending: torch.Tensor | None = None
        self.outstanding = 0
        self.on_gradient: Callable[[torch.Tensor], None] | None = None  # a memory meter's
        # stages 0 and 1: the model's, told that a local gradient arrived (it reduces them all
        # when the backward ends)
        self.on_local_gradient: Callable[[], None] | None = None
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
        for a, p in enumerate(self.flat_partial):
            if isinstance(p, Partial) and (self.stage == 0 or a not in self.axes):
                dist.all_reduce(flat, group=self.mesh.get_group(a))  # in place: no second copy
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
            self.on_local_gradient()

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward (stages 0 and 1)."""
        if self.stage <= 1:
            self._reduce_now()

    def is_updated(self) -> bool:
        """Whether the shard changed through its parameter since its compute weight was
        gathered (stages 1 and 2). (An optimizer's ``foreach`` update of a DTensor moves no
        version on: its step hook gathers regardless, ``gather_updated(force=True)``.)"""
        return self.stage in (1, 2) and self.version() != self.gathered_version

    @torch.no_grad()
    def gather_updated(self, force: bool = False) -> None:
        """Stages 1 and 2: gather the updated shards back into the compute weight, if the shard
        changed since the last gather (or ``force``)."""
        if self.stage in (1, 2) and (force or self.is_updated()):
            full = reshard_local(self.shard.detach(), (self.numel,), self.mesh, self.flat_sharded,
                                 tuple(REPLICATE for _ in self.flat_sharded), reverse=True)
            self.param.to_local().view(-1).copy_(full)
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


class ShardedGraphModel(nn.Module):
    """The graph of a reference model (a :class:`GraphModel`, or ``traced.TracedReference``)
    run on one rank of ``device_mesh`` under a plan, with the reference's kernels."""

    def __init__(self, model, problem: Problem, selection: Selection, device_mesh: DeviceMesh):
        super().__init__()
        graph = problem.graph
        source = getattr(model, "module", model)  # the module the plan runs (misuse checks)
        if tuple(device_mesh.shape) != problem.mesh.shape:
            raise ValueError(f"device mesh {tuple(device_mesh.shape)} ≠ plan mesh {problem.mesh.shape}")
        self.graph, self.problem, self.selection, self.mesh = graph, problem, selection, device_mesh
        self.seed = model.seed
        self.kernels: ops.KernelTable = model.kernels
        self.step = 0
        self.batch: dict[str, torch.Tensor] = {}
        self.coords = tuple(device_mesh.get_coordinate() or [0] * device_mesh.ndim)
        self.device = torch.device(device_mesh.device_type)
        self.groups = tuple(device_mesh.get_group(a) for a in range(device_mesh.ndim))
        self.strategies = [problem.strategy(selection, problem.op_group[i]) for i in range(len(graph.ops))]
        self.replayed = [problem.replayed(selection, problem.op_group[i]) for i in range(len(graph.ops))]
        uses: dict[str, int] = {}
        for op in graph.ops:
            for x in op.inputs:
                if graph.tensors[x.tensor].kind is TensorKind.PARAMETER:
                    uses[x.tensor] = uses.get(x.tensor, 0) + 1
        units = layer_units(graph, problem.schedule) if problem.zero3_unit == "layer" else {}
        shard_dtype = torch.float32 if graph.precision.master_bytes else None  # ZeRO-3: the master
        self.stores: dict[str, ParamStore] = {}
        members: dict[tuple, list[ParamStore]] = {}
        for name in graph.parameters:
            gid = problem.storage_group[name]
            G, opt = problem.groups[gid].options[selection.choices[gid]]
            grad = tuple(PARTIAL if g == "P" else (REPLICATE if g == "R" else Shard(int(g[1:]))) for g in G)
            full = model.parameter(name).detach().to(self.device)
            in_unit = opt.stage == 3 and name in units
            store = ParamStore(name, full, param_layout(G), grad, opt.stage, opt.axes, device_mesh, uses[name],
                               in_unit, shard_dtype)
            store.module_shape = tuple(model.module_shape(name))
            self.stores[name] = store
            if in_unit:  # one flat shard per layer, storage axes and reduction over them
                key = (units[name], opt.axes, tuple(isinstance(grad[a], Partial) for a in opt.axes))
                members.setdefault(key, []).append(store)
        # Members with the same all-reduce axes next to each other: one all-reduce per run.
        self.units = [GatherUnit(sorted(group, key=lambda st: tuple(
            isinstance(p, Partial) and a not in st.axes for a, p in enumerate(st.flat_partial))), device_mesh,
            shard_dtype) for group in members.values()]
        # With recomputation a layer's unit is gathered for backward when its replay runs.
        self.units_of_layer: dict[int, list[GatherUnit]] = {}
        if problem.recompute != "none":
            for unit in self.units:
                layer = graph.ops[graph.consumers[unit.stores[0].name][0][0]].layer
                self.units_of_layer.setdefault(layer, []).append(unit)
        # The module's parameters are what an optimizer updates: this rank's shards, as 1-D
        # DTensors (a stage 0-2 shard shares storage with its DTensor compute weight,
        # ``store.param``; a unit member's with the unit's flat shard).
        self.weights = nn.ParameterDict({_key(n): s.opt for n, s in self.stores.items()})
        self.requires_gradient_sync = True
        self.local_gradients = False  # stage 0-1 gradients not reduced yet
        self.reduction_queued = False
        self.replicate_loss = True  # forward returns the global loss on every rank
        for store in self.stores.values():
            if store.stage <= 1:
                store.on_local_gradient = self._local_gradient_arrived
        self.source = loop.SourceParameters(source.parameters() if isinstance(source, nn.Module) else ())
        loop.register(self)

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """This rank's shards, which an optimizer updates (the module's parameters)."""
        return list(self.parameters())

    def boundary(self, i: int, j: int) -> _Boundary:
        e = self.problem.edge_of_input[(i, j)]
        producer = self.graph.producer[self.graph.ops[i].inputs[j].tensor]
        lp = self.strategies[producer].output_layout
        lc = self.strategies[i].input_layouts[j]
        gc = input_grad_layout(self.strategies[i], self.graph.ops[i], j)
        keep = bool(self.selection.keeps[e]) and lp != lc
        return _Boundary(lp, lc, gc, keep)

    def _feed(self, i: int, j: int, x: torch.Tensor):
        b = self.boundary(i, j)
        shape = self.graph.tensors[self.graph.ops[i].inputs[j].tensor].shape
        if b.lp == b.lc and b.gc == without_partial(b.lp):
            return x, None
        y = Reshard.apply(x, shape, self.mesh, b.lp, b.lc, b.gc)
        if not b.keep:
            return y, None
        small = x.detach()
        return y, lambda: reshard_local(small, shape, self.mesh, b.lp, b.lc)

    def _slice(self, i: int, j: int, x: torch.Tensor) -> torch.Tensor:
        """The piece of model input ``x`` that op ``i`` reads as its input ``j`` here (a view)."""
        layout = to_torch(self.strategies[i].input_layouts[j])
        return distribute_tensor(x, self.mesh, layout, src_data_rank=None).to_local()

    def _input(self, i: int, j: int, x: torch.Tensor) -> torch.Tensor:
        x = made(x)
        if self.graph.ops[i].inputs[j].tensor in self.graph.loaded_inputs:
            return x  # this rank's share already (``load``)
        return self._slice(i, j, x)

    def shares(self, inputs: dict[str, torch.Tensor]) -> Shares:
        """This rank's share of a micro-batch's graph inputs, as a data loader hands it out:
        of the token ids and labels the slice the one op that reads each reads (views of
        ``inputs``); the others whole."""
        out = Shares(inputs)
        for name, (i, j) in self.graph.loaded_inputs.items():
            out[name] = self._slice(i, j, inputs[name])
        return out

    def load(self, shares: Shares) -> dict[str, torch.Tensor]:
        """The shares in memory of their own, kept until the next micro-batch's (a training
        loop's ``batch``: through the optimizer step)."""
        self.batch = {name: x if callable(x) else x.clone() for name, x in shares.items()}
        return self.batch

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of one micro-batch: the graph's inputs in full, or this rank's ``shares``
        of them cut before the step (then no view of the full batch is made in it)."""
        g = self.graph
        self.gather_updated()  # shards updated by something other than an optimizer step
        inputs = self.load(inputs if isinstance(inputs, Shares) else self.shares(inputs))

        def context(i):
            return ops.OpContext(g, g.ops[i], i, self.strategies[i], self.coords, self.groups,
                                 g.dim_sizes(g.ops[i]), self.step, self.device)

        cache: dict[str, tuple] = {}

        def weight(i, j):
            # One local view per parameter and pass: a tied weight's uses then sum their
            # gradients in one autograd buffer (ZeRO-3 gathers for every use instead).
            name = g.ops[i].inputs[j].tensor
            store = self.stores[name]
            if store.unit is not None:
                return store.unit.weight(store.unit_index)
            if store.stage == 3:
                return store.weight()
            if name not in cache:
                cache[name] = store.weight()
            return cache[name]

        loss = _run_graph(
            g, inputs, self.kernels, context,
            weight=weight,
            feed=self._feed,
            input_for=self._input,
            replay=self._replay(inputs, context) if any(self.replayed) or self.units_of_layer else None,
        )
        groups = self.loss_groups() if self.replicate_loss else ()
        return loop.SumOverAxes.apply(loss, groups) if groups else loss

    def _replay(self, inputs: dict[str, torch.Tensor], context) -> LayerReplay:
        g = self.graph

        def weight(i, j):
            store = self.stores[g.ops[i].inputs[j].tensor]
            if store.unit is not None:
                release = store.unit.regather.hold()
                return store.unit.member(store.unit.regather.flat, store.unit_index), release
            if store.stage == 3:
                return store.gather(), None
            return store.weight()[0], None

        def hold(layer):
            releases = [unit.regather.hold() for unit in self.units_of_layer[layer]]
            return lambda: [release() for release in releases]

        def reshard(i, j, x):
            b = self.boundary(i, j)
            return reshard_local(x, self.graph.tensors[g.ops[i].inputs[j].tensor].shape, self.mesh, b.lp, b.lc)

        links = ReplayLinks(
            kernel=lambda i: self.kernels(g.ops[i].kind), context=context,
            model_input=lambda i, j: self._input(i, j, inputs[g.ops[i].inputs[j].tensor]),
            weight=weight, reshard=reshard, same_layout=lambda i, j: self.boundary(i, j).lp == self.boundary(i, j).lc,
            layer_hold=hold, unit_layers=frozenset(self.units_of_layer))
        return LayerReplay(g, self.replayed, links)

    def watch_gradients(self, callback: Callable[[torch.Tensor], None] | None) -> None:
        """Call ``callback`` on every gradient buffer of a stage 0-2 weight and every reduced
        gradient the optimizer will read."""
        for store in self.stores.values():
            store.on_gradient = callback

    # -- the training loop (``loop.py``) ---------------------------------------------------------
    def set_requires_gradient_sync(self, requires: bool) -> None:
        """Whether the next backwards reduce the gradients of ZeRO stages 0 and 1 when they end
        (FSDP2's name). Off for every micro-batch but the last, they accumulate locally and
        the last one's backward reduces their sum once, as the plan prices. Stages 2 and 3
        reduce every micro-batch's gradients as they are made either way (the plan prices
        that too)."""
        self.requires_gradient_sync = requires

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside do not reduce stage 0-1 gradients (DDP's name; see
        :meth:`set_requires_gradient_sync`)."""
        before = self.requires_gradient_sync
        self.requires_gradient_sync = False
        try:
            yield
        finally:
            self.requires_gradient_sync = before

    def _local_gradient_arrived(self) -> None:
        self.local_gradients = True
        if self.requires_gradient_sync and not self.reduction_queued:
            self.reduction_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.reduction_queued = False
        self.finish_gradients()

    def finish_gradients(self) -> None:
        """Reduce the stage 0-1 gradients now, if some wait. The backward with gradient sync on
        does this when it ends; a loop that keeps gradient sync off may call it instead."""
        if not self.local_gradients:
            return
        self.local_gradients = False
        for store in self.stores.values():
            store.finish_gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The shards' gradients, and the stage 0-1 local gradients waiting to be reduced."""
        super().zero_grad(set_to_none)
        for store in self.stores.values():
            if store.unit is None and store.stage < 3:
                store.param.grad = None
        self.local_gradients = False

    def gather_updated(self, held: set[int] = frozenset()) -> None:
        """Gather the shards updated since their last gather into the compute weights (ZeRO
        1-2): those changed through their parameters, and those of ids ``held`` (an optimizer's
        step updates its parameters in place)."""
        for store in self.stores.values():
            store.gather_updated(force=id(store.opt) in held)

    def after_step(self) -> None:
        """Gather the updated shards (an optimizer's step hook does this by itself)."""
        self.gather_updated()

    def check_optimizer(self, held: set[int], keeps_masters: bool = False) -> None:
        """Before a step of an optimizer holding the parameters of ids ``held`` (keeping fp32
        master weights of low-precision ones or not): raise if it cannot be right for this
        model (``loop.check_step``)."""
        mine = {id(p) for p in self.parameters()}
        has_gradients = self.local_gradients or any(p.grad is not None for p in self.parameters())
        low = set()
        if self.graph.precision.master_bytes and not keeps_masters:
            low = {id(p) for p in self.parameters() if p.dtype != torch.float32}
        loop.check_step(self.source, held, mine, has_gradients, self.local_gradients, low)

    def after_optimizer_step(self, held: set[int]) -> None:
        """After a step of an optimizer holding the parameters of ids ``held``: if it holds
        this model's, gather the updated shards and move the step count on."""
        if any(id(p) in held for p in self.parameters()):
            self.gather_updated(held)
            self.step += 1

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)``: the norm of the whole
        model's gradients (each element counted once, whichever ranks hold it: the shards are
        DTensors), the same on every rank, as a plain tensor; the gradients scaled to at most
        ``max_norm``."""
        total = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type, foreach=foreach)
        return total.full_tensor() if isinstance(total, DTensor) else total

    def state_dict(self, *args, **kwargs) -> dict[str, DTensor]:
        """Every parameter by the module's own name (``lm_head.weight``): a DTensor of its
        shape in its compute layout under the plan (``checkpoint.py``)."""
        return checkpoint.model_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False) -> None:
        """Load parameters by the module's names: DTensors in any layout on this mesh (as
        ``torch.distributed.checkpoint`` loads them into :meth:`state_dict`'s), or full tensors."""
        unexpected = set(state_dict) - set(self.graph.parameters)
        if strict and unexpected:
            raise KeyError(f"unexpected keys in the state dict: {', '.join(sorted(unexpected)[:5])}")
        checkpoint.load_model_state_dict(self, state_dict)

    @torch.no_grad()
    def full_gradient(self, name: str) -> torch.Tensor:
        """The whole reduced gradient of parameter ``name`` (gathered; for checks)."""
        store = self.stores[name]
        if store.unit is not None:
            unit = store.unit
            piece = torch.cat([local_of(s.opt.grad).reshape(-1) for s in unit.stores])
            flat = reshard_local(piece, (unit.numel,), self.mesh, unit.flat_sharded,
                                 tuple(REPLICATE for _ in unit.flat_sharded), reverse=True)
            local = unit.member(flat, store.unit_index)
            return reshard_local(local, store.shape, self.mesh, store.compute,
                                 tuple(REPLICATE for _ in store.compute), reverse=True)
        g = local_of(store.opt.grad).detach()
        if store.stage >= 1:
            g = reshard_local(g, (store.numel,), self.mesh, store.flat_sharded,
                              tuple(REPLICATE for _ in store.flat_sharded), reverse=True)
        local = g.reshape(store.local_shape)
        return reshard_local(local, store.shape, self.mesh, store.compute,
                             tuple(REPLICATE for _ in store.compute), reverse=True)

    def loss_groups(self) -> tuple:
        """The process groups of the mesh axes over which each rank holds a partial loss."""
        layout = self.strategies[self.graph.producer[self.graph.loss]].output_layout
        return tuple(self.groups[a] for a, p in enumerate(layout) if isinstance(p, Partial))

    def loss_value(self, loss: torch.Tensor) -> float:
        """The global loss from what forward returned: this rank's partial piece (summed over
        the axes that split it) or, with ``replicate_loss``, the global loss itself."""
        t = loss.detach().clone()
        if not self.replicate_loss:
            for group in self.loss_groups():
                dist.all_reduce(t, group=group)
        if is_fake(t):  # memshard simulate (FakeTensorMode): there is no value to read
            return math.nan
        return float(t)

