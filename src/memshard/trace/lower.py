"""An exported training forward (ATen graph) → memshard's graph IR.

Three passes over the FX graph:

1. **dims**: every tensor axis gets atoms (``dims.py``) by one rule per ATen op: views and
   transposes regroup or permute atoms, broadcasts and contractions unify them, ``split`` /
   ``slice`` / ``cat`` along an axis factor it into (pieces × piece). An op without a rule gets
   fresh atoms on its output.
2. **ops**: every node that depends on a parameter and computes (not a view) becomes an IR op
   over the *leaf* atoms, so a head split of a fused projection is a plain ``Shard`` of one leaf.
   What it saves for backward comes from running it on fake tensors (``probe.py``), except
   the two kernels that save differently on the GPUs we plan for (dropout keeps a 1-byte mask,
   fused attention keeps q, k, v, its output and the log-sum-exp). Nodes that depend on no
   parameter (masks, positions, shifted labels) are computed in full on every device: they are
   the IR's inputs. Ops without a description keep every dim whole (replicated) and are
   listed in ``Graph.meta["unknown_ops"]``.
3. **layers**: ops inside ``<container>.<i>.`` modules get ``layer = i`` and a role (their
   path and ordinal inside the layer); when all layers have the same roles and their dims
   correspond one to one, the ILP shares variables across layers as for the built-in models.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
from torch.fx import Node

from memshard.errors import MemshardError
from memshard.graph import Graph, Op, Operand, Precision, SavedBuffer, TensorKind, TensorSpec
from memshard.trace.dims import Atoms, DimConflict
from memshard.trace.export import WRAPPER_PREFIX
from memshard.trace.probe import ArgSpec, Saved, probe

VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze",
         "expand", "alias", "detach", "flatten", "unflatten", "contiguous", "clone", "to",
         "_to_copy", "type_as", "expand_as", "view_as"}
SKIP = {"_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_constrain_range_for_size"}
MATMULS = {"linear", "addmm", "mm", "bmm", "matmul"}
REDUCTIONS = {"sum", "mean"}  # a split reduced dim leaves a partial sum
DROPOUT_MASK_BYTES = 1  # native_dropout's bool mask (the CPU kernel keeps a float one)
LSE_BYTES = 4


@dataclass
class _Desc:
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
    index: int = 0  # select: which piece
    whole: bool = False  # an op without a rule: every dim stays whole
    item: int | None = None  # one output of a multi-output op without a rule


@dataclass(frozen=True)
class InputSlot:
    """An argument slot filled at run time with the op's input ``index`` (local shard)."""

    index: int


def _packet(node: Node) -> str:
    target = node.target
    if hasattr(target, "_overloadpacket"):
        return target._overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def _is_pointwise(node: Node) -> bool:
    return hasattr(node.target, "tags") and torch.Tag.pointwise in node.target.tags


def _tensor_args(node: Node) -> list[Node]:
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


