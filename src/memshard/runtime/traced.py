"""Running a traced module under a plan: each IR op calls its own ATen op on local shards.

A traced graph (``memshard.trace``) keeps, per op, the ATen call it came from and the dims of
every torch axis of its arguments (``graph.traced.aten``: ``memshard.trace.program.AtenCall``).
The executor of ``executor.py`` runs it like a built-in model (same parameter stores, reshards
at op boundaries, ZeRO stages) with this module's kernel table (``KERNELS``, which
``TracedReference`` hands it): a local IR tensor (one axis per dim) is
viewed as the op's torch argument (dims permuted, broadcast dims expanded, neighbours merged),
the ATen op runs, and its result is viewed back. That is a rewritten GraphModule, one op per
IR op, so the plan maps to code one to one. Ops whose result is not a local function of local
pieces get the split kernels of ``ops.py``: norms and softmax over a split dim, a
vocab-split embedding or cross-entropy, a contraction's bias added once, mean as a partial
sum; dropout draws its mask from the global element index (the same in every sharding).

Inputs that depend on no parameter (masks, positions, shifted labels) are computed in full
on every device from the user's arguments, by the exported program's own nodes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from memshard.core.graph import LAYOUT_COPY, Graph, TensorKind
from memshard.runtime import ops
from memshard.runtime.executor import ShardedGraphModel, Shares
from memshard.trace.export import WRAPPER_PREFIX
from memshard.trace.program import AtenCall, InputSlot


# -- local tensors ⇄ ATen arguments --------------------------------------------------------------
def _size_of(ctx: ops.OpContext, spec: AtenCall):
    local = ctx.strategy.local_sizes
    return lambda d: local.get(d, spec.sizes.get(d, ctx.sizes.get(d)))


def to_arg(x: torch.Tensor, dims: tuple[str, ...], axes, size_of) -> torch.Tensor:
    """View local ``x`` (one axis per dim of ``dims``) as a torch argument whose axes are the
    dim groups ``axes``: permute, expand broadcast dims, merge each group."""
    flat = [d for ax in axes for d in ax]
    present = [d for d in flat if d in dims]
    y = x.permute(*[dims.index(d) for d in present]) if present != list(dims) else x
    for k, d in enumerate(flat):
        if d not in dims:
            y = y.unsqueeze(k)
    y = y.expand(*[size_of(d) for d in flat]) if len(present) < len(flat) else y
    shape = [math.prod(size_of(d) for d in ax) for ax in axes]
    return y.reshape(shape) if list(y.shape) != shape else y


def from_out(y: torch.Tensor, axes, size_of) -> torch.Tensor:
    """An ATen result with axes ``axes`` as a local IR tensor (one axis per dim)."""
    shape = [size_of(d) for ax in axes for d in ax]
    return y.reshape(shape) if list(y.shape) != shape else y


def _fill(x, args: list[torch.Tensor], device):
    if isinstance(x, InputSlot):
        return args[x.index]
    if isinstance(x, torch.device):
        return device
    if isinstance(x, (list, tuple)):
        return type(x)(_fill(y, args, device) for y in x)
    return x


def _call(ctx: ops.OpContext, xs, target=None, **overrides):
    spec = ctx.graph.traced.aten[ctx.op.name]
    size_of = _size_of(ctx, spec)
    args = [to_arg(x, ctx.op.inputs[j].dims, spec.in_axes[j], size_of) for j, x in enumerate(xs)
            if j < len(spec.in_axes)]
    call_args = _fill(spec.args, args, ctx.device)
    call_kwargs = {k: _fill(v, args, ctx.device) for k, v in spec.kwargs.items()}
    call_kwargs.update(overrides)
    out = (target or spec.target)(*call_args, **call_kwargs)
    if spec.item is not None:  # one output of a multi-output op
        out = out[spec.item]
    return from_out(out, spec.out_axes, size_of)


# -- kernels ---------------------------------------------------------------------------------
def generic(ctx, *xs):
    return _call(ctx, xs)


def linear(ctx, *xs):
    """A contraction with a parameter: a split contracted dim leaves a partial sum, so the
    bias is added on one rank of those axes (zero elsewhere, keeping it in every autograd graph)."""
    spec = ctx.graph.traced.aten[ctx.op.name]
    root = float(ctx.is_root_of(ctx.op.contracted_dims))
    name = str(spec.target)
    if name.startswith("aten.addmm"):
        # scale the (small) bias, not addmm's beta (or add's alpha below): for a factor ≠ 1
        # their backward makes a scaled copy of the whole output gradient
        return _call(ctx, (xs[0] * root, *xs[1:])) if root != 1 else _call(ctx, xs)
    if name.startswith("aten.linear") and len(xs) == 3:
        y = _call(ctx, xs, target=lambda x, w, b: F.linear(x, w))  # the bias below, once
        bias = to_arg(xs[2], ctx.op.inputs[2].dims, [(d,) for d in ctx.op.output.dims if d in ctx.op.inputs[2].dims],
                      _size_of(ctx, spec))
        return y + _broadcast(bias * root, ctx.op.inputs[2].dims, ctx.op.output.dims)
    return _call(ctx, xs)


def _broadcast(t, dims, out_dims):
    order = [d for d in out_dims if d in dims]
    return t.reshape([t.shape[order.index(d)] if d in order else 1 for d in out_dims])


def embedding(ctx, weight, ids):
    v = ctx.op.inputs[0].dims[0]
    if not ctx.split_axes((v,)):
        return _call(ctx, (weight, ids))
    lo, n = ctx.dim_range(v)
    inside = (ids >= lo) & (ids < lo + n)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids))
    return _call(ctx, (weight, local)) * inside.unsqueeze(-1)


def layer_norm(ctx, x, weight=None, bias=None):
    spec = ctx.graph.traced.aten[ctx.op.name]
    h = ctx.op.reduced_dims
    axes = ctx.split_axes(h)
    k = len(spec.args[1])
    eps = spec.args[4] if len(spec.args) > 4 else 1e-5
    size_of = _size_of(ctx, spec)
    xa = to_arg(x, ctx.op.inputs[0].dims, spec.in_axes[0], size_of)
    if not axes:
        y = F.layer_norm(xa, xa.shape[-k:], _arg(ctx, weight, 1), _arg(ctx, bias, 2), eps)
    else:
        if k != 1:
            raise NotImplementedError("a split LayerNorm over several dims")
        n = math.prod(ctx.sizes[d] for d in h)
        y = ops.SplitNorm.apply(xa, _arg(ctx, weight, 1), _arg(ctx, bias, 2), n,
                                tuple(ctx.groups[a] for a in axes), False, eps)
    return from_out(y, spec.out_axes, size_of)


def _arg(ctx, x, j):
    if x is None:
        return None
    spec = ctx.graph.traced.aten[ctx.op.name]
    return to_arg(x, ctx.op.inputs[j].dims, spec.in_axes[j], _size_of(ctx, spec))


def softmax(ctx, x):
    axes = ctx.split_axes(ctx.op.reduced_dims)
    if not axes:
        return _call(ctx, (x,))
    spec = ctx.graph.traced.aten[ctx.op.name]
    size_of = _size_of(ctx, spec)
    y = ops.SplitSoftmax.apply(to_arg(x, ctx.op.inputs[0].dims, spec.in_axes[0], size_of), 0.0,
                               tuple(ctx.groups[a] for a in axes))
    return from_out(y, spec.out_axes, size_of)


def mean(ctx, x):
    """A sum divided by the global count: with the reduced dims split, a partial sum."""
    spec = ctx.graph.traced.aten[ctx.op.name]
    axes = spec.in_axes[0]
    over = spec.args[1] if len(spec.args) > 1 and spec.args[1] is not None else range(len(axes))
    over = [over] if isinstance(over, int) else list(over)
    keep = bool(spec.args[2]) if len(spec.args) > 2 else False
    count = math.prod(spec.sizes[d] for i in over for d in axes[i])
    size_of = _size_of(ctx, spec)
    y = to_arg(x, ctx.op.inputs[0].dims, axes, size_of).sum([i % len(axes) for i in over], keepdim=keep) / count
    return from_out(y, spec.out_axes, size_of)


def cross_entropy(ctx, logits, labels, tokens):
    spec = ctx.graph.traced.aten[ctx.op.name]
    if spec.unsupported is not None:
        raise NotImplementedError(f"cross-entropy with {spec.unsupported}")
    size_of = _size_of(ctx, spec)
    la = to_arg(logits, ctx.op.inputs[0].dims, spec.in_axes[0], size_of)
    ta = to_arg(labels, ctx.op.inputs[1].dims, spec.in_axes[1], size_of)
    if la.dim() > 2:  # [N, C, d…] → rows last
        la = la.movedim(1, -1).reshape(-1, la.shape[1])
        ta = ta.reshape(-1)
    scale = 1.0 / tokens.clamp(min=1).to(la.dtype) if spec.reduction == 1 else 1.0
    v = ctx.op.reduced_dims
    axes = ctx.split_axes(v)
    v0, _ = ctx.dim_range(v[0])
    return ops.SplitCrossEntropy.apply(la, ta, v0, tuple(ctx.groups[a] for a in axes), scale, spec.ignore_index)


def dropout(ctx, x):
    spec = ctx.graph.traced.aten[ctx.op.name]
    p = float(spec.args[1]) if len(spec.args) > 1 else 0.5
    train = bool(spec.args[2]) if len(spec.args) > 2 else True
    size_of = _size_of(ctx, spec)
    x = to_arg(x, ctx.op.inputs[0].dims, [(d,) for d in ctx.op.output.dims], size_of)
    return ops.dropout(ctx, x, p if train else 0.0)


def select(ctx, x):
    """One piece of a split / slice, as a new tensor (the IR prices it as one)."""
    spec = ctx.graph.traced.aten[ctx.op.name]
    dims = ctx.op.inputs[0].dims
    piece = spec.pieces[0]
    y = x.select(dims.index(piece), spec.index)
    rest = [d for d in dims if d != piece]
    return to_arg(y, tuple(rest), [(d,) for d in ctx.op.output.dims], _size_of(ctx, spec)).clone(
        memory_format=torch.contiguous_format)


def cat(ctx, *xs):
    spec = ctx.graph.traced.aten[ctx.op.name]
    out = ctx.op.output.dims
    piece = spec.pieces[0]
    rest = [(d,) for d in out if d != piece]
    size_of = _size_of(ctx, spec)
    parts = [to_arg(x, ctx.op.inputs[j].dims, rest, size_of) for j, x in enumerate(xs)]
    return torch.stack(parts, out.index(piece))


def copy(ctx, x):
    """A materialised view (contiguous, reshape of an expanded tensor, dtype cast)."""
    spec = ctx.graph.traced.aten[ctx.op.name]
    view = to_arg(x, ctx.op.inputs[0].dims, [(d,) for d in ctx.op.output.dims], _size_of(ctx, spec))
    out = torch.empty(view.shape, dtype=spec.dtype, device=view.device)
    return out.copy_(view)


KERNELS = ops.KernelTable({  # every other kind, unknown ones included, calls its ATen op
    "linear": linear,
    "embedding": embedding,
    "layernorm": layer_norm,
    "softmax": softmax,
    "mean": mean,
    "cross_entropy": cross_entropy,
    "dropout": dropout,
    "select": select,
    "cat": cat,
    "copy": copy,
    LAYOUT_COPY: copy,
}, default=generic)


# -- the module's parameters, buffers and parameter-free inputs ----------------------------------
class TracedReference:
    """What :class:`ShardedGraphModel` reads from a reference model: each parameter of the
    module (by FQN) viewed in its IR shape, the seed (for dropout masks) and this module's
    kernels."""

    kernels = KERNELS

    def __init__(self, graph: Graph, module: nn.Module, seed: int = 0):
        self.graph = graph
        self.seed = seed
        self.module = module
        self.params = dict(module.named_parameters(remove_duplicate=False))

    def parameter(self, name: str) -> torch.Tensor:
        return self.params[name].reshape(self.graph.tensors[name].shape)

    def module_shape(self, name: str) -> tuple[int, ...]:
        """The parameter's shape in the module (a state dict's), not the IR's."""
        return tuple(self.params[name].shape)


