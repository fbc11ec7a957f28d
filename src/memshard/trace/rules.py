"""The dims rule of each ATen op family: what a node's output axes are, and how it becomes an
IR op (:class:`Desc`).

A rule takes the pass's state (:class:`RuleState`: the atoms and every node's axes), the
node and its op packet name; it returns ``(output axes, Desc)``, ``Desc`` None for a view
(it owns no data), or raises :class:`~memshard.trace.dims.DimConflict`. Rules are registered
by packet name with :func:`rule`; :func:`rule_for` finds a node's. An op with no rule gets
fresh atoms and stays whole (``lower.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from memshard.core.graph import ACTIVATION_FLOPS_PER_POINT, LAYOUT_COPY
from memshard.trace.dims import Atoms, DimConflict
from memshard.trace.probe import Saved

VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze",
         "expand", "alias", "detach", "flatten", "unflatten", "contiguous", "clone", "to",
         "_to_copy", "type_as", "expand_as", "view_as"}
SKIP = {"_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_constrain_range_for_size"}
MATMULS = {"linear", "addmm", "mm", "bmm", "matmul"}
REDUCTIONS = {"sum", "mean"}  # a split reduced dim leaves a partial sum
SOFTMAXES = {"_softmax", "softmax", "_safe_softmax", "_log_softmax", "log_softmax"}
SPLITS = {"split", "split_with_sizes", "chunk", "unbind"}
DROPOUT_MASK_BYTES = 1  # native_dropout's bool mask (the CPU kernel keeps a float one)
LSE_BYTES = 4


@dataclass
class Desc:
    """How one node becomes an IR op."""

    kind: str
    reduced: tuple[int, ...] = ()  # atoms the op computes statistics over
    unsplittable: tuple[int, ...] = ()
    stats_per_row: int = 0
    flops_per_point: float = 1.0
    backward_flops_ratio: float = 1.0
    saved: Saved | None = None  # None: probe it
    # Inputs whose atoms ``renamed`` take another name inside this op: attention's keys run
    # over the same sequence as its queries but are a different dim of the op (``t``, not ``s``).
    renamed: tuple[int, ...] = ()
    renamed_inputs: tuple[int, ...] = ()
    # is_causal masks by local positions: split queries (the renamed atoms' own dims) would be
    # masked wrongly, so they stay whole too.
    causal: bool = False
    index: int = 0  # select: which piece
    whole: bool = False  # an op without a rule: every dim stays whole
    item: int | None = None  # one output of a multi-output op without a rule


@dataclass
class RuleState:
    """What the rules read and refine: the atoms, each node's axes (a list of atom tuples,
    or a list of those for a multi-output op), and which placeholders are parameters."""

    atoms: Atoms
    axes: dict[Node, Any]
    parameters: frozenset[str]

    def ax(self, node: Node) -> list[tuple[int, ...]]:
        return self.axes[node]


Axes = Any  # list[tuple[int, ...]], or a list of those
Rule = Callable[[RuleState, Node, str], "tuple[Axes, Desc | None]"]
RULES: dict[str, Rule] = {}


def rule(*packets: str) -> Callable[[Rule], Rule]:
    """Register a rule for the ATen op packets ``packets``."""

    def register(fn: Rule) -> Rule:
        for p in packets:
            RULES[p] = fn
        return fn

    return register


def rule_for(node: Node, packet: str) -> Rule | None:
    """The node's rule: any op tagged pointwise is one, except the views (``clone`` carries the
    tag but only copies); the rest by name."""
    if packet not in VIEWS and is_pointwise(node):
        return pointwise
    return RULES.get(packet)


# -- node helpers ---------------------------------------------------------------------------------
def packet_of(node: Node) -> str:
    target = node.target
    if hasattr(target, "_overloadpacket"):
        return target._overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def is_pointwise(node: Node) -> bool:
    return hasattr(node.target, "tags") and torch.Tag.pointwise in node.target.tags


def tensor_args(node: Node) -> list[Node]:
    out: list[Node] = []

    def visit(a):
        if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    for a in (*node.args, *node.kwargs.values()):
        visit(a)
    return out


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _out_shape(node: Node) -> list | None:
    val = node.meta["val"]
    return list(val.shape) if isinstance(val, torch.Tensor) else None


# -- the rules ------------------------------------------------------------------------------------
def _sdpa_output_regrouped(node: Node, packet: str) -> bool:
    """``attention.transpose(1, 2).contiguous()``, which eager PyTorch makes without a copy:
    the fused SDPA kernels (CPU flash, CUDA flash and memory-efficient) lay their output out
    as the query, heads inside sequence, so the transposed output is already contiguous (the
    exported program's meta kernel returns it contiguous the other way round). It becomes a
    :data:`LAYOUT_COPY` op: memshard's runtime copies there (its reshards lay a tensor out in
    its dims' order), the frameworks that run the eager module price it as a view."""
    if packet != "contiguous":
        return False
    x = node.args[0]
    if not (isinstance(x, Node) and packet_of(x) == "transpose" and sorted(x.args[1:3]) == [1, 2]):
        return False
    source = x.args[0]
    while isinstance(source, Node) and packet_of(source) in ("reshape", "view", "_unsafe_view") and \
            tuple(source.meta["val"].shape) == tuple(source.args[0].meta["val"].shape):
        source = source.args[0]  # a reshape to its own shape (transformers' attention does one)
    return isinstance(source, Node) and packet_of(source) == "scaled_dot_product_attention"


@rule(*VIEWS)
def view(s: RuleState, node: Node, packet: str):
    """Regroup or permute the input's atoms; a view that copies (``contiguous`` of a
    transposed tensor, a dtype cast) is a ``copy`` op."""
    A, x, out_shape = s.atoms, node.args[0], _out_shape(node)
    xa = s.ax(x)
    alias = torch._C._is_alias_of(node.meta["val"], x.meta["val"])
    if packet in ("transpose", "swapaxes"):
        d0, d1 = (_dim(d, len(xa)) for d in node.args[1:3])
        out = list(xa)
        out[d0], out[d1] = xa[d1], xa[d0]
    elif packet == "permute":
        out = [xa[_dim(d, len(xa))] for d in node.args[1]]
    elif packet == "t":
        out = list(reversed(xa))
    elif packet in ("expand", "expand_as"):
        out = []
        pad = len(out_shape) - len(xa)
        for p, n in enumerate(out_shape):
            src = xa[p - pad] if p >= pad else ()
            out.append(src if A.numel(src) == n else A.axis(n))
    elif [int(n) for n in out_shape] == [int(n) for n in x.meta["val"].shape]:
        out = list(xa)
    else:
        out = A.regroup(xa, [int(n) for n in out_shape])
    if alias:
        return out, None
    return out, Desc(LAYOUT_COPY if _sdpa_output_regrouped(node, packet) else "copy")


def pointwise(s: RuleState, node: Node, packet: str):
    """Broadcast: axes of the output's size unify across the inputs."""
    A, out_shape = s.atoms, _out_shape(node)
    out: list[tuple[int, ...] | None] = [None] * len(out_shape)
    for a in tensor_args(node):
        xa = s.ax(a)
        pad = len(out_shape) - len(xa)
        for i, ax in enumerate(xa):
            p = i + pad
            if A.numel(ax) == 1 or A.numel(ax) != out_shape[p]:
                continue
            if out[p] is None:
                out[p] = ax
            else:
                A.unify(out[p], ax)
    return ([ax if ax is not None else A.axis(int(n)) for ax, n in zip(out, out_shape)],
            Desc(packet, flops_per_point=ACTIVATION_FLOPS_PER_POINT.get(packet, 1.0)))


@rule("dropout")
def dropout(s: RuleState, node: Node, packet: str):
    """Keeps a mask, except at p = 0 (or not training): torch returns its input then."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    if p == 0 or not train:
        return list(s.ax(node.args[0])), None
    mask = Saved((), False, ((tuple(_out_shape(node)), DROPOUT_MASK_BYTES),))
    return list(s.ax(node.args[0])), Desc("dropout", flops_per_point=2.0, saved=mask)


@rule("native_dropout")
def native_dropout(s: RuleState, node: Node, packet: str):
    """``dropout`` as its fused kernel runs on CPU and CUDA tensors (a trace on CPU tensors
    records it): the output, its op, and the mask it keeps (``dropout``'s)."""
    p = node.args[1]
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    axes = list(s.ax(node.args[0]))
    kept = () if p == 0 or train is False else ((tuple(int(n) for n in node.meta["val"][0].shape), DROPOUT_MASK_BYTES),)
    return [axes, list(axes)], Desc("dropout", flops_per_point=2.0, saved=Saved((), False, kept), item=0)


@rule(*MATMULS)
def matmul(s: RuleState, node: Node, packet: str):
    """A contraction: ``linear`` when it reads a parameter, else ``matmul``."""
    out = {"linear": _linear, "addmm": _addmm}.get(packet, _batched)(s, node)
    kind = "linear" if any(a.name in s.parameters for a in tensor_args(node)) else "matmul"
    return out, Desc(kind, flops_per_point=2.0, backward_flops_ratio=2.0)


def _linear(s: RuleState, node: Node) -> list[tuple[int, ...]]:
    args = node.args
    x, w = s.ax(args[0]), s.ax(args[1])
    s.atoms.unify(x[-1], w[1])
    if len(args) > 2 and isinstance(args[2], Node):
        s.atoms.unify(s.ax(args[2])[0], w[0])
    return [*x[:-1], w[0]]


def _addmm(s: RuleState, node: Node) -> list[tuple[int, ...]]:
    A = s.atoms
    bias, a, b = (s.ax(x) for x in node.args[:3])
    A.unify(a[1], b[0])
    out = [a[0], b[1]]
    pad = 2 - len(bias)
    for i, ax in enumerate(bias):
        if A.numel(ax) > 1:
            A.unify(ax, out[i + pad])
    return out


def _batched(s: RuleState, node: Node) -> list[tuple[int, ...]]:
    """mm, bmm, matmul: the batch dims broadcast, the inner dims contract."""
    A = s.atoms
    a, b = s.ax(node.args[0]), s.ax(node.args[1])
    if len(a) < 2 or len(b) < 2:
        raise DimConflict("vector matmul")
    A.unify(a[-1], b[-2])
    batch_a, batch_b = a[:-2], b[:-2]
    n = max(len(batch_a), len(batch_b))
    batch = []
    for i in range(n):
        xa = batch_a[i - (n - len(batch_a))] if i >= n - len(batch_a) else ()
        xb = batch_b[i - (n - len(batch_b))] if i >= n - len(batch_b) else ()
        if A.numel(xa) > 1 and A.numel(xb) > 1:
            A.unify(xa, xb)
        batch.append(xa if A.numel(xa) > 1 else xb)
    return [*batch, a[-2], b[-1]]


@rule("embedding")
def embedding(s: RuleState, node: Node, packet: str):
    w, ids = node.args[0], node.args[1]
    return [*s.ax(ids), s.ax(w)[1]], Desc("embedding", flops_per_point=0.0)


@rule("layer_norm")
def layer_norm(s: RuleState, node: Node, packet: str):
    x, shape = node.args[0], node.args[1]
    xa = s.ax(x)
    k = len(shape)
    for extra in node.args[2:4]:  # weight and bias run over the normalised dims
        if isinstance(extra, Node):
            s.atoms.unify([a for ax in xa[-k:] for a in ax], [a for ax in s.ax(extra) for a in ax])
    reduced = tuple(a for ax in xa[-k:] for a in ax)
    return list(xa), Desc("layernorm", reduced=reduced, stats_per_row=2, flops_per_point=8.0,
                          backward_flops_ratio=2.0)


@rule(*SOFTMAXES)
def softmax(s: RuleState, node: Node, packet: str):
    xa = s.ax(node.args[0])
    d = _dim(node.args[1], len(xa))
    # The split kernel normalises the last dim; log-softmax keeps its dim whole.
    whole = tuple(xa[d]) if "log" in packet or d != len(xa) - 1 else ()
    return list(xa), Desc("softmax" if "log" not in packet else "log_softmax",
                          reduced=tuple(xa[d]), unsplittable=whole, stats_per_row=2, flops_per_point=5.0)


@rule(*REDUCTIONS)
def reduction(s: RuleState, node: Node, packet: str):
    args = node.args
    xa = s.ax(args[0])
    over = args[1] if len(args) > 1 and args[1] is not None else range(len(xa))  # .default: all
    dims = {_dim(d, len(xa)) for d in (over if isinstance(over, (list, tuple, range)) else [over])}
    keep = len(args) > 2 and args[2]
    out = [() if i in dims else ax for i, ax in enumerate(xa) if keep or i not in dims]
    return out, Desc(packet)


@rule("cross_entropy_loss")
def cross_entropy(s: RuleState, node: Node, packet: str):
    logits, target = node.args[0], node.args[1]
    la, ta = s.ax(logits), s.ax(target)
    s.atoms.unify([a for ax in la[:1] + la[2:] for a in ax], [a for ax in ta for a in ax])
    # memshard's own kernel runs it (ops.SplitCrossEntropy): it keeps the logits and labels,
    # and makes one logits-sized buffer per pass (torch's keeps log-probabilities and makes
    # two in backward).
    return [], Desc("cross_entropy", reduced=tuple(la[1]), stats_per_row=3, flops_per_point=5.0,
                    saved=Saved((0, 1), False, ()))


@rule("scaled_dot_product_attention")
def sdpa(s: RuleState, node: Node, packet: str):
    A = s.atoms
    q, k, v = (s.ax(x) for x in node.args[:3])
    # Grouped-query attention: query head i reads key/value head i // (query heads per
    # key/value head), so the query heads are (key/value heads × group), in that order.
    gqa = bool(node.kwargs.get("enable_gqa")) and len(q) > 2 and A.numel(q[-3]) != A.numel(k[-3])
    kv_heads = _pieces(s, q[-3], A.numel(k[-3]))[0] if gqa else ()
    for x in (k, v):
        for i in range(len(q) - 2):
            A.unify(kv_heads if gqa and i == len(q) - 3 else q[i], x[i])
    A.unify(q[-1], k[-1])
    A.unify(k[-2], v[-2])
    if A.numel(v[-1]) == A.numel(q[-1]):  # one head dim: the iteration space runs over it once
        A.unify(q[-1], v[-1])
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, Node):
        scores = [*q[:-1], k[-2]]
        ma = s.ax(mask)
        pad = len(scores) - len(ma)
        for i, ax in enumerate(ma):
            if A.numel(ax) > 1:
                A.unify(ax, scores[i + pad])
    out = [*q[:-1], v[-1]]
    lse_shape = tuple(int(n) for n in node.meta["val"].shape[:-1])
    saved = Saved((0, 1, 2), True, ((lse_shape, LSE_BYTES),))
    key = tuple(k[-2])
    causal = bool(node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5]))
    return out, Desc("sdpa", reduced=key, unsplittable=(*key, *q[-1], *v[-1]), flops_per_point=4.0,
                     backward_flops_ratio=2.5, saved=saved, renamed=key, renamed_inputs=(1, 2, 3),
                     causal=causal)