class _Lowering:
    def __init__(self, ep: torch.export.ExportedProgram, name: str, precision: Precision):
        self.ep = ep
        self.name = name
        self.precision = precision
        sig = ep.graph_signature
        self.param_fqn = {k: _strip(v) for k, v in sig.inputs_to_parameters.items()}
        self.user_inputs = list(sig.user_inputs)
        self.atoms = Atoms()
        self.axes: dict[Node, object] = {}  # node → list of atom tuples (or a list of those)
        self.grad: dict[Node, bool] = {}
        self.base: dict[Node, Node] = {}  # view → the node that owns the data
        self.descs: dict[Node, _Desc] = {}
        self.unknown: Counter[str] = Counter()

    # -- pass 1: dims -------------------------------------------------------------------------
    def run_dims(self) -> None:
        for node in self.ep.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder":
                self.grad[node] = node.name in self.param_fqn
                if isinstance(val, torch.Tensor):
                    self.axes[node] = [self.atoms.axis(n) for n in val.shape]
                continue
            if node.op != "call_function":
                continue
            args = _tensor_args(node)
            packet = _packet(node)
            if packet == "getitem":
                args = [node.args[0]]
            self.grad[node] = any(self.grad.get(a, False) for a in args)
            if packet in SKIP or val is None:
                continue
            if packet == "getitem":
                parent, index = node.args
                self.axes[node] = self.axes[parent][index]
                up = self.descs.get(parent)
                if up is not None and up.whole:
                    self.descs[node] = _Desc(up.kind, whole=True, item=index)
                elif up is not None:
                    self.descs[node] = _Desc("select", unsplittable=up.unsplittable, index=index)
                continue
            try:
                out_axes, desc = self.rule(node, packet)
            except DimConflict:
                out_axes, desc = None, None
            if out_axes is None:
                if self.grad[node]:
                    self.unknown[f"aten.{packet}"] += 1
                vals = val if isinstance(val, (tuple, list)) else [val]
                fresh = [[self.atoms.axis(int(n)) for n in v.shape] for v in vals if isinstance(v, torch.Tensor)]
                out_axes = fresh if isinstance(val, (tuple, list)) else fresh[0]
                desc = _Desc(f"aten.{packet}", whole=True)
            self.axes[node] = out_axes
            if desc is None:  # a view: owns no data
                self.base[node] = self.base.get(args[0], args[0])
            else:
                self.descs[node] = desc

    def ax(self, node: Node) -> list[tuple[int, ...]]:
        return self.axes[node]

    def rule(self, node: Node, packet: str):
        """(output axes, description) of a node; description None for a view."""
        val = node.meta["val"]
        out_shape = list(val.shape) if isinstance(val, torch.Tensor) else None
        A = self.atoms
        args = node.args
        if packet in VIEWS:
            x = args[0]
            xa = self.ax(x)
            alias = torch._C._is_alias_of(val, x.meta["val"])
            if packet in ("transpose", "swapaxes"):
                d0, d1 = (_dim(d, len(xa)) for d in args[1:3])
                out = list(xa)
                out[d0], out[d1] = xa[d1], xa[d0]
            elif packet == "permute":
                out = [xa[_dim(d, len(xa))] for d in args[1]]
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
            return out, (None if alias else _Desc("copy"))
        if _is_pointwise(node):
            return self._broadcast(node, out_shape), _Desc(packet)
        if packet == "dropout":
            return list(self.ax(args[0])), _Desc(
                "dropout", flops_per_point=2.0,
                saved=Saved((), False, ((tuple(out_shape), DROPOUT_MASK_BYTES),)))
        if packet in MATMULS:
            return self._matmul(node, packet), _Desc(
                "linear" if any(a.name in self.param_fqn for a in _tensor_args(node)) else "matmul",
                flops_per_point=2.0, backward_flops_ratio=2.0)
        if packet == "embedding":
            w, ids = args[0], args[1]
            wa = self.ax(w)
            return [*self.ax(ids), wa[1]], _Desc("embedding", flops_per_point=0.0)
        if packet == "layer_norm":
            x, shape = args[0], args[1]
            xa = self.ax(x)
            k = len(shape)
            for extra in args[2:4]:
                if isinstance(extra, Node):
                    A.unify([a for ax in xa[-k:] for a in ax], [a for ax in self.ax(extra) for a in ax])
            reduced = tuple(a for ax in xa[-k:] for a in ax)
            return list(xa), _Desc("layernorm", reduced=reduced, stats_per_row=2, flops_per_point=8.0,
                                   backward_flops_ratio=2.0)
        if packet in ("_softmax", "softmax", "_log_softmax", "log_softmax"):
            xa = self.ax(args[0])
            d = _dim(args[1], len(xa))
            # The split kernel normalises the last dim; log-softmax keeps its dim whole.
            whole = tuple(xa[d]) if "log" in packet or d != len(xa) - 1 else ()
            return list(xa), _Desc("softmax" if "log" not in packet else "log_softmax",
                                   reduced=tuple(xa[d]), unsplittable=whole, stats_per_row=2, flops_per_point=5.0)
        if packet in REDUCTIONS:
            xa = self.ax(args[0])
            over = args[1] if len(args) > 1 and args[1] is not None else range(len(xa))  # .default: all
            dims = {_dim(d, len(xa)) for d in (over if isinstance(over, (list, tuple, range)) else [over])}
            keep = len(args) > 2 and args[2]
            out = [() if i in dims else ax for i, ax in enumerate(xa) if keep or i not in dims]
            return out, _Desc(packet)
        if packet == "cross_entropy_loss":
            logits, target = args[0], args[1]
            la, ta = self.ax(logits), self.ax(target)
            A.unify([a for ax in la[:1] + la[2:] for a in ax], [a for ax in ta for a in ax])
            # memshard's own kernel runs it (ops.SplitCrossEntropy): it keeps the logits and
            # labels, and makes one logits-sized buffer per pass (torch's keeps log-probabilities
            # and makes two in backward).
            return [], _Desc("cross_entropy", reduced=tuple(la[1]), stats_per_row=3, flops_per_point=5.0,
                             saved=Saved((0, 1), False, ()))
        if packet == "scaled_dot_product_attention":
            return self._sdpa(node)
        if packet in ("split", "split_with_sizes", "chunk", "unbind"):
            return self._split(node, packet)
        if packet in ("slice", "narrow"):
            return self._slice(node, packet)
        if packet == "cat":
            return self._cat(node)
        return None, None

    def _broadcast(self, node: Node, out_shape) -> list[tuple[int, ...]]:
        A = self.atoms
        out: list[tuple[int, ...] | None] = [None] * len(out_shape)
        for a in _tensor_args(node):
            xa = self.ax(a)
            pad = len(out_shape) - len(xa)
            for i, ax in enumerate(xa):
                p = i + pad
                if A.numel(ax) == 1 or A.numel(ax) != out_shape[p]:
                    continue
                if out[p] is None:
                    out[p] = ax
                else:
                    A.unify(out[p], ax)
        return [ax if ax is not None else A.axis(int(n)) for ax, n in zip(out, out_shape)]

    def _matmul(self, node: Node, packet: str) -> list[tuple[int, ...]]:
        A = self.atoms
        args = node.args
        if packet == "linear":
            x, w = self.ax(args[0]), self.ax(args[1])
            A.unify(x[-1], w[1])
            out = [*x[:-1], w[0]]
            if len(args) > 2 and isinstance(args[2], Node):
                A.unify(self.ax(args[2])[0], w[0])
            return out
        if packet == "addmm":
            bias, a, b = (self.ax(x) for x in args[:3])
            A.unify(a[1], b[0])
            out = [a[0], b[1]]
            pad = 2 - len(bias)
            for i, ax in enumerate(bias):
                if A.numel(ax) > 1:
                    A.unify(ax, out[i + pad])
            return out
        a, b = self.ax(args[0]), self.ax(args[1])
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

    def _sdpa(self, node: Node):
        A = self.atoms
        q, k, v = (self.ax(x) for x in node.args[:3])
        for x in (k, v):
            for i in range(len(q) - 2):
                A.unify(q[i], x[i])
        A.unify(q[-1], k[-1])
        A.unify(k[-2], v[-2])
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, Node):
            scores = [*q[:-1], k[-2]]
            ma = self.ax(mask)
            pad = len(scores) - len(ma)
            for i, ax in enumerate(ma):
                if A.numel(ax) > 1:
                    A.unify(ax, scores[i + pad])
        out = [*q[:-1], v[-1]]
        lse_shape = tuple(int(n) for n in node.meta["val"].shape[:-1])
        saved = Saved((0, 1, 2), True, ((lse_shape, LSE_BYTES),))
        key = tuple(k[-2])
        # is_causal masks by local positions: with the queries split it would mask wrongly
        causal = tuple(q[-2]) if node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5]) else ()
        return out, _Desc("sdpa", reduced=key, unsplittable=(*key, *q[-1], *v[-1], *causal), flops_per_point=4.0,
                          backward_flops_ratio=2.5, saved=saved, renamed=key, renamed_inputs=(1, 2, 3))

    def _pieces(self, axis: tuple[int, ...], pieces: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Factor ``axis`` into (pieces, piece) atoms."""
        A = self.atoms
        n = A.numel(axis)
        if pieces == 1:
            return (), axis
        if n % pieces:
            raise DimConflict("uneven pieces")
        outer, inner = A.axis(pieces), A.axis(n // pieces)
        A.unify(axis, (*outer, *inner))
        return outer, inner

    def _split(self, node: Node, packet: str):
        x = node.args[0]
        xa = self.ax(x)
        vals = node.meta["val"]
        if packet == "unbind":
            d = _dim(node.args[1] if len(node.args) > 1 else 0, len(xa))
        else:
            d = _dim(node.args[2] if len(node.args) > 2 else 0, len(xa))
        sizes = {int(v.shape[d]) for v in vals}
        if len(sizes) != 1:
            raise DimConflict("uneven split")
        outer, inner = (xa[d], ()) if packet == "unbind" else self._pieces(xa[d], len(vals))
        outs = []
        for _v in vals:
            ax = list(xa)
            if packet == "unbind":
                del ax[d]
            else:
                ax[d] = inner
            outs.append(ax)
        return outs, _Desc("select", unsplittable=tuple(outer))

    def _slice(self, node: Node, packet: str):
        x = node.args[0]
        xa = self.ax(x)
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
        outer, inner = self._pieces(xa[d], int(n_in[d]) // length)
        out = list(xa)
        out[d] = inner
        return out, _Desc("select", unsplittable=tuple(outer), index=start // length)

    def _cat(self, node: Node):
        tensors = node.args[0]
        d = node.args[1] if len(node.args) > 1 else 0
        axes = [self.ax(t) for t in tensors]
        nd = len(axes[0])
        d = _dim(d, nd)
        sizes = {self.atoms.numel(a[d]) for a in axes}
        if len(sizes) != 1 or any(len(a) != nd for a in axes):
            raise DimConflict("uneven cat")
        for a in axes[1:]:
            for i in range(nd):
                self.atoms.unify(axes[0][i], a[i])
        out = list(axes[0])
        outer = self.atoms.axis(len(tensors))
        out[d] = (*outer, *axes[0][d])
        return out, _Desc("cat", unsplittable=tuple(outer))

    # -- pass 2: ops --------------------------------------------------------------------------
    def leaves(self, node: Node) -> tuple[int, ...]:
        return self.atoms.leaves([a for ax in self.axes[node] for a in ax])

    def build(self) -> Graph:
        A = self.atoms
        tensors: dict[str, TensorSpec] = {}
        ops_raw: list[tuple[Node, _Desc, list[Node], Node]] = []
        ir_name: dict[Node, str] = {}
        loss_node = None
        for node in self.ep.graph.nodes:
            if node.op == "output":
                loss_node = self.base.get(node.args[0][0], node.args[0][0])
        if loss_node is None or not self.grad.get(loss_node, False):
            raise MemshardError("the loss does not depend on any parameter: nothing to train")

        def tensor_of(n: Node) -> str:
            n = self.base.get(n, n)
            if n in ir_name:
                return ir_name[n]
            val = n.meta["val"]
            if n.name in self.param_fqn:
                name, kind, nbytes = self.param_fqn[n.name], TensorKind.PARAMETER, self.precision.param_bytes
            elif self.grad[n]:
                raise AssertionError(f"activation {n.name} used before it is made")
            else:
                name, kind, nbytes = n.name, TensorKind.INPUT, val.element_size()
            shape = tuple(A.size[a] for a in self.leaves(n))
            tensors[name] = TensorSpec(name, shape, nbytes, kind)
            ir_name[n] = name
            return name

        for node in self.ep.graph.nodes:
            if node.op != "call_function" or node not in self.descs or not self.grad[node]:
                continue
            val = node.meta["val"]
            if isinstance(val, (tuple, list)):  # its getitems are the ops
                continue
            inputs = self._inputs(node)
            for a in inputs:
                tensor_of(a)
            ops_raw.append((node, self.descs[node], inputs, node))
            nbytes = val.element_size()
            name = node.name
            shape = tuple(A.size[a] for a in self.leaves(node))
            tensors[name] = TensorSpec(name, shape, nbytes, TensorKind.ACTIVATION)
            ir_name[node] = name

        specs: dict[str, dict] = {}
        synthetic: dict[str, tuple[str, int]] = {}
        layers = self._layers([n for n, *_ in ops_raw])
        names = self._dim_names(ops_raw, layers, share=True)
        if not self._consistent(ops_raw, layers, names):  # layers differ: plan each op on its own
            layers = {n: (lay, None, name) for n, (lay, _, name) in layers.items()}
            names = self._dim_names(ops_raw, layers, share=False)
        ops = []
        for node, desc, inputs, _ in ops_raw:
            layer, role, op_name = layers[node]
            operands = [self._operand(a, i, desc, names, ir_name) for i, a in enumerate(inputs)]
            output = Operand(ir_name[node], tuple(names[x] for x in self.leaves(node)))
            specs[op_name] = self._spec(node, desc, inputs, names)
            if desc.kind == "cross_entropy":  # the number of counted tokens, from the full labels
                count = f"{node.name}.tokens"
                tensors[count] = TensorSpec(count, (), 8, TensorKind.INPUT)
                operands.append(Operand(count, ()))
                synthetic[count] = (inputs[1].name, specs[op_name]["ignore_index"])
            op_dims = {d for o in (*operands, output) for d in o.dims}
            # A dim on two axes of one tensor (scores [b, n, s, s] of unfused attention) is two
            # different dims of the op that tracing cannot tell apart: it stays whole.
            doubled = {d for o in (*operands, output) for d, n in Counter(o.dims).items() if n > 1}
            unsplittable = (tuple(sorted(op_dims)) if desc.whole
                            else tuple(dict.fromkeys(
                                [d for d in (self._name(x, desc, names) for x in A.leaves(desc.unsplittable))
                                 if d in op_dims] + sorted(doubled))))
            saved = desc.saved if desc.saved is not None else self._probe(node, inputs)
            saves_inputs = tuple(
                i for i in saved.inputs
                if i < len(inputs) and tensors[operands[i].tensor].kind is TensorKind.ACTIVATION
            )
            buffers = tuple(
                SavedBuffer(f"{op_name}.saved{j}", *self._buffer_layout(shape, nbytes, node, inputs, names))
                for j, (shape, nbytes) in enumerate(saved.buffers)
            )
            ops.append(Op(
                name=op_name, kind=desc.kind, inputs=tuple(operands), output=output,
                reduced_dims=tuple(dict.fromkeys(self._name(x, desc, names) for x in A.leaves(desc.reduced))),
                unsplittable_dims=unsplittable, stats_per_row=desc.stats_per_row,
                saves_inputs=saves_inputs, saves_output=saved.output, buffers=buffers,
                flops_per_point=desc.flops_per_point, backward_flops_ratio=desc.backward_flops_ratio,
                layer=layer, role=role,
            ))
        num_layers = len({op.layer for op in ops if op.layer is not None})
        graph = Graph(
            name=self.name, tensors=tensors, ops=tuple(ops), loss=ir_name[loss_node],
            precision=self.precision, num_layers=num_layers,
            unknown_ops=dict(sorted(self.unknown.items())),
            traced={"program": self.ep, "aten": specs, "synthetic": synthetic,
                    "parameter_axes": {self.param_fqn[n.name]: self._torch_axes(n, names) for n in self._param_nodes()}},
        )
        return graph

    def _name(self, atom: int, desc: _Desc, names: dict[int, str]) -> str:
        renamed = self.atoms.leaves(desc.renamed)
        return names[atom] + "_k" if atom in renamed else names[atom]

    def _operand(self, a: Node, i: int, desc: _Desc, names: dict[int, str], ir_name: dict) -> Operand:
        base = self.base.get(a, a)
        return Operand(ir_name[base], tuple(d for ax in self._axis_names(base, i, desc, names) for d in ax))

    def _axis_names(self, a: Node, i: int, desc: _Desc, names: dict[int, str]) -> list[tuple[str, ...]]:
        """The op-local dim names of each torch axis of ``a`` (input ``i`` of the op)."""
        axes = [self.atoms.leaves(ax) for ax in self.axes[a]]
        renamed = set(self.atoms.leaves(desc.renamed)) if i in desc.renamed_inputs else set()
        # Rename only the last axis made of the key atoms (a mask [b, 1, s, s] keeps its rows).
        last = max((j for j, ax in enumerate(axes) if ax and set(ax) <= renamed), default=None)
        return [tuple(names[x] + ("_k" if j == last else "") for x in ax) for j, ax in enumerate(axes)]

    def _spec(self, node: Node, desc: _Desc, inputs: list[Node], names: dict[int, str]) -> dict:
        """How the runtime calls this op on local shards: the ATen target, its arguments with
        tensors as input indices, and the dims of every torch axis of the inputs and output."""
        index = {a: i for i, a in enumerate(inputs)}

        def template(x):
            if isinstance(x, Node):
                return InputSlot(index[x]) if x in index else x.meta.get("val")
            if isinstance(x, (list, tuple)):
                return type(x)(template(y) for y in x)
            return x

        source = self._source(node)
        spec = {
            "target": source.target if source is not None else None,
            "args": template(tuple(source.args)) if source is not None else (),
            "kwargs": {k: template(v) for k, v in source.kwargs.items()} if source is not None else {},
            "item": desc.item,
            "in_axes": [self._axis_names(a, i, desc, names) for i, a in enumerate(inputs)],
            "out_axes": [tuple(names[x] for x in self.atoms.leaves(ax)) for ax in self.axes[node]],
            "dtype": node.meta["val"].dtype,
            "index": desc.index,
            "pieces": tuple(names[x] for x in self.atoms.leaves(desc.unsplittable or ())),
            "sizes": {names[x]: self.atoms.size[x] for a in (*inputs, node) for ax in self.axes[a]
                      for x in self.atoms.leaves(ax)},
        }
        if desc.kind == "cross_entropy":
            args = list(node.args) + [None] * 6
            spec["reduction"] = node.kwargs.get("reduction", args[3] if args[3] is not None else 1)
            spec["ignore_index"] = node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
            smoothing = node.kwargs.get("label_smoothing", args[5] or 0.0)
            if node.kwargs.get("weight", args[2]) is not None or smoothing:
                spec["unsupported"] = "class weights or label smoothing"
        return spec

    def _param_nodes(self) -> list[Node]:
        return [n for n in self.ep.graph.nodes if n.op == "placeholder" and n.name in self.param_fqn
                and n.users]

    def _torch_axes(self, node: Node, names: dict[int, str]) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(names.get(a, "?") for a in self.atoms.leaves(ax)) for ax in self.axes[node])

    def _inputs(self, node: Node) -> list[Node]:
        """The tensors an op reads: a split's piece reads the split's input."""
        if _packet(node) != "getitem":
            return _tensor_args(node)
        parent = node.args[0]
        return _tensor_args(parent) if self.descs[node].item is not None else [parent.args[0]]

    def _source(self, node: Node) -> Node | None:
        """The node whose ATen call an op makes (none for a piece of a split)."""
        if _packet(node) != "getitem":
            return node
        return node.args[0] if self.descs[node].item is not None else None

    def _probe(self, node: Node, inputs: list[Node]) -> Saved:
        source = self._source(node)
        if source is None or self.descs[node].kind in ("select", "cat", "copy"):
            return Saved((), False, ())
        if source is not node and node is not next(iter(source.users)):
            return Saved((), False, ())  # a multi-output op's saved tensors go to its first output
        specs = []

        def placeholder(a):
            if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor):
                v = a.meta["val"]
                specs.append(ArgSpec(tuple(int(n) for n in v.shape), tuple(int(s) for s in v.stride()),
                                     v.dtype, bool(self.grad.get(a)) and v.is_floating_point()))
                return specs[-1]
            if isinstance(a, (list, tuple)):
                return type(a)(placeholder(x) for x in a)
            return a

        args = placeholder(tuple(source.args))
        kwargs = {k: placeholder(v) for k, v in source.kwargs.items() if k != "device"}
        saved = probe(source.target, args, kwargs, specs)
        return saved if saved is not None else Saved((), False, ())

    def _buffer_layout(self, shape, nbytes: int, node: Node, inputs: list[Node], names) -> tuple[tuple[str, ...], int]:
        """A saved buffer's dims: the axes of the output (or else of an input) that its axes are,
        in order, skipping some and merging neighbours (a batched matmul keeps ``[b·n, s, d]``
        copies of its ``[b, n, s, d]`` operands); else one opaque replicated blob."""
        want = [int(n) for n in shape if n != 1]
        for t in (node, *inputs):
            sizes = [int(n) for n in t.meta["val"].shape]
            dims: list[str] = []
            i = j = 0
            while j < len(want) and i < len(sizes):
                group, have = [], 1
                while i < len(sizes) and have < want[j] and want[j] % (have * sizes[i]) == 0:
                    group.append(i)
                    have *= sizes[i]
                    i += 1
                if have == want[j]:
                    dims.extend(names[a] for k in group for a in self.atoms.leaves(self.axes[t][k]))
                    j += 1
                elif not group:
                    i += 1  # an axis the buffer does not have
                else:
                    break
            if j == len(want):
                return tuple(dims), nbytes
        return (), nbytes * math.prod(shape)

    # -- pass 3: layers and names ---------------------------------------------------------------
    def _layers(self, nodes: list[Node]) -> dict[Node, tuple[int | None, str | None, str]]:
        out = {}
        counts: Counter = Counter()
        per_layer: dict[int, list[str]] = defaultdict(list)
        for node in nodes:
            stack = node.meta.get("nn_module_stack") or {}
            path = _strip(list(stack.values())[-1][0]) if stack else ""
            m = re.match(r"^(.*?)\.(\d+)(?:\.(.*))?$", path)
            packet = _packet(node)
            if packet == "getitem":
                item = self.descs[node].item
                packet = "select" if item is None else f"{_packet(node.args[0])}{item}"
            if m:
                layer, rel = int(m.group(2)), m.group(3) or ""
                key = (layer, rel, packet)
                role = f"{rel}/{packet}#{counts[key]}" if rel else f"{packet}#{counts[key]}"
                counts[key] += 1
                name = f"{m.group(1)}.{layer}.{role}"
                per_layer[layer].append(role)
                out[node] = (layer, role, name)
            else:
                key = (None, path, packet)
                base = f"{path}/{packet}" if path else packet
                out[node] = (None, None, f"{base}#{counts[key]}")
                counts[key] += 1
        first = min(per_layer) if per_layer else None
        if not all(r == per_layer[first] for r in per_layer.values()):
            out = {n: (lay, None, name) for n, (lay, _, name) in out.items()}
        return out

    def _dim_names(self, ops_raw, layers, share: bool) -> dict[int, str]:
        """Readable dim names; with ``share``, a layer's own dims take the names of the first
        layer's corresponding dims, so every copy of a role has the same dims (one set of ILP
        variables per role)."""
        A = self.atoms
        names: dict[int, str] = {}
        ids = next((n for n in self.ep.graph.nodes if n.op == "placeholder" and n.name in self.user_inputs), None)
        if ids is not None and len(self.axes.get(ids, [])) == 2:  # token ids: batch and sequence
            for letter, ax in zip("bs", self.axes[ids]):
                if len(A.leaves(ax)) == 1:
                    names[A.leaves(ax)[0]] = letter
        used = set(names.values())
        counter = iter(range(1 << 30))

        def fresh() -> str:
            name = f"d{next(counter)}"
            while name in used:
                name = f"d{next(counter)}"
            used.add(name)
            return name

        atoms_of = {node: [self.leaves(self.base.get(a, a)) for a in inputs] + [self.leaves(node)]
                    for node, _, inputs, _ in ops_raw}
        atom_layers: dict[int, set] = defaultdict(set)
        for node, per_operand in atoms_of.items():
            for atoms in per_operand:
                for a in atoms:
                    atom_layers[a].add(layers[node][0])
        first_of_role: dict[str, tuple[int, list]] = {}
        for node, per_operand in atoms_of.items():
            layer, role, _ = layers[node]
            ref_layer, ref = first_of_role.setdefault(role, (layer, per_operand)) if share and role else (layer, per_operand)
            for atoms, ref_atoms in zip(per_operand, ref):
                for a, r in zip(atoms, ref_atoms):
                    if a in names:
                        continue
                    local = r in names and atom_layers[r] == {ref_layer} and atom_layers[a] == {layer}
                    names[a] = names[r] if local and r != a else fresh()
        return names

    def _consistent(self, ops_raw, layers, names) -> bool:
        """Every copy of a role has the same dims, and no op has two dims of one name."""
        dims_of_role: dict[str, tuple] = {}
        for node, _, inputs, _ in ops_raw:
            per_operand = [self.leaves(self.base.get(a, a)) for a in inputs] + [self.leaves(node)]
            atoms = {a for atoms in per_operand for a in atoms}
            if len({names[a] for a in atoms}) != len(atoms):
                return False
            role = layers[node][1]
            dims = tuple(tuple(names[a] for a in atoms) for atoms in per_operand)
            if role is not None and dims_of_role.setdefault(role, dims) != dims:
                return False
        return True


def _strip(fqn: str) -> str:
    """A module path without the export wrapper's own name."""
    if fqn == WRAPPER_PREFIX.rstrip("."):
        return ""
    return fqn[len(WRAPPER_PREFIX):] if fqn.startswith(WRAPPER_PREFIX) else fqn


def lower(ep: torch.export.ExportedProgram, name: str, precision: Precision) -> Graph:
    """The graph IR of an exported training forward (see :func:`memshard.trace.trace_module`)."""
    lowering = _Lowering(ep, name, precision)
    lowering.run_dims()
    return lowering.build()
