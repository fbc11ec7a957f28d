"""Run memshard's graph in PyTorch: the reference model, and the same model under a plan.

:class:`GraphModel` is the single-device reference: an ``nn.Module`` holding the full
parameters of a :class:`~memshard.core.graph.Graph` whose forward runs the graph's ops in order
with the kernels of ``ops.py``, so every op of the plan is one piece of code.

:class:`ShardedGraphModel` runs a reference model's graph for a plan on a ``DeviceMesh``
(``parallel.parallelize`` makes it); the reference gives the full parameters and the kernel
table (``ops.KERNELS``, or a traced module's in ``traced.py``), the executor the rest:

- every parameter becomes a DTensor in the layout its op's strategy needs; with ZeRO storage
  (``stores.ParamStore``) the optimizer sees only this rank's flat shard of it, as a 1-D DTensor of
  the parameter's size (the module's parameters are these shards, so any ``torch.optim``
  optimizer over ``parameters()`` trains the plan: ``loop.py``, and torch's
  ``clip_grad_norm_`` reduces over the mesh): stage 1 shards the optimizer states, 2 also the
  gradients (reduce-scattered as soon as each is complete), 3 also the weight (under mixed precision
  the fp32 shard is the master weight, cast to bf16 into its all-gather's output, its reduced
  bf16 gradient cast to fp32: FSDP2's layout), gathered around each use and gathered again in
  backward — or, with the plan's ``zero3_unit="layer"``, all of a layer's such weights as one flat shard
  (``stores.GatherUnit``, FSDP's unit; the optimizer sees each member's part): one all-gather for
  the layer's forward, one for its backward, one reduce-scatter of their gradients;
- every activation is redistributed at each op boundary from its producer's layout to its
  consumer's (``reshard.Reshard``: forward in axis order, gradient in reverse axis order);
- an edge the plan keeps (Megatron's sequence parallelism) saves the producer's smaller
  piece and gathers it again when backward needs it (saved-tensor hooks);
- activations are dropped after their last forward use;
- the gradient reductions run from the backward (post-accumulate-grad hooks: stage 2 at once,
  stages 0 and 1 when the backward ends, unless gradient sync is off; where ``stores.py`` says
  so, a stage 0-1 reduction starts as soon as its gradient is final, beside the rest of the
  backward, and the end of the backward waits for it); an optimizer step hook
  gathers the updated stage 1-2 shards into the compute weights (``loop.py``; beside the next
  forward where ``stores.py`` says so, waited for at the weight's first use); the forward
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

from memshard.core.graph import Graph, TensorKind
from memshard.core.placement import PARTIAL, REPLICATE, Layout, Partial, Shard
from memshard.problem.gathers import layer_units
from memshard.problem.memory import param_layout
from memshard.problem.records import Problem, Selection
from memshard.problem.storage import ready_order
from memshard.problem.strategies import Strategy, input_grad_layout
from memshard.runtime import checkpoint, loop, ops
from memshard.runtime.replay import LayerReplay, ReplayLinks, again_hooks, storage_id
from memshard.runtime.reshard import Reshard, local_of, reshard_local, to_torch, without_partial
from memshard.runtime.stores import GatherUnit, ParamStore, compute_dtype, made, reduction_buckets

INIT_STD = 0.02


def _key(name: str) -> str:
    return name.replace(".", "/")


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
                               in_unit, shard_dtype, in_pipeline=bool(graph.received or graph.sent))
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
        # on CUDA, where a gradient's all-reduce over a second axis waits for the first's
        # (``stores.start_all_reduces``): not the compute stream
        self.reduction_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # ZeRO-0 gradients all-reduced together, per bucket (``stores.reduction_buckets``)
        self.reduction_buckets = reduction_buckets(self.stores, ready_order(graph), graph.precision.reduce_bytes)
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

    def _local_gradient_arrived(self, store: ParamStore) -> None:
        """A stage 0-1 store's gradient is final for this backward: with gradient sync on, one
        that reduces beside the compute (``ParamStore.reduces_beside``) starts its reduction now,
        and the end of the backward finishes them all."""
        self.local_gradients = True
        if not self.requires_gradient_sync:
            return
        if not self.reduction_queued:
            self.reduction_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if store.reduces_beside:
            store.start_reduction(self.reduction_stream)

    def _end_of_backward(self) -> None:
        self.reduction_queued = False
        self.finish_gradients()

    def finish_gradients(self) -> None:
        """Reduce the stage 0-1 gradients now, if some wait (waiting for the all-reduces the
        backward started). The backward with gradient sync on does this when it ends; a loop
        that keeps gradient sync off may call it instead."""
        if not self.local_gradients:
            return
        self.local_gradients = False
        for store in self.stores.values():
            store.finish_gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The shards' gradients, and the stage 0-1 local gradients waiting to be reduced
        (with the all-reduces of a backward that raised before it ended)."""
        super().zero_grad(set_to_none)
        for store in self.stores.values():
            if store.unit is None and store.stage < 3:
                store.param.grad = None
                store.drop_started()
        self.local_gradients = False
        self.reduction_queued = False

    def gather_updated(self, held: set[int] = frozenset(), beside: bool = False) -> None:
        """Gather the shards updated since their last gather into the compute weights (ZeRO
        1-2): those changed through their parameters, and those of ids ``held`` (an optimizer's
        step updates its parameters in place); ``beside``: started beside the compute where the
        store can (``ParamStore.gather_updated``)."""
        for store in self.stores.values():
            store.gather_updated(force=id(store.opt) in held, beside=beside)

    def wait_gathered(self) -> None:
        """Wait for the gathers an optimizer step started beside the compute (before anything
        reads or writes the shards or the compute weights but the forward, which waits for
        each at its first use)."""
        for store in self.stores.values():
            store.wait_gathered()

    def after_step(self) -> None:
        """Gather the updated shards (an optimizer's step hook does this by itself)."""
        self.gather_updated()

    def check_optimizer(self, held: set[int], keeps_masters: bool = False) -> None:
        """Before a step of an optimizer holding the parameters of ids ``held`` (keeping fp32
        master weights of low-precision ones or not): raise if it cannot be right for this
        model (``loop.check_step``)."""
        params = list(self.parameters())  # (every optimizer step visits every registered model)
        mine = {id(p) for p in params}
        if held & mine:
            self.wait_gathered()  # (the step writes the shards that a running gather reads)
        has_gradients = self.local_gradients or any(p.grad is not None for p in params)
        low = set()
        if self.graph.precision.master_bytes and not keeps_masters:
            low = {id(p) for p in params if p.dtype != torch.float32}
        loop.check_step(self.source, held, mine, has_gradients, self.local_gradients, low)

    def after_optimizer_step(self, held: set[int]) -> None:
        """After a step of an optimizer holding the parameters of ids ``held``: if it holds
        this model's, gather the updated shards (beside the next forward where a store can) and
        move the step count on."""
        if any(id(p) in held for p in self.parameters()):
            self.gather_updated(held, beside=True)
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