def _flatten_inputs(ep, args: tuple, kwargs: dict) -> list:
    spec = ep.call_spec.in_spec
    kw = spec.child(1) if spec is not None and spec.num_children == 2 else None
    if kw is not None and kw.context is not None:
        order = list(kw.context)
        missing = [k for k in order if k not in kwargs]
        if missing:
            raise TypeError(f"missing keyword arguments: {', '.join(missing)}")
        kwargs = {k: kwargs[k] for k in order}
    return pytree.tree_leaves((tuple(args), kwargs))


@torch.no_grad()
def constant_inputs(graph: Graph, buffers: dict, args: tuple, kwargs: dict, device) -> dict[str, torch.Tensor]:
    """The graph's INPUT tensors for one call, computed in full by the exported program's
    parameter-free nodes (on ``device``) from the call's arguments and the module's buffers.
    A made input (``graph.made_inputs``: a causal mask built from nothing) is a
    :class:`MadeInput`, made where an op reads it, as the eager module makes it there."""
    ep = graph.traced.program
    sig = ep.graph_signature
    params = set(sig.inputs_to_parameters)
    user = iter(_flatten_inputs(ep, args, kwargs))
    env: dict = {}
    grad: set = set()
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in params:
                grad.add(node)
            elif node.name in sig.inputs_to_buffers:
                env[node] = buffers[sig.inputs_to_buffers[node.name][len(WRAPPER_PREFIX):]].to(device)
            elif node.name in sig.inputs_to_lifted_tensor_constants:
                env[node] = ep.constants[sig.inputs_to_lifted_tensor_constants[node.name]].to(device)
            else:
                env[node] = next(user).to(device)
        elif node.op == "call_function":
            if any(a in grad for a in node.all_input_nodes):
                grad.add(node)
            else:
                env[node] = _run_node(node, env, device)
    by_name = {n.name: v for n, v in env.items()}
    by_node = {n.name: n for n in env}
    out = {}
    for name, spec in graph.tensors.items():
        if spec.kind is not TensorKind.INPUT:
            continue
        count = graph.traced.synthetic.get(name)
        if count is not None:
            out[name] = (by_name[count.labels] != count.ignore_index).sum()
        elif name in graph.made_inputs:
            out[name] = MadeInput(_ancestors(by_node[name], list(ep.graph.nodes)), spec.shape, device)
        else:
            out[name] = by_name[name].reshape(spec.shape)
    return out