def _pieces(s: RuleState, axis: tuple[int, ...], pieces: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Factor ``axis`` into (pieces, piece) atoms."""
    A = s.atoms
    n = A.numel(axis)
    if pieces == 1:
        return (), axis
    if n % pieces:
        raise DimConflict("uneven pieces")
    outer, inner = A.axis(pieces), A.axis(n // pieces)
    A.unify(axis, (*outer, *inner))
    return outer, inner


@rule("repeat_interleave")
def repeat_interleave(s: RuleState, node: Node, packet: str):
    """Each slice along one axis repeated ``r`` times in a row (the math attention path's keys
    and values, repeated to the query's heads): that axis becomes (its atoms × r), a copy."""
    x, repeats = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not isinstance(x, Node) or not isinstance(repeats, int) or d is None:
        raise DimConflict("repeat_interleave without one int repeat along one dim")
    out = list(s.ax(x))
    d = _dim(d, len(out))
    copies = s.atoms.axis(repeats)
    out[d] = (*out[d], *copies)
    # the call makes all ``repeats`` copies: that atom stays whole here
    return out, Desc("copy", unsplittable=tuple(copies))


@rule(*SPLITS)
def split(s: RuleState, node: Node, packet: str):
    """Equal pieces along one axis: (pieces × piece); each output is one piece (its
    ``getitem`` a ``select`` op)."""
    xa = s.ax(node.args[0])
    vals = node.meta["val"]
    if packet == "unbind":
        d = _dim(node.args[1] if len(node.args) > 1 else 0, len(xa))
    else:
        d = _dim(node.args[2] if len(node.args) > 2 else 0, len(xa))
    if len({int(v.shape[d]) for v in vals}) != 1:
        raise DimConflict("uneven split")
    outer, inner = (xa[d], ()) if packet == "unbind" else _pieces(s, xa[d], len(vals))
    outs = []
    for _v in vals:
        ax = list(xa)
        if packet == "unbind":
            del ax[d]
        else:
            ax[d] = inner
        outs.append(ax)
    return outs, Desc("select", unsplittable=tuple(outer))


@rule("slice", "narrow")
def slice_(s: RuleState, node: Node, packet: str):
    """A regular slice is one piece of (pieces × piece); a full one is a view."""
    x = node.args[0]
    xa = s.ax(x)
    n_in = x.meta["val"].shape
    if packet == "slice":
        d = _dim(node.args[1] if len(node.args) > 1 else 0, len(xa))
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else n_in[d]
        step = node.args[4] if len(node.args) > 4 else 1
        start = start or 0
        end = min(int(end if end is not None else n_in[d]), int(n_in[d]))
    else:
        d = _dim(node.args[1], len(xa))
        start, end, step = node.args[2], node.args[2] + node.args[3], 1
    length = end - start
    if step != 1 or length <= 0 or n_in[d] % length or start % length:
        raise DimConflict("irregular slice")
    if length == n_in[d]:
        return list(xa), None
    outer, inner = _pieces(s, xa[d], int(n_in[d]) // length)
    out = list(xa)
    out[d] = inner
    return out, Desc("select", unsplittable=tuple(outer), index=start // length)


@rule("cat")
def cat(s: RuleState, node: Node, packet: str):
    """Equal pieces joined along one axis: (pieces × piece), the inputs' other dims unified."""
    tensors = node.args[0]
    d = node.args[1] if len(node.args) > 1 else 0
    axes = [s.ax(t) for t in tensors]
    nd = len(axes[0])
    d = _dim(d, nd)
    sizes = {s.atoms.numel(a[d]) for a in axes}
    if len(sizes) != 1 or any(len(a) != nd for a in axes):
        raise DimConflict("uneven cat")
    for a in axes[1:]:
        for i in range(nd):
            s.atoms.unify(axes[0][i], a[i])
    out = list(axes[0])
    outer = s.atoms.axis(len(tensors))
    out[d] = (*outer, *axes[0][d])
    return out, Desc("cat", unsplittable=tuple(outer))