def _run_node(node: torch.fx.Node, env: dict, device):
    def value(a):  # traced on meta: constants are made on the run's device
        return env[a] if isinstance(a, torch.fx.Node) else (device if isinstance(a, torch.device) else a)

    return node.target(*pytree.tree_map(value, node.args), **pytree.tree_map(value, dict(node.kwargs)))


def _ancestors(node: torch.fx.Node, order: list) -> list:
    """``node`` and the nodes it is computed from (for a made input: from no placeholder), in
    ``order``."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in order if n in seen]


class MadeInput:
    """An input the module's code makes from nothing (``graph.made_inputs``): called, it runs
    the program's nodes up to it and returns the tensor, which lives as long as its reader
    holds it."""

    def __init__(self, nodes: list, shape: tuple[int, ...], device):
        self.nodes, self.shape, self.device = nodes, shape, device

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        env: dict = {}
        uses = {n: sum(u in self.nodes for u in n.users) for n in self.nodes}
        for node in self.nodes:
            env[node] = _run_node(node, env, self.device)
            for a in node.all_input_nodes:  # dropped after their last use, as eager code drops them
                uses[a] -= 1
                if not uses[a]:
                    del env[a]
        return env[self.nodes[-1]].reshape(self.shape)


class ShardedTracedModel(ShardedGraphModel):
    """A traced module on one rank under a plan; called like the module (its loss)."""

    def __init__(self, reference: TracedReference, problem, selection, device_mesh):
        super().__init__(reference, problem, selection, device_mesh)
        # Only the module's buffers (rotary frequencies) are kept, for the constants: its
        # parameters now live in this model's shards.
        self.module_buffers = {n: b.to(self.device) for n, b in reference.module.named_buffers(remove_duplicate=False)}

    def shares(self, *args, **kwargs) -> Shares:
        """This rank's share of the graph inputs of a call with the module's arguments."""
        return super().shares(constant_inputs(self.graph, self.module_buffers, args, kwargs, self.device))

    def forward(self, *args, **kwargs):
        if len(args) == 1 and isinstance(args[0], Shares) and not kwargs:
            return super().forward(args[0])
        return super().forward(self.shares(*args, **kwargs))


def make_batch(graph: Graph, micro_batches: int, seed: int, device="cpu") -> list[tuple[tuple, dict]]:
    """Random arguments for the traced module, per micro-batch: integer inputs (token ids,
    labels) below the first embedding's row count, floats standard normal; same on every rank."""
    ep = graph.traced.program
    sig = ep.graph_signature
    vocab = next((graph.tensors[op.inputs[0].tensor].shape[0] for op in graph.ops if op.kind == "embedding"), 2)
    vals = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in sig.user_inputs]
    out = []
    for k in range(micro_batches):
        gen = torch.Generator().manual_seed(seed * 1009 + k)
        leaves = [torch.randint(0, vocab, v.shape, generator=gen) if not v.is_floating_point()
                  else torch.randn(v.shape, generator=gen, dtype=v.dtype) for v in vals]
        args, kwargs = pytree.tree_unflatten([t.to(device) for t in leaves], ep.call_spec.in_spec)
        out.append((tuple(args), dict(kwargs)))
    return out
